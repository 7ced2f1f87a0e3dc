"""torch.compile(fullgraph=True) traces through the engine (dispatch, plan, layers) on CPU.

Slow (a compile takes ~15-40 s on 2 shared cores): marked ``slow``; deselect with ``-m "not slow"``.
"""

from __future__ import annotations

import copy
import functools
import re
import time
import warnings

import pytest
import torch

import normscope
from conftest import direct


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3),
        normscope.BatchNorm2d(8),
        normscope.GroupNorm(2, 8),
        normscope.InstanceNorm2d(8, affine=True, track_running_stats=True),
        torch.nn.Flatten(2),  # (N, 8, 36)
        normscope.LayerNorm(36),
        normscope.RMSNorm(36),
    ).double()  # float64: eager and compiled agree to ~1e-12, so any real difference shows


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compile_fullgraph_matches_eager_in_train_and_eval(backend):
    """``aot_eager`` checks dynamo's trace and AOT autograd; ``inductor`` adds code generation."""
    torch._dynamo.reset()
    eager = _model()
    compiled_mod = copy.deepcopy(eager)
    compiled = torch.compile(compiled_mod, fullgraph=True, backend=backend)  # a graph break raises
    g = torch.Generator().manual_seed(1)
    t0 = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            x = torch.randn(4, 3, 8, 8, generator=g, dtype=torch.float64)
            ye = eager(x)
            yc = compiled(x)
            torch.testing.assert_close(yc, ye, rtol=1e-9, atol=1e-9)
            ye.square().sum().backward()
            yc.square().sum().backward()
        for (k, pe), (_, pc) in zip(eager.named_parameters(), compiled_mod.named_parameters()):
            torch.testing.assert_close(pc.grad, pe.grad, rtol=1e-9, atol=1e-9, msg=lambda m, k=k: f"{k}: {m}")
        for (k, be), (_, bc) in zip(eager.named_buffers(), compiled_mod.named_buffers()):
            torch.testing.assert_close(bc, be, rtol=1e-9, atol=1e-9, msg=lambda m, k=k: f"{k}: {m}")
        assert int(compiled_mod[1].num_batches_tracked) == 2
        eager.eval()
        compiled_mod.eval()
        x = torch.randn(4, 3, 8, 8, generator=g, dtype=torch.float64)
        torch.testing.assert_close(compiled(x), eager(x), rtol=1e-9, atol=1e-9)
    # no notice about normscope's own code (the lru_cache wrappers dynamo warned about are gone)
    ours = [str(w.message) for w in caught if "lru_cache" in str(w.message) or "normscope" in str(w.filename)]
    assert not ours, ours
    print(f"torch.compile(fullgraph=True, backend={backend!r}) train+eval: {time.perf_counter() - t0:.1f} s")


@pytest.mark.slow
def test_compile_fullgraph_reference_backend_and_masks(monkeypatch):
    """The reference path (forced through NORMSCOPE_BACKEND) and a masked normalize trace too."""
    torch._dynamo.reset()
    monkeypatch.setenv("NORMSCOPE_BACKEND", "reference")
    torch.manual_seed(0)
    eager = torch.nn.Sequential(normscope.BatchNorm1d(4), normscope.LayerNorm(6), normscope.GroupNorm(2, 4)).double()
    compiled_mod = copy.deepcopy(eager)
    compiled = torch.compile(compiled_mod, fullgraph=True, backend="aot_eager")
    x = torch.randn(3, 4, 6, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.testing.assert_close(compiled(x), eager(x), rtol=1e-9, atol=1e-9)
        assert normscope.last_backend() == "reference"
        for (k, be), (_, bc) in zip(eager.named_buffers(), compiled_mod.named_buffers()):
            torch.testing.assert_close(bc, be, rtol=1e-9, atol=1e-9, msg=lambda m, k=k: f"{k}: {m}")

        def masked(x, mask):
            return normscope.normalize(x, keep=1, mask=mask)

        mask = torch.rand(3, 1, 6) < 0.6
        y = torch.compile(masked, fullgraph=True, backend="aot_eager")(x, mask)
        torch.testing.assert_close(y, direct(x, (0, 2), mask=mask))


def _counting_backend():
    """``(graphs, backend)``: a torch.compile backend that runs each graph as it is and keeps it."""
    frames = []

    def counting(gm, example_inputs):
        frames.append(gm)
        return gm.forward

    return frames, counting


@pytest.mark.slow
def test_environment_is_read_when_traced_not_guarded(monkeypatch):
    """NORMSCOPE_BACKEND (and TRITON_INTERPRET) are read once while tracing: an environment variable
    set afterwards -- any, or ours -- neither recompiles the graph nor changes its backend. Traced as
    a read of os.environ, dynamo guarded on every key of the environment (a retrace on any change)
    and evaluated that guard on every call (engine.constant_when_compiled)."""
    torch._dynamo.reset()
    frames, counting = _counting_backend()
    ln = normscope.LayerNorm(8).double()
    x = torch.randn(4, 8, dtype=torch.float64)
    compiled = torch.compile(ln, backend=counting)
    y = compiled(x)
    monkeypatch.setenv("NORMSCOPE_SOME_UNRELATED_VARIABLE", "1")
    monkeypatch.setenv("NORMSCOPE_BACKEND", "reference")
    torch.testing.assert_close(compiled(x), y)
    assert len(frames) == 1, f"recompiled {len(frames) - 1} time(s) after an environment change"
    # eagerly the variable is read per call, as documented
    ln(x)
    assert normscope.last_backend() == "reference"


def _layers():
    """One of each layer with a traced hot path, and an input for it."""
    return [
        (normscope.LayerNorm(6), (3, 4, 6)),
        (normscope.RMSNorm(6), (3, 4, 6)),
        (normscope.GroupNorm(2, 4), (3, 4, 5)),
        (normscope.BatchNorm1d(4), (3, 4, 5)),
        (normscope.BatchNorm2d(4).eval(), (3, 4, 2, 5)),
        (normscope.InstanceNorm1d(4, affine=True, track_running_stats=True), (3, 4, 5)),
    ]


@pytest.mark.slow
@pytest.mark.parametrize("i", range(6))
def test_compiled_layer_guards_only_its_runner(i):
    """A compiled layer's guards cover the runner it runs, not its checked path: the checks, the
    scope's resolution and the choice of backend are planned once, eagerly, on stand-ins
    (normscope.hot._trace_token). Traced, each function and constant they read was a guard that
    dynamo evaluated on every call (a compiled small model ~5 % slower than torch.nn's)."""
    torch._dynamo.reset()
    layer, shape = _layers()[i]
    x = torch.randn(shape)
    out = torch._dynamo.explain(layer)(x)
    assert out.graph_break_count == 0, out.break_reasons
    names = {g.name for g in out.out_guards}
    modules = ("normscope_dot__checks", "normscope_dot_functional", "normscope_dot_scope")
    # the op's settings builder is the layer's own forward (functional.*_settings, functional_modern.
    # last_axes): it runs traced and reads its op and settings type, not the checks
    builder = re.compile(
        r"functional(_modern)?'\]($|\.(last_axes|\w+_settings|\w+Settings|[A-Z_]*NORM[A-Z_]*(\.name)?)$)"
    )
    checked = [n for n in names if any(m in n for m in modules) and not builder.search(n)]
    assert not checked, f"{type(layer).__name__}: the checked path was traced: {sorted(checked)}"
    assert any("_TRACE_PLANS" in n for n in names), sorted(names)


@pytest.mark.slow
@pytest.mark.parametrize("i", range(6))
def test_compile_dynamic_shapes_fullgraph(i):
    """With symbolic sizes (dynamic=True, or the automatic dynamic shapes of a second batch size)
    a layer has no constant signature to plan with: the checked path is traced, without a graph
    break. (Dynamo answers ``type(n) is int`` -- and isinstance(n, SymInt) -- as for an int: a
    check written so sent symbolic sizes to an assume_constant_result function, a graph break.)"""
    layer, shape = _layers()[i]
    for dynamic in (True, None):
        torch._dynamo.reset()
        eager, traced = copy.deepcopy(layer), copy.deepcopy(layer)
        compiled = torch.compile(traced, dynamic=dynamic, fullgraph=True, backend="eager")
        for n in (shape[0], shape[0] + 2, shape[0] + 4):
            x = torch.randn((n, *shape[1:]))
            where = f"dynamic={dynamic}, batch {n}"
            torch.testing.assert_close(compiled(x), eager(x), msg=lambda m, where=where: f"{where}: {m}")
        for (k, be), (_, bc) in zip(eager.named_buffers(), traced.named_buffers()):
            torch.testing.assert_close(bc, be, msg=lambda m, k=k: f"{k}: {m}")


@pytest.mark.slow
def test_compile_dynamic_fullgraph_with_a_weight_offset():
    """torch.compile(dynamic=True) makes a layer's float attribute a symbolic float: the family
    layers' ``weight_offset`` (QKNorm's always, RMSNorm's and LayerNorm's when set) is then checked
    traced, and its finiteness check must trace without a graph break (``math.isfinite`` of a
    symbolic float was one: an error under fullgraph=True). Against the RMS formula in float64."""

    def rms(x, w, eps):
        x = x.double()
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.double()

    torch.manual_seed(0)
    qk = normscope.QKNorm(8)  # Qwen3's: weight_offset=0.0, stored on the layer
    gemma = normscope.RMSNorm(8, eps=1e-6, weight_offset=1.0, casting="gemma")
    with torch.no_grad():
        for p in (qk.q_weight, qk.k_weight, gemma.weight):
            p.uniform_(-0.5, 0.5)
    torch._dynamo.reset()
    c_qk = torch.compile(qk, dynamic=True, fullgraph=True, backend="eager")
    c_gemma = torch.compile(gemma, dynamic=True, fullgraph=True, backend="eager")
    for n in (3, 5):
        q, k = torch.randn(2, n, 4, 8), torch.randn(2, n, 2, 8)
        qn, kn = c_qk(q, k)
        torch.testing.assert_close(qn, rms(q, qk.q_weight, 1e-6), check_dtype=False)
        torch.testing.assert_close(kn, rms(k, qk.k_weight, 1e-6), check_dtype=False)
        x = torch.randn(n, 8)
        torch.testing.assert_close(c_gemma(x), rms(x, gemma.weight + 1.0, 1e-6), check_dtype=False)


@pytest.mark.slow
def test_compile_fullgraph_with_an_eps_or_offset_that_changes_between_calls():
    """An eps that changes between calls of compiled code -- a layer's attribute, or a functional
    call's argument -- becomes a symbolic float under torch.compile's default automatic dynamic; it
    has no constant to plan with (as symbolic sizes), and the checked call is traced. Handed to the
    planner's constant function it was dynamo's "assume_constant_result argument conversion failed",
    an error under fullgraph=True. So is a family layer's ``weight_offset`` (read by the choice of
    backend, planned on stand-ins likewise). Against torch.nn.functional, which compiles so."""
    torch._dynamo.reset()
    ln, gn = normscope.LayerNorm(8), normscope.GroupNorm(2, 8)
    gemma = normscope.RMSNorm(8, eps=1e-6, weight_offset=1.0, casting="gemma")
    c_ln = torch.compile(ln, fullgraph=True, backend="eager")
    c_gn = torch.compile(gn, fullgraph=True, backend="eager")
    c_gemma = torch.compile(gemma, fullgraph=True, backend="eager")
    c_rms = torch.compile(lambda t, e: normscope.functional.rms_norm(t, (8,), eps=e), fullgraph=True, backend="eager")
    for eps, offset in ((1e-5, 1.0), (1e-3, 0.5), (0.5, 2.0)):
        ln.eps = gn.eps = eps
        gemma.weight_offset = offset
        x, xg = torch.randn(3, 8), torch.randn(3, 8, 4)
        torch.testing.assert_close(c_ln(x), torch.nn.functional.layer_norm(x, (8,), ln.weight, ln.bias, eps))
        torch.testing.assert_close(c_gn(xg), torch.nn.functional.group_norm(xg, 2, gn.weight, gn.bias, eps))
        torch.testing.assert_close(c_rms(x, eps), torch.nn.functional.rms_norm(x, (8,), eps=eps))
        scale = gemma.weight.detach() + offset
        torch.testing.assert_close(c_gemma(x), torch.nn.functional.rms_norm(x, (8,), scale, eps=1e-6))


@pytest.mark.slow
def test_compile_fullgraph_with_one_changing_eps_given_to_two_norms():
    """A symbolic eps given to two norms of one traced function: the first one's ATen op takes no
    symbolic float, and dynamo fixes its value with a guard while still handing it on as a symbol. The
    second norm's planner read it as a constant and handed the symbol to its constant function:
    "assume_constant_result argument conversion failed" under fullgraph=True -- QKNorm (q, then k) and
    PolyNorm (three RMS scopes) on every eps after the first, and any function calling two norms with
    its eps argument. Against torch.nn.functional, and the layers eagerly."""
    torch._dynamo.reset()
    qk, poly = normscope.QKNorm(8), normscope.PolyNorm()
    c_qk = torch.compile(lambda q, k: qk(q, k), fullgraph=True, backend="eager")
    c_poly = torch.compile(poly, fullgraph=True, backend="eager")

    def two(t, e):
        return normscope.functional.layer_norm(normscope.functional.rms_norm(t, (8,), eps=e), (8,), eps=e)

    c_two = torch.compile(two, fullgraph=True, backend="eager")
    F = torch.nn.functional
    for eps in (1e-6, 1e-5, 1e-3, 0.5):
        qk.eps = poly.eps = eps
        x, q, k = torch.randn(3, 8), torch.randn(2, 3, 4, 8), torch.randn(2, 3, 2, 8)
        want = F.layer_norm(F.rms_norm(x, (8,), eps=eps), (8,), eps=eps)
        torch.testing.assert_close(c_two(x, eps), want, rtol=0, atol=0)
        for got, expected in zip(c_qk(q, k), normscope.QKNorm(8, eps=eps)(q, k)):
            torch.testing.assert_close(got, expected, rtol=0, atol=0)
        torch.testing.assert_close(c_poly(x), poly(x), rtol=0, atol=0)


@pytest.mark.slow
def test_compiled_bad_input_raises_the_layers_error():
    """A call the checks refuse has no traced plan: the layer's checked path runs and raises its
    ValueError, as eagerly (not dynamo's wrapper of an error raised while planning)."""
    torch._dynamo.reset()
    with pytest.raises(ValueError, match=r"normalized_shape=\[8\], got input of shape \(4, 7\)"):
        torch.compile(normscope.LayerNorm(8), backend="eager")(torch.randn(4, 7))
    with pytest.raises(ValueError, match=r"GroupNorm\(2, 8\): expected input with 8 channels at dim 1, got 6"):
        torch.compile(normscope.GroupNorm(2, 8), backend="eager")(torch.randn(4, 6, 3))


@pytest.mark.slow
def test_a_traced_plan_is_not_reused_for_an_eps_of_another_type():
    """The traced plans' key holds eps's type, as the eager key does: ``True == 1.0``, and the check
    that refuses a bool eps must run when a call with eps=True is traced after one with eps=1.0."""
    torch._dynamo.reset()
    x = torch.randn(2, 8)
    torch.compile(lambda t: normscope.functional.layer_norm(t, (8,), eps=1.0), backend="eager")(x)
    with pytest.raises(TypeError, match="layer_norm: expected `eps` to be a float, got True"):
        torch.compile(lambda t: normscope.functional.layer_norm(t, (8,), eps=True), backend="eager")(x)


@pytest.mark.slow
def test_compiled_layer_follows_use_backend():
    """The requested backend is part of the traced plan's key and guarded: entering use_backend
    recompiles, and the compiled call runs (and reports) the forced backend."""
    torch._dynamo.reset()
    frames, counting = _counting_backend()
    ln = normscope.LayerNorm(8).double()
    x = torch.randn(4, 8, dtype=torch.float64)
    compiled = torch.compile(ln, backend=counting, fullgraph=True)
    compiled(x)
    assert normscope.last_backend() == "aten"
    with normscope.use_backend("reference"):
        torch.testing.assert_close(compiled(x), direct(x, (1,)) * ln.weight + ln.bias)
        assert normscope.last_backend() == "reference"
    assert len(frames) == 2


@pytest.mark.slow
def test_use_backend_inside_a_compiled_function():
    """A ``with use_backend(...)`` block inside the compiled code itself (as torch.no_grad() may be)
    forces the calls in its block, fullgraph=True included: dynamo cannot trace ContextVar.set, which the
    block called (an Unsupported error). The graph holds ATen's layer_norm only for the block that asks for
    'aten'; the numbers are the float64 formula's."""
    graphs = []

    def keep(gm, example_inputs):
        graphs.append(str(gm.graph))
        return gm.forward

    ln = normscope.LayerNorm(8).double()
    x = torch.randn(4, 8, dtype=torch.float64)

    def run(t, name):
        with normscope.use_backend(name):
            return ln(t) * 2

    for name, native in (("reference", False), ("aten", True)):
        torch._dynamo.reset()
        y = torch.compile(functools.partial(run, name=name), fullgraph=True, backend=keep)(x)
        torch.testing.assert_close(y, 2 * direct(x, (1,)))
        assert normscope.last_backend() == name
        assert ("layer_norm" in graphs[-1]) is native, graphs[-1]
    assert normscope.engine.requested_backend() == "auto"  # nothing forced after the blocks


def test_a_forced_backend_that_cannot_run_a_compiled_call_raises_its_value_error():
    # eagerly use_backend("rows") on a LayerNorm raises ValueError ("cannot run"); compiled, the choice
    # made on stand-ins raised it from inside a function dynamo runs as a constant, and the caller got
    # dynamo's InternalTorchDynamoError -- as the checks' errors, the refusal is now traced and raised
    torch._dynamo.reset()
    x = torch.randn(4, 8)
    with normscope.use_backend("rows"), pytest.raises(ValueError, match="cannot run"):
        normscope.LayerNorm(8)(x)
    compiled = torch.compile(normscope.LayerNorm(8), backend="eager")
    torch.testing.assert_close(compiled(x), torch.nn.functional.layer_norm(x, (8,)))
    with normscope.use_backend("rows"), pytest.raises(ValueError, match="backend 'rows' cannot run"):
        compiled(x)
    fresh = torch.compile(normscope.LayerNorm(8), backend="eager")
    with normscope.use_backend("rows"), pytest.raises(ValueError, match="backend 'rows' cannot run"):
        fresh(x)
    torch.testing.assert_close(compiled(x), torch.nn.functional.layer_norm(x, (8,)))  # the automatic graph still runs


def test_a_traced_plan_is_made_for_the_request_its_memo_is_keyed_by():
    # The traced plans are memoized by the request as the graph reads it (the thread's view of the forced
    # backend), but the plan was made for this context's FORCED: traced in a copied context (FORCED
    # 'reference', the thread's view unset), the memo for "nothing forced" held a 'reference' plan, which
    # every later trace of the same signature, in any thread, then took
    import contextvars

    graphs = []

    def keep(gm, example_inputs):
        graphs.append(str(gm.graph))
        return gm.forward

    x = torch.randn(5, 13)  # a signature no other test compiles: the memo is shared by the process
    with normscope.use_backend("reference"):
        ctx = contextvars.copy_context()
    torch._dynamo.reset()
    ctx.run(torch.compile(normscope.LayerNorm(13), fullgraph=True, backend=keep), x)
    torch._dynamo.reset()  # a fresh trace in this context, where nothing is forced
    plain = torch.compile(normscope.LayerNorm(13), fullgraph=True, backend=keep)
    torch.testing.assert_close(plain(x), torch.nn.functional.layer_norm(x, (13,)))
    normscope.LayerNorm(13)(x)
    assert normscope.last_backend() == "aten"  # what an eager call with nothing forced runs: ATen's op
    assert "layer_norm" in graphs[-1], graphs[-1]
