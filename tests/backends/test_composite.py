"""The composite backend (masked BatchNorm / InstanceNorm / GroupNorm from ATen ops with a closed-form
backward) against an independent float64 formula written here from the definition: outputs, every
gradient, running statistics, numerics, fallbacks and double backward."""

from __future__ import annotations

import pytest
import torch

import normscope
import normscope.functional as F
from normscope import engine

TOL64 = dict(atol=1e-10, rtol=1e-9)
TOL32 = dict(atol=2e-5, rtol=1e-5)


def _mask(*shape: int, p: float = 0.3, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    m = torch.rand(*shape, generator=g) > p
    m.view(-1)[0] = True
    return m


def formula(x, mask, keep, groups=1, weight=None, bias=None, eps=1e-5):
    """Masked normalization in float64 from the definition, differentiable.

    ``keep``: the axes whose indices get their own statistics (BatchNorm: the channel axis;
    InstanceNorm: (0, 1); GroupNorm: (0,) with ``groups`` groups of axis 1). ``mask`` broadcasts
    against ``x``; padding is replaced by 0 with torch.where before any arithmetic touches it.
    """
    x = x.double()
    shape = x.shape
    m = mask.expand(shape)
    if groups > 1:  # split axis 1 into (G, C/G); the group index is kept
        gshape = shape[:1] + (groups, shape[1] // groups) + shape[2:]
        x, m = x.reshape(gshape), m.reshape(gshape)
        keep = (0, 1)
    dims = tuple(d for d in range(x.dim()) if d not in keep)
    mf = m.double()
    n = mf.sum(dims, keepdim=True)
    xs = torch.where(m, x, torch.zeros_like(x))
    mean = xs.sum(dims, keepdim=True) / n.clamp_min(1)
    dev = torch.where(m, x - mean, torch.zeros_like(x))
    var = (dev * dev).sum(dims, keepdim=True) / n.clamp_min(1)
    rstd = torch.where(n > 0, (var + eps).rsqrt(), torch.zeros_like(var))
    y = ((x - mean) * rstd).reshape(shape)
    ch = [1] * len(shape)
    ch[1 if keep != (len(shape) - 1,) else -1] = -1
    if weight is not None:
        y = y * weight.double().reshape(ch)
    if bias is not None:
        y = y + bias.double().reshape(ch)
    return y


# (name, input shape, mask shape as given to normalize, normalize kwargs, formula kwargs)
CASES = [
    ("batch1d", (5, 6, 11), (5, 1, 11), dict(keep=1), dict(keep=(1,))),
    ("batch1d-rows", (5, 6), (5, 1), dict(keep=1), dict(keep=(1,))),
    ("batch-last", (4, 9, 6), (4, 9, 1), dict(keep=-1, affine_dims=-1), dict(keep=(2,))),
    ("batch2d", (3, 4, 5, 6), (3, 1, 5, 6), dict(keep=1), dict(keep=(1,))),
    ("batch3d", (2, 3, 3, 4, 2), (2, 1, 3, 4, 2), dict(keep=1), dict(keep=(1,))),
    ("instance1d", (4, 6, 9), (4, 1, 9), dict(keep=(0, 1)), dict(keep=(0, 1))),
    ("instance2d", (3, 5, 4, 3), (3, 1, 4, 3), dict(keep=(0, 1)), dict(keep=(0, 1))),
    ("group3", (4, 6, 9), (4, 1, 9), dict(keep=0, groups=3), dict(keep=(0,), groups=3)),
    ("group1", (4, 6, 9), (4, 1, 9), dict(keep=0), dict(keep=(0,))),
    ("group2-2d", (2, 8, 3, 5), (2, 1, 3, 5), dict(keep=0, groups=2), dict(keep=(0,), groups=2)),
    ("mask-broadcast", (4, 6, 9), (1, 1, 9), dict(keep=1), dict(keep=(1,))),
]


def _run(x, mask, kw, weight, bias, backend):
    xs = x.detach().clone().requires_grad_()
    ws = None if weight is None else weight.detach().clone().requires_grad_()
    bs = None if bias is None else bias.detach().clone().requires_grad_()
    with normscope.use_backend(backend):
        y = normscope.normalize(xs, mask=mask, weight=ws, bias=bs, **kw)
        used = normscope.last_backend()
    return y, xs, ws, bs, used


@pytest.mark.parametrize("name,shape,mshape,kw,fkw", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("affine", [True, False])
def test_matches_the_formula_with_gradients(name, shape, mshape, kw, fkw, affine):
    torch.manual_seed(0)
    x = torch.randn(shape, dtype=torch.float64) * 3 + 2
    mask = _mask(*mshape)
    c = shape[-1] if kw.get("keep") == -1 else shape[1]
    weight = torch.randn(c, dtype=torch.float64) if affine else None
    bias = torch.randn(c, dtype=torch.float64) if affine else None
    y, xs, ws, bs, used = _run(x, mask, kw, weight, bias, None)
    assert used == "composite"
    x0 = x.clone().requires_grad_()
    w0 = None if weight is None else weight.clone().requires_grad_()
    b0 = None if bias is None else bias.clone().requires_grad_()
    want = formula(x0, mask, weight=w0, bias=b0, **fkw)
    torch.testing.assert_close(y, want, **TOL64)
    # every output gets a gradient, padding included: its output depends on the statistics too
    g = torch.randn_like(want)
    y.backward(g)
    want.backward(g)
    torch.testing.assert_close(xs.grad, x0.grad, **TOL64)
    if affine:
        torch.testing.assert_close(ws.grad, w0.grad, **TOL64)
        torch.testing.assert_close(bs.grad, b0.grad, **TOL64)


@pytest.mark.parametrize("channel_dim", [1, -1])
def test_batchnorm_layer_running_stats_and_grads_equal_reference(channel_dim):
    torch.manual_seed(1)
    x = torch.randn(6, 7, 13) * 2 + 0.5
    mask = _mask(6, 13)
    if channel_dim == -1:
        x = x.transpose(1, 2).contiguous()
    a = normscope.BatchNorm1d(7, momentum=0.3, channel_dim=channel_dim)
    with torch.no_grad():
        a.weight.normal_()
        a.bias.normal_()
    b = normscope.BatchNorm1d(7, momentum=0.3, channel_dim=channel_dim)
    b.load_state_dict(a.state_dict())
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya = a(xa, mask)
    assert normscope.last_backend() == "composite"
    with normscope.use_backend("reference"):
        yb = b(xb, mask)
    torch.testing.assert_close(ya, yb, **TOL32)
    torch.testing.assert_close(a.running_mean, b.running_mean, **TOL32)
    torch.testing.assert_close(a.running_var, b.running_var, **TOL32)
    g = torch.randn_like(ya)
    ya.backward(g)
    yb.backward(g)
    for p, q in ((xa.grad, xb.grad), (a.weight.grad, b.weight.grad), (a.bias.grad, b.bias.grad)):
        torch.testing.assert_close(p, q, **TOL32)


def test_padding_gradient_reaches_valid_inputs_through_the_statistics():
    # a loss on padded outputs only: padded inputs get rstd * w * dy, valid inputs get the
    # statistics' share -- the formula's autograd decides both
    x = torch.randn(3, 4, 7, dtype=torch.float64)
    mask = _mask(3, 1, 7)
    xs = x.clone().requires_grad_()
    y = normscope.normalize(xs, keep=1, mask=mask)
    assert normscope.last_backend() == "composite"
    pad = (~mask).expand_as(y)
    (y[pad] ** 2).sum().backward()
    x0 = x.clone().requires_grad_()
    (formula(x0, mask, keep=(1,))[pad] ** 2).sum().backward()
    torch.testing.assert_close(xs.grad, x0.grad, **TOL64)
    assert xs.grad[mask.expand_as(y)].abs().max() > 0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    "kw,fkw", [(dict(keep=1), dict(keep=(1,))), (dict(keep=0, groups=2), dict(keep=(0,), groups=2))]
)
def test_half_inputs_keep_fp32_statistics(dtype, kw, fkw):
    torch.manual_seed(2)
    x = (torch.randn(4, 6, 10) * 2 + 3).to(dtype)
    mask = _mask(4, 1, 10)
    w = torch.randn(6)
    y, xs, ws, _, used = _run(x, mask, kw, w, None, None)
    assert used == "composite" and y.dtype == dtype
    want = formula(x.double(), mask, weight=w.double(), **fkw)
    # the error against fp64 is the output rounding: at most twice what rounding the exact result gives
    own = (want.to(dtype).double() - want).abs().max()
    assert (y.double() - want).abs().max() <= 2 * own + 1e-3
    g = torch.randn(y.shape).to(dtype)
    y.backward(g)
    assert xs.grad.dtype == dtype and ws.grad.dtype == torch.float32
    x0 = x.double().requires_grad_()
    formula(x0, mask, weight=w.double(), **fkw).backward(g.double())
    scale = x0.grad.abs().max()
    assert (xs.grad.double() - x0.grad).abs().max() <= 2e-2 * scale


def test_large_offset_normalizes_to_unit_variance():
    # mean 1e4, std 1e-2 in fp32: the centred tensor keeps the deviations exact, so the valid
    # outputs have unit variance (the fp32 value 1e4 + 1e-2 z is quantized to 1e-3, which the
    # formula sees too: compare against it on the same fp32 input)
    torch.manual_seed(3)
    x = torch.randn(8, 3, 64) * 1e-2 + 1e4
    mask = _mask(8, 64)
    xs = x.clone().requires_grad_()
    y = normscope.BatchNorm1d(3, eps=1e-12)(xs, mask)
    assert normscope.last_backend() == "composite"
    yv = y.transpose(1, 2)[mask]
    torch.testing.assert_close(yv.var(0, unbiased=False), torch.ones(3), atol=1e-4, rtol=1e-4)
    x0 = x.double().requires_grad_()
    want = formula(x0, mask.unsqueeze(1), keep=(1,), eps=1e-12)
    assert (y.double() - want).abs().max() < 1e-4
    # the gradient too: the first mean's fp32 rounding (here ~5% of a std) must be corrected there
    g = torch.randn(y.shape)
    y.backward(g)
    want.backward(g.double())
    assert (xs.grad.double() - x0.grad).abs().max() < 1e-4 * x0.grad.abs().max()


@pytest.mark.parametrize("garbage", [float("inf"), float("nan"), -float("inf")])
def test_non_finite_padding_stays_on_the_composite_path(garbage):
    x = torch.randn(4, 6, 8)
    mask = _mask(4, 8)
    x2 = x.clone()
    x2.transpose(1, 2)[~mask] = garbage
    y = normscope.BatchNorm1d(6)(x2, mask)
    assert normscope.last_backend() == "composite"  # statistics redone with the padding zeroed
    want = formula(x, mask.unsqueeze(1), keep=(1,))
    m = mask.unsqueeze(1).expand_as(y)
    torch.testing.assert_close(y[m].double(), want[m], **TOL32)
    # a non-finite *valid* value is what goes to the reference (NaN statistics, as torch's)
    x2.transpose(1, 2)[mask] = garbage
    normscope.BatchNorm1d(6)(x2, mask)
    assert normscope.last_backend() == "reference"


def test_empty_scopes_give_the_bias():
    x = torch.randn(3, 4, 5, dtype=torch.float64)
    bias = torch.randn(4, dtype=torch.float64)
    mask = _mask(3, 1, 5)
    mask[1] = False  # sample 1 has no valid position
    for kw in (dict(keep=(0, 1)), dict(keep=0, groups=2)):
        y = normscope.normalize(x, mask=mask, weight=torch.ones(4, dtype=torch.float64), bias=bias, **kw)
        assert normscope.last_backend() == "composite"
        torch.testing.assert_close(y[1], bias[:, None].expand(4, 5))
    # BatchNorm statistics with no valid element at all (only reachable through normalize)
    none = torch.zeros(3, 1, 5, dtype=torch.bool)
    xs = x.clone().requires_grad_()
    y = normscope.normalize(xs, keep=1, mask=none, bias=bias)
    torch.testing.assert_close(y, bias[None, :, None].expand_as(y))
    y.sum().backward()
    assert torch.count_nonzero(xs.grad) == 0


def test_double_backward_is_exact():
    torch.manual_seed(4)
    x = torch.randn(3, 4, 6, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, dtype=torch.float64, requires_grad=True)
    mask = _mask(3, 1, 6)
    with normscope.use_backend("composite"):
        f = lambda x, w: normscope.normalize(x, keep=1, mask=mask, weight=w)  # noqa: E731
        assert torch.autograd.gradgradcheck(f, (x, w))
        # first-order gradients taken with create_graph equal the closed form
        g = torch.randn(3, 4, 6, dtype=torch.float64)
        (gx1,) = torch.autograd.grad(f(x, w), x, g)
        (gx2,) = torch.autograd.grad(f(x, w), x, g, create_graph=True)
    torch.testing.assert_close(gx1, gx2, **TOL64)
    assert gx2.requires_grad


def test_non_contiguous_input_and_gradient():
    torch.manual_seed(5)
    base = torch.randn(5, 9, 6, dtype=torch.float64)
    x = base.transpose(1, 2).requires_grad_()  # (5, 6, 9), not contiguous
    mask = _mask(5, 1, 9)
    y = normscope.normalize(x, keep=1, mask=mask)
    assert normscope.last_backend() == "composite"
    g = torch.randn(5, 9, 6, dtype=torch.float64).transpose(1, 2)  # a non-contiguous dy
    y.backward(g)
    x0 = base.transpose(1, 2).clone().requires_grad_()
    formula(x0, mask, keep=(1,)).backward(g)
    torch.testing.assert_close(x.grad, x0.grad, **TOL64)


def test_declines_what_it_cannot_run():
    x = torch.randn(3, 4, 5)
    # a mask that varies along the channel axis: no per-position form; the reference runs it
    per_element = _mask(3, 4, 5)
    per_position = _mask(3, 1, 5)
    normscope.normalize(x, keep=1, mask=per_position)
    assert normscope.last_backend() == "composite"
    y = normscope.normalize(x, keep=1, mask=per_element)  # same shapes otherwise: the plan must differ
    assert normscope.last_backend() == "reference"
    torch.testing.assert_close(y.double(), formula(x, per_element, keep=(1,)), **TOL32)
    with pytest.raises(ValueError, match="varies along the channel axis"):
        normscope.normalize(x, keep=1, mask=per_element, backend="composite")
    with pytest.raises(ValueError, match="masked scopes only"):
        normscope.normalize(x, keep=1, backend="composite")
    with pytest.raises(ValueError, match="no composite form"):
        normscope.normalize(x, keep=1, centered=False, mask=per_position, backend="composite")  # RMS statistics


def test_automatic_order():
    names = normscope.backends()
    assert names.index("aten") < names.index("composite") < names.index("reference")
    assert "composite" in engine._BACKENDS


def test_torch_compile_traces_through_the_reference():
    x = torch.randn(3, 4, 6)
    mask = _mask(3, 6)
    f = lambda x: normscope.normalize(x, keep=1, mask=mask.unsqueeze(1))  # noqa: E731
    want = f(x)
    assert normscope.last_backend() == "composite"
    torch.testing.assert_close(torch.compile(f, fullgraph=True, backend="aot_eager")(x), want, **TOL32)


def test_functional_group_and_instance_norm_take_it():
    x = torch.randn(3, 4, 6)
    mask = _mask(3, 6)
    F.group_norm(x, 2, mask=mask)
    assert normscope.last_backend() == "composite"
    F.instance_norm(x, mask=mask)
    assert normscope.last_backend() == "composite"


@pytest.mark.parametrize("layout", ["contiguous", "transposed", "strided"])
def test_padding_values_change_no_valid_bit_of_a_strided_input(layout):
    """Padding of finite squares and padding whose squares overflow (the statistics then recomputed
    with it set to 0) give the valid outputs and gradients the same bits -- for a view with gaps too,
    whose two passes once summed in two layouts (1 ulp apart)."""
    torch.manual_seed(6)
    mask = _mask(3, 1, 7 * 7 * 7)
    base = torch.randn(3, 2, 2 * 7 * 7 * 7) * 100 - 1

    def padded(value):
        b = base.clone()
        b.view(3, 2, 7 * 7 * 7, 2)[..., 0][~mask.expand(3, 2, -1)] = value
        if layout == "strided":
            x = b.view(3, 2, 7, 7, 7, 2)[..., 0]  # every other element: a view with gaps
        else:
            x = b.view(3, 2, 7 * 7 * 7, 2)[..., 0].contiguous().view(3, 2, 7, 7, 7)
            x = x.transpose(2, 4).contiguous().transpose(2, 4) if layout == "transposed" else x
        return x.requires_grad_()

    m = mask.view(3, 1, 7, 7, 7)
    dy = torch.randn(3, 2, 7, 7, 7) * m  # a loss that ignores the padding
    results = []
    for value in (0.5, 1e25):  # 1e25 squared overflows fp32
        x = padded(value)
        with normscope.use_backend("composite"):
            y = F.instance_norm(x, weight=torch.ones(2), bias=torch.zeros(2), mask=m.squeeze(1))
        (g,) = torch.autograd.grad(y, (x,), dy)
        results.append((y.detach()[m.expand_as(y)], g[m.expand_as(g)]))
    (y1, g1), (y2, g2) = results
    assert torch.equal(y1, y2) and torch.equal(g1, g2)


def _rms_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).pow(2).mean().sqrt())


@pytest.mark.parametrize("op", ["instance_norm", "group_norm"])
def test_long_scopes_are_as_accurate_as_torch(op):
    # one batched GEMM summed a scope's 2^20 positions one after another: rms error 4.2e-6 of the output
    # and input gradient against float64, where torch's unmasked op has 9e-8. By blocks of SUM_BLOCK
    # positions, their sums added in float64, it is torch's order
    from normscope.backends import composite

    n = 2**20
    assert n > 4 * composite.SUM_BLOCK
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 2, n, generator=g) + 3
    dy = torch.randn(1, 2, n, generator=g)
    mask = torch.ones(1, n, dtype=torch.bool)
    if op == "instance_norm":
        ours_fn, torch_fn = (lambda t: F.instance_norm(t, mask=mask)), torch.nn.functional.instance_norm
    else:
        ours_fn, torch_fn = (lambda t: F.group_norm(t, 1, mask=mask)), (lambda t: torch.nn.functional.group_norm(t, 1))
    x64 = x.double().requires_grad_()
    want = torch_fn(x64)
    (want_g,) = torch.autograd.grad(want, x64, dy.double())
    errors = {}
    for name, fn in (("normscope", ours_fn), ("torch", torch_fn)):
        xx = x.clone().requires_grad_()
        y = fn(xx)
        (gx,) = torch.autograd.grad(y, xx, dy)
        errors[name] = (_rms_error(y, want.detach()), _rms_error(gx, want_g))
    for ours, theirs in zip(errors["normscope"], errors["torch"]):
        assert ours <= 2 * theirs + 1e-8, errors


def test_a_long_masked_scope_is_the_same_alone_and_in_a_batch():
    # the blocks of a long scope's sums depend on its own length only: a sample alone (its sums a
    # stride-0 pair, see _masked_sums) and in a batch get the same bits
    from normscope.backends import composite

    n = composite.SUM_BLOCK * 2 + 5
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 2, n, generator=g)
    mask = torch.rand(3, n, generator=g) > 0.3
    y = F.instance_norm(x, mask=mask)
    for i in range(3):
        alone = F.instance_norm(x[i : i + 1], mask=mask[i : i + 1])
        valid = mask[i].expand(2, n)
        assert torch.equal(alone[0][valid], y[i][valid])


@pytest.mark.parametrize("seed", [1, 2])
def test_weight_gradient_of_a_long_scope_is_as_accurate_as_the_references(seed):
    """Past ``composite.SUM_BLOCK`` positions a scope's ``sum(dy * xhat)`` was taken by BatchNorm's
    backward kernel, which accumulates a channel's positions one after another: masked InstanceNorm
    over 40000 fp32 positions had weight and bias gradients up to 20x the reference's error off
    float64 (7e-4 vs 3e-5). Checked against the float64 computation of the same call."""
    g = torch.Generator().manual_seed(seed)
    n = 40000
    x = torch.randn(2, 1, n, generator=g, dtype=torch.float64)
    mask = torch.rand(2, n, generator=g) < 0.3
    mask[:, 0] = True
    w, b = torch.tensor([1.2], dtype=torch.float64), torch.tensor([0.3], dtype=torch.float64)
    dy = torch.randn(2, 1, n, generator=g, dtype=torch.float64)
    grads = {}
    for backend, dtype in (("composite", torch.float32), ("reference", torch.float32), ("reference", torch.float64)):
        wt, bt = w.to(dtype).requires_grad_(), b.to(dtype).requires_grad_()
        y = F.instance_norm(x.to(dtype), None, None, wt, bt, True, 0.1, 1e-5, mask=mask, backend=backend)
        y.backward(dy.to(dtype))
        grads[backend, dtype] = (wt.grad.double(), bt.grad.double())
    truth = grads["reference", torch.float64]
    for k, name in enumerate(("weight", "bias")):
        err = (grads["composite", torch.float32][k] - truth[k]).abs().max().item()
        err_ref = (grads["reference", torch.float32][k] - truth[k]).abs().max().item()
        bound = 2 * err_ref + 8 * 2**-24 * truth[k].abs().max().item()
        assert err <= bound, f"grad of {name}: composite {err:.3g} off float64, reference {err_ref:.3g}"
