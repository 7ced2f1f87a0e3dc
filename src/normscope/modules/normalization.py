"""LayerNorm, RMSNorm, GroupNorm and LocalResponseNorm as drop-in ``torch.nn`` layers."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from .. import _checks as check
from .. import functional as F
from ..engine import Call
from ..scope import Scope
from . import _hot
from ._hot import forget, last, shared

# RMSNorm's eps=None: the machine epsilon of the dtype statistics are computed in (functional.rms_norm)
_RMS_EPS = {torch.float64: torch.finfo(torch.float64).eps}
_FP32_EPS = torch.finfo(torch.float32).eps


class LayerNorm(_hot.HotLayer, nn.LayerNorm):
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
        p = self._parameters  # not self.weight: see modules/_hot.py
        w, b = p.get("weight", p), p.get("bias", p)  # p: the "not there" marker
        if w is p or b is p or not self._normscope_direct:
            w, b = self.weight, self.bias
        k, hot = None, last(self, input, w, b)
        if hot is None:
            k, hot = shared(self, (_layer_norm, self.normalized_shape, self.eps), input, w, b)
        if hot is not None:  # this signature was checked, resolved and planned before
            try:
                return hot[2](input, w, b, self.eps, None)
            except Exception:  # e.g. a parameter's data swapped for one that does not fit: say why
                forget(self)
                k = None
        y = F.layer_norm(input, self.normalized_shape, w, b, self.eps)
        if k is not None:
            scope = Scope.layer(len(self.normalized_shape)).resolve(input.shape)
            _hot.remember(self, k, Call(input, scope, w, b, self.eps, None, None), w, b)
        return y


class RMSNorm(_hot.HotLayer, nn.RMSNorm):
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
        p = self._parameters  # not self.weight: see modules/_hot.py
        w = p.get("weight", p)  # p: the "not there" marker
        if w is p or not self._normscope_direct:
            w = self.weight
        eps = self.eps
        if eps is None and isinstance(x, Tensor):
            eps = _RMS_EPS.get(x.dtype, _FP32_EPS)
        k, hot = None, last(self, x, w)
        if hot is None:
            k, hot = shared(self, (_rms_norm, self.normalized_shape, self.eps), x, w)
        if hot is not None:  # this signature was checked, resolved and planned before
            try:
                return hot[2](x, w, None, eps, None)
            except Exception:  # e.g. a parameter's data swapped for one that does not fit: say why
                forget(self)
                k = None
        y = F.rms_norm(x, self.normalized_shape, w, self.eps)
        if k is not None:
            scope = Scope.rms(len(self.normalized_shape)).resolve(x.shape)
            _hot.remember(self, k, Call(x, scope, w, None, eps, None, None), w)
        return y


class GroupNorm(_hot.HotLayer, nn.GroupNorm):
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
        p = self._parameters  # not self.weight: see modules/_hot.py
        w, b = p.get("weight", p), p.get("bias", p)  # p: the "not there" marker
        if w is p or b is p or not self._normscope_direct:
            w, b = self.weight, self.bias
        k, hot = None, None
        if mask is None:
            hot = last(self, input, w, b)
            if hot is None:
                k, hot = shared(self, (_group_norm, self.num_groups, self.num_channels, self.eps), input, w, b)
        if hot is not None:  # this signature was checked, resolved and planned before
            try:
                return hot[2](input, w, b, self.eps, None)  # op="group_norm": planned
            except Exception:  # e.g. a parameter's data swapped for one that does not fit: say why
                forget(self)
                k = None
        y = _group_norm((_group_norm, self.num_groups, self.num_channels, self.eps), input, w, b, mask)
        if k is not None:
            scope = Scope.group(self.num_groups).resolve(input.shape)
            _hot.remember(self, k, Call(input, scope, w, b, self.eps, None, None, op="group_norm"), w, b)
        return y


# The layers' checked calls, ``checked(config, x, *tensors)`` with ``config = (checked, *settings)``:
# what a traced call is planned with (see modules/_hot.py, ``shared``)


def _layer_norm(config: tuple, x: Tensor, w: Tensor | None, b: Tensor | None) -> Tensor:
    return F.layer_norm(x, config[1], w, b, config[2])


def _rms_norm(config: tuple, x: Tensor, w: Tensor | None) -> Tensor:
    return F.rms_norm(x, config[1], w, config[2])


def _group_norm(config: tuple, x: Tensor, w: Tensor | None, b: Tensor | None, mask: Tensor | None = None) -> Tensor:
    _, num_groups, num_channels, eps = config
    if isinstance(x, Tensor) and x.dim() >= 2 and x.shape[1] != num_channels:
        raise ValueError(
            f"GroupNorm({num_groups}, {num_channels}): expected input with {num_channels} channels at "
            f"dim 1, got {x.shape[1]} (input shape {tuple(x.shape)})"
        )
    return F.group_norm(x, num_groups, w, b, eps, mask=mask)


class LocalResponseNorm(nn.LocalResponseNorm):
    r"""Local Response Normalization across neighbouring channels (AlexNet), as
    :class:`torch.nn.LocalResponseNorm`; see :func:`normscope.functional.local_response_norm`
    for why it is the one layer outside the engine."""

    def forward(self, input: Tensor) -> Tensor:
        return F.local_response_norm(input, self.size, self.alpha, self.beta, self.k)


__all__ = ["LayerNorm", "RMSNorm", "GroupNorm", "LocalResponseNorm"]
