"""Calls under modes that change how a call runs without changing its arguments: CPU autocast, inference
mode, autograd's batched backward.

torch.nn's norms are not among CPU autocast's ops, so torch gives the same numbers inside an autocast block
as outside; the independent computations here are torch.nn's layers (or the model families' formulas) run
under the same mode, and a float64 formula written from the definition.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import normscope
import normscope.functional as F
from normscope import engine
from normscope.backends import TRITON

AUTOCAST = [torch.bfloat16, torch.float16]


def _masked_f64(x: torch.Tensor, mask: torch.Tensor, dims: tuple[int, ...], groups: int | None, eps: float):
    """Masked normalization in float64 from the definition: statistics over the valid elements of
    ``dims`` (per channel group when ``groups``), every element normalized with its scope's."""
    x = x.double()
    m = mask.unsqueeze(1).expand_as(x).double()
    if groups is not None:
        n, c = x.shape[:2]
        x, m = x.view(n, groups, -1), m.reshape(n, groups, -1)
        dims = (2,)
    cnt = m.sum(dims, keepdim=True)
    mean = (x * m).sum(dims, keepdim=True) / cnt
    var = ((x - mean) ** 2 * m).sum(dims, keepdim=True) / cnt
    y = (x - mean) / torch.sqrt(var + eps)
    return y if groups is None else y.view(n, c, -1)


MASKED = [
    ("batch", lambda: normscope.BatchNorm1d(16, affine=False), (0, 2), None),
    ("instance", lambda: normscope.InstanceNorm1d(16), (2,), None),
    ("group", lambda: normscope.GroupNorm(4, 16, affine=False), None, 4),
]


@pytest.mark.parametrize("dtype", AUTOCAST)
@pytest.mark.parametrize("name, make, dims, groups", MASKED, ids=[m[0] for m in MASKED])
def test_masked_statistics_under_cpu_autocast(name, make, dims, groups, dtype):
    # the composite backend sums the valid elements as matrix products (bmm), which CPU autocast runs
    # in bf16/fp16: fp32 statistics came out ~5e-3 off float64 (5e-7 outside autocast), where torch's
    # norms are untouched by autocast
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 16, 50, generator=g) * 3 + 5
    mask = torch.rand(4, 50, generator=g) > 0.3
    layer = make()
    plain = layer(x, mask)
    with torch.autocast("cpu", dtype=dtype):
        y = layer(x, mask)
    assert normscope.last_backend() == "composite"
    assert y.dtype == torch.float32
    torch.testing.assert_close(y.double(), _masked_f64(x, mask, dims, groups, layer.eps), rtol=0, atol=1e-5)
    assert torch.equal(y, plain)


def _llama(x, w, eps):
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype)


def _gemma(x, w, eps):
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * (1.0 + w.float())).type_as(x)


def _torch_rms(x, w, eps):
    return nn.functional.rms_norm(x, (x.shape[-1],), w, eps)


FAMILIES = [
    ("torch", _torch_rms, {}),
    ("llama", _llama, {"casting": "llama"}),
    ("gemma", _gemma, {"casting": "gemma", "weight_offset": 1.0}),
]


def _ours(options):
    return lambda x, w, eps: F.rms_norm(x, (x.shape[-1],), w, eps, **options)


@pytest.mark.parametrize("dtype", AUTOCAST)
def test_rows_weight_gradient_of_a_backward_under_cpu_autocast(dtype):
    # a backward run inside the autocast block: the rows' closed-form weight gradient sums its rows with
    # bmm/mv, which autocast took in bf16/fp16 (RMSNorm(1024) on 2048 rows: 0.43 off float64, torch 2.4e-5)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 256, generator=g)
    w = torch.rand(256, generator=g) + 0.5
    gy = torch.randn(64, 256, generator=g)
    grads = []
    for fn in (_ours({}), _torch_rms):
        wi = w.clone().requires_grad_()
        with normscope.use_backend("rows"), torch.autocast("cpu", dtype=dtype):
            fn(x, wi, 1e-6).backward(gy)
        grads.append(wi.grad)
    x64 = x.double()
    want = (gy.double() * x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6)).sum(0)
    torch.testing.assert_close(grads[0].double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family, theirs, options", FAMILIES, ids=[f[0] for f in FAMILIES])
@pytest.mark.parametrize("backend", ["rows", None])
def test_rows_take_an_inference_tensor_with_a_trainable_weight(family, theirs, options, backend):
    # an input made under torch.inference_mode() (data prepared there), a weight that trains: torch's op
    # saves only its intermediates, the rows' autograd.Function saved the input itself and autograd raised
    # "Inference tensors cannot be saved for backward". None: the automatic choice, which takes the rows
    # from rows.MIN_AUTO_ELEMENTS elements
    shape = (1024, 1024) if backend is None else (8, 64)
    g = torch.Generator().manual_seed(2)
    with torch.inference_mode():
        x = torch.randn(shape, generator=g).to(torch.bfloat16)
    w0 = (torch.randn(shape[-1], generator=g) * 0.1 + (0.0 if family == "gemma" else 1.0)).to(torch.bfloat16)
    gy = torch.randn(shape, generator=g).to(torch.bfloat16)
    out = []
    for fn in (_ours(options), theirs):
        w = w0.clone().requires_grad_()
        with normscope.use_backend(backend):
            y = fn(x, w, 1e-6)
        y.backward(gy)
        out.append((y, w.grad))
    assert normscope.last_backend() == "rows"
    (y, gw), (y_want, gw_want) = out
    assert torch.equal(y, y_want)
    torch.testing.assert_close(gw.float(), gw_want.float(), rtol=2e-2, atol=2e-2 * gw_want.float().abs().max().item())


@pytest.mark.parametrize("family, theirs, options", FAMILIES, ids=[f[0] for f in FAMILIES])
@pytest.mark.parametrize("backend", ["rows", None])
def test_rows_inside_inference_mode_with_grad_enabled(family, theirs, options, backend):
    # torch.enable_grad() inside torch.inference_mode(): grad mode is on, but inference mode records no
    # graph -- torch's ops give an inference tensor that requires no grad. The rows took grad mode alone as
    # their cue, ran their autograd.Function, and raised "Inference tensors cannot be saved for backward"
    shape = (1024, 1024) if backend is None else (8, 64)
    g = torch.Generator().manual_seed(5)
    w = torch.randn(shape[-1], generator=g).requires_grad_()
    out = []
    with torch.inference_mode(), torch.enable_grad():
        x = torch.randn(shape, generator=g)
        for fn in (_ours(options), theirs):
            with normscope.use_backend(backend):
                out.append(fn(x, w, 1e-6))
    assert normscope.last_backend() == "rows"
    y, want = out
    assert (y.requires_grad, y.is_inference()) == (want.requires_grad, want.is_inference()) == (False, True)
    assert torch.equal(y, want)


@pytest.mark.parametrize("name, make, dims, groups", MASKED, ids=[m[0] for m in MASKED])
def test_masked_inside_inference_mode_with_grad_enabled(name, make, dims, groups):
    # as above, the composite backend's autograd.Function (masked BatchNorm/InstanceNorm/GroupNorm with a
    # trainable weight): it raised where torch's unmasked layers give an inference tensor
    g = torch.Generator().manual_seed(6)
    layer = make()
    layer.weight = nn.Parameter(torch.rand(16, generator=g) + 0.5)
    with torch.inference_mode(), torch.enable_grad():
        x = torch.randn(4, 16, 50, generator=g)
        mask = torch.rand(4, 50, generator=g) > 0.3
        y = layer(x, mask)
        assert normscope.last_backend() == "composite"
        unmasked = nn.functional.group_norm(x, 4, layer.weight)  # torch's own norm there
    assert (y.requires_grad, y.is_inference()) == (unmasked.requires_grad, unmasked.is_inference()) == (False, True)
    want = _masked_f64(x, mask, dims, groups, layer.eps) * layer.weight.detach().double().view(1, 16, 1)
    torch.testing.assert_close(y.double(), want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("family, theirs, options", FAMILIES, ids=[f[0] for f in FAMILIES])
def test_rows_batched_backward(family, theirs, options):
    # autograd's batched gradients (is_grads_batched=True: torch.autograd.functional.jacobian(vectorize=True),
    # gradcheck's batched check) run the backward under vmap; the rows' closed form, out= ops throughout,
    # raised "Batching rule not implemented for aten::mul.out" where torch's rms_norm gives the gradients
    g = torch.Generator().manual_seed(3)
    x0 = torch.randn(4, 32, generator=g)
    w0 = torch.rand(32, generator=g) + 0.5
    v = torch.randn(3, 4, 32, generator=g)
    got = []
    for fn in (_ours(options), theirs):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        with normscope.use_backend("rows"):
            y = fn(x, w, 1e-6)
        batched = torch.autograd.grad(y, (x, w), v, is_grads_batched=True, retain_graph=True)
        looped = [torch.stack(t) for t in zip(*(torch.autograd.grad(y, (x, w), vi, retain_graph=True) for vi in v))]
        # and vmap (torch.func) over torch.autograd.grad
        vmapped = torch.func.vmap(lambda vi, y=y, x=x, w=w: torch.autograd.grad(y, (x, w), vi, retain_graph=True))(v)
        got.append((batched, looped, vmapped))
    (batched, looped, vmapped), (want, _, _) = got
    for ours in (batched, looped, vmapped):
        for a, b in zip(ours, want):
            torch.testing.assert_close(a, b)


def _autocast_dtype_case(device: str):
    g = torch.Generator().manual_seed(4)
    x = torch.randn(64, 1024, generator=g).to(device, torch.bfloat16)
    w = (torch.rand(1024, generator=g) + 0.5).to(device, torch.bfloat16)
    b = torch.randn(1024, generator=g).to(device, torch.bfloat16)
    return x, w, b


@pytest.mark.skipif(not TRITON, reason="Triton is not installed")
def test_an_automatic_triton_choice_hands_an_autocast_call_to_torchs_op():
    # Under CUDA autocast torch's layer_norm (and group_norm) runs in fp32: nn.LayerNorm on bf16 input gives
    # fp32 output. The kernels are custom ops, which autocast does not cast: where the measured table picks
    # Triton (bf16 LayerNorm rows of 256..16384 on sm90) the layer gave bf16 (measured on an H200, torch 2.11).
    # Here in Triton's interpreter on CPU, the runner an automatic choice prepares: inside autocast it runs
    # torch's op (and says so), outside it the kernel
    from normscope.backends import triton as tb

    x, w, b = _autocast_dtype_case("cpu")
    call = engine.Call(x, normscope.Scope.layer().resolve(x.shape), w, b, 1e-5, None, None)
    run = tb.prepare(call, True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = run(call)
        assert normscope.last_backend() == "aten"
        assert torch.equal(y, nn.functional.layer_norm(x, (1024,), w, b, 1e-5))
    engine.report_backend("triton")
    run(call)
    assert normscope.last_backend() == "triton"
    assert tb.prepare(call, False) is not None  # forced: the kernel itself, autocast or not


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA autocast: needs a GPU")
@pytest.mark.parametrize("dtype", AUTOCAST)
def test_layer_norm_under_cuda_autocast_is_torchs(dtype):
    x, w, b = _autocast_dtype_case("cuda")
    ours, theirs = normscope.LayerNorm(1024).to("cuda", x.dtype), nn.LayerNorm(1024).to("cuda", x.dtype)
    for m in (ours, theirs):
        with torch.no_grad():
            m.weight.copy_(w)
            m.bias.copy_(b)
    ours(x)  # planned outside autocast, then called inside it
    with torch.autocast("cuda", dtype=dtype):
        y, want = ours(x), theirs(x)
    assert y.dtype == want.dtype == torch.float32
    assert torch.equal(y, want)


ADA = [
    ("zero", "AdaLayerNormZero", torch.float32, torch.bfloat16),
    ("zero", "AdaLayerNormZero", torch.bfloat16, torch.bfloat16),
    ("continuous", "AdaLayerNormContinuous", torch.bfloat16, torch.float32),
]


@pytest.mark.parametrize("kind, cls, x_dtype, cond_dtype", ADA)
def test_ada_layer_norm_under_cpu_autocast_is_diffusers(kind, cls, x_dtype, cond_dtype):
    # an fp32 model under autocast: a bf16 activation or condition reaches the projection, which nn.Linear
    # casts under autocast (diffusers' modules run). The layer refused it, a TypeError for a dtype that differs
    # from the projection's -- right outside autocast, where torch's linear raises too, wrong inside it
    norm_mod = pytest.importorskip("diffusers.models.normalization")
    d = 64
    if kind == "zero":
        theirs = norm_mod.AdaLayerNormZero(d)
        ours = normscope.AdaLayerNorm(d, d, gate=True, chunks=6, casting="eager")
    else:
        theirs = norm_mod.AdaLayerNormContinuous(d, 32, elementwise_affine=False, eps=1e-6)
        ours = normscope.AdaLayerNorm(d, 32, order="scale_shift", casting="eager")
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in theirs.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(2, 16, d, generator=g).to(x_dtype)
    cond = torch.randn(2, ours.cond_dim, generator=g).to(cond_dtype)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = theirs(x, emb=cond) if kind == "zero" else theirs(x, cond)
        got = ours(x, emb=cond) if kind == "zero" else ours(x, cond)
    for a, b in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
        assert a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.parametrize("transform", ["jvp", "grad", "dual"])
@pytest.mark.parametrize("backend", ["reference", None])
def test_instance_norm_running_statistics_under_a_grad_transform_are_torchs(transform, backend):
    # InstanceNorm with running statistics in training, under torch.func.grad/jvp or a forward-AD dual level:
    # torch's instance_norm updates its buffers there (through an alias, a tensor of the transform's level);
    # the reference backend copied into the captured buffer itself, and functorch raised "would mutate a
    # captured Tensor". The oracle: torch.nn.InstanceNorm1d under the same transform
    g = torch.Generator().manual_seed(7)
    x, v = (torch.randn(3, 4, 6, generator=g, dtype=torch.float64) for _ in range(2))
    theirs = nn.InstanceNorm1d(4, affine=True, track_running_stats=True).double()
    ours = normscope.InstanceNorm1d(4, affine=True, track_running_stats=True).double()

    def run(m):
        if transform == "jvp":
            return torch.func.jvp(m, (x,), (v,))[1]
        if transform == "grad":
            return torch.func.grad(lambda t: (m(t) ** 3).sum())(x)
        with torch.autograd.forward_ad.dual_level():
            return torch.autograd.forward_ad.unpack_dual(m(torch.autograd.forward_ad.make_dual(x, v))).tangent

    want = run(theirs)
    with normscope.use_backend(backend):
        got = run(ours)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert not torch.equal(theirs.running_mean, torch.zeros(4))  # the oracle did update them
    torch.testing.assert_close(ours.running_mean, theirs.running_mean, rtol=1e-14, atol=1e-15)
    torch.testing.assert_close(ours.running_var, theirs.running_var, rtol=1e-14, atol=1e-15)
