"""InstanceNorm1d/2d/3d: statistics per sample and channel over the positions.

Paper: Ulyanov et al. 2016, "Instance Normalization: The Missing Ingredient for Fast Stylization".
Scope: :meth:`normscope.Scope.instance`.
"""

from __future__ import annotations

import warnings

from torch import Tensor, nn

from .. import functional as F
from ..engine import Call, Running
from ..scope import Scope
from . import _hot
from ._hot import forget, last, shared


def _instance_norm(config: tuple, x: Tensor, w: Tensor | None, b: Tensor | None, rm: Tensor | None, rv: Tensor | None):
    """An InstanceNorm layer's checked call of a batched input with its number of channels (the
    layer checks both first), to plan a traced call with (see modules/_hot.py, ``shared``)."""
    _, _, _, use_input_stats, momentum, eps = config
    return F.instance_norm(x, rm, rv, w, b, use_input_stats, momentum, eps)


class _InstanceNormMixin(_hot.HotLayer):
    """torch's ``_InstanceNorm.forward`` (unbatched input included), routed through the engine."""

    _spatial: int

    def forward(self, input: Tensor, mask: Tensor | None = None) -> Tensor:
        """Normalize ``input``; ``mask`` (optional, bool, the input's shape without the channel
        axis, True = valid) restricts each instance's statistics to its valid positions."""
        p, bufs = self._parameters, self._buffers  # not self.weight: see modules/_hot.py
        w, b = p.get("weight", p), p.get("bias", p)  # p: the "not there" marker
        rm, rv = bufs.get("running_mean", p), bufs.get("running_var", p)
        if w is p or b is p or rm is p or rv is p or not self._normscope_direct:
            w, b, rm, rv = self.weight, self.bias, self.running_mean, self.running_var
        use_input_stats = self.training or not self.track_running_stats
        momentum = self.momentum if self.momentum is not None else 0.0
        k, hot = None, None
        if mask is None:  # batched input only: an unbatched one is unsqueezed below, the checked way
            hot = last(self, input, w, b, rm, rv)
            if (
                hot is None
                and isinstance(input, Tensor)
                and input.dim() == self._spatial + 2
                and input.shape[1] == self.num_features
            ):
                config = (_instance_norm, type(self), self.num_features, use_input_stats, momentum, self.eps)
                k, hot = shared(self, config, input, w, b, rm, rv)
        running = None
        if rm is not None or rv is not None:  # as functional.instance_norm
            running = Running(rm, rv, float(momentum), use_input_stats)
        if hot is not None:  # this signature was checked, resolved and planned before
            try:
                return hot[2](input, w, b, self.eps, running)
            except Exception:  # e.g. a parameter's data swapped for one that does not fit: say why
                forget(self)
                k = None
        name = type(self).__name__
        if not isinstance(input, Tensor):
            raise TypeError(f"{name}: expected input to be a torch.Tensor, got {type(input).__name__}")
        unbatched = self._spatial + 1
        if input.dim() not in (unbatched, unbatched + 1):
            raise ValueError(
                f"{name}: expected {unbatched}D (unbatched) or {unbatched + 1}D (batched) input, "
                f"got {input.dim()}D input of shape {tuple(input.shape)}"
            )
        feature_dim = input.dim() - unbatched
        if input.shape[feature_dim] != self.num_features:
            if self.affine or self.track_running_stats:
                raise ValueError(
                    f"{name}({self.num_features}): expected input with {self.num_features} channels at "
                    f"dim {feature_dim}, got {input.shape[feature_dim]} (input shape {tuple(input.shape)})"
                )
            warnings.warn(
                f"{name}: input's size at dim={feature_dim} ({input.shape[feature_dim]}) does not match "
                f"num_features ({self.num_features}); num_features is unused because affine=False",
                stacklevel=2,
            )
        x = input.unsqueeze(0) if feature_dim == 0 else input
        if feature_dim == 0 and isinstance(mask, Tensor):
            mask = mask.unsqueeze(0)
        y = F.instance_norm(x, rm, rv, w, b, use_input_stats, momentum, self.eps, mask=mask)
        if k is not None and feature_dim == 1 and input.shape[1] == self.num_features:  # torch warns per call
            scope = Scope.instance().resolve(input.shape)
            _hot.remember(self, k, Call(input, scope, w, b, self.eps, None, running), w, b, rm, rv)
        return y.squeeze(0) if feature_dim == 0 else y


class InstanceNorm1d(_InstanceNormMixin, nn.InstanceNorm1d):
    r"""Instance Normalization over a (N, C, L) or unbatched (C, L) input.

    .. math:: y = \frac{x - \mathrm{E}[x]}{\sqrt{\mathrm{Var}[x] + \epsilon}} \gamma + \beta

    with mean and biased variance over L, separately for each sample and channel. Same arguments
    and defaults as :class:`torch.nn.InstanceNorm1d` (``affine=False``,
    ``track_running_stats=False``).
    """

    _spatial = 1


class InstanceNorm2d(_InstanceNormMixin, nn.InstanceNorm2d):
    r"""Instance Normalization over a (N, C, H, W) or unbatched (C, H, W) input; see
    :class:`InstanceNorm1d`. Same arguments and defaults as :class:`torch.nn.InstanceNorm2d`."""

    _spatial = 2


class InstanceNorm3d(_InstanceNormMixin, nn.InstanceNorm3d):
    r"""Instance Normalization over a (N, C, D, H, W) or unbatched (C, D, H, W) input; see
    :class:`InstanceNorm1d`. Same arguments and defaults as :class:`torch.nn.InstanceNorm3d`."""

    _spatial = 3
