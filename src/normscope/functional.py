"""Functional normalization with ``torch.nn.functional``'s signatures.

Each function checks its arguments, builds its :class:`~normscope.scope.Scope` and calls the one
engine (:func:`normscope.engine.norm`). Every function also takes ``backend=`` (``"auto"``,
``"aten"``, ``"reference"``, ``"triton"``...) to force a backend for that call.

The torch-named functions go through the hot path (:mod:`normscope.hot`): their checked call is an
:class:`~normscope.hot.Op`, planned once per call signature, the layers' too.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from . import _checks as check
from . import hot
from ._state import tracing as _tracing
from .engine import Running, add_norm, norm, stats
from .engine import apply as _apply

# the last-axes ops and the modern norms: normscope.functional_modern builds on the engine and the hot
# path only, so the dependency is one way (this module on that one)
from .functional_modern import CASTINGS, derf, layer_norm, modulated_norm, poly_norm, qk_norm, rms_norm
from .scope import Scope

__all__ = [
    "batch_norm",
    "instance_norm",
    "layer_norm",
    "rms_norm",
    "group_norm",
    "local_response_norm",
    "normalize",
    "adain",
]

_BATCH = Scope.batch(1)
_BATCH_LAST = Scope.batch(-1)
_INSTANCE = Scope.instance()


# -- the hot path's settings of each op: one type and one builder an op, used by the functional form
# and the layers alike. A builder returns the type's fields in its order as a plain tuple (the hot
# path's key; see normscope.hot.Op), and the checked call reads them by name


class BatchNormSettings(NamedTuple):
    """What :func:`batch_norm`'s checked call reads besides the tensors and ``eps``."""

    training: bool
    momentum: float
    #: its type: the check refuses a bool, and ``True == 1`` in a key
    momentum_type: type
    channel_dim: int
    #: its type: ``1.0 == 1`` in a key, and the check refuses a float
    channel_dim_type: type
    backend: str | None


class InstanceNormSettings(NamedTuple):
    """What :func:`instance_norm`'s checked call reads besides the tensors and ``eps``."""

    use_input_stats: bool
    momentum: float
    momentum_type: type
    backend: str | None


class GroupNormSettings(NamedTuple):
    """What :func:`group_norm`'s checked call reads besides the tensors and ``eps``; ``num_channels``:
    the channels a GroupNorm layer expects (None: any)."""

    num_groups: int
    num_groups_type: type
    num_channels: int | None
    backend: str | None




def batch_norm_settings(training: bool, momentum: float, channel_dim: int = 1, backend: str | None = None) -> tuple:
    """The fields of :class:`BatchNormSettings`."""
    return (training, momentum, type(momentum), channel_dim, type(channel_dim), backend)


def instance_norm_settings(use_input_stats: bool, momentum: float, backend: str | None = None) -> tuple:
    """The fields of :class:`InstanceNormSettings`."""
    return (use_input_stats, momentum, type(momentum), backend)


def group_norm_settings(num_groups: int, num_channels: int | None = None, backend: str | None = None) -> tuple:
    """The fields of :class:`GroupNormSettings`."""
    return (num_groups, type(num_groups), num_channels, backend)


_GROUP_SCOPES: dict[int, Scope] = {}


def _group_scope(num_groups: int) -> Scope:
    # building a frozen Scope (validation + hash) costs ~3 us, a third of the layer's Python
    # overhead at small shapes (benchmarks/cpu_overhead.py); scopes are immutable, so share them.
    # A plain dict, not functools.lru_cache, which dynamo warns about on every compile; under
    # compile the scope is built once per trace, so the cache is skipped there
    if torch.compiler.is_compiling() or not isinstance(num_groups, int):
        return Scope.group(num_groups)
    scope = _GROUP_SCOPES.get(num_groups)
    if scope is None:
        if len(_GROUP_SCOPES) >= 256:
            _GROUP_SCOPES.clear()
        scope = _GROUP_SCOPES[num_groups] = Scope.group(num_groups)
    return scope


def _check_momentum_eps(momentum: object, eps: object, use_input_stats: bool, where: str) -> None:
    """torch's checks of ``momentum`` and ``eps``, with the expected value in the message.

    torch: ``momentum`` must be a float (None is a TypeError, not "no update"). ``eps``: BatchNorm's
    must be positive when the batch statistics normalize (eps = 0 divides a constant channel by 0)
    and non-negative otherwise; InstanceNorm's is any number, as every other op's
    (:func:`normscope._checks.eps`).
    """
    if not isinstance(momentum, numbers.Real) or isinstance(momentum, bool):  # NumPy scalars too
        raise TypeError(
            f"{where}: expected `momentum` to be a float (the running-statistics update factor; "
            f"the layers' momentum=None is their own cumulative average), got {momentum!r}"
        )
    check.eps(eps, where)
    if where != "batch_norm":
        return
    if use_input_stats and not eps > 0:
        raise ValueError(f"{where}: expected `eps` > 0 when training (batch statistics normalize), got {eps!r}")
    if not eps >= 0:
        raise ValueError(f"{where}: expected `eps` >= 0, got {eps!r}")


def batch_norm(
    input: Tensor,
    running_mean: Tensor | None,
    running_var: Tensor | None,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    training: bool = False,
    momentum: float = 0.1,
    eps: float = 1e-5,
    *,
    mask: Tensor | None = None,
    channel_dim: int = 1,
    backend: str | None = None,
) -> Tensor:
    """Batch Normalization over (N, C, *): statistics per channel, over the batch and positions.

    Same signature and semantics as :func:`torch.nn.functional.batch_norm`: in training the batch
    statistics normalize and (with running buffers) update ``running_mean``/``running_var`` in
    place, the variance with Bessel's correction; otherwise the running buffers normalize.

    Beyond torch:

    * ``mask``: bool tensor shaped like ``input`` without the channel axis (``(N, L)`` for
      ``(N, C, L)``), True = valid. Statistics and the running update (Bessel's correction with
      the valid count) use valid elements only; padded positions are normalized with the same
      statistics. A batch with no valid element raises ValueError in training.
    * ``channel_dim``: the channel axis; ``-1`` takes channels-last input such as ``(B, S, D)``
      directly. Default: 1.
    """
    running = None
    if running_mean is not None or running_var is not None or not training:
        running = hot.running((running_mean, running_var, momentum, training))
    # training is read for its truth only (1 and True alike); momentum's and channel_dim's types are
    # checked (a bool momentum, a float axis are refused), so the key holds them
    settings = batch_norm_settings(training, momentum, channel_dim, backend)
    return hot.call(BATCH_NORM, settings, input, weight, bias, eps, running, mask)


def checked_batch_norm(settings: BatchNormSettings, input, weight, bias, eps, running: Running | None, mask) -> Tensor:
    """:func:`batch_norm`'s checked call (see :mod:`normscope.hot`); the BatchNorm layers' too."""
    training, momentum = settings.training, settings.momentum
    channel_dim, backend = settings.channel_dim, settings.backend
    running_mean, running_var = (None, None) if running is None else running[:2]
    where = "batch_norm"
    check.tensor(input, "input", where)
    check.channels_first(input, 2, where)
    _check_momentum_eps(momentum, eps, training, where)
    if not isinstance(channel_dim, numbers.Integral):  # True is 1, as torch's own int arguments take it
        raise TypeError(f"{where}: expected `channel_dim` to be an int (1 or -1), got {channel_dim!r}")
    channel_dim = int(channel_dim)  # NumPy's too
    if channel_dim not in (1, -1, input.dim() - 1):
        raise ValueError(f"{where}: expected `channel_dim` to be 1 or -1, got {channel_dim!r}")
    c = input.shape[channel_dim]
    for name, p in (("running_mean", running_mean), ("running_var", running_var), ("weight", weight), ("bias", bias)):
        # an empty batch returns empty whatever the parameters' dtype, as torch's batch_norm does
        check.param(p, name, (c,), input, where, any_dtype=input.numel() == 0)
    if input.numel():
        check.one_dtype(input, where, running_mean=running_mean, running_var=running_var, weight=weight, bias=bias)
    mask = check.mask(mask, input, channel_dim, where)
    if training:
        # with a mask too: a mask only takes values away, and torch's rule is on the shape
        if input.numel() // max(c, 1) <= 1 and input.numel() > 0:
            raise ValueError(
                f"{where}: expected more than 1 value per channel when training, got input of shape "
                f"{tuple(input.shape)} (1 value per channel)"
            )
        if mask is not None and check.all_masked(mask):  # not asked on meta tensors or while tracing
            raise ValueError(
                f"{where}: expected at least one valid (True) element in `mask` when training, got an "
                f"all-False mask of shape {tuple(mask.squeeze(channel_dim).shape)}"
            )
        _check_running_written(running_mean, running_var, where)
    elif running_mean is None or running_var is None:
        raise ValueError(f"{where}: evaluation (training=False) needs `running_mean` and `running_var`, got None")
    if not training:
        # the running statistics normalize every position alike: ATen's fused path, without the mask. Where
        # autograd records, a non-finite padded value is taken as 0: its output's gradient (0 from a loss on
        # the valid outputs) times its normalized value would be 0 * inf = NaN in the weight's gradient
        # (docs/beyond.md: padding passes no gradient, whatever it holds). masked_fill keeps the input's
        # layout, so the valid outputs are ATen's bits on the input as given
        if mask is not None and _records(input, weight, bias):
            input = input.masked_fill(~mask & ~torch.isfinite(input), 0)
        mask = None
    if running is not None:
        running = Running(running_mean, running_var, float(momentum), training)
    scope = _BATCH if channel_dim == 1 else _BATCH_LAST
    return norm(input, scope, weight, bias, eps, mask=mask, running=running, backend=backend)


BATCH_NORM = hot.Op("batch_norm", checked_batch_norm, BatchNormSettings)


def _records(*tensors: Tensor | None) -> bool:
    """Whether autograd records a call on these tensors (grad mode on and one of them requires grad)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def instance_norm(
    input: Tensor,
    running_mean: Tensor | None = None,
    running_var: Tensor | None = None,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    use_input_stats: bool = True,
    momentum: float = 0.1,
    eps: float = 1e-5,
    *,
    mask: Tensor | None = None,
    backend: str | None = None,
) -> Tensor:
    """Instance Normalization over (N, C, *): statistics per sample and channel, over positions.

    Same as :func:`torch.nn.functional.instance_norm`; running buffers (if given) receive the
    batch average of the per-instance statistics.

    ``mask`` (beyond torch): bool, shaped ``(N, *)`` (the input without the channel axis), True =
    valid; statistics over valid positions only. A sample with no valid position normalizes to
    the bias (its statistics are mean 0, variance 0 and enter a running average as such).
    """
    running = None
    if running_mean is not None or running_var is not None:
        running = hot.running((running_mean, running_var, momentum, use_input_stats))
    settings = instance_norm_settings(use_input_stats, momentum, backend)
    return hot.call(INSTANCE_NORM, settings, input, weight, bias, eps, running, mask)


def checked_instance_norm(
    settings: InstanceNormSettings, input, weight, bias, eps, running: Running | None, mask
) -> Tensor:
    """:func:`instance_norm`'s checked call (see :mod:`normscope.hot`); the InstanceNorm layers' too."""
    use_input_stats, momentum, backend = settings.use_input_stats, settings.momentum, settings.backend
    running_mean, running_var = (None, None) if running is None else running[:2]
    where = "instance_norm"
    check.tensor(input, "input", where)
    check.channels_first(input, 3, where)
    _check_momentum_eps(momentum, eps, use_input_stats, where)
    c = input.shape[1]
    for name, p in (("running_mean", running_mean), ("running_var", running_var)):
        # torch's instance_norm averages the per-instance statistics into the buffers with a copy:
        # buffers of any dtype
        check.param(p, name, (c,), input, where, any_dtype=True)
    # ... but never one without the other, nor a running_mean of the input's dtype with a running_var of
    # another (the one mixture torch's kernel takes as all of the input's dtype; measured over every pair
    # of fp16/bf16/fp32/fp64): torch refuses both with a RuntimeError from inside ("expected scalar type
    # Float but found Double", "Expected a proper Tensor but got None") -- a layer whose buffer was
    # replaced by one of another dtype, or set to None
    if (running_mean is None) != (running_var is None):
        given, missing = ("running_mean", "running_var") if running_var is None else ("running_var", "running_mean")
        raise ValueError(
            f"{where}: expected `running_mean` and `running_var` both or neither, got `{given}` without `{missing}`"
        )
    if running_mean is not None and running_mean.dtype == input.dtype != running_var.dtype:
        raise TypeError(
            f"{where}: expected `running_var` of dtype {input.dtype} like `running_mean` and the input, got "
            f"{running_var.dtype}"
        )
    for name, p in (("weight", weight), ("bias", bias)):
        check.param(p, name, (c,), input, where)
    check.one_dtype(input, where, weight=weight, bias=bias)
    if use_input_stats and input.numel() // max(input.shape[0] * c, 1) <= 1 and input.numel() > 0:
        raise ValueError(
            f"{where}: expected more than 1 spatial element when training, got input of shape {tuple(input.shape)}"
        )
    if not use_input_stats and (running_mean is None or running_var is None):
        raise ValueError(f"{where}: use_input_stats=False needs `running_mean` and `running_var`, got None")
    mask = check.mask(mask, input, 1, where)
    if use_input_stats:
        _check_running_written(running_mean, running_var, where)
    if running is not None:
        running = Running(running_mean, running_var, float(momentum), use_input_stats)
    return norm(input, _INSTANCE, weight, bias, eps, mask=mask, running=running, backend=backend)


def _check_running_written(running_mean: Tensor | None, running_var: Tensor | None, where: str) -> None:
    """Running statistics a call updates in place hold one element per channel: an expanded buffer (its
    channels sharing memory) would take every channel's update in one element -- torch's BatchNorm
    writes it silently, the last channel's update winning, and its InstanceNorm refuses it from inside.
    Refused by name. (The plan key holds the buffers' strides: a buffer replaced by an expanded one after
    a planned call comes here too.)"""
    if _tracing():  # a question dynamo cannot trace (an int from C++)
        return
    for name, t in (("running_mean", running_mean), ("running_var", running_var)):
        if t is not None and torch._debug_has_internal_overlap(t) == 1:
            raise ValueError(
                f"{where}: expected `{name}` whose elements do not share memory when its running statistics are "
                f"updated (training), got shape {tuple(t.shape)} with strides {t.stride()} (an expanded tensor?)"
            )


INSTANCE_NORM = hot.Op("instance_norm", checked_instance_norm, InstanceNormSettings)


def group_norm(
    input: Tensor,
    num_groups: int,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float = 1e-5,
    *,
    mask: Tensor | None = None,
    backend: str | None = None,
) -> Tensor:
    """Group Normalization over (N, C, *), as :func:`torch.nn.functional.group_norm`: the C
    channels are split into ``num_groups`` groups, statistics per sample and group.

    ``mask`` (beyond torch): bool, shaped ``(N, *)``, True = valid; statistics over valid
    positions only. A sample with no valid position normalizes to the bias."""
    settings = group_norm_settings(num_groups, None, backend)
    return hot.call(GROUP_NORM, settings, input, weight, bias, eps, None, mask)


def _group_norm(settings: GroupNormSettings, input, weight, bias, eps, running, mask) -> Tensor:
    """:func:`group_norm`'s checked call (see :mod:`normscope.hot`); the GroupNorm layer's too."""
    num_groups, num_channels, backend = settings.num_groups, settings.num_channels, settings.backend
    where = "group_norm"
    check.tensor(input, "input", where)
    check.channels_first(input, 2, where)
    # a wrong type, as torch: TypeError; an integer of any kind torch takes (NumPy's too), as a Python int
    if not isinstance(num_groups, numbers.Integral) or isinstance(num_groups, bool):
        raise TypeError(f"{where}: expected `num_groups` to be a positive int, got {num_groups!r}")
    if num_groups < 1:
        raise ValueError(f"{where}: expected `num_groups` to be a positive int, got {num_groups!r}")
    num_groups = int(num_groups)
    c = input.shape[1]
    if num_channels is not None and c != num_channels:
        raise ValueError(
            f"GroupNorm({num_groups}, {num_channels}): expected input with {num_channels} channels at "
            f"dim 1, got {c} (input shape {tuple(input.shape)})"
        )
    if c % num_groups:
        raise ValueError(
            f"{where}: expected the number of channels (input.shape[1] = {c}) to be divisible by "
            f"num_groups={num_groups}"
        )
    check.eps(eps, where)
    check.param(weight, "weight", (c,), input, where)
    check.param(bias, "bias", (c,), input, where)
    check.one_dtype(input, where, weight=weight, bias=bias)
    mask = check.mask(mask, input, 1, where)
    if input.numel() // max(input.shape[0] * num_groups, 1) == 1 and input.shape[0] == 1:
        # torch's group_norm: one value per group (batch of one) has no variance to estimate; with a mask
        # too, which only takes values away
        raise ValueError(
            f"{where}: expected more than 1 value per group, got input of shape {tuple(input.shape)} "
            f"with num_groups={num_groups} (1 value per group)"
        )
    return norm(input, _group_scope(num_groups), weight, bias, eps, mask=mask, backend=backend, op="group_norm")


GROUP_NORM = hot.Op("group_norm", _group_norm, GroupNormSettings)


def local_response_norm(input: Tensor, size: int, alpha: float = 1e-4, beta: float = 0.75, k: float = 1.0) -> Tensor:
    """Local Response Normalization across channels, as
    :func:`torch.nn.functional.local_response_norm`:
    ``b_c = a_c / (k + alpha / n * sum_{c' in window(c)} a_{c'}^2) ** beta``.

    The one layer outside the mean/variance family: its "scope" is a sliding window of ``size``
    neighbouring channels and it divides by a power of the mean square rather than a standard
    deviation, so it is not an engine configuration; it runs on ATen directly.
    """
    where = "local_response_norm"
    check.tensor(input, "input", where)
    check.channels_first(input, 3, where)
    size = check.size(size, "size", where)  # NumPy's ints too, as torch's
    if input.dim() >= 5 and not (
        input.is_contiguous() or input.dim() == 5 and input.is_contiguous(memory_format=torch.channels_last_3d)
    ):
        # torch views the axes after the third as one (``view(N, 1, C, D, -1)``), which raises for
        # layouts where they cannot merge (a transposed 5-D input); the values are the same on a copy
        input = input.contiguous()
    half = input.dtype in (torch.float16, torch.bfloat16)
    if input.dim() >= 4 and input.device.type == "cpu" and half and not torch.is_autocast_enabled("cpu"):
        # torch runs 4+ dims through avg_pool3d, which has no CPU half kernels (NotImplementedError
        # "avg_pool3d_out_frame" from inside, torch.nn's layer included): computed in fp32 and rounded once,
        # no less accurate than torch's half computation of 3-D input (avg_pool2d, its own bits). Not under
        # CPU autocast, where torch's own runs (in fp32, returning fp32): its bits and dtype, as torch.nn's
        return torch.nn.functional.local_response_norm(input.float(), size, alpha, beta, k).to(input.dtype)
    return torch.nn.functional.local_response_norm(input, size, alpha, beta, k)


def normalize(
    x: Tensor,
    dims: int | Sequence[int] | None = None,
    *,
    keep: int | Sequence[int] | None = None,
    centered: bool = True,
    groups: int = 1,
    group_dim: int = 1,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    affine_dims: int | Sequence[int] | None = None,
    eps: float = 1e-5,
    mask: Tensor | None = None,
    backend: str | None = None,
) -> Tensor:
    """Normalize ``x`` over any scope: the generic entry point of the engine.

    Args:
        x: input tensor.
        dims: the axes whose elements share one mean and variance (e.g. ``-1`` is LayerNorm,
            ``1`` on (N, C, H, W) is channels-first LayerNorm).
        keep: alternatively, the axes that keep separate statistics (``(1,)`` is BatchNorm).
        centered: subtract the mean (True) or divide by the root mean square only (False: RMSNorm).
        groups: split ``group_dim`` into this many groups reduced separately (GroupNorm).
        group_dim: the axis ``groups`` splits. Default: 1.
        weight, bias: optional affine parameters spanning ``affine_dims``.
        affine_dims: axes the affine spans. Default: ``dims`` when given, else ``group_dim``.
        eps: added to the variance inside the square root. Default: 1e-5.
        mask: optional bool tensor broadcastable to ``x``; only True elements enter statistics.
        backend: force a backend (see :mod:`normscope.engine`).

    Example::

        >>> x = torch.randn(2, 3, 4, 4)
        >>> y = normscope.normalize(x, dims=(2, 3))          # InstanceNorm without affine
        >>> y = normscope.normalize(x, keep=0, groups=3)     # GroupNorm(3, 3)
    """
    where = "normalize"
    check.tensor(x, "x", where)
    check.positive_eps(eps, where)
    if (dims is None) == (keep is None):
        raise ValueError(f"{where}: expected exactly one of `dims` and `keep`, got dims={dims!r}, keep={keep!r}")
    d = _axes(dims, "dims", x, where) if dims is not None else None
    k = _axes(keep, "keep", x, where) if keep is not None else None
    if affine_dims is None:
        affine = d if d is not None else (group_dim,)
    else:
        affine = _axes(affine_dims, "affine_dims", x, where)
    if weight is None and bias is None:
        affine = ()
    scope = Scope(reduce=d, keep=k, centered=centered, groups=groups, group_dim=group_dim, affine=affine)
    resolved = scope.resolve(tuple(x.shape))
    pshape = tuple(x.shape[a] for a in resolved.affine)
    check.param(weight, "weight", pshape, x, where)
    check.param(bias, "bias", pshape, x, where)
    if mask is not None:
        if not isinstance(mask, Tensor) or mask.dtype != torch.bool:
            got = mask.dtype if isinstance(mask, Tensor) else type(mask).__name__
            raise TypeError(f"{where}: expected `mask` to be a torch.bool tensor (True = valid), got {got}")
        # broadcastable *to* x: a mask that broadcasts with x to a larger shape ((4, 1, 5) for x (1, 3, 5))
        # made the reference return an output of that larger shape, and the composite path raise a
        # RuntimeError from inside
        try:
            fits = torch.broadcast_shapes(mask.shape, x.shape) == x.shape
        except RuntimeError:
            fits = False
        if not fits:
            got = tuple(mask.shape)
            raise ValueError(f"{where}: expected `mask` broadcastable to {tuple(x.shape)}, got {got}")
        if mask.device != x.device:
            raise ValueError(f"{where}: expected `mask` on the input's device {x.device}, got {mask.device}")
    return norm(x, resolved, weight, bias, eps, mask=mask, backend=backend)


def _axes(value: object, name: str, x: Tensor, where: str) -> tuple[int, ...]:
    """An axis or a sequence of axes of ``x``: ints (not bools), in range, none named twice -- as
    torch's reductions take them ("dim 3 appears multiple times")."""
    items = (value,) if isinstance(value, numbers.Integral) and not isinstance(value, bool) else value
    try:
        axes = tuple(items)
    except TypeError:
        raise TypeError(f"{where}: expected `{name}` to be an int or a sequence of ints, got {value!r}") from None
    for a in axes:
        if not isinstance(a, numbers.Integral) or isinstance(a, bool):
            raise TypeError(f"{where}: expected `{name}` to be an int or a sequence of ints, got {value!r}")
    axes = tuple(int(a) for a in axes)  # NumPy's ints too, as torch's reductions take them
    seen = [a % x.dim() for a in axes if -x.dim() <= a < x.dim()]  # out of range: the scope says so
    for i, a in enumerate(seen):
        if a in seen[:i]:
            raise ValueError(f"{where}: `{name}` names dim {a} more than once ({value!r}, input of {x.dim()} dims)")
    return axes


def adain(content: Tensor, style: Tensor | tuple[Tensor, Tensor], eps: float = 1e-5) -> Tensor:
    r"""Adaptive Instance Normalization (Huang & Belongie 2017, "Arbitrary Style Transfer in
    Real-time with Adaptive Instance Normalization").

    .. math:: \mathrm{AdaIN}(x, s) = \sigma(s) \frac{x - \mu(x)}{\sigma(x)} + \mu(s)

    :math:`\mu, \sigma`: per sample and channel over the spatial axes, biased variance with eps
    inside the square root (InstanceNorm's statistics; the authors' Torch code uses the biased
    variance too, with no eps on the style side -- a popular PyTorch port uses the unbiased one).
    On the engine: the content's instance statistics, then ``apply`` with the style's std folded
    into ``rstd`` and its mean added -- the affine is per (sample, channel) here, which the
    per-channel ``weight``/``bias`` of ``apply`` cannot express.

    Args:
        content: (N, C, *) with at least one spatial axis.
        style: a tensor (N or 1, C, *') with its own spatial size, or a tuple ``(style_mean,
            style_std)`` of tensors shaped (N, C), (1, C) or (C,).
        eps: added to the variances. Default: 1e-5.

    Example::

        >>> y = normscope.functional.adain(torch.randn(2, 8, 16, 16), torch.randn(2, 8, 9, 9))
    """
    where = "adain"
    check.tensor(content, "content", where)
    check.positive_eps(eps, where)
    check.channels_first(content, 3, where, "content")
    n, c = content.shape[:2]
    spatial = (1,) * (content.dim() - 2)
    if isinstance(style, tuple):
        if len(style) != 2:
            raise ValueError(f"{where}: expected `style` as a (mean, std) tuple, got a tuple of {len(style)}")
        for name, t in zip(("style_mean", "style_std"), style):
            check.tensor(t, name, where)
            if t.shape not in ((n, c), (1, c), (c,)):
                raise ValueError(
                    f"{where}: expected `{name}` of shape {(n, c)}, {(1, c)} or {(c,)}, got {tuple(t.shape)}"
                )
            if t.device != content.device:
                raise ValueError(f"{where}: expected `{name}` on {content.device}, got {t.device}")
        s_mean, s_std = (t.reshape(-1, c, *spatial) for t in style)
    else:
        check.tensor(style, "style", where)
        if style.dim() < 3 or style.shape[1] != c or style.shape[0] not in (1, n):
            raise ValueError(
                f"{where}: expected `style` of shape ({n} or 1, {c}, *) to match content {tuple(content.shape)}, "
                f"got {tuple(style.shape)}"
            )
        if style.device != content.device:
            raise ValueError(f"{where}: expected `style` on {content.device}, got {style.device}")
        s_mean, s_rstd = stats(style, _INSTANCE, eps=eps)
        s_std = s_rstd.reciprocal()
        s_mean, s_std = s_mean.reshape(-1, c, *spatial), s_std.reshape(-1, c, *spatial)
    mean, rstd = stats(content, _INSTANCE, eps=eps)
    dt = mean.dtype
    # normalized and scaled in the statistics' dtype, rounded once after the style's mean is added:
    # apply on the content itself returns its dtype, and half input was rounded twice (2x the error)
    y = _apply(content.to(dt), mean, rstd * s_std.to(dt), _INSTANCE)
    return (y + s_mean.to(dt)).to(content.dtype)


_RMS_LAST = Scope.rms()


def fused_add_rms_norm(
    x: Tensor,
    residual: Tensor,
    weight: Tensor | None = None,
    eps: float = 1e-6,
    *,
    weight_offset: float = 0.0,
    residual_fp32: bool = False,
    backend: str | None = None,
) -> tuple[Tensor, Tensor]:
    r"""Add a residual and apply RMSNorm over the last axis; returns ``(normed, new_residual)``.

    .. math::
        h = x + r, \qquad y = \frac{h}{\sqrt{\mathrm{mean}(h^2) + \epsilon}} \cdot (w + \text{offset})

    RMSNorm: Zhang & Sennrich, "Root Mean Square Layer Normalization", NeurIPS 2019. The fusion is
    the one of pre-norm transformer blocks (``residual = residual + sublayer(...)`` followed by the
    next block's norm). ``h`` is rounded to its dtype before it is normalized, exactly as "add, then
    norm", so every backend gives the same residual stream; the Triton backend does both in one pass
    (:mod:`normscope.kernels.rows`), any other adds and then normalizes. Like every op it obeys
    ``backend=``, :func:`normscope.use_backend` and ``NORMSCOPE_BACKEND``, and reports
    :func:`normscope.last_backend`. The plain-PyTorch definition is
    :func:`normscope.kernels.fused.fused_add_rms_norm_ref`.

    Args:
        x: the sublayer output, shape ``(*, N)``.
        residual: the residual stream, same shape as ``x``.
        weight: per-feature scale of shape ``(N,)``, or None. Default: ``None``
        eps: added to the mean square. Default: ``1e-6``
        weight_offset: the scale is ``weight + weight_offset`` (1.0 for Gemma's ``(1 + w)``). Default: ``0.0``
        residual_fp32: keep the new residual in fp32 (for bf16/fp16 models). Default: ``False``
        backend: force a backend (``"triton"``, ``"aten"``, ``"reference"``, ...), or None for the
            automatic choice. Default: ``None``

    Shape:
        - x, residual: ``(*, N)``; normed: like ``x``; new_residual: like ``residual`` (fp32 with
          ``residual_fp32``).

    Example::

        >>> x, r = torch.randn(2, 5, 8), torch.randn(2, 5, 8)
        >>> y, h = fused_add_rms_norm(x, r, torch.ones(8))
        >>> torch.allclose(h, x + r)
        True
    """
    where = "fused_add_rms_norm"
    check.tensor(x, "x", where)
    check.tensor(residual, "residual", where)
    if residual.shape != x.shape:
        raise ValueError(
            f"{where}: expected `residual` of the shape of x {tuple(x.shape)}, got {tuple(residual.shape)}"
        )
    if x.dim() == 0:
        raise ValueError(f"{where}: expected `x` with at least 1 dimension, got a 0-d tensor")
    if residual.device != x.device:
        raise ValueError(f"{where}: expected `residual` on {x.device}, got {residual.device}")
    if weight is not None:
        check.tensor(weight, "weight", where)  # floating point
        check.param(weight, "weight", (x.shape[-1],), x, where, any_dtype=True)  # shape, device
    check.eps(eps, where)
    weight_offset = check.weight_offset(weight_offset, where)
    if not isinstance(residual_fp32, bool):
        got = f"{type(residual_fp32).__name__} {residual_fp32!r}"
        raise TypeError(f"{where}: expected `residual_fp32` to be a bool, got {got}")
    options = {"weight_offset": weight_offset, "residual_fp32": residual_fp32, "backend": backend}
    return add_norm(x, residual, _RMS_LAST, weight, None, eps, **options)


__all__ += ["fused_add_rms_norm"]

__all__ += ["modulated_norm", "qk_norm", "poly_norm", "derf", "CASTINGS"]

for _name in __all__:  # torch.jit.script(F.layer_norm): normscope's TypeError, as for a layer
    if callable(globals()[_name]) and not isinstance(globals()[_name], type):
        hot.refuse_script_function(globals()[_name], f"normscope.functional.{_name}")
del _name
