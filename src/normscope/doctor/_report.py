"""The doctor's result as data: :class:`Finding` and :class:`Report`, with a versioned JSON schema."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from ._finding import Finding, Series, plain
from .checks import CHECKS

__all__ = ["Finding", "Report", "Series", "SCHEMA", "SEVERITIES"]

#: the identifier and version of :meth:`Report.to_json`'s layout; the number changes whenever a key
#: is renamed or removed (adding a key keeps it)
SCHEMA = "normscope.doctor/1"

#: most serious first: the order of the terminal table and of :attr:`Report.findings`
SEVERITIES = ("error", "warning", "info")


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
    """

    findings: list[Finding]
    checks: dict[str, dict[str, Any]] = field(default_factory=dict)
    model: str = ""
    inputs: list[str] = field(default_factory=list)
    world_size: int | None = None
    seconds: float = 0.0
    series: list[Series] = field(default_factory=list)

    def __post_init__(self) -> None:
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
            "model": self.model,
            "inputs": list(self.inputs),
            "world_size": self.world_size,
            "seconds": round(self.seconds, 3),
            "summary": {s: self.count(s) for s in SEVERITIES},
            "checks": plain(self.checks),
            "findings": [f.as_dict() for f in self.findings],
            "series": [v.as_dict() for v in self.series],
        }

    def to_json(self, indent: int | None = 2) -> str:
        """The report as JSON; the layout is named and versioned by its ``"schema"`` key
        (:data:`SCHEMA`, documented in docs/doctor.md). Non-finite numbers are written as the
        strings ``"inf"``, ``"-inf"``, ``"nan"`` (JSON has no such numbers)."""
        return json.dumps(self.as_dict(), indent=indent, allow_nan=False)

    def __str__(self) -> str:
        if not self.findings:
            return f"normscope doctor: {self.model}: nothing found ({len(self.checks)} checks)"
        lines = [f"normscope doctor: {self.model}: " + ", ".join(f"{self.count(s)} {s}" for s in SEVERITIES)]
        for f in self.findings:
            lines.append(f"  {f.severity:<7} {f.check:<18} {f.module or '<model>'}: {f.reason}")
            lines.append(f"          fix: {f.fix}")
        return "\n".join(lines)
