"""FrozenBatchNorm2d and ``freeze_batchnorm`` / ``unfreeze_batchnorm``: a frozen layer equals BatchNorm
in eval and loads its state; freezing keeps a channels_last axis, unfreezing restores the options, and
tied modules stay tied through the surgery."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import normscope

TOL = dict(atol=2e-5, rtol=1e-5)


def _randomize(module: nn.Module, seed: int = 0) -> nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    return module


# -- FrozenBatchNorm2d ---------------------------------------------------------------------------


def _trained_bn(c: int = 5) -> nn.BatchNorm2d:
    bn = _randomize(nn.BatchNorm2d(c))
    for _ in range(3):
        bn(torch.randn(4, c, 3, 3) * 2 + 1)
    return bn.eval()


def test_frozen_batchnorm_equals_bn_eval_and_loads_its_state():
    bn = _trained_bn()
    frozen = normscope.FrozenBatchNorm2d(5)
    frozen.load_state_dict(bn.state_dict())  # num_batches_tracked ignored, strict otherwise
    assert list(frozen.parameters()) == []
    assert set(frozen.state_dict()) == {"weight", "bias", "running_mean", "running_var"}
    x = torch.randn(2, 5, 4, 4, requires_grad=True)
    frozen.train()  # frozen in train mode too
    y = frozen(x)
    torch.testing.assert_close(y, bn(x), **TOL)
    # direct formula
    scale = frozen.weight / torch.sqrt(frozen.running_var + frozen.eps)
    want = (x - frozen.running_mean[:, None, None]) * scale[:, None, None] + frozen.bias[:, None, None]
    torch.testing.assert_close(y, want, **TOL)
    y.sum().backward()
    torch.testing.assert_close(x.grad, scale[None, :, None, None].expand_as(x), **TOL)
    assert torch.equal(frozen.running_mean, bn.running_mean)  # never updated


def test_freeze_and_unfreeze_batchnorm():
    model = nn.Sequential(nn.Conv2d(3, 5, 3), _trained_bn(), nn.ReLU(), nn.Sequential(nn.BatchNorm1d(4)))
    model[3][0].eval()
    x = torch.randn(2, 3, 6, 6)
    model.eval()
    want = model[:3](x)
    frozen = normscope.freeze_batchnorm(model)
    assert frozen is model
    assert isinstance(model[1], normscope.FrozenBatchNorm2d) and isinstance(model[3][0], normscope.FrozenBatchNorm2d)
    torch.testing.assert_close(model[:3](x), want, **TOL)
    normscope.unfreeze_batchnorm(model)
    assert type(model[1]) is normscope.BatchNorm2d and type(model[3][0]) is normscope.BatchNorm1d
    torch.testing.assert_close(model[:3](x), want, **TOL)
    assert isinstance(normscope.freeze_batchnorm(nn.BatchNorm2d(3)), normscope.FrozenBatchNorm2d)
    untracked = nn.Sequential(nn.BatchNorm2d(3, track_running_stats=False))
    assert isinstance(normscope.freeze_batchnorm(untracked)[0], nn.BatchNorm2d)  # nothing to freeze
    for bad in (None, "resnet"):  # a TypeError naming the argument, not an AttributeError from inside
        with pytest.raises(TypeError, match="freeze_batchnorm: expected `model` to be a torch.nn.Module"):
            normscope.freeze_batchnorm(bad)
        with pytest.raises(TypeError, match="unfreeze_batchnorm: expected `model` to be a torch.nn.Module"):
            normscope.unfreeze_batchnorm(bad)


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


def test_folded_frozen_batch_norm_refuses_an_input_on_another_device_with_a_value_error():
    # the unfolded path (F.batch_norm) says so; the folded one raised torch's RuntimeError from an op
    x = torch.randn(2, 3, 4, 4, device="meta")
    with pytest.raises(ValueError, match="meta"):
        normscope.FrozenBatchNorm2d(3)(x)
    with pytest.raises(ValueError, match="meta"):
        normscope.FrozenBatchNorm2d(3, fold=True)(x)


@pytest.mark.parametrize("name", ["weight", "bias", "running_mean", "running_var"])
def test_folded_frozen_batch_norm_refuses_a_buffer_of_another_size_replaced_after_a_call(name):
    # the unfolded path (F.batch_norm) refuses it by name; the folded one raised a broadcast RuntimeError
    # (or, for a buffer of one value, broadcast it silently over every channel)
    m = normscope.FrozenBatchNorm2d(3, fold=True)
    x = torch.randn(2, 3, 4, 4)
    m(x)
    for size in (1, 2, 5):
        setattr(m, name, torch.ones(size))
        with pytest.raises(ValueError, match=f"expected `{name}` of shape \\(3,\\), got \\({size},\\)"):
            m(x)
    setattr(m, name, torch.full((3,), 0.5))
    bn = nn.BatchNorm2d(3).eval()
    bn.load_state_dict(m.state_dict(), strict=False)
    torch.testing.assert_close(m(x), bn(x))
