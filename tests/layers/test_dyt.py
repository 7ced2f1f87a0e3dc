"""DyT (Dynamic Tanh) against its formula ``weight * tanh(alpha * x) + bias``."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import normscope


def _randomize(module: nn.Module, seed: int = 0) -> nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    return module


# -- DyT ------------------------------------------------------------------------------------------


def test_dyt_formula():
    dyt = _randomize(normscope.DyT(4, alpha_init=0.7))
    x = torch.randn(2, 3, 4)
    want = dyt.weight * torch.tanh(dyt.alpha * x) + dyt.bias
    torch.testing.assert_close(dyt(x), want)
    first = _randomize(normscope.DyT(4, channel_dim=1))
    xc = torch.randn(2, 4, 3, 3)
    w, b = first.weight[:, None, None], first.bias[:, None, None]
    torch.testing.assert_close(first(xc), w * torch.tanh(first.alpha * xc) + b)
    assert normscope.DyT(4).alpha.item() == 0.5
    with pytest.raises(ValueError, match="4 features at dim -1"):
        dyt(torch.randn(2, 4, 3))


def test_dyt_refuses_integer_input_as_derf_and_poly_norm_do():
    x = torch.arange(16).reshape(2, 8)
    with pytest.raises(TypeError, match="floating-point"):
        normscope.Derf(8)(x)
    with pytest.raises(TypeError, match=r"DyT.*floating-point.*int64"):
        normscope.DyT(8)(x)


@pytest.mark.parametrize(
    "name, value, got",
    [("weight", nn.Parameter(torch.ones(5)), "(5,) and (4,)"), ("bias", nn.Parameter(torch.zeros(1)), "(4,) and (1,)"),
     ("bias", None, "(4,) and None")],
    ids=["weight_size", "bias_size", "bias_none"],
)  # fmt: skip
def test_dyt_weight_or_bias_replaced_after_a_call(name, value, got):
    """A weight or bias replaced after a call by one of another size, or a bias by None, is a ValueError
    naming both (a RuntimeError from view(), or an AttributeError of None, before); replaced by one of
    the right size, the new one is used: the formula ``weight * tanh(alpha * x) + bias``."""
    m = normscope.DyT(4)
    x = torch.randn(2, 3, 4)
    m(x)
    setattr(m, name, value)
    with pytest.raises(ValueError, match="expected `weight` and `bias` of shape") as e:
        m(x)
    assert got in str(e.value)
    setattr(m, name, nn.Parameter(torch.randn(4)))
    torch.testing.assert_close(m(x), m.weight * torch.tanh(m.alpha * x) + m.bias)


@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("size", [4, 9])
def test_dyt_alpha_of_more_than_one_value_is_refused(affine, size):
    """alpha is one scalar (the paper's, as Derf's): one of the feature count's size broadcast silently
    per feature, another size raised a broadcast RuntimeError; both a ValueError naming it now."""
    m = normscope.DyT(4, affine=affine)
    x = torch.randn(2, 3, 4)
    m(x)
    m.alpha = nn.Parameter(torch.full((size,), 0.5))
    with pytest.raises(ValueError, match=f"expected `alpha` to have one element, got shape \\({size},\\)"):
        m(x)
    m.alpha = None  # an AttributeError of None once, a TypeError of None * input before
    with pytest.raises(ValueError, match="expected `alpha` to have one element, got None"):
        m(x)
    m.alpha = nn.Parameter(torch.full((1,), 0.7))
    want = torch.tanh(0.7 * x)
    torch.testing.assert_close(m(x), want if m.weight is None else want * m.weight + m.bias)
