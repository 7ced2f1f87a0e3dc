"""Functional normalization with ``torch.nn.functional``'s signatures.

Each function checks its arguments, builds its :class:`~normscope.scope.Scope` and calls the one
engine (:func:`normscope.engine.norm`). Every function also takes ``backend=`` (``"auto"``,
``"aten"``, ``"reference"``, ``"triton"``...) to force a backend for that call.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from . import _checks as check
from .engine import Running, norm
from .scope import Scope

__all__ = [
    "batch_norm",
    "instance_norm",
    "layer_norm",
    "rms_norm",
    "group_norm",
    "local_response_norm",
    "normalize",
]

_LAYER_SCOPES = {k: Scope.layer(k) for k in range(1, 9)}
_RMS_SCOPES = {k: Scope.rms(k) for k in range(1, 9)}
_BATCH = Scope.batch(1)
_INSTANCE = Scope.instance()


def _layer_scope(k: int, centered: bool) -> Scope:
    table = _LAYER_SCOPES if centered else _RMS_SCOPES
    return table.get(k) or (Scope.layer(k) if centered else Scope.rms(k))


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
    backend: str | None = None,
) -> Tensor:
    """Batch Normalization over (N, C, *): statistics per channel, over the batch and positions.

    Same signature and semantics as :func:`torch.nn.functional.batch_norm`: in training the batch
    statistics normalize and (with running buffers) update ``running_mean``/``running_var`` in
    place, the variance with Bessel's correction; otherwise the running buffers normalize.
    """
    where = "batch_norm"
    check.tensor(input, "input", where)
    if input.dim() < 2:
        raise ValueError(f"{where}: expected input of shape (N, C, *) with at least 2 dims, got shape {tuple(input.shape)}")
    c = input.shape[1]
    for name, p in (("running_mean", running_mean), ("running_var", running_var), ("weight", weight), ("bias", bias)):
        check.param(p, name, (c,), input, where)
    if training:
        if input.numel() // max(c, 1) <= 1 and input.numel() > 0:
            raise ValueError(
                f"{where}: expected more than 1 value per channel when training, got input of shape "
                f"{tuple(input.shape)} (1 value per channel)"
            )
    elif running_mean is None or running_var is None:
        raise ValueError(f"{where}: evaluation (training=False) needs `running_mean` and `running_var`, got None")
    running = None
    if running_mean is not None or running_var is not None or not training:
        running = Running(running_mean, running_var, 0.0 if momentum is None else float(momentum), training)
    return norm(input, _BATCH, weight, bias, eps, running=running, backend=backend)


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
    backend: str | None = None,
) -> Tensor:
    """Instance Normalization over (N, C, *): statistics per sample and channel, over positions.

    Same as :func:`torch.nn.functional.instance_norm`; running buffers (if given) receive the
    batch average of the per-instance statistics.
    """
    where = "instance_norm"
    check.tensor(input, "input", where)
    if input.dim() < 3:
        raise ValueError(f"{where}: expected input of shape (N, C, *) with at least 3 dims, got shape {tuple(input.shape)}")
    c = input.shape[1]
    for name, p in (("running_mean", running_mean), ("running_var", running_var), ("weight", weight), ("bias", bias)):
        check.param(p, name, (c,), input, where)
    if use_input_stats and input.numel() // max(input.shape[0] * c, 1) <= 1 and input.numel() > 0:
        raise ValueError(
            f"{where}: expected more than 1 spatial element when training, got input of shape {tuple(input.shape)}"
        )
    if not use_input_stats and (running_mean is None or running_var is None):
        raise ValueError(f"{where}: use_input_stats=False needs `running_mean` and `running_var`, got None")
    running = None
    if running_mean is not None or running_var is not None:
        running = Running(running_mean, running_var, float(momentum), use_input_stats)
    return norm(input, _INSTANCE, weight, bias, eps, running=running, backend=backend)


def _last_axes(
    where: str,
    centered: bool,
    input: Tensor,
    normalized_shape: int | Sequence[int],
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float,
    backend: str | None,
) -> Tensor:
    check.tensor(input, "input", where)
    shape = check.normalized_shape(normalized_shape, where)
    check.trailing(input, shape, where)
    check.param(weight, "weight", shape, input, where, any_dtype=not centered)  # torch's rms_norm: any
    check.param(bias, "bias", shape, input, where)
    return norm(input, _layer_scope(len(shape), centered), weight, bias, eps, backend=backend)


def layer_norm(
    input: Tensor,
    normalized_shape: int | Sequence[int],
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float = 1e-5,
    *,
    backend: str | None = None,
) -> Tensor:
    """Layer Normalization over the last ``len(normalized_shape)`` dims, as
    :func:`torch.nn.functional.layer_norm`."""
    return _last_axes("layer_norm", True, input, normalized_shape, weight, bias, eps, backend)


def rms_norm(
    input: Tensor,
    normalized_shape: int | Sequence[int],
    weight: Tensor | None = None,
    eps: float | None = None,
    *,
    backend: str | None = None,
) -> Tensor:
    """Root Mean Square Normalization over the last dims, as :func:`torch.nn.functional.rms_norm`.

    ``eps=None`` is the machine epsilon of the dtype the statistics are computed in: fp32's for
    fp16/bf16/fp32 input, fp64's for fp64 input.
    """
    if eps is None and isinstance(input, Tensor):
        eps = torch.finfo(torch.float64 if input.dtype == torch.float64 else torch.float32).eps
    return _last_axes("rms_norm", False, input, normalized_shape, weight, None, eps, backend)


def group_norm(
    input: Tensor,
    num_groups: int,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float = 1e-5,
    *,
    backend: str | None = None,
) -> Tensor:
    """Group Normalization over (N, C, *), as :func:`torch.nn.functional.group_norm`: the C
    channels are split into ``num_groups`` groups, statistics per sample and group."""
    where = "group_norm"
    check.tensor(input, "input", where)
    if input.dim() < 2:
        raise ValueError(f"{where}: expected input of shape (N, C, *) with at least 2 dims, got shape {tuple(input.shape)}")
    if not isinstance(num_groups, int) or isinstance(num_groups, bool) or num_groups < 1:
        raise ValueError(f"{where}: expected `num_groups` to be a positive int, got {num_groups!r}")
    c = input.shape[1]
    if c % num_groups:
        raise ValueError(
            f"{where}: expected the number of channels (input.shape[1] = {c}) to be divisible by "
            f"num_groups={num_groups}"
        )
    check.param(weight, "weight", (c,), input, where)
    check.param(bias, "bias", (c,), input, where)
    return norm(input, Scope.group(num_groups), weight, bias, eps, backend=backend)


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
    if input.dim() < 3:
        raise ValueError(f"{where}: expected input of shape (N, C, *) with at least 3 dims, got shape {tuple(input.shape)}")
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"{where}: expected `size` to be a positive int, got {size!r}")
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
    as_tuple = lambda a: (a,) if isinstance(a, int) else tuple(a)  # noqa: E731
    d = as_tuple(dims) if dims is not None else None
    k = as_tuple(keep) if keep is not None else None
    if affine_dims is None:
        affine = d if d is not None else (group_dim,)
    else:
        affine = as_tuple(affine_dims)
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
        try:
            torch.broadcast_shapes(mask.shape, x.shape)
        except RuntimeError:
            raise ValueError(f"{where}: expected `mask` broadcastable to {tuple(x.shape)}, got {tuple(mask.shape)}") from None
        if mask.device != x.device:
            raise ValueError(f"{where}: expected `mask` on the input's device {x.device}, got {mask.device}")
    return norm(x, resolved, weight, bias, eps, mask=mask, backend=backend)
