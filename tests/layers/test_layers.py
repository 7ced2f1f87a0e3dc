"""Every layer against its torch.nn namesake, in train and eval, on both backends and four dtypes:
outputs, every gradient (input, weight, bias), running buffers and num_batches_tracked.
Empty batches return what torch returns; half-precision running statistics are rounded once; the
layers beyond torch.nn pass gradcheck in float64 and run in half precision; momentum=None is a
cumulative average."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import normscope
import normscope.functional as nf
from conftest import BACKENDS, assert_half_close

# (id, class name, ctor args, ctor kwargs, input shape)
CONFIGS = [
    ("bn1d_2d", "BatchNorm1d", (5,), {}, (4, 5)),
    ("bn1d_3d", "BatchNorm1d", (5,), {}, (4, 5, 7)),
    ("bn1d_momentum_none", "BatchNorm1d", (5,), {"momentum": None}, (3, 5, 7)),
    ("bn2d", "BatchNorm2d", (3,), {}, (2, 3, 5, 7)),
    ("bn2d_no_affine", "BatchNorm2d", (3,), {"affine": False, "momentum": 0.5}, (2, 3, 5, 1)),
    ("bn2d_no_track", "BatchNorm2d", (3,), {"track_running_stats": False}, (2, 3, 5, 7)),
    ("bn3d", "BatchNorm3d", (2,), {"momentum": 0.3, "eps": 1e-3}, (2, 2, 3, 5, 1)),
    ("ln", "LayerNorm", (7,), {}, (3, 5, 7)),
    ("ln_2dims", "LayerNorm", ((5, 7),), {}, (3, 5, 7)),
    ("ln_no_bias", "LayerNorm", (7,), {"bias": False}, (3, 5, 7)),
    ("ln_no_affine", "LayerNorm", (7,), {"elementwise_affine": False}, (3, 5, 7)),
    ("ln_n1", "LayerNorm", (11,), {}, (1, 11)),
    ("rms", "RMSNorm", (7,), {}, (3, 5, 7)),
    ("rms_eps_2dims", "RMSNorm", ((5, 7),), {"eps": 1e-6}, (3, 5, 7)),
    ("rms_no_affine", "RMSNorm", (7,), {"elementwise_affine": False}, (3, 5, 7)),
    ("gn", "GroupNorm", (3, 6), {}, (2, 6, 5)),
    ("gn_4d", "GroupNorm", (2, 4), {}, (3, 4, 3, 5)),
    ("gn_no_affine", "GroupNorm", (2, 6), {"affine": False}, (2, 6, 7)),
    ("gn_one_group", "GroupNorm", (1, 6), {}, (2, 6, 5)),
    ("gn_C_groups", "GroupNorm", (6, 6), {}, (2, 6, 5)),
    ("gn_2d_input", "GroupNorm", (3, 6), {}, (4, 6)),
    ("gn_n1", "GroupNorm", (3, 6), {}, (1, 6, 11)),
    ("in1d", "InstanceNorm1d", (3,), {}, (2, 3, 7)),
    ("in1d_affine", "InstanceNorm1d", (3,), {"affine": True}, (2, 3, 7)),
    ("in1d_track", "InstanceNorm1d", (3,), {"track_running_stats": True}, (2, 3, 7)),
    ("in1d_affine_track", "InstanceNorm1d", (3,), {"affine": True, "track_running_stats": True}, (2, 3, 7)),
    ("in1d_track_momentum_none", "InstanceNorm1d", (3,), {"track_running_stats": True, "momentum": None}, (2, 3, 7)),
    ("in1d_unbatched", "InstanceNorm1d", (3,), {"affine": True}, (3, 7)),
    ("in2d_affine_track", "InstanceNorm2d", (3,), {"affine": True, "track_running_stats": True}, (2, 3, 5, 7)),
    ("in2d_unbatched_track", "InstanceNorm2d", (3,), {"track_running_stats": True}, (3, 5, 7)),
    ("in3d_affine", "InstanceNorm3d", (2,), {"affine": True}, (2, 2, 3, 5, 2)),
    ("lrn", "LocalResponseNorm", (3,), {}, (2, 5, 7)),
    ("lrn_4d", "LocalResponseNorm", (2,), {"alpha": 1e-2, "beta": 0.5, "k": 2.0}, (2, 5, 3, 4)),
]


IDS = [c[0] for c in CONFIGS]


def make_pair(name, args, kwargs, seed=0):
    """A torch.nn layer with random parameters and buffers, and a normscope layer loaded from it."""
    t = getattr(torch.nn, name)(*args, **kwargs)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for pname, p in t.named_parameters():
            p.copy_((1.0 if pname == "weight" else 0.0) + 0.5 * torch.randn(p.shape, generator=g))
        if getattr(t, "running_mean", None) is not None:
            t.running_mean.copy_(0.2 * torch.randn(t.running_mean.shape, generator=g))
            t.running_var.copy_(0.5 + torch.rand(t.running_var.shape, generator=g))
    n = getattr(normscope, name)(*args, **kwargs)
    n.load_state_dict(t.state_dict(), strict=True)
    return t, n


def step(mod, x, gy):
    x = x.clone().requires_grad_()
    mod.zero_grad(set_to_none=True)
    y = mod(x)
    y.backward(gy)
    grads = {k: p.grad for k, p in mod.named_parameters()}
    return y.detach(), x.grad, grads


def buffers(mod):
    return {k: v.clone() for k, v in mod.named_buffers()}


def compare_same_dtype(t, n, shape, dtype, backend, steps=3, what=""):
    tol = dict(rtol=1e-9, atol=1e-9) if dtype == torch.float64 else dict(rtol=1e-4, atol=2e-5)
    g = torch.Generator().manual_seed(1)
    for i in range(steps + 1):
        if i == steps:
            t.eval()
            n.eval()
        x = (torch.randn(shape, generator=g) * 2 + 0.5).to(dtype)
        gy = torch.randn(shape, generator=g).to(dtype)
        yt, gxt, gpt = step(t, x, gy)
        with normscope.use_backend(backend):
            yn, gxn, gpn = step(n, x, gy)
        where = f"{what} {'eval' if i == steps else f'train step {i}'}"
        torch.testing.assert_close(yn, yt, **tol, msg=lambda m, w=where: f"{w} output: {m}")
        torch.testing.assert_close(gxn, gxt, **tol, msg=lambda m, w=where: f"{w} input grad: {m}")
        assert gpn.keys() == gpt.keys()
        for k in gpt:
            torch.testing.assert_close(gpn[k], gpt[k], **tol, msg=lambda m, k=k, w=where: f"{w} {k}.grad: {m}")
        bt, bn = buffers(t), buffers(n)
        assert bt.keys() == bn.keys()
        for k in bt:
            torch.testing.assert_close(bn[k], bt[k], **tol, msg=lambda m, k=k, w=where: f"{w} buffer {k}: {m}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("cfg", CONFIGS, ids=IDS)
def test_layer_matches_torch(cfg, dtype, backend):
    _, name, args, kwargs, shape = cfg
    t, n = make_pair(name, args, kwargs)
    t, n = t.to(dtype), n.to(dtype)
    compare_same_dtype(t, n, shape, dtype, backend, what=f"{cfg[0]}[{backend}]")
    if name != "LocalResponseNorm":
        assert normscope.last_backend() == backend


# torch's own CPU LocalResponseNorm on 4D+ input has no fp16/bf16 kernel (avg_pool3d), and normscope
# runs torch's op for it, so that configuration is left out of the half-precision table
HALF_CONFIGS = [c for c in CONFIGS if c[0] != "lrn_4d"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("cfg", HALF_CONFIGS, ids=[c[0] for c in HALF_CONFIGS])
def test_layer_half_precision(cfg, dtype, backend):
    """Against the fp32 torch computation: our error is at most 2x torch's own in the same dtype."""
    _, name, args, kwargs, shape = cfg
    t32, n = make_pair(name, args, kwargs)
    th = copy.deepcopy(t32).to(dtype)
    n = n.to(dtype)
    g = torch.Generator().manual_seed(2)
    for i in range(3):
        if i == 2:
            for m in (t32, th, n):
                m.eval()
        x32 = torch.randn(shape, generator=g) * 2 + 0.5
        x = x32.to(dtype)
        gy = torch.randn(shape, generator=g).to(dtype)
        y32, gx32, gp32 = step(t32, x.float(), gy.float())
        yh, gxh, gph = step(th, x, gy)
        with normscope.use_backend(backend):
            yn, gxn, gpn = step(n, x, gy)
        assert yn.dtype == dtype and gxn.dtype == dtype
        what = f"{cfg[0]}[{backend}] step {i}"
        assert_half_close(yn, yh, y32, dtype, what + " output")
        assert_half_close(gxn, gxh, gx32, dtype, what + " input grad")
        for k in gp32:
            assert gpn[k].dtype == dtype
            assert_half_close(gpn[k], gph[k], gp32[k], dtype, f"{what} {k}.grad")
        b32, bh, bn = buffers(t32), buffers(th), buffers(n)
        for k in b32:
            if k == "num_batches_tracked":
                assert bn[k] == b32[k]
            else:
                assert_half_close(bn[k], bh[k], b32[k], dtype, f"{what} buffer {k}")


def test_batchnorm_momentum_none_is_cumulative_average():
    """momentum=None: after k steps the running mean is the plain average of the k batch means."""
    n = normscope.BatchNorm1d(3, momentum=None).double()
    means, vars_ = [], []
    for _ in range(4):
        x = torch.randn(8, 3, dtype=torch.float64) + torch.randn(3, dtype=torch.float64)
        n(x)
        means.append(x.mean(0))
        vars_.append(x.var(0, correction=1))
    assert int(n.num_batches_tracked) == 4
    torch.testing.assert_close(n.running_mean, torch.stack(means).mean(0))
    torch.testing.assert_close(n.running_var, torch.stack(vars_).mean(0))


@pytest.mark.parametrize("backend", BACKENDS)
def test_track_running_stats_false_has_no_buffers_and_uses_batch_stats_in_eval(backend):
    n = normscope.BatchNorm2d(3, track_running_stats=False).eval()
    assert n.running_mean is None and n.running_var is None and n.num_batches_tracked is None
    x = torch.randn(2, 3, 4, 5, dtype=torch.float64) * 3 + 2
    with normscope.use_backend(backend):
        y = n.double()(x)
    expected = (x - x.mean((0, 2, 3), keepdim=True)) / torch.sqrt(x.var((0, 2, 3), keepdim=True, correction=0) + 1e-5)
    torch.testing.assert_close(y, expected)


@pytest.mark.parametrize("backend", BACKENDS)
def test_instancenorm_momentum_none_never_updates(backend):
    n = normscope.InstanceNorm1d(3, track_running_stats=True, momentum=None)
    before = buffers(n)
    with normscope.use_backend(backend):
        for _ in range(3):
            n(torch.randn(2, 3, 7) + 5)
    for k, v in before.items():
        assert torch.equal(buffers(n)[k], v), k


# -------------------------------------------------------------------------------------------------
# odd shapes and layouts

ODD = [
    ("ln_1x1x1023", lambda: ("LayerNorm", (1023,), {}), (1, 1, 1023)),
    ("rms_1x1x1023", lambda: ("RMSNorm", (1023,), {}), (1, 1, 1023)),
    ("bn2d_3x5x7x11", lambda: ("BatchNorm2d", (5,), {}), (3, 5, 7, 11)),
    ("gn_3x5x7x11", lambda: ("GroupNorm", (5, 5), {}), (3, 5, 7, 11)),
    ("gn1_3x5x7x11", lambda: ("GroupNorm", (1, 5), {}), (3, 5, 7, 11)),
    ("in2d_3x5x7x11", lambda: ("InstanceNorm2d", (5,), {"affine": True}), (3, 5, 7, 11)),
    ("ln_3x5x7x11", lambda: ("LayerNorm", ((7, 11),), {}), (3, 5, 7, 11)),
    ("bn1d_1023x1", lambda: ("BatchNorm1d", (1,), {}), (1023, 1)),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", ODD, ids=[c[0] for c in ODD])
def test_odd_shapes(case, backend):
    name, args, kwargs = case[1]()
    t, n = make_pair(name, args, kwargs)
    compare_same_dtype(t, n, case[2], torch.float32, backend, steps=1, what=case[0])


LAYOUTS = [
    ("bn2d", "BatchNorm2d", (4,), {}),
    ("gn", "GroupNorm", (2, 4), {}),
    ("in2d", "InstanceNorm2d", (4,), {"affine": True, "track_running_stats": True}),
    ("ln_last", "LayerNorm", (6,), {}),
    ("rms_last", "RMSNorm", (6,), {}),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", ["transposed", "sliced", "channels_last"])
@pytest.mark.parametrize("cfg", LAYOUTS, ids=[c[0] for c in LAYOUTS])
def test_non_contiguous_and_channels_last(cfg, layout, backend):
    _, name, args, kwargs = cfg
    t, n = make_pair(name, args, kwargs)
    g = torch.Generator().manual_seed(3)
    if layout == "transposed":
        x = torch.randn(3, 6, 5, 4, generator=g).transpose(1, 3)  # (3, 4, 5, 6), not contiguous
    elif layout == "sliced":
        x = torch.randn(3, 9, 5, 13, generator=g)[:, 1:9:2, :, 3:9]  # (3, 4, 5, 6)
    else:
        x = torch.randn(3, 4, 5, 6, generator=g).to(memory_format=torch.channels_last)
    assert not x.is_contiguous()
    x = x * 2 + 1
    yt = t(x)
    with normscope.use_backend(backend):
        yn = n(x)
    torch.testing.assert_close(yn, yt, rtol=1e-4, atol=2e-5)
    for k, v in buffers(t).items():
        torch.testing.assert_close(buffers(n)[k], v)
    # every backend returns torch's layout (channels_last kept by BatchNorm, GroupNorm and RMSNorm; made
    # contiguous by InstanceNorm and LayerNorm): tests/core/test_output_layout.py sweeps the layouts
    assert yn.stride() == yt.stride()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", [(0, 4, 3), (3, 4, 0)], ids=["no_samples", "no_positions"])
@pytest.mark.parametrize("name", ["BatchNorm1d", "InstanceNorm1d"])
def test_empty_batch_leaves_running_stats_like_torch(name, shape, backend):
    kwargs = {"track_running_stats": True} if name == "InstanceNorm1d" else {}
    t, n = make_pair(name, (4,), kwargs)
    x = torch.randn(shape)
    yt = t(x)
    with normscope.use_backend(backend):
        yn = n(x)
    assert yn.shape == yt.shape == shape
    # (torch's InstanceNorm averages the per-instance statistics of zero instances into NaN
    # buffers; normscope matches that rather than inventing its own rule, hence equal_nan)
    for k, v in buffers(t).items():
        torch.testing.assert_close(buffers(n)[k], v, equal_nan=True, msg=lambda m, k=k: f"{k}: {m}")


EMPTY_BACKENDS = ["auto", "aten", "reference"]


# ---------------------------------------------------------------------------------------------
# empty batches: torch returns an empty tensor


@pytest.mark.parametrize("backend", EMPTY_BACKENDS)
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


# -- gradcheck, dtypes, serialization ----------------------------------------------------------------


def test_gradcheck_float64():
    torch.manual_seed(5)
    x = torch.randn(3, 4, 5, dtype=torch.float64, requires_grad=True)
    mask = torch.rand(3, 5) > 0.3
    mask[0, 0] = True
    w = torch.randn(4, dtype=torch.float64, requires_grad=True)
    b = torch.randn(4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w, b: nf.batch_norm(x, None, None, w, b, True, mask=mask), (x, w, b))
    assert torch.autograd.gradcheck(lambda x, w, b: nf.group_norm(x, 2, w, b, mask=mask), (x, w, b))
    # (BatchRenorm is deliberately not differentiable in r and d -- the paper's stop-gradient --
    # so gradcheck does not apply; its gradient is checked against the direct formula above)
    style = torch.randn(3, 4, 2, 2, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda c, s: nf.adain(c, s), (x, style))
    ln2d = normscope.LayerNorm2d(4).double()
    assert torch.autograd.gradcheck(lambda x: ln2d(x), (x,))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_masked_batchnorm_layernorm2d_powernorm_frozen_batchnorm(dtype):
    x = torch.randn(4, 6, 8)
    mask = torch.rand(4, 8) > 0.3
    mask[0, 0] = True
    y = normscope.BatchNorm1d(6).to(dtype)(x.to(dtype), mask)
    want = normscope.BatchNorm1d(6)(x, mask)
    assert y.dtype == dtype
    torch.testing.assert_close(y.float(), want, atol=2e-2, rtol=2e-2)
    for layer, inp in ((normscope.LayerNorm2d(6), x[..., None]), (normscope.PowerNorm(6, channel_dim=1), x),
                       (normscope.FrozenBatchNorm2d(6), x[..., None])):
        out = layer.to(dtype)(inp.to(dtype))
        assert out.dtype == dtype and torch.isfinite(out.float()).all()


def test_layers_momentum_none_is_a_cumulative_average():
    """The layers' momentum=None (a cumulative average) is unaffected by the functional check."""
    torch.manual_seed(0)
    ours, theirs = normscope.BatchNorm1d(3, momentum=None), nn.BatchNorm1d(3, momentum=None)
    for _ in range(3):
        x = torch.randn(8, 3)
        ours(x), theirs(x)
    torch.testing.assert_close(ours.running_mean, theirs.running_mean)
    torch.testing.assert_close(ours.running_var, theirs.running_var)
