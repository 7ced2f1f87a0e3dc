"""Questions about a tensor's memory layout, for the modules that may import neither the engine nor the
kernels: torch's own channels_last test (the ATen backend and the Triton groups kernel ask it), whether
a layout fills its memory (the composite and reference backends ask it), and the layout torch.nn returns,
which the engine gives every backend's output (:func:`output_layout`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
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


_is_batched = torch._C._functorch.is_batchedtensor


def _contiguous(x: Tensor, y: Tensor) -> Tensor:
    return y.contiguous()  # y itself when it already is (one C call)


def _suggested(x: Tensor, y: Tensor) -> Tensor:
    # torch's ``suggest_memory_format(x)``: channels_last(_3d) where its strides test says so, else contiguous
    # (a tensor batched by torch.func.vmap answers no question of its strides: its logical layout is none)
    if x.is_contiguous() or x.dim() not in (4, 5) or _is_batched(x) or not strides_like_channels_last(x):
        return y.contiguous()
    return y.contiguous(memory_format=torch.channels_last if x.dim() == 4 else torch.channels_last_3d)


def _moved(reduce: tuple[int, ...], ndim: int) -> Callable[[Tensor, Tensor], Tensor]:
    # the reduced axes innermost, the kept ones outside them in order
    order = tuple(d for d in range(ndim) if d not in reduce) + tuple(reduce)
    back = tuple(order.index(d) for d in range(ndim))

    def moved(x: Tensor, y: Tensor) -> Tensor:
        inner = y.permute(order)  # a view: contiguous when y is laid out so already
        if inner.is_contiguous() or _is_batched(y):
            return y
        return inner.contiguous().permute(back)

    return moved


def like_input(x: Tensor, y: Tensor) -> Tensor:
    """``y``, the output of an element-wise op of ``x`` (Derf), in the layout torch's element-wise ops give
    it: ``x``'s own strides where ``x`` fills its memory (transposed, channels_last: ``empty_like``'s
    ``preserve_format``), else contiguous (an expanded or strided view). A copy only where ``y``'s
    layout differs; no value changes."""
    if not fills_memory(x.shape, x.stride()):
        return y.contiguous()
    if y.stride() == x.stride():
        return y
    return torch.empty_like(x, dtype=y.dtype).copy_(y)


def output_layout(scope, op: str | None) -> Callable[[Tensor, Tensor], Tensor]:
    """``fix(x, y)``: the output ``y`` of a norm of ``x`` over ``scope`` in the memory layout torch.nn's
    namesake returns for ``x`` -- the one rule every backend's output goes through (the engine applies
    it to every runner, :func:`normscope._registry.prepare`), so a path never shows in the strides of
    what it returns. ``y`` itself where its layout is already that one (a check of strides); else a
    copy, which changes no value. Decided per plan from what the signature fixes (the scope, ``op``);
    per call from ``x``'s strides. torch on CPU (measured, torch 2.13):

    * ``batch_norm`` (statistics per channel of axis 1), ``group_norm`` (GroupNorm(G, C), ``G`` = 1 and
      ``C`` too) and ``rms_norm`` over the last axes: ``suggest_memory_format(x)`` -- channels_last
      (``_3d``) where torch's strides test says so (:func:`strides_like_channels_last`: a channels_last
      input, a channel slice of one), else contiguous (a transposed or expanded input too);
    * ``instance_norm`` and ``layer_norm`` over the last axes: contiguous, whatever ``x``'s layout;
    * a norm over other axes than the last ones (LayerNorm2d, any-axis LayerNorm/RMSNorm), which torch
      has no op for: the layout of the permute-based implementations (timm's and torchvision's
      LayerNorm2d: move the axes last, normalize, move them back) -- the reduced axes innermost, the
      kept ones outside in order: channels_last for LayerNorm2d's (N, C, H, W);
    * BatchNorm over another channel axis (``channel_dim=-1``): contiguous, as torch's ``batch_norm`` of
      its (rows, C) reshape; any other scope: ``suggest_memory_format(x)``.

    A mask never changes the rule: a masked norm returns its unmasked namesake's layout."""
    form = scope.form
    ndim = len(scope.shape)
    if form.channel is not None and form.channel != 1:
        return _contiguous
    if form.channel == 1 or op == "group_norm" or form.sample_groups and scope.groups > 1:
        return _suggested
    if form.instance:
        return _contiguous
    if form.rows:
        if not form.trailing:
            return _moved(scope.reduce, ndim)
        return _contiguous if scope.centered else _suggested
    return _suggested


def laid_out(runner: Callable, scope, op: str | None, adds: bool) -> Callable:
    """``runner`` with its output put through :func:`output_layout`'s rule (and its ``layer_entry``, where it
    has one, too). ``adds``: an add_norm runner, whose ``(y, h)`` output has ``y`` laid out as a norm of ``h``."""
    fix = output_layout(scope, op)
    if adds:

        def run_adding(c):
            y, h = runner(c)
            return fix(h, y), h

        return run_adding

    def run(c):
        return fix(c.x, runner(c))

    entry = getattr(runner, "layer_entry", None)
    if entry is not None:

        def layer(x: Tensor, w, b, eps, r) -> Tensor:
            return fix(x, entry(x, w, b, eps, r))

        run.layer_entry = layer
    return run
