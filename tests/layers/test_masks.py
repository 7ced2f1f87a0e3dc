"""Masked normalization: a masked layer equals the unmasked layer applied to the valid elements
alone (outputs, running statistics and every gradient), and padding has no influence."""

from __future__ import annotations

import pytest
import torch

import normscope
import normscope.functional as F

torch.manual_seed(0)
TOL = dict(atol=2e-5, rtol=1e-5)


def _mask(*shape: int, p: float = 0.3, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    m = torch.rand(*shape, generator=g) > p
    m.view(-1)[0] = True  # never empty
    return m


@pytest.fixture(params=["auto", "reference"])
def backend(request):
    """Run a test with the automatic choice (masked scopes: the composite backend) and on the reference."""
    with normscope.use_backend(None if request.param == "auto" else request.param):
        yield request.param


def _pair(layer_cls, *args, **kw):
    a = layer_cls(*args, **kw)
    with torch.no_grad():
        for p in a.parameters():
            p.copy_(torch.randn_like(p))
    b = layer_cls(*args, **kw)
    b.load_state_dict(a.state_dict())
    return a, b


@pytest.mark.parametrize("channel_dim", [1, -1])
def test_batchnorm1d_masked_equals_valid_only(channel_dim, backend):
    n, c, length = 5, 7, 11
    x = torch.randn(n, c, length) * 3 + 1 if channel_dim == 1 else torch.randn(n, length, c) * 3 + 1
    mask = _mask(n, length)
    masked, plain = _pair(normscope.BatchNorm1d, c, channel_dim=channel_dim, momentum=0.3)
    plain = torch.nn.BatchNorm1d(c, momentum=0.3)
    plain.load_state_dict(masked.state_dict())
    x1 = x.clone().requires_grad_()
    y = masked(x1, mask)
    # the valid elements alone, as a (K, C) batch for torch's own layer
    xv_src = x.clone().requires_grad_()
    xv = xv_src.transpose(1, 2)[mask] if channel_dim == 1 else xv_src[mask]
    yv = plain(xv)
    yc = y.transpose(1, 2)[mask] if channel_dim == 1 else y[mask]
    torch.testing.assert_close(yc, yv, **TOL)
    torch.testing.assert_close(masked.running_mean, plain.running_mean, **TOL)
    torch.testing.assert_close(masked.running_var, plain.running_var, **TOL)
    g = torch.randn_like(yv)
    yc.backward(g)
    yv.backward(g)
    torch.testing.assert_close(x1.grad, xv_src.grad, **TOL)
    torch.testing.assert_close(masked.weight.grad, plain.weight.grad, **TOL)
    torch.testing.assert_close(masked.bias.grad, plain.bias.grad, **TOL)
    # eval: running statistics, mask irrelevant
    masked.eval(), plain.eval()
    torch.testing.assert_close(masked(x, mask), masked(x), **TOL)


def test_batchnorm2d_masked_equals_valid_only(backend):
    x = torch.randn(3, 4, 5, 6)
    mask = _mask(3, 5, 6)
    bn = normscope.BatchNorm2d(4)
    ref = torch.nn.BatchNorm1d(4)
    y = bn(x, mask)
    yv = ref(x.permute(0, 2, 3, 1)[mask])
    torch.testing.assert_close(y.permute(0, 2, 3, 1)[mask], yv, **TOL)
    torch.testing.assert_close(bn.running_var, ref.running_var, **TOL)


@pytest.mark.parametrize("kind", ["instance1d", "instance2d", "group"])
def test_per_sample_masked_equals_valid_only(kind, backend):
    n, c = 4, 6
    if kind == "instance2d":
        shape, layer = (n, c, 5, 4), normscope.InstanceNorm2d(c, affine=True)
        ref = torch.nn.InstanceNorm1d(c, affine=True)
    elif kind == "instance1d":
        shape, layer, ref = (n, c, 9), normscope.InstanceNorm1d(c, affine=True), torch.nn.InstanceNorm1d(c, affine=True)
    else:
        shape, layer, ref = (n, c, 9), normscope.GroupNorm(3, c), torch.nn.GroupNorm(3, c)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(c))
        layer.bias.copy_(torch.randn(c))
    ref.load_state_dict(layer.state_dict())
    x = (torch.randn(shape) * 2 + 5).requires_grad_()
    mask = _mask(n, *shape[2:])
    y = layer(x, mask)
    g = torch.randn_like(y)
    (y * g * mask.unsqueeze(1)).sum().backward()
    xr = x.detach().clone().requires_grad_()
    for i in range(n):
        flat = xr[i].reshape(c, -1)[:, mask[i].reshape(-1)]
        yr = ref(flat.unsqueeze(0))[0]
        torch.testing.assert_close(y[i].reshape(c, -1)[:, mask[i].reshape(-1)], yr, **TOL)
        (yr * g[i].reshape(c, -1)[:, mask[i].reshape(-1)]).sum().backward()
    torch.testing.assert_close(x.grad, xr.grad, **TOL)
    torch.testing.assert_close(layer.weight.grad, ref.weight.grad, **TOL)
    torch.testing.assert_close(layer.bias.grad, ref.bias.grad, **TOL)


def test_padding_has_no_influence(backend):
    x = torch.randn(4, 6, 8)
    mask = _mask(4, 8)
    for garbage in (1e6, float("inf"), float("nan")):
        x2 = x.clone()
        x2.transpose(1, 2)[~mask] = garbage  # garbage in the padding
        for layer in (
            normscope.BatchNorm1d(6),
            normscope.InstanceNorm1d(6),
            normscope.GroupNorm(3, 6),
            normscope.GroupNorm(1, 6),
        ):
            y1, y2 = layer(x, mask), layer(x2, mask)
            m = mask.unsqueeze(1).expand_as(y1)
            torch.testing.assert_close(y1[m], y2[m])
    # padded inputs receive no gradient through the statistics
    xg = x.clone().requires_grad_()
    y = normscope.BatchNorm1d(6)(xg, mask)
    (y * mask.unsqueeze(1)).square().sum().backward()
    assert torch.count_nonzero(xg.grad.transpose(1, 2)[~mask]) == 0


def test_functional_masks_and_backend_choice():
    x = torch.randn(3, 4, 6)
    mask = _mask(3, 6)
    F.batch_norm(x, None, None, training=True, mask=mask)
    assert normscope.last_backend() == "composite"  # ATen has no masked op; the composite form runs it
    y = F.group_norm(x, 2, mask=mask)
    yi = F.instance_norm(x, mask=mask)
    torch.testing.assert_close(y, normscope.normalize(x, keep=0, groups=2, mask=mask.unsqueeze(1)))
    torch.testing.assert_close(yi, normscope.normalize(x, dims=2, mask=mask.unsqueeze(1)))
    # an all-True mask is the unmasked op
    full = torch.ones(3, 6, dtype=torch.bool)
    torch.testing.assert_close(F.group_norm(x, 2, mask=full), torch.nn.functional.group_norm(x, 2), **TOL)


def test_empty_scopes(backend):
    x = torch.randn(2, 3, 5)
    mask = torch.zeros(2, 5, dtype=torch.bool)
    with pytest.raises(ValueError, match="at least one valid"):
        normscope.BatchNorm1d(3)(x, mask)
    bias = torch.randn(3)
    mask[0] = True  # sample 1 has no valid position: its output is the bias
    y = F.instance_norm(x, weight=torch.ones(3), bias=bias, mask=mask)
    torch.testing.assert_close(y[1], bias[:, None].expand(3, 5))
    y = F.group_norm(x, 3, bias=bias, weight=torch.ones(3), mask=mask)
    torch.testing.assert_close(y[1], bias[:, None].expand(3, 5))
    assert torch.isfinite(y).all()


def test_mask_errors():
    x = torch.randn(2, 3, 5)
    with pytest.raises(ValueError, match=r"expected `mask` of shape \(2, 5\)"):
        normscope.BatchNorm1d(3)(x, torch.ones(2, 3, 5, dtype=torch.bool))
    with pytest.raises(TypeError, match="torch.bool"):
        normscope.InstanceNorm1d(3)(x, torch.ones(2, 5))
    with pytest.raises(ValueError, match="channel_dim"):
        normscope.BatchNorm1d(3, channel_dim=0)


def test_channels_last_batchnorm1d():
    x = torch.randn(4, 9, 6)
    bn = normscope.BatchNorm1d(6, channel_dim=-1)
    ref = torch.nn.BatchNorm1d(6)
    y = bn(x)
    assert normscope.last_backend() == "aten"
    torch.testing.assert_close(y, ref(x.transpose(1, 2)).transpose(1, 2), **TOL)
    torch.testing.assert_close(bn.running_var, ref.running_var)
    assert "channel_dim=-1" in repr(bn)
    assert repr(normscope.BatchNorm1d(6)) == repr(torch.nn.BatchNorm1d(6))
    assert set(bn.state_dict()) == set(ref.state_dict())
    bn.eval(), ref.eval()
    torch.testing.assert_close(bn(x), ref(x.transpose(1, 2)).transpose(1, 2), **TOL)
    with pytest.raises(ValueError, match="channels at dim -1"):
        bn(torch.randn(4, 6, 9))


def test_masked_large_offset_and_broadcast_mask(backend):
    # two-pass variance on valid elements: mean 1e4, std 1e-2 in fp32 still normalizes to unit variance
    x = torch.randn(6, 3, 50) * 1e-2 + 1e4
    mask = _mask(6, 50)
    y = normscope.BatchNorm1d(3, eps=1e-12)(x, mask)
    yv = y.transpose(1, 2)[mask]
    torch.testing.assert_close(yv.var(0, unbiased=False), torch.ones(3), atol=1e-3, rtol=1e-3)
    # a mask broadcast over a reduced axis counts that axis' elements (same as the expanded mask)
    x = torch.randn(2, 3, 5, dtype=torch.float64)
    m = _mask(2, 1, 5)
    torch.testing.assert_close(
        normscope.normalize(x, dims=(1, 2), mask=m), normscope.normalize(x, dims=(1, 2), mask=m.expand(2, 3, 5))
    )
    xv = x[0][:, m[0, 0]]
    want = (xv - xv.mean()) / torch.sqrt(xv.var(unbiased=False) + 1e-5)
    torch.testing.assert_close(normscope.normalize(x, dims=(1, 2), mask=m)[0][:, m[0, 0]], want)


def test_unbatched_instance_norm_mask_and_eval_batchnorm_on_aten():
    x = torch.randn(3, 7)
    mask = _mask(7)
    y = normscope.InstanceNorm1d(3)(x, mask)
    xv = x[:, mask]
    want = (xv - xv.mean(1, keepdim=True)) / torch.sqrt(xv.var(1, unbiased=False, keepdim=True) + 1e-5)
    torch.testing.assert_close(y[:, mask], want)
    bn = normscope.BatchNorm1d(3).eval()
    bn(torch.randn(2, 3, 7), _mask(2, 7))
    assert normscope.last_backend() == "aten"  # running statistics: the mask changes nothing
