"""Findings grouped for reading: one group per check and severity, its layers listed once (collapsed where
they share a prefix), the range of its headline figure, and one fix line that covers the whole group.

A model of a hundred norm layers trained at a small batch gets a hundred findings that say the same thing
about different layers; the reader needs to see *which* layers (where in the depth), *how far* past the
threshold, and *one* line to fix them all.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ._finding import SEVERITIES, Finding

__all__ = ["Group", "group_findings", "collapse", "where_for"]


@dataclass(frozen=True)
class Group:
    """The findings of one check at one severity.

    Attributes:
        check, severity: what they share.
        findings: the findings, in the model's forward order.
        modules: their module paths, in forward order (``""`` for the whole model).
        collapsed: the paths for reading: ``"layer4.*"`` where every norm under ``layer4`` is in the group.
        measure: the headline figure's name (the first number of the findings' ``measured``), or None.
        low, high: its range over the group.
        fix: one line of Python that fixes every layer of the group (for a model named ``model``).
    """

    check: str
    severity: str
    findings: tuple[Finding, ...]
    modules: tuple[str, ...]
    collapsed: str
    measure: str | None
    low: float | None
    high: float | None
    fix: str

    def as_dict(self) -> dict[str, Any]:
        from ._finding import plain

        return {
            "check": self.check,
            "severity": self.severity,
            "count": len(self.findings),
            "modules": list(self.modules),
            "collapsed": self.collapsed,
            "measure": self.measure,
            "range": plain([self.low, self.high]) if self.measure else None,
            "fix": self.fix,
        }


def _headline(f: Finding) -> tuple[str, float] | None:
    for k, v in f.measured.items():
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return k, float(v)
    return None


def _under(path: str, prefix: str) -> bool:
    return prefix == "" or path == prefix or path.startswith(prefix + ".")


def _prefixes(paths: list[str], layers: list[str]) -> list[str]:
    """The fewest prefixes that cover ``paths`` and nothing else of ``layers``: each path climbs to its
    highest ancestor under which every layer is in ``paths``; in forward order, without repeats."""
    inside = set(paths)
    out: list[str] = []
    for p in paths:
        best, covered = p, 1
        parts = p.split(".")
        for k in range(len(parts) - 1, 0, -1):
            prefix = ".".join(parts[:k])
            under = [q for q in layers if _under(q, prefix)]
            if not under or not all(q in inside for q in under):
                break
            if len(under) > covered:  # climb only where the prefix says more than the path itself
                best, covered = prefix, len(under)
        if not any(_under(best, q) for q in out):
            out = [q for q in out if not _under(q, best)] + [best]
    return out


def collapse(paths: list[str], layers: list[str], limit: int = 6) -> str:
    """``paths`` for reading: ``prefix.*`` for a prefix whose every norm layer (of ``layers``) is among
    them, at most ``limit`` entries then how many more; ``<model>`` for the whole model."""
    named = [p for p in paths if p]
    known = [q for q in layers if q] or named
    if len(known) > 1 and sorted(named) == sorted(known):
        return f"every norm layer ({len(known)})"
    items = ["<model>"] if "" in paths else []
    for prefix in _prefixes(named, known):
        below = any(x != prefix and _under(x, prefix) for x in known)
        items.append(f"{prefix}.*" if below else prefix)
    shown = ", ".join(items[:limit])
    return shown + (f", ... (+{len(items) - limit} more)" if len(items) > limit else "")


def where_for(paths: list[str], layers: list[tuple[str, str]]) -> str:
    """A ``where=`` predicate for ``normscope.convert`` that picks exactly ``paths`` among the model's norm
    layers (``layers``: (path, class name), forward order): by class where the group is every layer of
    its classes, by prefixes where few cover it, else by name."""
    if len(paths) == 1:
        return f"lambda name, m: name == {paths[0]!r}"
    types = {t for p, t in layers if p in set(paths)}
    same_type = [p for p, t in layers if t in types]
    test = f"type(m).__name__ == {next(iter(types))!r}" if len(types) == 1 else f"type(m).__name__ in {sorted(types)!r}"
    if types and sorted(same_type) == sorted(paths):
        return f"lambda name, m: {test}"
    prefixes = _prefixes(paths, same_type)
    if types and len(prefixes) <= 8:
        ends = tuple(f"{p}." for p in prefixes)
        return f"lambda name, m: {test} and (name + '.').startswith({ends[0] if len(ends) == 1 else ends!r})"
    return f"lambda name, m: name in {set(paths)!r}" if len(paths) <= 12 else f"lambda name, m: name in {paths!r}"


def _merged_fix(findings: list[Finding], layers: list[tuple[str, str]]) -> str:
    """One line for the group: the findings' own line where they all share it; where the lines differ only
    in their ``where=`` predicate (``lambda name, m: name == 'path'``), the line with one predicate for the
    group; where they differ only in the path, a loop over the paths; else the first line, saying so."""
    fixes = [f.fix for f in findings]
    if len(set(fixes)) == 1:
        return fixes[0]
    paths = [f.module for f in findings]
    own = [f"lambda name, m: name == {p!r}" for p in paths]
    templates = {fx.replace(w, "{WHERE}") for fx, w in zip(fixes, own)}
    if len(templates) == 1 and "{WHERE}" in next(iter(templates)):
        return next(iter(templates)).replace("{WHERE}", where_for(paths, layers))
    loops = {fx.replace(repr(p), "name") for fx, p in zip(fixes, paths)}
    if len(loops) == 1 and not fixes[0].startswith(("model =", "model, ")):
        return f"for name in {tuple(paths)!r}: {next(iter(loops))}"
    return fixes[0] + f"  # and the like for the other {len(findings) - 1} (--all lists each)"


def group_findings(findings: list[Finding], layers: list[tuple[str, str]]) -> list[Group]:
    """``findings`` as groups, most serious first, then by check, each in forward order (``layers``)."""
    rank = {p: i for i, (p, _) in enumerate(layers)}
    order = {s: i for i, s in enumerate(SEVERITIES)}
    buckets: dict[tuple, list[Finding]] = {}
    for i, f in enumerate(findings):  # a finding about the whole model stands alone: it says its own thing
        buckets.setdefault((f.check, f.severity) if f.module else (f.check, f.severity, i), []).append(f)
    names = [p for p, _ in layers]
    out = []
    for (check, severity, *_), fs in sorted(buckets.items(), key=lambda kv: (order[kv[0][1]], kv[0][0])):
        fs = sorted(fs, key=lambda f: (rank.get(f.module, math.inf), f.module))
        heads = [h for h in map(_headline, fs) if h is not None]
        measure = heads[0][0] if heads and all(h[0] == heads[0][0] for h in heads) else None
        values = [v for _, v in heads] if measure else []
        modules = tuple(f.module for f in fs)
        out.append(
            Group(
                check,
                severity,
                tuple(fs),
                modules,
                collapse(list(modules), names),
                measure,
                min(values) if values else None,
                max(values) if values else None,
                _merged_fix(fs, layers),
            )
        )
    return out
