"""LayerNorm, RMSNorm, GroupNorm and LocalResponseNorm as drop-in ``torch.nn`` layers."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from .. import _checks as check
from .. import functional as F
from .. import functional_modern as FM
from .. import hot

_WB = ("weight", "bias")
_W = ("weight",)


class _FamilyOptions:
    """The options of LayerNorm and RMSNorm that model families of 2023-2026 use (see
    :func:`normscope.functional_modern.rms_norm`): ``weight_offset`` -- the scale is ``weight +
    weight_offset``, formed in fp32; Gemma's ``1 + w`` is 1.0 (Transformer Engine's
    ``zero_centered_gamma``, Liger's ``offset``, QuACK's ``weight_offset``), and the weight then starts
    at ``1 - weight_offset`` so the layer starts as the identity scale -- and ``casting``: ``"torch"``,
    ``"gemma"`` (normalize and scale in fp32, cast last: Gemma, Gemma 2/3, OLMo 2) or ``"llama"``
    (normalize in fp32, cast to the input dtype, then scale: Llama, Mistral, Qwen 2/3). The defaults
    are torch's layer, with torch's state_dict and repr."""

    weight_offset: float = 0.0  # class attributes: the defaults add nothing to __dict__, state or repr
    casting: str = "torch"

    def _set_family(self, weight_offset: float, casting: str) -> None:
        name = type(self).__name__
        weight_offset = check.weight_offset(weight_offset, name)  # a finite number (the one rule)
        if casting not in FM.CASTINGS:
            raise ValueError(f"{name}: expected `casting` to be one of {list(FM.CASTINGS)}, got {casting!r}")
        if weight_offset != 0.0 or casting != "torch":
            self.weight_offset, self.casting = float(weight_offset), casting
            self.reset_parameters()

    def reset_parameters(self) -> None:
        super().reset_parameters()
        w = getattr(self, "weight", None)
        if self.weight_offset and w is not None:
            with torch.no_grad():
                w.fill_(1.0 - self.weight_offset)

    def extra_repr(self) -> str:
        s = super().extra_repr()
        if self.weight_offset:
            s += f", weight_offset={self.weight_offset}"
        return s if self.casting == "torch" else f"{s}, casting={self.casting!r}"


class LayerNorm(_FamilyOptions, nn.LayerNorm):
    r"""Layer Normalization over the last ``len(normalized_shape)`` dims of each sample.

    Paper: Ba et al. 2016, "Layer Normalization". Scope: :meth:`normscope.Scope.layer`.

    .. math:: y = \frac{x - \mathrm{E}[x]}{\sqrt{\mathrm{Var}[x] + \epsilon}} \gamma + \beta

    Args:
        normalized_shape: the trailing shape normalized over (an int for the last dim).
        eps: added to the variance. Default: 1e-5.
        elementwise_affine: learnable per-element ``weight`` (ones) and ``bias`` (zeros). Default: True.
        bias: with ``elementwise_affine``, whether to learn the bias too. Default: True.
        weight_offset: keyword only; the scale is ``weight + weight_offset``, formed in fp32 (1.0: a
            zero-centred weight, Gemma's ``1 + w``); the weight then starts at ``1 - weight_offset``.
            Default: 0.0.
        casting: keyword only; where the result is rounded to the input dtype: ``"torch"``,
            ``"gemma"`` (normalize and scale in fp32, cast last) or ``"llama"`` (normalize in fp32,
            cast, then scale). Default: ``"torch"``.

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
        *,
        weight_offset: float = 0.0,
        casting: str = "torch",
    ) -> None:
        shape = check.normalized_shape(normalized_shape, "LayerNorm")
        super().__init__(shape, eps, elementwise_affine, bias, device, dtype)
        self._set_family(weight_offset, casting)

    def forward(self, input: Tensor) -> Tensor:
        w, b = hot.tensors(self, _WB)
        op, settings = FM.last_axes(True, self.normalized_shape, None, self.weight_offset, self.casting)
        return hot.call(op, settings, input, w, b, self.eps)


class RMSNorm(_FamilyOptions, nn.RMSNorm):
    r"""Root Mean Square Normalization: LayerNorm without the mean and the bias.

    Paper: Zhang & Sennrich 2019, "Root Mean Square Layer Normalization".
    Scope: :meth:`normscope.Scope.rms`.

    .. math:: y = \frac{x}{\sqrt{\mathrm{E}[x^2] + \epsilon}} \gamma

    Args:
        normalized_shape: the trailing shape normalized over.
        eps: added to the mean square. Default: None, the machine epsilon of the compute dtype
            (fp32's for fp16/bf16/fp32 input).
        elementwise_affine: learnable per-element ``weight`` (ones). Default: True.
        weight_offset: keyword only; the scale is ``weight + weight_offset``, formed in fp32 (1.0:
            Gemma's ``1 + w``, Transformer Engine's ``zero_centered_gamma``); the weight then starts
            at ``1 - weight_offset``. Default: 0.0.
        casting: keyword only; where the result is rounded to the input dtype: ``"torch"``,
            ``"gemma"`` (normalize and scale in fp32, cast last) or ``"llama"`` (normalize in fp32,
            cast, then scale). Default: ``"torch"``.

    Gemma's RMSNorm is ``RMSNorm(d, eps=1e-6, weight_offset=1.0, casting="gemma")``; Llama's, Mistral's
    and Qwen's ``RMSNorm(d, eps=1e-6, casting="llama")``.

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
        *,
        weight_offset: float = 0.0,
        casting: str = "torch",
    ) -> None:
        shape = check.normalized_shape(normalized_shape, "RMSNorm")
        super().__init__(shape, eps, elementwise_affine, device, dtype)
        self._set_family(weight_offset, casting)

    def forward(self, x: Tensor) -> Tensor:
        (w,) = hot.tensors(self, _W)
        # a weight offset's scale ``w + offset`` is formed by the plan's runner in every call, as
        # torch's layers and the families' modules read their weight on every call: no key cheaper than
        # the weight's values sees every change of them (writes through ``.data``; FSDP and ZeRO-3
        # point ``param.data`` at a freshly gathered buffer before each forward)
        op, settings = FM.last_axes(False, self.normalized_shape, None, self.weight_offset, self.casting)
        return hot.call(op, settings, x, w, None, self.eps)


class _ScaleSlot:
    """What a whole-module pickle of a layer with a weight offset may hold in its ``__dict__`` (as
    ``_scale_slot``), so that such a pickle loads; nothing reads it: the scale is formed in every call."""

    __slots__ = ("entry",)

    def __init__(self) -> None:
        self.entry: tuple | None = None

    def __deepcopy__(self, memo: dict) -> _ScaleSlot:
        return _ScaleSlot()

    def __reduce__(self) -> tuple:
        return (_ScaleSlot, ())


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
        # num_channels may be 0, as torch's (an empty scope); num_groups may not (torch divides by it)
        # NumPy's ints too, as torch's, stored as Python ints
        num_groups = check.size(num_groups, "num_groups", "GroupNorm")
        num_channels = check.size(num_channels, "num_channels", "GroupNorm", low=0)
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
        settings = F.group_norm_settings(self.num_groups, self.num_channels)
        return hot.call(F.GROUP_NORM, settings, input, w, b, self.eps, None, mask)


class LocalResponseNorm(nn.LocalResponseNorm):
    r"""Local Response Normalization across neighbouring channels (AlexNet), as
    :class:`torch.nn.LocalResponseNorm`; see :func:`normscope.functional.local_response_norm`
    for why it is the one layer outside the engine."""

    def forward(self, input: Tensor) -> Tensor:
        return F.local_response_norm(input, self.size, self.alpha, self.beta, self.k)


__all__ = ["LayerNorm", "RMSNorm", "GroupNorm", "LocalResponseNorm"]
