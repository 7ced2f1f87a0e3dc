"""Conformance with torch's own test-sample database, on every backend that can run each sample.

The samples are torch's, not ours: the OpInfos of ``torch.testing._internal.common_methods_invocations.op_db``
and the ModuleInfos of ``torch.testing._internal.common_modules.module_db`` for every normalization torch has
(:data:`OPS`, :data:`MODULES`; what is left out and why: :data:`NOT_COVERED`). Each sample runs through torch and
through normscope's equivalent -- ``normscope.functional`` for an op, the normscope layer (with the torch module's
state copied in) for a module -- and the test compares

* the output (and, for a 4-D/5-D input, the output's memory format, with a channels_last copy of the sample),
* the gradients of the input, weight and bias (a fixed random cotangent),
* every buffer the call may update in place (running mean/var, ``num_batches_tracked``),

on the automatic choice and on each forced backend (:func:`normscope.use_backend`). A forced backend that declines
a call ("cannot run") makes that test *skip* as not applicable -- never pass -- so pytest's ``-ra`` summary counts
the coverage. ``triton`` (Triton's interpreter on CPU, slow) runs only on the small float32 samples
(:func:`_triton_subset`); deselect it with ``-k "not triton"``.

The oracle rule, per compared tensor (:func:`_judge`): normscope passes when it matches torch within
``torch.testing.assert_close``'s default tolerance for the dtype, or else when it is no less accurate than torch
against a float64 computation of the same sample -- torch's own op run on the sample upcast to float64: each
element's error is at most torch's largest error (or half an ulp: correctly rounded), plus one ulp of the dtype
and a few of the fp32 accumulation for ties. Which rule passed is recorded per test (``record_property``: look for
``rule:`` entries in a junit XML report, ``-o junit_family=xunit1``), so a reader sees where normscope differs.
An output's layout must be torch's or the input's.

Error inputs (``error_inputs_func`` / ``module_error_inputs_func``): normscope must raise too, a ValueError or
TypeError (the project's rule for bad input; torch's own error class is accepted where it is one of those).

Where normscope deliberately behaves differently from torch, the expectation comes from one table,
:data:`DIFFERENCES`, and each entry cites its section of ``docs/differences.md``.

Needs ``expecttest`` (torch's test utilities import it; the ``dev`` extra installs it).
"""

from __future__ import annotations

import copy
import fnmatch
import math
import os
from dataclasses import dataclass
from functools import cache

import pytest
import torch
from torch import Tensor

from conftest import kernel_interpreter_env

try:  # torch.testing._internal imports expecttest at import time
    import expecttest  # noqa: F401
except ImportError as e:  # fail loudly: a conformance suite that silently skips proves nothing
    raise ImportError(
        "tests/conformance/test_conformance.py needs `expecttest` for torch.testing._internal "
        "(pip install 'normscope[dev]')"
    ) from e

_SCRIPT_CALLS = (torch._C.ScriptFunction.__call__, torch._C.ScriptMethod.__call__)

from torch.testing._internal.common_methods_invocations import op_db  # noqa: E402
from torch.testing._internal.common_modules import ModuleErrorEnum, module_db  # noqa: E402

# Importing torch's test utilities sets the process up for torch's own suite: it freezes the torch.backends flags
# (``torch.backends.cudnn.enabled = False`` then raises) and wraps TorchScript calls for its profiling executor.
# The other test modules of this session expect neither: undo both.
torch.backends.flags_frozen.__globals__["__allow_nonbracketed_mutation_flag"] = True  # disable_global_flags undone
torch._C.ScriptFunction.__call__, torch._C.ScriptMethod.__call__ = _SCRIPT_CALLS

import normscope  # noqa: E402
from normscope import engine  # noqa: E402
from normscope import functional as nf  # noqa: E402

_PREVIOUS_INTERPRET = os.environ.get("TRITON_INTERPRET")

# torch's samples include eps=-0.5, for which torch itself returns NaN where var + eps < 0; Triton's interpreter
# (numpy) warns about the same square roots
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered in sqrt:RuntimeWarning")


@pytest.fixture(scope="module", autouse=True)
def _interpreter_env():
    # the "triton" cases run the kernels in Triton's interpreter on CPU (conftest.py explains why it must be set
    # before normscope is imported; this keeps it set while this module runs)
    yield from kernel_interpreter_env(_PREVIOUS_INTERPRET)


# ----------------------------------------------------------------------------------------------------------------
# what is covered: torch's op / module -> normscope's equivalent


def _first(out):
    """The normalized output of an ATen op that also returns saved statistics (``native_*``)."""
    return out[0] if isinstance(out, (tuple, list)) else out


def _legit(x, w, b, *rest):
    # _native_batch_norm_legit has two overloads: with running stats (rm, rv, training, momentum, eps) and
    # without (training, momentum, eps)
    if len(rest) == 5:
        rm, rv, training, momentum, eps = rest
    else:
        (training, momentum, eps), rm, rv = rest, None, None
    return nf.batch_norm(x, rm, rv, w, b, training, momentum, eps)


@dataclass(frozen=True)
class Op:
    """An OpInfo and the normscope call with the same meaning (``ours`` takes the sample's arguments)."""

    ours: object
    engine: bool = True  # False: normscope runs torch's op directly (no backend choice to test)
    names: tuple[str, ...] = ()  # positional argument names, for readable messages


#: OpInfo name -> normscope equivalent. Only the normalized output (and in-place running statistics) of the
#: ``native_*`` ATen ops has a normscope equivalent; their saved mean/rstd are internal to torch's autograd.
OPS: dict[str, Op] = {
    "nn.functional.batch_norm": Op(
        nf.batch_norm, names=("running_mean", "running_var", "weight", "bias", "training", "momentum", "eps")
    ),
    "nn.functional.instance_norm": Op(nf.instance_norm),
    "nn.functional.layer_norm": Op(nf.layer_norm, names=("normalized_shape", "weight", "bias", "eps")),
    "nn.functional.rms_norm": Op(nf.rms_norm, names=("normalized_shape", "weight", "eps")),
    "nn.functional.group_norm": Op(nf.group_norm, names=("num_groups",)),
    "nn.functional.local_response_norm": Op(nf.local_response_norm, engine=False, names=("size",)),
    "native_layer_norm": Op(
        lambda x, shape, w, b, eps: nf.layer_norm(x, shape, w, b, eps),
        names=("normalized_shape", "weight", "bias", "eps"),
    ),
    "native_group_norm": Op(
        lambda x, w, b, n, c, hxw, group, eps: nf.group_norm(x, group, w, b, eps),
        names=("weight", "bias", "N", "C", "HxW", "group", "eps"),
    ),
    "native_batch_norm": Op(
        lambda x, w, b, rm, rv, training, momentum, eps: nf.batch_norm(x, rm, rv, w, b, training, momentum, eps),
        names=("weight", "bias", "running_mean", "running_var", "training", "momentum", "eps"),
    ),
    "_native_batch_norm_legit": Op(_legit, names=("weight", "bias", "running_mean", "running_var")),
    "_batch_norm_with_update": Op(
        lambda x, w, b, rm, rv, momentum, eps: nf.batch_norm(x, rm, rv, w, b, True, momentum, eps),
        names=("weight", "bias", "running_mean", "running_var", "momentum", "eps"),
    ),
}

#: ModuleInfo name -> normscope layer (same constructor; the torch module's state is copied in).
MODULES: dict[str, type] = {
    f"nn.{n}": getattr(normscope, n)
    for n in (
        "BatchNorm1d",
        "BatchNorm2d",
        "BatchNorm3d",
        "InstanceNorm1d",
        "InstanceNorm2d",
        "InstanceNorm3d",
        "GroupNorm",
        "LayerNorm",
        "RMSNorm",
        "LocalResponseNorm",
    )
}

#: Norm-related entries of torch's databases that this module does not run, and why.
NOT_COVERED = {
    "nn.functional.batch_norm (variant without_cudnn)": "a CUDA-only variant: no dtypes on CPU",
    "nn.functional.normalize": "L_p normalization of vectors (x / ||x||), not a mean/variance normalization",
    "masked.normalize, masked.norm, norm, linalg.*norm, renorm": "norms of tensors, not normalization layers",
    "native_* saved mean/rstd": "internal to torch's autograd; normscope returns only the normalized output",
    "nn.SyncBatchNorm": "no ModuleInfo in torch's database (needs a process group); tests/layers/test_syncbn.py",
}

_OPINFOS = {o.name: o for o in op_db if o.name in OPS and not o.variant_test_name}
_MODINFOS = {m.name: m for m in module_db if m.name in MODULES}
assert set(_OPINFOS) == set(OPS), f"torch {torch.__version__} lacks OpInfos {set(OPS) - set(_OPINFOS)}"
assert set(_MODINFOS) == set(MODULES), f"torch {torch.__version__} lacks ModuleInfos {set(MODULES) - set(_MODINFOS)}"

DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
_SHORT = {torch.float64: "f64", torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
BACKENDS = ("auto", *engine.backends())  # every registered backend, forced, after the automatic choice


# ----------------------------------------------------------------------------------------------------------------
# deliberate differences from torch: ONE table, each entry citing docs/differences.md


@dataclass(frozen=True)
class Difference:
    """A sample on which normscope deliberately behaves differently from torch: it raises ``raises`` where torch
    computes. ``ops`` is a glob over OpInfo/ModuleInfo names, ``applies(x)`` a test on the sample's input;
    ``section`` is the heading of docs/differences.md that documents it."""

    ops: str
    applies: object
    raises: type[BaseException]
    section: str


#: Every deliberate difference from torch that a sample of torch's database meets: the ONE place the
#: expectations below come from, each citing its section of docs/differences.md.
DIFFERENCES: tuple[Difference, ...] = (
    Difference(
        "nn.functional.batch_norm",
        lambda x: x.dim() < 2,
        ValueError,
        "batch_norm: input must be (N, C, *) even when empty",
    ),
)


_DOC = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "differences.md")


def test_every_difference_is_documented():
    with open(_DOC, encoding="utf-8") as f:
        headings = {line[3:].strip() for line in f if line.startswith("## ")}
    missing = [d.section for d in DIFFERENCES if d.section not in headings]
    assert not missing, f"DIFFERENCES cites sections that docs/differences.md lacks: {missing}"


def _difference(name: str, x) -> Difference | None:
    for d in DIFFERENCES:
        if fnmatch.fnmatchcase(name, d.ops) and isinstance(x, Tensor) and d.applies(x):
            return d
    return None


# ----------------------------------------------------------------------------------------------------------------
# samples: generated once per (op, dtype) under a fixed seed, so ids and numbers are stable across runs


@cache
def _op_samples(name: str, dtype: torch.dtype) -> tuple:
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return tuple(_OPINFOS[name].sample_inputs("cpu", dtype, requires_grad=True))


@cache
def _op_errors(name: str) -> tuple:
    info = _OPINFOS[name]
    if info.error_inputs_func is None:
        return ()
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return tuple(info.error_inputs("cpu"))


@cache
def _module_samples(name: str, dtype: torch.dtype, training: bool) -> tuple:
    info = _MODINFOS[name]
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return tuple(info.module_inputs_func(info, device="cpu", dtype=dtype, requires_grad=True, training=training))


@cache
def _module_errors(name: str) -> tuple:
    info = _MODINFOS[name]
    if info.module_error_inputs_func is None:
        return ()
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return tuple(
            info.module_error_inputs_func(info, device="cpu", dtype=torch.float32, requires_grad=False, training=True)
        )


def _layout(x: Tensor) -> torch.memory_format | None:
    return {4: torch.channels_last, 5: torch.channels_last_3d}.get(x.dim()) if isinstance(x, Tensor) else None


def _triton_subset(x: Tensor, dtype: torch.dtype) -> bool:
    """The samples the slow Triton interpreter runs: float32, at most 256 elements."""
    return dtype == torch.float32 and isinstance(x, Tensor) and 0 < x.numel() <= 256


def _backends_for(x: Tensor, dtype: torch.dtype, uses_engine: bool, forward=None) -> tuple[str, ...]:
    """The backends a sample is run on: the automatic choice, and every forced backend that takes the sample's
    call (``forward()`` runs normscope on it; each forced backend plans it, nothing runs). A backend that
    declines the call -- composite runs only RMS rows and masked scopes, Triton's running statistics only
    BatchNorm's -- has nothing to compare, so it is not a case at all (a skip would read "could not run here")."""
    if not uses_engine:
        return ("auto",)
    candidates = [b for b in BACKENDS if b != "triton" or _triton_subset(x, dtype)]
    return tuple(b for b in candidates if b == "auto" or forward is None or _takes(b, forward))


def _takes(backend: str, forward) -> bool:
    """Whether the forced ``backend`` plans the call ``forward()`` makes. Under :func:`engine.capture` the engine
    plans each call and runs nothing, so this costs no kernel run and leaves no plan cached."""
    with normscope.use_backend(backend), engine.capture():
        try:
            forward()
        except ValueError as e:
            if "cannot run" in str(e):
                return False
            return True  # normscope refuses the sample itself: the test judges that, on every backend
        except Exception:  # noqa: BLE001 - the captured call's stand-in output upset later code: the test runs it
            return True
    return True


def _op_forward(name: str, sample, fmt):
    def forward():
        x, args, kwargs = _arguments(sample, None, fmt)
        OPS[name].ours(x, *args, **kwargs)

    return forward


def _module_forward(name: str, sample, dtype, training: bool, fmt):
    def forward():
        c = sample.constructor_input
        module = MODULES[name](*c.args, **c.kwargs).to(dtype).train(training)
        x = _clone(sample.forward_input.args[0], None, fmt, is_input=True)
        module(x, *sample.forward_input.args[1:], **sample.forward_input.kwargs)

    return forward


def _op_cases():
    for name, op in OPS.items():
        info = _OPINFOS[name]
        for dtype in DTYPES:
            if dtype not in info.supported_dtypes("cpu"):
                continue
            for i, s in enumerate(_op_samples(name, dtype)):
                fmts = [None] + ([_layout(s.input)] if _layout(s.input) else [])
                for fmt in fmts:
                    for b in _backends_for(s.input, dtype, op.engine, _op_forward(name, s, fmt)):
                        cl = "-cl" if fmt else ""
                        yield pytest.param(name, dtype, i, fmt, b, id=f"{name}-{_SHORT[dtype]}-s{i:02d}{cl}-{b}")


def _module_cases():
    for name in MODULES:
        info = _MODINFOS[name]
        for dtype in DTYPES:
            if dtype not in info.dtypes:
                continue
            for training in (True, False):
                for i, s in enumerate(_module_samples(name, dtype, training)):
                    x = s.forward_input.args[0]
                    fmts = [None] + ([_layout(x)] if _layout(x) else [])
                    mode = "train" if training else "eval"
                    desc = s.desc or "default"
                    for fmt in fmts:
                        forward = _module_forward(name, s, dtype, training, fmt)
                        for b in _backends_for(x, dtype, name != "nn.LocalResponseNorm", forward):
                            cl = "-cl" if fmt else ""
                            case = f"{name}-{_SHORT[dtype]}-{mode}-{i:02d}_{desc}{cl}-{b}"
                            yield pytest.param(name, dtype, training, i, fmt, b, id=case)


# ----------------------------------------------------------------------------------------------------------------
# the oracle rule


def _errors(got: Tensor, exact: Tensor) -> Tensor:
    """|got - exact| per element in float64; NaN/inf count as exact only where ``exact`` has the same."""
    g, e = got.detach().double(), exact.detach().double()
    same_nonfinite = (torch.isnan(g) & torch.isnan(e)) | (torch.isinf(g) & (g == e))
    diff = (g - e).abs()
    diff = torch.where(same_nonfinite, torch.zeros_like(diff), diff)
    return torch.where(torch.isnan(diff), torch.full_like(diff, math.inf), diff)


def _ulp(v: Tensor, dtype: torch.dtype) -> Tensor:
    """The spacing of ``dtype`` at each value of ``v`` (float64)."""
    _, e = torch.frexp(v.abs().clamp_min(torch.finfo(dtype).tiny))
    return torch.finfo(dtype).eps * torch.pow(2.0, (e - 1).double())


#: ties: slack for a last-bit difference in the accumulation (fp32; fp64 for fp64), in its ulps at the tensor's scale
_TIE_ULPS = 4


def _judge(what: str, ours: Tensor, theirs: Tensor, exact, record) -> None:
    """Pass when ``ours`` matches torch's ``theirs`` within assert_close's dtype defaults, or when it is no less
    accurate than torch against the float64 computation ``exact()``; record which rule passed.

    "No less accurate", per element: normscope's error is at most torch's largest error, or at most half an ulp
    of the output dtype (correctly rounded: nothing can be more accurate), plus a tie slack: one ulp of the output
    dtype at that element (a last-bit difference in the fp32 computation may round to the other neighbour) and a
    few ulps of the accumulation dtype at the tensor's scale."""
    assert isinstance(ours, Tensor), f"{what}: expected a tensor like torch's, got {type(ours).__name__}"
    assert ours.shape == theirs.shape, f"{what}: shape {tuple(ours.shape)}, torch {tuple(theirs.shape)}"
    assert ours.dtype == theirs.dtype, f"{what}: dtype {ours.dtype}, torch {theirs.dtype}"
    if not ours.is_floating_point():
        assert torch.equal(ours, theirs), f"{what}: {ours.tolist()} != torch's {theirs.tolist()}"
        record(what, "equal")
        return
    try:
        torch.testing.assert_close(ours, theirs, equal_nan=True)
        record(what, "matches torch")
        return
    except AssertionError as e:
        mismatch = " ".join(str(e).split("\n")[1:4])
    ref = exact().detach().double()
    err_ours, err_torch = _errors(ours, ref), _errors(theirs, ref)
    finite = ref[torch.isfinite(ref)]
    scale = max(1e-30, finite.abs().max().item()) if finite.numel() else 1.0
    acc = torch.float64 if ours.dtype == torch.float64 else torch.float32
    slack = _TIE_ULPS * torch.finfo(acc).eps * scale
    worst_torch = err_torch.max().item()
    ulp = _ulp(ref, ours.dtype)
    bound = torch.clamp(0.5 * ulp, min=worst_torch) + ulp + slack
    worst = (err_ours - bound).argmax()
    e_o, e_t = err_ours.flatten()[worst].item(), err_torch.flatten()[worst].item()
    verdict = (
        f"max error vs float64 {err_ours.max().item():.3g}, torch's {worst_torch:.3g}; at the worst element "
        f"{e_o:.3g} vs bound {bound.flatten()[worst].item():.3g} (torch there: {e_t:.3g}, float64 value "
        f"{ref.flatten()[worst].item():.6g})"
    )
    if bool((err_ours <= bound).all()):
        record(what, f"no less accurate than torch: {verdict}")
        return
    raise AssertionError(f"{what}: differs from torch ({mismatch}) and is less accurate: {verdict}")


# ----------------------------------------------------------------------------------------------------------------
# running one sample three ways: torch, normscope (on a backend), torch in float64


def _clone(v, dtype: torch.dtype | None = None, fmt: torch.memory_format | None = None, is_input: bool = False):
    """A fresh copy of a sample argument (tensors: same strides and requires_grad; upcast to ``dtype``;
    the input converted to ``fmt``)."""
    if isinstance(v, Tensor):
        t = v.detach()
        t = t.to(dtype) if dtype is not None and t.is_floating_point() else t.clone()
        if is_input and fmt is not None:
            t = t.contiguous(memory_format=fmt)
        return t.requires_grad_(v.requires_grad)
    if isinstance(v, (list, tuple)):
        return type(v)(_clone(a, dtype) for a in v)
    return v


def _arguments(sample, dtype=None, fmt=None):
    x = _clone(sample.input, dtype, fmt, is_input=True)
    return x, [_clone(a, dtype) for a in sample.args], {k: _clone(v, dtype) for k, v in sample.kwargs.items()}


def _leaves(x, args, kwargs, names):
    """(name, tensor) of every argument: differentiable ones and in-place buffers, by a readable name."""
    out = [("input", x)]
    for i, a in enumerate(args):
        out.append((names[i] if i < len(names) else f"args[{i}]", a))
    out.extend(kwargs.items())
    return [(n, t) for n, t in out if isinstance(t, Tensor)]


def _cotangent(y: Tensor) -> Tensor:
    g = torch.Generator().manual_seed(1234)
    return torch.randn(y.shape, generator=g).to(y.dtype)


def _grads(y: Tensor, leaves, cot: Tensor):
    wrt = [(n, t) for n, t in leaves if t.requires_grad]
    if not wrt or not y.requires_grad:
        return {}
    gs = torch.autograd.grad(y, [t for _, t in wrt], cot.to(y.dtype), allow_unused=True)
    return {n: g for (n, _), g in zip(wrt, gs)}


class _NotApplicable(Exception):
    pass


def _ours(run, backend: str):
    """Run normscope's call on ``backend``; a forced backend that declines raises _NotApplicable."""
    engine._LAST.set(None)
    try:
        if backend == "auto":
            return run(), engine.last_backend()
        with normscope.use_backend(backend):
            out = run()
    except ValueError as e:
        if backend != "auto" and "cannot run" in str(e):
            raise _NotApplicable(str(e)) from None
        raise
    ran = engine.last_backend()
    assert ran in (backend, None), f"forced backend {backend!r}, but {ran!r} ran"
    return out, ran


def _recorder(record_property, log):
    def record(what, rule):
        log.append(f"{what}: {rule}")
        record_property(f"rule: {what}", rule)

    return record


def _compare_all(record, ours, theirs, exact_fn, fmt):
    """Compare output, memory format, gradients and buffers; ``exact_fn()`` -> the float64 run (lazily)."""
    cache_ = {}

    def exact(kind, key=None):
        if not cache_:
            cache_["run"] = exact_fn()
        got = cache_["run"][kind]
        return got if key is None else got[key]

    y, y_t = ours["out"], theirs["out"]
    _judge("output", y, y_t, lambda: exact("out"), record)
    if fmt is not None:
        # the output's layout: torch's, or the input's (what torch's own test_memory_format asks of a module; torch
        # skips that test for LayerNorm and InstanceNorm, whose outputs are contiguous)
        torch_cl, ours_cl = y_t.is_contiguous(memory_format=fmt), y.is_contiguous(memory_format=fmt)
        if ours_cl != torch_cl:
            assert ours_cl, (
                f"output layout: torch's output and the input are {fmt}, normscope's is not (strides {y.stride()})"
            )
            record("output layout", f"{fmt} like the input; torch's is not")
    for n, g_t in theirs["grads"].items():
        g = ours["grads"].get(n)
        if g_t is None:
            assert g is None or not g.abs().any(), f"grad of {n}: torch has none, ours is nonzero"
            continue
        assert g is not None, f"grad of {n}: torch computes one, normscope's is None (not connected)"
        _judge(f"grad {n}", g, g_t, lambda n=n: exact("grads", n), record)
    for n, b_t in theirs["buffers"].items():
        _judge(f"buffer {n} after forward", ours["buffers"][n], b_t, lambda n=n: exact("buffers", n), record)


# ----------------------------------------------------------------------------------------------------------------
# OpInfo samples


def _run_op(name, sample, dtype, fmt, call):
    """Run ``call(x, *args, **kwargs)`` on a fresh copy of the sample: output, gradients, updated buffers."""
    op = OPS[name]
    x, args, kwargs = _arguments(sample, dtype, fmt)
    leaves = _leaves(x, args, kwargs, op.names)
    y = call(x, *args, **kwargs)
    y = _first(y)
    buffers = {n: t.detach().clone() for n, t in leaves if not t.requires_grad and n != "input"}
    return {"out": y, "grads": _grads(y, leaves, _cotangent(y)), "buffers": buffers}


_OP_CASES = list(_op_cases())
_MODULE_CASES = list(_module_cases())


def test_the_applicability_probe_keeps_every_backend_where_it_runs():
    # the probe must drop only what a backend declines: each backend keeps cases, rows at least the RMS rows
    # it runs unmasked, and Triton (registered with the triton extra) its interpreter's subset
    cases = [(p.values[0], p.values[-1]) for p in _OP_CASES + _MODULE_CASES]
    assert {b for _, b in cases} == set(BACKENDS)
    assert {name for name, b in cases if b == "rows"} >= {"nn.functional.rms_norm", "nn.RMSNorm"}
    assert {name for name, b in cases if b == "rows"} < {name for name, _ in cases}
    assert {name for name, b in cases if b == "aten"} == {name for name, b in cases if b == "reference"}


@pytest.mark.parametrize("name,dtype,index,fmt,backend", _OP_CASES)
def test_op_sample(name, dtype, index, fmt, backend, record_property):
    sample = _op_samples(name, dtype)[index]
    op, info = OPS[name], _OPINFOS[name]
    log: list[str] = []
    record = _recorder(record_property, log)
    diff = _difference(name, sample.input)
    theirs = _run_op(name, sample, None, fmt, info.op)
    try:
        ours, ran = _ours(lambda: _run_op(name, sample, None, fmt, op.ours), backend)
    except _NotApplicable as e:
        pytest.skip(f"not applicable: {e}")
    except Exception as e:
        if diff is not None and isinstance(e, diff.raises):
            record_property(
                "rule: deliberate difference", f"raises {type(e).__name__}: docs/differences.md, {diff.section!r}"
            )
            return
        raise AssertionError(f"normscope raised where torch computes: {type(e).__name__}: {e}") from e
    assert diff is None, (
        f"docs/differences.md ({diff.section!r}) says normscope raises {diff.raises.__name__} here; it computed"
    )
    record_property("backend", ran)
    _compare_all(record, ours, theirs, lambda: _run_op(name, sample, torch.float64, fmt, info.op), fmt)
    assert log, "nothing was compared"


# ----------------------------------------------------------------------------------------------------------------
# ModuleInfo samples


def _torch_module(name, sample, dtype):
    """torch's module for the sample, with its parameters and running statistics drawn at random (seeded): the
    default ones (weight 1, bias 0, mean 0, var 1) would hide an affine or running-statistics mix-up."""
    info = _MODINFOS[name]
    c = sample.constructor_input
    with torch.random.fork_rng():
        torch.manual_seed(7)
        m = info.module_cls(*c.args, **c.kwargs).to(dtype)
        with torch.no_grad():
            for pname, p in m.named_parameters():
                p.copy_(torch.rand(p.shape) + 0.5 if pname == "weight" else torch.randn(p.shape))
            for bname, b in m.named_buffers():
                if bname == "running_mean":
                    b.copy_(torch.randn(b.shape) * 0.5)
                elif bname == "running_var":
                    b.copy_(torch.rand(b.shape) + 0.5)
    return m


def _run_module(module, sample, training, dtype, fmt):
    module.train(training)
    x = _clone(sample.forward_input.args[0], dtype, fmt, is_input=True)
    y = module(x, *sample.forward_input.args[1:], **sample.forward_input.kwargs)
    leaves = [("input", x)] + [(n, p) for n, p in module.named_parameters()]
    buffers = {n: b.detach().clone() for n, b in module.named_buffers()}
    return {"out": y, "grads": _grads(y, leaves, _cotangent(y)), "buffers": buffers}


@pytest.mark.parametrize("name,dtype,training,index,fmt,backend", _MODULE_CASES)
def test_module_sample(name, dtype, training, index, fmt, backend, record_property):
    sample = _module_samples(name, dtype, training)[index]
    log: list[str] = []
    record = _recorder(record_property, log)
    diff = _difference(name, sample.forward_input.args[0])
    reference = _torch_module(name, sample, dtype)
    theirs_mod = copy.deepcopy(reference)
    exact_mod = copy.deepcopy(reference).double()
    theirs = _run_module(theirs_mod, sample, training, None, fmt)
    c = sample.constructor_input

    def run():
        ours_mod = MODULES[name](*c.args, **c.kwargs).to(dtype)
        ours_mod.load_state_dict(reference.state_dict())
        return _run_module(ours_mod, sample, training, None, fmt)

    try:
        ours, ran = _ours(run, backend)
    except _NotApplicable as e:
        pytest.skip(f"not applicable: {e}")
    except Exception as e:
        if diff is not None and isinstance(e, diff.raises):
            record_property(
                "rule: deliberate difference", f"raises {type(e).__name__}: docs/differences.md, {diff.section!r}"
            )
            return
        raise AssertionError(f"normscope raised where torch computes: {type(e).__name__}: {e}") from e
    assert diff is None, (
        f"docs/differences.md ({diff.section!r}) says normscope raises {diff.raises.__name__} here; it computed"
    )
    record_property("backend", ran)
    _compare_all(record, ours, theirs, lambda: _run_module(exact_mod, sample, training, torch.float64, fmt), fmt)
    assert log, "nothing was compared"


# ----------------------------------------------------------------------------------------------------------------
# error inputs: normscope raises too, a ValueError or TypeError


def _assert_user_error(e: BaseException, torch_type: type, where: str, record_property) -> None:
    ok = isinstance(e, (ValueError, TypeError)) and (torch_type in (ValueError, TypeError, RuntimeError))
    assert ok, f"{where}: expected ValueError/TypeError (torch: {torch_type.__name__}), got {type(e).__name__}: {e}"
    assert str(e), f"{where}: {type(e).__name__} without a message"
    record_property("rule: error", f"{type(e).__name__}: {e}")


def _op_error_cases():
    for name in OPS:
        for i, _ in enumerate(_op_errors(name)):
            yield pytest.param(name, i, id=f"{name}-e{i}")


def _module_error_cases():
    for name in MODULES:
        for i, _ in enumerate(_module_errors(name)):
            yield pytest.param(name, i, id=f"{name}-e{i}")


@pytest.mark.parametrize("name,index", list(_op_error_cases()))
def test_op_error_input(name, index, record_property):
    err = _op_errors(name)[index]
    s = err.sample_input
    with pytest.raises(err.error_type):  # the sample is an error for torch itself
        _OPINFOS[name].op(s.input, *s.args, **s.kwargs)
    try:
        OPS[name].ours(s.input, *s.args, **s.kwargs)
    except Exception as e:
        _assert_user_error(
            e, err.error_type, f"{name} error input {index} (torch: {err.error_regex!r})", record_property
        )
    else:
        pytest.fail(f"{name}: torch raises {err.error_type.__name__} ({err.error_regex!r}); normscope returned")


@pytest.mark.parametrize("name,index", list(_module_error_cases()))
def test_module_error_input(name, index, record_property):
    err = _module_errors(name)[index]
    s = err.module_error_input
    c, f = s.constructor_input, s.forward_input
    where = f"{name} error input {index} (torch: {err.error_type.__name__} {err.error_regex!r})"
    with pytest.raises(err.error_type):  # the sample is an error for torch itself
        m = _MODINFOS[name].module_cls(*c.args, **c.kwargs)
        if err.error_on == ModuleErrorEnum.FORWARD_ERROR:
            m(*f.args, **f.kwargs)
    stage = "construction"
    try:
        m = MODULES[name](*c.args, **c.kwargs)
        if err.error_on == ModuleErrorEnum.FORWARD_ERROR:
            stage = "forward"
            m(*f.args, **f.kwargs)
    except Exception as e:
        _assert_user_error(e, err.error_type, where, record_property)
        record_property("raised at", stage)
    else:
        pytest.fail(f"{where}: normscope raised nothing")
