"""Questions about a tensor's memory layout, for the modules that may import neither the engine nor the
kernels: torch's own channels_last test (the ATen backend and the Triton groups kernel ask it) and whether
a layout fills its memory (the composite and reference backends ask it)."""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor


def fills_memory(shape: Sequence[int], strides: Sequence[int]) -> bool:
    """Whether elements of these sizes and strides fill their memory without gaps or overlaps: some
    order of the axes is contiguous (contiguous, channels_last, transposed), the layouts
    ``empty_like`` reproduces."""
    expected = 1
    for stride, n in sorted((st, n) for n, st in zip(shape, strides) if n != 1):
        if stride != expected:
            return False
        expected *= n
    return True


def strides_like_channels_last(x: Tensor) -> bool:
    """torch's own test of whether a 4-D/5-D tensor's strides are channels_last's (c10's
    ``is_channels_last_strides_2d_s4``/``_3d_s5``), which ``suggest_memory_format`` and so
    ``torch.group_norm``/``native_group_norm`` read -- unlike torch's batch_norm, which asks
    ``is_contiguous(memory_format=channels_last)`` (:func:`channels_last`). That one ignores the
    strides of size-1 axes: an (1, C, H, W) tensor with strides (C, 1, W*C, C) -- a permuted
    attention output -- passes it, yet group_norm calls it contiguous-format, copies it so and
    returns contiguous output (native_group_norm refuses it as channels_last)."""
    sizes, strides = x.shape, x.stride()
    if x.dim() not in (4, 5) or strides[1] == 0:
        return False
    least = 0
    for d in (1, *range(x.dim() - 1, 1, -1), 0):
        if sizes[d] == 0 or strides[d] < least or (d == 0 and least == strides[1]):
            return False
        least = strides[d] * sizes[d] if sizes[d] > 1 else strides[d]
    return True
