"""Applying the doctor's fixes to a model in memory: the fix lines themselves, run in order."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from ._report import Report

__all__ = ["apply_fixes", "AUTOMATIC"]

#: the checks whose fix line changes only the model, in the order they are applied: biases go
#: before the norms are replaced, freezing before a frozen layer could be converted, and the
#: statistics are recalibrated last, on the final layers
AUTOMATIC = ("bias-before-norm", "frozen-bn-updating", "bn-elements", "train-eval-drift")


def apply_fixes(model: nn.Module, report: Report, batches: Any = None) -> tuple[nn.Module, list[str]]:
    """Run the fix lines of ``report``'s findings that only change the model (:data:`AUTOMATIC`),
    each once, on ``model`` (in place, as the lines do) and return ``(model, the lines run)``.

    ``batches`` is what ``normscope.recalibrate`` gets for the ``train-eval-drift`` fix; without it
    that fix is not applied. A layer that ``frozen-bn-updating`` freezes is not also converted by
    ``bn-elements`` (a frozen layer has no batch statistics), and a bias before a layer that ``bn-elements``
    converts is kept (a GroupNorm's group mean spans channels of different biases: there the bias counts).
    Nothing is written anywhere.

    Example::

        >>> from normscope.doctor import apply_fixes
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8))
        >>> report = normscope.doctor(model, torch.randn(16, 4))
        >>> model, lines = apply_fixes(model, report)
        >>> normscope.doctor(model, torch.randn(16, 4)).by_check("bias-before-norm")
        []
    """
    from ..convert import convert
    from ..modules import freeze_batchnorm
    from ._run import recalibrate

    # the names the automatic fix lines call, as `normscope.<name>` (not the package itself: this module sits
    # below it)
    normscope = SimpleNamespace(convert=convert, freeze_batchnorm=freeze_batchnorm, recalibrate=recalibrate)
    frozen = {f.module for f in report.findings if f.check == "frozen-bn-updating"}
    converted = set() if frozen else {f.module for f in report.findings if f.check == "bn-elements"}
    lines: list[str] = []
    for check in AUTOMATIC:
        for f in report.findings:
            if f.check != check or f.fix in lines:
                continue
            if check == "bias-before-norm" and f.module in converted:
                continue  # the bias is removable under this BatchNorm, not under the GroupNorm replacing it
            if check == "bn-elements" and frozen:
                continue  # freeze_batchnorm already took every BatchNorm with running statistics
            if check == "train-eval-drift" and batches is None:
                continue
            lines.append(f.fix)
    namespace = {"model": model, "torch": torch, "normscope": normscope, "batches": batches}
    for line in lines:
        exec(compile(line, "<normscope doctor fix>", "exec"), namespace)  # noqa: S102 - lines the checks wrote
    return namespace["model"], lines
