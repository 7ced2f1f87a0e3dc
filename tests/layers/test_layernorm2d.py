"""LayerNorm2d (timm's channels-first LayerNorm) is LayerNorm over the channel axis after a permute,
in NCHW and channels_last."""

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


# -- LayerNorm2d and any-axis LayerNorm --------------------------------------------------------


@pytest.mark.parametrize("channels_last", [False, True])
def test_layernorm2d_is_permuted_layernorm(channels_last):
    x = torch.randn(2, 6, 5, 7) * 3 + 2
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    x.requires_grad_()
    ln2d = _randomize(normscope.LayerNorm2d(6))
    ln = nn.LayerNorm(6, eps=1e-6)
    ln.load_state_dict(ln2d.state_dict())
    y = ln2d(x)
    assert normscope.last_backend() == "aten"
    x2 = x.detach().clone().requires_grad_()
    y2 = ln(x2.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
    torch.testing.assert_close(y, y2, **TOL)
    g = torch.randn_like(y)
    y.backward(g), y2.backward(g)
    torch.testing.assert_close(x.grad, x2.grad, **TOL)
    torch.testing.assert_close(ln2d.weight.grad, ln.weight.grad, **TOL)
    with normscope.use_backend("reference"):
        torch.testing.assert_close(ln2d(x), y, **TOL)
    assert isinstance(ln2d, nn.LayerNorm) and ln2d.num_channels == 6
    with pytest.raises(ValueError, match=r"\(N, 6, \*\)"):
        ln2d(torch.randn(2, 5, 3, 3))
