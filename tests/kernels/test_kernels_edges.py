"""Edges of the Triton door, in Triton's interpreter on CPU (as the other kernel tests): q and k
each with their own optional affine in the one-launch QK-norm, empty input through every modern
kernel op with autograd, masked BatchNorm with one valid position per channel or with padding that
holds inf, NaN or values whose normalization overflows, and the fused add's residual sum rounded
once; running buffers that are views of a larger tensor and output cotangents of any strides
(TestHostile). The oracle is the reference backend (plain PyTorch), torch.nn.functional (float64
where the kernels' numbers are compared) or torch's own add."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import TEST_DEVICE

pytest.importorskip("triton", reason="the kernel tests need Triton (pip install 'normscope[kernels]')")

import normscope  # noqa: E402
from normscope import functional as nf  # noqa: E402
from normscope import functional_modern as FM  # noqa: E402

DEV = torch.device(TEST_DEVICE)
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def _leaf(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.to(DEV).detach().requires_grad_()


def _outputs_and_grads(fn, leaves):
    outs = fn(*leaves)
    outs = outs if isinstance(outs, tuple) else (outs,)
    torch.manual_seed(5)
    cots = [torch.randn(o.shape, device=DEV, dtype=o.dtype) for o in outs]
    live = [t for t in leaves if t is not None]
    grads = torch.autograd.grad(outs, live, cots, allow_unused=True)
    return outs, grads


@pytest.mark.parametrize("given", ("q_weight", "k_weight", "q_bias", "k_bias", "q_weight k_bias"))
def test_qk_norm_with_one_side_affine(given):
    """q and k each take their own optional weight and bias: a weight on one side only is applied to
    that side (it was ignored for k alone, and raised in the kernel for q alone)."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 3, 4, 8, generator=g)
    k = torch.randn(2, 3, 2, 8, generator=g) + 1
    affine = {name: torch.randn(8, generator=g) for name in given.split()}
    norm = "layer" if "bias" in given else "rms"

    def run(backend):
        leaves = [_leaf(t) for t in (q, k, affine.get("q_weight"), affine.get("k_weight"))]
        biases = [_leaf(affine.get(n)) for n in ("q_bias", "k_bias")]

        def fn(q, k, wq, wk, bq, bk):
            return FM.qk_norm(q, k, wq, wk, norm=norm, q_bias=bq, k_bias=bk, casting="gemma", backend=backend)

        return _outputs_and_grads(fn, [*leaves, *biases])

    (yq, yk), grads = run("triton")
    assert normscope.last_backend() == "triton"
    (eq, ek), expected = run("reference")
    torch.testing.assert_close(yq, eq, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(yk, ek, rtol=1e-5, atol=1e-5)
    assert len(grads) == len(expected)
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def _modern_ops():
    """(name, fn(x, w, b) on the forced backend, the shapes of x, w, b) for the modern kernel ops."""
    return [
        ("modulated_norm", lambda x, w, b, be: FM.modulated_norm(x, b, w, backend=be), (0, 4, 8), (0, 8), (0, 8)),
        (
            "zero-centred rms_norm",
            lambda x, w, b, be: FM.rms_norm(x, 8, w, 1e-6, weight_offset=1.0, casting="gemma", backend=be),
            (0, 3, 8),
            (8,),
            None,
        ),
        (
            "qk_norm",
            lambda x, w, b, be: FM.qk_norm(x, x * 2, w, w, casting="gemma", backend=be),
            (0, 3, 2, 8),
            (8,),
            None,
        ),
        (
            "zero-centred layer_norm over rows of zero elements",  # was a RuntimeError from reshape(-1, 0)
            lambda x, w, b, be: FM.layer_norm(x, 0, w, b, weight_offset=1.0, casting="gemma", backend=be),
            (3, 0),
            (0,),
            (0,),
        ),
        ("poly_norm", lambda x, w, b, be: FM.poly_norm(x, w, b, backend=be), (0, 3, 8), (3,), (1,)),
        (
            "derf",
            lambda x, w, b, be: FM.derf(x, x.new_tensor(0.5), x.new_tensor(0.1), w, b, backend=be),
            (2, 0, 8),
            (8,),
            (8,),
        ),
    ]


@pytest.mark.parametrize("i", range(len(_modern_ops())))
def test_modern_ops_on_empty_input_keep_autograd(i):
    """An empty input gives an empty output that autograd reaches, on the kernels as on the default
    backend: the input's gradient is empty, the weights' are zeros."""
    name, fn, xs, ws, bs = _modern_ops()[i]
    g = torch.Generator().manual_seed(1)
    tensors = [None if s is None else torch.randn(s, generator=g) for s in (xs, ws, bs)]

    def run(backend):
        leaves = [_leaf(t) for t in tensors]
        return _outputs_and_grads(lambda x, w, b: fn(x, w, b, backend), leaves)

    outs, grads = run("triton")
    expected_outs, expected_grads = run(None)
    for o, e in zip(outs, expected_outs):
        assert o.shape == e.shape and o.dtype == e.dtype, name
    assert len(grads) == len(expected_grads)
    for got, want in zip(grads, expected_grads):
        assert got is not None, f"{name}: no gradient reached an input"
        torch.testing.assert_close(got, want, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("first_masked", (True, False))
def test_masked_batch_norm_with_one_valid_position_per_channel(first_masked):
    """Each channel's statistics come from one valid position (variance 0): output and every gradient
    as the reference backend's -- a masked first value must shift nothing."""
    torch.manual_seed(3)
    x = torch.randn(2, 3, 4) * 3 + 5
    w, b = torch.randn(3), torch.randn(3)
    mask = torch.zeros(2, 4, dtype=torch.bool)
    mask[1, 2] = True  # one valid position: sample 1, position 2
    if not first_masked:
        mask[:] = False
        mask[0, 0] = True
    x[~mask.unsqueeze(1).expand_as(x)] = 1e3  # padded values far from the valid ones

    def run(backend):
        leaves = [_leaf(t) for t in (x, w, b)]

        def fn(x, w, b):
            return nf.batch_norm(x, None, None, w, b, True, mask=mask.to(DEV), backend=backend)

        return _outputs_and_grads(fn, leaves)

    (y,), grads = run("triton")
    (ey,), expected = run("reference")
    valid = mask.unsqueeze(1).expand_as(x).to(DEV)
    torch.testing.assert_close(y[valid], ey[valid], rtol=1e-5, atol=1e-5)
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_masked_batch_norm_one_valid_position_is_the_bias_and_passes_no_gradient():
    """The independent check, from the formula: one valid value per channel has variance 0, so xhat
    is 0 -- the output is the bias -- and dx = w * rstd * (dy - mean(dy) - xhat * mean(dy * xhat)) is 0."""
    torch.manual_seed(4)
    x = torch.randn(2, 3, 4) + 2
    x[0, :, 0] = 1e3  # a padded first value: the shift the kernel once used
    w, b = torch.randn(3), torch.randn(3)
    mask = torch.zeros(2, 4, dtype=torch.bool)
    mask[1, 3] = True
    xl = _leaf(x)
    y = nf.batch_norm(xl, None, None, w.to(DEV), b.to(DEV), True, mask=mask.to(DEV), backend="triton")
    (gx,) = torch.autograd.grad(y[1, :, 3], xl, torch.randn(3, device=DEV))
    torch.testing.assert_close(y[1, :, 3], b.to(DEV), rtol=0, atol=1e-6)
    torch.testing.assert_close(gx, torch.zeros_like(gx), rtol=0, atol=1e-6)


@pytest.mark.parametrize("padding", ("inf", "-inf", "nan", "finite"))
def test_masked_batch_norm_padding_holds_anything(padding):
    """Padded positions holding inf, -inf or NaN change no valid output and no gradient: a non-finite
    padded value passes no gradient to anything (its own input gradient is 0), a finite one is
    normalized like any other position -- output and every gradient as the reference backend's, with
    a cotangent on every position, padded ones included."""
    torch.manual_seed(6)
    x = torch.randn(3, 4, 5)
    w, b = torch.randn(4), torch.randn(4)
    mask = torch.rand(3, 5) < 0.5
    mask[0, 0] = True
    padded = ~mask.unsqueeze(1).expand_as(x)
    x[padded] = {"inf": float("inf"), "-inf": float("-inf"), "nan": float("nan"), "finite": 7.0}[padding]

    def run(backend):
        leaves = [_leaf(t) for t in (x, w, b)]

        def fn(x, w, b):
            return nf.batch_norm(x, None, None, w, b, True, mask=mask.to(DEV), backend=backend)

        return _outputs_and_grads(fn, leaves)

    (y,), grads = run("triton")
    assert normscope.last_backend() == "triton"
    (ey,), expected = run("reference")
    torch.testing.assert_close(y, ey, rtol=1e-5, atol=1e-5, equal_nan=True)  # padded outputs: the formula's
    for name, got, want in zip(("x", "weight", "bias"), grads, expected):
        assert bool(got.isfinite().all()), f"grad of {name}: not finite"
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=lambda m, name=name: f"grad of {name}: {m}")


@pytest.mark.parametrize("value", (3e38, 1e38))
def test_masked_batch_norm_huge_finite_padding_without_gradient_changes_nothing(value):
    """A finite padded value far enough from the mean overflows its normalized value to inf (3e38;
    1e38 at std 0.1). When the loss reads valid outputs only, the padding gets no cotangent and
    must pass nothing: the valid outputs and every gradient are the bits of the same batch padded
    with zeros (0 * inf would make them NaN)."""
    torch.manual_seed(8)
    x = torch.randn(2, 3, 5) * 0.1
    w, b = torch.randn(3), torch.randn(3)
    mask = torch.rand(2, 5) < 0.5
    mask[0, 0], mask[1, 4] = True, False
    valid = mask.unsqueeze(1).expand_as(x)
    cot = torch.randn(x.shape) * valid

    def run(pad):
        leaves = [_leaf(t) for t in (torch.where(valid, x, pad), w, b)]
        y = nf.batch_norm(leaves[0], None, None, leaves[1], leaves[2], True, mask=mask.to(DEV), backend="triton")
        assert normscope.last_backend() == "triton"
        grads = torch.autograd.grad(y, leaves, cot.to(DEV))
        return (y.detach()[valid.to(DEV)], *grads)

    for name, got, want in zip(("valid output", "grad of x", "grad of weight", "grad of bias"), run(value), run(0.0)):
        assert torch.equal(got, want), f"{name}: {got} != {want}"


def _bf16_toward_zero(t: torch.Tensor) -> torch.Tensor:
    """fp32 -> bf16 rounded toward zero: the low 16 bits dropped."""
    return (t.view(torch.int32) & ~0xFFFF).view(torch.float32).to(torch.bfloat16)


@pytest.mark.parametrize("looped", (False, True))
@pytest.mark.parametrize("dtype", (torch.float32, torch.float16, torch.bfloat16), ids=str)
def test_fused_add_residual_is_one_rounding_of_the_fp32_sum(dtype, looped, monkeypatch):
    """The residual sum ``s = x + residual`` is the fp32 sum rounded once to the residual's dtype, as
    torch adds half types: bit for bit with ``x + residual`` -- on both the in-register and the looped
    path. Triton's CPU interpreter (3.6) converts fp32 to bf16 toward zero where compiled Triton and
    torch round to nearest even, so in the interpreter the bf16 sum is held to that rounding of the
    same fp32 sum: any other order, dtype or a second rounding of the add still fails."""
    from normscope.kernels import config

    if looped:
        monkeypatch.setattr(config, "ROWS_MAX_FUSED_N", 8)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(5, 3, 33, generator=g).to(dtype).to(DEV)
    r = (torch.randn(5, 3, 33, generator=g) * 1e-3).to(dtype).to(DEV)
    _, s = nf.fused_add_rms_norm(x, r, None, 1e-6, backend="triton")
    assert normscope.last_backend() == "triton"
    if dtype == torch.bfloat16 and not x.is_cuda:
        want = _bf16_toward_zero(x.float() + r.float())
        assert not torch.equal(want, x + r), "the case must hold sums whose two roundings differ"
    else:
        want = x + r
    assert s.dtype == want.dtype
    assert torch.equal(s, want), f"{int((s != want).sum())} of {s.numel()} residual sums differ in their bits"


def _inf_padded_batch(seed: int):
    """(x, w, b, mask) of a masked BatchNorm1d input whose padded positions hold inf, -inf and NaN."""
    torch.manual_seed(seed)
    x = torch.randn(3, 4, 6)
    w, b = torch.randn(4), torch.randn(4)
    mask = torch.rand(3, 6) < 0.5
    mask[0, :2] = True
    values = torch.tensor([float("inf"), float("-inf"), float("nan")]).repeat(x.numel())[: x.numel()].view_as(x)
    x = torch.where(mask.unsqueeze(1), x, values)
    return x, w, b, mask


def test_masked_batch_norm_gradient_penalty_with_inf_padding():
    """Double backward (``create_graph=True``) through the Triton masked BatchNorm with non-finite
    padding: the penalty's gradients are finite and the reference backend's."""
    x, w, b, mask = _inf_padded_batch(8)
    cot = torch.randn(x.shape, generator=torch.Generator().manual_seed(9)).to(DEV)

    def run(backend):
        xl, wl, bl = (_leaf(t) for t in (x, w, b))
        y = nf.batch_norm(xl, None, None, wl, bl, True, mask=mask.to(DEV), backend=backend)
        (gx,) = torch.autograd.grad(y, xl, cot, create_graph=True)
        return torch.autograd.grad(gx.square().sum(), (xl, wl))

    got, want = run("triton"), run("reference")
    for name, g, e in zip(("x", "weight"), got, want):
        assert bool(g.isfinite().all()), f"second-order grad of {name}: not finite"
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-4, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.skipif(TEST_DEVICE != "cpu", reason="the kernels' CPU fallback runs on CPU tensors")
def test_channels_cpu_fallback_with_inf_padding(monkeypatch):
    """Outside the interpreter the channels ops run their plain-PyTorch fallback on CPU tensors; it
    treats non-finite padding as the kernel does (no NaN from ``0 * inf`` in the masked sums)."""
    from normscope.kernels import channels as chn

    x, w, b, mask = _inf_padded_batch(10)
    cot = torch.randn(x.shape, generator=torch.Generator().manual_seed(11))

    def run(fn):
        xl, wl, bl = (_leaf(t) for t in (x, w, b))
        y = fn(xl, wl, bl)
        return (y, *torch.autograd.grad(y, (xl, wl, bl), cot))

    want = run(lambda x, w, b: nf.batch_norm(x, None, None, w, b, True, mask=mask, backend="reference"))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    got = run(lambda x, w, b: chn.batch_norm_channels(x, 1, w, b, 1e-5, mask=mask)[0])
    for name, g, e in zip(("y", "x", "weight", "bias"), got, want):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5, equal_nan=True, msg=lambda m, n=name: f"{n}: {m}")


_LAYOUT_OPS = {
    "rms_norm": lambda x, r, w, b: nf.rms_norm(x, (8,), w, backend=b),
    "layer_norm": lambda x, r, w, b: nf.layer_norm(x, (8,), w, backend=b),
    "gemma": lambda x, r, w, b: nf.rms_norm(x, (8,), w, 1e-6, weight_offset=1.0, casting="gemma", backend=b),
    "fused_add_rms_norm": lambda x, r, w, b: nf.fused_add_rms_norm(x, r, w, backend=b),
    "poly_norm": lambda x, r, w, b: FM.poly_norm(x, torch.ones(3, device=DEV), torch.zeros(1, device=DEV), backend=b),
    "derf": lambda x, r, w, b: FM.derf(
        x, torch.tensor(0.5, device=DEV), torch.tensor(0.0, device=DEV), w, torch.zeros(8, device=DEV), backend=b
    ),
    "qk_norm": lambda x, r, w, b: FM.qk_norm(x, r, w, w, backend=b),
}


@pytest.mark.parametrize("op", list(_LAYOUT_OPS.values()), ids=list(_LAYOUT_OPS))
def test_a_channels_last_input_keeps_its_layout_on_the_kernels_as_on_the_reference(op):
    # the kernels write contiguous outputs; the reference keeps a channels_last input's layout (torch's
    # rms_norm does too), and the fused add, Gemma's order and the modern ops returned theirs contiguous:
    # the path showed in the strides of the result
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 4, 8, generator=g).to(DEV).contiguous(memory_format=torch.channels_last)
    r = torch.randn(2, 3, 4, 8, generator=g).to(DEV).contiguous(memory_format=torch.channels_last)
    w = torch.randn(8, generator=g).to(DEV)
    want, got = op(x, r, w, "reference"), op(x, r, w, "triton")
    want, got = (want if isinstance(want, tuple) else (want,)), (got if isinstance(got, tuple) else (got,))
    for a, b in zip(want, got):
        assert b.stride() == a.stride(), (b.stride(), a.stride())
        torch.testing.assert_close(b, a)


class TestHostile:
    """Hostile layouts of the arguments the kernels do not own: running buffers that are views of a
    larger tensor (the in-place update must land in the caller's view, as torch's does, and nowhere
    else) and output cotangents of any strides (stride 0 from ``.sum()``, channels_last for an NCHW
    output, transposed, offset storage). Oracles: torch.nn.functional in float64."""

    @pytest.mark.parametrize("kind", ("strided", "offset"))
    @pytest.mark.parametrize("masked", (False, True))
    def test_running_buffers_as_views_are_updated_in_place(self, kind, masked):
        g = torch.Generator().manual_seed(12)
        c = 4
        x = torch.randn(3, c, 5, generator=g) * 2 + 1
        mask = torch.rand(3, 5, generator=g) < 0.6 if masked else None
        if masked:
            mask[0, :2] = True
        base_m = torch.randn(2 * c + 3, generator=g).to(DEV)
        base_v = (torch.rand(2 * c + 3, generator=g) + 0.5).to(DEV)
        keep_m, keep_v = base_m.cpu().double(), base_v.cpu().double()
        at = slice(None, 2 * c, 2) if kind == "strided" else slice(3, 3 + c)
        rm, rv = base_m[at], base_v[at]
        nf.batch_norm(x.to(DEV), rm, rv, None, None, True, 0.1, mask=None if mask is None else mask.to(DEV),
                      backend="triton")  # fmt: skip
        assert normscope.last_backend() == "triton"
        # independent: the batch moments of the valid positions in float64, torch's update rule
        valid = x.double().transpose(0, 1).reshape(c, -1)
        if masked:
            valid = valid[:, mask.reshape(-1)]
        want_m, want_v = keep_m.clone(), keep_v.clone()
        want_m[at] = 0.9 * keep_m[at] + 0.1 * valid.mean(1)
        want_v[at] = 0.9 * keep_v[at] + 0.1 * valid.var(1, unbiased=True)
        # the update lands in the caller's views, so in base; nothing outside the views moves
        torch.testing.assert_close(base_m.cpu().double(), want_m, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(base_v.cpu().double(), want_v, rtol=1e-5, atol=1e-6)

    _OPS = {
        "layer_norm": (lambda x: nf.layer_norm(x, (x.shape[-1],), backend="triton"),
                       lambda x: F.layer_norm(x, (x.shape[-1],))),
        "rms_norm": (lambda x: nf.rms_norm(x, (x.shape[-1],), None, 1e-6, backend="triton"),
                     lambda x: F.rms_norm(x, (x.shape[-1],), None, 1e-6)),
        "group_norm": (lambda x: nf.group_norm(x, 2, backend="triton"), lambda x: F.group_norm(x, 2)),
        "group_norm_cl": (
            lambda x: nf.group_norm(x.contiguous(memory_format=torch.channels_last), 2, backend="triton"),
            lambda x: F.group_norm(x, 2),
        ),
        "batch_norm": (lambda x: nf.batch_norm(x, None, None, None, None, True, backend="triton"),
                       lambda x: F.batch_norm(x, None, None, None, None, True)),
        "batch_norm_eval": (
            lambda x: nf.batch_norm(x, torch.full((4,), 0.3, device=DEV), torch.full((4,), 2.0, device=DEV),
                                    training=False, backend="triton"),
            lambda x: F.batch_norm(x, torch.full((4,), 0.3, dtype=x.dtype, device=x.device),
                                   torch.full((4,), 2.0, dtype=x.dtype, device=x.device)),
        ),
        "fused_add_rms_norm": (lambda x: nf.fused_add_rms_norm(x, x * 0.5, None, 1e-6, backend="triton")[0],
                               lambda x: F.rms_norm(1.5 * x, (x.shape[-1],), None, 1e-6)),
        "poly_norm": (
            lambda x: FM.poly_norm(x, x.new_tensor([1.0, 2.0, 3.0]), x.new_tensor([0.5]), backend="triton"),
            lambda x: sum(c * F.rms_norm(x**p, (x.shape[-1],), None, 1e-6) for c, p in ((1, 3), (2, 2), (3, 1))) + 0.5,
        ),
        "modulated_norm": (
            lambda x: FM.modulated_norm(x, None, torch.full_like(x, 0.5), backend="triton"),
            lambda x: F.layer_norm(x, (x.shape[-1],), None, None, 1e-6) * 1.5,
        ),
    }  # fmt: skip

    @pytest.mark.parametrize("cot", ("stride0", "channels_last", "transposed", "offset"))
    @pytest.mark.parametrize("op", list(_OPS))
    def test_cotangent_of_any_strides(self, op, cot):
        fn, fn64 = self._OPS[op]
        g = torch.Generator().manual_seed(13)
        x = torch.randn(2, 4, 3, 5, generator=g)
        c = torch.randn(x.shape, generator=g)
        c = {
            "stride0": torch.tensor(1.3).expand(x.shape),  # what y.sum() hands back
            "channels_last": c.contiguous(memory_format=torch.channels_last),
            "transposed": c.transpose(0, -1).contiguous().transpose(0, -1),
            "offset": torch.cat([torch.zeros(3), c.reshape(-1)])[3:].view(x.shape),
        }[cot]
        xl = x.to(DEV).requires_grad_()
        y = fn(xl)
        assert normscope.last_backend() == "triton"
        (got,) = torch.autograd.grad(y, xl, c.to(DEV))
        x64 = x.double().requires_grad_()
        (want,) = torch.autograd.grad(fn64(x64), x64, c.double())
        torch.testing.assert_close(got.cpu().double(), want, rtol=1e-4, atol=1e-4)

    @pytest.mark.parametrize("default", (torch.float32, torch.float64), ids=str)
    @pytest.mark.parametrize("path", ("evaluation", "training", "reference"))
    def test_channels_op_keeps_the_custom_op_contract(self, path, default, monkeypatch):
        """torch.library.opcheck's test_faketensor on the channels op, whatever torch's default dtype:
        its valid-position count is fp32, as its fake says (the evaluation path and the reference built
        it with ``torch.tensor(float)``: float64 after ``torch.set_default_dtype(torch.float64)``), and
        no output aliases an input (the reference returned fp32 running statistics themselves as the
        evaluation's mean and variance)."""
        from normscope.kernels import channels as chn

        if path == "reference":  # the plain-PyTorch fallback: a CPU tensor outside the interpreter
            if DEV.type != "cpu":
                pytest.skip("the fallback runs on CPU tensors")
            monkeypatch.setenv("TRITON_INTERPRET", "0")
        g = torch.Generator().manual_seed(14)
        x = torch.randn(2, 3, 4, generator=g).to(DEV)
        stats = (None, None) if path == "training" else (torch.zeros(3, device=DEV), torch.ones(3, device=DEV))
        previous = torch.get_default_dtype()
        torch.set_default_dtype(default)
        try:
            torch.library.opcheck(
                chn.channels_fwd, (x, None, None, *stats, None, 1e-5), test_utils=("test_faketensor",)
            )
        finally:
            torch.set_default_dtype(previous)


_TRANSFORMED = {
    "layer_norm": (lambda: normscope.LayerNorm(8), lambda: torch.nn.LayerNorm(8), (3, 8)),
    "rms_norm": (lambda: normscope.RMSNorm(8), lambda: torch.nn.RMSNorm(8), (3, 8)),
    "group_norm": (lambda: normscope.GroupNorm(2, 4), lambda: torch.nn.GroupNorm(2, 4), (3, 4, 5)),
    "batch_norm_eval": (lambda: normscope.BatchNorm1d(4).eval(), lambda: torch.nn.BatchNorm1d(4).eval(), (3, 4, 5)),
    "instance_norm": (lambda: normscope.InstanceNorm1d(4), lambda: torch.nn.InstanceNorm1d(4), (3, 4, 5)),
}


def _transform(how: str, m, x: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    if how == "jvp":
        return torch.func.jvp(m, (x,), (v,))[1]
    if how == "vmap":
        return torch.func.vmap(m)(x.unsqueeze(1))
    if how == "grad":
        return torch.func.grad(lambda t: (m(t) * v).sum())(x)
    import torch.autograd.forward_ad as fwAD

    with fwAD.dual_level():
        return fwAD.unpack_dual(m(fwAD.make_dual(x, v))).tangent


class TestTransforms:
    """torch.func transforms and forward-mode AD with the Triton backend forced: the kernels are custom
    ops and autograd.Functions with no batching or forward-derivative rules, and raised functorch's
    "Cannot access storage of TensorWrapper", "must override the setup_context staticmethod" or "must
    implement the jvp function" (and InstanceNorm's dual tangent came back None). There the call runs on
    the reference and says so in last_backend(); the oracle is torch.nn's layer under the same transform."""

    @pytest.mark.parametrize("how", ("jvp", "vmap", "grad", "dual"))
    @pytest.mark.parametrize("op", sorted(_TRANSFORMED))
    def test_a_forced_kernel_inside_a_transform_gives_torchs_result(self, op, how):
        ours, theirs, shape = _TRANSFORMED[op]
        g = torch.Generator().manual_seed(0)
        x, v = (torch.randn(shape, generator=g).to(DEV) for _ in range(2))
        m, tm = ours().to(DEV), theirs().to(DEV)
        with normscope.use_backend("triton"):
            got = _transform(how, m, x, v)
            assert normscope.last_backend() == "reference"
        torch.testing.assert_close(got, _transform(how, tm, x, v), rtol=1e-5, atol=1e-5)

    @pytest.mark.parametrize("how", ("jvp", "vmap"))
    def test_modern_ops_forced_on_the_kernels_inside_a_transform_run_their_composition(self, how):
        g = torch.Generator().manual_seed(1)
        x, v = (torch.randn(3, 8, generator=g).to(DEV) for _ in range(2))
        w, b = torch.randn(3, generator=g).to(DEV), torch.randn((), generator=g).to(DEV)
        shift, scale = torch.randn(3, 8, generator=g).to(DEV), torch.randn(3, 8, generator=g).to(DEV)
        ops = {
            "poly_norm": lambda t, sh, sc, backend: FM.poly_norm(t, w, b.reshape(1), backend=backend),
            "modulated_norm": lambda t, sh, sc, backend: FM.modulated_norm(t, sh, sc, backend=backend),
            "gemma rms_norm": lambda t, sh, sc, backend: FM.rms_norm(t, 8, None, 1e-6, weight_offset=1.0,
                                                                  casting="gemma", backend=backend),
        }  # fmt: skip

        def run(op, backend):
            if how == "vmap":
                return torch.func.vmap(lambda t, sh, sc: op(t[None], sh[None], sc[None], backend)[0])(x, shift, scale)
            return torch.func.jvp(lambda t: op(t, shift, scale, backend), (x,), (v,))[1]

        for name, op in ops.items():
            torch.testing.assert_close(run(op, "triton"), run(op, None), rtol=1e-5, atol=1e-5, msg=name)

    def test_batch_norm_evaluation_double_backward(self):
        """create_graph=True through BatchNorm's evaluation kernel differentiated its saved running
        statistics -- the op's own outputs -- and reached its own backward again with no output gradient
        (AttributeError: 'NoneType' object has no attribute 'to'). The oracle: torch.nn's layer."""
        g = torch.Generator().manual_seed(2)
        x = torch.randn(3, 4, 5, generator=g).to(DEV)
        m, tm = normscope.BatchNorm1d(4).to(DEV).eval(), torch.nn.BatchNorm1d(4).to(DEV).eval()
        with torch.no_grad():
            for a in (m, tm):
                a.running_mean.copy_(torch.linspace(-1, 1, 4))
                a.running_var.copy_(torch.linspace(0.5, 2, 4))
                a.weight.copy_(torch.linspace(0.5, 1.5, 4))

        def second(layer):
            xi = x.clone().requires_grad_()
            (gx,) = torch.autograd.grad((layer(xi) ** 3).sum(), xi, create_graph=True)
            return torch.autograd.grad((gx**2).sum(), [xi, layer.weight])

        with normscope.use_backend("triton"):
            got = second(m)
        for a, b in zip(got, second(tm)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


_EMPTY = {
    "layer_norm": (lambda: normscope.LayerNorm(8), lambda: torch.nn.LayerNorm(8), (0, 8)),
    "rms_norm": (lambda: normscope.RMSNorm(8), lambda: torch.nn.RMSNorm(8), (0, 3, 8)),
    "group_norm": (lambda: normscope.GroupNorm(2, 4), lambda: torch.nn.GroupNorm(2, 4), (0, 4, 5)),
    "batch_norm_eval": (lambda: normscope.BatchNorm1d(4).eval(), lambda: torch.nn.BatchNorm1d(4).eval(), (0, 4, 5)),
}


@pytest.mark.parametrize("op", sorted(_EMPTY))
def test_empty_input_on_the_forced_kernels_is_torchs(op):
    """An empty batch (an MoE expert given no tokens) under ``use_backend("triton")`` was refused with a
    ValueError -- a model failing on one batch in many -- where torch returns it. No kernel launches on it:
    the reference gives torch's empty output and input gradient, and zeros for the weights. (Scopes of
    zero elements -- ``RMSNorm(0)`` -- stay declined, as on the rows backend:
    tests/core/test_torch_parity_edges.py.)"""
    ours, theirs, shape = _EMPTY[op]
    m, tm = ours().to(DEV), theirs().to(DEV)
    x = torch.randn(shape, device=DEV)
    grads = []
    for layer, forced in ((m, "triton"), (tm, None)):
        xi = x.clone().requires_grad_()
        with normscope.use_backend(forced):
            y = layer(xi)
        y.sum().backward()
        grads.append((y, xi.grad, layer.weight.grad))
    (y, gx, gw), (ty, tgx, tgw) = grads
    for a, b in ((y, ty), (gx, tgx)):
        assert a.shape == b.shape and a.dtype == b.dtype
    assert gw.shape == tgw.shape and torch.equal(gw, torch.zeros_like(gw))
