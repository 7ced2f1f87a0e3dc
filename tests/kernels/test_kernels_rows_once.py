"""The read-once rows kernels (kernels/rows_once.py) against independent float64 oracles, and the rules
of their choice (kernels/variants.py, backends/measured.py): off unless forced or measured.

On the CPU the kernels run in Triton's interpreter with launch settings shrunk so that tiny rows take
every path: a row read whole by one program (``one``) and rows split over several programs that combine
their partial sums (``split``, with a partial last chunk), forward and backward. The interpreter runs
the split kernels as two launches (it runs programs one at a time: none can wait for another); with
``NORMSCOPE_TEST_DEVICE=cuda`` the same tests run the synchronised single launch, and the CUDA-only tests
at the end hold it bitwise equal to the two-launch form, check rows of the bench's lengths against
float64 with torch's own error as the yardstick, and check that no program gave up waiting.
"""

import itertools

import pytest
import torch
import torch.nn.functional as F

from conftest import TEST_DEVICE, sample_alone_and_in_batches

pytest.importorskip("triton", reason="the kernel tests need Triton (pip install 'normscope[kernels]')")

import normscope  # noqa: E402
from normscope import _registry  # noqa: E402
from normscope import functional as nf  # noqa: E402
from normscope.backends import measured  # noqa: E402
from normscope.kernels import config as KC  # noqa: E402
from normscope.kernels import rows as R  # noqa: E402
from normscope.kernels import rows_once as RO  # noqa: E402
from normscope.kernels import variants  # noqa: E402

DEV = torch.device(TEST_DEVICE)
ON_CPU = DEV.type == "cpu"
cuda_only = pytest.mark.skipif(ON_CPU, reason="realistic sizes and the synchronised launch run only on CUDA")

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

#: (row length, forward plan (BLOCK_N, S), backward plan) under the shrunk settings of ``path``
PATHS = {
    # fwd: one program reads the row (16 >= next_pow2(13)); bwd: one program per row too (chunk 16)
    "one": (13, {"ROWS_ONCE_BWD_CHUNK": 16}, (16, 1), (16, 1)),
    # fwd: 3 chunks of 16 (the last one 8 long); bwd: 5 chunks of 8
    "split": (40, {}, (16, 3), (8, 5)),
}


@pytest.fixture
def small(monkeypatch):
    """Launch settings that make tiny rows take the read-once kernels and their splits."""
    for name, value in {
        "ROWS_MAX_FUSED_N": 8,  # the default single block: rows of 8 at most; longer ones come here
        "ROWS_ONCE_MAX_N": 16,
        "ROWS_ONCE_FWD_CHUNK": 16,
        "ROWS_ONCE_BWD_CHUNK": 8,
    }.items():
        monkeypatch.setattr(KC, name, value)


@pytest.fixture(params=list(PATHS))
def path(request, small, monkeypatch):
    n, knobs, fwd, bwd = PATHS[request.param]
    for name, value in knobs.items():
        monkeypatch.setattr(KC, name, value)
    probe = torch.empty(0, device=DEV)
    # the test runs the path it names: the plans are functions of the row length alone
    assert RO.fwd_plan(n, probe)[:2] == fwd and RO.bwd_plan(n, probe)[:2] == bwd
    return n


@pytest.fixture
def launches(monkeypatch):
    """Counts of the read-once kernels' launches (a spy on ``kernel[grid]``), forward and backward."""
    counts = {"fwd": 0, "bwd": 0}
    names = {id(RO._once_fwd_kernel): "fwd", id(RO._once_bwd_kernel): "bwd"}
    cls = type(RO._once_fwd_kernel)
    orig = cls.__getitem__

    def spy(self, grid):
        if id(self) in names:
            counts[names[id(self)]] += 1
        return orig(self, grid)

    monkeypatch.setattr(cls, "__getitem__", spy)
    return counts


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
    return torch.autograd.grad(outputs, [t for t in inputs if t is not None], cotangents, allow_unused=True)


FLAGS = list(itertools.product([True, False], repeat=4))  # centered, weight, bias, residual


@pytest.mark.parametrize("centered,has_w,has_b,has_r", FLAGS)
def test_forward_and_gradients_match_float64(path, centered, has_w, has_b, has_r, launches):
    n = path
    g = torch.Generator().manual_seed(n)
    m = 7  # several rows per group of programs: the interpreter runs 4 groups at most
    x = (torch.randn(m, n, generator=g) * 2 + 1).to(DEV).requires_grad_()
    w = (torch.rand(n, generator=g) + 0.5).to(DEV).requires_grad_() if has_w else None
    b = torch.randn(n, generator=g).to(DEV).requires_grad_() if has_b else None
    r = torch.randn(m, n, generator=g).to(DEV).requires_grad_() if has_r else None
    offset = 0.5 if has_w else 0.0
    y, s = RO.rows_norm(x, w, b, 1e-5, centered, residual=r, weight_offset=offset)
    y64 = _ref64(x, w, b, r, centered, offset)
    torch.testing.assert_close(y.double(), y64, atol=2e-5, rtol=1e-5)
    dy = torch.randn(m, n, generator=g).to(DEV)
    if has_r:
        torch.testing.assert_close(s, x + r, atol=0, rtol=0)  # fp32: the same rounding of the same sum
        ds = torch.randn(m, n, generator=g).to(DEV)
        got = _grads((y, s), (x, w, b, r), (dy, ds))
        want = _grads((y64, x.double() + r.double()), (x, w, b, r), (dy.double(), ds.double()))
    else:
        assert s is None
        got = _grads(y, (x, w, b), dy)
        want = _grads(y64, (x, w, b), dy.double())
    for a, e in zip(got, want):
        torch.testing.assert_close(a.double(), e.double(), atol=5e-5, rtol=1e-4)
    assert launches["fwd"] >= 1 and launches["bwd"] >= 1  # the read-once kernels ran, not the default


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("centered", [True, False])
def test_low_precision_error_at_most_twice_torch(path, dtype, centered):
    """The rule of tests/kernels/test_kernels.py: against float64, at most twice the error of torch's
    own computation in the same dtype, plus a small atol -- output and every gradient."""
    n = path
    g = torch.Generator().manual_seed(1)
    m = 6
    x = (torch.randn(m, n, generator=g) * 3 + 1).to(DEV, dtype).requires_grad_()
    w = (torch.rand(n, generator=g) + 0.5).to(DEV, dtype).requires_grad_()
    b = torch.randn(n, generator=g).to(DEV, dtype).requires_grad_() if centered else None
    dy = torch.randn(m, n, generator=g).to(DEV, dtype)
    y64 = _ref64(x, w, b, None, centered, 0.0)
    y_k, _ = RO.rows_norm(x, w, b, 1e-5, centered)
    y_t = F.layer_norm(x, (n,), w, b, 1e-5) if centered else F.rms_norm(x, (n,), w, 1e-5)
    g64, g_k, g_t = _grads(y64, (x, w, b), dy.double()), _grads(y_k, (x, w, b), dy), _grads(y_t, (x, w, b), dy)
    atol = {torch.float16: 1e-3, torch.bfloat16: 1e-2, torch.float32: 1e-5}[dtype]
    for got, torch_, want in zip((y_k, *g_k), (y_t, *g_t), (y64, *g64)):
        assert got.dtype == dtype
        err_k = (got.double() - want).abs().max().item()
        err_t = (torch_.double() - want).abs().max().item()
        assert err_k <= 2 * err_t + atol * want.abs().max().item() + atol, (err_k, err_t)


def test_large_offset_small_spread_normalizes_to_unit_variance(path):
    """Mean 1e4, std 1e-2 in fp32 (E[x^2] - E[x]^2 would lose every digit); the split path combines chunks
    whose fp32 means are each rounded to 1e-3 -- the spread's tenth -- so their differences must not be
    taken from those roundings alone."""
    g = torch.Generator().manual_seed(3)
    x = (1e4 + 1e-2 * torch.randn(4, path, generator=g)).to(DEV)
    x[:, path // 2 :] += 3e-2  # chunk means that differ by a few spreads
    y, _ = RO.rows_norm(x, None, None, 0.0, True)
    var = y.double().var(-1, unbiased=False)
    torch.testing.assert_close(var, torch.ones_like(var), atol=1e-3, rtol=0)  # torch CPU: ~4e-2
    want = F.layer_norm(x.double(), (path,), eps=0.0)
    err = (y.double() - want).abs().max().item()
    torch_err = (F.layer_norm(x, (path,), eps=0.0).double() - want).abs().max().item()
    assert err <= 2 * torch_err + 1e-3, (err, torch_err)


def test_outlier_first_element_and_constant_rows(path):
    """A massive activation first in the row keeps torch's accuracy on the others (shifting by the first
    element did not); constant rows near fp32's largest value give the bias (no overflow in a mean)."""
    n = path
    g = torch.Generator().manual_seed(12)
    x = torch.randn(4, n, generator=g)
    x[:, 0] = 1e4
    x = x.to(DEV)
    want = F.layer_norm(x.double(), (n,))[:, 1:]
    got, _ = RO.rows_norm(x, None, None, 1e-5, True)
    torch_err = (F.layer_norm(x, (n,)).double()[:, 1:] - want).abs().max().item()
    err = (got.double()[:, 1:] - want).abs().max().item()
    assert err <= 2 * torch_err + 1e-6, f"kernel {err:.3g} vs torch {torch_err:.3g} against float64"
    c = torch.full((2, n), 3e38, device=DEV)
    c[1] = -2e38
    b = torch.randn(n, generator=g).to(DEV)
    y, _ = RO.rows_norm(c, None, b, 1e-5, True)
    torch.testing.assert_close(y, b.expand(2, n), rtol=0, atol=0)


def test_weight_gradient_is_deterministic_and_right(path):
    g = torch.Generator().manual_seed(4)
    m, n = 11, path  # 11 rows over the groups of programs: each group's dW partial sums several rows
    x = torch.randn(m, n, generator=g).to(DEV)
    w = torch.randn(n, generator=g).to(DEV).requires_grad_()
    b = torch.randn(n, generator=g).to(DEV).requires_grad_()
    dy = torch.randn(m, n, generator=g).to(DEV)
    runs = []
    for _ in range(2):
        xx = x.clone().requires_grad_()
        y, _ = RO.rows_norm(xx, w, b, 1e-5, True)
        runs.append(torch.autograd.grad(y, (xx, w, b), dy))
    for a, b_ in zip(*runs):
        assert torch.equal(a, b_), "two runs of the same call differ"
    want = _grads(_ref64(x.requires_grad_(), w, b, None, True, 0.0), (w, b), dy.double())
    for a, e in zip(runs[0][1:], want):
        torch.testing.assert_close(a.double(), e.double(), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm", "add_rms_norm"])
def test_a_row_is_the_same_bits_alone_and_in_any_batch(path, op, monkeypatch):
    """Scope isolation: the split, the chunk, the warps and the combine order depend on the row length
    alone, so a sample's output and input gradient are bitwise equal alone and in batches -- also where
    the batch changes how many groups of programs share the rows (3 in the interpreter here)."""
    monkeypatch.setattr(KC, "INTERPRETER_PROGRAMS", 3)
    n = path
    torch.manual_seed(1)
    w, b = torch.randn(n, device=DEV), torch.randn(n, device=DEV)
    # values over several magnitudes: a sum taken in another order then differs in bits that reach the output
    spread = torch.exp(2 * torch.randn(3, 2 * n, device=DEV))
    if op == "add_rms_norm":
        sample = torch.randn(3, 2 * n, device=DEV) * spread  # x and the residual side by side

        def fn(xb):
            y, h = nf.fused_add_rms_norm(xb[..., :n], xb[..., n:], w, backend="triton")
            return torch.cat([y, h], -1)
    else:
        sample = (torch.randn(3, n, device=DEV) * 2 + 1) * spread[:, :n]

        def fn(xb):
            if op == "layer_norm":
                return nf.layer_norm(xb, (n,), w, b, backend="triton")
            return nf.rms_norm(xb, (n,), w, backend="triton")

    with variants.use_variant("rows", "rows_once"):
        sample_alone_and_in_batches(fn, sample, ((2, 0), (5, 3), (9, 8)))


def test_strided_rows_and_empty_batch(small):
    base = torch.randn(6, 64, device=DEV)
    x = base[:, 5:45]  # rows of 40 with a row stride of 64: read in place
    r = torch.randn(40, 6, device=DEV).t()  # a residual whose last axis is not unit-stride: copied once
    w = torch.randn(40, device=DEV)
    y, s = RO.rows_norm(x, w, None, 1e-5, False, residual=r)
    torch.testing.assert_close(s, x + r, atol=0, rtol=0)
    torch.testing.assert_close(y, F.rms_norm(x + r, (40,), w, 1e-5), atol=1e-5, rtol=1e-5)
    e = torch.randn(0, 40, device=DEV, requires_grad=True)
    y, _ = RO.rows_norm(e, w, None, 1e-5, True)
    assert y.shape == (0, 40)
    (ge,) = torch.autograd.grad(y.sum(), e)
    assert ge.shape == (0, 40)


def test_long_rows_with_default_settings():
    """The settings as shipped: 40000 columns take the split forward (chunks of ROWS_ONCE_FWD_CHUNK) and
    backward; 20000 one program forward. Against torch, output and gradients."""
    for n in (20000, 40000):
        assert RO.fwd_plan(n, torch.empty(0, device=DEV)) is not None
        g = torch.Generator().manual_seed(n)
        x = (torch.randn(2, n, generator=g) * 2 + 3).to(DEV).requires_grad_()
        w, b = (torch.randn(n, generator=g).to(DEV).requires_grad_() for _ in range(2))
        y, _ = RO.rows_norm(x, w, b, 1e-5, True)
        want = F.layer_norm(x, (n,), w, b, 1e-5)
        torch.testing.assert_close(y, want, atol=1e-5, rtol=1e-5)
        dy = torch.randn(2, n, generator=g).to(DEV)
        for a, e in zip(_grads(y, (x, w, b), dy), _grads(want, (x, w, b), dy)):
            torch.testing.assert_close(a, e, atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(not ON_CPU, reason="on a GPU every program of the launch is resident: every wait ends")
def test_a_wait_that_cannot_end_gives_up_and_is_counted(small, monkeypatch):
    """The synchronised launch in the interpreter, which runs programs one after another: a program waits
    for chunks whose programs run after it, so the wait cannot end -- it must give up (no hang) and be
    counted (``timeouts``). The last program of each row waits for nobody: its chunk checks the
    synchronised path's own arithmetic (its prefetch, its combine) -- bitwise equal to the two-launch
    form's, as the GPU test holds for every chunk, and right against float64."""
    g = torch.Generator().manual_seed(13)
    m = 7  # 4 groups of programs: some take two rows, the second one prefetched
    x = (torch.randn(m, 40, generator=g) * 2 + 1).to(DEV)
    w, b = (torch.randn(40, generator=g).to(DEV) for _ in range(2))
    dy = torch.randn(m, 40, generator=g).to(DEV)
    mean, rstd = x.mean(-1), torch.rsqrt(x.var(-1, unbiased=False) + 1e-5)
    y2 = RO._fwd_impl(x, w, b, None, 1e-5, True, 0.0, False)[0]  # the two-launch form first
    dx2 = RO._bwd_impl(dy, None, x, w, mean, rstd, True, True, 0.0)[0]
    monkeypatch.setattr(RO, "_two_phase", lambda x: False)
    monkeypatch.setattr(RO, "_MAX_SPINS", 3)
    before = RO.timeouts(DEV)
    y = RO._fwd_impl(x, w, b, None, 1e-5, True, 0.0, False)[0]
    assert RO.timeouts(DEV) - before == m * 2  # per row, chunks 0 and 1 (of 3) gave up
    assert torch.equal(y[:, 32:], y2[:, 32:])  # the last chunk
    want = F.layer_norm(x.double(), (40,), w.double(), b.double(), 1e-5)
    torch.testing.assert_close(y[:, 32:].double(), want[:, 32:], atol=2e-5, rtol=1e-5)
    before = RO.timeouts(DEV)
    dx = RO._bwd_impl(dy, None, x, w, mean, rstd, True, True, 0.0)[0]
    assert RO.timeouts(DEV) - before == m * 4  # chunks 0 to 3 (of 5)
    assert torch.equal(dx[:, 32:], dx2[:, 32:])
    x64 = x.double().requires_grad_()
    (dx64,) = torch.autograd.grad(F.layer_norm(x64, (40,), w.double(), b.double(), 1e-5), x64, dy.double())
    torch.testing.assert_close(dx[:, 32:].double(), dx64[:, 32:], atol=5e-5, rtol=1e-4)


def test_rows_default_kernel_covers_when_the_plan_declines(small, launches):
    """Rows within the default single block (the read-once kernels would read them once the same way) run
    the default kernel: no read-once launch, its bits."""
    x = torch.randn(3, 7, device=DEV)
    assert RO.fwd_plan(7, x) is None and RO.bwd_plan(7, x) is None
    y, _ = RO.rows_norm(x, None, None, 1e-5, True)
    assert torch.equal(y, R.rows_norm(x, None, None, 1e-5, True)[0])
    assert _ran(launches) == (False, False)


# ----------------------------------------------------------------------------------------------
# the choice: off by default, on where forced or where a measurement names it


def _layer_norm_call(n, m=3):
    x = torch.randn(m, n, device=DEV, requires_grad=True)
    w = torch.randn(n, device=DEV, requires_grad=True)
    y = nf.layer_norm(x, (n,), w, None, 1e-5)
    y.sum().backward()
    return y


def _ran(launches) -> tuple[bool, bool]:
    """Whether the read-once forward and backward kernels launched since the counts were last cleared."""
    ran = (launches["fwd"] > 0, launches["bwd"] > 0)
    launches.update(fwd=0, bwd=0)
    return ran


def test_forced_triton_runs_the_default_kernel_unless_overridden(small, launches):
    _registry.clear_plans()
    with normscope.use_backend("triton"):
        _layer_norm_call(40)
        assert normscope.last_backend() == "triton"
        assert _ran(launches) == (False, False), "the candidates ran without an override or a measurement"
        with variants.use_variant("rows", "rows_once"):  # read per call: the plan made above obeys it too
            _layer_norm_call(40)
        assert normscope.last_backend() == "triton"
        assert _ran(launches) == (True, True)
        with variants.use_variant("rows", "rows_once"), variants.use_variant("rows", None):  # None: pin, else table
            _layer_norm_call(40)
        assert _ran(launches) == (False, False)
    assert variants.forced("rows") is None
    with pytest.raises(ValueError, match=r"expected one of \('rows', 'rows_once'\) or None for 'rows', got 'fast'"):
        with variants.use_variant("rows", "fast"):
            pass


def test_automatic_choice_never_takes_the_candidates_without_a_measurement(small, launches):
    """Automatic: the kernels only on CUDA and only inside a measured range (on the CPU: never); an
    override chooses among the Triton kernels, not the backend."""
    _registry.clear_plans()
    with variants.use_variant("rows", "rows_once"):
        _layer_norm_call(40)  # fp32 rows of 40: in no measured range of any committed table
    assert normscope.last_backend() == "aten"
    assert _ran(launches) == (False, False)
    committed = measured._load("cuda-sm90")
    assert committed and all(c.variant is None for c in committed), "a committed table names the candidates"


def test_a_measured_row_naming_the_kernel_is_what_forced_triton_runs(small, launches, monkeypatch):
    """A row of the device class's table with ``"variant": "rows_once"`` makes the triton backend run the
    candidate inside its range (here on the interpreter's device class, ``cpu``, so that the forced
    backend reaches it), and the default kernel outside it and for other ops and dtypes."""
    cls = measured.device_class(DEV)
    rows = (
        measured.Choice("layer_norm", "float32", 33, 48, "rows_once"),
        measured.Choice("rms_norm", "float32", 33, 48),
    )
    monkeypatch.setitem(measured._TABLES, cls, rows)
    _registry.clear_plans()
    try:
        with normscope.use_backend("triton"):
            _layer_norm_call(40)
            assert _ran(launches) == (True, True)
            _layer_norm_call(56)  # outside the range
            x = torch.randn(3, 40, device=DEV)
            nf.rms_norm(x, (40,))  # a row without a variant: the default kernel
            assert _ran(launches) == (False, False)
            with variants.use_variant("rows", "rows"):  # the override beats the table
                _layer_norm_call(40)
            assert _ran(launches) == (False, False)
        assert measured.variant("layer_norm", torch.float32, 40, DEV) == "rows_once"
        assert measured.variant("layer_norm", torch.float32, 49, DEV) is None
    finally:
        _registry.clear_plans()


def test_the_table_names_only_known_kernels(tmp_path):
    entry = '{"op": "rms_norm", "dtype": "bfloat16", "n_min": 1, "n_max": 2, "variant": "rows_once"}'
    ok = f'{{"schema": 1, "choices": [{entry}]}}'
    (tmp_path / "a.json").write_text(ok)
    assert measured.load(tmp_path / "a.json")[0].variant == "rows_once"
    for op, kernel in (("rms_norm", "fast"), ("group_norm", "rows_once")):
        bad = ok.replace('"rms_norm"', f'"{op}"').replace('"rows_once"', f'"{kernel}"')
        (tmp_path / "b.json").write_text(bad)
        with pytest.raises(ValueError, match=f"unknown variant '{kernel}' for {op}"):
            measured.load(tmp_path / "b.json")


# ----------------------------------------------------------------------------------------------
# torch.library registration and torch.compile


def test_custom_op_registrations(small):
    """Schemas, fake shapes and autograd registration (the backward op has none of its own: double
    backward evaluates a differentiable form, as for normscope::rows_fwd)."""
    x = torch.randn(3, 40, device=DEV, requires_grad=True)
    w, b = torch.randn(40, device=DEV, requires_grad=True), torch.randn(40, device=DEV, requires_grad=True)
    r = torch.randn(3, 40, device=DEV, requires_grad=True)
    utils = ("test_schema", "test_faketensor", "test_autograd_registration")
    for args in ((x, w, b, r, 1e-5, True, 0.5, False), (x, w, None, None, 1e-5, False, 0.0, False)):
        torch.library.opcheck(torch.ops.normscope.rows_once_fwd.default, args, test_utils=utils)
    with torch.no_grad():
        y, s, mean, rstd = torch.ops.normscope.rows_once_fwd(x, w, b, None, 1e-5, True, 0.0, False)
    args = (torch.randn_like(y), None, x.detach(), w.detach(), mean, rstd, True, True, 0.0)
    utils = ("test_schema", "test_faketensor")
    torch.library.opcheck(torch.ops.normscope.rows_once_bwd.default, args, test_utils=utils)


def test_eager_path_and_custom_op_are_bitwise_equal(small):
    """Eager mode launches through a plain autograd.Function (kernels/_eager.py), a trace through the custom
    op: the same launches, the same bits -- output, input and weight gradients."""
    g = torch.Generator().manual_seed(8)
    x = torch.randn(5, 40, generator=g).to(DEV).requires_grad_()
    w, b = (torch.randn(40, generator=g).to(DEV).requires_grad_() for _ in range(2))
    dy = torch.randn(5, 40, generator=g).to(DEV)
    y, _ = RO.rows_norm(x, w, b, 1e-5, True)
    y_op = torch.ops.normscope.rows_once_fwd(x, w, b, None, 1e-5, True, 0.0, False)[0]
    assert torch.equal(y, y_op)
    for a, e in zip(torch.autograd.grad(y, (x, w, b), dy), torch.autograd.grad(y_op, (x, w, b), dy)):
        assert torch.equal(a, e)


def test_double_backward_routes_to_a_differentiable_form(small):
    """create_graph=True (a gradient penalty): second derivatives through the read-once op, against float64."""
    g = torch.Generator().manual_seed(9)
    x = torch.randn(3, 40, generator=g).to(DEV).requires_grad_()
    w = (torch.rand(40, generator=g) + 0.5).to(DEV).requires_grad_()
    x64, w64 = (t.detach().double().requires_grad_() for t in (x, w))
    y, _ = RO.rows_norm(x, w, None, 1e-5, True)
    (gx,) = torch.autograd.grad(y.square().sum(), x, create_graph=True)
    y64 = F.layer_norm(x64, (40,), w64, None, 1e-5)
    (gx64,) = torch.autograd.grad(y64.square().sum(), x64, create_graph=True)
    got = torch.autograd.grad(gx.square().sum(), (x, w))
    want = torch.autograd.grad(gx64.square().sum(), (x64, w64))
    for a, e in zip(got, want):
        torch.testing.assert_close(a.double(), e, atol=1e-4, rtol=1e-4)


def test_compiles_without_graph_breaks(small, launches):
    """The custom ops trace with fullgraph=True, directly and through the engine (the override is read
    while tracing: the graph keeps the kernel chosen then); gradients equal eager's bit for bit."""
    torch._dynamo.reset()
    x = torch.randn(3, 40, device=DEV, requires_grad=True)
    w = torch.randn(40, device=DEV, requires_grad=True)
    r = torch.randn(3, 40, device=DEV, requires_grad=True)

    def direct(x, w, r):
        y, s = RO.rows_norm(x, w, None, 1e-5, False, residual=r)
        return y * s

    def engine(x, w):
        return nf.layer_norm(x, (40,), w, None, 1e-5, backend="triton")

    for fn, args in ((direct, (x, w, r)), (engine, (x, w))):
        with variants.use_variant("rows", "rows_once"):
            eager = fn(*args)
            before = dict(launches)
            compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")(*args)
            assert launches["fwd"] > before["fwd"], "the compiled graph did not run the read-once kernel"
        torch.testing.assert_close(compiled, eager, atol=0, rtol=0)
        got = torch.autograd.grad(compiled.square().sum(), args)
        want = torch.autograd.grad(eager.square().sum(), args)
        for a, e in zip(got, want):
            torch.testing.assert_close(a, e, atol=0, rtol=0)


# ----------------------------------------------------------------------------------------------
# CUDA: the synchronised launch, at the bench's row lengths

BENCH_NS = (32768, 65536, 131072, 262144)
CUDA_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@cuda_only
@pytest.mark.parametrize("dtype", CUDA_DTYPES)
@pytest.mark.parametrize("n", BENCH_NS)
@pytest.mark.parametrize("op", ["layer_norm", "rms_norm", "add_rms_norm"])
def test_synchronised_launch_equals_two_launches_and_float64(op, n, dtype, monkeypatch):
    """At the bench's lengths with the shipped settings: the one synchronised launch gives the same bits
    as the two-launch form (the interpreter's), no program gave up waiting, and the error against
    float64 is at most twice torch's (output, input gradient, weight gradient)."""
    dt = CUDA_DTYPES[dtype]
    g = torch.Generator().manual_seed(n)
    m = 67  # more rows than groups of programs fit at once: each group takes several
    x = (torch.randn(m, n, generator=g) * 2 + 1).to(DEV, dt).requires_grad_()
    w = (torch.rand(n, generator=g) + 0.5).to(DEV, dt).requires_grad_()
    b = torch.randn(n, generator=g).to(DEV, dt).requires_grad_() if op == "layer_norm" else None
    r = torch.randn(m, n, generator=g).to(DEV, dt) if op == "add_rms_norm" else None
    dy = torch.randn(m, n, generator=g).to(DEV, dt)
    centered = op == "layer_norm"
    before = RO.timeouts(DEV)

    def run():
        y, s = RO.rows_norm(x, w, b, 1e-5, centered, residual=r)
        return (y, s, *_grads(y, (x, w, b), dy))

    sync = run()
    monkeypatch.setattr(KC, "ROWS_ONCE_TWO_PHASE", True)
    two = run()
    assert RO.timeouts(DEV) == before, "a program gave up waiting for the others of its row"
    for a, e in zip(sync, two):
        if a is not None:
            assert torch.equal(a, e), "the synchronised launch and the two launches differ"
    h = x if r is None else (x.float() + r.float()).to(dt)
    y64 = _ref64(h, w, b, None, centered, 0.0)
    y_t = F.layer_norm(h, (n,), w, b, 1e-5) if centered else F.rms_norm(h, (n,), w, 1e-5)
    if r is not None:
        h = h.detach().requires_grad_()
        y64 = _ref64(h, w, b, None, centered, 0.0)
        y_t = F.rms_norm(h, (n,), w, 1e-5)
        torch.testing.assert_close(sync[1], (x.float() + r.float()).to(dt), atol=0, rtol=0)
    leaves = (x if r is None else h, w, b)
    g64, g_t = _grads(y64, leaves, dy.double()), _grads(y_t, leaves, dy)
    atol = {torch.bfloat16: 1e-2, torch.float32: 1e-5}[dt]
    for got, torch_, want in zip((sync[0], *sync[2:]), (y_t, *g_t), (y64, *g64)):
        err_k = (got.double() - want).abs().max().item()
        err_t = (torch_.double() - want).abs().max().item()
        assert err_k <= 2 * err_t + atol * want.abs().max().item() + atol, (err_k, err_t)


@cuda_only
@pytest.mark.parametrize("dtype", CUDA_DTYPES)
@pytest.mark.parametrize("n", BENCH_NS)
@pytest.mark.parametrize("op", ["layer_norm", "rms_norm", "add_rms_norm"])
def test_rows_once_is_batch_invariant_at_bench_sizes(op, n, dtype):
    """tests/kernels/test_kernels_cuda_invariance.py's rule for the candidates: a row alone and among 6,
    254, 255, 256 and 299 other rows, output and input gradient bitwise."""
    g = torch.Generator().manual_seed(n)
    dt = CUDA_DTYPES[dtype]
    w, b = (torch.rand(n, generator=g) + 0.5).to(DEV, dt), torch.randn(n, generator=g).to(DEV, dt)
    if op == "add_rms_norm":
        sample = torch.randn(2 * n, generator=g).to(DEV, dt)

        def fn(xb):
            y, h = nf.fused_add_rms_norm(xb[..., :n], xb[..., n:], w, backend="triton")
            return torch.cat([y, h], -1)
    else:
        sample = (torch.randn(n, generator=g) * 2 + 1).to(DEV, dt)

        def fn(xb):
            if op == "layer_norm":
                return nf.layer_norm(xb, (n,), w, b, backend="triton")
            return nf.rms_norm(xb, (n,), w, backend="triton")

    before = RO.timeouts(DEV)
    with variants.use_variant("rows", "rows_once"):
        sample_alone_and_in_batches(fn, sample, ((7, 3), (255, 254), (256, 0), (257, 128), (300, 299)))
    assert RO.timeouts(DEV) == before


@cuda_only
def test_rows_once_past_2_31_elements():
    """Offsets past 2**31 elements (bf16, 4.3 GB per tensor) in the split kernels, forward and backward:
    the rows around element 2**31 against float64."""
    if torch.cuda.get_device_properties(DEV).total_memory < (60 << 30):
        pytest.skip("needs a GPU with at least 60 GB")
    torch.manual_seed(18)
    n = 262144
    m = 2**31 // n + 2
    x = torch.randn(m, n, device=DEV, dtype=torch.bfloat16).requires_grad_()
    rows = [0, m - 3, m - 2, m - 1]  # the rows before and after element 2**31
    y, _ = RO.rows_norm(x, None, None, 1e-5, True)
    want = F.layer_norm(x[rows].detach().double(), (n,), eps=1e-5)
    torch.testing.assert_close(y[rows].double(), want, atol=2e-2, rtol=1e-2)
    dy = torch.zeros_like(y)
    dy[rows] = torch.randn(len(rows), n, device=DEV, dtype=torch.bfloat16)
    (dx,) = torch.autograd.grad(y, x, dy)
    x64 = x[rows].detach().double().requires_grad_()
    (dx64,) = torch.autograd.grad(F.layer_norm(x64, (n,), eps=1e-5), x64, dy[rows].double())
    torch.testing.assert_close(dx[rows].double(), dx64, atol=2e-2, rtol=1e-2)
    assert RO.timeouts(DEV) == 0
    del x, y, dy, dx
    torch.cuda.empty_cache()
