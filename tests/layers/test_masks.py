"""Masked normalization: a masked layer equals the unmasked layer applied to the valid elements
alone (outputs, running statistics and every gradient), and padding has no influence.
TestHostile: padding that holds inf, NaN or values too large to square, and hostile layouts."""

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


HOSTILE_TOL = dict(atol=3e-5, rtol=3e-5)

C = 6


def _valid_mask(n: int, *rest: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    m = torch.rand(n, *rest, generator=g) > 0.35
    m.view(n, -1)[:, 0] = True  # every sample has a valid position
    m.view(n, -1)[:, -1] = False  # and a padded one
    return m


# layer kind -> (constructor, input shape (channels at dim 1 unless channel_dim=-1), channel_dim)
LAYERS = {
    "bn1d": (lambda: normscope.BatchNorm1d(C, momentum=0.3), (4, C, 7), 1),
    "bn1d_bsd": (lambda: normscope.BatchNorm1d(C, channel_dim=-1, momentum=0.3), (4, 7, C), -1),
    "bn2d": (lambda: normscope.BatchNorm2d(C, momentum=0.3), (3, C, 4, 3), 1),
    "in1d": (lambda: normscope.InstanceNorm1d(C, affine=True), (4, C, 7), 1),
    "in2d": (lambda: normscope.InstanceNorm2d(C, affine=True, track_running_stats=True), (3, C, 4, 3), 1),
    "gn3": (lambda: normscope.GroupNorm(3, C), (4, C, 7), 1),
    "gn1_ln": (lambda: normscope.GroupNorm(1, C), (3, C, 4, 3), 1),  # masked LayerNorm over (C, *)
}


def _layer(kind: str, seed: int = 1) -> torch.nn.Module:
    layer = LAYERS[kind][0]()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(C, generator=g) + 1)
        layer.bias.copy_(torch.randn(C, generator=g))
    return layer


def _canonical(t: torch.Tensor, channel_dim: int) -> torch.Tensor:
    """(N, C, *) or (N, *, C) -> (N, C, L)."""
    if channel_dim == -1:
        t = t.movedim(-1, 1)
    return t.reshape(t.shape[0], t.shape[1], -1)


def oracle(kind, x, mask, weight, bias, g, eps=1e-5):
    """Float64, valid elements only, by plain indexing: outputs at valid positions (N, C, L) (NaN at
    padded ones), gradients of ``sum(y_valid * g_valid)`` for x (N, C, L), weight and bias, and the
    biased/unbiased per-channel variance pair for BatchNorm's running update."""
    channel_dim = LAYERS[kind][2]
    x = _canonical(x.detach().double(), channel_dim).clone().requires_grad_()
    g = _canonical(g.double(), channel_dim)
    m = mask.reshape(mask.shape[0], -1)
    w = weight.detach().double().clone().requires_grad_()
    b = bias.detach().double().clone().requires_grad_()
    n = x.shape[0]
    y = torch.full(x.shape, float("nan"), dtype=torch.float64)
    loss = torch.zeros((), dtype=torch.float64)
    stats = {}

    def norm(vals, chans):  # vals: (len(chans), k) valid values of one scope
        mean = vals.mean()
        var = ((vals - mean) ** 2).mean()
        return (vals - mean) / torch.sqrt(var + eps) * w[chans, None] + b[chans, None], mean, var

    if kind.startswith("bn"):
        xv = x.transpose(1, 2)[m]  # (K, C)
        for c in range(C):
            yc, mean, var = norm(xv[:, c][None], [c])
            k = xv.shape[0]
            stats[c] = (mean.detach(), var.detach() * k / (k - 1))
            loss = loss + (yc[0] * g.transpose(1, 2)[m][:, c]).sum()
            y.transpose(1, 2)[m, c] = yc[0].detach()
    else:
        per = 1 if kind.startswith("in") else C // (3 if kind == "gn3" else 1)
        for i in range(n):
            for c0 in range(0, C, per):
                chans = list(range(c0, c0 + per))
                yc, _, _ = norm(x[i, c0 : c0 + per][:, m[i]], chans)
                loss = loss + (yc * g[i, c0 : c0 + per][:, m[i]]).sum()
                y[i, c0 : c0 + per, m[i]] = yc.detach()
    loss.backward()
    return y, x.grad, w.grad, b.grad, stats


def _hostile(x: torch.Tensor, mask: torch.Tensor, channel_dim: int, values) -> torch.Tensor:
    """x with the padded positions (all channels) cycling through ``values``."""
    x = x.clone()
    xc = x.movedim(channel_dim, -1)  # (..., C) view
    pad = xc[~mask]  # (P, C)
    vals = torch.tensor(values, dtype=x.dtype)
    pad[:] = vals[torch.arange(pad.numel()) % len(vals)].view(pad.shape)
    xc[~mask] = pad
    return x


def _check(kind, layer, x, mask, pad_values):
    channel_dim = LAYERS[kind][2]
    xh = _hostile(x, mask, channel_dim, pad_values).requires_grad_()
    y = layer(xh, mask)
    assert y.requires_grad, "the output lost its graph: training would get no gradient"
    backend = normscope.last_backend()
    mask_c = mask.unsqueeze(channel_dim if channel_dim == 1 else -1).expand_as(y)
    gen = torch.Generator().manual_seed(3)
    g = torch.randn(y.shape, generator=gen)
    (torch.where(mask_c, y, 0) * g).sum().backward()
    y64, gx64, gw64, gb64, stats = oracle(kind, x, mask, layer.weight, layer.bias, g)
    yc, gxc = _canonical(y.detach(), channel_dim), _canonical(xh.grad, channel_dim)
    valid = _canonical(mask_c, channel_dim)
    torch.testing.assert_close(yc[valid], y64[valid].float(), **HOSTILE_TOL)
    assert torch.isfinite(xh.grad).all() and torch.isfinite(layer.weight.grad).all()
    torch.testing.assert_close(gxc[valid], gx64[valid].float(), **HOSTILE_TOL)
    assert torch.count_nonzero(gxc[~valid]) == 0, "padded inputs must get exactly zero gradient"
    torch.testing.assert_close(layer.weight.grad, gw64.float(), **HOSTILE_TOL)
    torch.testing.assert_close(layer.bias.grad, gb64.float(), **HOSTILE_TOL)
    if kind.startswith("bn"):
        mom = layer.momentum
        want_m = torch.stack([s[0] for s in stats.values()]) * mom
        want_v = (1 - mom) + torch.stack([s[1] for s in stats.values()]) * mom
        torch.testing.assert_close(layer.running_mean, want_m.float(), **HOSTILE_TOL)
        torch.testing.assert_close(layer.running_var, want_v.float(), **HOSTILE_TOL)
    return y, backend


INF, NAN = float("inf"), float("nan")

PADDINGS = {
    "inf": [INF],
    "-inf": [-INF],
    "nan": [NAN],
    "mixed": [INF, NAN, -INF, 3.0],
    "huge": [3e38, -3e38],  # finite, but its square overflows fp32
    "finite": [1e3, -7.0],
}

LAYOUTS = {
    "transposed": lambda shape: torch.randn(shape[0], *shape[2:], shape[1]).movedim(-1, 1),
    "channels_last": lambda shape: torch.randn(shape).to(memory_format=torch.channels_last),
}

NON_CONTIGUOUS = [("transposed", k) for k in ("bn1d", "bn2d", "in1d", "in2d", "gn3", "gn1_ln")]

NON_CONTIGUOUS += [("channels_last", k) for k in ("bn2d", "in2d", "gn1_ln")]  # 4-D only


# -- the PowerNorm authors' MaskBatchNorm, its semantics restated in float64 ---------------------


def mask_batchnorm(x, pad_mask, weight, bias, eps):
    """MaskBatchNorm.forward in training for x (T, B, C), pad_mask (B, T) True = padding: sum and
    square-sum over ``x[~pad_mask.T]``, biased variance, ``inv_std = clamp(var, eps) ** -0.5``, every
    position normalized with them."""
    valid = x[~pad_mask.transpose(0, 1)]  # (K, C)
    k = valid.shape[0]
    s, ss = valid.sum(0), (valid**2).sum(0)
    mean = s / k
    var = (ss - s * mean) / k
    inv_std = var.clamp(eps) ** -0.5
    return (x - mean) * (inv_std * weight) + bias


# -- the other layers taking a mask: BatchRenorm, PowerNorm, SyncBatchNorm (one process) -------------

def _padding_has_no_influence(make, shape, channel_dim, padding):
    """The same layer on the input with zero padding and with hostile padding: equal valid outputs,
    gradients, parameter gradients and state; padded inputs get no gradient."""
    torch.manual_seed(0)
    x = torch.randn(shape) * 2 + 1
    n = shape[0]
    mask = _valid_mask(n, *(shape[1:-1] if channel_dim == -1 else shape[2:]))
    results = []
    for values in ([0.0], PADDINGS[padding]):
        torch.manual_seed(1)
        layer = make()
        with torch.no_grad():
            for p in layer.parameters():
                p.add_(torch.randn_like(p) * 0.3)
        xh = _hostile(x, mask, channel_dim, values).requires_grad_()
        y = layer(xh, mask)
        mask_c = mask.unsqueeze(channel_dim if channel_dim == 1 else -1).expand_as(y)
        g = torch.randn(y.shape, generator=torch.Generator().manual_seed(3))
        (torch.where(mask_c, y, 0) * g).sum().backward()
        grads = {k: p.grad for k, p in layer.named_parameters()}
        results.append((y.detach()[mask_c], xh.grad, grads, {k: b.clone() for k, b in layer.named_buffers()}))
        assert torch.count_nonzero(xh.grad[~mask_c]) == 0
    (y0, gx0, gp0, b0), (y1, gx1, gp1, b1) = results
    torch.testing.assert_close(y1, y0)
    torch.testing.assert_close(gx1, gx0)
    for k in gp0:
        torch.testing.assert_close(gp1[k], gp0[k], msg=k)
    for k in b0:
        torch.testing.assert_close(b1[k], b0[k], msg=k)


# -- batch invariance: a masked per-sample scope alone and among other samples ------------------------

_PER_SAMPLE = {
    "gn2": lambda: normscope.GroupNorm(2, 8),
    "gn1_ln": lambda: normscope.GroupNorm(1, 8),
    "in1d": lambda: normscope.InstanceNorm1d(8, affine=True),
}


@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
@pytest.mark.parametrize("kind", sorted(_PER_SAMPLE))
def test_masked_sample_has_the_same_bits_alone_and_in_a_batch(kind, layout):
    # InstanceNorm and GroupNorm statistics are per sample: a sample's output and input gradient
    # must not depend on how many samples share the call (torch.nn's unmasked layers hold this), on
    # the automatic path (composite) as on the reference. Against the same sample run alone.
    g = torch.Generator().manual_seed(0)
    xs, dys = torch.randn(7, 8, 64, generator=g), torch.randn(7, 8, 64, generator=g)
    masks = torch.rand(7, 64, generator=g) > 0.3
    masks[:, 0] = True
    layer = _PER_SAMPLE[kind]()

    def run(b, at):
        x = xs[:b].clone()
        x[at] = xs[0]
        m, dy = masks[:b].clone(), dys[:b].clone()
        m[at], dy[at] = masks[0], dys[0]
        if layout == "transposed":
            x = x.transpose(1, 2).contiguous().transpose(1, 2)
        x.requires_grad_()
        y = layer(x, m)
        y.backward(dy)
        return y.detach()[at], x.grad[at], normscope.last_backend()

    y1, g1, backend = run(1, 0)
    assert backend == "composite"
    for b in (2, 3, 7):
        y, gx, _ = run(b, b // 2)
        assert torch.equal(y, y1), f"output of the sample differs in a batch of {b}"
        assert torch.equal(gx, g1), f"input gradient of the sample differs in a batch of {b}"


class TestHostile:
    """Masked layers against hostile padding and hostile layouts.

    The docs say padding "may hold anything". Here it holds inf, -inf, NaN and values too large to
    square in fp32, and the input comes transposed or channels_last. Every masked layer (BatchNorm,
    InstanceNorm, GroupNorm -- GroupNorm(1, C) is the masked LayerNorm over (C, *)) must give, at the
    valid positions, the output and every gradient of an independent float64 computation over the valid
    elements alone (written below with plain indexing, not with normscope), padded inputs exactly zero
    gradient when the loss reads only valid outputs, and an output that still carries its graph.

    Also compared with the PowerNorm authors' ``MaskBatchNorm`` (sIncerass/powernorm,
    ``fairseq/modules/norms/mask_powernorm.py`` / ``mask_batchnorm.py``): statistics from ``x[mask]``, every
    position normalized with them. Its semantics are restated here in float64 (not its code): equal to
    ours on finite padding; with inf padding its weight gradient is ``0 * inf = NaN``, ours stays finite
    and exact."""

    @pytest.mark.parametrize("padding", sorted(PADDINGS))
    @pytest.mark.parametrize("kind", sorted(LAYERS))
    def test_hostile_padding_exact_on_the_automatic_path(self, kind, padding):
        _, shape, channel_dim = LAYERS[kind]
        x = torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 2 + 0.5
        n = shape[0]
        mask = _valid_mask(n, *(shape[1:-1] if channel_dim == -1 else shape[2:]))
        layer = _layer(kind)
        y, backend = _check(kind, layer, x, mask, PADDINGS[padding])
        assert backend == "composite", f"padding alone must not push the call off the fast path, ran {backend}"
        # padded outputs: the valid elements' statistics applied to the padding's own values
        pad_y = _canonical(y.detach(), channel_dim).transpose(1, 2)[~mask.reshape(n, -1)]
        if padding in ("inf", "-inf", "nan"):
            assert not torch.isfinite(pad_y).any()
        if padding == "finite":
            assert torch.isfinite(pad_y).all()

    def test_infinite_padding_leaves_finite_gradients_and_none_at_the_pads(self):
        x = torch.randn(4, 6, 3)
        x[1, 4:] = float("inf")
        x.requires_grad_()
        mask = torch.ones(4, 6, dtype=torch.bool)
        mask[1, 4:] = False
        bn = normscope.BatchNorm1d(3, channel_dim=-1)
        y = bn(x, mask)
        assert y.requires_grad
        y[mask].square().sum().backward()
        assert torch.isfinite(x.grad).all() and torch.isfinite(bn.weight.grad).all()
        assert torch.count_nonzero(x.grad[~mask]) == 0

    def test_nonfinite_valid_value_keeps_the_graph(self):
        # a non-finite *valid* value: NaN statistics (torch's layers give NaN too), but still a graph
        x = torch.randn(3, C, 5)
        x[0, 2, 1] = float("inf")
        mask = torch.ones(3, 5, dtype=torch.bool)
        mask[1, 4] = False
        for layer in (normscope.BatchNorm1d(C), normscope.GroupNorm(3, C), normscope.InstanceNorm1d(C, affine=True)):
            y = layer(x.clone().requires_grad_(), mask)
            assert y.requires_grad
            assert torch.isnan(y).any()

    @pytest.mark.parametrize("layout,kind", NON_CONTIGUOUS)
    @pytest.mark.parametrize("padding", ["finite", "inf"])
    def test_non_contiguous_input(self, kind, layout, padding):
        _, shape, channel_dim = LAYERS[kind]
        torch.manual_seed(0)
        x = LAYOUTS[layout](shape)
        assert not x.is_contiguous()
        mask = _valid_mask(shape[0], *shape[2:])
        y, backend = _check(kind, _layer(kind), x, mask, PADDINGS[padding])
        assert backend == "composite"
        # same as the contiguous input, output and gradients
        layer, xc = _layer(kind), _hostile(x, mask, channel_dim, PADDINGS[padding]).contiguous().requires_grad_()
        torch.testing.assert_close(layer(xc, mask), y, equal_nan=True)
        if layout == "channels_last" and not kind.startswith("in"):
            # torch's GroupNorm and BatchNorm keep channels_last (InstanceNorm: docs/differences.md)
            assert y.is_contiguous(memory_format=torch.channels_last)

    @pytest.mark.parametrize("layout,kind", NON_CONTIGUOUS)
    @pytest.mark.parametrize("padding", ["inf", "nan", "huge"])
    def test_non_contiguous_padding_changes_no_bit(self, kind, layout, padding):
        # the same transposed / channels_last input padded with finite values and with hostile ones:
        # the valid outputs, every gradient and the running statistics are the same bits (the
        # hostile padding must not move the sums into another memory order)
        _, shape, channel_dim = LAYERS[kind]
        torch.manual_seed(0)
        base = LAYOUTS[layout](shape)
        mask = _valid_mask(shape[0], *shape[2:])
        valid = mask.unsqueeze(1).expand(base.shape)
        g = torch.randn(base.shape, generator=torch.Generator().manual_seed(5))

        def run(values):
            x = _hostile(base, mask, channel_dim, values)
            assert x.stride() == base.stride()
            x.requires_grad_()
            layer = _layer(kind)
            y = layer(x, mask)
            (torch.where(valid, y, 0) * g).sum().backward()
            return y.detach()[valid], x.grad, layer.weight.grad, layer.bias.grad, [b.clone() for b in layer.buffers()]

        want, got = run(PADDINGS["finite"]), run(PADDINGS[padding])
        for name, a, b in zip(("valid output", "input gradient", "weight gradient", "bias gradient"), want, got):
            assert torch.equal(a, b), f"{name}: {(a != b).sum().item()} elements differ with {padding} padding"
        assert torch.count_nonzero(got[1][~valid]) == 0
        assert all(torch.equal(a, b) for a, b in zip(want[4], got[4])), "running statistics"

    def test_gradient_arriving_non_contiguous(self):
        x = torch.randn(3, C, 5, requires_grad=True)
        mask = _valid_mask(3, 5)
        layer = _layer("gn3")
        y = layer(x, mask)
        g = torch.randn(3, 5, C).transpose(1, 2)  # a transposed incoming gradient
        (gx,) = torch.autograd.grad(y, x, g)
        x2 = x.detach().clone().requires_grad_()
        (gx2,) = torch.autograd.grad(layer(x2, mask), x2, g.contiguous())
        torch.testing.assert_close(gx, gx2)

    def test_double_backward_with_inf_padding(self):
        x = torch.randn(4, C, 5, dtype=torch.float64)
        mask = _valid_mask(4, 5)
        xh = _hostile(x, mask, 1, [INF, NAN]).requires_grad_()
        layer = _layer("gn3").double()
        y = layer(xh, mask)
        mask_c = mask.unsqueeze(1).expand_as(y)
        g = torch.randn(y.shape, dtype=torch.float64)
        (gx,) = torch.autograd.grad((torch.where(mask_c, y, 0) * g).sum(), xh, create_graph=True)
        (gx * gx).sum().backward()
        assert torch.isfinite(xh.grad).all() and torch.isfinite(layer.weight.grad).all()
        # the same second derivative from the finite input (padding set to 0): padding has no influence
        x0 = torch.where(mask_c, x, 0).requires_grad_()
        layer0 = _layer("gn3").double()
        y0 = layer0(x0, mask)
        (gx0,) = torch.autograd.grad((torch.where(mask_c, y0, 0) * g).sum(), x0, create_graph=True)
        (gx0 * gx0).sum().backward()
        torch.testing.assert_close(gx, gx0)
        torch.testing.assert_close(xh.grad[mask_c], x0.grad[mask_c])
        torch.testing.assert_close(layer.weight.grad, layer0.weight.grad)

    @pytest.mark.parametrize("padding", ["finite", "inf"])
    def test_matches_the_powernorm_authors_maskbatchnorm(self, padding):
        t, b = 9, 4
        x = torch.randn(t, b, C, dtype=torch.float64) * 2 + 1
        pad = ~_valid_mask(b, t)  # (B, T), True = padding, as fairseq passes it
        x[pad.transpose(0, 1)] = {"finite": 5.0, "inf": INF}[padding]
        w, bias = torch.randn(C, dtype=torch.float64), torch.randn(C, dtype=torch.float64)
        g = torch.randn(t, b, C, dtype=torch.float64) * (~pad).transpose(0, 1)[..., None]  # valid outputs only
        # MaskBatchNorm clamps var at eps where torch adds it: with a tiny eps both are 1/sqrt(var) to
        # far below fp64's comparison tolerance (eps must be > 0 for batch statistics, as in torch)
        eps = 1e-12
        ours = normscope.BatchNorm1d(C, eps=eps, channel_dim=-1).double()
        with torch.no_grad():
            ours.weight.copy_(w), ours.bias.copy_(bias)
        x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
        w2, b2 = w.clone().requires_grad_(), bias.clone().requires_grad_()
        y1 = ours(x1.transpose(0, 1), ~pad).transpose(0, 1)  # (B, T, C) with the valid mask
        y2 = mask_batchnorm(x2, pad, w2, b2, eps)
        valid = (~pad).transpose(0, 1)
        torch.testing.assert_close(y1[valid], y2[valid])
        torch.testing.assert_close(y1.isfinite(), y2.isfinite())  # padded outputs too (inf where inf)
        (torch.where(valid[..., None], y1, 0) * g).sum().backward()
        (torch.where(valid[..., None], y2, 0) * g).sum().backward()
        torch.testing.assert_close(ours.bias.grad, b2.grad)
        if padding == "finite":
            torch.testing.assert_close(y1, y2)  # padded outputs equal too
            torch.testing.assert_close(x1.grad, x2.grad)
            torch.testing.assert_close(ours.weight.grad, w2.grad)
        else:
            # theirs: the weight's gradient sums dy * (x - mean) over every position, 0 * inf = NaN,
            # and the NaN reaches every valid input through inv_std. Ours is the valid-only value:
            assert torch.isnan(w2.grad).all() and torch.isnan(x2.grad[valid]).all()
            xf = torch.where(valid[..., None], x, 0.0).requires_grad_()
            w3, b3 = w.clone().requires_grad_(), bias.clone().requires_grad_()
            y3 = mask_batchnorm(xf, pad, w3, b3, eps)
            (torch.where(valid[..., None], y3, 0) * g).sum().backward()
            torch.testing.assert_close(ours.weight.grad, w3.grad)
            torch.testing.assert_close(x1.grad, xf.grad * valid[..., None])

    # -- paths that run the reference: forced, under torch.func, under torch.compile ------------------

    @pytest.mark.parametrize("kind", ["bn1d_bsd", "in1d", "gn3"])
    def test_hostile_padding_exact_on_the_forced_reference(self, kind):
        _, shape, channel_dim = LAYERS[kind]
        x = torch.randn(shape, generator=torch.Generator().manual_seed(0))
        mask = _valid_mask(shape[0], *(shape[1:-1] if channel_dim == -1 else shape[2:]))
        with normscope.use_backend("reference"):
            _check(kind, _layer(kind), x, mask, PADDINGS["mixed"])

    @pytest.mark.parametrize("kind", ["bn1d_bsd", "in1d", "gn3"])
    def test_padding_too_large_to_normalize_on_the_forced_reference(self, kind):
        # finite padding whose normalized value overflows fp32 (+-finfo.max as a fill, rstd ~2): its output
        # is +-inf, and a zero cotangent times it made the weight gradient NaN (0 * inf) where the
        # reference forms (x - mean) * rstd before the weight (GroupNorm; BatchNorm and InstanceNorm fold
        # the weight into rstd, and their finite x - mean kept the gradient finite)
        _, shape, channel_dim = LAYERS[kind]
        x = torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 0.5
        mask = _valid_mask(shape[0], *(shape[1:-1] if channel_dim == -1 else shape[2:]))
        big = torch.finfo(torch.float32).max
        with normscope.use_backend("reference"):
            _check(kind, _layer(kind), x, mask, [big, -big])

    def test_hostile_padding_under_torch_func(self):
        # inside torch.func transforms the composite runner recomputes on the reference
        x = torch.randn(4, C, 7, generator=torch.Generator().manual_seed(0))
        mask = _valid_mask(4, 7)
        xh = _hostile(x, mask, 1, PADDINGS["mixed"])
        layer = _layer("gn3")
        g = torch.randn(4, C, 7, generator=torch.Generator().manual_seed(3))
        mask_c = mask.unsqueeze(1).expand_as(x)
        params = dict(layer.named_parameters())

        def loss(p, inp):
            y = torch.func.functional_call(layer, p, (inp, mask))
            return (torch.where(mask_c, y, 0) * g).sum()

        grads = torch.func.grad(loss, argnums=(0, 1))(params, xh)
        _, gx64, gw64, _, _ = oracle("gn3", x, mask, layer.weight, layer.bias, g)
        torch.testing.assert_close(grads[0]["weight"], gw64.float(), **HOSTILE_TOL)
        torch.testing.assert_close(grads[1][mask_c], gx64[mask_c].float(), **HOSTILE_TOL)

    @pytest.mark.parametrize("kind", ["bn1d", "in1d", "gn3"])
    def test_reference_normalize_with_hostile_padding(self, kind):
        # the oracle itself (reference.moments + reference.apply with the mask): exact, finite gradients
        from normscope import reference as ref

        x = torch.randn(4, C, 7, generator=torch.Generator().manual_seed(0))
        mask = _valid_mask(4, 7)
        xh = _hostile(x, mask, 1, PADDINGS["mixed"]).requires_grad_()
        layer = _layer(kind)
        scope = {
            "bn1d": normscope.Scope.batch(1),
            "in1d": normscope.Scope.instance(),
            "gn3": normscope.Scope.group(3),
        }[kind].resolve(tuple(x.shape))
        y = ref.normalize(xh, scope, layer.weight, layer.bias, 1e-5, mask.unsqueeze(1))
        mask_c = mask.unsqueeze(1).expand_as(y)
        g = torch.randn(y.shape, generator=torch.Generator().manual_seed(3))
        (torch.where(mask_c, y, 0) * g).sum().backward()
        y64, gx64, gw64, gb64, _ = oracle(kind, x, mask, layer.weight, layer.bias, g)
        torch.testing.assert_close(y[mask_c], y64[mask_c].float(), **HOSTILE_TOL)
        torch.testing.assert_close(xh.grad[mask_c], gx64[mask_c].float(), **HOSTILE_TOL)
        assert torch.count_nonzero(xh.grad[~mask_c]) == 0
        torch.testing.assert_close(layer.weight.grad, gw64.float(), **HOSTILE_TOL)
        torch.testing.assert_close(layer.bias.grad, gb64.float(), **HOSTILE_TOL)

    def test_syncbatchnorm_outside_a_group_with_hostile_padding(self):
        _padding_has_no_influence(lambda: normscope.SyncBatchNorm(C), (4, C, 7), 1, "mixed")

    def test_batchrenorm_with_hostile_padding(self):
        _padding_has_no_influence(lambda: normscope.BatchRenorm1d(C), (4, C, 7), 1, "mixed")

    def test_powernorm_with_hostile_padding(self):
        _padding_has_no_influence(lambda: normscope.PowerNorm(C, warmup_iters=0), (4, 7, C), -1, "mixed")


@pytest.mark.parametrize("backend_name", [None, "reference"])
def test_masked_batch_norm_under_vmap_with_a_mask_per_member(backend_name):
    # torch.func.vmap over an ensemble of batches, each with its own mask (and vmap of per-member gradients):
    # the training check for an all-False mask asked bool(mask.any()) of the batched mask, and vmap raised
    # its "data-dependent control flow" RuntimeError. The oracle: float64 masked statistics per member
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, 4, 6, generator=g, dtype=torch.float64)
    mask = torch.rand(2, 3, 6, generator=g) > 0.3
    mask[:, 0, 0] = True

    def masked_bn(xi, mi):
        m = mi[:, None, :].double()
        n = m.sum((0, 2), keepdim=True)
        mean = (xi * m).sum((0, 2), keepdim=True) / n
        var = ((xi - mean) ** 2 * m).sum((0, 2), keepdim=True) / n
        return (xi - mean) / torch.sqrt(var + 1e-5) * m

    bn = normscope.BatchNorm1d(4, track_running_stats=False).double()
    with normscope.use_backend(backend_name):
        y = torch.func.vmap(lambda xi, mi: bn(xi, mi) * mi[:, None, :])(x, mask)
        gx = torch.func.vmap(torch.func.grad(lambda xi, mi: (bn(xi, mi) ** 3 * mi[:, None, :]).sum()))(x, mask)
    want = torch.stack([masked_bn(x[i], mask[i]) for i in range(2)])
    grad_want = torch.func.grad(lambda xi, mi: (masked_bn(xi, mi) ** 3).sum())
    want_gx = torch.stack([grad_want(x[i], mask[i]) for i in range(2)])
    torch.testing.assert_close(y, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(gx, want_gx, rtol=1e-10, atol=1e-10)
