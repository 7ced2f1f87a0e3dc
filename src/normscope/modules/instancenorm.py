"""InstanceNorm1d/2d/3d: statistics per sample and channel over the positions.

Paper: Ulyanov et al. 2016, "Instance Normalization: The Missing Ingredient for Fast Stylization".
Scope: :meth:`normscope.Scope.instance`.
"""

from __future__ import annotations

import warnings
from typing import NamedTuple

from torch import Tensor, nn

from .. import _checks as check
from .. import functional as F
from .. import hot

_NAMES = ("weight", "bias", "running_mean", "running_var")


class InstanceNormLayerSettings(NamedTuple):
    """What an InstanceNorm layer's checked call reads besides the tensors and ``eps``
    (:func:`layer_settings`)."""

    name: str
    spatial: int
    num_features: int
    #: whether a channel count other than ``num_features`` is refused (else warned about, as torch)
    strict: bool
    use_input_stats: bool
    momentum: float


def layer_settings(layer: nn.Module, use_input_stats: bool, momentum: float) -> tuple:
    """The fields of :class:`InstanceNormLayerSettings` for ``layer``."""
    strict = layer.affine or layer.track_running_stats
    return (type(layer).__name__, layer._spatial, layer.num_features, strict, use_input_stats, momentum)


def _instance_norm(settings: tuple, input, w, b, eps, running, mask) -> Tensor:
    """An InstanceNorm layer's checked call (see :mod:`normscope.hot`): torch's ``_InstanceNorm``
    rules for the input (unbatched input, a channel count that ``affine=False`` ignores with a warning
    on every call), then :func:`normscope.functional.instance_norm`'s checks."""
    name, spatial, num_features, strict = settings.name, settings.spatial, settings.num_features, settings.strict
    use_input_stats, momentum = settings.use_input_stats, settings.momentum
    if not isinstance(input, Tensor):
        raise TypeError(f"{name}: expected input to be a torch.Tensor, got {type(input).__name__}")
    check.dense(input, "input", name)
    unbatched = spatial + 1
    if input.dim() not in (unbatched, unbatched + 1):
        raise ValueError(
            f"{name}: expected {unbatched}D (unbatched) or {unbatched + 1}D (batched) input, "
            f"got {input.dim()}D input of shape {tuple(input.shape)}"
        )
    feature_dim = input.dim() - unbatched
    if input.shape[feature_dim] != num_features:
        if strict:
            raise ValueError(
                f"{name}({num_features}): expected input with {num_features} channels at "
                f"dim {feature_dim}, got {input.shape[feature_dim]} (input shape {tuple(input.shape)})"
            )
        hot.per_call()  # torch warns on every call
        warnings.warn(
            f"{name}: input's size at dim={feature_dim} ({input.shape[feature_dim]}) does not match "
            f"num_features ({num_features}); num_features is unused because affine=False",
            stacklevel=4,
        )
    rm, rv = (None, None) if running is None else running[:2]
    if feature_dim == 0:  # unbatched: a call of its own (never planned: the entry cannot unsqueeze)
        # the mask checked against the input as given: checked after the unsqueeze, a wrong one was named by
        # the batched shapes ("expected `mask` of shape (1, 7) ..., got (1, 5)" for a (5,) mask of (3, 7) input)
        check.mask(mask, input, 0, name)
        mask = mask.unsqueeze(0) if isinstance(mask, Tensor) else mask
        y = F.instance_norm(input.unsqueeze(0), rm, rv, w, b, use_input_stats, momentum, eps, mask=mask)
        return y.squeeze(0)
    settings = F.InstanceNormSettings._make(F.instance_norm_settings(use_input_stats, momentum))
    return F.checked_instance_norm(settings, input, w, b, eps, running, mask)


class _InstanceNormMixin:
    """torch's ``_InstanceNorm.forward`` (unbatched input included), routed through the engine."""

    _spatial: int

    def forward(self, input: Tensor, mask: Tensor | None = None) -> Tensor:
        """Normalize ``input``; ``mask`` (optional, bool, the input's shape without the channel
        axis, True = valid) restricts each instance's statistics to its valid positions."""
        w, b, rm, rv = hot.tensors(self, _NAMES)
        use_input_stats = self.training or not self.track_running_stats
        momentum = self.momentum
        if momentum is None:
            momentum = 0.0
        elif type(momentum) is not float:  # the common case asks no more (a call a layer call)
            check.layer_momentum(momentum, type(self).__name__)
            momentum = float(momentum)
        running = None
        if rm is not None or rv is not None:  # as functional.instance_norm
            running = hot.running((rm, rv, momentum, use_input_stats))
        settings = layer_settings(self, use_input_stats, momentum)
        return hot.call(_INSTANCE_NORM, settings, input, w, b, self.eps, running, mask)


_INSTANCE_NORM = hot.Op("InstanceNorm", _instance_norm, InstanceNormLayerSettings)


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
