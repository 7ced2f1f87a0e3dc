"""The rows backend (normscope.backends.rows; its RMSNorm rows in backends.rms): one reduction each way, closed form.

Every output and gradient is compared with float64 (torch's own ``F.rms_norm`` run in float64 -- an
independent computation) and with torch at the same dtype: the error against float64 may be at most
about twice torch's own (the flash-attention criterion), plus a small floor.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as tF

import normscope
import normscope.functional as F
from normscope import engine
from normscope.backends import aten, rms
from normscope.scope import Scope

FLOOR = {torch.float32: 1e-6, torch.float64: 1e-12, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def _run(fn, x, w, gy):
    xi = x.detach().clone().requires_grad_()
    wi = None if w is None else w.detach().clone().requires_grad_()
    y = fn(xi, wi)
    y.backward(gy.to(y.dtype))
    return y.detach(), xi.grad, None if wi is None else wi.grad


def _check_against_fp64_and_torch(x, w, k, eps=1e-6, fn=None):
    shape = tuple(x.shape[-k:])
    g = torch.Generator().manual_seed(7)
    gy = torch.randn(x.shape, generator=g, dtype=torch.float64)
    fn = fn or (lambda xi, wi: F.rms_norm(xi, shape, wi, eps, backend="rows"))
    ours = _run(fn, x, w, gy)
    assert normscope.last_backend() == "rows"
    theirs = _run(lambda xi, wi: tF.rms_norm(xi, shape, wi, eps), x, w, gy)
    exact = _run(lambda xi, wi: tF.rms_norm(xi, shape, wi, eps), x.double(), None if w is None else w.double(), gy)
    for name, o, t, e in zip(("y", "dx", "dw"), ours, theirs, exact):
        if e is None:
            assert o is None and t is None
            continue
        assert o.dtype == t.dtype and o.shape == t.shape, name
        err = (o.double() - e).abs().max().item() if e.numel() else 0.0
        ref_err = (t.double() - e).abs().max().item() if e.numel() else 0.0
        scale = e.abs().max().item() if e.numel() else 1.0
        assert err <= 2 * ref_err + FLOOR[x.dtype] * max(scale, 1.0), (name, err, ref_err)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("shape,k", [((4, 64), 1), ((3, 7, 127), 1), ((1, 1), 1), ((5, 3, 11), 2), ((257, 33), 1)])
@pytest.mark.parametrize("affine", [True, False], ids=["weight", "no_weight"])
def test_matches_float64_and_torch(dtype, shape, k, affine):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(shape, generator=g) * 3).to(dtype)
    w = (torch.randn(shape[-k:], generator=g)).to(dtype) if affine else None
    _check_against_fp64_and_torch(x, w, k)


def test_large_offset_and_large_rows():
    # no mean is subtracted, so a large offset is a large root mean square; rows longer than a
    # BLAS block and an offset of 1e4 must still give torch's numbers
    g = torch.Generator().manual_seed(1)
    x = 1e4 + 1e-2 * torch.randn(16, 5000, generator=g)
    w = torch.randn(5000, generator=g)
    _check_against_fp64_and_torch(x, w, 1)


def test_fp32_weight_with_bf16_input_and_non_contiguous_input():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(64, 48, generator=g).to(torch.bfloat16).t()  # (48, 64), transposed strides
    w = torch.randn(64, generator=g)  # fp32 weight on bf16 input: torch's rms_norm accepts any dtype
    _check_against_fp64_and_torch(x, w, 1)


def test_inner_axis_scope():
    # RMS over axis 0 of (5, 6): the reduced axis is moved last (a view), normalized, moved back
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 6, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(5, generator=g, dtype=torch.float64, requires_grad=True)
    y = normscope.normalize(x, dims=0, centered=False, weight=w, eps=1e-6, backend="rows")
    assert normscope.last_backend() == "rows"
    expected = x * torch.rsqrt(x.pow(2).mean(0, keepdim=True) + 1e-6) * w.view(5, 1)
    torch.testing.assert_close(y, expected)
    gy = torch.randn(5, 6, dtype=torch.float64, generator=g)
    got = torch.autograd.grad(y, (x, w), gy)
    want = torch.autograd.grad(expected, (x, w), gy)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


def test_empty_input():
    x = torch.randn(0, 64, requires_grad=True)
    w = torch.ones(64, requires_grad=True)
    y = F.rms_norm(x, (64,), w, 1e-6, backend="rows")
    assert y.shape == (0, 64)
    y.sum().backward()
    assert x.grad.shape == (0, 64)
    torch.testing.assert_close(w.grad, torch.zeros(64))


@pytest.mark.parametrize("affine", [True, False])
def test_gradcheck_and_double_backward(affine):
    g = torch.Generator().manual_seed(4)
    x = torch.randn(3, 7, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(7, generator=g, dtype=torch.float64, requires_grad=True) if affine else None
    inputs = (x, w) if affine else (x,)

    def fn(*args):
        return F.rms_norm(args[0], (7,), args[1] if affine else None, 1e-5, backend="rows")

    assert torch.autograd.gradcheck(fn, inputs)
    assert torch.autograd.gradgradcheck(fn, inputs)
    # and the second derivative is torch's
    gy = torch.randn(3, 7, generator=g, dtype=torch.float64)
    dx = torch.autograd.grad(fn(*inputs), x, gy, create_graph=True)[0]
    dx_t = torch.autograd.grad(tF.rms_norm(x, (7,), w, 1e-5), x, gy, create_graph=True)[0]
    torch.testing.assert_close(dx, dx_t)
    torch.testing.assert_close(torch.autograd.grad(dx.sum(), x)[0], torch.autograd.grad(dx_t.sum(), x)[0])


def test_no_grad_forward_matches():
    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(6, 33, generator=g), torch.randn(33, generator=g)
    with torch.no_grad():
        y = F.rms_norm(x, (33,), w, 1e-6, backend="rows")
    torch.testing.assert_close(y, tF.rms_norm(x, (33,), w, 1e-6))


def test_vmap_runs_the_reference():
    x = torch.randn(4, 3, 16, dtype=torch.float64)
    y = torch.func.vmap(lambda t: F.rms_norm(t, (16,), None, 1e-6, backend="rows"))(x)
    assert normscope.last_backend() == "reference"
    torch.testing.assert_close(y, tF.rms_norm(x, (16,), None, 1e-6))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("no_grad", [False, True])
def test_forward_mode_ad_matches_torch(dtype, no_grad):
    # a dual tensor (torch.autograd.forward_ad) reached the rows' autograd.Function, which has no jvp,
    # or under no_grad their out= ops: NotImplementedError where torch's rms_norm gives the tangent.
    # Forced here; automatically the rows take RMSNorm from rms.MIN_AUTO_ELEMENTS elements
    import torch.autograd.forward_ad as fwAD

    g = torch.Generator().manual_seed(6)
    x, v, w = (torch.randn(s, generator=g).to(dtype) for s in ((6, 33), (6, 33), (33,)))
    w.requires_grad_()
    got, want = [], []
    for out, fn in (
        (got, lambda t: F.rms_norm(t, (33,), w, 1e-6, backend="rows")),
        (want, lambda t: tF.rms_norm(t, (33,), w, 1e-6)),
    ):
        with fwAD.dual_level(), torch.set_grad_enabled(not no_grad):
            out.extend(fwAD.unpack_dual(fn(fwAD.make_dual(x, v)))[:2])
    assert got[1] is not None
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_torch_compile_fullgraph():
    g = torch.Generator().manual_seed(6)
    x = torch.randn(8, 32, generator=g)
    w = torch.randn(32, generator=g)

    def fn(xi, wi):
        return F.rms_norm(xi, (32,), wi, 1e-6, backend="rows")

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    got = _run(compiled, x, w, torch.ones(8, 32))
    want = _run(lambda xi, wi: tF.rms_norm(xi, (32,), wi, 1e-6), x, w, torch.ones(8, 32))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


def test_automatic_choice_follows_the_measured_size():
    # below rms.MIN_AUTO_ELEMENTS torch's op runs; from it on, the rows backend (the committed
    # measurement is benchmarks/results/cpu_speed.json); a forced "aten" stays torch's op
    small = torch.randn(2, 64)
    F.rms_norm(small, (64,))
    assert normscope.last_backend() == "aten"
    rows = -(-rms.MIN_AUTO_ELEMENTS // 128)
    large = torch.randn(rows, 128)
    F.rms_norm(large, (128,))
    assert normscope.last_backend() == "rows"
    F.rms_norm(large, (128,), backend="aten")
    assert normscope.last_backend() == "aten"
    # the choice is the rows backend's own, ahead of aten in the one declared order (no veto of aten's)
    from normscope.backends import rows as rows_backend

    assert rows_backend.why_not_auto is rows_backend.BACKEND.why_not_auto
    assert normscope.backends().index("rows") < normscope.backends().index("aten")
    assert (
        aten.BACKEND.why_not_auto(engine.Call(large, Scope.rms(1).resolve(large.shape), None, None, 1e-6, None, None))
        is None
    )


# Block by block (rms.BLOCK_ELEMENTS): fp16/bf16 always, fp32/fp64 (both ways) from
# rms.BLOCKED_BYTES. Shrinking both makes small inputs take many blocks, a ragged last one
# included (257 rows in blocks of 3), and blocks of one row when a row exceeds a block.
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("block", [100, 8])
@pytest.mark.parametrize("affine", [True, False], ids=["weight", "no_weight"])
def test_blocks_match_float64_and_torch(monkeypatch, dtype, block, affine):
    monkeypatch.setattr(rms, "BLOCK_ELEMENTS", block)
    monkeypatch.setattr(rms, "BLOCKED_BYTES", 0)
    g = torch.Generator().manual_seed(8)
    x = (torch.randn(257, 33, generator=g) * 3).to(dtype)
    w = torch.randn(33, generator=g).to(dtype) if affine else None
    _check_against_fp64_and_torch(x, w, 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blocks_with_one_gradient_and_an_expanded_output_gradient(monkeypatch, dtype):
    # only dx or only dw wanted, and dy = ones expanded (stride 0, from y.sum()), block by block
    monkeypatch.setattr(rms, "BLOCK_ELEMENTS", 100)
    monkeypatch.setattr(rms, "BLOCKED_BYTES", 0)
    g = torch.Generator().manual_seed(9)
    x = (torch.randn(70, 40, generator=g) * 2).to(dtype)
    w = torch.randn(40, generator=g).to(dtype)
    for wants in ("x", "w"):
        grads = {}
        for name, backend in (("ours", "rows"), ("torch", "aten")):
            xi, wi = x.clone().requires_grad_(wants == "x"), w.clone().requires_grad_(wants == "w")
            y = F.rms_norm(xi, (40,), wi, 1e-6, backend=backend)
            assert normscope.last_backend() == backend
            grads[name] = torch.autograd.grad(y.sum(), xi if wants == "x" else wi)[0]
        xd, wd = x.double().requires_grad_(wants == "x"), w.double().requires_grad_(wants == "w")
        e = torch.autograd.grad(tF.rms_norm(xd, (40,), wd, 1e-6).sum(), xd if wants == "x" else wd)[0]
        o, t = grads["ours"], grads["torch"]
        assert o.dtype == t.dtype == dtype and o.shape == t.shape
        err, ref_err = (o.double() - e).abs().max().item(), (t.double() - e).abs().max().item()
        assert err <= 2 * ref_err + FLOOR[dtype] * max(e.abs().max().item(), 1.0), (wants, err, ref_err)


def test_bf16_large_enough_for_several_default_blocks():
    # the default block size on a bf16 input of 2.5 blocks (and the fp32 whole-input backward beside it)
    n = 1024
    rows = 5 * rms.BLOCK_ELEMENTS // (2 * n)
    g = torch.Generator().manual_seed(10)
    for dtype in (torch.bfloat16, torch.float32):
        x = (torch.randn(rows, n, generator=g) + 0.5).to(dtype)
        w = torch.randn(n, generator=g).to(dtype)
        _check_against_fp64_and_torch(x, w, 1)


@pytest.mark.parametrize("rows", [8192, 8192 + 37])
def test_weight_gradient_over_many_rows_is_as_accurate_as_torch(rows):
    # dw sums over every row: one long matrix-vector product accumulates them one after another (an
    # error growing with the row count, ~10x torch's here); rms sums groups of rows, then the groups
    g = torch.Generator().manual_seed(11)
    x = torch.randn(rows, 8, generator=g) + 0.5
    w = torch.randn(8, generator=g)
    _check_against_fp64_and_torch(x, w, 1)


@pytest.mark.parametrize("rows", [1024, 2048])
def test_gradients_no_further_from_float64_than_torch(rows):
    # the rows backend (automatic from 1024 x 1024 on CPU) against float64, beside torch's own op:
    # output, input gradient and weight gradient each no further than torch's (relative norm error)
    g = torch.Generator().manual_seed(rows)
    n = 1024
    x, w, dy = (torch.randn(s, generator=g) for s in ((rows, n), (n,), (rows, n)))

    def run(fn, x, w):
        x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = fn(x, w)
        y.backward(dy.to(y.dtype))
        return y.detach(), x.grad, w.grad

    exact = run(lambda a, b: tF.rms_norm(a, (n,), b, 1e-6), x.double(), w.double())
    theirs = run(lambda a, b: tF.rms_norm(a, (n,), b, 1e-6), x, w)
    ours = run(lambda a, b: normscope.functional.rms_norm(a, (n,), b, 1e-6), x, w)
    assert normscope.last_backend() == "rows"
    for name, o, t, e in zip(("output", "dx", "dw"), ours, theirs, exact):
        err_o = float((o.double() - e).norm() / e.norm())
        err_t = float((t.double() - e).norm() / e.norm())
        assert err_o <= err_t, f"{name}: normscope {err_o:.3e} vs torch {err_t:.3e} from float64"


def test_float64_weight_on_float32_input_runs_torchs_op_even_after_a_float32_weights_plan():
    # torch multiplies by an fp64 weight in fp64 (then rounds to the input's fp32): the rows path,
    # whose products are in the input's accumulation dtype, declines such a weight and the automatic
    # choice runs torch's op -- also where a plan for an fp32 weight of the same shape exists (plans
    # are keyed on the parameters' dtypes: that plan would multiply in fp32, other bits)
    g = torch.Generator().manual_seed(3)
    n, rows = 1024, 1024  # 1 M elements: the rows path's own size
    x, dy = torch.randn(rows, n, generator=g), torch.randn(rows, n, generator=g)
    F.rms_norm(x, (n,), torch.randn(n, generator=g), 1e-6)
    assert normscope.last_backend() == "rows"
    w = torch.randn(n, generator=g, dtype=torch.float64)
    ours, theirs = w.clone().requires_grad_(), w.clone().requires_grad_()
    y = F.rms_norm(x, (n,), ours, 1e-6)
    assert normscope.last_backend() == "aten"
    y.backward(dy)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch: "Mismatch dtype between input and weight"
        y_t = tF.rms_norm(x, (n,), theirs, 1e-6)
    y_t.backward(dy)
    assert torch.equal(y, y_t) and torch.equal(ours.grad, theirs.grad) and ours.grad.dtype == torch.float64
    with normscope.use_backend("rows"), pytest.raises(ValueError, match="a weight of the input's dtype"):
        F.rms_norm(x, (n,), w, 1e-6)


def test_the_rows_backend_is_forced_by_its_name_and_refuses_what_it_does_not_run():
    x, w = torch.randn(6, 33), torch.randn(33)
    with normscope.use_backend("rows"):
        y = F.rms_norm(x, (33,), w, 1e-6)
    assert normscope.last_backend() == "rows"
    assert torch.equal(y, tF.rms_norm(x, (33,), w, 1e-6))  # torch's bits, row by row
    with normscope.use_backend("rows"), pytest.raises(ValueError, match="rows backend runs unmasked RMS scopes"):
        F.layer_norm(x, (33,), w)  # centered: not an RMS scope
    mask = torch.rand(6, 33) > 0.5
    with pytest.raises(ValueError, match="rows backend runs unmasked RMS scopes"):
        normscope.normalize(x, dims=-1, centered=False, mask=mask, backend="rows")
    with pytest.raises(ValueError, match="rows backend runs unmasked RMS scopes.*grouped axes"):
        normscope.normalize(torch.randn(2, 6, 4), keep=0, groups=2, centered=False, backend="rows")
    # the unmasked RMS scope is the rows backend's: composite, forced, says where it runs
    with pytest.raises(ValueError, match="masked scopes only.*rows backend for RMS scopes"):
        F.rms_norm(x, (33,), w, 1e-6, backend="composite")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape,k", [((6, 5, 64), 1), ((4, 8, 16), 2)])
@pytest.mark.parametrize("casting", ["torch", "llama"])
def test_input_gradient_is_the_buffer_the_backward_wrote(monkeypatch, dtype, shape, k, casting):
    # Peak memory: autograd adds the two gradient terms of the input in place and takes the sum as
    # .grad only when it holds each term's storage alone; a returned view makes it allocate a third
    # full-size tensor (fp32 RMSNorm(4096) on 8192 rows: +552 MiB of peak rather than +424).
    written = []
    real = rms._backward

    def spy(*args, **kwargs):
        out = real(*args, **kwargs)
        written.extend(t.data_ptr() for t in out[:2] if t is not None)
        return out

    monkeypatch.setattr(rms, "_backward", spy)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(shape, generator=g).to(dtype).requires_grad_()
    w = torch.randn(shape[-k:], generator=g).to(dtype).requires_grad_()
    gy = torch.randn(shape, generator=g).to(dtype)
    F.rms_norm(x, shape[-k:], w, 1e-6, backend="rows", casting=casting).backward(gy)
    assert normscope.last_backend() == "rows" and written
    assert x.grad.data_ptr() in written, "autograd copied the input gradient"
    xt, wt = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    if casting == "torch":
        tF.rms_norm(xt, shape[-k:], wt, 1e-6).backward(gy)
    else:  # Llama's order: normalized in fp32, rounded to x's dtype, then the weight's product
        x32 = xt.float()
        dims = tuple(range(-k, 0))
        (wt * (x32 * torch.rsqrt(x32.pow(2).mean(dims, keepdim=True) + 1e-6)).to(dtype)).backward(gy)
    assert torch.equal(x.grad, xt.grad)


@pytest.mark.parametrize("dtype,wdtype", [(torch.bfloat16,) * 2, (torch.float16,) * 2, (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("block", [None, 100])
def test_llama_order_by_blocks_output_input_and_scale_gradients(monkeypatch, dtype, wdtype, block):
    # Llama's order on the rows path, the default blocks and blocks of 3 rows (a ragged last one):
    # y and dx bitwise the formula's (autograd through it), the scale's gradient within a few
    # roundings of its exact value -- the float64 sum of dy * the rounded normalized value
    if block is not None:
        monkeypatch.setattr(rms, "BLOCK_ELEMENTS", block)
    g = torch.Generator().manual_seed(12)
    x = (torch.randn(257, 33, generator=g) * 3).to(dtype).requires_grad_()
    w = (1 + 0.1 * torch.randn(33, generator=g)).to(wdtype).requires_grad_()
    gy = torch.randn(257, 33, generator=g).to(torch.promote_types(dtype, wdtype))
    y = F.rms_norm(x, (33,), w, 1e-6, backend="rows", casting="llama")
    assert normscope.last_backend() == "rows"
    y.backward(gy)
    xt, wt = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    x32 = xt.float()
    rounded = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
    expected = wt * rounded
    expected.backward(gy)
    assert y.dtype == expected.dtype and torch.equal(y, expected)
    assert torch.equal(x.grad, xt.grad)
    exact = (gy.double() * rounded.detach().double()).sum(0)
    err = (w.grad.double() - exact).abs().max().item()
    ulp = torch.finfo(wdtype).eps * exact.abs().max().item()
    assert err <= 2 * ulp, (err, ulp)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout,casting", [("last axis", "torch"), ("last axis", "llama"), ("inner axis", "torch")])
def test_saved_tensor_hooks_pack_no_view_beside_its_base(dtype, layout, casting):
    """Activation offloading (``save_on_cpu``) packs every saved tensor: the rows path saves each storage
    once -- its rows, where they are a view of the input, are rebuilt in the backward, not packed a
    second time (they were: 2.1x the input's bytes in fp32) -- and the gradients are torch's."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 6, 64, generator=g, dtype=torch.float64).to(dtype)
    # inner axis: RMS over axis 1 of a transposed (8, 64, 6) leaf, whose moved rows are a view of it too
    x = (x.transpose(1, 2) if layout == "inner axis" else x).requires_grad_()
    w0 = (torch.randn(64, generator=g, dtype=torch.float64) * 0.1 + 1).to(dtype)
    w = w0.clone().requires_grad_()
    storages = []

    def pack(t):
        storages.append(t.untyped_storage().data_ptr())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        if layout == "inner axis":
            y = normscope.normalize(x, dims=1, centered=False, weight=w, eps=1e-6, backend="rows")
        else:
            y = F.rms_norm(x, 64, w, 1e-6, casting=casting, backend="rows")
    assert normscope.last_backend() == "rows"
    dy = torch.randn(y.shape, generator=g, dtype=torch.float64).to(y.dtype)
    got = torch.autograd.grad(y, (x, w), dy)
    assert len(storages) == len(set(storages)), f"a storage packed twice: {storages}"
    xr, wr = x.detach().clone().requires_grad_(), w0.clone().requires_grad_()
    xm = xr.movedim(1, -1) if layout == "inner axis" else xr
    if casting == "llama":  # transformers' LlamaRMSNorm: normalized in fp32, rounded, then scaled
        x32 = xm.float()
        yr = wr * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
    else:
        yr = tF.rms_norm(xm, (64,), wr, 1e-6)
    yr = yr.movedim(-1, 1) if layout == "inner axis" else yr
    expected = torch.autograd.grad(yr, (xr, wr), dy)
    if layout == "last axis":
        assert torch.equal(got[0], expected[0])  # dense rows in place: a row's input gradient is torch's bits
    else:  # torch's op on the moved (strided) view reduces in its own order
        torch.testing.assert_close(got[0], expected[0])
    tol = {} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(got[1], expected[1], **tol)  # the weight's: the rows summed in another order
