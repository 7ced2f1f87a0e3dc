"""Modern norms (AdaLN, QK-norm, Gemma RMSNorm, PolyNorm, Derf) against float64 formulas from their papers.

The formulas below are deliberately written without normscope or the engine: mean of squares,
variance, erf, all in float64. Each test compares normscope's output (and gradients, where the
norm has parameters) to them at the dtype's tolerance.
"""

from __future__ import annotations

import pickle

import pytest
import torch
from torch import nn

import normscope
from normscope import functional_modern as FM

TOL = {torch.float32: (2e-5, 2e-5), torch.bfloat16: (2e-2, 2e-2), torch.float64: (1e-12, 1e-12)}


def rms64(u, eps, dims=(-1,)):
    u = u.double()
    return u / torch.sqrt(u.pow(2).mean(dims, keepdim=True) + eps)


def ln64(u, eps, dims=(-1,)):
    u = u.double()
    m = u.mean(dims, keepdim=True)
    return (u - m) / torch.sqrt((u - m).pow(2).mean(dims, keepdim=True) + eps)


def close(actual, expected, dtype):
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(actual.double(), expected.double(), atol=atol, rtol=rtol)


# -- modulated norm / AdaLayerNorm ------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("norm", ["layer", "rms"])
@pytest.mark.parametrize("per_token", [False, True])
@pytest.mark.parametrize("casting", ["fp32", "eager"])
def test_modulated_norm_formula(dtype, norm, per_token, casting):
    g = torch.Generator().manual_seed(0)
    b, s, d = 3, 5, 1536  # 1536: a non-power-of-two width (Liger #518)
    x = (torch.randn(b, s, d, generator=g) * 2 + 3).to(dtype)
    mshape = (b, s, d) if per_token else (b, d)
    shift = torch.randn(mshape, generator=g).to(dtype)
    scale = (torch.randn(mshape, generator=g) * 0.1).to(dtype)
    y = FM.modulated_norm(x, shift, scale, norm=norm, casting=casting)
    assert y.dtype == dtype and y.shape == x.shape
    n = (ln64 if norm == "layer" else rms64)(x, 1e-6)
    sh, sc = (shift, scale) if per_token else (shift[:, None], scale[:, None])
    close(y, n * (1 + sc.double()) + sh.double(), dtype)


def test_modulated_norm_with_norm_affine_and_4d():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 4, 16, generator=g, dtype=torch.float64)
    w, bb = torch.randn(16, generator=g, dtype=torch.float64), torch.randn(16, generator=g, dtype=torch.float64)
    shift, scale = (
        torch.randn(2, 16, generator=g, dtype=torch.float64),
        torch.randn(2, 16, generator=g, dtype=torch.float64),
    )
    y = FM.modulated_norm(x, shift, scale, w, bb, 1e-5)
    expected = (ln64(x, 1e-5) * w + bb) * (1 + scale[:, None, None]) + shift[:, None, None]
    close(y, expected, torch.float64)


def test_modulated_norm_constant_input_gives_shift_not_nan():
    x = torch.full((2, 4, 8), 3.0, dtype=torch.bfloat16)
    shift = torch.randn(2, 8).to(torch.bfloat16)
    y = FM.modulated_norm(x, shift, torch.randn(2, 8).to(torch.bfloat16))
    assert torch.isfinite(y).all()
    torch.testing.assert_close(y, shift[:, None].expand_as(y))


def test_modulated_norm_gradients_float64():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 3, 6, generator=g, dtype=torch.float64, requires_grad=True)
    shift = torch.randn(2, 6, generator=g, dtype=torch.float64, requires_grad=True)
    scale = torch.randn(2, 3, 6, generator=g, dtype=torch.float64, requires_grad=True)
    for norm in ("layer", "rms"):
        torch.autograd.gradcheck(lambda a, b, c, norm=norm: FM.modulated_norm(a, b, c, norm=norm), (x, shift, scale))


def test_modulated_norm_empty_input():
    x = torch.randn(0, 4, 8)
    y = FM.modulated_norm(x, torch.randn(0, 8), torch.randn(0, 8))
    assert y.shape == (0, 4, 8)


@pytest.mark.parametrize("per_token", [False, True])
def test_ada_layer_norm_dit(per_token):
    torch.manual_seed(0)
    d, c = 16, 12
    ada = normscope.AdaLayerNorm(d, c, gate=True)
    x = torch.randn(2, 5, d, dtype=torch.float64)
    cond = torch.randn(2, 5, c) if per_token else torch.randn(2, c)
    ada = ada.double()
    y, gate = ada(x, cond.double())
    # zero-initialised projection (adaLN-Zero): plain LayerNorm, gate 0
    close(y, ln64(x, 1e-6), torch.float64)
    assert gate.abs().max() == 0 and gate.shape == cond.shape[:-1] + (d,)
    ada.reset_parameters()
    with torch.no_grad():
        ada.linear.weight.normal_()
        ada.linear.bias.normal_()
    y, gate = ada(x, cond.double())
    emb = torch.nn.functional.silu(cond.double()) @ ada.linear.weight.T + ada.linear.bias
    shift, scale, g = emb.chunk(3, -1)
    if not per_token:
        shift, scale = shift[:, None], scale[:, None]
    close(y, ln64(x, 1e-6) * (1 + scale) + shift, torch.float64)
    close(gate, g, torch.float64)
    y.sum().backward()  # stride-0 upstream gradient
    assert ada.linear.weight.grad is not None and torch.isfinite(ada.linear.weight.grad).all()


def test_ada_layer_norm_scale_shift_order_rms_affine_state_dict():
    d, c = 8, 4
    ada = normscope.AdaLayerNorm(d, c, norm="rms", elementwise_affine=True, order="scale_shift", zero_init=False)
    assert sorted(ada.state_dict()) == ["linear.bias", "linear.weight", "norm.weight"]
    with torch.no_grad():
        ada.norm.weight.normal_()
    x, cond = torch.randn(3, 7, d), torch.randn(3, c)
    emb = ada.linear(torch.nn.functional.silu(cond)).double()
    scale, shift = emb.chunk(2, -1)
    expected = rms64(x, 1e-6) * ada.norm.weight.double() * (1 + scale[:, None]) + shift[:, None]
    close(ada(x, cond), expected, torch.float32)
    clone = pickle.loads(pickle.dumps(ada))
    torch.testing.assert_close(clone(x, cond), ada(x, cond))


# -- zero-centred weight and casting ---------------------------------------------------------------


@pytest.mark.parametrize("casting", ["torch", "gemma", "llama"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zero_centred_rms_formula(casting, dtype):
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(4, 1536, generator=g) * 3).to(dtype)
    w = (torch.randn(1536, generator=g) * 0.1).to(dtype)
    y = FM.rms_norm(x, 1536, w, 1e-6, weight_offset=1.0, casting=casting)
    close(y, rms64(x, 1e-6) * (1 + w.double()), dtype)


def test_bf16_one_plus_tiny_weight_is_not_rounded_away():
    # Liger #1462: 1 + 2^-8 in bf16 is 1.0; formed in fp32 the scale keeps it
    x = torch.ones(1, 4, dtype=torch.bfloat16) * torch.tensor([1.0, -1.0, 1.0, -1.0], dtype=torch.bfloat16)
    w = torch.full((4,), 2.0**-8, dtype=torch.bfloat16)
    for casting in ("torch", "gemma"):
        y = FM.rms_norm(x.float(), 4, w, 0.0, weight_offset=1.0, casting=casting)
        assert y.abs().max().item() == pytest.approx(1 + 2**-8), casting


def test_llama_casting_rounds_before_scaling():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(3, 64, generator=g).to(torch.bfloat16)
    w = torch.randn(64, generator=g).to(torch.bfloat16)
    y = FM.rms_norm(x, 64, w, 1e-6, casting="llama")
    n = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16)
    assert torch.equal(y, w * n)
    # an fp32 weight on bf16 activations: fp32 output, by type promotion (as transformers')
    assert FM.rms_norm(x, 64, w.float(), 1e-6, casting="llama").dtype == torch.float32


@pytest.mark.parametrize("casting", ["torch", "gemma", "llama"])
def test_zero_centred_layer_norm_formula(casting):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 5, 33, generator=g) * 2 + 100
    w, b = torch.randn(33, generator=g) * 0.1, torch.randn(33, generator=g)
    y = FM.layer_norm(x, 33, w, b, 1e-5, weight_offset=1.0, casting=casting)
    close(y, ln64(x, 1e-5) * (1 + w.double()) + b.double(), torch.float32)


def test_weight_as_view_and_gradients():
    g = torch.Generator().manual_seed(6)
    base = torch.randn(2, 32, generator=g, dtype=torch.float64, requires_grad=True)
    x = torch.randn(4, 16, generator=g, dtype=torch.float64, requires_grad=True)
    for casting in ("torch", "gemma", "llama"):
        torch.autograd.gradcheck(
            lambda a, p, casting=casting: FM.rms_norm(a, 16, p[0, ::2], 1e-6, weight_offset=1.0, casting=casting),
            (x, base),
        )


# -- QK-norm ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
@pytest.mark.parametrize("per_head", [True, False])
@pytest.mark.parametrize("norm", ["rms", "layer"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qk_norm_formula(layout, per_head, norm, dtype):
    g = torch.Generator().manual_seed(7)
    b, s, h, hkv, d = 2, 5, 4, 2, 16
    q = torch.randn(b, s, h, d, generator=g).to(dtype)
    k = (torch.randn(b, s, hkv, d, generator=g) + 1).to(dtype)
    shape_q, shape_k = ((d,), (d,)) if per_head else ((h * d,), (hkv * d,))
    qw, kw = torch.randn(shape_q, generator=g).to(dtype), torch.randn(shape_k, generator=g).to(dtype)
    qb = torch.randn(shape_q, generator=g).to(dtype) if norm == "layer" else None
    kb = torch.randn(shape_k, generator=g).to(dtype) if norm == "layer" else None
    qi, ki = (q, k) if layout == "bshd" else (q.transpose(1, 2), k.transpose(1, 2))
    qn, kn = FM.qk_norm(qi, ki, qw, kw, layout=layout, per_head=per_head, norm=norm, q_bias=qb, k_bias=kb)
    assert qn.shape == qi.shape and kn.shape == ki.shape and qn.dtype == dtype
    if layout == "bhsd":
        qn, kn = qn.transpose(1, 2), kn.transpose(1, 2)
    f = ln64 if norm == "layer" else rms64
    for t, out, w, bb, heads in ((q, qn, qw, qb, h), (k, kn, kw, kb, hkv)):
        if per_head:
            expected = f(t, 1e-6) * w.double()
        else:  # OLMo 2: over the flattened (H * D) width of each token
            expected = (f(t.reshape(b, s, heads * d), 1e-6) * w.double()).reshape(b, s, heads, d)
        if bb is not None:
            expected = expected + (bb.double() if per_head else bb.double().reshape(heads, d))
        close(out, expected, dtype)


def test_qk_norm_module_gemma_offset_and_grad():
    qkn = normscope.QKNorm(8, weight_offset=1.0, casting="gemma", layout="bhsd")
    assert torch.equal(qkn.q_weight, torch.zeros(8))  # Gemma's offset weights start at 0
    q = torch.randn(2, 3, 5, 8, requires_grad=True)
    k = torch.randn(2, 1, 5, 8, requires_grad=True)
    qn, kn = qkn(q, k)
    close(qn, rms64(q.detach(), 1e-6), torch.float32)
    (qn.sum() + kn.sum()).backward()
    assert qkn.q_weight.grad is not None and q.grad is not None


def test_qk_norm_full_width_module():
    qkn = normscope.QKNorm(4, num_heads=3, num_kv_heads=1, per_head=False)
    assert qkn.q_weight.shape == (12,) and qkn.k_weight.shape == (4,)
    q, k = torch.randn(2, 5, 3, 4), torch.randn(2, 5, 1, 4)
    qn, _ = qkn(q, k)
    close(qn, rms64(q.reshape(2, 5, 12), 1e-6).reshape(2, 5, 3, 4), torch.float32)


# -- PolyNorm and Derf -----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_poly_norm_formula(dtype):
    g = torch.Generator().manual_seed(8)
    x = torch.randn(3, 7, 1536, generator=g).to(dtype)
    pn = normscope.PolyNorm().to(dtype)
    assert torch.equal(pn.weight.float(), torch.full((3,), 1 / 3).to(dtype).float())
    assert torch.equal(pn.bias.float(), torch.ones(1))
    w, b = torch.tensor([0.3, -0.7, 1.1]), torch.tensor([0.25])
    with torch.no_grad():
        pn.weight.copy_(w)
        pn.bias.copy_(b)
    w, b = pn.weight.double(), pn.bias.double()
    x64 = x.double()
    expected = w[0] * rms64(x64**3, 1e-6) + w[1] * rms64(x64**2, 1e-6) + w[2] * rms64(x64, 1e-6) + b
    close(pn(x), expected, dtype)


def test_poly_norm_grad_and_constant_input():
    x = torch.randn(2, 5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, dtype=torch.float64, requires_grad=True)
    b = torch.randn(1, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(lambda *a: FM.poly_norm(*a), (x, w, b))
    assert torch.isfinite(normscope.PolyNorm()(torch.zeros(2, 8))).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_derf_formula(dtype):
    g = torch.Generator().manual_seed(9)
    m = normscope.Derf(6, alpha_init=0.7, shift_init=0.1, channel_dim=1).to(dtype)
    with torch.no_grad():
        m.weight.normal_(generator=g)
        m.bias.normal_(generator=g)
    x = (torch.randn(2, 6, 3, 3, generator=g) * 3).to(dtype)
    view = (1, 6, 1, 1)
    expected = m.weight.double().reshape(view) * torch.erf(m.alpha.double() * x.double() + m.shift.double())
    close(m(x), expected + m.bias.double().reshape(view), dtype)


def test_derf_gradcheck_and_repr_state_dict():
    m = normscope.Derf(4).double()
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(lambda a: m(a), (x,))
    assert sorted(m.state_dict()) == ["alpha", "bias", "shift", "weight"]
    assert "alpha_init=0.5" in repr(m)
    assert normscope.Derf(4, affine=False).weight is None


# -- registry --------------------------------------------------------------------------------------


def test_registry_names():
    assert isinstance(normscope.get_norm("derf", 8), normscope.Derf)
    assert isinstance(normscope.get_norm("polynorm", 8), normscope.PolyNorm)
    assert isinstance(normscope.get_norm("qknorm", 8), normscope.QKNorm)
    ada = normscope.get_norm("adaln", 8, cond_dim=4)
    assert isinstance(ada, normscope.AdaLayerNorm) and not ada.gate
    assert normscope.get_norm("adaln_zero", 8, cond_dim=4).gate
    for name in ("derf", "polynorm", "qknorm", "adaln", "adaln_zero", "gemma_rms", "llama_rms"):
        assert name in normscope.norm_names()
    gemma = normscope.get_norm("gemma_rms", 16)
    with torch.no_grad():
        gemma.weight.normal_()
    x = torch.randn(3, 16)
    close(gemma(x), rms64(x, 1e-6) * (1 + gemma.weight.double()), torch.float32)
    assert torch.equal(normscope.get_norm("llama_rms", 16, eps=1e-5).weight, torch.ones(16))


# -- bad input: a clear error naming the argument, before any work ----------------------------------


@pytest.mark.parametrize(
    "call, error, words",
    [
        (lambda: FM.modulated_norm(torch.randn(2, 3, 8), torch.randn(2, 7)), ValueError, ["shift", "(2, 8)", "(2, 7)"]),
        (lambda: FM.modulated_norm(torch.randn(2, 3, 8), norm="batch"), ValueError, ["norm", "batch"]),
        (lambda: FM.modulated_norm(torch.randn(2, 3, 8), casting="x"), ValueError, ["casting"]),
        (lambda: FM.modulated_norm([1.0]), TypeError, ["x", "list"]),
        (lambda: FM.qk_norm(torch.randn(2, 3, 4, 8), torch.randn(2, 3, 4, 6)), ValueError, ["k", "head_dim"]),
        (lambda: FM.qk_norm(torch.randn(2, 3, 8), torch.randn(2, 3, 8)), ValueError, ["q", "4 dims"]),
        (
            lambda: FM.qk_norm(torch.randn(2, 3, 4, 8), torch.randn(2, 3, 4, 8), torch.ones(7)),
            ValueError,
            ["q_weight", "(8,)", "(7,)"],
        ),
        (lambda: FM.qk_norm(torch.randn(2, 3, 4, 8), torch.randn(2, 3, 4, 8), layout="sbhd"), ValueError, ["layout"]),
        (lambda: FM.rms_norm(torch.randn(2, 8), 8, torch.ones(8), casting="fp16"), ValueError, ["casting", "fp16"]),
        (lambda: FM.rms_norm(torch.randn(2, 8), 7), ValueError, ["normalized_shape=[7]", "(2, 8)"]),
        (lambda: FM.poly_norm(torch.randn(2, 8), torch.ones(2), torch.ones(1)), ValueError, ["weight", "(3,)", "(2,)"]),
        (lambda: FM.derf(torch.randn(2, 8), torch.ones(2)), ValueError, ["alpha", "one element"]),
        (lambda: normscope.AdaLayerNorm(8, 4)(torch.randn(2, 3, 8), torch.randn(2, 5)), ValueError, ["cond", "4"]),
        (lambda: normscope.QKNorm(8, per_head=False), ValueError, ["num_heads"]),
    ],
)
def test_errors(call, error, words):
    with pytest.raises(error) as info:
        call()
    for w in words:
        assert w in str(info.value), (w, str(info.value))


@pytest.mark.parametrize(
    "change, error, words",
    [
        (lambda m: setattr(m.linear, "weight", None), TypeError, ["`linear.weight`", "(24, 4)", "NoneType"]),
        (lambda m: setattr(m, "linear", None), TypeError, ["`linear`", "nn.Linear(4, 24)", "NoneType"]),
        (lambda m: setattr(m, "linear", nn.Identity()), TypeError, ["`linear.weight`", "no `weight`"]),
        (lambda m: setattr(m.linear, "weight", nn.Parameter(torch.zeros(16, 4))), ValueError, ["(24, 4)", "(16, 4)"]),
        (lambda m: setattr(m.linear, "weight", nn.Parameter(torch.zeros(24, 5))), ValueError, ["(24, 4)", "(24, 5)"]),
        (lambda m: setattr(m.linear, "bias", nn.Parameter(torch.zeros(5))), ValueError, ["bias", "(24,)", "(5,)"]),
        (
            lambda m: setattr(m.linear, "weight", nn.Parameter(torch.zeros(24, 4).long(), requires_grad=False)),
            TypeError,
            ["`linear.weight`", "floating-point", "torch.int64"],
        ),
        (lambda m: setattr(m, "norm", None), TypeError, ["`norm`", "`weight` and `bias`", "NoneType"]),
    ],
)
def test_adaln_projection_changed_after_construction_is_refused_by_name_before_any_work(change, error, words):
    """A projection whose weight was set to None raised ``AttributeError: 'NoneType' object has no attribute
    'dtype'`` from the forward (a replaced ``linear`` or ``norm`` likewise), a weight or bias of another
    shape a RuntimeError from inside the matmul or the chunking: each is named now, with what was expected
    and what was found, before the projection runs."""
    ada = normscope.AdaLayerNorm(8, 4, gate=True, elementwise_affine=True)
    change(ada)
    ran = []
    if isinstance(ada.linear, nn.Module):
        ada.linear.register_forward_pre_hook(lambda *a: ran.append(1))
    with pytest.raises(error) as info:
        ada(torch.randn(2, 3, 8), torch.randn(2, 4))
    for w in words:
        assert w in str(info.value), (w, str(info.value))
    assert not ran, "the projection ran before the refusal"
    ada = normscope.AdaLayerNorm(8, 4, bias=False)  # no bias is a projection as built
    ada.linear.bias = None
    assert ada(torch.randn(2, 3, 8), torch.randn(2, 4)).shape == (2, 3, 8)


# -- sandwich / Peri-LN placement in the lab's transformer block ------------------------------------


@pytest.mark.parametrize("placement", ["sandwich", "peri"])
def test_block_sandwich_placement(placement):
    from normscope.tools.lab.models import Block, TinyTransformer

    torch.manual_seed(0)
    blk = Block(16, 4, "rms", True, False, placement=placement)
    with torch.no_grad():  # distinct output-norm weights, so a swapped or missing norm shows
        for n in (blk.n1_out, blk.n2_out):
            n.inner.weight.uniform_(0.5, 2.0)
    x = torch.randn(2, 5, 16)
    h = x + blk.n1_out(blk.attn(blk.n1(x), None))
    expected = h + blk.n2_out(blk.ff(blk.n2(h)))
    torch.testing.assert_close(blk(x), expected)
    model = TinyTransformer(11, 3, d=16, depth=2, heads=4, norm="rms", placement=placement)
    assert (model.embed_norm is not None) == (placement == "peri")
    assert model(torch.randint(0, 11, (2, 6))).shape == (2, 6, 3)
    with pytest.raises(ValueError, match="placement"):
        Block(16, 4, "rms", True, False, placement="middle")


# -- the tour's worked examples --------------------------------------------------------------------


def test_tour_sections_for_qk_norm_and_adaln():
    from normscope.tools import tour

    sections = {s.key: s for s in tour.run()}
    qk, ada = sections["qk_norm"], sections["adaln"]
    assert all(c.passed for c in qk.checks + ada.checks)
    q = torch.tensor(qk.data["q"], dtype=torch.float64)
    close(torch.tensor(qk.data["per_head"]), rms64(q, 1e-6), torch.float32)
    close(torch.tensor(qk.data["all_heads"]), rms64(q, 1e-6, dims=(-2, -1)), torch.float32)
    x = torch.tensor(ada.data["x"], dtype=torch.float64)
    shift, scale = torch.tensor(ada.data["shift"]), torch.tensor(ada.data["scale"])
    expected = ln64(x, 1e-6) * (1 + scale.double()[:, None]) + shift.double()[:, None]
    close(torch.tensor(ada.data["y"]), expected, torch.float32)


def test_docs_modern_examples_run():
    """Every python block of docs/modern.md runs, in order, in one namespace."""
    import pathlib
    import re

    text = (pathlib.Path(__file__).parents[2] / "docs" / "modern.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert len(blocks) >= 6
    namespace: dict = {}
    try:
        for block in blocks:
            if "ns_hf" in block:
                pytest.importorskip("transformers")
            exec(compile(block, "docs/modern.md", "exec"), namespace)
    finally:
        from normscope.integrations import transformers as hf

        hf.unpatch_classes()


# -- explain ---------------------------------------------------------------------------------------


def test_explain_shows_qk_norms_per_head_scope_and_adalns_affine():
    from normscope.tools import explain

    x = torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(0))
    r = explain.explain("qknorm", (2, 3, 8), groups=2, values=x.flatten().tolist())
    assert r["scope"]["num_scopes"] == 2 * 3 * 2 and r["scope"]["elements_per_scope"] == 4
    assert "one head" in r["scope"]["words"] and r["torch"]["allclose"]
    ids = torch.tensor(r["scope_ids"])
    assert ids[0, 0].tolist() == [0] * 4 + [1] * 4  # one token's D features: two heads, two scopes
    close(torch.tensor(r["output"]), rms64(x.reshape(2, 3, 2, 4), 1e-5).reshape(2, 3, 8), torch.float32)
    r = explain.explain("AdaLayerNorm", (2, 3, 8), values=x.flatten().tolist())
    assert r["layer"] == "adaln" and "conditioning tensor" in r["affine"]
    close(torch.tensor(r["output"]), ln64(x, 1e-5), torch.float32)
    assert explain.explain("qknorm", (2, 3, 8))["groups"] == 2  # the heads, by default 2 where they divide D
    with pytest.raises(explain.UsageError, match="3 axes"):
        explain.explain("adaln", (2, 3, 4, 4))


def test_torch_compile_fullgraph():
    """The unfused forms trace whole (no graph break) and agree with eager."""
    x, s, c = torch.randn(2, 5, 16), torch.randn(2, 16), torch.randn(2, 16)
    f = torch.compile(lambda x, s, c: FM.modulated_norm(x, s, c), fullgraph=True)
    torch.testing.assert_close(f(x, s, c), FM.modulated_norm(x, s, c))
    q, k, w = torch.randn(2, 5, 4, 16), torch.randn(2, 5, 2, 16), torch.randn(16)
    g = torch.compile(lambda q, k, w: FM.qk_norm(q, k, w, w, weight_offset=1.0, casting="gemma"), fullgraph=True)
    for a, b in zip(g(q, k, w), FM.qk_norm(q, k, w, w, weight_offset=1.0, casting="gemma")):
        torch.testing.assert_close(a, b)
