"""Engine-side hardening (issue "Exactly torch"): empty batches, engine misuse, GroupNorm(C, C) as torch
runs it, half-precision running statistics, torch.func transforms and meta tensors. Each test failed on
the code before the fix; the oracle is torch.nn or a float64 computation."""

import pytest
import torch
import torch.nn.functional as F

import normscope
import normscope.functional as nf
from normscope import Scope
from normscope.engine import Running, norm

BACKENDS = ["auto", "aten", "reference"]


# ---------------------------------------------------------------------------------------------
# empty batches: torch returns an empty tensor


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "make, shape",
    [
        (lambda: normscope.BatchNorm2d(4), (0, 4, 3, 3)),
        (lambda: normscope.BatchNorm1d(4), (2, 4, 0)),
        (lambda: normscope.InstanceNorm2d(4), (0, 4, 3, 3)),
        (lambda: normscope.InstanceNorm1d(4), (0, 4, 5)),  # torch itself fails with affine=True at N=0
        (lambda: normscope.GroupNorm(2, 4), (0, 4, 3)),
        (lambda: normscope.LayerNorm(5), (0, 4, 5)),
    ],
)
def test_empty_batches_return_empty_like_torch(make, shape, backend):
    layer = make()
    torch_layer = getattr(torch.nn, type(layer).__name__)(*_ctor_args(layer))
    torch_layer.load_state_dict(layer.state_dict())
    x = torch.randn(shape, requires_grad=True)
    with normscope.use_backend(None if backend == "auto" else backend):
        y = layer(x)
    y_t = torch_layer(x)
    assert y.shape == y_t.shape and y.numel() == 0
    y.sum().backward()  # and the backward runs
    for name, buf in layer.named_buffers():
        torch.testing.assert_close(buf, dict(torch_layer.named_buffers())[name], msg=name)


def _ctor_args(layer):
    if isinstance(layer, torch.nn.GroupNorm):
        return (layer.num_groups, layer.num_channels)
    if isinstance(layer, torch.nn.LayerNorm):
        return (layer.normalized_shape,)
    if isinstance(layer, torch.nn.modules.instancenorm._InstanceNorm):
        return (layer.num_features, layer.eps, layer.momentum, layer.affine, layer.track_running_stats)
    return (layer.num_features,)


def test_functional_and_masked_empty_batches():
    assert nf.instance_norm(torch.randn(0, 4, 3)).shape == (0, 4, 3)
    mask = torch.ones(0, 5, dtype=torch.bool)
    y = nf.batch_norm(torch.randn(0, 4, 5), None, None, training=True, mask=mask)
    assert y.shape == (0, 4, 5)
    y = normscope.normalize(torch.randn(0, 4, 5), keep=1, mask=torch.ones(0, 1, 5, dtype=torch.bool))
    assert y.shape == (0, 4, 5)
    with pytest.raises(ValueError, match="at least one valid"):  # a real batch with no valid element still raises
        nf.batch_norm(torch.randn(2, 4, 5), None, None, training=True, mask=torch.zeros(2, 5, dtype=torch.bool))


# ---------------------------------------------------------------------------------------------
# engine misuse: a wrong-size buffer raises before any kernel reads it


def test_engine_rejects_running_statistics_of_the_wrong_size():
    x = torch.randn(64, 256, 50)
    with pytest.raises(ValueError, match=r"running.mean.*256 elements.*\(3,\)"):
        norm(x, Scope.batch(), running=Running(torch.zeros(3), torch.ones(3), 0.1, True))
    with pytest.raises(ValueError, match=r"running.var.*256"):
        norm(x, Scope.batch(), running=Running(torch.zeros(256), torch.ones(5), 0.1, False))


@pytest.mark.parametrize("scope", [Scope.batch(), Scope.instance(), Scope.group(4), Scope.layer()])
def test_engine_rejects_weights_that_do_not_fit_the_scope(scope):
    x = torch.randn(8, 16, 5)
    with pytest.raises(ValueError, match="expected `weight` of shape"):
        norm(x, scope, weight=torch.ones(3))
    with pytest.raises(ValueError, match="expected `bias` of shape"):
        norm(x, scope, bias=torch.ones(17))
    with pytest.raises(ValueError, match="no affine axes"):
        norm(x, Scope(keep=(1,)), weight=torch.ones(16))


def test_engine_rejects_a_weight_on_another_device():
    x = torch.randn(2, 4, 3)
    with pytest.raises(ValueError, match="expected `weight` on cpu, got meta"):
        norm(x, Scope.batch(), weight=torch.ones(4, device="meta"))


# ---------------------------------------------------------------------------------------------
# GroupNorm(C, C): torch runs group_norm, not instance_norm


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_group_norm_with_one_channel_per_group_is_torchs_group_norm(dtype):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(4, 8, 5, 5, generator=g) * 3 + 2).to(dtype)
    ours, theirs = normscope.GroupNorm(8, 8).to(dtype), torch.nn.GroupNorm(8, 8).to(dtype)
    with torch.no_grad():
        ours.weight.uniform_(0.5, 1.5, generator=g)
        theirs.weight.copy_(ours.weight)
    # bit-identical: the same ATen op (fp32 and half types)
    assert torch.equal(ours(x), theirs(x))
    xc = x.contiguous(memory_format=torch.channels_last)
    y = ours(xc)
    assert y.is_contiguous(memory_format=torch.channels_last) == theirs(xc).is_contiguous(
        memory_format=torch.channels_last
    )
    torch.testing.assert_close(y, theirs(xc), atol=0, rtol=0)
    assert torch.equal(nf.group_norm(x, 8, ours.weight), F.group_norm(x, 8, theirs.weight))


# ---------------------------------------------------------------------------------------------
# half-precision running statistics: updated in fp32, rounded once, as torch does


@pytest.mark.parametrize("backend", ["reference", "composite"])
def test_half_running_statistics_are_rounded_once(backend):
    g = torch.Generator().manual_seed(1)
    c = 64
    x = (torch.randn(50, c, 8, generator=g) * 2 + 1).half()
    bn = normscope.BatchNorm1d(c).half()
    with torch.no_grad():
        bn.running_mean.uniform_(-1, 1, generator=g)
        bn.running_var.uniform_(0.5, 2, generator=g)
    rm0, rv0 = bn.running_mean.double(), bn.running_var.double()
    mask = torch.ones(50, 8, dtype=torch.bool) if backend == "composite" else None
    with normscope.use_backend(backend):
        bn(x, mask=mask) if mask is not None else bn(x)
    xd = x.double()
    mean, var = xd.mean((0, 2)), xd.var((0, 2), unbiased=True)
    want_m = (rm0 * 0.9 + mean * 0.1).half()
    want_v = (rv0 * 0.9 + var * 0.1).half()
    # a correctly rounded update is within one fp16 ulp of the float64 value rounded once
    ulp_m = (want_m.double().abs() * 2**-10).clamp_min(2**-24)
    ulp_v = want_v.double().abs() * 2**-10
    assert ((bn.running_mean.double() - want_m.double()).abs() <= ulp_m).all()
    assert ((bn.running_var.double() - want_v.double()).abs() <= ulp_v).all()


# ---------------------------------------------------------------------------------------------
# torch.func transforms and meta tensors


@pytest.mark.parametrize(
    "make",
    [
        lambda: normscope.LayerNorm(5),
        lambda: normscope.GroupNorm(2, 4),
        lambda: normscope.InstanceNorm1d(4, affine=True),
        lambda: normscope.BatchNorm1d(4).eval(),
        lambda: normscope.BatchNorm1d(4, track_running_stats=False),
        lambda: normscope.RMSNorm(5),
    ],
)
def test_vmap_and_jacrev_match_torch(make):
    layer = make()
    torch_layer = getattr(torch.nn, type(layer).__name__)(*_ctor_args_any(layer))
    torch_layer.load_state_dict(layer.state_dict())
    torch_layer.train(layer.training)
    x = torch.randn(3, 2, 4, 5)
    torch.testing.assert_close(torch.func.vmap(layer)(x), torch.func.vmap(torch_layer)(x))
    jac = torch.func.jacrev(lambda t: layer(t).square().sum())(x[0])
    jac_t = torch.func.jacrev(lambda t: torch_layer(t).square().sum())(x[0])
    torch.testing.assert_close(jac, jac_t, atol=1e-4, rtol=1e-4)


def _ctor_args_any(layer):
    if isinstance(layer, torch.nn.RMSNorm):
        return (layer.normalized_shape,)
    if isinstance(layer, torch.nn.modules.batchnorm._BatchNorm):
        return (layer.num_features, layer.eps, layer.momentum, layer.affine, layer.track_running_stats)
    return _ctor_args(layer)


def test_masked_batch_norm_under_torch_func_grad_and_vmap():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 4, 5, generator=g, dtype=torch.float64)
    mask = torch.rand(2, 5, generator=g) > 0.3
    mask[0, 0] = True

    def f(t):
        return nf.batch_norm(t, None, None, training=True, mask=mask).square().mul(torch.arange(5.0)).sum()

    f(x)  # an eager call first: its plan (the composite backend) is cached for this signature ...
    assert normscope.last_backend() == "composite"
    got = torch.func.grad(f)(x)  # ... and must still run inside the transform
    assert normscope.last_backend() == "reference"
    xr = x.clone().requires_grad_()
    with normscope.use_backend("reference"):
        (want,) = torch.autograd.grad(f(xr), xr)
    torch.testing.assert_close(got, want)
    batched = torch.func.vmap(lambda t: normscope.normalize(t, keep=0, mask=mask[0][None]))(x)
    with normscope.use_backend("reference"):
        want = torch.stack([normscope.normalize(t, keep=0, mask=mask[0][None]) for t in x])
    torch.testing.assert_close(batched, want)


def test_meta_tensors_run_masked_batch_norm_and_layers():
    xm = torch.randn(2, 4, 5, device="meta")
    mask = torch.ones(2, 5, dtype=torch.bool, device="meta")
    assert nf.batch_norm(xm, None, None, training=True, mask=mask).shape == (2, 4, 5)
    for layer in (normscope.BatchNorm1d(4), normscope.GroupNorm(2, 4), normscope.LayerNorm(5)):
        assert layer.to("meta")(xm).shape == (2, 4, 5)


def test_torchscript_trace_works_and_script_is_refused_as_documented():
    m = normscope.LayerNorm(5)
    x = torch.randn(2, 5)
    with torch.no_grad():
        traced = torch.jit.trace(m, (x,), check_trace=False)
    torch.testing.assert_close(traced(x * 3 + 1), F.layer_norm(x * 3 + 1, (5,), m.weight, m.bias))
    with pytest.raises(TypeError, match=r"torch\.compile.*torch\.export"):
        torch.jit.script(m)


@pytest.mark.parametrize("name", ["PowerNorm", "BatchRenorm1d", "BatchNorm1d"])
def test_masked_layers_compile_fullgraph_in_training(name):
    import copy

    g = torch.Generator().manual_seed(3)
    if name == "PowerNorm":
        eager, x, mask = normscope.PowerNorm(4), torch.randn(3, 5, 4, generator=g), torch.rand(3, 5, generator=g) > 0.3
    else:
        eager = getattr(normscope, name)(4)
        x, mask = torch.randn(3, 4, 5, generator=g), torch.rand(3, 5, generator=g) > 0.3
    mask[0, 0] = True
    mod = copy.deepcopy(eager)
    torch._dynamo.reset()
    compiled = torch.compile(mod, fullgraph=True, backend="aot_eager")  # a graph break raises
    for _ in range(2):
        xe, xc = x.clone().requires_grad_(), x.clone().requires_grad_()
        ye, yc = eager(xe, mask=mask), compiled(xc, mask=mask)
        torch.testing.assert_close(yc, ye)
        ye.square().sum().backward()
        yc.square().sum().backward()
        torch.testing.assert_close(xc.grad, xe.grad)
    for (k, be), (_, bc) in zip(eager.named_buffers(), mod.named_buffers()):
        torch.testing.assert_close(bc, be, msg=k)
    with pytest.raises(ValueError, match="at least one valid"):  # eager still refuses an all-False mask
        eager(x, mask=torch.zeros_like(mask))
