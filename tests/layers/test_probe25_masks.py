"""Masked norms at their edges: the mask's own shape and layout, and one value per channel.

* ``normalize`` takes a mask broadcastable *to* the input -- not one that broadcasts with it to a larger
  shape -- and refuses any other with a ValueError naming ``mask`` and both shapes.
"""

from __future__ import annotations

import re

import pytest
import torch

import normscope

C = 3


# -- normalize: a mask broadcastable to the input ---------------------------------------------------------


@pytest.mark.parametrize("backend", [None, "reference", "composite"])
@pytest.mark.parametrize("mask_shape", [(4, 1, 5), (2, 1, 3, 5), (4, 3, 5)])
def test_normalize_refuses_a_mask_that_broadcasts_past_the_input(mask_shape, backend):
    x = torch.randn(1, 3, 5)
    mask = torch.ones(mask_shape, dtype=torch.bool)
    with pytest.raises(ValueError, match=re.escape(f"`mask` broadcastable to (1, 3, 5), got {tuple(mask_shape)}")):
        normscope.normalize(x, dims=2, mask=mask, backend=backend)


@pytest.mark.parametrize("mask_shape", [(1, 1, 5), (5,), (3, 1), (1, 3, 5)])
def test_normalize_takes_a_mask_broadcastable_to_the_input(mask_shape):
    x = torch.randn(1, 3, 5, dtype=torch.float64)
    mask = torch.ones(mask_shape, dtype=torch.bool)
    y = normscope.normalize(x, dims=2, mask=mask)
    want = (x - x.mean(2, keepdim=True)) / torch.sqrt(x.var(2, unbiased=False, keepdim=True) + 1e-5)
    assert y.shape == x.shape
    torch.testing.assert_close(y, want)
