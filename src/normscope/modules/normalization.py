"""LayerNorm, RMSNorm, GroupNorm and LocalResponseNorm as drop-in ``torch.nn`` layers."""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor, nn

from .. import _checks as check
from .. import functional as F
from .. import hot

_WB = ("weight", "bias")
_W = ("weight",)


class LayerNorm(nn.LayerNorm):
    r"""Layer Normalization over the last ``len(normalized_shape)`` dims of each sample.

    Paper: Ba et al. 2016, "Layer Normalization". Scope: :meth:`normscope.Scope.layer`.

    .. math:: y = \frac{x - \mathrm{E}[x]}{\sqrt{\mathrm{Var}[x] + \epsilon}} \gamma + \beta

    Args:
        normalized_shape: the trailing shape normalized over (an int for the last dim).
        eps: added to the variance. Default: 1e-5.
        elementwise_affine: learnable per-element ``weight`` (ones) and ``bias`` (zeros). Default: True.
        bias: with ``elementwise_affine``, whether to learn the bias too. Default: True.

    Shape:
        - Input: (*, normalized_shape). Output: same shape.

    Example::

        >>> ln = normscope.LayerNorm(512)
        >>> y = ln(torch.randn(4, 10, 512))
    """

    def __init__(
        self,
        normalized_shape: int | Sequence[int],
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        bias: bool = True,
        device=None,
        dtype=None,
    ) -> None:
        shape = check.normalized_shape(normalized_shape, "LayerNorm")
        super().__init__(shape, eps, elementwise_affine, bias, device, dtype)

    def forward(self, input: Tensor) -> Tensor:
        w, b = hot.tensors(self, _WB)
        shape = self.normalized_shape
        settings = ("layer_norm", True, shape, type(shape), None)
        return hot.call(F._LAYER_NORM, settings, input, w, b, self.eps)


class RMSNorm(nn.RMSNorm):
    r"""Root Mean Square Normalization: LayerNorm without the mean and the bias.

    Paper: Zhang & Sennrich 2019, "Root Mean Square Layer Normalization".
    Scope: :meth:`normscope.Scope.rms`.

    .. math:: y = \frac{x}{\sqrt{\mathrm{E}[x^2] + \epsilon}} \gamma

    Args:
        normalized_shape: the trailing shape normalized over.
        eps: added to the mean square. Default: None, the machine epsilon of the compute dtype
            (fp32's for fp16/bf16/fp32 input).
        elementwise_affine: learnable per-element ``weight`` (ones). Default: True.

    Shape:
        - Input: (*, normalized_shape). Output: same shape.
    """

    def __init__(
        self,
        normalized_shape: int | Sequence[int],
        eps: float | None = None,
        elementwise_affine: bool = True,
        device=None,
        dtype=None,
    ) -> None:
        shape = check.normalized_shape(normalized_shape, "RMSNorm")
        super().__init__(shape, eps, elementwise_affine, device, dtype)

    def forward(self, x: Tensor) -> Tensor:
        (w,) = hot.tensors(self, _W)
        shape = self.normalized_shape
        settings = ("rms_norm", False, shape, type(shape), None)
        return hot.call(F._RMS_NORM, settings, x, w, None, self.eps)


class GroupNorm(nn.GroupNorm):
    r"""Group Normalization: channels split into ``num_groups`` groups; statistics per sample and
    group over the group's channels and every position.

    Paper: Wu & He 2018, "Group Normalization". Scope: :meth:`normscope.Scope.group`.
    ``GroupNorm(1, C)`` is LayerNorm over (C, *) with per-channel affine, and ``GroupNorm(C, C)``
    is InstanceNorm with affine: their scopes resolve to the same value.

    Args:
        num_groups: number of groups; must divide ``num_channels``.
        num_channels: channels expected in the input (dim 1).
        eps: added to the variance. Default: 1e-5.
        affine: learnable per-channel ``weight`` (ones) and ``bias`` (zeros). Default: True.

    Shape:
        - Input: (N, C, *). Output: same shape.
    """

    def __init__(
        self,
        num_groups: int,
        num_channels: int,
        eps: float = 1e-5,
        affine: bool = True,
        device=None,
        dtype=None,
        **kw,
    ) -> None:
        # **kw: torch's keyword-only arguments of the running version (``bias=`` since 2.13)
        for name, v in (("num_groups", num_groups), ("num_channels", num_channels)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"GroupNorm: expected `{name}` to be a positive int, got {v!r}")
        if num_channels % num_groups:
            raise ValueError(
                f"GroupNorm: expected num_channels ({num_channels}) to be divisible by num_groups "
                f"({num_groups}); valid num_groups for {num_channels} channels: "
                f"{[g for g in range(1, num_channels + 1) if num_channels % g == 0]}"
            )
        super().__init__(num_groups, num_channels, eps, affine, device, dtype, **kw)

    def forward(self, input: Tensor, mask: Tensor | None = None) -> Tensor:
        """Normalize ``input``; ``mask`` (optional, bool, ``(N, *)``, True = valid) restricts each
        group's statistics to valid positions."""
        w, b = hot.tensors(self, _WB)
        groups = self.num_groups
        settings = (groups, type(groups), self.num_channels, None)
        return hot.call(F._GROUP_NORM, settings, input, w, b, self.eps, None, mask)


class LocalResponseNorm(nn.LocalResponseNorm):
    r"""Local Response Normalization across neighbouring channels (AlexNet), as
    :class:`torch.nn.LocalResponseNorm`; see :func:`normscope.functional.local_response_norm`
    for why it is the one layer outside the engine."""

    def forward(self, input: Tensor) -> Tensor:
        return F.local_response_norm(input, self.size, self.alpha, self.beta, self.k)


__all__ = ["LayerNorm", "RMSNorm", "GroupNorm", "LocalResponseNorm"]
