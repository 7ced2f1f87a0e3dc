"""BatchNorm1d/2d/3d: statistics per channel over the batch and every position.

Paper: Ioffe & Szegedy 2015, "Batch Normalization: Accelerating Deep Network Training by Reducing
Internal Covariate Shift". Scope: :meth:`normscope.Scope.batch`.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

from torch import Tensor, nn

from .. import _checks as check
from .. import functional as F
from .. import hot

_UNREAD = object()  # a layer's buffer not read yet (None is a value: no counter)


def momentum_factor(bn: nn.Module, num_batches_tracked: object = _UNREAD) -> float:
    """The running-statistics update factor of this step, by torch's rule: ``momentum``, or for
    ``momentum=None`` the cumulative average ``1 / (batches seen, this one included)``.
    ``num_batches_tracked``: the layer's buffer when the caller holds it already (the hot path).

    Pure: the counter moves in :func:`count_batch` (BatchNorm's hot path: once the call is checked,
    before it runs -- a refused call changes nothing, and a call that raises while it runs, such as
    the recomputation that activation checkpointing stops early, has counted, as in torch).
    """
    m = bn.momentum
    if m is not None:
        if type(m) is not float:  # the common case asks no more (a call a layer call)
            check.layer_momentum(m, type(bn).__name__)
        return m
    nbt = bn.num_batches_tracked if num_batches_tracked is _UNREAD else num_batches_tracked
    if bn.training and bn.track_running_stats and nbt is not None:
        return 1.0 / (float(nbt) + 1.0)
    return 0.0


def count_batch(bn: nn.Module, num_batches_tracked: object = _UNREAD) -> None:
    """Count a training step in ``num_batches_tracked`` (torch's bookkeeping);
    ``num_batches_tracked`` as in :func:`momentum_factor`."""
    if bn.training and bn.track_running_stats:
        nbt = bn.num_batches_tracked if num_batches_tracked is _UNREAD else num_batches_tracked
        if nbt is not None:
            nbt.add_(1)


def _check_input(cls: type, num_features: int, channel_dim: int, input: object) -> None:
    """A BatchNorm layer's own check of its input: a tensor of its class's ranks (``_dims``) with
    ``num_features`` channels at ``channel_dim``."""
    name = cls.__name__
    if not isinstance(input, Tensor):
        raise TypeError(f"{name}: expected input to be a torch.Tensor, got {type(input).__name__}")
    if input.is_nested:  # asked inline: this check runs on every call
        check.dense(input, "input", name)
    if input.dim() not in cls._dims:
        want = " or ".join(f"{d}D" for d in cls._dims)
        raise ValueError(f"{name}: expected {want} input, got {input.dim()}D input of shape {tuple(input.shape)}")
    if input.shape[channel_dim] != num_features:
        hint = ""
        if channel_dim == 1 and input.dim() > 2 and input.shape[-1] == num_features:  # the day-one mistake
            hint = (
                f"; the last axis has {num_features}: pass channel_dim=-1 for (B, S, D) input"
                if issubclass(cls, BatchNorm1d)  # and BatchRenorm1d: the layers that take channel_dim
                else f"; the last axis has {num_features}: move it to dim 1 (input.movedim(-1, 1))"
            )
        raise ValueError(
            f"{name}({num_features}): expected input with {num_features} channels at dim {channel_dim}, "
            f"got {input.shape[channel_dim]} (input shape {tuple(input.shape)}){hint}"
        )


class BatchNormLayerSettings(NamedTuple):
    """What a BatchNorm layer's checked call reads besides the tensors and ``eps``: the training flag
    and momentum come with the running statistics (a momentum of ``None`` changes every step, and
    is no part of the key)."""

    channel_dim: int




def _batch_norm(settings: BatchNormLayerSettings, x, w, b, eps, running, mask) -> Tensor:
    """A BatchNorm layer's checked call (see :mod:`normscope.hot`): :func:`normscope.functional.batch_norm`'s
    checks, with the running statistics the layer resolved (the layer checked its input first)."""
    channel_dim = settings.channel_dim
    training = running is None or running.use_input_stats
    momentum = 0.0 if running is None else running.momentum
    settings = F.BatchNormSettings._make(F.batch_norm_settings(training, momentum, channel_dim))
    return F.checked_batch_norm(settings, x, w, b, eps, running, mask)


#: the BatchNorm layers' op on the hot path (SyncBatchNorm's too, outside a process group)
LAYER_OP = hot.Op("BatchNorm", _batch_norm, BatchNormLayerSettings)
_NAMES = ("weight", "bias", "running_mean", "running_var", "num_batches_tracked")


class BatchNormMixin:
    """torch's ``_BatchNorm.forward``, routed through the engine; the rest is torch's own."""

    _dims: tuple[int, ...]
    channel_dim: int = 1  # a class attribute: the default adds nothing to __dict__, state or repr

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        device=None,
        dtype=None,
        **kw,
    ) -> None:
        # **kw: torch's keyword-only arguments of the running version (``bias=`` since 2.13)
        num_features = check.num_features(num_features, type(self).__name__, affine or track_running_stats)
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device, dtype, **kw)

    def _check_input_dim(self, input: Tensor) -> None:
        _check_input(type(self), self.num_features, self.channel_dim, input)

    def forward(self, input: Tensor, mask: Tensor | None = None) -> Tensor:
        """Normalize ``input``; ``mask`` (optional, bool, the input's shape without the channel
        axis, True = valid) restricts the statistics and the running update to valid elements."""
        self._check_input_dim(input)  # first, as torch: before the batch is counted
        w, b, rm, rv, nbt = hot.tensors(self, _NAMES)
        use_batch_stats = self.training or (rm is None and rv is None)
        if self.training and not self.track_running_stats:
            rm = rv = None
        running = None
        if rm is not None or rv is not None or not use_batch_stats:  # as functional.batch_norm
            running = hot.running((rm, rv, float(momentum_factor(self, nbt)), use_batch_stats))
        # the batch counts once the call is checked, before it runs (see hot.call)
        counts = self.training and self.track_running_stats and nbt is not None
        start = functools.partial(nbt.add_, 1) if counts else None
        settings = (self.channel_dim,)  # BatchNormLayerSettings' fields
        return hot.call(LAYER_OP, settings, input, w, b, self.eps, running, mask, start)


class BatchNorm1d(BatchNormMixin, nn.BatchNorm1d):
    r"""Batch Normalization over a 2D (N, C) or 3D (N, C, L) input.

    .. math:: y = \frac{x - \mathrm{E}[x]}{\sqrt{\mathrm{Var}[x] + \epsilon}} \gamma + \beta

    with mean and biased variance per channel over N (and L). Same arguments, defaults, buffers
    and behaviour as :class:`torch.nn.BatchNorm1d`, plus:

    Args:
        channel_dim: the channel axis: 1 (torch's layout, ``(N, C, L)``) or -1 (channels last,
            e.g. a transformer's ``(B, S, D)``, normalized per feature over batch and sequence
            without a transpose). Default: 1.

    ``forward(input, mask=None)``: ``mask`` is a bool tensor shaped like the input without the
    channel axis (``(N, L)``, or ``(B, S)`` with ``channel_dim=-1``), True = valid; statistics
    and the running update use valid elements only (see ``docs/beyond.md``).

    Shape:
        - Input: (N, C) or (N, C, L); (N, L, C) with ``channel_dim=-1``. Output: same shape.

    Example::

        >>> bn = normscope.BatchNorm1d(100)
        >>> y = bn(torch.randn(20, 100))
        >>> bn = normscope.BatchNorm1d(512, channel_dim=-1)
        >>> x, mask = torch.randn(8, 30, 512), torch.rand(8, 30) > 0.2
        >>> y = bn(x, mask)
    """

    _dims = (2, 3)

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        device=None,
        dtype=None,
        *,
        channel_dim: int = 1,
        **kw,
    ) -> None:
        # **kw: torch's keyword-only arguments of the running version (``bias=`` since 2.13)
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device, dtype, **kw)
        channel_dim = check.channel_dim(channel_dim, "BatchNorm1d")
        if channel_dim != 1:
            self.channel_dim = channel_dim

    def extra_repr(self) -> str:
        s = super().extra_repr()
        return s if self.channel_dim == 1 else f"{s}, channel_dim={self.channel_dim}"


class BatchNorm2d(BatchNormMixin, nn.BatchNorm2d):
    r"""Batch Normalization over a 4D (N, C, H, W) input; see :class:`BatchNorm1d`.

    Same arguments, defaults, buffers and behaviour as :class:`torch.nn.BatchNorm2d`.

    Example::

        >>> bn = normscope.BatchNorm2d(3)
        >>> y = bn(torch.randn(2, 3, 8, 8))
    """

    _dims = (4,)


class BatchNorm3d(BatchNormMixin, nn.BatchNorm3d):
    r"""Batch Normalization over a 5D (N, C, D, H, W) input; see :class:`BatchNorm1d`.

    Same arguments, defaults, buffers and behaviour as :class:`torch.nn.BatchNorm3d`.
    """

    _dims = (5,)
