"""timm's norm names (``timm.layers.get_norm_layer``) resolve in normscope's registry and compute what
timm's layers compute (checked against torch.nn and the direct formula with timm's defaults)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import normscope
from normscope.registry import TIMM_NAMES, get_norm, register_norm

C = 64  # divisible by timm's fixed 32 groups


def _x(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 3 + 1


def _rms(x: torch.Tensor, dims: tuple[int, ...], eps: float) -> torch.Tensor:
    return x / torch.sqrt(x.square().mean(dims, keepdim=True) + eps)


# name -> (normscope class, input shape, independent computation of timm's layer at init)
CASES = {
    "batchnorm": (normscope.BatchNorm2d, (4, C, 3, 3), lambda x: F.batch_norm(x, None, None, training=True, eps=1e-5)),
    "batchnorm2d": (normscope.BatchNorm2d, (4, C, 3, 3), lambda x: F.batch_norm(x, None, None, training=True)),
    "batchnorm1d": (normscope.BatchNorm1d, (4, C, 5), lambda x: F.batch_norm(x, None, None, training=True)),
    "groupnorm": (normscope.GroupNorm, (2, C, 3, 3), lambda x: F.group_norm(x, 32, eps=1e-5)),
    "groupnorm1": (normscope.GroupNorm, (2, C, 3, 3), lambda x: F.group_norm(x, 1, eps=1e-5)),
    "layernorm": (normscope.LayerNorm, (2, 7, C), lambda x: F.layer_norm(x, (C,), eps=1e-6)),
    "layernorm2d": (
        normscope.LayerNorm2d,
        (2, C, 3, 3),
        lambda x: F.layer_norm(x.permute(0, 2, 3, 1), (C,), eps=1e-6).permute(0, 3, 1, 2),
    ),
    "rmsnorm": (normscope.RMSNorm, (2, 7, C), lambda x: _rms(x, (-1,), 1e-6)),
    # frozen statistics at init: running mean 0, var 1 -> x / sqrt(1 + eps)
    "frozenbatchnorm2d": (normscope.FrozenBatchNorm2d, (2, C, 3, 3), lambda x: x / (1 + 1e-5) ** 0.5),
}


def test_every_timm_name_is_tested():
    assert set(CASES) == set(TIMM_NAMES)


@pytest.mark.parametrize("name", sorted(CASES))
def test_timm_name_builds_the_matching_layer_and_computes_timms_output(name):
    cls, shape, expected = CASES[name]
    layer = get_norm(name, C).double()
    assert isinstance(layer, cls), f"{name} -> {type(layer).__name__}, expected {cls.__name__}"
    x = _x(*shape)
    torch.testing.assert_close(layer(x), expected(x), rtol=1e-10, atol=1e-10)


def test_timm_defaults_for_eps_and_groups():
    assert get_norm("layernorm", C).eps == 1e-6
    assert get_norm("layernorm2d", C).eps == 1e-6
    assert get_norm("rmsnorm", C).eps == 1e-6
    assert get_norm("layernorm", C, eps=1e-3).eps == 1e-3  # an explicit eps still wins
    assert get_norm("groupnorm", C).num_groups == 32
    assert get_norm("groupnorm1", C).num_groups == 1


def test_timm_spellings_with_underscores_and_case():
    assert isinstance(get_norm("Group_Norm", C), nn.GroupNorm)
    assert isinstance(get_norm("LayerNorm2d", C), normscope.LayerNorm2d)


@pytest.mark.parametrize("target", [5, None, 1.5, [normscope.LayerNorm]])
def test_register_norm_refuses_a_target_that_is_not_callable(target):
    with pytest.raises(TypeError, match="`target`"):
        register_norm("x_bad", target)
    with pytest.raises(ValueError, match="unknown norm"):
        get_norm("x_bad", 4)  # nothing was registered


def test_register_norm_refuses_a_malformed_import_path():
    with pytest.raises(ValueError, match="package.module:Attribute"):
        register_norm("x_bad_path", "normscope.modules.LayerNorm")
