"""What the kernel families share: the interpreter switch, when a tensor runs the kernel, the dense
per-channel view every entry point takes, launch arithmetic (the rows view's block and backward grid
included: the rows and modern kernels launch alike), and Chan's combination of partial moments (a
``triton.jit`` function the rows, groups and channels kernels call). The body of a block of rows is
in :mod:`._rowbody`, the references in :mod:`._ref`.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import config


def interpreting() -> bool:
    """Whether Triton runs its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def fix_interpreter_index() -> None:
    """Triton <= 3.8's interpreter turns a scalar into an int with ``int(array_of_shape_(1,))``,
    which NumPy >= 2.4 refuses, so every loop with a runtime bound fails on CPU. Triton 3.9 fixed
    it (``.squeeze()``); do the same for older versions. Only the CPU interpreter is touched.

    ``_patch_lang_tensor`` is private and changed shape: up to 3.5 it is ``(tensor)`` and sets
    attributes directly; from 3.6 it is ``(tensor, scope)`` and sets them through ``scope`` (which
    restores them afterwards). The wrapper passes on whatever it is given and sets ``__index__`` the
    same way the original did."""
    from triton.runtime import interpreter

    orig = getattr(interpreter, "_patch_lang_tensor", None)
    if orig is None or getattr(orig, "_normscope_fixed", False):
        return

    def index(self):
        return int(self.handle.data.reshape(-1)[0])

    def patched(tensor, *scope):
        orig(tensor, *scope)
        if scope:
            scope[0].set_attr(tensor, "__index__", index)
        else:
            tensor.__index__ = index

    patched._normscope_fixed = True
    interpreter._patch_lang_tensor = patched


if interpreting():
    fix_interpreter_index()


def use_kernel(x: Tensor) -> bool:
    """Run the Triton kernel on ``x`` (CUDA, or any tensor under the interpreter), else the reference."""
    return x.is_cuda or interpreting()


@triton.jit
def chan_combine(n_a, mean_a, m2_a, n_b, mean_b, m2_b):
    """Chan et al.'s parallel combination of two parts' (count, mean, M2) -> the union's. It adds only
    non-negative terms (no E[x^2] - E[x]^2 cancellation); a part with no element (n_b = 0) changes
    nothing. Every kernel that walks a scope in tiles combines its tiles with this."""
    n = n_a + n_b
    delta = mean_b - mean_a
    frac = n_b / tl.maximum(n, 1.0)
    return n, mean_a + delta * frac, m2_a + m2_b + delta * delta * n_a * frac


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@functools.lru_cache(maxsize=16)
def sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def programs(x: Tensor, work: int, per_sm: int) -> int:
    """How many persistent programs the backward uses (deterministic for a given device)."""
    if x.is_cuda:
        return max(1, min(work, sm_count(x.device.index or 0) * per_sm))
    return max(1, min(work, config.INTERPRETER_PROGRAMS))


def rows_config(N: int) -> tuple[int, int, bool, int]:
    """(BLOCK_M, BLOCK_N, looped, num_warps) of a kernel over rows of length N (settings:
    kernels/config.py): whole rows in registers up to ``ROWS_MAX_FUSED_N``, else one row a program
    walked in chunks. Every kernel on the rows view launches with these."""
    block = next_pow2(N)
    if block <= config.ROWS_MAX_FUSED_N:
        block_m = max(1, min(config.ROWS_MAX_BLOCK_M, config.ROWS_TILE // block))
        warps = min(config.ROWS_MAX_WARPS, max(1, block_m * block // config.ROWS_WARP_ELEMS))
        return block_m, block, False, next_pow2(warps)
    tuned = config.ROWS_LOOP_LAUNCH.get(block)
    if tuned is not None:
        return 1, tuned[0], True, tuned[1]
    chunk = min(config.ROWS_LOOP_BLOCK, config.ROWS_MAX_FUSED_N)
    return 1, chunk, True, next_pow2(min(config.ROWS_MAX_WARPS, max(1, chunk // config.ROWS_LOOP_WARP_ELEMS)))


def bwd_grid(x: Tensor, M: int, block_m: int, per_sm: int) -> tuple[int, int]:
    """(programs, rows per program) of a single-block rows backward: each program takes a run of
    whole blocks (a multiple of ``block_m`` rows) and writes one row of per-program dW/dB partials."""
    blocks = triton.cdiv(M, block_m)
    rows_per_prog = triton.cdiv(blocks, programs(x, blocks, per_sm)) * block_m
    return triton.cdiv(M, rows_per_prog), rows_per_prog


def rows2d(t: Tensor, n: int) -> Tensor:
    """``t`` as rows of ``n`` elements; the row count spelled out, so that empty input (rows of zero
    elements included, which ``reshape(-1, 0)`` cannot size) has a shape. Every rows entry point
    views its input through this."""
    return t.reshape(t.numel() // n if n else 0, n)


def dense(t: Tensor | None) -> Tensor | None:
    """A weight, bias or running buffer as the dense 1-d memory the kernels index: a view such as
    ``base[::2]``, ``g.expand(n)`` or an offset slice is copied (C elements, not the activation).
    Every kernel entry point passes its per-channel tensors through this."""
    if t is None:
        return None
    t = t.reshape(-1)
    return t if t.is_contiguous() else t.contiguous()
