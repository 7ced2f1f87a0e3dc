"""One measured problem, :class:`Finding`, and the JSON form of its figures: the bottom of the doctor's
modules (the checks make findings, the report holds them; neither imports the other's callers)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Finding", "Series", "SEVERITIES", "plain"]

#: most serious first: the order of the report and of :attr:`Report.findings`
SEVERITIES = ("error", "warning", "info")


@dataclass(frozen=True)
class Finding:
    """One problem the doctor measured.

    Attributes:
        check: the check's stable identifier (``"bn-elements"``, ``"padding"``, ... see
            :data:`normscope.doctor.CHECKS`).
        module: the module's path in the model (``"layer1.0.bn1"``), ``""`` for the whole model.
        severity: ``"error"``, ``"warning"`` or ``"info"``.
        measured: the figures, by name (numbers, strings, short lists): what the verdict rests on.
        threshold: the bounds the figures were held to, and ``"source"``: where they come from.
        reason: one or two sentences: what this means for the model.
        fix: a line of Python that fixes it, written for a model named ``model``.
    """

    check: str
    module: str
    severity: str
    measured: dict[str, Any]
    threshold: dict[str, Any]
    reason: str
    fix: str

    def as_dict(self) -> dict[str, Any]:
        return {
            "check": self.check,
            "module": self.module,
            "severity": self.severity,
            "measured": plain(self.measured),
            "threshold": plain(self.threshold),
            "reason": self.reason,
            "fix": self.fix,
        }


@dataclass
class Series:
    """A measured quantity over a model's norm layers (in forward order) or over training steps: what the
    report draws, one picture per series.

    Attributes:
        check: the check it belongs to (its findings sit beside the picture).
        title: what is drawn, in words.
        y: the quantity's name and unit (the vertical axis).
        x: ``"layer"`` (the norm layers in forward order, named by ``labels``) or ``"step"``.
        lines: label -> points ``(x, y)``: for ``x == "layer"`` one line, x the layer's index in
            ``labels``; for ``x == "step"`` a line per layer (or per quantity), x the step.
        labels: for ``x == "layer"``, the layers' paths by index.
        thresholds: name -> value, drawn as horizontal lines (``{"warning": 0.133}``).
        log: a logarithmic vertical axis.
    """

    check: str
    title: str
    y: str
    x: str = "layer"
    lines: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    labels: list[str] = field(default_factory=list)
    thresholds: dict[str, float] = field(default_factory=dict)
    log: bool = False

    def as_dict(self) -> dict[str, Any]:
        return {
            "check": self.check,
            "title": self.title,
            "y": self.y,
            "x": self.x,
            "lines": {k: [[plain(a), plain(b)] for a, b in pts] for k, pts in self.lines.items()},
            "labels": list(self.labels),
            "thresholds": plain(self.thresholds),
            "log": self.log,
        }


def plain(v: Any) -> Any:
    """``v`` with every number a JSON number (non-finite ones as strings) and tuples as lists."""
    if isinstance(v, dict):
        return {str(k): plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [plain(x) for x in v]
    if isinstance(v, bool) or v is None or isinstance(v, str):
        return v
    if isinstance(v, int):
        return v
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return v
    if hasattr(v, "item") and getattr(v, "numel", lambda: 2)() == 1:  # a one-element tensor
        return plain(v.item())
    return str(v)
