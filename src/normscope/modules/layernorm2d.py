"""LayerNorm2d: LayerNorm over the channel axis of a channels-first tensor (ConvNeXt).

Paper: Liu et al. 2022, "A ConvNet for the 2020s" (ConvNeXt). Scope: :meth:`normscope.Scope.channels`.
"""

from __future__ import annotations

from typing import NamedTuple

from torch import Tensor, nn

from .. import _checks as check
from .. import hot
from ..engine import norm
from ..scope import Scope

_CHANNELS = Scope.channels()
_WB = ("weight", "bias")


class LayerNorm2dSettings(NamedTuple):
    """What LayerNorm2d's checked call reads besides the tensors and ``eps``: the class's name (for
    messages) and the channels expected at dim 1."""

    name: str
    channels: int


def _layer_norm_2d(settings: LayerNorm2dSettings, input, w, b, eps, running, mask) -> Tensor:
    """LayerNorm2d's checked call (see :mod:`normscope.hot`)."""
    name, c = settings.name, settings.channels
    if not isinstance(input, Tensor):
        raise TypeError(f"{name}: expected input to be a torch.Tensor, got {type(input).__name__}")
    check.tensor(input, "input", name)
    if input.dim() < 2 or input.shape[1] != c:
        raise ValueError(
            f"{name}({c}): expected input of shape (N, {c}, *) with {c} channels at dim 1, "
            f"got shape {tuple(input.shape)}"
        )
    check.eps(eps, name)
    check.param(w, "weight", (c,), input, name)
    check.param(b, "bias", (c,), input, name)
    return norm(input, _CHANNELS, w, b, eps)


_LAYER_NORM_2D = hot.Op("LayerNorm2d", _layer_norm_2d, LayerNorm2dSettings)


class LayerNorm2d(nn.LayerNorm):
    r"""Layer Normalization over the channels of (N, C, H, W), separately at every position.

    .. math:: y_{n,:,h,w} = \frac{x_{n,:,h,w} - \mathrm{E}_c[x]}{\sqrt{\mathrm{Var}_c[x] + \epsilon}}
              \gamma + \beta

    Equal to ``LayerNorm(C)`` applied to ``x.permute(0, 2, 3, 1)`` and permuted back, without the
    two copies: the engine runs ATen's ``layer_norm`` on a ``movedim`` view, which is free when
    ``x`` is ``channels_last``. Subclasses :class:`torch.nn.LayerNorm` (``normalized_shape=(C,)``),
    so weight-decay filters that look for LayerNorm see it; the state_dict is LayerNorm's (and
    timm's ``LayerNorm2d``'s).

    Args:
        num_channels: channels C at dim 1.
        eps: added to the variance. Default: 1e-6 (ConvNeXt's).
        affine: learnable per-channel ``weight`` (ones) and ``bias`` (zeros). Default: True.

    Shape:
        - Input: (N, C, *) (any number of positions, e.g. (N, C, H, W)). Output: same shape.

    Example::

        >>> ln = normscope.LayerNorm2d(96)
        >>> y = ln(torch.randn(2, 96, 56, 56))
    """

    def __init__(self, num_channels: int, eps: float = 1e-6, affine: bool = True, device=None, dtype=None) -> None:
        num_channels = check.size(num_channels, "num_channels", "LayerNorm2d")  # NumPy's ints too
        super().__init__(num_channels, eps=eps, elementwise_affine=affine, device=device, dtype=dtype)

    @property
    def num_channels(self) -> int:
        return self.normalized_shape[0]

    def forward(self, input: Tensor) -> Tensor:
        w, b = hot.tensors(self, _WB)
        settings = (type(self).__name__, self.normalized_shape[0])  # LayerNorm2dSettings' fields
        return hot.call(_LAYER_NORM_2D, settings, input, w, b, self.eps)
