"""Memory layouts the backends keep: torch's norms return channels_last output for channels_last input."""

from __future__ import annotations

import torch
from torch import Tensor


def channels_last(x: Tensor) -> torch.memory_format | None:
    """channels_last / channels_last_3d when ``x`` is laid out so (and not also contiguous), else None."""
    if x.is_contiguous():
        return None
    for fmt, nd in ((torch.channels_last, 4), (torch.channels_last_3d, 5)):
        if x.dim() == nd and x.is_contiguous(memory_format=fmt):
            return fmt
    return None


def reduced_last(scope) -> tuple[tuple[int, ...], bool]:
    """``(tail, moved)`` for ops that normalize the last axes (layer_norm, rms_norm, the RMS rows):
    ``tail`` are the last ``len(scope.reduce)`` axes, and ``moved`` says whether the reduced axes
    must be moved there first (``x.movedim(scope.reduce, tail)``, a view)."""
    ndim, nred = len(scope.shape), len(scope.reduce)
    tail = tuple(range(ndim - nred, ndim))
    return tail, scope.reduce != tail
