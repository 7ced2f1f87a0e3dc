"""Issue 13, beyond-torch layers: state after freeze/unfreeze/convert, BatchRenorm's and PowerNorm's
edge cases, and torch's argument checks in the functional API. Each test fails on the code before
the fix (the bug it pins down is named in its docstring)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import normscope
import normscope.functional as F


def _bn64(x, mean, var, w, b, eps, cd):
    """BatchNorm in evaluation, float64, channel axis ``cd``: the oracle for frozen layers."""
    shape = [1] * x.dim()
    shape[cd] = -1
    v = lambda t: t.double().reshape(shape)  # noqa: E731
    return (x.double() - v(mean)) / torch.sqrt(v(var) + eps) * v(w) + v(b)


def test_freeze_keeps_channels_last_axis():
    """freeze_batchnorm normalized BatchNorm1d(channel_dim=-1) over dim 1 (off by 3-9.5)."""
    torch.manual_seed(0)
    bn = normscope.BatchNorm1d(6, channel_dim=-1)
    bn(torch.randn(4, 5, 6) * 3 + 2)  # non-trivial running statistics
    with torch.no_grad():
        bn.weight.uniform_(0.5, 2)
        bn.bias.uniform_(-1, 1)
    frozen = normscope.freeze_batchnorm(bn)
    x = torch.randn(3, 6, 6)  # 6 also at dim 1: a layer reading dim 1 would not even raise
    want = _bn64(x, bn.running_mean, bn.running_var, bn.weight, bn.bias, bn.eps, -1)
    torch.testing.assert_close(frozen(x).double(), want, atol=1e-5, rtol=1e-5)
    assert "channel_dim=-1" in repr(frozen)


def test_unfreeze_restores_options():
    """unfreeze_batchnorm dropped channel_dim, momentum, rmax, dmax (and warmup_iters)."""
    model = nn.Sequential(
        normscope.BatchNorm1d(4, momentum=0.3, channel_dim=-1),
        normscope.BatchRenorm2d(4, momentum=None, rmax=2.0, dmax=0.5, warmup_iters=7),
        nn.BatchNorm2d(4, momentum=0.05),
    )
    back = normscope.unfreeze_batchnorm(normscope.freeze_batchnorm(model))
    assert type(back[0]) is normscope.BatchNorm1d and back[0].channel_dim == -1 and back[0].momentum == 0.3
    r = back[1]
    assert type(r) is normscope.BatchRenorm2d
    assert (r.momentum, r.rmax, r.dmax, r.warmup_iters) == (None, 2.0, 0.5, 7)
    assert type(back[2]) is normscope.BatchNorm2d and back[2].momentum == 0.05
    # a hand-built channels-last frozen layer comes back as a channels-last BatchNorm1d
    bn = normscope.unfreeze_batchnorm(normscope.FrozenBatchNorm2d(4, channel_dim=-1))
    assert type(bn) is normscope.BatchNorm1d and bn.channel_dim == -1


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.BatchNorm2d(3)
        self.b = self.a  # the same layer under two names
        self.block = nn.Sequential(self.a)


@pytest.mark.parametrize("surgery", ["convert", "convert_to", "freeze"])
def test_tied_modules_stay_tied(surgery):
    """convert()/freeze_batchnorm replaced a module used twice at one path only (tied modules untied)."""
    m = _Tied()
    if surgery == "convert":
        m, report = normscope.convert(m)
        assert len(report) == 1
    elif surgery == "convert_to":
        m, report = normscope.convert(m, to="group:3")
        assert len(report) == 1
    else:
        m = normscope.freeze_batchnorm(m)
    assert not isinstance(m.a, nn.BatchNorm2d) or type(m.a) is not nn.BatchNorm2d
    assert m.a is m.b is m.block[0]
    assert len(list(m.parameters())) == len({id(p) for p in m.parameters()})


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


def test_powernorm_empty_batch_leaves_state():
    """An empty batch set running_phi to 0 (eval outputs 316x too large afterwards)."""
    torch.manual_seed(0)
    p = normscope.PowerNorm(4, warmup_iters=0)
    p(torch.randn(8, 5, 4) * 2)
    state = {k: v.clone() for k, v in p.state_dict().items()}
    y = p(torch.randn(0, 5, 4))
    assert y.shape == (0, 5, 4)
    y = p(torch.randn(3, 0, 4), torch.zeros(3, 0, dtype=torch.bool))
    assert y.shape == (3, 0, 4)
    for k, v in p.state_dict().items():
        torch.testing.assert_close(v, state[k], msg=k)


def test_powernorm_warmup_matches_loop_formula():
    """The tensor-valued step counter gives the reference's warm-up rule, step by step."""
    torch.manual_seed(0)
    p = normscope.PowerNorm(3, warmup_iters=3, alpha_fwd=0.8)
    phi = torch.ones(3, dtype=torch.float64)
    for it in range(1, 6):
        x = torch.randn(4, 5, 3) * it
        y = p(x)
        phi_b = x.double().square().mean((0, 1))
        used = phi_b if it <= 3 else phi
        torch.testing.assert_close(y.double(), x.double() / torch.sqrt(used + 1e-5), atol=1e-5, rtol=1e-5)
        if it < 3:
            phi = phi * (it - 1) / it + phi_b / it
        phi = 0.8 * phi + 0.2 * phi_b
        torch.testing.assert_close(p.running_phi.double(), phi, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"warmup_iters": -5}, r"`warmup_iters` to be a non-negative int, got -5"),
        ({"warmup_iters": "a"}, r"`warmup_iters` to be a non-negative int, got 'a'"),
        ({"warmup_iters": 2.5}, r"`warmup_iters` to be a non-negative int, got 2.5"),
        ({"group_scaling": True}, r"`group_scaling` to be None or a positive int dividing num_features=6, got True"),
        ({"group_scaling": 4}, r"`group_scaling` .* got 4"),
        ({"eps": -1.0}, r"`eps` to be a positive number, got -1.0"),
    ],
)
def test_powernorm_errors_name_the_argument(kwargs, match):
    """warm-up errors showed warmup_iters + 1 (or a str concatenation error); group_scaling=True
    fell through to the engine's 'Scope `groups`' message."""
    with pytest.raises(ValueError, match=match):
        normscope.PowerNorm(6, **kwargs)


@pytest.mark.parametrize("ndims", [0, -1, True])
@pytest.mark.parametrize("ctor", ["layer", "rms"])
def test_scope_layer_needs_positive_ndims(ctor, ndims):
    """Scope.layer(0)/layer(-1) gave an empty scope (all-zero output)."""
    with pytest.raises(ValueError, match=r"expected `ndims` to be a positive int"):
        getattr(normscope.Scope, ctor)(ndims)


@pytest.mark.parametrize("training, eps", [(True, 0.0), (True, -1e-5), (False, -1e-5)])
def test_batch_norm_eps_checked_like_torch(training, eps):
    """eps <= 0 in training (NaN) and eps < 0 in evaluation were accepted; torch raises."""
    x = torch.randn(4, 3, 5)
    with pytest.raises(ValueError, match="eps"):
        torch.nn.functional.batch_norm(x, torch.zeros(3), torch.ones(3), training=training, eps=eps)
    with pytest.raises(ValueError, match=rf"batch_norm: expected `eps` .* got {eps!r}"):
        F.batch_norm(x, torch.zeros(3), torch.ones(3), training=training, eps=eps)
    bn = normscope.BatchNorm1d(3, eps=eps).train(training)
    with pytest.raises(ValueError, match="eps"):
        bn(x)


def test_batch_norm_eps_zero_in_eval_is_allowed_like_torch():
    x, rm, rv = torch.randn(4, 3, 5), torch.randn(3), torch.rand(3) + 0.5
    want = torch.nn.functional.batch_norm(x, rm, rv, training=False, eps=0.0)
    torch.testing.assert_close(F.batch_norm(x, rm, rv, training=False, eps=0.0), want)


@pytest.mark.parametrize("fn", ["batch_norm", "instance_norm"])
def test_momentum_none_is_a_type_error_like_torch(fn):
    """F.batch_norm(momentum=None) silently meant 0; torch raises TypeError."""
    x, rm, rv = torch.randn(4, 3, 5), torch.zeros(3), torch.ones(3)
    args = (x, rm, rv, None, None, True)
    with pytest.raises(TypeError):
        getattr(torch.nn.functional, fn)(*args, momentum=None)
    with pytest.raises(TypeError, match=rf"{fn}: expected `momentum` to be a float .* got None"):
        getattr(F, fn)(*args, momentum=None)
    torch.testing.assert_close(rm, torch.zeros(3))  # nothing was updated


def test_layers_momentum_none_still_cumulative():
    """The layers' momentum=None (a cumulative average) is unaffected by the functional check."""
    torch.manual_seed(0)
    ours, theirs = normscope.BatchNorm1d(3, momentum=None), nn.BatchNorm1d(3, momentum=None)
    for _ in range(3):
        x = torch.randn(8, 3)
        ours(x), theirs(x)
    torch.testing.assert_close(ours.running_mean, theirs.running_mean)
    torch.testing.assert_close(ours.running_var, theirs.running_var)
