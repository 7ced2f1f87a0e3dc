"""Adversarial findings (probe 9): each test failed before its fix.

Training steps of the layers that update their own state outside the hot path (BatchRenorm,
PowerNorm) must refuse a bad call before any state moves, with a ValueError/TypeError that names the
argument -- as BatchNorm's training call does (``functional.checked_batch_norm``)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import normscope


def _state(m: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


def _swap(name: str, value: object):
    def mutate(m: nn.Module) -> None:
        if isinstance(value, torch.Tensor):
            setattr(m, name, nn.Parameter(value))
        else:
            setattr(m, name, value)

    return mutate


# (id, mutation of a warm layer, the input, exception type, fragments of the message)
_RENORM_CASES = [
    ("weight_size", _swap("weight", torch.ones(5)), None, ValueError, ["weight", "(6,)", "(5,)"]),
    ("weight_device", _swap("weight", torch.ones(6, device="meta")), None, ValueError, ["weight", "meta"]),
    ("weight_dtype", _swap("weight", torch.ones(6, dtype=torch.float64)), None, TypeError, ["weight", "float64"]),
    ("bias_size", _swap("bias", torch.zeros(7)), None, ValueError, ["bias", "(7,)"]),
    ("eps_negative", _swap("eps", -1.0), None, ValueError, ["eps", "-1.0"]),
    ("eps_zero", _swap("eps", 0.0), None, ValueError, ["eps", "0.0"]),
    ("eps_nan", _swap("eps", math.nan), None, ValueError, ["eps", "nan"]),
    # float64 input, float32 buffers: refused in evaluation (BatchNorm's path), so in training too
    ("input_dtype", lambda m: None, torch.randn(4, 6, 5, dtype=torch.float64), TypeError, ["running_mean", "float64"]),
    ("input_device", lambda m: None, torch.randn(4, 6, 5, device="meta"), ValueError, ["meta"]),
]


@pytest.mark.parametrize(
    "mutate, x, exc, fragments", [c[1:] for c in _RENORM_CASES], ids=[c[0] for c in _RENORM_CASES]
)
def test_batch_renorm_training_refuses_before_its_state_moves(mutate, x, exc, fragments):
    torch.manual_seed(0)
    m = normscope.BatchRenorm1d(6)
    good = torch.randn(4, 6, 5)
    m(good)  # warm, state moved once
    mutate(m)
    before = _state(m)
    with pytest.raises(exc) as info:
        m(good if x is None else x)
    for fragment in fragments:
        assert fragment in str(info.value), (fragment, str(info.value))
    after = _state(m)
    for k, v in before.items():
        if v.device.type != "meta" and after[k].device == v.device:
            assert torch.equal(v, after[k]), f"{k} changed by a refused call"


def test_batch_renorm_training_takes_half_input_with_float_parameters_as_batchnorm():
    # the mixed-precision case BatchNorm takes (fp16 input, fp32 parameters and buffers) stays accepted
    m = normscope.BatchRenorm1d(6)
    y = m(torch.randn(4, 6, 5).half())
    assert y.dtype == torch.float16


_POWER_CASES = [
    ("weight_size", _swap("weight", torch.ones(5)), None, ValueError, ["weight", "(6,)", "(5,)"]),
    ("weight_device", _swap("weight", torch.ones(6, device="meta")), None, ValueError, ["weight", "meta"]),
    ("eps_negative", _swap("eps", -1.0), None, ValueError, ["eps", "-1.0"]),
    ("eps_nan", _swap("eps", math.nan), None, ValueError, ["eps", "nan"]),
    ("input_device", lambda m: None, torch.randn(4, 5, 6, device="meta"), ValueError, ["meta"]),
    ("running_phi_size", lambda m: setattr(m, "running_phi", torch.ones(5)), None, ValueError, ["running_phi", "(5,)"]),
]


@pytest.mark.parametrize("mutate, x, exc, fragments", [c[1:] for c in _POWER_CASES], ids=[c[0] for c in _POWER_CASES])
def test_power_norm_training_refuses_before_its_state_moves(mutate, x, exc, fragments):
    torch.manual_seed(0)
    m = normscope.PowerNorm(6, warmup_iters=2)
    good = torch.randn(4, 5, 6)
    m(good)
    mutate(m)
    before = _state(m)
    with pytest.raises(exc) as info:
        m(good if x is None else x)
    for fragment in fragments:
        assert fragment in str(info.value), (fragment, str(info.value))
    after = _state(m)
    for k, v in before.items():
        if v.device.type != "meta" and after[k].device == v.device:
            assert torch.equal(v, after[k]), f"{k} changed by a refused call"


def test_sync_batch_norm_outside_a_group_refuses_an_all_false_mask_in_training_as_batchnorm():
    # one process is the whole group: its all-False mask has no valid value to take statistics from,
    # which BatchNorm (and every rank of a group, together) refuses -- the running variance must not
    # be pulled towards 0 by an empty batch
    torch.manual_seed(0)
    x, mask = torch.randn(4, 6, 5), torch.zeros(4, 5, dtype=torch.bool)
    with pytest.raises(ValueError, match="at least one valid"):
        normscope.BatchNorm1d(6)(x, mask)
    sbn = normscope.SyncBatchNorm(6)
    before = _state(sbn)
    with pytest.raises(ValueError, match="at least one valid"):
        sbn(x, mask)
    for k, v in _state(sbn).items():
        assert torch.equal(v, before[k]), f"{k} changed by a refused call"


def test_sync_batch_norm_outside_a_group_checks_a_masked_calls_parameter_dtypes():
    sbn = normscope.SyncBatchNorm(6)
    sbn.weight = nn.Parameter(torch.ones(6, dtype=torch.float64))
    x, mask = torch.randn(4, 6, 5), torch.rand(4, 5) > 0.3
    with pytest.raises(TypeError, match="weight"):
        sbn(x, mask)


@pytest.mark.parametrize(
    "call",
    [
        lambda: normscope.functional.normalize(torch.randn(2, 3, 8), 2, eps=math.nan),
        lambda: normscope.functional.adain(torch.randn(2, 3, 8), torch.randn(2, 3, 8), eps=math.nan),
        lambda: normscope.AdaIN(eps=math.nan)(torch.randn(2, 3, 8), torch.randn(2, 3, 8)),
    ],
    ids=["normalize", "adain", "AdaIN"],
)
def test_a_nan_eps_is_refused_by_normalize_and_adain_as_by_every_other_op(call):
    # layer_norm, group_norm, instance_norm... refuse eps=NaN (every output would be NaN); these two
    # checked eps < 0 only, which NaN passes
    with pytest.raises(ValueError, match="eps"):
        normscope.functional.layer_norm(torch.randn(2, 8), (8,), eps=math.nan)
    with pytest.raises(ValueError, match="eps"):
        call()


def test_dyt_refuses_integer_input_as_derf_and_poly_norm_do():
    x = torch.arange(16).reshape(2, 8)
    with pytest.raises(TypeError, match="floating-point"):
        normscope.Derf(8)(x)
    with pytest.raises(TypeError, match=r"DyT.*floating-point.*int64"):
        normscope.DyT(8)(x)


def test_folded_frozen_batch_norm_refuses_an_input_on_another_device_with_a_value_error():
    # the unfolded path (F.batch_norm) says so; the folded one raised torch's RuntimeError from an op
    x = torch.randn(2, 3, 4, 4, device="meta")
    with pytest.raises(ValueError, match="meta"):
        normscope.FrozenBatchNorm2d(3)(x)
    with pytest.raises(ValueError, match="meta"):
        normscope.FrozenBatchNorm2d(3, fold=True)(x)
