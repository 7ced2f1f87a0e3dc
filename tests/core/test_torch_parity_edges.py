"""Edges where a reimplementation of torch.nn's norms easily parts from torch on the same state, each
checked against torch (or float64) directly: empty batches, eps, cancellation, axes, channel mismatches,
numpy scalars as arguments, the hot path's keys (``True == 1`` in Python). GroupNorm's and BatchRenorm's
own edges are in their files (``layers/test_group_norm.py``, ``layers/test_batchrenorm.py``)."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn

import normscope
import normscope.functional as F


@pytest.mark.parametrize("train", [True, False])
def test_batch_norm_empty_batch_of_another_dtype_returns_empty_as_torch(train):
    x = torch.randn(0, 3, 2, 2, dtype=torch.float64)
    want = nn.BatchNorm2d(3).train(train)(x)
    got = normscope.BatchNorm2d(3).train(train)(x)
    assert got.shape == want.shape and got.dtype == want.dtype


LAYER_EPS = [
    (lambda m, eps: m.LayerNorm(6, eps=eps), (3, 6)),
    (lambda m, eps: m.RMSNorm(6, eps=eps), (3, 6)),
    (lambda m, eps: m.GroupNorm(2, 4, eps=eps), (3, 4, 5)),
    (lambda m, eps: m.InstanceNorm1d(4, eps=eps, affine=True), (3, 4, 5)),
    (lambda m, eps: m.InstanceNorm1d(4, eps=eps, track_running_stats=True).eval(), (3, 4, 5)),
]


@pytest.mark.parametrize("make,shape", LAYER_EPS)
def test_negative_eps_is_taken_as_torch_takes_it(make, shape):
    # one rule: an eps as torch takes it (BatchNorm: > 0 in training, >= 0 otherwise; every other op
    # any number), NaN refused
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 3
    for eps in (-1e-3, 0.0, 1e-3):
        ours, theirs = make(normscope, eps), make(nn, eps)
        ours.load_state_dict(theirs.state_dict())
        torch.testing.assert_close(ours(x), theirs(x), equal_nan=True)
    with pytest.raises(ValueError, match="eps"):
        make(normscope, math.nan)(x)


def test_batch_norm_eps_rule_is_torchs():
    x = torch.randn(4, 3)
    for train, eps in ((True, 0.0), (True, -1e-3), (False, -1e-3)):
        with pytest.raises(ValueError):
            nn.BatchNorm1d(3, eps=eps).train(train)(x)
        with pytest.raises(ValueError, match="eps"):
            normscope.BatchNorm1d(3, eps=eps).train(train)(x)
    torch.testing.assert_close(normscope.BatchNorm1d(3, eps=0.0).eval()(x), nn.BatchNorm1d(3, eps=0.0).eval()(x))


CANCELLING = [
    ("LayerNorm", lambda m: m.LayerNorm(64), (16, 64)),
    ("GroupNorm", lambda m: m.GroupNorm(4, 16), (4, 16, 8)),
    ("BatchNorm1d", lambda m: m.BatchNorm1d(16), (32, 16)),
    ("InstanceNorm1d", lambda m: m.InstanceNorm1d(16), (4, 16, 32)),
]


@pytest.mark.parametrize("name,make,shape", CANCELLING, ids=[c[0] for c in CANCELLING])
def test_cancelling_input_is_normalized_from_float64_statistics(name, make, shape):
    # mean 1e4, std 1e-2 in fp32: fp32 statistics lose the spread (torch is ~1e-1 off); the rare
    # recomputation runs in float64 and is off by rounding only
    g = torch.Generator().manual_seed(1)
    x = (1e4 + 1e-2 * torch.randn(shape, generator=g)).float()
    layer = make(normscope)
    y = layer(x)
    exact = make(nn).double()(x.double())
    err = float((y.detach().double() - exact).abs().max())
    assert err < 1e-3, f"{name}: {err:.3e} from float64 of the same fp32 input"
    assert normscope.last_backend() == "reference"
    # the gradient flows through the recomputation
    xr = x.clone().requires_grad_()
    layer(xr).sum().backward()
    assert xr.grad is not None and torch.isfinite(xr.grad).all()


def test_normalize_axes_are_checked_as_torch_checks_dims():
    x = torch.randn(2, 3, 4, 5)
    with pytest.raises(RuntimeError, match="appears multiple times"):
        x.mean((3, -1))  # torch's rule
    with pytest.raises(ValueError, match="dim 3 more than once"):
        normscope.normalize(x, (3, -1))
    with pytest.raises(TypeError, match="`dims`"):
        normscope.normalize(x, True)
    with pytest.raises(TypeError, match="`keep`"):
        normscope.normalize(x, keep=(0, False))
    with pytest.raises(ValueError, match="axis 4"):
        normscope.normalize(x, 4)


def test_hot_path_keys_tell_true_from_one():
    # True == 1 and hash(True) == hash(1): a plan made for 1 must not serve True, which the checks refuse
    x = torch.randn(2, 4, 3)
    F.group_norm(x, 1), F.group_norm(x, 1)
    with pytest.raises(TypeError, match="num_groups"):  # a bool is no int here, as in torch
        F.group_norm(x, True)
    y = torch.randn(3, 8)
    F.layer_norm(y, (8,), eps=1), F.layer_norm(y, (8,), eps=1)
    with pytest.raises(TypeError, match="eps"):
        F.layer_norm(y, (8,), eps=True)
    rm, rv = torch.zeros(4), torch.ones(4)
    F.batch_norm(x, rm, rv, training=True, momentum=1), F.batch_norm(x, rm, rv, training=True, momentum=1)
    with pytest.raises(TypeError, match="momentum"):
        F.batch_norm(x, rm, rv, training=True, momentum=True)


def test_functional_list_shape_and_changed_tensors_replan():
    x = torch.randn(3, 8)
    w, b = torch.randn(8), torch.randn(8)
    for _ in range(2):
        torch.testing.assert_close(F.layer_norm(x, [8], w, b), nn.functional.layer_norm(x, [8], w, b))
    with pytest.raises(ValueError, match="weight"):
        F.layer_norm(x, [8], torch.randn(4), b)
    with pytest.raises(TypeError, match="weight"):
        F.layer_norm(x, [8], w.double(), b)


def test_instance_norm_channel_mismatch_warns_on_every_call_as_torch():
    x = torch.randn(2, 5, 7)
    for m in (nn, normscope):
        layer = m.InstanceNorm1d(4)  # affine=False: num_features unused, torch warns per call
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(3):
                layer(x)
        assert sum("num_features" in str(w.message) for w in caught) == 3, m.__name__


def test_a_tensor_where_a_number_belongs_gets_the_checks_error():
    x = torch.randn(3, 8)
    F.layer_norm(x, (8,)), F.layer_norm(x, (8,))
    for eps in (torch.tensor(1e-5), torch.tensor([1e-5, 1e-5])):
        with pytest.raises(TypeError, match="eps"):
            F.layer_norm(x, (8,), eps=eps)


def test_numpy_scalars_as_eps_and_momentum_are_taken_as_torch_takes_them():
    np = pytest.importorskip("numpy")
    x = torch.randn(3, 4, 5)
    for eps in (np.float32(1e-3), np.float64(1e-3)):
        torch.testing.assert_close(F.layer_norm(x, (5,), eps=eps), nn.functional.layer_norm(x, (5,), eps=eps))
        torch.testing.assert_close(F.group_norm(x, 2, eps=eps), nn.functional.group_norm(x, 2, eps=eps))
    rm, rv = torch.zeros(4), torch.ones(4)
    y = F.batch_norm(x, rm.clone(), rv.clone(), training=True, momentum=np.float32(0.3))
    torch.testing.assert_close(y, nn.functional.batch_norm(x, rm, rv, training=True, momentum=np.float32(0.3)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_family_layer_options_equal_the_transformers_classes_bit_for_bit(dtype):
    # normscope.RMSNorm(weight_offset=, casting=) as the layer a model family ships (transformers)
    gemma = pytest.importorskip("transformers.models.gemma.modeling_gemma")
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 64, generator=g).to(dtype)
    cases = [
        (gemma.GemmaRMSNorm(64, eps=1e-6), dict(weight_offset=1.0, casting="gemma")),
        (llama.LlamaRMSNorm(64, eps=1e-6), dict(casting="llama")),
    ]
    for theirs, options in cases:
        theirs = theirs.to(dtype)
        with torch.no_grad():
            theirs.weight.copy_(torch.randn(64, generator=g) * 0.3)
        ours = normscope.RMSNorm(64, eps=1e-6, dtype=dtype, **options)
        ours.load_state_dict(theirs.state_dict())
        for _ in range(2):  # the checked call, then the planned one
            assert torch.equal(ours(x), theirs(x)), type(theirs).__name__
    assert torch.equal(normscope.RMSNorm(8, weight_offset=1.0).weight, torch.zeros(8))  # Gemma's init


def test_modern_norms_take_eps_by_the_same_rule():
    # the one rule (every op but BatchNorm's): any number, as torch's layer_norm takes it; NaN refused
    x = torch.randn(2, 5, 8) * 3
    shift, scale = torch.randn(2, 8), torch.randn(2, 8)
    y = F.modulated_norm(x, shift, scale, eps=-1e-3, norm="layer")
    want = nn.functional.layer_norm(x, (8,), eps=-1e-3) * (1 + scale[:, None]) + shift[:, None]
    torch.testing.assert_close(y, want)
    torch.testing.assert_close(
        F.rms_norm(x, (8,), None, -1e-3, casting="gemma"), nn.functional.rms_norm(x, (8,), None, -1e-3)
    )
    for call in (
        lambda: F.modulated_norm(x, shift, scale, eps=math.nan),
        lambda: F.rms_norm(x, (8,), None, math.nan, casting="llama"),
        lambda: F.poly_norm(x, torch.full((3,), 1 / 3), torch.ones(1), math.nan),
    ):
        with pytest.raises(ValueError, match="eps"):
            call()


@pytest.mark.parametrize(
    "shape,perm",
    [((2, 6, 4, 5), (0, 1, 3, 2)), ((2, 6, 3, 4, 5), (0, 1, 4, 3, 2)), ((2, 6, 3, 4, 5), (0, 2, 1, 3, 4)),
     ((4, 2, 6, 3, 5), (1, 2, 0, 4, 3)), ((2, 6, 3, 4, 5, 2), (0, 1, 2, 5, 4, 3))],
)
def test_local_response_norm_on_transposed_input_matches_torch(shape, perm):
    # torch views the axes after the third as one and raises where they cannot merge
    x = torch.randn(shape).permute(perm).requires_grad_()
    xc = x.detach().contiguous().requires_grad_()
    y, want = F.local_response_norm(x, 3), nn.functional.local_response_norm(xc, 3)
    assert torch.equal(y, want)
    assert torch.equal(normscope.LocalResponseNorm(3)(x), want)
    gy = torch.randn(want.shape)
    y.backward(gy), want.backward(gy)
    assert torch.equal(x.grad, xc.grad)


def _lrn64(x, size, alpha, beta, k):
    """local_response_norm in float64, from its formula: each channel over the window c - size//2 .. c + (size-1)//2."""
    x = x.double()
    c = x.shape[1]
    out = torch.empty_like(x)
    for i in range(c):
        lo, hi = max(0, i - size // 2), min(c, i + (size - 1) // 2 + 1)
        out[:, i] = x[:, i] / (k + alpha / size * (x[:, lo:hi] ** 2).sum(1)) ** beta
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(2, 7, 3, 4), (1, 5, 2, 3, 2)])
def test_local_response_norm_of_half_input_with_four_or_more_dims_on_cpu(dtype, shape):
    # torch runs 4+ dims through avg_pool3d, which has no CPU half kernels: torch.nn raised NotImplementedError
    # ("avg_pool3d_out_frame" not implemented) from inside, and normscope with it; now x's dtype, within one
    # rounding of the float64 formula (torch's own 3-D half path is no closer)
    x = (torch.randn(shape, generator=torch.Generator().manual_seed(3)) * 3).to(dtype).requires_grad_()
    y = normscope.LocalResponseNorm(3, alpha=0.3, beta=0.9, k=1.5)(x)
    want = _lrn64(x.detach(), 3, 0.3, 0.9, 1.5)
    assert y.dtype == dtype
    torch.testing.assert_close(y.double(), want, rtol=2 ** -8 if dtype == torch.bfloat16 else 2**-10, atol=1e-5)
    y.sum().backward()
    assert x.grad.dtype == dtype and torch.isfinite(x.grad).all()


@pytest.mark.parametrize("autocast_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(2, 7, 3, 4), (1, 5, 2, 3, 2)])
def test_local_response_norm_of_half_input_under_cpu_autocast_is_torchs(autocast_dtype, dtype, shape):
    # under CPU autocast torch.nn's LocalResponseNorm of half 4+-D input runs (autocast computes it in fp32)
    # and returns fp32; the fp32-then-round path above (for torch's NotImplementedError outside autocast)
    # returned x's dtype there, ~500x further from float64 (bf16: 1.7e-3 against torch's 3.1e-6)
    x = (torch.randn(shape, generator=torch.Generator().manual_seed(4)) * 3).to(dtype)
    xo, xt = x.clone().requires_grad_(), x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=autocast_dtype):
        y = normscope.LocalResponseNorm(3, alpha=0.3, beta=0.9, k=1.5)(xo)
        want = nn.LocalResponseNorm(3, alpha=0.3, beta=0.9, k=1.5)(xt)
    assert y.dtype == want.dtype and torch.equal(y, want)
    gy = torch.randn(shape, generator=torch.Generator().manual_seed(5)).to(want.dtype)
    y.backward(gy), want.backward(gy)
    assert torch.equal(xo.grad, xt.grad)


_EMPTY_SCOPES = [
    ("LayerNorm(0)", lambda m: m.LayerNorm(0), (2, 0)),
    ("LayerNorm((3, 0))", lambda m: m.LayerNorm((3, 0)), (2, 3, 0)),
    ("RMSNorm(0)", lambda m: m.RMSNorm(0), (2, 0)),
    ("GroupNorm(2, 0)", lambda m: m.GroupNorm(2, 0), (2, 0, 3)),
    ("InstanceNorm1d(0)", lambda m: m.InstanceNorm1d(0), (2, 0, 3)),
]


@pytest.mark.parametrize("name,make,shape", _EMPTY_SCOPES, ids=[c[0] for c in _EMPTY_SCOPES])
@pytest.mark.parametrize("backend", [None, "aten", "reference"])
def test_a_normalized_size_of_zero_is_taken_as_torch_takes_it(name, make, shape, backend):
    """torch.nn builds these layers and returns an empty output (and an empty input gradient) for
    an input of their shape; normscope's do the same on every backend that takes the call."""
    x = torch.randn(shape)
    xs, xt = x.clone().requires_grad_(), x.clone().requires_grad_()
    with normscope.use_backend(backend):
        ys = make(normscope)(xs)
    yt = make(nn)(xt)
    ys.sum().backward()
    yt.sum().backward()
    assert ys.shape == yt.shape and ys.dtype == yt.dtype
    assert xs.grad.shape == xt.grad.shape


@pytest.mark.parametrize("backend", ["rows", "triton"])
def test_a_normalized_size_of_zero_is_refused_with_a_reason_by_the_row_paths(backend):
    """The row paths have no rows to run: forced, they say so (the automatic choice takes torch's op)."""
    if backend not in normscope.backends():
        pytest.skip(f"{backend} is not registered (Triton is not installed)")
    with pytest.raises(ValueError, match="zero|empty"), normscope.use_backend(backend):
        normscope.RMSNorm(0)(torch.randn(2, 0))
