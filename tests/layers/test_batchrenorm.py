"""BatchRenorm against the direct formula of the paper (Ioffe 2017) and torch's BatchNorm running
statistics: warm-up and the r/d limits, channels_last with a mask, and its edges -- non-float input,
one value per channel (refused as BatchNorm refuses it), the warm-up ramp read as a tensor; a forced
backend that cannot run its training step refused before any state moves; torch.compile(fullgraph=True)
giving eager's gradients step after step.

BatchRenorm's rows in the sweeps over every layer (layers, masks, serialization, transforms) stay with
their sweep."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

import normscope
import normscope.functional as nf
from conftest import refused_with_state_kept, swap

TOL = dict(atol=2e-5, rtol=1e-5)


def _randomize(module: nn.Module, seed: int = 0) -> nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    return module


# -- BatchRenorm ---------------------------------------------------------------------------------


def _renorm_direct(x, rm, rv, w, b, eps, rmax, dmax):
    dims = (0, 2)
    mu = x.mean(dims)
    sb = torch.sqrt(x.var(dims, unbiased=False) + eps)
    s = torch.sqrt(rv + eps)
    r = (sb / s).clamp(1 / rmax, rmax).detach()
    d = ((mu - rm) / s).clamp(-dmax, dmax).detach()
    c = lambda t: t[None, :, None]  # noqa: E731
    return ((x - c(mu)) / c(sb) * c(r) + c(d)) * c(w) + c(b)


def test_batchrenorm_matches_direct_formula_and_bn_running_stats():
    c = 6
    brn = _randomize(normscope.BatchRenorm1d(c, rmax=2.0, dmax=0.5, momentum=0.2))
    # running statistics far from the batch's on some channels, so that both clips are active
    rm0 = torch.tensor([0.0, 3.0, -3.0, 0.5, 0.0, 1.0])
    rv0 = torch.tensor([1.0, 1.0, 1.0, 20.0, 0.05, 4.0])
    brn.running_mean.copy_(rm0), brn.running_var.copy_(rv0)
    bn = nn.BatchNorm1d(c, momentum=0.2)
    bn.load_state_dict(brn.state_dict())
    x = (torch.randn(8, c, 5) * 1.5 + 0.3).requires_grad_()
    y = brn(x)
    x2 = x.detach().clone().requires_grad_()
    w2, b2 = brn.weight.detach().clone().requires_grad_(), brn.bias.detach().clone().requires_grad_()
    y2 = _renorm_direct(x2, rm0, rv0, w2, b2, brn.eps, 2.0, 0.5)
    torch.testing.assert_close(y, y2, **TOL)
    g = torch.randn_like(y)
    y.backward(g), y2.backward(g)
    torch.testing.assert_close(x.grad, x2.grad, **TOL)
    torch.testing.assert_close(brn.weight.grad, w2.grad, **TOL)
    torch.testing.assert_close(brn.bias.grad, b2.grad, **TOL)
    bn(x.detach())  # running statistics: exactly BatchNorm's update
    torch.testing.assert_close(brn.running_mean, bn.running_mean, **TOL)
    torch.testing.assert_close(brn.running_var, bn.running_var, **TOL)
    brn.eval(), bn.eval()
    torch.testing.assert_close(brn(x), bn(x), **TOL)
    assert "rmax=2.0, dmax=0.5" in repr(brn)


def test_batchrenorm_warmup_and_limits():
    brn = normscope.BatchRenorm2d(3, warmup_iters=4)
    assert brn.limits(0) == (1.0, 0.0) and brn.limits(2) == (2.0, 2.5) and brn.limits(9) == (3.0, 5.0)
    brn.running_mean.fill_(5.0), brn.running_var.fill_(9.0)
    bn = nn.BatchNorm2d(3)
    bn.load_state_dict(brn.state_dict())
    x = torch.randn(4, 3, 3, 3)
    torch.testing.assert_close(brn(x), bn(x), **TOL)  # first step: r = 1, d = 0 -- plain BatchNorm
    assert not torch.allclose(brn(x), bn(x), atol=1e-3)  # later steps: corrected
    # constant input: x - mu_B = 0, so y = d = (1 - running_mean) / sqrt(running_var + eps), clipped
    brn3 = normscope.BatchRenorm3d(2, dmax=0.5)
    torch.testing.assert_close(brn3(torch.ones(2, 2, 2, 2, 2)), torch.full((2, 2, 2, 2, 2), 0.5))
    with pytest.raises(ValueError, match="track_running_stats"):
        normscope.BatchRenorm2d(3, track_running_stats=False)
    with pytest.raises(ValueError, match="rmax"):
        normscope.BatchRenorm2d(3, rmax=0.5)


def test_batchrenorm_channels_last_with_mask():
    x = torch.randn(4, 7, 5)
    mask = torch.rand(4, 7) > 0.3
    mask[0, 0] = True
    a = normscope.BatchRenorm1d(5, channel_dim=-1)
    a.running_mean.fill_(0.3)
    b = normscope.BatchRenorm1d(5)
    b.load_state_dict(a.state_dict())
    y = a(x, mask)
    yv = b(x[mask].unsqueeze(-1))  # the valid tokens alone, as (K, C, 1)
    torch.testing.assert_close(y[mask], yv.squeeze(-1), **TOL)
    torch.testing.assert_close(a.running_var, b.running_var, **TOL)


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool])
def test_batchrenorm_rejects_non_float_input(dtype):
    """BatchRenorm accepted int/bool input in training and returned an int tensor."""
    with pytest.raises(TypeError, match="floating-point"):
        normscope.BatchRenorm1d(3)(torch.ones(4, 3, dtype=dtype))


def test_batchrenorm_one_value_per_channel_raises_like_batchnorm():
    """BatchRenorm accepted one value per channel (torch's BatchNorm raises)."""
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        nn.BatchNorm1d(3)(torch.randn(1, 3))  # the rule being matched
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        normscope.BatchRenorm1d(3)(torch.randn(1, 3))
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        normscope.BatchRenorm2d(3)(torch.randn(1, 3, 1, 1))


def test_batchrenorm_warmup_ramp_read_as_tensor():
    """The ramp of rmax/dmax follows num_batches_tracked (now read without int())."""
    torch.manual_seed(0)
    m = normscope.BatchRenorm1d(2, warmup_iters=4, rmax=3.0, dmax=2.0, momentum=0.0)
    with torch.no_grad():
        m.running_var.fill_(100.0)  # sigma_B / sigma is far below 1/rmax: r sits on its clip
    x = torch.randn(16, 2, dtype=torch.float32)
    mean, var = x.double().mean(0), x.double().var(0, unbiased=False)
    for step in range(6):
        rmax = 1 + 2 * min(step / 4, 1)
        dmax = 2 * min(step / 4, 1)
        sigma = math.sqrt(100 + 1e-5)
        r = torch.clamp(torch.sqrt(var + 1e-5) / sigma, 1 / rmax, rmax)
        d = torch.clamp(mean / sigma, -dmax, dmax)
        want = (x.double() - mean) / torch.sqrt(var + 1e-5) * r + d
        torch.testing.assert_close(m(x).double(), want, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# backends and torch.compile


def test_batch_renorm_training_honours_the_forced_backend_and_says_which_ran():
    m = normscope.BatchRenorm2d(4)
    x = torch.randn(2, 4, 3, 3)
    nf.layer_norm(x, (3,))  # leaves last_backend() at "aten"
    assert normscope.last_backend() == "aten"
    m(x)
    assert normscope.last_backend() == "reference"  # its training step runs on the reference
    with normscope.use_backend("reference"):
        m(x)
    for name in ("aten", "composite"):
        before = m.running_mean.clone()
        with normscope.use_backend(name), pytest.raises(ValueError, match=f"backend '{name}' cannot run a training"):
            m(x)
        assert torch.equal(m.running_mean, before)  # refused before any state changed
    m.eval()
    with normscope.use_backend("aten"):
        torch.testing.assert_close(m(x), nn.functional.batch_norm(x, m.running_mean, m.running_var, m.weight, m.bias))
        assert normscope.last_backend() == "aten"


def test_compile_batchrenorm_with_momentum_matches_eager():
    """r and d are computed once, before the running buffers move: a backward that recomputed them from
    the updated buffers would differ from eager's by the size of the update."""
    _compile_batchrenorm(momentum=0.1, warmup=0, steps=3)


def test_compile_batchrenorm_warmup_matches_eager():
    """The warm-up limits come from the step counter, incremented in the same graph."""
    _compile_batchrenorm(momentum=0.0, warmup=3, steps=4)


def _compile_batchrenorm(momentum, warmup, steps):
    torch._dynamo.reset()
    torch.manual_seed(0)
    m = normscope.BatchRenorm2d(4, momentum=momentum, rmax=1.5, dmax=0.5, warmup_iters=warmup)
    with torch.no_grad():
        m.running_mean.uniform_(-1, 1)
        m.running_var.uniform_(0.5, 2)
    x = torch.randn(8, 4, 3, 3)
    eager, compiled = copy.deepcopy(m), copy.deepcopy(m)
    fn = torch.compile(compiled, fullgraph=True, backend="aot_eager")
    for _ in range(steps):
        xe, xc = x.clone().requires_grad_(), x.clone().requires_grad_()
        dy = torch.randn_like(x)
        (eager(xe) * dy).sum().backward()
        (fn(xc) * dy).sum().backward()
        torch.testing.assert_close(xc.grad, xe.grad)


_RENORM_CASES = [
    ("weight_size", swap("weight", torch.ones(5)), None, ValueError, ["weight", "(6,)", "(5,)"]),
    ("weight_device", swap("weight", torch.ones(6, device="meta")), None, ValueError, ["weight", "meta"]),
    ("weight_dtype", swap("weight", torch.ones(6, dtype=torch.float64)), None, TypeError, ["weight", "float64"]),
    ("bias_size", swap("bias", torch.zeros(7)), None, ValueError, ["bias", "(7,)"]),
    ("eps_negative", swap("eps", -1.0), None, ValueError, ["eps", "-1.0"]),
    ("eps_zero", swap("eps", 0.0), None, ValueError, ["eps", "0.0"]),
    ("eps_nan", swap("eps", math.nan), None, ValueError, ["eps", "nan"]),
    # float64 input, float32 buffers: refused in evaluation (BatchNorm's path), so in training too
    ("input_dtype", lambda m: None, torch.randn(4, 6, 5, dtype=torch.float64), TypeError, ["running_mean", "float64"]),
    ("input_device", lambda m: None, torch.randn(4, 6, 5, device="meta"), ValueError, ["meta"]),
    # a buffer set to None after a call: the correction reads both, the warm-up reads the count (an
    # AttributeError from the correction's reshape, or the ramp's .to, before)
    ("running_mean_none", swap("running_mean", None), None, ValueError, ["`running_mean`", "got None"]),
    ("running_var_none", swap("running_var", None), None, ValueError, ["`running_var`", "got None"]),
    ("count_none_warmup", lambda m: (swap("warmup_iters", 3)(m), swap("num_batches_tracked", None)(m)), None,
     ValueError, ["`num_batches_tracked`", "warmup_iters=3", "got None"]),
]


@pytest.mark.parametrize(
    "mutate, x, exc, fragments", [c[1:] for c in _RENORM_CASES], ids=[c[0] for c in _RENORM_CASES]
)
def test_batch_renorm_training_refuses_before_its_state_moves(mutate, x, exc, fragments):
    torch.manual_seed(0)
    m = normscope.BatchRenorm1d(6)
    good = torch.randn(4, 6, 5)
    m(good)  # warm, state moved once
    refused_with_state_kept(m, mutate, good if x is None else x, exc, fragments)


def test_batch_renorm_training_takes_half_input_with_float_parameters_as_batchnorm():
    # the mixed-precision case BatchNorm takes (fp16 input, fp32 parameters and buffers) stays accepted
    m = normscope.BatchRenorm1d(6)
    y = m(torch.randn(4, 6, 5).half())
    assert y.dtype == torch.float16


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_a_checkpointed_recomputation_counts_as_batchnorm_counts_it(use_reentrant):
    # activation checkpointing runs the forward again in the backward; non-reentrant checkpointing stops
    # that recomputation early, raising from a saved-tensor hook once the last tensor it needs is saved --
    # after the running statistics moved. torch.nn's BatchNorm counts the batch first (4 over two steps);
    # counted after the step, BatchRenorm's count stayed at 2 and momentum=None's factor 1 / count was off.
    # With rmax = 1 and dmax = 0 (no correction yet) its running statistics are BatchNorm's.
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    ours = normscope.BatchRenorm1d(6, momentum=None, rmax=1.0, dmax=0.0)
    theirs = nn.BatchNorm1d(6, momentum=None)
    for _ in range(2):
        x = torch.randn(4, 6, 5) * 2 + 1
        for layer in (ours, theirs):
            checkpoint(layer, x.clone().requires_grad_(), use_reentrant=use_reentrant).square().sum().backward()
    assert int(ours.num_batches_tracked) == int(theirs.num_batches_tracked) == 4
    torch.testing.assert_close(ours.running_mean, theirs.running_mean, rtol=0, atol=1e-6)
    torch.testing.assert_close(ours.running_var, theirs.running_var, rtol=0, atol=1e-6)


@pytest.mark.parametrize("use_reentrant", [True, False])
@pytest.mark.parametrize("warmup_iters", [0, 5])
def test_a_checkpointed_step_has_the_gradients_of_the_step_without_checkpointing(use_reentrant, warmup_iters):
    # the recomputation ran after the forward's update had moved the running statistics (and the warm-up's
    # step): r and d came out another correction, and every gradient another function's (2.5-27 % off in
    # relative norm). Oracle: the same layer, same state, run without checkpointing -- bit for bit
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    layer = normscope.BatchRenorm1d(6, warmup_iters=warmup_iters)
    with torch.no_grad():
        layer.running_mean.fill_(0.5)
        layer.running_var.fill_(2.0)
        layer.weight.uniform_(0.5, 1.5)
        layer.bias.uniform_(-1, 1)
    for _ in range(3):
        plain = copy.deepcopy(layer)  # the state before this step (a checkpointed step updates it twice)
        x = torch.randn(16, 6, 5)
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        plain(xa).square().sum().backward()
        checkpoint(layer, xb, use_reentrant=use_reentrant).square().sum().backward()
        for name, want, got in (
            ("input", xa.grad, xb.grad),
            ("weight", plain.weight.grad, layer.weight.grad),
            ("bias", plain.bias.grad, layer.bias.grad),
        ):
            assert torch.equal(got, want), f"grad of {name}: {(got - want).abs().max().item():.3g} off"
        layer.weight.grad = layer.bias.grad = None


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_a_layer_called_in_a_checkpointed_segment_and_after_it_has_the_gradients_without_checkpointing(
    use_reentrant,
):
    # the layer kept its calls' (r, d) in order and handed a recomputation the latest: here the call after
    # the segment, whose r and d were computed from running statistics the segment's call had moved -- the
    # segment's gradients another function's. Oracle: the same layer and state, no checkpointing, bit for bit
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    layer = normscope.BatchRenorm1d(6)
    with torch.no_grad():
        layer.running_mean.fill_(0.5)
        layer.running_var.fill_(2.0)
        layer.weight.uniform_(0.5, 1.5)
    plain = copy.deepcopy(layer)
    x1, x2 = torch.randn(16, 6, 5), torch.randn(16, 6, 5) * 3 + 1
    xa, xb = x1.clone().requires_grad_(), x1.clone().requires_grad_()
    (plain(xa).square().sum() + plain(x2).square().sum()).backward()
    (checkpoint(layer, xb, use_reentrant=use_reentrant).square().sum() + layer(x2).square().sum()).backward()
    for name, want, got in (
        ("input", xa.grad, xb.grad),
        ("weight", plain.weight.grad, layer.weight.grad),
        ("bias", plain.bias.grad, layer.bias.grad),
    ):
        assert torch.equal(got, want), f"grad of {name}: {(got - want).abs().max().item():.3g} off"


@pytest.mark.parametrize(
    "dtype, mean, std", [(torch.float16, 1e4, 0.0), (torch.float32, 1e4, 1e-3), (torch.float32, 5.0, 0.0)]
)
def test_batchrenorm_correction_d_is_not_rounded_at_the_batch_mean_magnitude(dtype, mean, std):
    # d joined the mean (mu_B - d sigma_B / r), rounded at mu_B's magnitude, then multiplied by r / sigma_B:
    # a constant fp16 channel at 1e4 (fresh running statistics: r = 1/3, d = 5) gave 5 +- 0.04 where the
    # paper's formula gives d exactly. Oracle: the formula in float64 on the same input values; bound: the
    # formula's own error run in fp32 (the input's dtype for fp16 is rounded once at the end)
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(16, 4, 8, generator=g, dtype=torch.float64) * std + mean).to(dtype)
    brn = normscope.BatchRenorm1d(4).to(dtype)
    y = brn(x).double()

    def formula(t):
        mu, sb = t.mean((0, 2), keepdim=True), (t.var((0, 2), unbiased=False, keepdim=True) + 1e-5).sqrt()
        s = math.sqrt(1 + 1e-5)  # fresh running statistics: mean 0, variance 1
        return (t - mu) / sb * (sb / s).clamp(1 / 3, 3) + (mu / s).clamp(-5, 5)

    want = formula(x.double())
    own = (formula(x.float()).to(dtype).double() - want).abs().max().item()
    assert (y - want).abs().max().item() <= own + 1e-6
