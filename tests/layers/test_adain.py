"""AdaIN against its direct formula (instance statistics of the content, affine from the style),
in both call styles."""

from __future__ import annotations

import math

import pytest
import torch

import normscope
import normscope.functional as F

# -- AdaIN -----------------------------------------------------------------------------------------


def test_adain_direct_formula_and_tuple_style():
    content = (torch.randn(2, 3, 6, 5, dtype=torch.float64) * 4 + 2).requires_grad_()
    style = torch.randn(2, 3, 4, 7, dtype=torch.float64) * 0.5 - 1
    eps = 1e-5
    cv, cm = torch.var_mean(content, dim=(2, 3), keepdim=True, correction=0)
    sv, sm = torch.var_mean(style, dim=(2, 3), keepdim=True, correction=0)
    want = (content - cm) / torch.sqrt(cv + eps) * torch.sqrt(sv + eps) + sm
    y = normscope.AdaIN()(content, style)
    torch.testing.assert_close(y, want)
    g = torch.randn_like(y)
    (gy,) = torch.autograd.grad(y, content, g)
    (gw,) = torch.autograd.grad(want, content, g)
    torch.testing.assert_close(gy, gw)
    y2 = F.adain(content, (sm.flatten(1), torch.sqrt(sv + eps).flatten(1)))
    torch.testing.assert_close(y2, want)
    # one style for the whole batch, (C,) statistics
    y3 = F.adain(content, (sm[0].flatten(), torch.sqrt(sv[0] + eps).flatten()))
    torch.testing.assert_close(y3[0], want[0])
    with pytest.raises(ValueError, match="style"):
        F.adain(content, torch.randn(2, 4, 3, 3, dtype=torch.float64))


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


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_adain_is_rounded_once(dtype):
    # the normalized, style-scaled content was rounded to the input dtype before the style's mean was
    # added (apply returns its input's dtype) and rounded again after: fp16 max error 0.0019 against
    # float64 where the formula in fp32 rounded once gives 0.00098. Oracle: the formula in float64 on the
    # same (half) values; bound: the formula in fp32, rounded once
    g = torch.Generator().manual_seed(0)
    content = torch.randn(2, 4, 16, 16, generator=g, dtype=torch.float64).to(dtype)
    style = torch.randn(2, 4, 8, 8, generator=g, dtype=torch.float64).to(dtype)

    def formula(c, s):
        cv, cm = torch.var_mean(c, dim=(2, 3), keepdim=True, correction=0)
        sv, sm = torch.var_mean(s, dim=(2, 3), keepdim=True, correction=0)
        return (c - cm) / torch.sqrt(cv + 1e-5) * torch.sqrt(sv + 1e-5) + sm

    want = formula(content.double(), style.double())
    bound = (formula(content.float(), style.float()).to(dtype).double() - want).abs().max().item()
    y = F.adain(content, style)
    assert y.dtype == dtype
    assert (y.double() - want).abs().max().item() <= bound * 1.05
