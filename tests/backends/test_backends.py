"""The backends package and the contract at the kernel door.

* every Triton kernel family (rows, fused add + RMSNorm, groups, channels) gives torch's numbers for
  every stride kind torch accepts -- views as weight or bias, sliced, transposed, expanded, offset and
  channels_last inputs -- run in Triton's interpreter on the CPU and compared with torch.nn.functional;
* the fused residual op obeys ``backend=``, ``use_backend`` and ``NORMSCOPE_BACKEND`` and reports
  ``last_backend()``;
* double backward (``create_graph=True``) works on every backend and matches torch's;
* the automatic choice of the Triton backend is a measured one (``normscope.backends.measured``);
* the layout: one package names the backends and their order; kernels import nothing from the engine.
"""

import ast
import json
import os
import pathlib
import sys

from conftest import kernel_interpreter_env

_PREVIOUS_INTERPRET = os.environ.get("TRITON_INTERPRET")
os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import normscope  # noqa: E402
from normscope import engine  # noqa: E402
from normscope import functional as nf  # noqa: E402
from normscope.backends import TRITON, measured  # noqa: E402

SRC = pathlib.Path(normscope.__file__).parent
needs_triton = pytest.mark.skipif(not TRITON, reason="Triton is not installed")


@pytest.fixture(scope="module", autouse=True)
def _interpreter_env():
    yield from kernel_interpreter_env(_PREVIOUS_INTERPRET)


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------------------------------------
# strides at the kernel door


def _param(kind: str, n: int, g: torch.Generator, scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
    """A 1-d parameter of ``n`` values laid out as ``kind`` (the values are what matter to torch)."""
    if kind == "contiguous":
        t = torch.randn(n, generator=g)
    elif kind == "strided":  # a view such as weight = base[::2]
        t = torch.randn(2 * n, generator=g)[::2]
    elif kind == "expanded":  # stride 0, as ScaleNorm's g.expand(n)
        t = torch.randn(1, generator=g).expand(n)
    elif kind == "offset":  # a view that starts inside its storage
        t = torch.randn(n + 5, generator=g)[5:]
    else:
        raise AssertionError(kind)
    return (t * scale + shift).requires_grad_()


PARAM_KINDS = ["contiguous", "strided", "expanded", "offset"]


def _input(kind: str, shape: tuple, g: torch.Generator) -> torch.Tensor:
    """An input of ``shape`` laid out as ``kind``."""
    if kind == "contiguous":
        x = torch.randn(shape, generator=g)
    elif kind == "sliced":  # every other element of the last axis, and a row stride that is not N
        x = torch.randn(*shape[:-1], 2 * shape[-1], generator=g)[..., ::2]
    elif kind == "transposed":  # the last axis is not unit-stride
        x = torch.randn(*reversed(shape), generator=g).permute(*reversed(range(len(shape))))
    elif kind == "expanded":  # the batch axis has stride 0
        x = torch.randn(1, *shape[1:], generator=g).expand(shape)
    elif kind == "offset":
        x = torch.randn(7 + torch.Size(shape).numel(), generator=g)[7:].view(shape)
    elif kind == "channels_last":
        x = torch.randn(shape, generator=g).contiguous(memory_format=torch.channels_last)
    else:
        raise AssertionError(kind)
    assert tuple(x.shape) == tuple(shape)
    return (x * 2 + 0.5).detach().requires_grad_()


INPUT_KINDS = ["contiguous", "sliced", "transposed", "expanded", "offset", "channels_last"]

# op name -> (input shape, function(x, w, b) using the given functional module, params per channel)
OPS = {
    "layer_norm": ((3, 4, 6, 5), lambda F_, x, w, b: F_.layer_norm(x, (5,), w, b, 1e-5), 5),
    "rms_norm": ((3, 4, 6, 5), lambda F_, x, w, b: F_.rms_norm(x, (5,), w, 1e-5), 5),
    "group_norm": ((3, 4, 6, 5), lambda F_, x, w, b: F_.group_norm(x, 2, w, b, 1e-5), 4),
    "instance_norm": ((3, 4, 6, 5), lambda F_, x, w, b: F_.instance_norm(x, weight=w, bias=b, eps=1e-5), 4),
    "batch_norm": ((3, 4, 6, 5), lambda F_, x, w, b: F_.batch_norm(x, None, None, w, b, True, 0.1, 1e-5), 4),
    "batch_norm_eval": (
        (3, 4, 6, 5),
        lambda F_, x, w, b: F_.batch_norm(
            x, torch.linspace(-1, 1, 4), torch.linspace(0.5, 2, 4), w, b, False, 0.1, 1e-5
        ),
        4,
    ),
}


def _check_against_torch(op: str, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, what: str) -> None:
    fn = OPS[op][1]
    dy = torch.randn(x.shape, generator=_gen(9))
    with normscope.use_backend("triton"):
        y = fn(nf, x, w, b)
        assert normscope.last_backend() == "triton", what
    y_t = fn(F, x, w, b)
    torch.testing.assert_close(y, y_t, atol=2e-5, rtol=2e-5, msg=lambda m: f"{what} output: {m}")
    used = [t for t in (x, w, b) if t is not None and (op != "rms_norm" or t is not b)]
    got = torch.autograd.grad(y, used, dy)
    want = torch.autograd.grad(y_t, used, dy)
    for name, a, e in zip("xwb", got, want):
        torch.testing.assert_close(a, e, atol=1e-4, rtol=1e-4, msg=lambda m, n=name: f"{what} grad {n}: {m}")


@needs_triton
@pytest.mark.parametrize("param_kind", PARAM_KINDS)
@pytest.mark.parametrize("op", list(OPS))
def test_views_as_weight_and_bias_give_torchs_numbers(op, param_kind):
    shape, _, c = OPS[op]
    g = _gen(1)
    x = _input("contiguous", shape, g)
    w = _param(param_kind, c, g, 0.5, 1.0)
    b = _param(param_kind, c, g)
    _check_against_torch(op, x, w, b, f"{op}, weight and bias {param_kind}")


@needs_triton
@pytest.mark.parametrize("input_kind", INPUT_KINDS)
@pytest.mark.parametrize("op", list(OPS))
def test_input_strides_give_torchs_numbers(op, input_kind):
    shape, _, c = OPS[op]
    g = _gen(2)
    x = _input(input_kind, shape, g)
    w = _param("strided", c, g, 0.5, 1.0)
    b = _param("offset", c, g)
    _check_against_torch(op, x, w, b, f"{op}, input {input_kind}")


@needs_triton
@pytest.mark.parametrize("kind", ["channels_last_3d", "transposed_2d"])
def test_group_and_batch_norm_on_other_layouts(kind):
    g = _gen(3)
    if kind == "channels_last_3d":
        x = torch.randn(2, 4, 3, 2, 3, generator=g).contiguous(memory_format=torch.channels_last_3d)
    else:  # (N, C, L) stored as (N, L, C)
        x = torch.randn(2, 5, 4, generator=g).transpose(1, 2)
    x.requires_grad_()
    w, b = _param("strided", 4, g, 0.5, 1.0), _param("expanded", 4, g)
    for op in ("group_norm", "instance_norm", "batch_norm"):
        _check_against_torch(op, x, w, b, f"{op} on {kind}")


@needs_triton
@pytest.mark.parametrize("kind", ["contiguous", "strided", "expanded", "offset"])
def test_fused_add_rms_norm_with_views(kind):
    g = _gen(4)
    x = _input("sliced" if kind != "contiguous" else "contiguous", (3, 5, 8), g)
    r = _input("offset" if kind != "contiguous" else "contiguous", (3, 5, 8), g)
    w = _param(kind, 8, g, 0.5, 1.0)
    y, h = nf.fused_add_rms_norm(x, r, w, 1e-6, backend="triton")
    assert normscope.last_backend() == "triton"
    h_t = x + r
    y_t = F.rms_norm(h_t, (8,), w, 1e-6)
    torch.testing.assert_close(h, h_t, atol=0, rtol=0)
    torch.testing.assert_close(y, y_t, atol=2e-5, rtol=2e-5)
    dy, dh = torch.randn(y.shape, generator=g), torch.randn(h.shape, generator=g)
    got = torch.autograd.grad((y, h), (x, r, w), (dy, dh))
    want = torch.autograd.grad((y_t, h_t), (x, r, w), (dy, dh))
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e, atol=1e-4, rtol=1e-4)


@needs_triton
def test_masked_batch_norm_with_views_as_weight_and_mask():
    g = _gen(5)
    x = _input("transposed", (3, 6, 4), g)  # (B, S, D) with D not unit-stride
    w, b = _param("strided", 4, g, 0.5, 1.0), _param("expanded", 4, g)
    mask = (torch.rand(3, 2 * 6, generator=g) > 0.3)[:, ::2]  # a strided (B, S) mask
    mask[0, 0] = True
    with normscope.use_backend("triton"):
        y = nf.normalize(x, keep=-1, weight=w, bias=b, affine_dims=-1, mask=mask[..., None])
        assert normscope.last_backend() == "triton"
    # independent: BatchNorm over the valid positions only, in float64
    xv = x.detach().double()[mask]
    mean, var = xv.mean(0), xv.var(0, unbiased=False)
    y64 = (x.double() - mean) / torch.sqrt(var + 1e-5) * w.double() + b.double()
    torch.testing.assert_close(y.double(), y64, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# the fused op obeys the backend contract


def test_fused_add_rms_norm_reports_and_obeys_the_backend(monkeypatch):
    g = _gen(6)
    x, r, w = torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g), torch.rand(8, generator=g) + 0.5
    want_h = x + r
    want_y = F.rms_norm(want_h, (8,), w, 1e-6)
    y, h = nf.fused_add_rms_norm(x, r, w)
    assert normscope.last_backend() == "aten"  # automatic on CPU: add, then torch's rms_norm
    torch.testing.assert_close(y, want_y)
    torch.testing.assert_close(h, want_h, atol=0, rtol=0)
    for name in ("reference", "aten"):
        with normscope.use_backend(name):
            y, h = nf.fused_add_rms_norm(x, r, w)
        assert normscope.last_backend() == name
        torch.testing.assert_close(y, want_y)
        y, h = nf.fused_add_rms_norm(x, r, w, backend=name)
        assert normscope.last_backend() == name
    monkeypatch.setenv(engine.ENV_VAR, "reference")
    nf.fused_add_rms_norm(x, r, w)
    assert normscope.last_backend() == "reference"
    monkeypatch.setenv(engine.ENV_VAR, "rows")  # the CPU RMSNorm rows: add, then its one-pass norm
    y, h = nf.fused_add_rms_norm(x, r, w)
    assert normscope.last_backend() == "rows"
    torch.testing.assert_close(y, want_y)
    if TRITON:
        monkeypatch.setenv(engine.ENV_VAR, "triton")
        monkeypatch.setenv("TRITON_INTERPRET", "0")  # a CPU tensor the kernels cannot take
        with pytest.raises(ValueError, match="triton.*cannot run"):
            nf.fused_add_rms_norm(x, r, w)  # a forced backend that cannot run it raises, never falls back
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.delenv(engine.ENV_VAR)
    with pytest.raises(ValueError, match="unknown backend"):
        nf.fused_add_rms_norm(x, r, w, backend="cudnn")


def test_fused_add_rms_norm_offset_and_fp32_residual_on_every_backend():
    g = _gen(7)
    x = torch.randn(3, 16, generator=g).to(torch.bfloat16)
    r = torch.randn(3, 16, generator=g).to(torch.bfloat16)
    w = torch.randn(16, generator=g).to(torch.bfloat16)
    h64 = x.double() + r.double()
    y64 = h64 * torch.rsqrt(h64.square().mean(-1, keepdim=True) + 1e-6) * (w.double() + 1.0)
    names = ["aten", "reference"] + (["triton"] if TRITON else [])
    for name in names:
        y, h = nf.fused_add_rms_norm(x, r, w, weight_offset=1.0, residual_fp32=True, backend=name)
        assert h.dtype == torch.float32 and y.dtype == torch.bfloat16, name
        torch.testing.assert_close(h.double(), h64, atol=0, rtol=0)  # fp32 holds a bf16 sum exactly
        torch.testing.assert_close(y.double(), y64, atol=2e-2, rtol=2e-2, msg=lambda m, n=name: f"{n}: {m}")


# ---------------------------------------------------------------------------------------------
# double backward on every backend


def _second_order(fn, x, w, b):
    """A gradient penalty: d/d(x, w, b) of sum((d y.dy / dx)^2)."""
    dy = torch.randn(x.shape, generator=_gen(11), dtype=torch.float64).to(x.dtype)
    y = fn(x, w, b)
    (gx,) = torch.autograd.grad(y, x, dy, create_graph=True)
    used = [t for t in (x, w, b) if t is not None]
    return torch.autograd.grad(gx.square().sum(), used, allow_unused=True)


DOUBLE = {
    "layer_norm": (lambda F_: lambda x, w, b: F_.layer_norm(x, (6,), w, b), (2, 3, 6), 6),
    "rms_norm": (lambda F_: lambda x, w, b: F_.rms_norm(x, (6,), w), (2, 3, 6), 6),
    "group_norm": (lambda F_: lambda x, w, b: F_.group_norm(x, 2, w, b), (2, 4, 3), 4),
    "batch_norm": (lambda F_: lambda x, w, b: F_.batch_norm(x, None, None, w, b, True), (3, 4, 5), 4),
}


@pytest.mark.parametrize("backend", ["aten", "reference", "triton"])
@pytest.mark.parametrize("op", list(DOUBLE))
def test_double_backward_matches_torch(op, backend):
    if backend == "triton" and not TRITON:
        pytest.skip("Triton is not installed")
    make, shape, c = DOUBLE[op]
    g = _gen(12)
    x = (torch.randn(shape, generator=g) * 2 + 1).requires_grad_()
    w = (torch.rand(c, generator=g) + 0.5).requires_grad_()
    b = torch.randn(c, generator=g).requires_grad_() if op != "rms_norm" else None
    with normscope.use_backend(backend):
        ours = _second_order(make(nf), x, w, b)
        assert normscope.last_backend() == backend
    # torch's double backward, in float64: an independent oracle
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    b64 = b.detach().double().requires_grad_() if b is not None else None
    want = _second_order(make(F), x64, w64, b64)
    for name, a, e in zip("xwb", ours, want):
        if e is None:
            continue
        assert a is not None, f"{op} on {backend}: no second-order gradient for {name}"
        torch.testing.assert_close(a.double(), e, atol=2e-4, rtol=2e-4, msg=lambda m, n=name: f"{op} {n}: {m}")


def test_double_backward_on_composite_and_fused():
    g = _gen(13)
    x = torch.randn(3, 4, 5, generator=g, dtype=torch.float64).requires_grad_()
    mask = torch.rand(3, 1, 5, generator=g) > 0.3
    ours = _second_order(lambda x, w, b: nf.normalize(x, keep=1, mask=mask), x, None, None)
    assert normscope.last_backend() == "composite"
    with normscope.use_backend("reference"):
        want = _second_order(lambda x, w, b: nf.normalize(x, keep=1, mask=mask), x, None, None)
    torch.testing.assert_close(ours[0], want[0])
    names = ["aten", "reference"] + (["triton"] if TRITON else [])
    r = torch.randn(3, 4, 5, generator=g).requires_grad_()
    w = (torch.rand(5, generator=g) + 0.5).requires_grad_()
    x32 = x.detach().float().requires_grad_()
    for name in names:
        y, h = nf.fused_add_rms_norm(x32, r, w, backend=name)
        (gx,) = torch.autograd.grad((y * h).sum(), x32, create_graph=True)
        got = torch.autograd.grad(gx.square().sum(), (x32, r, w))
        y_t = F.rms_norm(x32 + r, (5,), w, 1e-6)
        (gx_t,) = torch.autograd.grad((y_t * (x32 + r)).sum(), x32, create_graph=True)
        want = torch.autograd.grad(gx_t.square().sum(), (x32, r, w))
        for a, e in zip(got, want):
            torch.testing.assert_close(a, e, atol=2e-4, rtol=2e-4, msg=lambda m, n=name: f"fused {n}: {m}")


# ---------------------------------------------------------------------------------------------
# measured automatic choice


def _table(tmp_path, choices, schema=1):
    p = tmp_path / "cuda-sm90.json"
    p.write_text(json.dumps({"schema": schema, "device_class": "cuda-sm90", "choices": choices}))
    return p


def test_measured_table_is_read_and_validated(tmp_path):
    p = _table(tmp_path, [{"op": "rms_norm", "dtype": "bfloat16", "n_min": 1024, "n_max": 65536}])
    assert measured.load(p) == (measured.Choice("rms_norm", "bfloat16", 1024, 65536),)
    with pytest.raises(ValueError, match="schema 1"):
        measured.load(_table(tmp_path, [], schema=2))
    with pytest.raises(ValueError, match="unknown op"):
        measured.load(_table(tmp_path, [{"op": "softmax", "dtype": "float32", "n_min": 1, "n_max": 2}]))
    with pytest.raises(ValueError, match="n_min > n_max"):
        measured.load(_table(tmp_path, [{"op": "rms_norm", "dtype": "float32", "n_min": 9, "n_max": 2}]))
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ValueError, match="cannot read"):
        measured.load(tmp_path / "bad.json")


def test_measured_choice_covers_only_the_measured_range(monkeypatch):
    monkeypatch.setitem(measured._TABLES, "cpu", (measured.Choice("rms_norm", "bfloat16", 1024, 65536),))
    cpu = torch.device("cpu")
    assert measured.why_not("rms_norm", torch.bfloat16, 4096, cpu) is None
    assert measured.why_not("rms_norm", torch.bfloat16, 1024, cpu) is None
    assert measured.why_not("rms_norm", torch.bfloat16, 65537, cpu) is not None  # no extrapolation
    assert measured.why_not("rms_norm", torch.float32, 4096, cpu) is not None  # another dtype
    assert "layer_norm" in measured.why_not("layer_norm", torch.bfloat16, 4096, cpu)


def test_committed_tables_come_from_bench_runs_and_cover_only_their_class():
    # every committed table comes from a real bench run on its device class (and names it)
    for f in (SRC / "backends" / "measured").glob("*.json"):
        data = json.loads(f.read_text())
        assert data["device_class"] == f.stem and data["choices"] is not None
        assert measured.load(f) is not None
    assert measured.why_not("layer_norm", torch.float32, 4096, torch.device("cpu")) is not None


@needs_triton
def test_triton_is_not_chosen_automatically_without_a_measurement():
    x = torch.randn(4, 8)
    nf.layer_norm(x, (8,))
    assert normscope.last_backend() == "aten"  # TRITON_INTERPRET=1 here: it could run, but is not chosen
    from normscope.backends import triton as tb

    call = engine.Call(x, normscope.Scope.layer().resolve(x.shape), None, None, 1e-5, None, None)
    assert tb.why_not(call) is None
    assert "CUDA" in tb.why_not_auto(call)


# ---------------------------------------------------------------------------------------------
# the layout


def test_one_place_names_the_backends_and_their_order():
    pkg = sys.modules["normscope.backends"]  # the package (``normscope.backends`` is the function)

    expected = [n for n in pkg.AUTOMATIC_ORDER if n != "triton" or pkg.TRITON]
    assert normscope.backends() == expected == engine.backends()
    for name in expected:
        mod = pkg._modules[name]
        assert mod.BACKEND.name == name and mod.__name__ == f"normscope.backends.{name}"


def _imports(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = "." * node.level + (node.module or "")
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out


def test_kernels_import_nothing_from_the_engine_and_the_engine_no_backend():
    for f in (SRC / "kernels").glob("*.py"):
        names = ("engine", "backends", "functional", "reference", "composite")
        # normscope's modules (relative or absolute); Triton's own (triton.backends.nvidia...) are not the engine
        ours = {m for m in _imports(f) if m.startswith((".", "normscope"))}
        bad = {m for m in ours if any(k in m for k in names)}
        assert not bad, f"{f.name} imports {bad}"
    from conftest import ENGINE_PARTS
    from conftest import module_imports as modules_imported

    for part in ENGINE_PARTS:  # the engine and its parts, read as the modules they import
        bad = {m for m in modules_imported(SRC / f"{part}.py") if m.split(".")[1] in ("backends", "kernels")}
        assert not bad, f"{part}.py imports {bad}"
