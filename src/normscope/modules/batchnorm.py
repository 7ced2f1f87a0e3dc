"""BatchNorm1d/2d/3d: statistics per channel over the batch and every position.

Paper: Ioffe & Szegedy 2015, "Batch Normalization: Accelerating Deep Network Training by Reducing
Internal Covariate Shift". Scope: :meth:`normscope.Scope.batch`.
"""

from __future__ import annotations

from torch import Tensor, nn

from .. import functional as F
from ..engine import Call, Running
from ..scope import Scope
from . import _hot
from ._hot import forget, last, shared

_UNREAD = object()  # a layer's buffer not read yet (None is a value: no counter)


def momentum_factor(bn: nn.Module, num_batches_tracked: object = _UNREAD) -> float:
    """The running-statistics update factor of this step, by torch's rule: ``momentum``, or for
    ``momentum=None`` the cumulative average ``1 / (batches seen, this one included)``.
    ``num_batches_tracked``: the layer's buffer when the caller holds it already (the hot path).

    Pure: the counter moves in :func:`count_batch`, once the step has succeeded (torch increments
    it first, so a rejected call would still count as a batch).
    """
    if bn.momentum is not None:
        return bn.momentum
    nbt = bn.num_batches_tracked if num_batches_tracked is _UNREAD else num_batches_tracked
    if bn.training and bn.track_running_stats and nbt is not None:
        return 1.0 / (float(nbt) + 1.0)
    return 0.0


def count_batch(bn: nn.Module, num_batches_tracked: object = _UNREAD) -> None:
    """Count a successful training step in ``num_batches_tracked`` (torch's bookkeeping);
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
    if input.dim() not in cls._dims:
        want = " or ".join(f"{d}D" for d in cls._dims)
        raise ValueError(f"{name}: expected {want} input, got {input.dim()}D input of shape {tuple(input.shape)}")
    if input.shape[channel_dim] != num_features:
        raise ValueError(
            f"{name}({num_features}): expected input with {num_features} channels at dim {channel_dim}, "
            f"got {input.shape[channel_dim]} (input shape {tuple(input.shape)})"
        )


def _batch_norm(config: tuple, x: Tensor, w: Tensor | None, b: Tensor | None, rm: Tensor | None, rv: Tensor | None):
    """A BatchNorm layer's checked call, to plan a traced call with (see modules/_hot.py, ``shared``):
    the update factor does not change the plan, so any valid one stands in for it."""
    _, cls, num_features, channel_dim, use_batch_stats, eps = config
    _check_input(cls, num_features, channel_dim, x)
    return F.batch_norm(x, rm, rv, w, b, use_batch_stats, 0.0, eps, channel_dim=channel_dim)


class _BatchNormMixin(_hot.HotLayer):
    """torch's ``_BatchNorm.forward``, routed through the engine; the rest is torch's own."""

    _dims: tuple[int, ...]
    channel_dim: int = 1  # a class attribute: the default adds nothing to __dict__, state or repr

    def _check_input_dim(self, input: Tensor) -> None:
        _check_input(type(self), self.num_features, self.channel_dim, input)

    def forward(self, input: Tensor, mask: Tensor | None = None) -> Tensor:
        """Normalize ``input``; ``mask`` (optional, bool, the input's shape without the channel
        axis, True = valid) restricts the statistics and the running update to valid elements."""
        p, bufs = self._parameters, self._buffers  # not self.weight: see modules/_hot.py
        w, b = p.get("weight", p), p.get("bias", p)  # p: the "not there" marker
        rm, rv, nbt = bufs.get("running_mean", p), bufs.get("running_var", p), bufs.get("num_batches_tracked", p)
        if w is p or b is p or rm is p or rv is p or nbt is p or not self._normscope_direct:
            w, b, rm, rv, nbt = self.weight, self.bias, self.running_mean, self.running_var, self.num_batches_tracked
        use_batch_stats = self.training or (rm is None and rv is None)
        if self.training and not self.track_running_stats:
            rm = rv = None
        factor = momentum_factor(self, nbt)
        running = None
        if rm is not None or rv is not None or not use_batch_stats:  # as functional.batch_norm
            running = Running(rm, rv, float(factor), use_batch_stats)
        k, hot = None, None
        if mask is None:
            hot = last(self, input, w, b, rm, rv)
            if hot is None:
                # the class too: its _check_input_dim accepts its own ranks only (a subclass's own
                # _check_input_dim: the traced call takes the checked path, which asks it)
                checked = _batch_norm if type(self)._check_input_dim is _BatchNormMixin._check_input_dim else None
                config = (checked, type(self), self.num_features, self.channel_dim, use_batch_stats, self.eps)
                k, hot = shared(self, config, input, w, b, rm, rv)
        if hot is not None:  # this signature was checked, resolved and planned before
            try:
                y = hot[2](input, w, b, self.eps, running)
            except Exception:  # e.g. a parameter's data swapped for one that does not fit: say why
                forget(self)
                k = None
            else:
                count_batch(self, nbt)
                return y
        self._check_input_dim(input)
        y = F.batch_norm(
            input, rm, rv, w, b, use_batch_stats, factor, self.eps, mask=mask, channel_dim=self.channel_dim
        )
        count_batch(self, nbt)
        if k is not None:
            scope = Scope.batch(self.channel_dim).resolve(input.shape)
            _hot.remember(self, k, Call(input, scope, w, b, self.eps, None, running), w, b, rm, rv)
        return y


class BatchNorm1d(_BatchNormMixin, nn.BatchNorm1d):
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
        if channel_dim not in (1, -1):
            raise ValueError(f"BatchNorm1d: expected `channel_dim` to be 1 or -1, got {channel_dim!r}")
        if channel_dim != 1:
            self.channel_dim = channel_dim

    def extra_repr(self) -> str:
        s = super().extra_repr()
        return s if self.channel_dim == 1 else f"{s}, channel_dim={self.channel_dim}"


class BatchNorm2d(_BatchNormMixin, nn.BatchNorm2d):
    r"""Batch Normalization over a 4D (N, C, H, W) input; see :class:`BatchNorm1d`.

    Same arguments, defaults, buffers and behaviour as :class:`torch.nn.BatchNorm2d`.

    Example::

        >>> bn = normscope.BatchNorm2d(3)
        >>> y = bn(torch.randn(2, 3, 8, 8))
    """

    _dims = (4,)


class BatchNorm3d(_BatchNormMixin, nn.BatchNorm3d):
    r"""Batch Normalization over a 5D (N, C, D, H, W) input; see :class:`BatchNorm1d`.

    Same arguments, defaults, buffers and behaviour as :class:`torch.nn.BatchNorm3d`.
    """

    _dims = (5,)
