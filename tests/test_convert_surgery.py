"""``convert`` and ``freeze_batchnorm`` on layers that are not exactly torch.nn's: subclasses, layers
that do more than normalize (a norm followed by an activation, as timm's NormAct layers), layers of
other libraries. A layer is converted only to what reproduces it, never stripped of its activation,
and a layer left unconverted is named in the report with why. Each case is checked against the
original layer (a copy kept aside), never against normscope."""

from __future__ import annotations

import copy
import pickle
import warnings

import pytest
import torch
from torch import nn

import normscope


class MyLN(nn.LayerNorm):
    pass


class BatchNormAct(nn.BatchNorm2d):
    """timm's BatchNormAct2d in miniature: BatchNorm, then drop, then the activation (children)."""

    def __init__(self, c: int, act: type = nn.SiLU, eps: float = 1e-5) -> None:
        super().__init__(c, eps=eps)
        self.drop = nn.Identity()
        self.act = act()

    def forward(self, x):
        return self.act(self.drop(super().forward(x)))


class ScaledLN(nn.LayerNorm):
    """Does more than normalize and says nothing about it: no configuration reproduces it."""

    def forward(self, x):
        return super().forward(x) * 2


class ForeignRMSNorm(nn.Module):
    """Another library's RMSNorm (no torch base class), computing torch's."""

    def __init__(self, d: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.randn(d))

    def forward(self, x):
        return torch.nn.functional.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def _randomized(m: nn.Module, seed: int = 0) -> nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in list(m.named_parameters()) + list(m.named_buffers()):
            if t.is_floating_point():
                t.copy_(torch.rand(t.shape, generator=g) + 0.5 if "var" in name else torch.randn(t.shape, generator=g))
    return m


def _x(*shape: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 3 + 1


def test_a_subclass_named_by_where_is_converted_not_silently_skipped():
    model = nn.Sequential(_randomized(MyLN(16)))
    original = copy.deepcopy(model)
    model, report = normscope.convert(model, where=MyLN)
    assert [r.path for r in report] == ["0"] and isinstance(model[0], normscope.LayerNorm)
    x = _x(3, 5, 16)
    assert torch.equal(model(x), original(x))
    back, _ = normscope.convert(model, to="torch")
    assert type(back[0]) is MyLN  # the subclass itself comes back


def test_normact_keeps_its_activation_lossless_and_to_another_norm():
    model = nn.Sequential(nn.Conv2d(3, 6, 3), _randomized(BatchNormAct(6)))
    original = copy.deepcopy(model)
    x = _x(2, 3, 7, 7)
    converted, report = normscope.convert(copy.deepcopy(model))
    assert [r.path for r in report] == ["1"] and not report.skipped
    assert isinstance(converted[1], normscope.BatchNorm2d) and isinstance(converted[1].act, nn.SiLU)
    assert list(converted.state_dict()) == list(original.state_dict())
    for mode in ("train", "eval"):
        getattr(original, mode)(), getattr(converted, mode)()
        assert torch.equal(converted(x), original(x)), mode
    assert torch.equal(converted[1].running_mean, original[1].running_mean)
    # to another norm: the activation stays after it (it was dropped, changing the output by O(1))
    grouped, report = normscope.convert(copy.deepcopy(model), to="group:2", where=nn.BatchNorm2d)
    assert isinstance(grouped[1], normscope.GroupNorm) and isinstance(grouped[1].act, nn.SiLU)
    ref = nn.Sequential(model[0], nn.GroupNorm(2, 6), nn.SiLU())
    with torch.no_grad():
        ref[1].weight.copy_(model[1].weight), ref[1].bias.copy_(model[1].bias)
    torch.testing.assert_close(grouped(x), ref(x), rtol=1e-5, atol=1e-5)
    assert pickle.loads(pickle.dumps(converted))[1].act is not None  # the generated class pickles


def test_a_layer_that_does_more_is_skipped_and_named():
    model = nn.Sequential(nn.Linear(4, 8), _randomized(ScaledLN(8)), nn.LayerNorm(8))
    x = _x(2, 4)
    want = model(x)
    model, report = normscope.convert(model)
    assert [r.path for r in report] == ["2"]
    assert [s.path for s in report.skipped] == ["1"] and "reproduces it" in report.skipped[0].reason
    assert type(model[1]) is ScaledLN and torch.equal(model(x), want)
    assert "at '1'" in str(report) and "left as they are" in str(report)
    _, report = normscope.convert(model, to="group:2", where=ScaledLN)
    assert len(report) == 1  # another norm is asked for: what the layer computes is replaced on purpose


def test_foreign_norms_are_probed_and_carried_both_ways():
    layer = ForeignRMSNorm(8, eps=1e-3)
    original = copy.deepcopy(layer)
    model, report = normscope.convert(nn.Sequential(layer))
    assert isinstance(model[0], normscope.RMSNorm) and model[0].eps == 1e-3
    x = _x(3, 8)
    assert torch.equal(model(x), original(x))
    back, _ = normscope.convert(model, to="torch")
    assert type(back[0]) is ForeignRMSNorm and back[0].weight is layer.weight


def test_convert_to_another_norm_carries_eps_momentum_and_affine():
    bn = nn.BatchNorm2d(4, eps=1e-3, momentum=0.3, affine=False)
    model, _ = normscope.convert(nn.Sequential(bn), to="batchrenorm")
    assert (model[0].eps, model[0].momentum, model[0].affine) == (1e-3, 0.3, False)
    model, _ = normscope.convert(nn.Sequential(nn.LayerNorm(8, eps=1e-3)), to="rms")
    assert model[0].eps == 1e-3
    model, _ = normscope.convert(nn.Sequential(nn.LayerNorm(8, eps=1e-3)), to="rms", eps=1e-7)
    assert model[0].eps == 1e-7  # the caller's keyword wins


def test_report_paths_are_quoted_and_skips_listed():
    model = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4), nn.LayerNorm(4))
    _, report = normscope.convert(model, to="group:2", where=nn.BatchNorm2d)
    text = str(report)
    assert "at '1': torch.BatchNorm2d(4" in text and "\n  1:" not in text
    assert [(s.path, s.reason) for s in report.skipped] == [("2", "not selected by `where`")]
    _, report = normscope.convert(nn.Sequential(ScaledLN(4)))
    assert str(report).startswith("convert: no layer replaced\nconvert: 1 normalization-like layer(s) left")


def test_freeze_keeps_the_activation_and_unfreeze_brings_back_the_layer():
    model = nn.Sequential(nn.Conv2d(3, 6, 3), _randomized(BatchNormAct(6, act=nn.GELU))).eval()
    x = _x(2, 3, 7, 7)
    want = model(x)
    frozen = normscope.freeze_batchnorm(copy.deepcopy(model))
    assert isinstance(frozen[1], normscope.FrozenBatchNorm2d) and isinstance(frozen[1].act, nn.GELU)
    assert torch.equal(frozen(x), want)
    back = normscope.unfreeze_batchnorm(frozen)
    assert type(back[1]) is BatchNormAct and isinstance(back[1].act, nn.GELU)  # not a ReLU, not a plain BN
    assert torch.equal(back.eval()(x), want)


def test_freeze_leaves_what_it_cannot_reproduce_and_warns():
    class OddBN(nn.BatchNorm2d):
        def forward(self, x):
            return super().forward(x) + 1

    model = nn.Sequential(OddBN(3)).eval()
    with pytest.warns(UserWarning, match=r"at '0': a FrozenBatchNorm2d does not reproduce it"):
        frozen = normscope.freeze_batchnorm(model)
    assert type(frozen[0]) is OddBN
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        normscope.freeze_batchnorm(nn.Sequential(nn.BatchNorm2d(3)))
