"""Masked norms at their edges: the mask's own shape and layout, and one value per channel.

* ``normalize`` takes a mask broadcastable *to* the input -- not one that broadcasts with it to a larger
  shape -- and refuses any other with a ValueError naming ``mask`` and both shapes; an unbatched InstanceNorm
  names the mask's shapes for the input as given.
* A masked BatchNorm in training refuses an input with one value per channel, and a masked GroupNorm a batch
  of one with one value per group, as torch.nn's layers (the independent check here) refuse them unmasked: a
  mask only takes values away. The refused call moves no state.
* A masked per-sample scope gives a sample the same bits alone and in batches of 2, 3, 7 and 33 when the
  mask's samples are not outermost in memory (a transposed ``(B, S)`` mask, as a sequence-first model holds
  it), on the reference backend (the automatic one for token-masked LayerNorm/RMSNorm over ``(S, D)``)
  and the automatic path. Oracle: the same sample computed alone.
* PowerNorm in evaluation with inf/NaN padding gives the valid outputs and gradients of its float64 formula
  over the valid positions alone (the weight's gradient was NaN: ``0 * inf``).
"""

from __future__ import annotations

import re

import pytest
import torch

import normscope
import normscope.functional as F

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


@pytest.mark.parametrize(
    "layer,shape,mask_shape,want",
    [
        (normscope.InstanceNorm1d, (3, 7), (5,), (7,)),
        (normscope.InstanceNorm1d, (3, 7), (1, 7), (7,)),  # the batched form of the right mask
        (normscope.InstanceNorm2d, (3, 4, 5), (4,), (4, 5)),
    ],
)
def test_unbatched_instance_norm_names_the_masks_own_shapes(layer, shape, mask_shape, want):
    # the message names the shape to pass for this input, and the one passed -- not the batched (1, ...) forms
    # the layer makes of them (which told a user to pass (1, 7), itself refused)
    msg = f"expected `mask` of shape {want} (the input's shape {shape} without channel axis 0), got {mask_shape}"
    with pytest.raises(ValueError, match=re.escape(msg)):
        layer(shape[0])(torch.randn(shape), torch.ones(mask_shape, dtype=torch.bool))


# -- masked BatchNorm with one value per channel -----------------------------------------------------------


def _functional(x, mask):
    rm, rv = torch.zeros(C), torch.ones(C)
    try:
        return F.batch_norm(x, rm, rv, training=True, mask=mask)
    finally:
        assert torch.equal(rm, torch.zeros(C)) and torch.equal(rv, torch.ones(C)), "a refused call moved state"


LAYERS = {
    "BatchNorm1d": lambda: normscope.BatchNorm1d(C),
    "SyncBatchNorm": lambda: normscope.SyncBatchNorm(C),
    "BatchRenorm1d": lambda: normscope.BatchRenorm1d(C),
}


@pytest.mark.parametrize("backend", [None, "reference"])
@pytest.mark.parametrize("shape", [(1, C), (1, C, 1)])
@pytest.mark.parametrize("kind", ["functional", *LAYERS])
def test_masked_batchnorm_with_one_value_per_channel_raises_as_torch(kind, shape, backend):
    x = torch.randn(shape)
    mask = torch.ones(shape[:1] + shape[2:], dtype=torch.bool)  # every value valid: the unmasked call
    with pytest.raises(ValueError, match="Expected more than 1 value per channel"):
        torch.nn.BatchNorm1d(C)(x)
    with normscope.use_backend(backend):
        if kind == "functional":
            with pytest.raises(ValueError, match="more than 1 value per channel"):
                _functional(x, mask)
            return
        layer = LAYERS[kind]()
        before = {k: b.clone() for k, b in layer.named_buffers()}
        with pytest.raises(ValueError, match="more than 1 value per channel"):
            layer(x, mask)
    for k, b in layer.named_buffers():
        assert torch.equal(b, before[k]), f"a refused call moved {k}"


@pytest.mark.parametrize("backend", [None, "reference"])
@pytest.mark.parametrize("kind", ["layer", "functional"])
def test_masked_group_norm_with_one_value_per_group_raises_as_torch(kind, backend):
    x = torch.randn(1, 4, 1)
    mask = torch.ones(1, 1, dtype=torch.bool)  # every value valid: the unmasked call
    with pytest.raises(ValueError, match="Expected more than 1 value per channel"):
        torch.nn.GroupNorm(4, 4)(x)
    with normscope.use_backend(backend), pytest.raises(ValueError, match="more than 1 value per group"):
        normscope.GroupNorm(4, 4)(x, mask) if kind == "layer" else F.group_norm(x, 4, mask=mask)


# -- batch invariance with a mask whose samples are not outermost in memory --------------------------------

L, D = 40, 16


def _token_norm(centered):
    return lambda x, m: normscope.normalize(x, dims=(1, 2), mask=m.unsqueeze(-1), centered=centered)


PER_SAMPLE = {  # name -> (call, input shape of one sample)
    "layer_norm_tokens": (_token_norm(True), (L, D)),
    "rms_norm_tokens": (_token_norm(False), (L, D)),
    "group_norm": (lambda x, m: normscope.GroupNorm(2, 8)(x, m), (8, L)),
    "layer_norm_gn1": (lambda x, m: normscope.GroupNorm(1, 8)(x, m), (8, L)),
    "instance_norm": (lambda x, m: normscope.InstanceNorm1d(8, affine=True)(x, m), (8, L)),
}


@pytest.mark.parametrize("x_layout", ["contiguous", "transposed"])
@pytest.mark.parametrize("backend", [None, "reference"])
@pytest.mark.parametrize("kind", sorted(PER_SAMPLE))
def test_masked_sample_same_bits_alone_and_in_a_batch_with_a_transposed_mask(kind, backend, x_layout):
    call, one = PER_SAMPLE[kind]
    g = torch.Generator().manual_seed(0)
    xs, dys = torch.randn(33, *one, generator=g), torch.randn(33, *one, generator=g)
    masks = torch.rand(33, L, generator=g) > 0.3
    masks[:, 0] = True

    def run(b, at):
        x, m, dy = xs[:b].clone(), masks[:b].clone(), dys[:b].clone()
        x[at], m[at], dy[at] = xs[0], masks[0], dys[0]
        if x_layout == "transposed":
            x = x.transpose(1, 2).contiguous().transpose(1, 2)
        m = m.t().contiguous().t()  # (B, S) laid out sequence-first: the samples innermost
        x.requires_grad_()
        with normscope.use_backend(backend):
            y = call(x, m)
        y.backward(dy)
        return y.detach()[at], x.grad[at]

    y1, g1 = run(1, 0)
    for b in (2, 3, 7, 33):
        y, gx = run(b, b // 2)
        assert torch.equal(y, y1), f"output of the sample differs in a batch of {b}"
        assert torch.equal(gx, g1), f"input gradient of the sample differs in a batch of {b}"


# -- PowerNorm in evaluation: non-finite padding passes no gradient ----------------------------------------


@pytest.mark.parametrize("padding", [float("inf"), float("nan"), -float("inf")])
def test_powernorm_eval_with_nonfinite_padding_gives_the_valid_gradients(padding):
    # evaluation normalizes with the running quadratic mean: y = x / sqrt(phi + eps) * w + b. Oracle: that
    # formula in float64 over the valid positions alone, the loss reading valid outputs only
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 7, C, generator=g)  # (B, S, D), channel_dim=-1
    mask = torch.rand(4, 7, generator=g) > 0.3
    mask[:, 0], mask[:, -1] = True, False
    layer = normscope.PowerNorm(C)
    with torch.no_grad():
        layer.running_phi.copy_(torch.rand(C, generator=g) + 0.5)
        layer.weight.copy_(torch.randn(C, generator=g))
        layer.bias.copy_(torch.randn(C, generator=g))
    layer.eval()
    xh = x.clone()
    xh[~mask] = padding
    xh.requires_grad_()
    dy = torch.randn(x.shape, generator=g)
    y = layer(xh, mask)
    (torch.where(mask[..., None], y, 0) * dy).sum().backward()

    scale = 1 / torch.sqrt(layer.running_phi.detach().double().reshape(-1) + layer.eps)
    xv, dyv = x[mask].double(), dy[mask].double()  # (K, C) valid positions
    w, b = layer.weight.detach().double(), layer.bias.detach().double()
    torch.testing.assert_close(y.detach()[mask], (xv * scale * w + b).float())
    torch.testing.assert_close(layer.weight.grad, (dyv * xv * scale).sum(0).float())
    torch.testing.assert_close(layer.bias.grad, dyv.sum(0).float())
    torch.testing.assert_close(xh.grad[mask], (dyv * scale * w).float())
    assert torch.count_nonzero(xh.grad[~mask]) == 0


@pytest.mark.parametrize("layer", ["BatchNorm1d", "SyncBatchNorm", "BatchRenorm1d"])
@pytest.mark.parametrize("fill", [float("inf"), float("-inf"), float("nan"), 1e30])
def test_batchnorm_eval_with_nonfinite_padding_gives_the_valid_gradients(layer, fill):
    # evaluation ran ATen on the input as given, mask dropped: the weight's gradient summed 0 * inf = NaN
    # from the padded positions (a loss on the valid outputs only). Oracle: torch.nn.BatchNorm1d in
    # evaluation, same state, on the input with its padding set to 0 -- bit for bit
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 4, 7, generator=g)
    mask = torch.rand(3, 7, generator=g) > 0.3
    m = getattr(normscope, layer)(4).eval()
    with torch.no_grad():
        m.running_mean.uniform_(-1, 1, generator=g)
        m.running_var.uniform_(0.5, 2, generator=g)
        m.weight.uniform_(0.5, 1.5, generator=g)
    t = torch.nn.BatchNorm1d(4).eval()
    t.load_state_dict({k: v for k, v in m.state_dict().items() if k in t.state_dict()})
    keep = mask.unsqueeze(1)
    xa = x.masked_fill(~keep, fill).requires_grad_()
    y = m(xa, mask)
    (y * keep).sum().backward()
    xz = x.masked_fill(~keep, 0.0).requires_grad_()
    yt = t(xz)
    (yt * keep).sum().backward()
    valid = keep.expand_as(y)
    assert torch.equal(y[valid], yt[valid])
    for name, got, want in (
        ("weight", m.weight.grad, t.weight.grad),
        ("bias", m.bias.grad, t.bias.grad),
        ("input", xa.grad, xz.grad),
    ):
        assert torch.equal(got, want), f"grad of {name}: {got} vs {want}"


@pytest.mark.parametrize("which", ["running_mean", "running_var"])
def test_masked_batchnorm_training_refuses_an_expanded_running_buffer_by_name(which):
    # the masked update is one in-place op on the buffer, which torch refuses from inside for a buffer
    # whose elements share memory ("unsupported operation: more than one element of the written-to
    # tensor refers to a single memory location"), after every check had passed
    x, mask = torch.randn(4, 3, 5), torch.rand(4, 5) > 0.3
    buffers = {"running_mean": torch.zeros(3), "running_var": torch.ones(3)}
    buffers[which] = buffers[which][:1].expand(3)
    before = {k: v.clone() for k, v in buffers.items()}
    with pytest.raises(ValueError, match=rf"batch_norm: expected `{which}` whose elements do not share memory.*"
                       r"strides \(0,\)"):
        normscope.functional.batch_norm(x, buffers["running_mean"], buffers["running_var"], training=True, mask=mask)
    for k, v in buffers.items():  # refused before any work: no buffer moved
        assert torch.equal(v, before[k])


def test_masked_batchnorm_with_one_valid_element_gives_the_bias_and_a_zero_batch_variance():
    # docs/beyond.md: one valid element per channel in training -- batch variance 0 (no NaN from Bessel's
    # n / (n - 1)), the valid output the bias, the running variance moved towards 0. Oracle: the formula
    x = torch.randn(4, 3, 5, generator=torch.Generator().manual_seed(5))
    mask = torch.zeros(4, 5, dtype=torch.bool)
    mask[1, 2] = True
    m = normscope.BatchNorm1d(3)
    with torch.no_grad():
        m.bias.copy_(torch.tensor([0.5, -1.0, 2.0]))
    y = m(x, mask)
    assert torch.equal(y[1, :, 2], m.bias.detach())
    assert torch.equal(m.running_mean, 0.1 * x[1, :, 2])
    assert torch.equal(m.running_var, torch.full((3,), 0.9))
