"""The normalizations of 2023-2026 models, as configurations of the one engine.

Each is a scope plus where its affine comes from, or an element-wise map:

================== ===========================================================================
``modulated_norm``  AdaLN (DiT, SD3, Flux): LayerNorm/RMSNorm over the last axis, then an affine
                    that comes from another tensor -- ``(1 + scale)`` and ``shift`` per sample
                    (B, D) or per token (B, S, D) -- as AdaIN's comes from the style's statistics
``qk_norm``         QK-norm (Qwen3, Gemma 3, OLMo 2, ViT-22B): the RMSNorm (or LayerNorm) scope over
                    ``head_dim`` of each head, or over all heads at once (OLMo 2), for q and k
``rms_norm``,       zero-centred weight (Gemma: scale ``1 + w`` formed in fp32) and the model
``layer_norm``      families' casting orders (``casting="gemma"``/``"llama"``)
``poly_norm``       PolyNorm (PolyCom): ``w0 rms(x^3) + w1 rms(x^2) + w2 rms(x) + b``, three RMSNorm
                    scopes on the powers of ``x``
``derf``            Derf: ``gamma * erf(alpha * x + s) + beta``, element-wise like DyT (no scope)
================== ===========================================================================

The statistics always come from :func:`normscope.engine.norm` (so from whichever backend it
chooses or is forced to). The families' options -- the zero-centred weight and the casting orders --
are fields of the engine's call (:class:`normscope.engine.Call`), defined once in
:func:`normscope.reference.cast_affine` and run by the backends; ``rms_norm`` and ``layer_norm``,
the torch-named ops that take them, are defined here and are :mod:`normscope.functional`'s (which
imports this module: the dependency is one way). They are left out of ``__all__`` so that
``from normscope.functional_modern import *`` does not shadow ``torch.nn.functional``'s names.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from . import _checks as check
from . import hot
from .backends import TRITON
from .engine import norm, requested_backend, transformed_eagerly
from .reference import CASTINGS, acc_dtype
from .scope import Scope

if TRITON:
    # imported here, not in the forced-Triton branches below: an import inside a function that
    # torch.compile traces breaks its graph on torch 2.11 ("Bad import result")
    from .backends import triton as _triton_door

__all__ = ["modulated_norm", "qk_norm", "poly_norm", "derf", "CASTINGS"]

_SCOPES = {
    (k, c): Scope(reduce=tuple(range(-k, 0)), centered=c, affine=tuple(range(-k, 0)))
    for k in range(1, 9)
    for c in (True, False)
}


# -- argument checks: each names the function, the argument, what was expected and what came -----


_tensor = check.tensor  # a floating-point tensor, as every op's input


def _optional(t: object, name: str, shape: tuple[int, ...], x: Tensor, where: str) -> None:
    if t is None:
        return
    _tensor(t, name, where)
    if tuple(t.shape) != tuple(shape) and not (t.dim() == 1 and t.numel() == _prod(shape)):
        raise ValueError(f"{where}: expected `{name}` of shape {tuple(shape)}, got {tuple(t.shape)}")
    if t.device != x.device:
        raise ValueError(f"{where}: expected `{name}` on {x.device} (the input's device), got {t.device}")


def _eps(eps: object, where: str) -> float:
    check.eps(eps, where)  # the one rule of every op but BatchNorm's (normscope._checks.eps)
    return float(eps)


def _choice(value: object, name: str, options: Sequence[str], where: str) -> None:
    if not isinstance(value, str) or value not in options:
        raise ValueError(f"{where}: expected `{name}` to be one of {tuple(options)}, got {value!r}")


def _fused(backend: str | None) -> tuple[bool, str | None]:
    """``(fused, backend)``: whether a modern op runs its fused Triton kernel -- ``backend="triton"``
    requested (forced) -- and the backend its composition runs on otherwise. Inside torch.func transforms
    and forward-mode AD the kernels have no batching or forward-derivative rules (functorch raised
    "Cannot access storage of TensorWrapper"): there a forced ``"triton"`` runs the composition on the
    reference (``last_backend()`` says so). A call dynamo traces keeps the kernels' custom ops
    (:func:`normscope.engine.transformed_eagerly`)."""
    if requested_backend(backend) != "triton":
        return False, backend
    if transformed_eagerly():
        return False, "reference"
    return True, backend


def _prod(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


# -- LayerNorm / RMSNorm over the last axes, with the model families' options ----------------------


class LastAxesSettings(NamedTuple):
    """What :func:`layer_norm`'s and :func:`rms_norm`'s checked call reads besides the tensors and
    ``eps`` (see :func:`last_axes`)."""

    where: str
    centered: bool
    normalized_shape: object
    #: its type (a list and a tuple check alike but are keys of their own), with its sizes' type
    #: names where they are not all ints
    shape_type: type | tuple
    backend: str | None


class FamilySettings(NamedTuple):
    """:class:`LastAxesSettings` with a model family's options (:func:`last_axes`)."""

    where: str
    centered: bool
    normalized_shape: object
    shape_type: type | tuple
    backend: str | None
    weight_offset: float
    offset_type: type
    casting: str


def last_axes(
    centered: bool,
    normalized_shape: object,
    backend: str | None = None,
    weight_offset: float = 0.0,
    casting: str = "torch",
) -> tuple[hot.Op, tuple]:
    """The op and settings of a LayerNorm (``centered``) or RMSNorm call over the last axes -- the
    fields of :class:`LastAxesSettings`, or with a family's options of :class:`FamilySettings` (see
    :class:`normscope.hot.Op`): the one place the functional form, the layers and the Hugging Face
    patch build them. The family options have ops of their own, whose keys hold three settings more
    that the plain calls need not compare."""
    if type(normalized_shape) is list:  # hashable, for the plan's key
        normalized_shape = tuple(normalized_shape)
    where = "layer_norm" if centered else "rms_norm"
    shape_type = type(normalized_shape)
    if shape_type is tuple:
        for d in normalized_shape:  # a loop, not a helper: dynamo would guard on a function
            if type(d) is not int:
                # (64.0,) == (64,) and hashes alike: the sizes' types are part of the key, or a plan
                # made for ints would run a float size that the checks refuse (names: constants for dynamo)
                shape_type = ("tuple", *(type(n).__name__ for n in normalized_shape))
                break
    if weight_offset == 0.0 and casting == "torch":
        settings = (where, centered, normalized_shape, shape_type, backend)
        return (LAYER_NORM if centered else RMS_NORM), settings
    settings = (where, centered, normalized_shape, shape_type, backend, weight_offset, type(weight_offset), casting)
    return (LAYER_NORM_FAMILY if centered else RMS_NORM_FAMILY), settings


def _last_axes(settings: LastAxesSettings | FamilySettings, input, weight, bias, eps, running, mask) -> Tensor:
    """:func:`layer_norm`'s and :func:`rms_norm`'s checked call (see :mod:`normscope.hot`)."""
    where, centered = settings.where, settings.centered
    normalized_shape, backend = settings.normalized_shape, settings.backend
    family = len(settings) > len(LastAxesSettings._fields)
    check.tensor(input, "input", where)
    shape = check.normalized_shape(normalized_shape, where)
    check.trailing(input, shape, where)
    if eps is None and not centered:  # rms_norm's default: the machine epsilon of the compute dtype
        eps = torch.finfo(acc_dtype(input.dtype)).eps
    check.eps(eps, where)
    scope = _SCOPES.get((len(shape), centered))
    if scope is None:
        axes = tuple(range(-len(shape), 0))
        scope = Scope(reduce=axes, centered=centered, affine=axes)
    if not family:
        check.param(weight, "weight", shape, input, where, any_dtype=not centered)  # torch's rms_norm: any
        check.param(bias, "bias", shape, input, where)
        if centered:
            check.one_dtype(input, where, weight=weight, bias=bias)
        return norm(input, scope, weight, bias, eps, backend=backend)
    # a family's parameters may be of any floating dtype (an fp32 weight on bf16 input: Llama's
    # casting then gives fp32), and flat over several normalized axes
    offset, casting = check.weight_offset(settings.weight_offset, where), settings.casting
    _choice(casting, "casting", CASTINGS, where)
    _optional(weight, "weight", shape, input, where)
    _optional(bias, "bias", shape, input, where)
    fused, backend = _fused(backend)
    if casting != "llama" and fused:
        # forced: one launch, the rows kernel forms w + offset in fp32 and rounds the result once
        return _triton_door.offset_rows_norm(input, _prod(shape), weight, bias, eps, centered, offset)
    return norm(input, scope, weight, bias, eps, backend=backend, weight_offset=offset, casting=casting)


class ByWeightSettings(NamedTuple):
    """What :func:`by_weight`'s checked call reads besides the tensors and ``eps``: no normalized
    shape -- the weight's is."""

    centered: bool
    backend: str | None
    weight_offset: float
    offset_type: type
    casting: str


def by_weight(
    centered: bool, backend: str | None = None, weight_offset: float = 0.0, casting: str = "torch"
) -> tuple[hot.Op, tuple]:
    """The op and settings of a LayerNorm or RMSNorm call over the last axes whose normalized shape
    is its 1-D weight's -- a model family's module that keeps no ``normalized_shape``, only a
    weight (the Hugging Face patch). The settings then depend on the configuration alone, built
    once per module class rather than from the weight's shape on every call; the weight's shape
    is still compared on every call, as every tensor's is (:mod:`normscope.hot`), and a plan is
    made for each shape it takes."""
    return BY_WEIGHT, (centered, backend, weight_offset, type(weight_offset), casting)


def _by_weight(settings: ByWeightSettings, input, weight, bias, eps, running, mask) -> Tensor:
    """:func:`by_weight`'s checked call: the weight's shape as the normalized shape, then
    :func:`_last_axes`' checked call."""
    where = "layer_norm" if settings.centered else "rms_norm"
    expected = "expected `weight` to be a 1-D tensor (its shape is the normalized shape)"
    if not isinstance(weight, Tensor):
        raise TypeError(f"{where}: {expected}, got {type(weight).__name__}")
    if weight.dim() != 1:
        raise ValueError(f"{where}: {expected}, got shape {tuple(weight.shape)}")
    op, full = last_axes(
        settings.centered, tuple(weight.shape), settings.backend, settings.weight_offset, settings.casting
    )
    return op.checked(tuple.__new__(op.settings_type, full), input, weight, bias, eps, running, mask)


LAYER_NORM = hot.Op("layer_norm", _last_axes, LastAxesSettings)
RMS_NORM = hot.Op("rms_norm", _last_axes, LastAxesSettings)
LAYER_NORM_FAMILY = hot.Op("layer_norm_family", _last_axes, FamilySettings)
RMS_NORM_FAMILY = hot.Op("rms_norm_family", _last_axes, FamilySettings)
BY_WEIGHT = hot.Op("last_axes_by_weight", _by_weight, ByWeightSettings)


def rms_norm(
    input: Tensor,
    normalized_shape: int | Sequence[int],
    weight: Tensor | None = None,
    eps: float | None = None,
    *,
    weight_offset: float = 0.0,
    casting: str = "torch",
    backend: str | None = None,
) -> Tensor:
    r"""Root Mean Square Normalization over the last dims, as :func:`torch.nn.functional.rms_norm`,
    with the model families' zero-centred weight and casting orders.

    .. math:: y = \frac{x}{\sqrt{\mathrm{E}[x^2] + \epsilon}} \cdot (w + \text{weight\_offset})

    Args:
        input: the tensor to normalize, as :func:`torch.nn.functional.rms_norm`'s.
        normalized_shape: the trailing shape normalized over, as :func:`torch.nn.functional.rms_norm`'s.
        weight: the per-element scale of ``normalized_shape``'s shape, or None (no scale).
        eps: added to the mean square. Default: None, the machine epsilon of fp32 (fp64's for fp64 input).
        weight_offset: added to ``weight`` in fp32 before scaling; 1.0 is Gemma's ``1 + w``
            (Transformer Engine's ``zero_centered_gamma``, Liger's ``offset``). Default: 0.0.
        casting: where the result is rounded to the input dtype: ``"torch"`` (torch's RMSNorm),
            ``"gemma"`` (normalize and scale in fp32, cast last: Gemma, Gemma 2/3, OLMo 2) or
            ``"llama"`` (normalize in fp32, cast, then scale: Llama, Mistral, Qwen 2/3) -- bit for bit
            the families' modules at every size (:func:`normscope.reference.cast_affine`).
            Default: ``"torch"``.
        backend: force a backend.

    Like every op it goes through the one hot path (:mod:`normscope.hot`), planned once per call
    signature, the options included.

    Example::

        >>> x = torch.randn(2, 7, 64, dtype=torch.bfloat16)
        >>> w = torch.zeros(64, dtype=torch.bfloat16)          # Gemma's weight starts at 0
        >>> y = rms_norm(x, 64, w, 1e-6, weight_offset=1.0, casting="gemma")
    """
    op, settings = last_axes(False, normalized_shape, backend, weight_offset, casting)
    return hot.call(op, settings, input, weight, None, eps)


def layer_norm(
    input: Tensor,
    normalized_shape: int | Sequence[int],
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float = 1e-5,
    *,
    weight_offset: float = 0.0,
    casting: str = "torch",
    backend: str | None = None,
) -> Tensor:
    """Layer Normalization over the last ``len(normalized_shape)`` dims, as
    :func:`torch.nn.functional.layer_norm`; ``weight_offset`` and ``casting`` as in :func:`rms_norm`
    (the bias is added after the scale, in the same precision)."""
    op, settings = last_axes(True, normalized_shape, backend, weight_offset, casting)
    return hot.call(op, settings, input, weight, bias, eps)


def _affine_norm(
    x: Tensor,
    k: int,
    centered: bool,
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float,
    weight_offset: float,
    casting: str,
    backend: str | None,
) -> Tensor:
    """The family norm over the last ``k`` axes, as the modern norms below use it."""
    shape = tuple(x.shape[-k:])
    if centered:
        return layer_norm(x, shape, weight, bias, eps, weight_offset=weight_offset, casting=casting, backend=backend)
    return rms_norm(x, shape, weight, eps, weight_offset=weight_offset, casting=casting, backend=backend)


# -- AdaLN: an affine from another tensor ---------------------------------------------------------


def modulated_norm(
    x: Tensor,
    shift: Tensor | None = None,
    scale: Tensor | None = None,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float = 1e-6,
    *,
    norm: str = "layer",
    casting: str = "fp32",
    backend: str | None = None,
) -> Tensor:
    r"""Adaptive (modulated) normalization of DiT / SD3 / Flux: ``norm(x) * (1 + scale) + shift``.

    Peebles & Xie 2023, "Scalable Diffusion Models with Transformers" (adaLN). The statistics are
    the LayerNorm (or RMSNorm) scope over the last axis; the affine comes from ``scale`` and
    ``shift``, per sample or per token, as AdaIN's comes from the style.

    .. math:: y = \mathrm{Norm}(x) \odot (1 + \text{scale}) + \text{shift}

    Args:
        x: (B, \*, D).
        shift, scale: per sample (B, D) -- broadcast over the middle axes -- or per token, x's shape;
            either may be None (no shift / scale of 1).
        weight, bias: an elementwise affine of the norm itself, (D,), applied before the modulation
            (diffusers' ``AdaLayerNormContinuous(elementwise_affine=True)``). Default: None.
        eps: added to the variance. Default: 1e-6 (DiT's).
        norm: ``"layer"`` or ``"rms"``. Default: ``"layer"``.
        casting: ``"fp32"``: normalize and modulate in fp32, round once to x's dtype (what a fused
            kernel does: most accurate); ``"eager"``: each step rounded to the input dtype as the
            unfused eager code of DiT and diffusers does (bit-for-bit with diffusers' bf16 output).
            For fp32 input without ``weight``/``bias`` the two give the same bits; with an
            elementwise affine they round it differently (``"eager"`` lets torch's layer_norm fuse it
            into the normalization, ``"fp32"`` multiplies and adds after it), by an ulp or so.
            Default: ``"fp32"``.
        backend: force a backend for the statistics.

    Example::

        >>> x, c = torch.randn(2, 16, 64), torch.randn(2, 128)
        >>> shift, scale = torch.nn.Linear(128, 128)(torch.nn.functional.silu(c)).chunk(2, dim=-1)
        >>> y = modulated_norm(x, shift, scale)
    """
    where = "modulated_norm"
    _tensor(x, "x", where)
    if x.dim() < 2:
        raise ValueError(f"{where}: expected `x` of shape (B, *, D) with at least 2 dims, got {tuple(x.shape)}")
    _choice(norm, "norm", ("layer", "rms"), where)
    _choice(casting, "casting", ("fp32", "eager"), where)
    eps = _eps(eps, where)
    d = x.shape[-1]
    mods = []
    for name, t in (("shift", shift), ("scale", scale)):
        if t is not None:
            _tensor(t, name, where)
            per_sample = t.dim() == 2 and t.shape[-1] == d and t.shape[0] in (x.shape[0], 1)
            if not (per_sample or tuple(t.shape) == tuple(x.shape)):
                raise ValueError(
                    f"{where}: expected `{name}` per sample ({x.shape[0]}, {d}) or per token {tuple(x.shape)}, "
                    f"got {tuple(t.shape)}"
                )
            if t.device != x.device:
                raise ValueError(f"{where}: expected `{name}` on {x.device} (x's device), got {t.device}")
            if per_sample and x.dim() > 2:  # (B, D) -> (B, 1, ..., 1, D): the same modulation for every token
                t = t.reshape(t.shape[0], *([1] * (x.dim() - 2)), d)
        mods.append(t)
    _optional(weight, "weight", (d,), x, where)
    _optional(bias, "bias", (d,), x, where)
    if norm == "rms" and bias is not None:
        raise ValueError(f"{where}: norm='rms' takes no `bias` (got one of shape {tuple(bias.shape)})")
    shift, scale = mods
    fused, backend = _fused(backend)
    if fused:  # forced: the fused kernel, or ValueError saying why
        if casting == "eager":
            raise ValueError(
                f"{where}: backend 'triton' cannot run casting='eager' (the fused kernel rounds once, as "
                "casting='fp32'); use casting='fp32' or another backend"
            )
        return _triton_door.modulated_norm(x, shift, scale, weight, bias, eps, norm == "layer")
    centered = norm == "layer"
    if casting == "eager":
        # torch's LayerNorm / diffusers' RMSNorm (normalize in fp32, cast, then scale), then the
        # modulation op by op in the input dtype, each op rounding as the eager code's does
        y = _affine_norm(x, 1, centered, weight, bias, eps, 0.0, "torch" if centered else "llama", backend)
        if scale is not None:
            y = y * (1 + scale)
        if shift is not None:
            y = y + shift
        return y
    acc = acc_dtype(x.dtype)
    y = _affine_norm(x.to(acc), 1, centered, weight, bias, eps, 0.0, "gemma", backend)
    if scale is not None:
        y = y * (1 + scale.to(acc))
    if shift is not None:
        y = y + shift.to(acc)
    return y.to(x.dtype)


# -- QK-norm: the per-head scope ------------------------------------------------------------------


def qk_norm(
    q: Tensor,
    k: Tensor,
    q_weight: Tensor | None = None,
    k_weight: Tensor | None = None,
    eps: float = 1e-6,
    *,
    layout: str = "bshd",
    per_head: bool = True,
    norm: str = "rms",
    q_bias: Tensor | None = None,
    k_bias: Tensor | None = None,
    weight_offset: float = 0.0,
    casting: str = "torch",
    backend: str | None = None,
) -> tuple[Tensor, Tensor]:
    r"""QK-norm: normalize queries and keys, in one call, before attention.

    Dehghani et al. 2023 (ViT-22B); Qwen3 and Gemma 3 (RMSNorm over ``head_dim``, per head);
    OLMo 2 (RMSNorm over the whole projected width ``H * head_dim``, before the head split).

    The scope is ``head_dim`` of each (token, head) with ``per_head=True`` -- weight (D,) shared by
    all heads -- or all heads of a token at once with ``per_head=False`` -- weight (H * D,) or (H, D),
    one value per (head, dim), as OLMo 2's ``q_norm`` over ``num_heads * head_dim``. k may have
    fewer heads than q (grouped-query attention).

    Args:
        q: the queries, (B, S, H, D) with ``layout="bshd"`` or (B, H, S, D) with ``"bhsd"`` (any strides:
            the transposed view of a projection works).
        k: the keys, in q's layout; H may be fewer than q's (grouped-query attention).
        q_weight: q's scale: (D,) with ``per_head=True``, (H * D,) or (H, D) without; None for none.
        k_weight: k's scale, as ``q_weight`` for k's heads; None for none.
        q_bias: q's shift (``norm="layer"`` only); None for none.
        k_bias: k's shift (``norm="layer"`` only); None for none.
        eps: added to the mean square. Default: 1e-6 (Qwen3's, Gemma 3's, OLMo 2's).
        layout: ``"bshd"`` or ``"bhsd"``. Default: ``"bshd"``.
        per_head: over ``head_dim`` per head (True) or over all heads (False, OLMo 2). Default: True.
        norm: ``"rms"`` or ``"layer"``. Default: ``"rms"``.
        weight_offset: added to each weight in fp32, as :func:`rms_norm`'s (Gemma 3: 1.0). Default: 0.0.
        casting: where the result is rounded, as :func:`rms_norm`'s: Qwen3 is ``"llama"``, Gemma 3 and
            OLMo 2 (with ``per_head=False``) ``"gemma"``. Default: ``"torch"``.

    Returns:
        ``(q_normed, k_normed)``, each in its input's layout and shape.

    Example::

        >>> q, k = torch.randn(2, 16, 8, 64), torch.randn(2, 16, 2, 64)
        >>> qn, kn = qk_norm(q, k, torch.ones(64), torch.ones(64), casting="llama")
    """
    where = "qk_norm"
    _tensor(q, "q", where)
    _tensor(k, "k", where)
    _choice(layout, "layout", ("bshd", "bhsd"), where)
    _choice(norm, "norm", ("rms", "layer"), where)
    _choice(casting, "casting", CASTINGS, where)
    if not isinstance(per_head, bool):
        raise TypeError(f"{where}: expected `per_head` to be a bool, got {type(per_head).__name__} {per_head!r}")
    eps = _eps(eps, where)
    offset = check.weight_offset(weight_offset, where)
    for name, t in (("q", q), ("k", k)):
        if t.dim() != 4:
            raise ValueError(f"{where}: expected `{name}` of 4 dims ({layout}), got shape {tuple(t.shape)}")
    h_axis = 2 if layout == "bshd" else 1
    if q.shape[-1] != k.shape[-1] or q.shape[0] != k.shape[0] or q.device != k.device:
        raise ValueError(
            f"{where}: expected `k` with q's batch and head_dim on q's device (q {tuple(q.shape)} on {q.device}), "
            f"got {tuple(k.shape)} on {k.device}"
        )
    if q.dtype != k.dtype:
        raise TypeError(f"{where}: expected `k` of q's dtype {q.dtype}, got {k.dtype}")
    if norm == "rms" and (q_bias is not None or k_bias is not None):
        raise ValueError(f"{where}: norm='rms' takes no `q_bias`/`k_bias`; use norm='layer'")
    for name, t, w, b in (("q", q, q_weight, q_bias), ("k", k, k_weight, k_bias)):
        heads, d = t.shape[h_axis], t.shape[-1]
        pshape = (d,) if per_head else (heads, d)
        _optional(w, f"{name}_weight", pshape, t, where)
        _optional(b, f"{name}_bias", pshape, t, where)
    fused, backend = _fused(backend)
    if casting != "llama" and fused and (per_head or layout == "bshd"):
        # q and k in one launch; rows of head_dim, or of H * head_dim (all heads of a token: adjacent
        # in (B, S, H, D)); the scale w + offset formed in fp32, the result rounded once
        n = q.shape[-1] if per_head else q.shape[-1] * q.shape[-2]
        nk = k.shape[-1] if per_head else k.shape[-1] * k.shape[-2]
        if n == nk:
            return _triton_door.qk_norm(q, k, n, (q_weight, k_weight, q_bias, k_bias), eps, norm == "layer", offset)
    out = []
    for t, w, b in ((q, q_weight, q_bias), (k, k_weight, k_bias)):
        heads, d = t.shape[h_axis], t.shape[-1]
        if per_head:
            out.append(_affine_norm(t, 1, norm == "layer", w, b, eps, offset, casting, backend))
            continue
        # all heads of a token: the scope (H, D) of each (b, s), normalized as OLMo 2 normalizes its
        # (B, S, H*D) projection -- one axis of H*D, in that order. A view where the heads lie so in
        # memory (the projection's own output); else a copy in that order: a reduction over (H, D)
        # of another layout (the (B, H, S, D) layout's, any strided one) takes the elements in
        # another order, and rounds otherwise than the family
        tv = t if layout == "bshd" else t.transpose(1, 2)
        flat = tv.reshape(*tv.shape[:-2], heads * d)
        w2 = None if w is None else w.reshape(heads * d)
        b2 = None if b is None else b.reshape(heads * d)
        y = _affine_norm(flat, 1, norm == "layer", w2, b2, eps, offset, casting, backend).view(tv.shape)
        out.append(y if layout == "bshd" else y.transpose(1, 2))
    return out[0], out[1]


# -- PolyNorm: three RMSNorm scopes on the powers of x ---------------------------------------------


def poly_norm(x: Tensor, weight: Tensor, bias: Tensor, eps: float = 1e-6, *, backend: str | None = None) -> Tensor:
    r"""PolyNorm (Zhuo et al. 2024, "Polynomial Composition Activations", PolyCom):

    .. math:: y = w_0\,\mathrm{rms}(x^3) + w_1\,\mathrm{rms}(x^2) + w_2\,\mathrm{rms}(x) + b,
              \qquad \mathrm{rms}(u) = u / \sqrt{\mathrm{E}[u^2] + \epsilon}

    over the last axis. Each term is the engine's RMSNorm scope on a power of ``x``, computed in
    fp32 (fp64 for fp64 input) -- ``x^3`` of bf16 input in bf16 would lose most of its bits -- and
    rounded once to x's dtype.

    Args:
        x: (\*, D).
        weight: (3,), the coefficients of ``x^3``, ``x^2``, ``x`` (Liger's and Motif's order).
        bias: (1,).
        eps: added to each mean square. Default: 1e-6.

    Example::

        >>> y = poly_norm(torch.randn(4, 64), torch.full((3,), 1 / 3), torch.ones(1))
    """
    where = "poly_norm"
    _tensor(x, "x", where)
    if x.dim() < 1:
        raise ValueError(f"{where}: expected `x` with at least 1 dim, got a scalar")
    for name, t, n in (("weight", weight, 3), ("bias", bias, 1)):
        _tensor(t, name, where)
        if t.numel() != n or t.dim() != 1:
            raise ValueError(f"{where}: expected `{name}` of shape ({n},), got {tuple(t.shape)}")
        if t.device != x.device:
            raise ValueError(f"{where}: expected `{name}` on {x.device} (x's device), got {t.device}")
    eps = _eps(eps, where)
    fused, backend = _fused(backend)
    if fused:  # forced: one fused launch, or ValueError saying why
        return _triton_door.poly_norm(x, weight, bias, eps)
    acc = acc_dtype(x.dtype)
    xf, w = x.to(acc), weight.to(acc)
    y = bias.to(acc)
    d = (x.shape[-1],)
    for i, p in enumerate((3, 2, 1)):
        y = y + w[i] * rms_norm(xf**p if p > 1 else xf, d, None, eps, backend=backend)
    return y.to(x.dtype)


# -- Derf: element-wise, like DyT ------------------------------------------------------------------


def derf(
    x: Tensor,
    alpha: Tensor | float,
    shift: Tensor | float = 0.0,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    channel_dim: int = -1,
    *,
    backend: str | None = None,
) -> Tensor:
    r"""Derf, dynamic erf (arXiv 2512.10938, "Stronger Normalization-Free Transformers"):

    .. math:: y = \gamma \odot \mathrm{erf}(\alpha x + s) + \beta

    No statistics (no scope): like DyT, an S-shaped element-wise map that stands in for a norm.
    Computed in fp32 for half-precision input and rounded once.

    Args:
        x: any shape with the features at ``channel_dim``.
        alpha, shift: scalars (Python numbers or one-element tensors, learnable in :class:`Derf`).
        weight, bias: per-feature :math:`\gamma`, :math:`\beta` (the size of ``channel_dim``), or None.
        channel_dim: the feature axis. Default: -1.
        backend: ``"triton"`` runs the fused kernel (features on the last axis); any other value
            the element-wise torch ops (there are no statistics for the engine to compute).

    Example::

        >>> y = derf(torch.randn(2, 10, 64), torch.tensor([0.5]), torch.tensor([0.0]), torch.ones(64), torch.zeros(64))
    """
    where = "derf"
    _tensor(x, "x", where)
    if (
        isinstance(channel_dim, bool)
        or not isinstance(channel_dim, numbers.Integral)  # NumPy's too
        or not -x.dim() <= channel_dim < x.dim()
    ):
        raise ValueError(
            f"{where}: expected `channel_dim` to be an axis of x (shape {tuple(x.shape)}), got {channel_dim!r}"
        )
    channel_dim = int(channel_dim)
    for name, t in (("alpha", alpha), ("shift", shift)):
        if isinstance(t, Tensor):
            if t.numel() != 1:
                raise ValueError(f"{where}: expected `{name}` to have one element, got shape {tuple(t.shape)}")
        elif isinstance(t, bool) or not isinstance(t, numbers.Real):  # NumPy's numbers too
            raise TypeError(f"{where}: expected `{name}` to be a float or a one-element tensor, got {type(t).__name__}")
    c = x.shape[channel_dim]
    _optional(weight, "weight", (c,), x, where)
    _optional(bias, "bias", (c,), x, where)
    fused, backend = _fused(backend)
    if fused:  # forced: the fused kernel, or ValueError saying why
        if channel_dim not in (-1, x.dim() - 1) or not isinstance(alpha, Tensor) or not isinstance(shift, Tensor):
            raise ValueError(
                f"{where}: backend 'triton' runs Derf with the features on the last axis and alpha/shift as "
                f"tensors, got channel_dim={channel_dim}, alpha {type(alpha).__name__}, shift {type(shift).__name__}"
            )
        return _triton_door.derf(x, alpha, shift, weight, bias)
    acc = acc_dtype(x.dtype)
    a = alpha.to(acc).reshape(()) if isinstance(alpha, Tensor) else float(alpha)
    s = shift.to(acc).reshape(()) if isinstance(shift, Tensor) else float(shift)
    y = torch.erf(x.to(acc) * a + s)
    view = [1] * x.dim()
    view[channel_dim] = c
    if weight is not None:
        y = y * weight.to(acc).reshape(view)
    if bias is not None:
        y = y + bias.to(acc).reshape(view)
    return y.to(x.dtype)
