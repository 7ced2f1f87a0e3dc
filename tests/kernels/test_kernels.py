"""The Triton kernels (rows, groups, channels, fused residual add) against independent float64 oracles.

Device: CPU by default, where the kernels run in Triton's interpreter (tests/conftest.py
sets TRITON_INTERPRET=1 before any kernel is imported) and shapes are tiny because the interpreter
is slow. ``NORMSCOPE_TEST_DEVICE=cuda``
(see conftest.py) runs the same tests on the compiled kernels on a GPU: the same assertions on the
same numbers (drawn on the CPU, then moved), plus the ``*_at_realistic_sizes`` tests that only CUDA
runs. Tolerances follow flash-attention's rule: the kernel's error against a float64 reference may
be at most twice the error of the same-dtype PyTorch computation, plus a small atol.
"""

import itertools
import os

import pytest
import torch
import torch.nn.functional as F

from conftest import TEST_DEVICE, direct

#: where every test's tensors live (numbers are drawn on the CPU, so both devices see the same ones)
DEV = torch.device(TEST_DEVICE)
ON_CPU = DEV.type == "cpu"
cuda_only = pytest.mark.skipif(ON_CPU, reason="realistic sizes run only with NORMSCOPE_TEST_DEVICE=cuda")

pytest.importorskip("triton", reason="the kernel tests need Triton (pip install 'normscope[kernels]')")

import normscope  # noqa: E402
from normscope import functional as nf  # noqa: E402
from normscope.backends import measured as _measured  # noqa: E402
from normscope.functional import fused_add_rms_norm  # noqa: E402
from normscope.kernels import channels as CH  # noqa: E402
from normscope.kernels import config as KC  # noqa: E402
from normscope.kernels import fused_add_rms_norm_ref  # noqa: E402
from normscope.kernels import groups as G  # noqa: E402
from normscope.kernels import rows as R  # noqa: E402

# eps=0 makes the (masked, never stored) padding rows of a block compute 1/sqrt(0) in numpy
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


@pytest.fixture(params=["block", "looped"])
def path(request, monkeypatch):
    """Run a test on the single-block path and, with an 8-element limit, on the looped one."""
    if request.param == "looped":
        monkeypatch.setattr(KC, "ROWS_MAX_FUSED_N", 8)
    return request.param


def _ref64(x, w, b, r, centered, offset, eps=1e-5):
    """Independent float64 oracle: torch's own layer_norm / rms_norm on (x + r)."""
    h = x.double() + (r.double() if r is not None else 0)
    n = x.shape[-1]
    wd = w.double() + offset if w is not None else None
    if centered:
        return F.layer_norm(h, (n,), wd, b.double() if b is not None else None, eps)
    y = F.rms_norm(h, (n,), wd, eps)
    return y + b.double() if b is not None else y


def _grads(outputs, inputs, cotangents):
    inputs = [t for t in inputs if t is not None]
    return torch.autograd.grad(outputs, inputs, cotangents, allow_unused=True)


FLAGS = list(itertools.product([True, False], repeat=4))  # centered, weight, bias, residual


# rows of 1 and 7 fit one block even with the 8-element limit, so only 33 exercises the looped path
@pytest.mark.parametrize("centered,has_w,has_b,has_r", FLAGS)
@pytest.mark.parametrize("path,n", [("block", 1), ("block", 7), ("block", 33), ("looped", 33)], indirect=["path"])
def test_rows_forward_and_gradients_match_float64(path, centered, has_w, has_b, has_r, n):
    g = torch.Generator().manual_seed(n)
    m = 5
    x = torch.randn(m, n, generator=g).to(DEV).requires_grad_()
    w = (torch.rand(n, generator=g) + 0.5).to(DEV).requires_grad_() if has_w else None
    b = torch.randn(n, generator=g).to(DEV).requires_grad_() if has_b else None
    r = torch.randn(m, n, generator=g).to(DEV).requires_grad_() if has_r else None
    offset = 0.5 if has_w else 0.0
    y, s = R.rows_norm(x, w, b, 1e-5, centered, residual=r, weight_offset=offset)
    y64 = _ref64(x, w, b, r, centered, offset)
    torch.testing.assert_close(y.double(), y64, atol=2e-5, rtol=1e-5)
    dy = torch.randn(m, n, generator=g).to(DEV)
    if has_r:
        torch.testing.assert_close(s, x + r)
        ds = torch.randn(m, n, generator=g).to(DEV)
        got = _grads((y, s), (x, w, b, r), (dy, ds))
        want = _grads((y64, x.double() + r.double()), (x, w, b, r), (dy.double(), ds.double()))
    else:
        assert s is None
        got = _grads(y, (x, w, b), dy)
        want = _grads(y64, (x, w, b), dy.double())
    for a, e in zip(got, want):
        torch.testing.assert_close(a.double(), e.double(), atol=5e-5, rtol=1e-4)


@pytest.mark.parametrize("centered", [True, False])
@pytest.mark.parametrize("n", [13, 50])
def test_measured_launch_tables_keep_the_numbers(monkeypatch, centered, n):
    """The per-block settings of ``config.ROWS_BWD_LAUNCH`` / ``ROWS_LOOP_LAUNCH`` (a GPU sweep writes
    them) change the launch, never the result: 13 takes the single-block backward with 2 rows per tile,
    50 the looped path with a forward chunk of 16 and a backward chunk of 8."""
    monkeypatch.setattr(KC, "ROWS_MAX_FUSED_N", 16)
    monkeypatch.setattr(KC, "ROWS_BWD_LAUNCH", {16: (2, 4, 1)})
    monkeypatch.setattr(KC, "ROWS_LOOP_LAUNCH", {64: (16, 4, 8, 2, 1)})
    assert R._bwd_config(n) == ((2, 16, False, 4, 1) if n == 13 else (1, 8, True, 2, 1))
    assert R._config(n) == ((64, 16, False, 1) if n == 13 else (1, 16, True, 4))
    g = torch.Generator().manual_seed(n)
    x = (torch.randn(7, n, generator=g) * 3 + 2).to(DEV).requires_grad_()
    w = (torch.rand(n, generator=g) + 0.5).to(DEV).requires_grad_()
    b = torch.randn(n, generator=g).to(DEV).requires_grad_() if centered else None
    y, _ = R.rows_norm(x, w, b, 1e-5, centered)
    y64 = _ref64(x, w, b, None, centered, 0.0)
    torch.testing.assert_close(y.double(), y64, atol=2e-5, rtol=1e-5)
    dy = torch.randn(7, n, generator=g).to(DEV)
    for a, e in zip(_grads(y, (x, w, b), dy), _grads(y64, (x, w, b), dy.double())):
        torch.testing.assert_close(a.double(), e.double(), atol=5e-5, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("centered", [True, False])
def test_low_precision_error_at_most_twice_torch(path, dtype, centered):
    g = torch.Generator().manual_seed(1)
    m, n = 6, 40
    x = (torch.randn(m, n, generator=g) * 3 + 1).to(DEV, dtype).requires_grad_()
    w = (torch.rand(n, generator=g) + 0.5).to(DEV, dtype).requires_grad_()
    b = torch.randn(n, generator=g).to(DEV, dtype).requires_grad_() if centered else None
    dy = torch.randn(m, n, generator=g).to(DEV, dtype)

    def torch_same_dtype():
        return F.layer_norm(x, (n,), w, b, 1e-5) if centered else F.rms_norm(x, (n,), w, 1e-5)

    y64 = _ref64(x, w, b, None, centered, 0.0)
    y_k, _ = R.rows_norm(x, w, b, 1e-5, centered)
    y_t = torch_same_dtype()
    assert y_k.dtype == dtype
    g64 = _grads(y64, (x, w, b), dy.double())
    g_k = _grads(y_k, (x, w, b), dy)
    g_t = _grads(y_t, (x, w, b), dy)
    atol = {torch.float16: 1e-3, torch.bfloat16: 1e-2, torch.float32: 1e-5}[dtype]
    for got, torch_, want in zip((y_k, *g_k), (y_t, *g_t), (y64, *g64)):
        assert got.dtype == dtype
        err_k = (got.double() - want).abs().max().item()
        err_t = (torch_.double() - want).abs().max().item()
        assert err_k <= 2 * err_t + atol * want.abs().max().item() + atol, (err_k, err_t)


def test_long_rows_with_default_knobs():
    # N = 1000 fits one 1024 block; N = 20000 > ROWS_MAX_FUSED_N takes the looped path at full chunk size
    for n in (1000, 20000):
        x = torch.randn(2, n, device=DEV) * 2 + 3
        w, b = torch.randn(n, device=DEV), torch.randn(n, device=DEV)
        y, _ = R.rows_norm(x, w, b, 1e-5, True)
        torch.testing.assert_close(y, F.layer_norm(x, (n,), w, b, 1e-5), atol=1e-5, rtol=1e-5)


def test_large_offset_small_spread_normalizes_to_unit_variance(path):
    # mean 1e4, std 1e-2 in fp32: E[x^2] - E[x]^2 would lose every digit
    g = torch.Generator().manual_seed(3)
    x = 1e4 + 1e-2 * torch.randn(4, 33, generator=g).to(DEV)
    y, _ = R.rows_norm(x, None, None, 0.0, True)
    var = y.double().var(-1, unbiased=False)
    torch.testing.assert_close(var, torch.ones_like(var), atol=1e-3, rtol=0)  # torch CPU: ~4e-2


def test_outlier_first_element_keeps_torchs_accuracy(path):
    """A row whose first element is an outlier (a massive activation, 1e4 among values ~1): the
    kernels once shifted a row by its first element, which rounded every other deviation to the
    outlier's spacing -- 20-40x torch's error against float64. The rule of this file: at most twice
    torch's error, plus a small atol."""
    g = torch.Generator().manual_seed(12)
    x = torch.randn(4, 64, generator=g)
    x[:, 0] = 1e4
    x = x.to(DEV)
    want = F.layer_norm(x.double(), (64,))[:, 1:]  # the other elements (the outlier's own ulp is larger)
    got, _ = R.rows_norm(x, None, None, 1e-5, True)
    torch_err = (F.layer_norm(x, (64,)).double()[:, 1:] - want).abs().max().item()
    err = (got.double()[:, 1:] - want).abs().max().item()
    assert err <= 2 * torch_err + 1e-7, f"kernel {err:.3g} vs torch {torch_err:.3g} against float64"
    # the shift (a mean) must not overflow where the row's values sum past fp32's max: a constant
    # row gives the bias, as DESIGN.md asks (torch's CPU layer_norm gives NaN there)
    c = torch.full((2, 64), 3e38, device=DEV)
    c[1] = -2e38
    b = torch.randn(64, generator=g).to(DEV)
    y, _ = R.rows_norm(c, None, b, 1e-5, True)
    torch.testing.assert_close(y, b.expand(2, 64), rtol=0, atol=0)


def test_weight_gradient_is_deterministic(path, monkeypatch):
    monkeypatch.setattr(KC, "ROWS_TILE", 64)  # one row per block, so that several programs share the rows
    g = torch.Generator().manual_seed(4)
    m, n = 12, 33  # 4 programs (the interpreter's cap), each with its own partial row of dW
    x = torch.randn(m, n, generator=g).to(DEV)
    w = torch.randn(n, generator=g).to(DEV).requires_grad_()
    b = torch.randn(n, generator=g).to(DEV).requires_grad_()
    dy = torch.randn(m, n, generator=g).to(DEV)
    runs = []
    for _ in range(2):
        xx = x.clone().requires_grad_()
        y, _ = R.rows_norm(xx, w, b, 1e-5, True)
        runs.append(torch.autograd.grad(y, (w, b), dy))
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])
    want = _grads(_ref64(x.requires_grad_(), w, b, None, True, 0.0), (w, b), dy.double())
    torch.testing.assert_close(runs[0][0].double(), want[0].double(), atol=1e-4, rtol=1e-4)


def test_strided_inputs():
    base = torch.randn(6, 48, device=DEV)
    x = base[:, 5:38]  # rows with a stride of 48: used in place
    y, _ = R.rows_norm(x, None, None, 1e-5, True)
    torch.testing.assert_close(y, F.layer_norm(x, (33,)), atol=1e-5, rtol=1e-5)
    xt = torch.randn(33, 6, device=DEV).t()  # last axis not unit-stride: copied once
    y, _ = R.rows_norm(xt, None, None, 1e-5, False)
    torch.testing.assert_close(y, F.rms_norm(xt, (33,), eps=1e-5), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("centered", [True, False])
def test_rows_over_several_axes_whose_flat_row_is_strided(centered):
    # x's last stride is 1, but the row over (4, 1) flattens to a view of stride 2: the kernel
    # must see unit-stride rows (it once read x[0], x[1], ... as if contiguous)
    x = torch.randn(3, 8, device=DEV)[:, ::2].unsqueeze(-1).requires_grad_()
    w = torch.randn(4, 1, device=DEV, requires_grad=True)
    x64, w64 = (t.detach().double().requires_grad_() for t in (x, w))
    if centered:
        y = nf.layer_norm(x, (4, 1), w, None, 1e-5, backend="triton")
        want = F.layer_norm(x64, (4, 1), w64, None, 1e-5)
    else:
        y = nf.rms_norm(x, (4, 1), w, 1e-5, backend="triton")
        want = F.rms_norm(x64, (4, 1), w64, 1e-5)
    assert normscope.last_backend() == "triton"
    torch.testing.assert_close(y.double(), want, atol=1e-5, rtol=1e-5)
    dy = torch.randn(3, 4, 1, device=DEV)
    y.backward(dy)
    want.backward(dy.double())
    for got, ref in ((x, x64), (w, w64)):
        torch.testing.assert_close(got.grad.double(), ref.grad, atol=1e-4, rtol=1e-4)


def test_engine_runs_the_triton_backend_when_forced():
    x = torch.randn(2, 3, 5, 7, device=DEV, requires_grad=True)
    w, b = torch.randn(5, 7, device=DEV, requires_grad=True), torch.randn(5, 7, device=DEV, requires_grad=True)
    with normscope.use_backend("triton"):
        y = nf.layer_norm(x, (5, 7), w, b)
        assert normscope.last_backend() == "triton"
        z = nf.rms_norm(x, (7,), w[0])
        assert normscope.last_backend() == "triton"
        layer = normscope.RMSNorm(7).to(DEV)
        layer(x)
        assert normscope.last_backend() == "triton"
    torch.testing.assert_close(y, F.layer_norm(x, (5, 7), w, b), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(z, F.rms_norm(x, (7,), w[0]), atol=1e-5, rtol=1e-5)
    got = torch.autograd.grad(y.sum() + z.square().sum(), (x, w, b))
    ref = F.layer_norm(x, (5, 7), w, b).sum() + F.rms_norm(x, (7,), w[0]).square().sum()
    for a, e in zip(got, torch.autograd.grad(ref, (x, w, b))):
        torch.testing.assert_close(a, e, atol=1e-4, rtol=1e-4)


def test_triton_backend_declines_what_it_cannot_run():
    x = torch.randn(4, 3, 5, device=DEV)
    nf.layer_norm(x, (5,))
    # automatic mode takes a kernel only for CUDA tensors, and only where a committed measurement
    # on this device class shows it faster (normscope.backends.measured); else ATen runs
    measured = not ON_CPU and _measured.why_not("layer_norm", x.dtype, 5, x.device) is None
    assert normscope.last_backend() == ("triton" if measured else "aten")
    with normscope.use_backend("triton"):
        with pytest.raises(ValueError, match="no kernel for this scope"):
            nf.normalize(x, dims=0)  # statistics over the batch axis only, per (position, channel)
        with pytest.raises(ValueError, match="running statistics"):
            nf.instance_norm(x, torch.zeros(3, device=DEV), torch.ones(3, device=DEV), use_input_stats=True)
        with pytest.raises(ValueError, match="float32/float16/bfloat16"):
            nf.layer_norm(x.double(), (5,))
        with pytest.raises(ValueError, match="mask"):
            mask = torch.ones(4, 3, 5, dtype=torch.bool, device=DEV)
            nf.normalize(x, dims=(-1,), mask=mask)  # masked LayerNorm
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "0"
    try:  # a CPU tensor without the interpreter, on every device
        with normscope.use_backend("triton"), pytest.raises(ValueError, match="CUDA"):
            nf.layer_norm(torch.randn(2, 9, device="cpu"), (9,))
    finally:
        if previous is None:
            os.environ.pop("TRITON_INTERPRET")
        else:
            os.environ["TRITON_INTERPRET"] = previous


@pytest.mark.parametrize("residual_fp32", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_add_rms_norm_equals_add_then_norm(residual_fp32, dtype):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 4, 24, generator=g).to(DEV, dtype).requires_grad_()
    r = torch.randn(3, 4, 24, generator=g).to(DEV, dtype).requires_grad_()
    w = torch.randn(24, generator=g).to(DEV, dtype).requires_grad_()
    y, h = fused_add_rms_norm(x, r, w, 1e-6, residual_fp32=residual_fp32, backend="triton")
    y0, h0 = fused_add_rms_norm_ref(x, r, w, 1e-6, residual_fp32=residual_fp32)
    assert h.dtype == (torch.float32 if residual_fp32 else dtype) and y.dtype == dtype
    # the same rounding of the same sum -- except that Triton's CPU interpreter casts fp32 to bf16
    # by truncation (the GPU rounds to nearest even), so bf16 may differ by one ulp there
    ulp = 0 if h.dtype == torch.float32 or not ON_CPU else 2**-7
    torch.testing.assert_close(h.float(), h0.float(), atol=0, rtol=ulp)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(y, y0, atol=tol, rtol=tol)
    if not residual_fp32:  # unfused torch: add, then rms_norm
        torch.testing.assert_close(y, F.rms_norm(x + r, (24,), w, 1e-6), atol=tol, rtol=tol)
    dy, dh = torch.randn_like(y), torch.randn_like(h)
    got = torch.autograd.grad((y, h), (x, r, w), (dy, dh))
    want = torch.autograd.grad((y0, h0), (x, r, w), (dy, dh))
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e, atol=tol * 10, rtol=tol)
    # automatic mode runs ATen's add then rms_norm (or the kernel where measured faster): the same residual
    y2, h2 = fused_add_rms_norm(x, r, w, 1e-6, residual_fp32=residual_fp32)
    torch.testing.assert_close(h2, h0, atol=0, rtol=0)


def test_fused_add_rms_norm_rejects_bad_input():
    x = torch.randn(2, 8, device=DEV)
    with pytest.raises(ValueError, match="residual"):
        fused_add_rms_norm(x, torch.randn(2, 9, device=DEV))
    with pytest.raises(ValueError, match=r"weight.*\(8,\)"):
        fused_add_rms_norm(x, x, torch.ones(9, device=DEV))
    with pytest.raises(TypeError, match="x"):
        fused_add_rms_norm(x.long(), x)


def test_custom_op_registrations():
    x = torch.randn(3, 9, device=DEV, requires_grad=True)
    w, b = torch.randn(9, device=DEV, requires_grad=True), torch.randn(9, device=DEV, requires_grad=True)
    r = torch.randn(3, 9, device=DEV, requires_grad=True)
    torch.library.opcheck(
        torch.ops.normscope.rows_fwd.default, (x, w, b, r, 1e-5, True, 0.0, False),
        test_utils=("test_schema", "test_faketensor", "test_autograd_registration"),
    )  # fmt: skip


def test_compiles_without_graph_breaks():
    def block(x, r, w, b):
        y, h = fused_add_rms_norm(x, r, w, 1e-6, backend="triton")
        z, _ = R.rows_norm(h * 2, w, b, 1e-5, True)
        return (y * z).sum()

    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    g = torch.Generator().manual_seed(6)
    args = [torch.randn(4, 16, generator=g).to(DEV).requires_grad_() for _ in range(2)]
    args += [torch.randn(16, generator=g).to(DEV).requires_grad_() for _ in range(2)]
    out = compiled(*args)
    got = torch.autograd.grad(out, args)
    eager = block(*args)
    torch.testing.assert_close(out, eager)
    for a, e in zip(got, torch.autograd.grad(eager, args)):
        torch.testing.assert_close(a, e)


# ---------------------------------------------------------------------------------------------
# groups: GroupNorm / InstanceNorm on (N, C, *)


@pytest.fixture(params=["one-tile", "tiles"])
def tiles(request, monkeypatch):
    """Whole groups in one tile, and (GROUPS_TILE = 8) groups walked in many partial tiles."""
    if request.param == "tiles":
        monkeypatch.setattr(KC, "GROUPS_TILE", 8)
    return request.param


def _group64(x, groups, w, b, centered, eps=1e-5):
    """float64 oracle: torch's group_norm, or the RMS variant written out."""
    if centered:
        return F.group_norm(
            x.double(), groups, w.double() if w is not None else None, b.double() if b is not None else None, eps
        )
    xg = x.double().reshape(x.shape[0], groups, -1)
    y = (xg * torch.rsqrt(xg.square().mean(-1, keepdim=True) + eps)).reshape(x.shape)
    shape = [1, x.shape[1]] + [1] * (x.dim() - 2)
    y = y * w.double().reshape(shape) if w is not None else y
    return y + b.double().reshape(shape) if b is not None else y


@pytest.mark.parametrize("shape,groups", [((2, 6, 5, 3), 3), ((3, 4, 7), 4), ((2, 4, 3, 3), 1), ((2, 6, 1, 5), 6)])
@pytest.mark.parametrize("centered,affine", [(True, True), (True, False), (False, True)])
def test_groups_forward_and_gradients_match_float64(tiles, shape, groups, centered, affine):
    g = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(shape, generator=g) * 2 + 5).to(DEV).requires_grad_()
    w = torch.randn(shape[1], generator=g).to(DEV).requires_grad_() if affine else None
    b = torch.randn(shape[1], generator=g).to(DEV).requires_grad_() if affine else None
    y = G.group_norm(x, groups, w, b, 1e-5, centered)
    y64 = _group64(x, groups, w, b, centered)
    torch.testing.assert_close(y.double(), y64, atol=2e-5, rtol=1e-5)
    dy = torch.randn(shape, generator=g).to(DEV)
    got = _grads(y, (x, w, b), dy)
    want = _grads(y64, (x, w, b), dy.double())
    for a, e in zip(got, want):
        torch.testing.assert_close(a.double(), e.double(), atol=5e-5, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_groups_low_precision_error_at_most_twice_torch(dtype):
    g = torch.Generator().manual_seed(7)
    x = (torch.randn(2, 8, 4, 5, generator=g) * 3 + 1).to(DEV, dtype).requires_grad_()
    w = (torch.rand(8, generator=g) + 0.5).to(DEV, dtype).requires_grad_()
    b = torch.randn(8, generator=g).to(DEV, dtype).requires_grad_()
    dy = torch.randn(2, 8, 4, 5, generator=g).to(DEV, dtype)
    y64 = _group64(x, 4, w, b, True)
    y_k, y_t = G.group_norm(x, 4, w, b), F.group_norm(x, 4, w, b)
    atol = {torch.float16: 1e-3, torch.bfloat16: 1e-2}[dtype]
    triples = zip(
        (y_k, *_grads(y_k, (x, w, b), dy)),
        (y_t, *_grads(y_t, (x, w, b), dy)),
        (y64, *_grads(y64, (x, w, b), dy.double())),
    )
    for got, torch_, want in triples:
        assert got.dtype == dtype
        err_k = (got.double() - want).abs().max().item()
        err_t = (torch_.double() - want).abs().max().item()
        assert err_k <= 2 * err_t + atol * want.abs().max().item() + atol, (err_k, err_t)


def test_groups_channels_last_and_determinism():
    g = torch.Generator().manual_seed(8)
    x = torch.randn(2, 8, 3, 5, generator=g).to(DEV).contiguous(memory_format=torch.channels_last)
    w = torch.randn(8, generator=g).to(DEV).requires_grad_()
    y = G.group_norm(x, 4, w)
    assert y.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(y, F.group_norm(x, 4, w), atol=1e-5, rtol=1e-5)
    dy = torch.randn(2, 8, 3, 5, generator=g).to(DEV)
    first, second = (torch.autograd.grad(G.group_norm(x, 4, w), w, dy)[0] for _ in range(2))
    assert torch.equal(first, second)


@pytest.mark.parametrize("layout", ["nchw", "channels_last"])
def test_groups_outlier_first_element_keeps_torchs_accuracy(layout, monkeypatch):
    """As the rows kernels' test: a group whose first element is an outlier (1e4 among values ~1) once
    had 8-30x torch's error against float64 (every value shifted by that element); and a constant
    group near fp32's max gives the bias. Small tiles and splits, so that the shift is one tile's."""
    small = {"GROUPS_TILE": 16, "GROUPS_CL_TILE": 16, "GROUPS_CL_WIDTH": 4, "GROUPS_CL_MIN_SPLIT": 8}
    for name, value in small.items():
        monkeypatch.setattr(KC, name, value)
    fmt = torch.channels_last if layout == "channels_last" else torch.contiguous_format
    g = torch.Generator().manual_seed(13)
    x = torch.randn(2, 4, 4, 4, generator=g)
    x[:, 0, 0, 0] = x[:, 2, 0, 0] = 1e4  # the first element of each of the two groups
    x = x.to(DEV).contiguous(memory_format=fmt)
    want = F.group_norm(x.double(), 2)
    others = torch.ones_like(want, dtype=torch.bool)
    others[:, 0, 0, 0] = others[:, 2, 0, 0] = False
    torch_err = (F.group_norm(x, 2).double() - want)[others].abs().max().item()
    err = (G.group_norm(x, 2).double() - want)[others].abs().max().item()
    assert err <= 2 * torch_err + 1e-7, f"kernel {err:.3g} vs torch {torch_err:.3g} against float64"
    c = torch.full((2, 4, 4, 4), 3e38, device=DEV).contiguous(memory_format=fmt)
    b = torch.randn(4, generator=g).to(DEV)
    torch.testing.assert_close(G.group_norm(c, 2, None, b), b[:, None, None].expand(2, 4, 4, 4), rtol=0, atol=0)


def test_engine_runs_group_and_instance_norm_on_the_triton_backend():
    g = torch.Generator().manual_seed(9)
    x = torch.randn(2, 6, 4, 3, generator=g).to(DEV).requires_grad_()
    gn, inn = normscope.GroupNorm(3, 6).to(DEV), normscope.InstanceNorm2d(6, affine=True).to(DEV)
    with torch.no_grad():
        for p in (gn.weight, gn.bias, inn.weight, inn.bias):  # drawn on the CPU, as everywhere here
            p.copy_(torch.empty(p.shape).normal_(generator=g))
    with normscope.use_backend("triton"):
        y1 = gn(x)
        assert normscope.last_backend() == "triton"
        y2 = inn(x)
        assert normscope.last_backend() == "triton"
        y3 = nf.group_norm(x, 1, gn.weight, gn.bias)  # GroupNorm(1, C): LayerNorm over (C, H, W)
        assert normscope.last_backend() == "triton"
    ref1 = F.group_norm(x, 3, gn.weight, gn.bias, gn.eps)
    ref2 = F.instance_norm(x, weight=inn.weight, bias=inn.bias, eps=inn.eps)
    ref3 = F.group_norm(x, 1, gn.weight, gn.bias)
    for got, ref in ((y1, ref1), (y2, ref2), (y3, ref3)):
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    params = (x, gn.weight, gn.bias, inn.weight, inn.bias)
    got = _grads(y1.sum() + y2.square().sum() + y3.pow(3).sum(), params, None)
    want = _grads(ref1.sum() + ref2.square().sum() + ref3.pow(3).sum(), params, None)
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e, atol=1e-4, rtol=1e-4)


def test_groups_op_registrations_and_compile():
    x = torch.randn(2, 4, 3, device=DEV, requires_grad=True)
    w, b = torch.randn(4, device=DEV, requires_grad=True), torch.randn(4, device=DEV, requires_grad=True)
    torch.library.opcheck(
        torch.ops.normscope.groups_fwd.default, (x, w, b, 2, 1e-5, True),
        test_utils=("test_schema", "test_faketensor", "test_autograd_registration"),
    )  # fmt: skip
    f = torch.compile(lambda x, w, b: G.group_norm(x, 2, w, b).square().sum(), fullgraph=True, backend="aot_eager")
    out = f(x, w, b)
    torch.testing.assert_close(out, F.group_norm(x, 2, w, b).square().sum(), atol=1e-4, rtol=1e-5)
    got = torch.autograd.grad(out, (x, w, b))
    want = torch.autograd.grad(F.group_norm(x, 2, w, b).square().sum(), (x, w, b))
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e, atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------------------------------------
# channels: BatchNorm (training, evaluation, running statistics)


@pytest.mark.parametrize("shape", [(6, 5), (4, 3, 7), (3, 4, 5, 2)])
def test_batch_norm_training_eval_and_running_stats_match_torch(shape, monkeypatch):
    monkeypatch.setattr(KC, "CHANNELS_BLOCK_P", 4)  # several position chunks: the two-stage reduction
    g = torch.Generator().manual_seed(len(shape))
    c = shape[1]
    x = (torch.randn(shape, generator=g) * 2 + 100).to(DEV).requires_grad_()  # a large offset too
    w = torch.randn(c, generator=g).to(DEV).requires_grad_()
    b = torch.randn(c, generator=g).to(DEV).requires_grad_()
    rm, rv = torch.randn(c, generator=g).to(DEV), (torch.rand(c, generator=g) + 0.5).to(DEV)
    rm_t, rv_t = rm.clone(), rv.clone()
    with normscope.use_backend("triton"):
        y = nf.batch_norm(x, rm, rv, w, b, training=True, momentum=0.2)
        assert normscope.last_backend() == "triton"
    F.batch_norm(x, rm_t, rv_t, w, b, True, 0.2)  # updates rm_t, rv_t
    y64 = F.batch_norm(x.double(), None, None, w.double(), b.double(), True)
    torch.testing.assert_close(y.double(), y64, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(rm, rm_t, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(rv, rv_t, atol=1e-5, rtol=1e-5)
    dy = torch.randn(shape, generator=g).to(DEV)
    got = _grads(y, (x, w, b), dy)
    want = _grads(y64, (x, w, b), dy.double())
    for a, e in zip(got, want):
        torch.testing.assert_close(a.double(), e.double(), atol=1e-4, rtol=1e-4)
    with normscope.use_backend("triton"):
        ye = nf.batch_norm(x, rm, rv, w, b, training=False)
    ye_t = F.batch_norm(x, rm, rv, w, b, False)
    torch.testing.assert_close(ye, ye_t, atol=1e-4, rtol=1e-5)
    for a, e in zip(_grads(ye, (x, w, b), dy), _grads(ye_t, (x, w, b), dy)):
        torch.testing.assert_close(a, e, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("masked", [False, True])
def test_batch_norm_outlier_first_element_keeps_torchs_accuracy(masked, monkeypatch):
    """As the rows kernels' test: a channel whose first (valid) value is an outlier (1e4 among values
    ~1) once had ~40x torch's error against float64 (every value shifted by that one); several
    position chunks, so that the shift is shared by programs. Padding holds NaN."""
    monkeypatch.setattr(KC, "CHANNELS_BLOCK_P", 4)
    g = torch.Generator().manual_seed(14)
    x = torch.randn(8, 3, 5, generator=g)
    mask = torch.ones(8, 5, dtype=torch.bool)
    if masked:
        mask[0, :2] = False  # the first valid position is (0, 2)
        x[~mask.unsqueeze(1).expand_as(x)] = float("nan")
    x[0, :, 2] = 1e4
    valid = mask.unsqueeze(1).expand_as(x).clone()
    xv = x.transpose(0, 1)[valid.transpose(0, 1)].view(3, -1)  # (C, valid values)
    want = F.layer_norm(xv.double(), (xv.shape[1],))  # a channel's statistics over its valid values
    torch_err = F.layer_norm(xv, (xv.shape[1],)).double() - want  # torch in fp32 on the same values
    others = xv != 1e4
    y = nf.batch_norm(x.to(DEV), None, None, None, None, True, mask=mask.to(DEV) if masked else None, backend="triton")
    assert normscope.last_backend() == "triton"
    got = y.cpu().transpose(0, 1)[valid.transpose(0, 1)].view(3, -1)
    err = (got.double() - want)[others].abs().max().item()
    bound = torch_err[others].abs().max().item()
    assert err <= 2 * bound + 1e-7, f"kernel {err:.3g} vs torch {bound:.3g} against float64"


def test_batch_norm_channels_last_layouts():
    g = torch.Generator().manual_seed(11)
    x = torch.randn(2, 5, 6, generator=g).to(DEV).requires_grad_()  # (B, S, D): statistics per feature
    w, b = torch.randn(6, generator=g).to(DEV), torch.randn(6, generator=g).to(DEV)
    with normscope.use_backend("triton"):
        y = nf.normalize(x, keep=-1, weight=w, bias=b, affine_dims=-1)
        assert normscope.last_backend() == "triton"
    y_t = F.batch_norm(x.reshape(-1, 6), None, None, w, b, True).reshape(2, 5, 6)
    torch.testing.assert_close(y, y_t, atol=1e-5, rtol=1e-5)
    xc = torch.randn(2, 4, 3, 3, generator=g).to(DEV).contiguous(memory_format=torch.channels_last)
    with normscope.use_backend("triton"):
        yc = normscope.BatchNorm2d(4).to(DEV)(xc)
    assert yc.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(yc, F.batch_norm(xc, None, None, training=True), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_batch_norm_low_precision_error_at_most_twice_torch(dtype):
    g = torch.Generator().manual_seed(12)
    x = (torch.randn(4, 6, 5, generator=g) * 3 + 1).to(DEV, dtype).requires_grad_()
    w = (torch.rand(6, generator=g) + 0.5).to(DEV).requires_grad_()
    b = torch.randn(6, generator=g).to(DEV).requires_grad_()
    dy = torch.randn(4, 6, 5, generator=g).to(DEV, dtype)
    with normscope.use_backend("triton"):
        y_k = nf.batch_norm(x, None, None, w, b, training=True)
    y_t = F.batch_norm(x, None, None, w, b, True)
    y64 = F.batch_norm(x.double(), None, None, w.double(), b.double(), True)
    atol = {torch.float16: 1e-3, torch.bfloat16: 1e-2}[dtype]
    triples = zip(
        (y_k, *_grads(y_k, (x, w, b), dy)),
        (y_t, *_grads(y_t, (x, w, b), dy)),
        (y64, *_grads(y64, (x, w, b), dy.double())),
    )
    for got, torch_, want in triples:
        err_k = (got.double() - want).abs().max().item()
        err_t = (torch_.double() - want).abs().max().item()
        assert err_k <= 2 * err_t + atol * want.abs().max().item() + atol, (err_k, err_t)


def test_channels_op_registrations():
    x = torch.randn(3, 4, 5, device=DEV, requires_grad=True)
    w, b = torch.randn(4, device=DEV, requires_grad=True), torch.randn(4, device=DEV, requires_grad=True)
    torch.library.opcheck(
        torch.ops.normscope.channels_fwd.default, (x, w, b, None, None, None, 1e-5),
        test_utils=("test_schema", "test_faketensor", "test_autograd_registration"),
    )  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_masked_batch_norm_matches_the_reference(dtype, monkeypatch):
    monkeypatch.setattr(KC, "CHANNELS_BLOCK_P", 4)
    g = torch.Generator().manual_seed(13)
    b_, s_, d_ = 3, 7, 5
    x = (torch.randn(b_, s_, d_, generator=g) + 50).to(DEV).requires_grad_()
    lengths = torch.tensor([7, 3, 0])  # one sequence entirely padding
    mask = (torch.arange(s_)[None, :] < lengths[:, None])[..., None].to(DEV)  # (B, S, 1): shared by features
    w = torch.randn(d_, generator=g).to(DEV).requires_grad_()
    b = torch.randn(d_, generator=g).to(DEV).requires_grad_()
    dy = torch.randn(b_, s_, d_, generator=g).to(DEV)
    run_stats = {}
    outs = {}
    for backend in ("triton", "reference"):
        rm, rv = torch.zeros(d_, device=DEV), torch.ones(d_, device=DEV)
        xin = x if backend == "triton" else x.to(dtype)  # the oracle may run in float64
        with normscope.use_backend(backend):
            y = normscope.engine.norm(
                xin,
                normscope.Scope.batch(-1),
                w.to(dtype) if backend != "triton" else w,
                b.to(dtype) if backend != "triton" else b,
                1e-5,
                mask=mask,
                running=normscope.engine.Running(rm, rv, 0.3, True),
            )
            assert normscope.last_backend() == backend
        outs[backend] = (y, *torch.autograd.grad(y, (x, w, b), dy.to(y.dtype)))
        run_stats[backend] = (rm, rv)
    for a, e in zip(outs["triton"], outs["reference"]):
        torch.testing.assert_close(a.double(), e.double(), atol=1e-4, rtol=1e-4)
    for a, e in zip(run_stats["triton"], run_stats["reference"]):
        torch.testing.assert_close(a, e, atol=1e-4, rtol=1e-4)


def test_masked_batch_norm_edge_cases():
    g = torch.Generator().manual_seed(14)
    x = torch.randn(2, 4, 3, generator=g).to(DEV)
    w, b = torch.randn(3, generator=g).to(DEV), torch.randn(3, generator=g).to(DEV)
    with normscope.use_backend("triton"):
        y = nf.normalize(
            x, keep=-1, weight=w, bias=b, affine_dims=-1, mask=torch.zeros(2, 4, 1, dtype=torch.bool, device=DEV)
        )
    torch.testing.assert_close(y, b.expand(2, 4, 3))  # no valid position: the bias, not NaN
    per_element = torch.rand(2, 4, 3, generator=g).to(DEV) > 0.3  # varies along the channel axis
    with normscope.use_backend("triton"):
        y = nf.normalize(x, keep=-1, weight=w, bias=b, affine_dims=-1, mask=per_element)
    with normscope.use_backend("reference"):
        want = nf.normalize(x, keep=-1, weight=w, bias=b, affine_dims=-1, mask=per_element)
    torch.testing.assert_close(y, want)


def test_masked_batch_norm_says_reference_when_the_mask_varies_along_channels():
    # a per-element mask has no kernel: the backend hands the call to the reference, and
    # last_backend() must say so rather than "triton"
    g = torch.Generator().manual_seed(15)
    x = torch.randn(3, 5, 4, generator=g).to(DEV)
    w, b = torch.randn(4, generator=g).to(DEV), torch.randn(4, generator=g).to(DEV)
    per_position = (torch.arange(5)[None, :] < torch.tensor([5, 2, 4])[:, None])[..., None].to(DEV)  # (B, S, 1)
    per_element = torch.rand(3, 5, 4, generator=g).to(DEV) > 0.4  # (B, S, D): differs between features
    with normscope.use_backend("triton"):
        y_pos = nf.normalize(x, keep=-1, weight=w, bias=b, affine_dims=-1, mask=per_position)
        assert normscope.last_backend() == "triton"
        y_el = nf.normalize(x, keep=-1, weight=w, bias=b, affine_dims=-1, mask=per_element)
        assert normscope.last_backend() == "reference"
    for y, m in ((y_pos, per_position), (y_el, per_element)):
        want = direct(x, (0, 1), affine=(2,), weight=w, bias=b, mask=m)
        torch.testing.assert_close(y.double(), want, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# CUDA only: realistic sizes (many programs and waves, long rows, channels_last, > 2**31 elements),
# which the interpreter cannot afford. The oracles are torch in float64, as above.


def _assert_within_twice_torch(ours, torch_same, want, dtype, what):
    """Each of ``ours`` is within twice the error of torch in the same dtype (plus a small atol)."""
    atol = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-2}[dtype]
    for i, (got, tt, w) in enumerate(zip(ours, torch_same, want)):
        assert got.dtype == tt.dtype, f"{what} output {i}: dtype {got.dtype}, torch gives {tt.dtype}"
        err_k = (got.double() - w).abs().max().item()
        err_t = (tt.double() - w).abs().max().item()
        bound = 2 * err_t + atol * w.abs().max().item() + atol
        assert err_k <= bound, f"{what} output {i}: error {err_k:.3g} > bound {bound:.3g} (torch's {err_t:.3g})"


@cuda_only
@pytest.mark.parametrize("m,n", [(4096, 1024), (1024, 8192), (64, 20000), (8, 131072), (3, 262144)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("centered", [True, False])
def test_rows_at_realistic_sizes(m, n, dtype, centered):
    g = torch.Generator().manual_seed(n)
    x = (torch.randn(m, n, generator=g) * 2 + 1).to(DEV, dtype).requires_grad_()
    w = (torch.rand(n, generator=g) + 0.5).to(DEV, dtype).requires_grad_()
    b = torch.randn(n, generator=g).to(DEV, dtype).requires_grad_() if centered else None
    dy = torch.randn(m, n, generator=g).to(DEV, dtype)
    with normscope.use_backend("triton"):  # the kernel (automatic mode takes it only where measured faster)
        y_k = nf.layer_norm(x, (n,), w, b, 1e-5) if centered else nf.rms_norm(x, (n,), w, 1e-5)
        assert normscope.last_backend() == "triton"
    y_t = F.layer_norm(x, (n,), w, b, 1e-5) if centered else F.rms_norm(x, (n,), w, 1e-5)
    y64 = _ref64(x, w, b, None, centered, 0.0)
    ours = (y_k, *_grads(y_k, (x, w, b), dy))
    theirs = (y_t, *_grads(y_t, (x, w, b), dy))
    want = (y64, *_grads(y64, (x, w, b), dy.double()))
    _assert_within_twice_torch(ours, theirs, want, dtype, f"rows {m}x{n} {dtype} centered={centered}")


@cuda_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_add_rms_norm_at_realistic_sizes(dtype):
    g = torch.Generator().manual_seed(16)
    m, n = 2048, 4096
    x = torch.randn(m, n, generator=g).to(DEV, dtype).requires_grad_()
    r = (torch.randn(m, n, generator=g) * 4).to(DEV, dtype).requires_grad_()
    w = (torch.rand(n, generator=g) + 0.5).to(DEV, dtype).requires_grad_()
    y, h = fused_add_rms_norm(x, r, w, 1e-6, backend="triton")
    h_t = x + r
    assert torch.equal(h, h_t), "the new residual must be exactly torch's x + r (same rounding)"
    y_t = F.rms_norm(h_t, (n,), w, 1e-6)
    y64 = _ref64(x, w, None, r, False, 0.0, eps=1e-6)
    dy, dh = torch.randn(m, n, generator=g).to(DEV, dtype), torch.randn(m, n, generator=g).to(DEV, dtype)
    ours = (y, *_grads((y, h), (x, r, w), (dy, dh)))
    theirs = (y_t, *_grads((y_t, h_t), (x, r, w), (dy, dh)))
    want = (y64, *_grads((y64, x.double() + r.double()), (x, r, w), (dy.double(), dh.double())))
    _assert_within_twice_torch(ours, theirs, want, dtype, f"fused add + RMSNorm {dtype}")


@cuda_only
@pytest.mark.parametrize("shape,groups", [((8, 64, 32, 32), 32), ((2, 320, 64, 64), 32), ((4, 96, 17, 13), 8)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("channels_last", [False, True])
def test_groups_at_realistic_sizes(shape, groups, dtype, channels_last):
    g = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(shape, generator=g) * 3 + 1).to(DEV, dtype)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    x.requires_grad_()
    w = (torch.rand(shape[1], generator=g) + 0.5).to(DEV, dtype).requires_grad_()
    b = torch.randn(shape[1], generator=g).to(DEV, dtype).requires_grad_()
    dy = torch.randn(shape, generator=g).to(DEV, dtype)
    with normscope.use_backend("triton"):
        y_k = nf.group_norm(x, groups, w, b, 1e-5)
        assert normscope.last_backend() == "triton"
    y_t = F.group_norm(x, groups, w, b, 1e-5)
    assert y_k.is_contiguous(memory_format=torch.channels_last) == channels_last
    y64 = _group64(x, groups, w, b, True)
    ours = (y_k, *_grads(y_k, (x, w, b), dy))
    theirs = (y_t, *_grads(y_t, (x, w, b), dy))
    want = (y64, *_grads(y64, (x, w, b), dy.double()))
    _assert_within_twice_torch(ours, theirs, want, dtype, f"GroupNorm({groups}) {shape} {dtype} cl={channels_last}")


@cuda_only
@pytest.mark.parametrize("shape", [(32, 64, 28, 28), (16, 256, 14, 14), (4096, 512)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batch_norm_at_realistic_sizes(shape, dtype):
    g = torch.Generator().manual_seed(sum(shape))
    c = shape[1]
    x = (torch.randn(shape, generator=g) * 2 + 3).to(DEV, dtype).requires_grad_()
    w = (torch.rand(c, generator=g) + 0.5).to(DEV).requires_grad_()  # fp32 parameters, as cuDNN wants
    b = torch.randn(c, generator=g).to(DEV).requires_grad_()
    dy = torch.randn(shape, generator=g).to(DEV, dtype)
    rm, rv = torch.zeros(c, device=DEV), torch.ones(c, device=DEV)
    rm_t, rv_t = rm.clone(), rv.clone()
    with normscope.use_backend("triton"):
        y_k = nf.batch_norm(x, rm, rv, w, b, True, 0.1, 1e-5)
    y_t = F.batch_norm(x, rm_t, rv_t, w, b, True, 0.1, 1e-5)
    y64 = F.batch_norm(x.double(), None, None, w.double(), b.double(), True, 0.1, 1e-5)
    torch.testing.assert_close(rm, rm_t, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(rv, rv_t, atol=1e-5, rtol=1e-4)
    ours = (y_k, *_grads(y_k, (x, w, b), dy))
    theirs = (y_t, *_grads(y_t, (x, w, b), dy))
    want = (y64, *_grads(y64, (x, w, b), dy.double()))
    _assert_within_twice_torch(ours, theirs, want, dtype, f"BatchNorm {shape} {dtype}")


def _masked_bn64(x, w, b, mask, eps):
    """float64 masked BatchNorm1d on (B, S, D), differentiable, straight from the formula."""
    xf, mf = x.double(), mask.double()
    cnt = mf.sum((0, 1))
    mean = (xf * mf).sum((0, 1)) / cnt
    var = ((xf - mean) ** 2 * mf).sum((0, 1)) / cnt
    return (xf - mean) * torch.rsqrt(var + eps) * w.double() + b.double()


@cuda_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_masked_batch_norm_at_realistic_sizes(dtype):
    g = torch.Generator().manual_seed(17)
    bsz, s, d = 16, 512, 768
    x = (torch.randn(bsz, s, d, generator=g) + 2).to(DEV, dtype).requires_grad_()
    lengths = torch.randint(s // 8, s + 1, (bsz,), generator=g)
    mask = (torch.arange(s)[None, :] < lengths[:, None])[..., None].to(DEV)
    w = (torch.rand(d, generator=g) + 0.5).to(DEV, dtype).requires_grad_()
    b = torch.randn(d, generator=g).to(DEV, dtype).requires_grad_()
    dy = torch.randn(bsz, s, d, generator=g).to(DEV, dtype)
    with normscope.use_backend("triton"):
        y = nf.normalize(x, keep=-1, weight=w, bias=b, affine_dims=-1, eps=1e-5, mask=mask)
        assert normscope.last_backend() == "triton"
    y64 = _masked_bn64(x, w, b, mask, 1e-5)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    for i, (got, want) in enumerate(zip((y, *_grads(y, (x, w, b), dy)), (y64, *_grads(y64, (x, w, b), dy.double())))):
        err, scale = (got.double() - want).abs().max().item(), want.abs().max().item()
        assert err <= tol * (1 + scale), f"masked BatchNorm {dtype} output {i}: error {err:.3g}, scale {scale:.3g}"


@cuda_only
@pytest.mark.parametrize("kind", ["rows", "groups", "channels"])
def test_more_than_2_31_elements(kind):
    """Offsets past 2**31 elements (bf16, 4.3 GB per tensor): an int32 index would wrap around."""
    if torch.cuda.get_device_properties(DEV).total_memory < (40 << 30):
        pytest.skip("needs a GPU with at least 40 GB")
    torch.manual_seed(18)
    big = 2**31
    with torch.no_grad():
        if kind == "rows":
            n = 8192
            x = torch.randn(big // n + 3, n, device=DEV, dtype=torch.bfloat16)
            y, _ = R.rows_norm(x, None, None, 1e-5, True)
            rows = [0, big // n - 1, big // n, x.shape[0] - 1]  # the row that starts at element 2**31 too
            want = F.layer_norm(x[rows].double(), (n,), eps=1e-5)
            torch.testing.assert_close(y[rows].double(), want, atol=2e-2, rtol=1e-2)
        elif kind == "groups":
            x = torch.randn(2, 64, big // 128 + 5, device=DEV, dtype=torch.bfloat16)
            y = G.group_norm(x, 32, None, None, 1e-5)
            for nn_, grp in ((0, 0), (1, 31)):  # the last group ends past 2**31
                xs = x[nn_, 2 * grp : 2 * grp + 2]
                mean = xs.sum(dtype=torch.float64) / xs.numel()
                var = sum(((c.double() - mean) ** 2).sum() for c in xs) / xs.numel()
                tail = xs[:, -1000:].double()
                want = (tail - mean) / torch.sqrt(var + 1e-5)
                torch.testing.assert_close(y[nn_, 2 * grp : 2 * grp + 2, -1000:].double(), want, atol=2e-2, rtol=1e-2)
        else:
            x = torch.randn(16, 2, big // 32 + 7, device=DEV, dtype=torch.bfloat16)
            y, mean, var, _ = CH.batch_norm_channels(x, 1, None, None, 1e-5)
            for c in range(2):
                xc = x[:, c]
                m64 = xc.sum(dtype=torch.float64) / xc.numel()
                v64 = sum(((row.double() - m64) ** 2).sum() for row in xc) / xc.numel()
                torch.testing.assert_close(mean.reshape(-1)[c].double(), m64, atol=1e-4, rtol=0)
                torch.testing.assert_close(var.reshape(-1)[c].double(), v64, atol=0, rtol=1e-4)
                want = (xc[-1, -1000:].double() - m64) / torch.sqrt(v64 + 1e-5)
                torch.testing.assert_close(y[-1, c, -1000:].double(), want, atol=2e-2, rtol=1e-2)
    del x, y
    torch.cuda.empty_cache()
