"""Layers for the norms of 2023-2026 models: AdaLN / AdaLN-Zero, QK-norm, PolyNorm, Derf.

Each layer holds parameters and calls one function of :mod:`normscope.functional_modern`, where
the norm is a configuration of the engine. Papers: Peebles & Xie 2023 (DiT, adaLN-Zero);
Dehghani et al. 2023 (ViT-22B, QK-norm); Zhuo et al. 2024 (PolyCom, PolyNorm); arXiv 2512.10938
(Derf, "Stronger Normalization-Free Transformers").
"""

from __future__ import annotations

import numbers

import torch
from torch import Tensor, nn
from torch.nn import functional as TF

from .. import _checks as check
from .. import functional_modern as FM
from .. import reference as ref

__all__ = ["AdaLayerNorm", "QKNorm", "PolyNorm", "Derf"]


def _positive_int(v: object, name: str, where: str) -> int:
    return check.size(v, name, where)  # a Python int, from NumPy's too


class AdaLayerNorm(nn.Module):
    r"""Adaptive LayerNorm (adaLN, adaLN-Zero) of DiT: a norm whose affine comes from a condition.

    .. math::
        (\text{shift}, \text{scale}[, \text{gate}], \dots) = \mathrm{Linear}(\mathrm{SiLU}(c)), \qquad
        y = \mathrm{Norm}(x) \odot (1 + \text{scale}) + \text{shift}

    The projection is zero-initialised (adaLN-Zero: the block starts as the identity, since the
    gate that multiplies the branch output starts at 0). With ``gate=True`` the forward returns
    ``(y, gate)``; the caller computes ``x + gate * f(y)``. A condition (B, cond_dim) modulates
    per sample, one (B, S, cond_dim) per token.

    A transformer block's whole modulation is one projection: with ``chunks=6`` (and ``gate=True``)
    the layer is diffusers' ``AdaLayerNormZero`` (DiT, PixArt, SD3, Flux) -- shift, scale and gate
    of the attention branch, then shift, scale and gate of the MLP, returned after ``y`` as
    ``(y, gate_msa, shift_mlp, scale_mlp, gate_mlp)`` -- and its ``state_dict`` loads both ways.

    Args:
        embedding_dim: D, the size of x's last axis.
        cond_dim: size of the conditioning vector.
        gate: also project a gate (adaLN-Zero). Default: False.
        norm: ``"layer"`` or ``"rms"``. Default: ``"layer"``.
        eps: added to the variance. Default: 1e-6 (DiT's).
        elementwise_affine: the norm's own weight (and bias for ``"layer"``) before the modulation,
            as diffusers' ``AdaLayerNormContinuous``. Default: False (DiT).
        bias: the projection has a bias. Default: True.
        order: the order of the chunks of the projection: ``"shift_scale"`` (DiT, diffusers'
            ``AdaLayerNormZero``: shift, scale[, gate]) or ``"scale_shift"`` (diffusers'
            ``AdaLayerNormContinuous``, which also casts ``SiLU(cond)`` to x's dtype before the
            projection, as this layer then does). Default: ``"shift_scale"``.
        zero_init: zero the projection's weight and bias. Default: True.
        casting: ``"fp32"`` (one rounding) or ``"eager"`` (diffusers' per-op rounding); see
            :func:`normscope.functional_modern.modulated_norm`. Default: ``"fp32"``.
        chunks: the projection's width in units of D: 2 (3 with ``gate``), or more for the chunks
            a block uses elsewhere, returned after ``y`` (and the gate) in order. Default: None
            (2, or 3 with ``gate``).

    Parameters and ``state_dict`` keys are diffusers': ``linear.weight``, ``linear.bias`` and,
    with ``elementwise_affine``, ``norm.weight`` (``norm.bias``).

    Shape:
        - x: (B, \*, D); cond: (B, cond_dim) or (B, \*, cond_dim) matching x. Output: x's shape
          (and the gate, (B, D) or per token).

    Example::

        >>> ada = normscope.AdaLayerNorm(64, 128, gate=True)
        >>> y, gate = ada(torch.randn(2, 16, 64), torch.randn(2, 128))
        >>> block = normscope.AdaLayerNorm(64, 64, gate=True, chunks=6, casting="eager")  # AdaLayerNormZero
        >>> y, gate_msa, shift_mlp, scale_mlp, gate_mlp = block(torch.randn(2, 16, 64), emb=torch.randn(2, 64))
    """

    def __init__(
        self,
        embedding_dim: int,
        cond_dim: int,
        *,
        gate: bool = False,
        norm: str = "layer",
        eps: float = 1e-6,
        elementwise_affine: bool = False,
        bias: bool = True,
        order: str = "shift_scale",
        zero_init: bool = True,
        casting: str = "fp32",
        chunks: int | None = None,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        where = "AdaLayerNorm"
        self.embedding_dim = embedding_dim = _positive_int(embedding_dim, "embedding_dim", where)
        self.cond_dim = cond_dim = _positive_int(cond_dim, "cond_dim", where)
        for name, v, options in (
            ("norm", norm, ("layer", "rms")),
            ("order", order, ("shift_scale", "scale_shift")),
            ("casting", casting, ("fp32", "eager")),
        ):
            if v not in options:
                raise ValueError(f"{where}: expected `{name}` to be one of {options}, got {v!r}")
        least = 3 if gate else 2
        if chunks is None:
            chunks = least
        elif isinstance(chunks, bool) or not isinstance(chunks, numbers.Integral) or chunks < least:
            raise ValueError(
                f"{where}: expected `chunks` to be an int >= {least} (shift, scale{', gate' if gate else ''}), "
                f"got {chunks!r}"
            )
        check.eps(eps, where)  # float() would take True and "1e-6", and name no argument for "a" or None
        kw = {"device": device, "dtype": dtype}
        self.gate, self.norm_type, self.eps, self.order = bool(gate), norm, float(eps), order
        self.casting, self.zero_init, self.elementwise_affine = casting, bool(zero_init), bool(elementwise_affine)
        self.chunks = chunks = int(chunks)
        self.linear = nn.Linear(cond_dim, chunks * embedding_dim, bias=bias, **kw)
        # a parameter holder named as diffusers' submodule, so state_dicts load both ways; never called
        self.norm = nn.Module()
        if elementwise_affine:
            self.norm.weight = nn.Parameter(torch.ones(embedding_dim, **kw))
            self.norm.bias = nn.Parameter(torch.zeros(embedding_dim, **kw)) if norm == "layer" else None
        else:
            self.norm.weight = self.norm.bias = None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.zero_init:
            nn.init.zeros_(self.linear.weight)
            if self.linear.bias is not None:
                nn.init.zeros_(self.linear.bias)
        else:
            self.linear.reset_parameters()
        if self.norm.weight is not None:
            nn.init.ones_(self.norm.weight)
        if self.norm.bias is not None:
            nn.init.zeros_(self.norm.bias)

    def extra_repr(self) -> str:
        more = f", chunks={self.chunks}" if self.chunks != (3 if self.gate else 2) else ""
        return (
            f"{self.embedding_dim}, cond_dim={self.cond_dim}, gate={self.gate}, norm={self.norm_type!r}, "
            f"eps={self.eps}, elementwise_affine={self.elementwise_affine}, order={self.order!r}, "
            f"casting={self.casting!r}{more}"
        )

    def forward(
        self, x: Tensor, cond: Tensor | None = None, *, emb: Tensor | None = None
    ) -> Tensor | tuple[Tensor, ...]:
        """Normalize ``x`` and modulate it by the projection of ``cond`` (``emb=`` is the same
        argument under diffusers' name)."""
        cond, arg = _condition(self, x, cond, emb)
        weight, norm = _projection(self), _norm_holder(self)
        h = TF.silu(cond)
        if self.order == "scale_shift":  # diffusers' AdaLayerNormContinuous: SiLU(cond) in x's dtype
            h = h.to(x.dtype)
        # under autocast the projection (nn.Linear) casts its input and weight alike, as in diffusers' modules
        if h.dtype != weight.dtype and not ref.autocasting(h.device):
            if self.order == "scale_shift":  # the cast to x's dtype is what misfits, not cond's own dtype
                raise TypeError(
                    f"AdaLayerNorm(order='scale_shift'): expected `x` of the projection's dtype "
                    f"{weight.dtype} (SiLU({arg}) is cast to x's dtype before the projection, as "
                    f"diffusers' AdaLayerNormContinuous does), got x of dtype {x.dtype}"
                )
            raise TypeError(
                f"AdaLayerNorm: expected `{arg}` of the projection's dtype {weight.dtype}, got {cond.dtype}"
            )
        chunks = self.linear(h).chunk(self.chunks, dim=-1)
        shift, scale = chunks[:2] if self.order == "shift_scale" else chunks[1::-1]
        y = FM.modulated_norm(
            x, shift, scale, norm.weight, norm.bias, self.eps, norm=self.norm_type, casting=self.casting
        )
        return (y, *chunks[2:]) if len(chunks) > 2 else y


def _condition(layer: AdaLayerNorm, x: Tensor, cond: Tensor | None, emb: Tensor | None) -> tuple[Tensor, str]:
    """The condition and the name the caller gave it, checked against x and the layer."""
    where, d, c = type(layer).__name__, layer.embedding_dim, layer.cond_dim
    if (cond is None) == (emb is None):
        raise TypeError(
            f"{where}: expected the condition as `cond` or `emb` (one of them), got "
            + ("both" if cond is not None else "neither")
        )
    arg, cond = ("cond", cond) if cond is not None else ("emb", emb)
    if not isinstance(x, Tensor):
        raise TypeError(f"{where}: expected `x` to be a Tensor, got {type(x).__name__}")
    check.dense(x, "x", where)
    if x.dim() < 2 or x.shape[-1] != d:
        raise ValueError(f"{where}({d}, cond_dim={c}): expected `x` of shape (B, *, {d}), got {tuple(x.shape)}")
    if not isinstance(cond, Tensor):
        raise TypeError(f"{where}: expected `{arg}` to be a Tensor, got {type(cond).__name__}")
    if not cond.is_floating_point():
        raise TypeError(f"{where}: expected `{arg}` to be a floating-point tensor, got {cond.dtype}")
    per_sample = cond.dim() == 2 and cond.shape[0] in (x.shape[0], 1)
    per_token = cond.dim() == x.dim() and cond.shape[:-1] == x.shape[:-1]
    if cond.shape[-1] != c or not (per_sample or per_token):
        raise ValueError(
            f"{where}({d}, cond_dim={c}): expected `{arg}` of shape ({x.shape[0]}, {c}) or "
            f"{(*x.shape[:-1], c)} for x of shape {tuple(x.shape)}, got {tuple(cond.shape)}"
        )
    if cond.device != x.device:
        raise ValueError(f"{where}: expected `{arg}` on {x.device} (x's device), got {cond.device}")
    return cond, arg


def _projection(layer: AdaLayerNorm) -> Tensor:
    """The projection's weight, once its module, weight and bias are checked as what the forward reads:
    a ``linear`` whose weight was set to None (or replaced by a module without one) raised AttributeError
    from a read of its dtype, a weight or bias of another shape a RuntimeError from inside the matmul or the
    chunking -- neither naming the attribute. Not its device: an offloading hook (accelerate's) moves the
    weight when the projection itself is called."""
    where, out, c = type(layer).__name__, layer.chunks * layer.embedding_dim, layer.cond_dim
    shape = f"({out}, {c}) (chunks * embedding_dim, cond_dim)"
    linear = layer.linear
    if not isinstance(linear, nn.Module):
        raise TypeError(
            f"{where}: expected `linear` to be the projection module (an nn.Linear({c}, {out})), got "
            f"{type(linear).__name__}"
        )
    weight = getattr(linear, "weight", None)
    if not isinstance(weight, Tensor):
        got = "no `weight` attribute" if not hasattr(linear, "weight") else type(weight).__name__
        raise TypeError(f"{where}: expected `linear.weight` to be a tensor of shape {shape}, got {got}")
    if not weight.is_floating_point():
        raise TypeError(f"{where}: expected `linear.weight` to be a floating-point tensor, got {weight.dtype}")
    if tuple(weight.shape) != (out, c):
        raise ValueError(f"{where}: expected `linear.weight` of shape {shape}, got {tuple(weight.shape)}")
    bias = getattr(linear, "bias", None)
    if bias is not None and not isinstance(bias, Tensor):
        raise TypeError(
            f"{where}: expected `linear.bias` to be a tensor of shape ({out},) or None, got {type(bias).__name__}"
        )
    if bias is not None and tuple(bias.shape) != (out,):
        raise ValueError(f"{where}: expected `linear.bias` of shape ({out},) or None, got {tuple(bias.shape)}")
    return weight


def _norm_holder(layer: AdaLayerNorm) -> nn.Module:
    """The ``norm`` submodule that holds the norm's own weight and bias (each a tensor or None)."""
    norm = layer.norm
    if not isinstance(norm, nn.Module) or not (hasattr(norm, "weight") and hasattr(norm, "bias")):
        got = type(norm).__name__ if not isinstance(norm, nn.Module) else f"{type(norm).__name__} without them"
        raise TypeError(
            f"{type(layer).__name__}: expected `norm` to be a module holding the norm's `weight` and `bias` "
            f"(tensors or None), got {got}"
        )
    return norm


class QKNorm(nn.Module):
    r"""QK-norm: RMSNorm (or LayerNorm) of queries and keys, per head or over all heads.

    ``QKNorm(head_dim)`` normalizes each head over ``head_dim`` with one (D,) weight for q and one
    for k (Qwen3, Gemma 3); ``QKNorm(head_dim, num_heads=H, num_kv_heads=Hkv, per_head=False)`` over
    all heads of a token with (H * D,) and (Hkv * D,) weights (OLMo 2). See
    :func:`normscope.functional_modern.qk_norm`.

    Args:
        head_dim: D.
        num_heads, num_kv_heads: H and Hkv, needed with ``per_head=False``. Default: None.
        per_head: Default: True.
        norm: ``"rms"`` or ``"layer"``. Default: ``"rms"``.
        eps: Default: 1e-6.
        layout: ``"bshd"`` or ``"bhsd"``. Default: ``"bshd"``.
        weight_offset: 1.0 for Gemma's ``1 + w`` (then the weights start at 0). Default: 0.0.
        casting: ``"torch"``, ``"gemma"`` or ``"llama"``. Default: ``"torch"``.
        elementwise_affine: learnable ``q_weight``/``k_weight`` (and biases for ``"layer"``). Default: True.

    Shape:
        - q, k: (B, S, H, D) or (B, H, S, D). Output: ``(q_normed, k_normed)``, the same shapes.

    Example::

        >>> qkn = normscope.QKNorm(64, casting="llama")
        >>> q, k = qkn(torch.randn(2, 16, 8, 64), torch.randn(2, 16, 2, 64))
    """

    def __init__(
        self,
        head_dim: int,
        num_heads: int | None = None,
        num_kv_heads: int | None = None,
        *,
        per_head: bool = True,
        norm: str = "rms",
        eps: float = 1e-6,
        layout: str = "bshd",
        weight_offset: float = 0.0,
        casting: str = "torch",
        elementwise_affine: bool = True,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        where = "QKNorm"
        self.head_dim = head_dim = _positive_int(head_dim, "head_dim", where)
        if not per_head:
            if num_heads is None:  # an argument this option needs, not one of a wrong type
                raise ValueError(f"{where}: per_head=False needs `num_heads` (a positive int), got None")
            num_heads = _positive_int(num_heads, "num_heads (needed with per_head=False)", where)
            num_kv_heads = num_heads if num_kv_heads is None else _positive_int(num_kv_heads, "num_kv_heads", where)
        for name, v, options in (
            ("norm", norm, ("rms", "layer")),
            ("layout", layout, ("bshd", "bhsd")),
            ("casting", casting, FM.CASTINGS),
        ):
            if v not in options:
                raise ValueError(f"{where}: expected `{name}` to be one of {tuple(options)}, got {v!r}")
        check.eps(eps, where)  # float() would take True and "1e-6", and name no argument for "a" or None
        self.num_heads, self.num_kv_heads, self.per_head = num_heads, num_kv_heads, bool(per_head)
        self.norm_type, self.eps, self.layout = norm, float(eps), layout
        self.weight_offset, self.casting = check.weight_offset(weight_offset, where), casting  # finite
        self.elementwise_affine = bool(elementwise_affine)
        kw = {"device": device, "dtype": dtype}
        q_n = head_dim if per_head else num_heads * head_dim
        k_n = head_dim if per_head else num_kv_heads * head_dim
        for name, n in (("q", q_n), ("k", k_n)):
            w = nn.Parameter(torch.empty(n, **kw)) if elementwise_affine else None
            b = nn.Parameter(torch.empty(n, **kw)) if elementwise_affine and norm == "layer" else None
            self.register_parameter(f"{name}_weight", w)
            self.register_parameter(f"{name}_bias", b)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # with a weight offset the scale is offset + w: w starts at 1 - offset (0 for Gemma's 1 + w)
        for p in (self.q_weight, self.k_weight):
            if p is not None:
                nn.init.constant_(p, 1.0 - self.weight_offset)
        for p in (self.q_bias, self.k_bias):
            if p is not None:
                nn.init.zeros_(p)

    def extra_repr(self) -> str:
        heads = "" if self.per_head else f", num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}"
        return (
            f"{self.head_dim}{heads}, per_head={self.per_head}, norm={self.norm_type!r}, eps={self.eps}, "
            f"layout={self.layout!r}, weight_offset={self.weight_offset}, casting={self.casting!r}"
        )

    def forward(self, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        return FM.qk_norm(
            q,
            k,
            self.q_weight,
            self.k_weight,
            self.eps,
            layout=self.layout,
            per_head=self.per_head,
            norm=self.norm_type,
            q_bias=self.q_bias,
            k_bias=self.k_bias,
            weight_offset=self.weight_offset,
            casting=self.casting,
        )


class PolyNorm(nn.Module):
    r"""PolyNorm: :math:`y = w_0\,\mathrm{rms}(x^3) + w_1\,\mathrm{rms}(x^2) + w_2\,\mathrm{rms}(x) + b`
    over the last axis (Zhuo et al. 2024, PolyCom; Motif). See :func:`normscope.functional_modern.poly_norm`.

    Args:
        num_features: accepted for the registry's "channels first" convention and ignored: PolyNorm's
            parameters are three coefficients and one bias whatever the width. Default: None.
        eps: Default: 1e-6.

    Parameters ``weight`` (3,), initialised to 1/3, and ``bias`` (1,), initialised to 1 (PolyCom's
    and Liger's ``LigerPolyNorm``'s).

    Example::

        >>> y = normscope.PolyNorm()(torch.randn(2, 16, 64))
    """

    def __init__(self, num_features: int | None = None, eps: float = 1e-6, device=None, dtype=None) -> None:
        super().__init__()
        check.eps(eps, "PolyNorm")  # float() would take True and "1e-6", and name no argument for "a" or None
        kw = {"device": device, "dtype": dtype}
        self.num_features, self.eps = num_features, float(eps)
        self.weight = nn.Parameter(torch.empty(3, **kw))
        self.bias = nn.Parameter(torch.empty(1, **kw))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.constant_(self.weight, 1.0 / 3.0)
        nn.init.ones_(self.bias)

    def extra_repr(self) -> str:
        return f"eps={self.eps}"

    def forward(self, x: Tensor) -> Tensor:
        return FM.poly_norm(x, self.weight, self.bias, self.eps)


class Derf(nn.Module):
    r"""Derf, dynamic erf: :math:`y = \gamma \odot \mathrm{erf}(\alpha x + s) + \beta` (arXiv 2512.10938).

    Like :class:`normscope.DyT` (whose conventions it follows), not a normalization: no statistics;
    learnable scalars :math:`\alpha` and :math:`s` and per-feature :math:`\gamma`, :math:`\beta`.

    Args:
        num_features: size of the feature axis.
        alpha_init: initial :math:`\alpha`. Default: 0.5 (as DyT's).
        shift_init: initial :math:`s`. Default: 0.0 (the map starts odd, as tanh).
        channel_dim: the feature axis. Default: -1.
        affine: learnable ``weight`` (ones) and ``bias`` (zeros). Default: True.

    Shape:
        - Input: any shape with ``num_features`` at ``channel_dim``. Output: same shape.

    Example::

        >>> y = normscope.Derf(512)(torch.randn(4, 10, 512))
    """

    def __init__(
        self,
        num_features: int,
        alpha_init: float = 0.5,
        shift_init: float = 0.0,
        channel_dim: int = -1,
        affine: bool = True,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        num_features = _positive_int(num_features, "num_features", "Derf")
        if not isinstance(channel_dim, int) or isinstance(channel_dim, bool):
            raise TypeError(f"Derf: expected `channel_dim` to be an int, got {channel_dim!r}")
        kw = {"device": device, "dtype": dtype}
        self.num_features, self.channel_dim = num_features, channel_dim
        self.alpha_init = check.finite(alpha_init, "alpha_init", "Derf")
        self.shift_init = check.finite(shift_init, "shift_init", "Derf")
        self.alpha = nn.Parameter(torch.empty(1, **kw))
        self.shift = nn.Parameter(torch.empty(1, **kw))
        if affine:
            self.weight = nn.Parameter(torch.empty(num_features, **kw))
            self.bias = nn.Parameter(torch.empty(num_features, **kw))
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.alpha.fill_(self.alpha_init)
            self.shift.fill_(self.shift_init)
            if self.weight is not None:
                self.weight.fill_(1.0)
                self.bias.zero_()

    def extra_repr(self) -> str:
        return (
            f"{self.num_features}, alpha_init={self.alpha_init}, shift_init={self.shift_init}, "
            f"channel_dim={self.channel_dim}"
        )

    def forward(self, input: Tensor) -> Tensor:
        n, cd = self.num_features, self.channel_dim
        check.tensor(input, "input", "Derf")  # a dense floating-point tensor (a nested one has no shape to read)
        if not -input.dim() <= cd < input.dim() or input.shape[cd] != n:
            # the layer's feature count, as DyT's: derf's own check named the weight as the misfit
            # ("expected `weight` of shape (5,), got (6,)" for input of 5 features)
            raise ValueError(
                f"Derf({n}): expected input with {n} features at dim {cd}, got shape {tuple(input.shape)}"
            )
        return FM.derf(input, self.alpha, self.shift, self.weight, self.bias, cd)
