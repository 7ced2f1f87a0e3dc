"""LayerNorm, RMSNorm, GroupNorm and LocalResponseNorm as drop-in ``torch.nn`` layers."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from .. import _checks as check
from .. import _state, hot
from .. import functional as F
from .. import functional_modern as FM
from .. import reference as ref

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
        shape = self.normalized_shape
        if self.weight_offset or self.casting != "torch":
            y = offset_rms_norm(self, x, w, shape, self.eps, self.weight_offset, self.casting)
            if y is not None:
                return y
        op, settings = FM.last_axes(False, shape, None, self.weight_offset, self.casting)
        return hot.call(op, settings, x, w, None, self.eps)


class _ScaleSlot:
    """A layer's cached scale (:func:`_offset_scale`), in the layer's ``__dict__``: neither copied nor
    pickled with it (a copy starts empty; the cached tensor may be part of an autograd graph, which
    ``copy.deepcopy`` refuses)."""

    __slots__ = ("entry",)

    def __init__(self) -> None:
        self.entry: tuple | None = None

    def __deepcopy__(self, memo: dict) -> _ScaleSlot:
        return _ScaleSlot()

    def __reduce__(self) -> tuple:
        return (_ScaleSlot, ())


def offset_rms_norm(
    layer: nn.Module, x: Tensor, w: Tensor | None, shape: tuple | None, eps: float | None, offset: float, casting: str
) -> Tensor | None:
    """A layer's RMSNorm in Gemma's order with a weight offset, ``(x32 * r * (w32 + offset)).to(x.dtype)``,
    run with the scale ``w32 + offset`` (:func:`_offset_scale`, cached on ``layer``) as its weight; None
    where that does not apply (Llama's order, no offset or weight, no cache). ``shape`` None: the
    weight's (:func:`normscope.functional_modern.by_weight`)."""
    if not offset or casting == "llama":
        return None
    scale = _offset_scale(layer, w, x, offset)
    if scale is None:
        return None
    # the same dtypes: torch's rms_norm is that order, ``(x * r) * scale`` rounded once. An fp32 scale
    # on half-precision input: Gemma's order by name ("torch" with an offset is that order too), which
    # computes in fp32 and rounds once -- torch's rms_norm would take the mixed dtypes with a warning
    # on every call
    order = "torch" if x.dtype == scale.dtype else "gemma"
    op, settings = _BY_WEIGHT[order] if shape is None else FM.last_axes(False, shape, None, 0.0, order)
    return hot.call(op, settings, x, scale, None, eps)


#: :func:`offset_rms_norm`'s ops and settings where the normalized shape is the weight's, by order
_BY_WEIGHT = {order: FM.by_weight(False, None, 0.0, order) for order in ("torch", "gemma")}


_is_compiling, _traces_here = _state.is_compiling, _state.traces_here
_is_tracing, _peek = torch._C._is_tracing, torch._C._functorch.peek_interpreter_stack


def _offset_scale(layer: nn.Module, w: Tensor | None, x: Tensor, offset: float) -> Tensor | None:
    """``w.to(acc) + offset`` (acc: ``x``'s accumulation dtype), formed once per state of the weight
    rather than on every call: forming it is ~20 % of a small layer's call.

    The key is everything the value depends on, compared on every call: the weight object itself,
    its version counter (every in-place change through the tensor or its views: an optimizer step,
    ``copy_``, ``load_state_dict``, ``nn.init``), its address, dtype, device, strides and shape
    (``.data`` reassigned by ``module.to()``/``.half()``, or to another view of the same storage
    starting at the same element, whose version counter is the storage's), the accumulation dtype,
    and whether the call records a graph for the weight's gradient and runs in inference mode. With
    a gradient the cached scale is ``w + offset`` of the graph, reused: its backward (a cast and an
    add) saves no tensor, so every backward through it is exact. A write through ``w.data`` bypasses
    the version counter (autograd does not see it either) and is seen only once the weight changes
    otherwise: write through ``w`` under ``torch.no_grad()``, as torch's optimizers and ``nn.init``
    do. None (no cache) while tracing or under a torch.func transform, and for tensor subclasses."""
    # traced (dynamo; the TorchScript tracer would bake a cached scale in as a constant) or transformed
    if w is None or (_is_compiling() and _traces_here()) or _is_tracing() or _peek() is not None:
        return None  # engine.compiling(), torch.jit.is_tracing(), engine.transformed(): inline, per call
    grad = w.requires_grad and torch.is_grad_enabled()
    inference = torch.is_inference_mode_enabled()
    slot = layer.__dict__.get("_scale_slot")
    e = None if slot is None else slot.entry
    version, ptr = w._version, w.data_ptr()
    if (
        e is not None
        and e[0] is w
        and e[1] == version
        and e[2] == ptr
        and e[3] == w.dtype
        and e[4] == w.device
        and e[5] == x.dtype
        and e[6] == grad
        and e[7] == inference
        and e[8] == offset
        and e[9] == w.stride()
        and e[10] == w.shape
    ):
        return e[11]
    if type(w) not in (nn.Parameter, Tensor):
        return None
    acc = ref.acc_dtype(x.dtype)
    if grad:
        scale = (w if w.dtype == acc else w.to(acc)) + offset
    else:
        with torch.no_grad():
            scale = (w if w.dtype == acc else w.to(acc)) + offset
    if slot is None:
        slot = layer.__dict__["_scale_slot"] = _ScaleSlot()
    slot.entry = (w, version, ptr, w.dtype, w.device, x.dtype, grad, inference, offset, w.stride(), w.shape, scale)
    return scale


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
        settings = F.group_norm_settings(self.num_groups, self.num_channels)
        return hot.call(F.GROUP_NORM, settings, input, w, b, self.eps, None, mask)


class LocalResponseNorm(nn.LocalResponseNorm):
    r"""Local Response Normalization across neighbouring channels (AlexNet), as
    :class:`torch.nn.LocalResponseNorm`; see :func:`normscope.functional.local_response_norm`
    for why it is the one layer outside the engine."""

    def forward(self, input: Tensor) -> Tensor:
        return F.local_response_norm(input, self.size, self.alpha, self.beta, self.k)


__all__ = ["LayerNorm", "RMSNorm", "GroupNorm", "LocalResponseNorm"]
