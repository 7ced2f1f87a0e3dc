"""BatchNorm1d/2d/3d: statistics per channel over the batch and every position.

Paper: Ioffe & Szegedy 2015, "Batch Normalization: Accelerating Deep Network Training by Reducing
Internal Covariate Shift". Scope: :meth:`normscope.Scope.batch`.
"""

from __future__ import annotations

from torch import Tensor, nn

from .. import functional as F


class _BatchNormMixin:
    """torch's ``_BatchNorm.forward``, routed through the engine; the rest is torch's own."""

    _dims: tuple[int, ...]

    def _check_input_dim(self, input: Tensor) -> None:
        name = type(self).__name__
        if not isinstance(input, Tensor):
            raise TypeError(f"{name}: expected input to be a torch.Tensor, got {type(input).__name__}")
        if input.dim() not in self._dims:
            want = " or ".join(f"{d}D" for d in self._dims)
            raise ValueError(f"{name}: expected {want} input, got {input.dim()}D input of shape {tuple(input.shape)}")
        if input.shape[1] != self.num_features:
            raise ValueError(
                f"{name}({self.num_features}): expected input with {self.num_features} channels at dim 1, "
                f"got {input.shape[1]} (input shape {tuple(input.shape)})"
            )

    def forward(self, input: Tensor) -> Tensor:
        self._check_input_dim(input)
        # exactly torch's bookkeeping: momentum=None means a cumulative average over the batches seen
        factor = 0.0 if self.momentum is None else self.momentum
        # the counter moves only once F.batch_norm has accepted the input (torch increments it
        # first, so a rejected call would still count as a batch)
        count = self.training and self.track_running_stats and self.num_batches_tracked is not None
        if count and self.momentum is None:
            factor = 1.0 / (float(self.num_batches_tracked) + 1.0)
        use_batch_stats = self.training or (self.running_mean is None and self.running_var is None)
        keep_running = not self.training or self.track_running_stats
        y = F.batch_norm(
            input,
            self.running_mean if keep_running else None,
            self.running_var if keep_running else None,
            self.weight,
            self.bias,
            use_batch_stats,
            factor,
            self.eps,
        )
        if count:
            self.num_batches_tracked.add_(1)
        return y


class BatchNorm1d(_BatchNormMixin, nn.BatchNorm1d):
    r"""Batch Normalization over a 2D (N, C) or 3D (N, C, L) input.

    .. math:: y = \frac{x - \mathrm{E}[x]}{\sqrt{\mathrm{Var}[x] + \epsilon}} \gamma + \beta

    with mean and biased variance per channel over N (and L). Same arguments, defaults, buffers
    and behaviour as :class:`torch.nn.BatchNorm1d`.

    Shape:
        - Input: (N, C) or (N, C, L). Output: same shape.

    Example::

        >>> bn = normscope.BatchNorm1d(100)
        >>> y = bn(torch.randn(20, 100))
    """

    _dims = (2, 3)


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
