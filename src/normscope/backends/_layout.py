"""Memory layouts the backends keep: torch's norms return channels_last output for channels_last input."""

from __future__ import annotations

from ..reference import channels_last  # noqa: F401  (the backends' layouts, in one place)


def reduced_last(scope) -> tuple[tuple[int, ...], bool]:
    """``(tail, moved)`` for ops that normalize the last axes (layer_norm, rms_norm, the RMS rows):
    ``tail`` are the last ``len(scope.reduce)`` axes, and ``moved`` says whether the reduced axes
    must be moved there first (``x.movedim(scope.reduce, tail)``, a view)."""
    ndim, nred = len(scope.shape), len(scope.reduce)
    tail = tuple(range(ndim - nred, ndim))
    return tail, scope.reduce != tail
