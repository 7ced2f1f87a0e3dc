"""Modern norms bit-for-bit against the modules the model families ship (transformers, diffusers).

Every comparison is ``torch.equal`` in fp32 and bf16: the families' casting orders differ only in
where they round, and a rounding in the wrong place shows up as a differing last bit. Models are
tiny and built from configs; nothing is downloaded.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import normscope
from normscope import functional_modern as FM

transformers = pytest.importorskip("transformers")

DTYPES = [torch.float32, torch.bfloat16]
WIDTHS = [64, 1536, 33]  # power of two, Liger #518's 1536, odd


def _randomize(module: torch.nn.Module, seed: int, std: float = 0.5) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * std + (0.0 if p.abs().max() == 0 else 1.0))


def _x(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 3 + 0.5).to(dtype)


# -- zero-centred weight (Gemma) and Llama's casting -----------------------------------------------


@pytest.mark.parametrize("family", ["gemma", "gemma2", "gemma3"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", WIDTHS)
def test_gemma_rmsnorm_bitwise(family, dtype, width):
    import importlib

    mod = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    cls = getattr(mod, f"{family.capitalize()}RMSNorm")
    ref = cls(width, eps=1e-6)
    with torch.no_grad():  # small offsets: the regime where a bf16 1 + w would lose them
        ref.weight.copy_(torch.randn(width, generator=torch.Generator().manual_seed(1)) * 0.01)
    ref = ref.to(dtype)
    x = _x((3, 5, width), dtype)
    y = FM.rms_norm(x, width, ref.weight, 1e-6, weight_offset=1.0, casting="gemma")
    assert torch.equal(y, ref(x))
    assert not torch.equal(FM.rms_norm(x, width, ref.weight, 1e-6, casting="gemma"), ref(x))  # the offset counts


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("weight_dtype", ["input", torch.float32])
@pytest.mark.parametrize("offset", [1.0, 0.0])
@pytest.mark.parametrize("grad", [False, True])
def test_gemma_order_on_half_input_through_the_layer_and_the_function(dtype, weight_dtype, offset, grad):
    # a half-precision input runs its own entry (torch's op between x.float() and the cast back by
    # the dtype's own method): fp16 as well as bf16, with and without a graph, layer and function,
    # against Gemma's formula written out
    width = 48
    wdtype = dtype if weight_dtype == "input" else weight_dtype
    w = (torch.randn(width, generator=torch.Generator().manual_seed(3)) * 0.01).to(wdtype)
    x = _x((4, 3, width), dtype)
    x32 = x.float()
    expected = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6) * (w.float() + offset)).to(dtype)
    layer = normscope.RMSNorm(width, eps=1e-6, weight_offset=offset, casting="gemma", dtype=wdtype)
    with torch.no_grad():
        layer.weight.copy_(w)
    with torch.set_grad_enabled(grad):
        xi = x.clone().requires_grad_(grad)
        for _ in range(2):  # the checked call, then the plan
            for y in (layer(xi), FM.rms_norm(xi, width, w, 1e-6, weight_offset=offset, casting="gemma")):
                assert y.dtype == dtype and torch.equal(y, expected)
        assert normscope.last_backend() == "aten"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("casting", ["torch", "gemma"])
def test_an_offset_on_half_input_runs_gemmas_order_without_a_warning(dtype, casting):
    # "torch" with an offset is Gemma's order (reference.cast_affine): the fp32 scale w + offset on a
    # half-precision input, computed in fp32 and rounded once -- not torch's rms_norm on mixed dtypes,
    # which warns on every call
    width = 64
    w = torch.randn(width, generator=torch.Generator().manual_seed(4)).to(dtype)
    x = _x((4, width), dtype)
    x32 = x.float()
    expected = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6) * (w.float() + 0.5)).to(dtype)
    layer = normscope.RMSNorm(width, eps=1e-6, weight_offset=0.5, casting=casting, dtype=dtype)
    with torch.no_grad():
        layer.weight.copy_(w)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(2):  # the checked call, then the plan
            assert torch.equal(layer(x), expected)


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen2", "mistral"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("weight_dtype", DTYPES)
def test_llama_casting_bitwise(family, dtype, weight_dtype):
    import importlib

    mod = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    cls = next(getattr(mod, n) for n in dir(mod) if n.lower() == f"{family}rmsnorm")
    ref = cls(1536, eps=1e-5)
    _randomize(ref, 2)
    ref = ref.to(weight_dtype)
    x = _x((2, 7, 1536), dtype)
    expected = ref(x)
    y = FM.rms_norm(x, 1536, ref.weight, 1e-5, casting="llama")
    assert y.dtype == expected.dtype and torch.equal(y, expected)


def test_olmo2_rmsnorm_is_gemma_casting_without_offset():
    from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm

    for dtype in DTYPES:
        ref = Olmo2RMSNorm(96, eps=1e-6)
        _randomize(ref, 3)
        ref = ref.to(dtype)
        x = _x((4, 96), dtype)
        assert torch.equal(FM.rms_norm(x, 96, ref.weight, 1e-6, casting="gemma"), ref(x))


# -- QK-norm in the families' attention ------------------------------------------------------------


def _attention(family: str, dtype: torch.dtype):
    import importlib

    cfg_mod = importlib.import_module(f"transformers.models.{family}.configuration_{family}")
    mod = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    cfg_cls = next(getattr(cfg_mod, n) for n in dir(cfg_mod) if n.lower() == f"{family}config")
    kw = dict(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=64,
        num_hidden_layers=1,
        vocab_size=50,
    )
    if family == "gemma3":  # Gemma3Config is multimodal; the attention reads the text config
        cfg_cls = cfg_mod.Gemma3TextConfig
    cfg = cfg_cls(**kw)
    attn_cls = next(getattr(mod, n) for n in dir(mod) if n.lower() == f"{family}attention")
    attn = attn_cls(cfg, layer_idx=0)
    _randomize(attn, 4, std=0.3)
    return attn.to(dtype), cfg


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
def test_qwen3_qk_norm_bitwise(dtype, layout):
    attn, cfg = _attention("qwen3", dtype)
    h = _x((2, 5, 64), dtype, seed=5)
    q = attn.q_proj(h).view(2, 5, -1, 16)
    k = attn.k_proj(h).view(2, 5, -1, 16)
    expected = attn.q_norm(q), attn.k_norm(k)  # transformers: on (B, S, H, D), then transposed
    qi, ki = (q, k) if layout == "bshd" else (q.transpose(1, 2), k.transpose(1, 2))
    qn, kn = FM.qk_norm(
        qi, ki, attn.q_norm.weight, attn.k_norm.weight, cfg.rms_norm_eps, layout=layout, casting="llama"
    )
    if layout == "bhsd":
        qn, kn = qn.transpose(1, 2), kn.transpose(1, 2)
    assert torch.equal(qn, expected[0]) and torch.equal(kn, expected[1])
    # and through the layer, with the family's parameters loaded
    qkn = normscope.QKNorm(16, eps=cfg.rms_norm_eps, casting="llama", layout=layout, dtype=dtype)
    qkn.load_state_dict({"q_weight": attn.q_norm.weight, "k_weight": attn.k_norm.weight})
    qn2, kn2 = qkn(qi, ki)
    if layout == "bhsd":
        qn2, kn2 = qn2.transpose(1, 2), kn2.transpose(1, 2)
    assert torch.equal(qn2, expected[0]) and torch.equal(kn2, expected[1])


@pytest.mark.parametrize("dtype", DTYPES)
def test_gemma3_qk_norm_bitwise(dtype):
    attn, cfg = _attention("gemma3", dtype)
    with torch.no_grad():  # Gemma's norm weights are offsets around 0
        for n in (attn.q_norm, attn.k_norm):
            n.weight.mul_(0.02)
    h = _x((2, 5, 64), dtype, seed=6)
    q = attn.q_proj(h).view(2, 5, -1, cfg.head_dim).transpose(1, 2)  # Gemma 3 normalizes (B, H, S, D)
    k = attn.k_proj(h).view(2, 5, -1, cfg.head_dim).transpose(1, 2)
    qn, kn = FM.qk_norm(
        q,
        k,
        attn.q_norm.weight,
        attn.k_norm.weight,
        cfg.rms_norm_eps,
        layout="bhsd",
        weight_offset=1.0,
        casting="gemma",
    )
    assert torch.equal(qn, attn.q_norm(q)) and torch.equal(kn, attn.k_norm(k))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
def test_olmo2_full_width_qk_norm_bitwise(dtype, layout):
    attn, cfg = _attention("olmo2", dtype)
    h = _x((2, 5, 64), dtype, seed=7)
    qp, kp = attn.q_proj(h), attn.k_proj(h)
    expected_q = attn.q_norm(qp).view(2, 5, -1, 16)  # OLMo 2: over H * D, before the head split
    expected_k = attn.k_norm(kp).view(2, 5, -1, 16)
    q, k = qp.view(2, 5, -1, 16), kp.view(2, 5, -1, 16)
    if layout == "bhsd":
        q, k = q.transpose(1, 2), k.transpose(1, 2)
    qn, kn = FM.qk_norm(
        q,
        k,
        attn.q_norm.weight,
        attn.k_norm.weight,
        cfg.rms_norm_eps,
        layout=layout,
        per_head=False,
        casting="gemma",
    )
    if layout == "bhsd":
        qn, kn = qn.transpose(1, 2), kn.transpose(1, 2)
    assert torch.equal(qn, expected_q) and torch.equal(kn, expected_k)


# -- diffusers' adaptive norms ---------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("per_token", [False, True])
def test_diffusers_ada_layer_norm_zero_bitwise(dtype, per_token):
    norm_mod = pytest.importorskip("diffusers.models.normalization")
    d = 48
    ref = norm_mod.AdaLayerNormZero(d)
    _randomize(ref, 8, std=0.2)
    ref = ref.to(dtype)
    x, emb = _x((2, 7, d), dtype, seed=9), _x((2, d), dtype, seed=10)
    y, gate_msa, *_ = ref(x, emb=emb)
    chunks = ref.linear(ref.silu(emb)).chunk(6, dim=1)
    ours = FM.modulated_norm(x, chunks[0], chunks[1], casting="eager")
    assert torch.equal(ours, y)
    if per_token:  # the same modulation given per token: the same bits
        expand = [c[:, None].expand(2, 7, d) for c in chunks[:2]]
        assert torch.equal(FM.modulated_norm(x, *expand, casting="eager"), y)
    # one rounding (casting="fp32") is never further from the float64 value than diffusers' per-op rounding
    shift64, scale64 = chunks[0].double()[:, None], chunks[1].double()[:, None]
    x64 = x.double()
    n64 = (x64 - x64.mean(-1, keepdim=True)) / torch.sqrt(x64.var(-1, correction=0, keepdim=True) + 1e-6)
    exact = n64 * (1 + scale64) + shift64
    one = FM.modulated_norm(x, chunks[0], chunks[1])
    assert (one.double() - exact).abs().max() <= (y.double() - exact).abs().max()


@pytest.mark.parametrize("dtype", DTYPES)
def test_diffusers_ada_layer_norm_zero_single_layer_bitwise(dtype):
    norm_mod = pytest.importorskip("diffusers.models.normalization")
    d = 32
    ref = norm_mod.AdaLayerNormZeroSingle(d)
    _randomize(ref, 11, std=0.2)
    ref = ref.to(dtype)
    ours = normscope.AdaLayerNorm(d, d, gate=True, casting="eager", dtype=dtype)
    ours.load_state_dict(ref.state_dict())  # same keys: linear.weight, linear.bias
    x, emb = _x((3, 4, d), dtype, seed=12), _x((3, d), dtype, seed=13)
    y_ref, gate_ref = ref(x, emb=emb)
    y, gate = ours(x, emb)
    assert torch.equal(y, y_ref) and torch.equal(gate, gate_ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm_type", ["layer_norm", "rms_norm"])
@pytest.mark.parametrize("affine", [False, True])
def test_diffusers_ada_layer_norm_continuous_layer_bitwise(dtype, norm_type, affine):
    norm_mod = pytest.importorskip("diffusers.models.normalization")
    d, c = 40, 24
    ref = norm_mod.AdaLayerNormContinuous(d, c, elementwise_affine=affine, eps=1e-5, norm_type=norm_type)
    _randomize(ref, 14, std=0.2)
    ref = ref.to(dtype)
    ours = normscope.AdaLayerNorm(
        d,
        c,
        norm="layer" if norm_type == "layer_norm" else "rms",
        eps=1e-5,
        elementwise_affine=affine,
        order="scale_shift",
        casting="eager",
        dtype=dtype,
    )
    ours.load_state_dict(ref.state_dict())
    x, cond = _x((2, 6, d), dtype, seed=15), _x((2, c), dtype, seed=16)
    assert torch.equal(ours(x, cond), ref(x, cond))


# -- bit for bit at every size: the sizes where the CPU's automatic choice moves between paths -------


@pytest.mark.parametrize("shape", [(1, 512, 1024), (1, 1024, 1024), (4, 1024, 1024)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_families_bitwise_at_every_size(shape, dtype):
    # below and above rms.MIN_AUTO_ELEMENTS: torch's op and the CPU rows path must give the family's bits
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    n = shape[-1]
    llama, gemma = LlamaRMSNorm(n, eps=1e-6), Gemma3RMSNorm(n, eps=1e-6)
    _randomize(llama, 3, std=0.1)
    _randomize(gemma, 4, std=0.01)
    llama, gemma = llama.to(dtype), gemma.to(dtype)
    x = _x(shape, dtype)
    for backend in (None, "aten", "rows", "reference"):
        y = FM.rms_norm(x, n, llama.weight, 1e-6, casting="llama", backend=backend)
        assert torch.equal(y, llama(x)), f"llama, backend {backend}"
        y = FM.rms_norm(x, n, gemma.weight, 1e-6, weight_offset=1.0, casting="gemma", backend=backend)
        assert torch.equal(y, gemma(x)), f"gemma, backend {backend}"
    # the layers too, warm (the hot path's plan) and cold
    ours = normscope.RMSNorm(n, eps=1e-6, casting="llama", dtype=dtype)
    ours.weight = llama.weight
    for _ in range(2):
        assert torch.equal(ours(x), llama(x))


@pytest.mark.parametrize("casting", ["gemma", "llama"])
def test_family_options_take_a_plan(casting):
    # a family's call is an engine configuration on the one hot path: planned once, then reused
    from normscope import functional_modern as fm

    # (a layer with a weight offset on input of its scale's dtype plans as the plain op, the scale
    # w + offset as its weight: torch's rms_norm is Gemma's order)
    layer = normscope.RMSNorm(64, weight_offset=1.0 if casting == "gemma" else 0.0, casting=casting)
    ops = (fm.RMS_NORM_FAMILY, fm.RMS_NORM)
    fm.RMS_NORM.plans.clear()
    before = sum(len(op.plans) for op in ops)
    x = torch.randn(3, 64)
    for _ in range(3):
        layer(x)
    assert sum(len(op.plans) for op in ops) == before + 1
    assert normscope.last_backend() == "aten"


@pytest.mark.parametrize("offset", [float("nan"), float("inf"), -float("inf"), 10**400])
def test_a_weight_offset_that_is_no_finite_number_is_refused_as_nan_eps_is(offset):
    # every output would be NaN or infinite (10**400: an int past any float)
    x, w = torch.randn(2, 8), torch.zeros(8)
    for call in (
        lambda: FM.rms_norm(x, 8, w, 1e-6, weight_offset=offset, casting="gemma"),
        lambda: FM.layer_norm(x, 8, w, None, weight_offset=offset),
        lambda: normscope.functional.rms_norm(x, (8,), w, weight_offset=offset),
        lambda: normscope.RMSNorm(8, weight_offset=offset),
        lambda: normscope.LayerNorm(8, weight_offset=offset),
        lambda: normscope.QKNorm(8, weight_offset=offset),
        lambda: normscope.functional.fused_add_rms_norm(x, x, w, weight_offset=offset),
    ):
        with pytest.raises(ValueError, match="weight_offset"):
            call()


def test_fused_add_rms_norm_checks_its_scalars_as_rms_norm_does():
    x, w = torch.randn(2, 8), torch.zeros(8)
    fused = normscope.functional.fused_add_rms_norm
    for call, exc, name in (
        (lambda: fused(x, x, w, float("nan")), ValueError, "eps"),
        (lambda: fused(x, x, w, "1e-6"), TypeError, "eps"),
        (lambda: fused(x, x, w, weight_offset="1"), TypeError, "weight_offset"),
        (lambda: fused(x, x, w, weight_offset=True), TypeError, "weight_offset"),
        (lambda: fused(x, x, w, residual_fp32="yes"), TypeError, "residual_fp32"),
    ):
        with pytest.raises(exc, match=name):
            call()


@pytest.mark.parametrize("norm", ["layer", "rms"])
def test_modulated_castings_agree_for_fp32_without_an_affine(norm):
    # the docstring's claim: same bits for fp32 input without weight/bias (and not promised with them)
    g = torch.Generator().manual_seed(5)
    x, shift, scale = (torch.randn(s, generator=g) for s in ((2, 9, 48), (2, 48), (2, 48)))
    a = FM.modulated_norm(x, shift, scale, norm=norm, casting="fp32")
    b = FM.modulated_norm(x, shift, scale, norm=norm, casting="eager")
    assert torch.equal(a, b)
    s = scale[:, None].double()
    x64 = x.double()
    if norm == "layer":
        xn = (x64 - x64.mean(-1, keepdim=True)) * torch.rsqrt(x64.var(-1, unbiased=False, keepdim=True) + 1e-6)
    else:
        xn = x64 * torch.rsqrt(x64.square().mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(a.double(), xn * (1 + s) + shift[:, None].double(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("memory", ["bshd", "bhsd_view", "bhsd_contiguous", "head_dim_strided"])
def test_full_width_qk_norm_takes_the_projections_order_in_any_memory_layout(dtype, memory):
    """``per_head=False`` is OLMo 2's norm of the (B, S, H*D) projection: one reduction over H*D in
    that order. Given q in any memory layout -- (B, H, S, D) transposed or copied, head_dim strided --
    the bits are the projection's (a reduction over the (H, D) axes as they lie in memory takes
    the elements in another order: 1-ulp differences at H=4, D=128)."""
    b, s, h, d, eps = 3, 5, 4, 128, 1e-6
    g = torch.Generator().manual_seed(3)
    proj = (torch.randn(b, s, h * d, generator=g, dtype=torch.float64) * 100 - 1).to(dtype)
    w = torch.randn(h * d, generator=g, dtype=torch.float64).to(dtype)
    # OLMo 2's order (casting="gemma"): (w32 * (x32 * rstd)) rounded once; fp32/fp64 in, nothing to round
    expected = w * (proj * torch.rsqrt(proj.pow(2).mean(-1, keepdim=True) + eps))
    q = proj.view(b, s, h, d)
    layout = "bshd"
    if memory == "bhsd_view":
        q, layout = q.transpose(1, 2), "bhsd"
    elif memory == "bhsd_contiguous":
        q, layout = q.transpose(1, 2).contiguous(), "bhsd"
    elif memory == "head_dim_strided":
        q = q.transpose(-1, -2).contiguous().transpose(-1, -2)
    qn, _ = FM.qk_norm(q, q, w, w, eps, layout=layout, per_head=False, casting="gemma")
    qn = qn.transpose(1, 2) if layout == "bhsd" else qn
    assert torch.equal(qn.reshape(b, s, h * d), expected)


# -- fp64 input: normalized in fp64 by the options; a patched model keeps its module's bits -------
#
# The families' modules cast every input to fp32 (LlamaRMSNorm: ``hidden_states.to(torch.float32)``;
# GemmaRMSNorm: ``self._norm(x.float())``), fp64 included: a downcast. The casting orders say where half
# and fp32 input round, and normalize fp64 input in fp64 (docs/modern.md); a patched model runs its
# module's own forward on fp64 input, so its bits are kept there too.


@pytest.mark.parametrize(
    "family,cls_name,options",
    [
        ("llama", "LlamaRMSNorm", dict(casting="llama")),
        ("qwen3", "Qwen3RMSNorm", dict(casting="llama")),
        ("gemma", "GemmaRMSNorm", dict(casting="gemma", weight_offset=1.0)),
        ("gemma3", "Gemma3RMSNorm", dict(casting="gemma", weight_offset=1.0)),
    ],
)
def test_fp64_input_normalizes_in_fp64_and_a_patched_module_keeps_its_bits(family, cls_name, options):
    import copy
    import importlib

    from normscope.integrations import transformers as nt

    cls = getattr(importlib.import_module(f"transformers.models.{family}.modeling_{family}"), cls_name)
    d = 33
    module = cls(d, eps=1e-6)
    _randomize(module, 5, std=0.3)
    module = module.double()
    x = _x((2, 5, d), torch.float64)
    # the option: the formula in fp64 (closer to the exact value than the module's fp32)
    w = module.weight.detach()
    scale = w + options.get("weight_offset", 0.0)
    exact = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * scale
    y = FM.rms_norm(x, d, w, 1e-6, **options)
    torch.testing.assert_close(y, exact, rtol=1e-14, atol=1e-14)
    assert (module(x) - exact).abs().max() > 1e-10  # the module's downcast: not the option's result
    # the patch: the module's own bits on fp64 input, output and gradients
    holder = torch.nn.Sequential(copy.deepcopy(module))
    nt.patch(holder)
    assert type(holder[0]) is not cls and isinstance(holder[0], cls)  # patched, not left alone
    a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
    expected, got = module(a), holder(b)
    assert torch.equal(got, expected)
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(6), dtype=x.dtype)
    expected.backward(dy)
    got.backward(dy)
    assert torch.equal(b.grad, a.grad) and torch.equal(holder[0].weight.grad, module.weight.grad)
