"""The doctor's result as data: :class:`Finding` and :class:`Report`, with a versioned JSON schema."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from ._finding import SEVERITIES, Finding, Series, plain
from ._group import Group, group_findings
from .checks import CHECKS

__all__ = ["Finding", "Group", "Report", "Series", "SCHEMA", "SEVERITIES"]

#: the identifier and version of :meth:`Report.to_json`'s layout; the number changes whenever a key
#: is renamed or removed (adding a key keeps it)
SCHEMA = "normscope.doctor/1"
#: what can make a report (Report.source)
SOURCES = ("doctor", "watch")


@dataclass
class Report:
    """What :func:`normscope.doctor` found: ``findings`` (most serious first) and how it ran.

    Attributes:
        findings: the :class:`Finding` list, ordered by severity, then check, then module path.
        checks: per check identifier, ``{"ran": bool, "note": str}`` -- a check that could not run
            on this model and batch (no mask given, no BatchNorm, ...) says why.
        model: the model's class name.
        inputs: a short description of each input (shape and dtype, or type).
        world_size: as given to :func:`normscope.doctor`.
        seconds: wall time of the diagnosis.
        series: the measured quantities per layer (or per step) that the HTML report draws, a
            :class:`Series` each.
        layers: the model's norm layers the diagnosis measured, ``(path, class name)`` in forward
            order: the order of the groups' layers and of the pictures.
        source: what made the report: ``"doctor"`` (one batch, :func:`normscope.doctor`) or ``"watch"``
            (a training run, :func:`normscope.watch`); the headings of the text and the page name it.
    """

    findings: list[Finding]
    checks: dict[str, dict[str, Any]] = field(default_factory=dict)
    model: str = ""
    inputs: list[str] = field(default_factory=list)
    world_size: int | None = None
    seconds: float = 0.0
    series: list[Series] = field(default_factory=list)
    layers: list[tuple[str, str]] = field(default_factory=list)
    source: str = "doctor"

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise ValueError(f"Report: expected `source` to be one of {SOURCES}, got {self.source!r}")
        rank = {s: i for i, s in enumerate(SEVERITIES)}
        self.findings = sorted(self.findings, key=lambda f: (rank[f.severity], f.check, f.module))

    def by_check(self, name: str) -> list[Finding]:
        """The findings of the check ``name`` (one of :data:`normscope.doctor.CHECKS`, or of the checks
        this report ran)."""
        if name not in CHECKS and name not in self.checks:
            known = list(CHECKS) + [c for c in self.checks if c not in CHECKS]
            raise ValueError(f"Report.by_check: expected `name` to be one of {known}, got {name!r}")
        return [f for f in self.findings if f.check == name]

    def count(self, severity: str) -> int:
        """How many findings have ``severity``."""
        if severity not in SEVERITIES:
            raise ValueError(f"Report.count: expected `severity` to be one of {list(SEVERITIES)}, got {severity!r}")
        return sum(f.severity == severity for f in self.findings)

    def groups(self) -> list[Group]:
        """The findings grouped for reading: one :class:`~normscope.doctor.Group` per check and severity
        (most serious first), its layers in forward order and collapsed where they share a prefix, the
        range of its headline figure, and one fix line that covers the group."""
        return group_findings(self.findings, self.layers)

    def worst(self) -> str | None:
        """The most serious severity found, None when nothing was."""
        return self.findings[0].severity if self.findings else None

    def as_dict(self) -> dict[str, Any]:
        """The JSON document of :meth:`to_json`, as Python objects."""
        import torch

        from .._version import __version__

        return {
            "schema": SCHEMA,
            "normscope": __version__,
            "torch": torch.__version__,
            "source": self.source,
            "model": self.model,
            "inputs": list(self.inputs),
            "world_size": self.world_size,
            "seconds": round(self.seconds, 3),
            "summary": {s: self.count(s) for s in SEVERITIES},
            "checks": plain(self.checks),
            "findings": [f.as_dict() for f in self.findings],
            "groups": [g.as_dict() for g in self.groups()],
            "layers": [{"path": p, "type": t} for p, t in self.layers],
            "series": [v.as_dict() for v in self.series],
        }

    def to_json(self, indent: int | None = 2) -> str:
        """The report as JSON; the layout is named and versioned by its ``"schema"`` key
        (:data:`SCHEMA`, documented in docs/doctor.md). Non-finite numbers are written as the
        strings ``"inf"``, ``"-inf"``, ``"nan"`` (JSON has no such numbers)."""
        return json.dumps(self.as_dict(), indent=indent, allow_nan=False)

    def __str__(self) -> str:
        from ._render import text_lines

        return "\n".join(text for text, _ in text_lines(self))

    def to_html(self) -> str:
        """A self-contained HTML page of the report: a summary, the groups with their fixes, and a picture
        per measured quantity (inline SVG; nothing is fetched)."""
        from ._render import to_html

        return to_html(self)
