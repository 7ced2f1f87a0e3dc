"""GroupNorm against torch.nn.GroupNorm and torch.nn.functional.group_norm where the sweep over every
layer (``test_layers``) does not reach: one channel per group bit for bit in every dtype and layout, a bias
without a weight (whose backward torch's own kernel cannot run; checked against float64), one group per
channel on 2-D input on the ATen path; and, in ``TestHostile``, input torch refuses (one value per group, a
channel count that does not match), refused the same way with a message naming what was expected.

GroupNorm's rows in the sweeps over every norm (layers, masks, errors, numerics, backends, conformance,
differential, kernels) stay with their sweep: they check a property of all norms at once.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as TF
from torch import nn

import normscope
import normscope.functional as F

# ---------------------------------------------------------------------------------------------
# parity with torch


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_group_norm_with_one_channel_per_group_is_torchs_group_norm(dtype):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(4, 8, 5, 5, generator=g) * 3 + 2).to(dtype)
    ours, theirs = normscope.GroupNorm(8, 8).to(dtype), torch.nn.GroupNorm(8, 8).to(dtype)
    with torch.no_grad():
        ours.weight.uniform_(0.5, 1.5, generator=g)
        theirs.weight.copy_(ours.weight)
    # bit-identical: the same ATen op (fp32 and half types)
    assert torch.equal(ours(x), theirs(x))
    xc = x.contiguous(memory_format=torch.channels_last)
    y = ours(xc)
    assert y.is_contiguous(memory_format=torch.channels_last) == theirs(xc).is_contiguous(
        memory_format=torch.channels_last
    )
    torch.testing.assert_close(y, theirs(xc), atol=0, rtol=0)
    assert torch.equal(F.group_norm(x, 8, ours.weight), TF.group_norm(x, 8, theirs.weight))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_group_norm_on_a_one_sample_view_torch_calls_contiguous_is_torchs(dtype):
    # (1, C, H, W) with strides (C, 1, W*C, C): a (H, W, C) attention output permuted back, as diffusers'
    # UNet mid block hands its resnet. is_contiguous(channels_last) says True (the batch stride of one
    # sample is ignored) but torch's own layout test does not: torch copies it contiguous-format. The
    # default path raised inside torch.native_group_norm ("Expected X.is_contiguous(memory_format)").
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 4, 16, generator=g).to(dtype).permute(2, 0, 1)[None]
    assert x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()
    ours, theirs = normscope.GroupNorm(4, 16).to(dtype), torch.nn.GroupNorm(4, 16).to(dtype)
    with torch.no_grad():
        ours.weight.uniform_(0.5, 1.5, generator=g)
        theirs.weight.copy_(ours.weight)
    want = theirs(x)
    got = ours(x)
    assert torch.equal(got, want) and got.stride() == want.stride()
    got = F.group_norm(x, 4, ours.weight, ours.bias, backend="reference")
    torch.testing.assert_close(got, want)


def _grads(fn, *tensors, gy):
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    y = fn(*leaves)
    y.backward(gy)
    return (y.detach(), *(t.grad for t in leaves))


@pytest.mark.parametrize("backend", [None, "aten", "reference"])
@pytest.mark.parametrize("shape", [(3, 4), (2, 4, 5), (2, 4, 3, 3)])
def test_group_norm_bias_without_weight_has_a_backward(backend, shape):
    # torch's own group_norm backward raises "tensor does not have a device" here; its values are those
    # of the call without bias, plus the bias (float64 independent check)
    g = torch.Generator().manual_seed(0)
    x, b = torch.randn(shape, generator=g), torch.randn(shape[1], generator=g)
    gy = torch.randn(shape, generator=g)
    with normscope.use_backend(backend):
        y, dx, db = _grads(lambda x, b: F.group_norm(x, 2, None, b), x, b, gy=gy)
    per_channel = (1, -1) + (1,) * (len(shape) - 2)
    want_y, want_dx = _grads(lambda x: nn.functional.group_norm(x, 2), x.double(), gy=gy.double())
    torch.testing.assert_close(y, (want_y + b.double().view(per_channel)).float())  # fp32 tolerances
    torch.testing.assert_close(dx, want_dx.float())
    torch.testing.assert_close(db, gy.double().sum([d for d in range(len(shape)) if d != 1]).float())


def test_group_norm_one_group_per_channel_on_two_dims_runs_on_aten_as_torch():
    # (N, C) with num_groups == C: one value per group, which torch computes (the output is the bias)
    g = torch.Generator().manual_seed(1)
    x, w, b = torch.randn(3, 4, generator=g), torch.randn(4, generator=g), torch.randn(4, generator=g)
    gy = torch.randn(3, 4, generator=g)
    want = _grads(lambda *t: nn.functional.group_norm(t[0], 4, t[1], t[2]), x, w, b, gy=gy)
    for backend in (None, "aten"):
        with normscope.use_backend(backend):
            got = _grads(lambda *t: F.group_norm(t[0], 4, t[1], t[2]), x, w, b, gy=gy)
            assert normscope.last_backend() == "aten"
        for name, o, t in zip(("y", "dx", "dw", "db"), got, want):
            assert torch.equal(o, t), (backend, name)


# ---------------------------------------------------------------------------------------------
# hostile input


class TestHostile:
    """Input a user should not send: refused as torch refuses it, with a message that says more."""

    def test_one_value_per_group_raises_as_torch(self):
        x = torch.rand(1, 10, 1)
        with pytest.raises(ValueError):  # torch: nn.GroupNorm(10, 10)(x) raises too
            nn.GroupNorm(10, 10)(x)
        with pytest.raises(ValueError, match="more than 1 value per group"):
            normscope.GroupNorm(10, 10)(x)
        with pytest.raises(ValueError, match="more than 1 value per group"):
            F.group_norm(x, 10)
        for shape, groups in (((2, 10, 1), 10), ((1, 10, 1), 5), ((1, 10, 2), 10)):  # torch computes these
            x = torch.rand(shape)
            torch.testing.assert_close(normscope.GroupNorm(groups, 10)(x), nn.GroupNorm(groups, 10)(x))

    def test_a_channel_mismatch_names_the_channels_expected_where_torch_does_not(self):
        """torch's own GroupNorm error does not say how many channels it expected; ours does."""
        x = torch.randn(2, 5, 4)
        with pytest.raises(RuntimeError) as t:
            torch.nn.GroupNorm(3, 6)(x)
        with pytest.raises(ValueError) as n:
            normscope.GroupNorm(3, 6)(x)
        assert "6 channels" in str(n.value) and "6 channels" not in str(t.value)
