"""The scale ``w + weight_offset`` of a model family's RMSNorm layer (Gemma's ``1 + w``) follows every
change of the weight, as torch's layers and transformers' Gemma RMSNorm do -- those the version counter
sees and those it does not (``.data`` writes, the buffers FSDP and ZeRO-3 gather into). Every test
compares with an independent computation -- Gemma's formula written out,
``(x32 * rsqrt(mean(x32^2) + eps) * (1 + w32)).to(x.dtype)``, or the functional form -- after each way
a weight changes."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

import normscope
import normscope.functional_modern as FM

EPS = 1e-6


def _gemma(x, w, offset=1.0):
    x32 = x.detach().to(torch.float64 if x.dtype == torch.float64 else torch.float32)
    acc = x32.dtype
    r = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + EPS)
    return (x32 * r * (w.detach().to(acc) + offset)).to(x.dtype)


def _layer(d, dtype, casting="gemma"):
    m = normscope.RMSNorm(d, eps=EPS, weight_offset=1.0, casting=casting, dtype=dtype)
    with torch.no_grad():
        m.weight.copy_(torch.randn(d, generator=torch.Generator().manual_seed(1)) * 0.1)
    return m


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("shape", [(3, 64), (2, 1024, 1024)], ids=["small", "rows-path"])
def test_every_way_the_weight_changes_is_seen(dtype, shape):
    if shape[-2] == 1024 and dtype in (torch.float16, torch.float64):
        pytest.skip("the rows path is covered by fp32 and bf16")
    d = shape[-1]
    m = _layer(d, dtype)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(shape, generator=g).to(dtype)

    def check(tag):
        with torch.no_grad():
            assert torch.equal(m(x), _gemma(x, m.weight)), tag
        y = m(x)  # with a graph
        assert torch.equal(y, _gemma(x, m.weight)), tag

    check("first")
    check("again")
    with torch.no_grad():
        m.weight.mul_(-2.0)
    check("no_grad in place")
    opt = torch.optim.SGD(m.parameters(), lr=0.5)
    m(x).float().square().mean().backward()
    opt.step()
    check("optimizer step")
    m.load_state_dict({"weight": torch.randn(d, generator=g).to(dtype)})
    check("load_state_dict")
    torch.nn.init.normal_(m.weight, std=0.3)
    check("nn.init")
    m.weight.data = torch.randn(d, generator=g).to(dtype)
    check(".data reassigned")
    with torch.inference_mode():
        assert torch.equal(m(x), _gemma(x, m.weight))
    check("after inference mode")


@pytest.mark.parametrize("layout", ["strided", "expanded", "shorter"])
def test_data_reassigned_to_another_view_at_the_same_address_is_seen(layout):
    """``.data`` set to a view of one storage, then to another view starting at the same element:
    the same address and the storage's one version counter, other values."""
    m = _layer(8, torch.float32)
    x = torch.randn(3, 8)
    base = torch.randn(16, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        m.weight.data = base[:8]
        assert torch.equal(m(x), _gemma(x, m.weight))
        if layout == "shorter":  # the same address, fewer elements: refused as torch refuses it
            m.weight.data = base[:4]
            with pytest.raises(ValueError, match="weight"):
                m(x)
            return
        m.weight.data = base[::2] if layout == "strided" else base[:1].expand(8)
        assert torch.equal(m(x), _gemma(x, m.weight))


def test_dtype_and_device_moves_are_seen():
    m = _layer(64, torch.float32)
    x = torch.randn(4, 64)
    m(x)
    m.to(torch.float64)
    assert torch.equal(m(x.double()), _gemma(x.double(), m.weight))
    m.half()
    assert torch.equal(m(x.half()), _gemma(x.half(), m.weight))
    assert torch.equal(m(x), _gemma(x, m.weight))  # fp32 input, fp16 weight: the scale in fp32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradients_through_the_scale_equal_the_functional_ones(dtype):
    m = _layer(64, dtype)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(5, 64, generator=g).to(dtype)
    w_ref = m.weight.detach().clone().requires_grad_()
    for step in range(3):  # each backward accumulates the same gradient
        dy = torch.randn(5, 64, generator=g).to(dtype)
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        m(xa).backward(dy)
        FM.rms_norm(xb, (64,), w_ref, EPS, weight_offset=1.0, casting="gemma").backward(dy)
        assert torch.equal(xa.grad, xb.grad), step
        assert torch.equal(m.weight.grad, w_ref.grad), step
    # against float64: the scale's gradient is the weight's
    x64, w64 = x.double().requires_grad_(), m.weight.detach().double().requires_grad_()
    r = torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + EPS)
    m.weight.grad = None
    m(x).backward(dy)
    (x64 * r * (1 + w64)).backward(dy.double())
    torch.testing.assert_close(
        m.weight.grad.double(), w64.grad, rtol=2e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-3
    )


def test_a_layer_copies_and_pickles_after_a_call():
    m = _layer(64, torch.float32)
    x = torch.randn(4, 64, requires_grad=True)
    m(x)  # a call with a graph
    for other in (copy.deepcopy(m), pickle.loads(pickle.dumps(m))):
        assert torch.equal(other(x), m(x))
        with torch.no_grad():
            other.weight.add_(1.0)
        assert torch.equal(other(x), _gemma(x, other.weight))
        assert torch.equal(m(x), _gemma(x, m.weight))  # the copies share nothing


def test_transformed_and_functional_calls_form_the_scale_each_time():
    m = _layer(64, torch.float32)
    x = torch.randn(4, 64)
    got = torch.func.vmap(lambda t: m(t))(x.unsqueeze(1)).squeeze(1)
    assert torch.equal(got, _gemma(x, m.weight))
    w2 = {"weight": m.weight.detach() * 3}
    assert torch.equal(torch.func.functional_call(m, w2, (x,)), _gemma(x, w2["weight"]))


def test_traced_and_compiled_layers_read_the_weight_on_every_call():
    m = _layer(64, torch.float32)
    x = torch.randn(4, 64)
    m(x)  # an eager call first: a trace must not take anything of it as a constant
    traced = torch.jit.trace(m, x)
    compiled = torch.compile(m, backend="eager", fullgraph=True)
    compiled(x)
    with torch.no_grad():
        m.weight.add_(1.0)
    want = _gemma(x, m.weight)
    assert torch.equal(traced(x), want)
    assert torch.equal(compiled(x), want)
    assert torch.equal(m(x), want)


def test_the_transformers_gemma_layer_sees_its_weight_change():
    from normscope.integrations.transformers import GemmaRMSNorm

    m = GemmaRMSNorm(64, eps=EPS, dtype=torch.bfloat16)
    x = torch.randn(3, 64).to(torch.bfloat16)
    assert torch.equal(m(x), _gemma(x, m.weight))
    with torch.no_grad():
        m.weight.add_(0.25)
    assert torch.equal(m(x), _gemma(x, m.weight))


def test_data_repointed_at_a_regathered_buffer_is_seen():
    """FSDP (``use_orig_params``) and DeepSpeed ZeRO-3 gather the weight into an unsharded buffer before
    each forward -- FSDP into the same buffer, ZeRO-3 often into a freed buffer's address -- and point
    ``param.data`` at it: the weight object, its version counter, address, dtype, shape and strides stay;
    the values are new."""
    m = _layer(64, torch.float32)
    x = torch.randn(3, 64)
    g = torch.Generator().manual_seed(5)
    unsharded = torch.empty(64)
    for step in range(3):
        unsharded.copy_(torch.randn(64, generator=g))  # the all-gather
        m.weight.data = unsharded
        assert torch.equal(m(x), _gemma(x, unsharded)), step
        m.weight.data = torch.empty(0)  # resharded after the forward


def test_in_place_writes_through_data_are_seen():
    # old-style EMA (``p.data.mul_(d).add_(...)``) and ``nn.init`` on ``p.data``: torch's layers and
    # transformers' Gemma RMSNorm read the weight on every call
    m = _layer(64, torch.float32)
    x = torch.randn(3, 64)
    m(x)
    m.weight.data.mul_(0.5).add_(0.7)
    assert torch.equal(m(x), _gemma(x, m.weight))
    with torch.no_grad():
        m(x)
        torch.nn.init.constant_(m.weight.data, 2.0)
        assert torch.equal(m(x), _gemma(x, m.weight))
