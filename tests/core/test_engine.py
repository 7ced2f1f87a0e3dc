"""The engine over random scopes: reference vs a float64 formula, engine and aten vs reference,
and backend selection (forcing, env var, precedence, last_backend, errors)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import normscope
from conftest import direct, hypothesis_examples
from normscope import engine
from normscope import reference as ref
from normscope.engine import Running, norm
from normscope.scope import Scope

SIZES = st.sampled_from([1, 2, 3, 4, 5, 6, 7, 8, 9, 11, 12, 13])


@st.composite
def scope_cases(draw):
    """A random input, scope (reduce or keep form, centered, groups), affine, mask and eps."""
    nd = draw(st.integers(1, 4))
    shape = tuple(draw(st.lists(SIZES, min_size=nd, max_size=nd)))
    axes = list(range(nd))
    # half the time one of the layouts the named layers use (and aten has ops for), with the
    # grouping and affine still random, so near-misses of the aten kinds are exercised too
    template = draw(st.sampled_from(["random", "random", "all_but_0", "all_but_1", "all_but_0_1", "last_k"]))
    if template == "random":
        reduce = sorted(draw(st.sets(st.sampled_from(axes), min_size=0, max_size=nd)))
    elif template == "last_k":
        reduce = axes[nd - draw(st.integers(1, nd)) :]
    else:
        kept = {"all_but_0": {0}, "all_but_1": {1}, "all_but_0_1": {0, 1}}[template]
        reduce = [a for a in axes if a not in kept]
    centered = draw(st.booleans())
    groups, group_dim = 1, 1
    grouped = [a for a in reduce if shape[a] > 1]
    if grouped and draw(st.booleans()):
        group_dim = draw(st.sampled_from(grouped))
        # proper divisors where there are any: groups == channels canonicalises to no grouping
        n = shape[group_dim]
        divisors = [g for g in range(2, n) if n % g == 0] or [n]
        groups = draw(st.sampled_from(divisors))
    affine_kind = draw(st.sampled_from(["none", "reduce", "other", "channel"]))
    if affine_kind == "reduce":
        affine = tuple(reduce)
    elif affine_kind == "channel":
        affine = (min(1, nd - 1),)
    elif affine_kind == "other":
        affine = tuple(sorted(draw(st.sets(st.sampled_from(axes), min_size=1, max_size=nd))))
    else:
        affine = ()
    with_bias = draw(st.booleans())
    use_keep = draw(st.booleans())
    # a scope is written with negative or positive axes; both must resolve the same
    neg = draw(st.booleans())
    wr = lambda a: a - nd if neg else a  # noqa: E731
    if use_keep:
        scope = Scope(
            keep=tuple(wr(a) for a in axes if a not in reduce),
            centered=centered,
            groups=groups,
            group_dim=wr(group_dim),
            affine=tuple(wr(a) for a in affine),
        )
    else:
        scope = Scope(
            reduce=tuple(wr(a) for a in reduce),
            centered=centered,
            groups=groups,
            group_dim=wr(group_dim),
            affine=tuple(wr(a) for a in affine),
        )
    mask_dims = draw(st.sampled_from(["none", "full", "broadcast"]))
    seed = draw(st.integers(0, 2**16))
    eps = draw(st.sampled_from([1e-5, 1e-3, 0.1]))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float64) * 3 + 1
    mask = None
    if mask_dims != "none":
        mshape = shape if mask_dims == "full" else tuple(s if i % 2 else 1 for i, s in enumerate(shape))
        mask = torch.rand(mshape, generator=g) < 0.7
    pshape = tuple(shape[a] for a in affine)
    weight = torch.randn(pshape, generator=g, dtype=torch.float64) if affine else None
    bias = torch.randn(pshape, generator=g, dtype=torch.float64) if affine and with_bias else None
    return dict(
        x=x,
        scope=scope,
        reduce=tuple(reduce),
        centered=centered,
        groups=groups,
        group_dim=group_dim,
        affine=affine,
        weight=weight,
        bias=bias,
        mask=mask,
        eps=eps,
    )


# 120 examples in CI, fewer in the README's command (conftest.hypothesis_examples)
HYP = settings(max_examples=hypothesis_examples(120), deadline=None, suppress_health_check=[HealthCheck.too_slow])


@HYP
@given(scope_cases())
def test_reference_matches_float64_formula(case):
    """The oracle itself, in fp64 and fp32, against the formula written in conftest.direct."""
    expected = direct(
        case["x"],
        case["reduce"],
        case["centered"],
        case["groups"],
        case["group_dim"],
        case["affine"],
        case["weight"],
        case["bias"],
        case["eps"],
        case["mask"],
    )
    resolved = case["scope"].resolve(tuple(case["x"].shape))
    y64 = ref.normalize(case["x"], resolved, case["weight"], case["bias"], case["eps"], case["mask"])
    torch.testing.assert_close(y64, expected, rtol=1e-9, atol=1e-9)
    w32 = None if case["weight"] is None else case["weight"].float()
    b32 = None if case["bias"] is None else case["bias"].float()
    y32 = ref.normalize(case["x"].float(), resolved, w32, b32, case["eps"], case["mask"])
    assert y32.dtype == torch.float32
    torch.testing.assert_close(y32.double(), expected, rtol=1e-4, atol=2e-4)


@HYP
@given(scope_cases())
def test_engine_and_aten_match_reference(case):
    """Automatic dispatch always agrees with the reference; so does aten wherever it accepts."""
    x = case["x"].float()
    w = None if case["weight"] is None else case["weight"].float()
    b = None if case["bias"] is None else case["bias"].float()
    resolved = case["scope"].resolve(tuple(x.shape))
    expected = ref.normalize(x, resolved, w, b, case["eps"], case["mask"])
    y = norm(x, case["scope"], w, b, case["eps"], mask=case["mask"])
    torch.testing.assert_close(y, expected, rtol=1e-4, atol=1e-4)
    assert normscope.last_backend() in engine.backends()
    call = engine.Call(x, resolved, w, b, case["eps"], case["mask"], None)
    if engine._BACKENDS["aten"].why_not(call) is None:
        ya = norm(x, case["scope"], w, b, case["eps"], mask=case["mask"], backend="aten")
        assert normscope.last_backend() == "aten"
        # forced, ATen runs without the automatic path's cancellation guard: its fused CPU kernels
        # compute x * rstd - mean * rstd, each term rounded at |x| * rstd <= |x| / sqrt(eps) (a lone
        # element of 9.5 at eps 1e-5: 1.1e-4 where the answer is 0; docs/differences.md)
        spread = float(x.abs().max()) / math.sqrt(case["eps"]) if x.numel() else 0.0
        atol = max(1e-4, 4 * spread * torch.finfo(torch.float32).eps)
        torch.testing.assert_close(ya, expected, rtol=1e-4, atol=atol)
    else:
        with pytest.raises(ValueError, match="backend 'aten' cannot run"):
            norm(x, case["scope"], w, b, case["eps"], mask=case["mask"], backend="aten")


@pytest.mark.parametrize("shape", [(2, 4, 6), (3, 4, 2, 6)])
def test_every_scope_exhaustively_on_small_shapes(shape):
    """Every reduce set x centered x grouping x affine on one shape (no sampling luck): auto and,
    where it accepts, aten agree with the float64 formula; where aten declines it says so."""
    nd = len(shape)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    n_aten = 0
    for bits in range(2**nd):
        reduce = tuple(a for a in range(nd) if bits >> a & 1)
        groupings = [(1, 1)] + [(g, d) for d in reduce for g in range(2, shape[d]) if shape[d] % g == 0]
        for centered in (True, False):
            for groups, gdim in groupings:
                for affine in {(), reduce, (1,), (nd - 1,)}:
                    scope = Scope(reduce=reduce, centered=centered, groups=groups, group_dim=gdim, affine=affine)
                    pshape = tuple(shape[a] for a in affine)
                    k = math.prod(pshape)
                    w = torch.linspace(0.5, 1.5, k, dtype=torch.float64).reshape(pshape)
                    b = None if not affine else torch.linspace(-1, 1, k, dtype=torch.float64).reshape(pshape)
                    for bias in (None, b):
                        wi = w if affine else None
                        expected = direct(x, reduce, centered, groups, gdim, affine, wi, bias)
                        what = f"{scope} bias={bias is not None}"
                        y = norm(x, scope, wi, bias)
                        torch.testing.assert_close(y, expected, msg=lambda m, w=what: f"{w}: {m}")
                        call = engine.Call(x, scope.resolve(shape), wi, bias, 1e-5, None, None)
                        if engine._BACKENDS["aten"].why_not(call) is None:
                            n_aten += 1
                            y = norm(x, scope, wi, bias, backend="aten")
                            torch.testing.assert_close(y, expected, msg=lambda m, w=what: f"aten {w}: {m}")
    assert n_aten > 20  # the aten kinds really were exercised


# every scope kind aten has an op for, each checked to really run on aten and match (output and grads)
ATEN_CASES = [
    ("batch_norm", (4, 3, 5, 7), Scope.batch(), True),
    ("batch_norm_last", (4, 5, 3), Scope(keep=(-1,), affine=(-1,)), True),
    ("instance_norm", (2, 3, 11), Scope.instance(), True),
    ("layer_norm", (3, 5, 7), Scope.layer(2), True),
    ("layer_norm_inner_axes", (3, 5, 7), Scope(reduce=(1,), affine=(1,)), True),
    ("layer_norm_no_affine", (3, 5, 7), Scope(reduce=(0, 2)), False),
    ("rms_norm", (3, 5, 7), Scope.rms(1), True),
    ("rms_norm_inner", (3, 5, 7), Scope(reduce=(0,), centered=False, affine=(0,)), True),
    ("group_norm", (2, 6, 5), Scope.group(3), True),
    ("group_norm_one_group", (2, 6, 5), Scope.group(1), True),
    ("group_norm_4d", (2, 4, 3, 5), Scope.group(2), True),
]


@pytest.mark.parametrize("name,shape,scope,affine", ATEN_CASES, ids=[c[0] for c in ATEN_CASES])
def test_aten_kinds_match_reference_with_grads(name, shape, scope, affine):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    resolved = scope.resolve(shape)
    pshape = tuple(shape[a] for a in resolved.affine)
    w = torch.randn(pshape, generator=g, dtype=torch.float64) if affine else None
    b = None if (not affine or not resolved.centered) else torch.randn(pshape, generator=g, dtype=torch.float64)
    outs = {}
    for be in ("aten", "reference"):
        xi = x.clone().requires_grad_()
        wi = None if w is None else w.clone().requires_grad_()
        bi = None if b is None else b.clone().requires_grad_()
        y = norm(xi, scope, wi, bi, 1e-5, backend=be)
        assert normscope.last_backend() == be
        gy = torch.randn(shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
        y.backward(gy)
        outs[be] = (y.detach(), xi.grad, None if wi is None else wi.grad, None if bi is None else bi.grad)
    # automatic choice picks aten for all of these
    norm(x, scope, w, b, 1e-5)
    assert normscope.last_backend() == "aten"
    for a, r in zip(outs["aten"], outs["reference"]):
        if a is None:
            assert r is None
        else:
            torch.testing.assert_close(a, r, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("shape,group_dim,groups", [((2, 3, 4), 2, 2), ((2, 6, 4), 2, 2), ((2, 3, 5, 6), -1, 3)])
def test_grouping_another_axis_is_not_torch_group_norm(shape, group_dim, groups):
    """torch.group_norm splits axis 1 only; grouping another axis must not be sent to it."""
    x = torch.randn(shape, dtype=torch.float64)
    scope = Scope(keep=(0,), groups=groups, group_dim=group_dim)
    y = norm(x, scope)
    assert normscope.last_backend() == "reference"
    reduce = tuple(range(1, len(shape)))
    torch.testing.assert_close(y, direct(x, reduce, groups=groups, group_dim=group_dim))
    with pytest.raises(ValueError, match="backend 'aten' cannot run"):
        norm(x, scope, backend="aten")


def test_running_statistics_in_engine_match_between_backends():
    x = torch.randn(4, 3, 6, dtype=torch.float64)
    bufs = {}
    for be in ("aten", "reference"):
        rm, rv = torch.zeros(3, dtype=torch.float64), torch.ones(3, dtype=torch.float64)
        norm(x, Scope.batch(), eps=1e-5, running=Running(rm, rv, 0.3, True), backend=be)
        y = norm(x, Scope.batch(), eps=1e-5, running=Running(rm, rv, 0.3, False), backend=be)
        bufs[be] = (rm, rv, y)
    expected_mean = 0.3 * x.mean((0, 2))
    expected_var = 0.7 + 0.3 * x.var((0, 2), correction=1)
    for be in bufs:
        torch.testing.assert_close(bufs[be][0], expected_mean)
        torch.testing.assert_close(bufs[be][1], expected_var)
    torch.testing.assert_close(bufs["aten"][2], bufs["reference"][2])


# -------------------------------------------------------------------------------------------------
# backend selection


def test_forced_backend_that_cannot_run_raises():
    x = torch.randn(2, 3, 4)
    mask = torch.ones(2, 3, 4, dtype=torch.bool)
    with pytest.raises(ValueError, match="backend 'aten' cannot run this normalization: ATen has no masked"):
        normscope.normalize(x, dims=-1, mask=mask, backend="aten")
    with pytest.raises(ValueError, match="backend 'aten' cannot run"), normscope.use_backend("aten"):
        normscope.normalize(x, dims=-1, mask=mask)
    # uncentered scope with a bias: no aten op
    with pytest.raises(ValueError, match="no ATen op computes this scope exactly"):
        norm(x, Scope(reduce=(-1,), centered=False, affine=(-1,)), torch.ones(4), torch.zeros(4), backend="aten")
    # the reference refuses evaluation without running statistics
    with pytest.raises(ValueError, match="backend 'reference' cannot run"):
        norm(x, Scope.batch(), running=Running(None, None, 0.1, False), backend="reference")


def test_unknown_backend_lists_valid_names(monkeypatch):
    x = torch.randn(2, 3)
    for call in (
        lambda: normscope.normalize(x, dims=-1, backend="cuda-magic"),
        lambda: normscope.use_backend("cuda-magic").__enter__(),
    ):
        with pytest.raises(ValueError, match="unknown backend 'cuda-magic'") as e:
            call()
        for name in ("auto", "aten", "reference"):
            assert name in str(e.value)
    monkeypatch.setenv("NORMSCOPE_BACKEND", "cuda-magic")
    with pytest.raises(ValueError, match="environment variable NORMSCOPE_BACKEND: unknown backend") as e:
        normscope.normalize(x, dims=-1)
    assert "aten" in str(e.value) and "reference" in str(e.value)


def test_backend_precedence_argument_over_context_over_env(monkeypatch):
    x = torch.randn(3, 8)
    normscope.functional.layer_norm(x, (8,))
    assert normscope.last_backend() == "aten"  # automatic choice
    monkeypatch.setenv("NORMSCOPE_BACKEND", "reference")
    normscope.functional.layer_norm(x, (8,))
    assert normscope.last_backend() == "reference"
    with normscope.use_backend("aten"):
        normscope.functional.layer_norm(x, (8,))
        assert normscope.last_backend() == "aten"  # context beats env
        normscope.functional.layer_norm(x, (8,), backend="reference")
        assert normscope.last_backend() == "reference"  # argument beats context
        with normscope.use_backend(None):
            normscope.functional.layer_norm(x, (8,))
            assert normscope.last_backend() == "aten"  # None = automatic, also over the env var
        normscope.functional.layer_norm(x, (8,))
        assert normscope.last_backend() == "aten"
    normscope.functional.layer_norm(x, (8,))
    assert normscope.last_backend() == "reference"  # back to the env var
    monkeypatch.setenv("NORMSCOPE_BACKEND", "auto")
    normscope.functional.layer_norm(x, (8,))
    assert normscope.last_backend() == "aten"
    monkeypatch.setenv("NORMSCOPE_BACKEND", "aten")
    normscope.LayerNorm(8)(x)
    assert normscope.last_backend() == "aten"
    # the env var forces too: a masked call cannot run on aten
    with pytest.raises(ValueError, match="backend 'aten' cannot run"):
        normscope.normalize(x, dims=-1, mask=torch.ones(8, dtype=torch.bool))


def test_last_backend_reports_what_ran():
    x = torch.randn(2, 3, 4)
    normscope.normalize(x, dims=-1, mask=torch.ones(4, dtype=torch.bool))
    assert normscope.last_backend() == "composite"  # ATen has no masked op: the composite form runs it
    normscope.normalize(x, dims=-1, mask=torch.ones(4, dtype=torch.bool), centered=False)
    assert normscope.last_backend() == "reference"  # masked RMS statistics: only the reference
    normscope.normalize(x, dims=-1)
    assert normscope.last_backend() == "aten"
    normscope.GroupNorm(3, 3)(x)
    assert normscope.last_backend() == "aten"  # GroupNorm(C, C) on 3D input is instance_norm
    assert engine.backends()[:2] == ["aten", "reference"] or "aten" in engine.backends()


def test_plan_cache_not_fooled_by_layout():
    """The plan is cached per signature; a transposed input of the same shape must still be right."""
    x = torch.randn(6, 5, dtype=torch.float64)
    a = normscope.normalize(x, dims=-1)
    xt = torch.randn(5, 6, dtype=torch.float64).t()
    b = normscope.normalize(xt, dims=-1)
    torch.testing.assert_close(a, direct(x, (1,)))
    torch.testing.assert_close(b, direct(xt, (1,)))


def test_scope_validation():
    with pytest.raises(ValueError, match="exactly one of `reduce` and `keep`"):
        Scope()
    with pytest.raises(ValueError, match="exactly one of `reduce` and `keep`"):
        Scope(reduce=(1,), keep=(0,))
    with pytest.raises(ValueError, match=r"distinct, got \(1, 1\)"):
        Scope(reduce=(1, 1))
    with pytest.raises(ValueError, match="positive int, got 0"):
        Scope(keep=(0,), groups=0)
    with pytest.raises(ValueError, match=r"axis 3 \(reduce\) does not exist for an input of rank 2"):
        Scope(reduce=(3,)).resolve((2, 3))
    with pytest.raises(ValueError, match="got 5\\) to be divisible by groups=2"):
        Scope.group(2).resolve((2, 5, 3))
    with pytest.raises(ValueError, match="not a reduced axis"):
        Scope(reduce=(2,), groups=2, group_dim=1).resolve((2, 4, 3))


@pytest.mark.parametrize(
    "kwargs",
    [dict(reduce=(-1.0,), affine=(-1.0,)), dict(keep=(0.0,)), dict(reduce=(True,)), dict(keep=(0,), group_dim=1.0)],
)
def test_scope_axes_must_be_ints_and_a_refused_scope_leaves_the_cache_alone(kwargs):
    """A float axis equals and hashes as the int one: were it accepted, its resolution (float axes, which
    cannot index a shape) would be cached under the int scope's key and break every later LayerNorm."""
    x = torch.randn(4, 8)
    with pytest.raises(TypeError, match=r"Scope: expected .* an int axis, got"):
        engine.norm(x, Scope(**kwargs), torch.ones(8) if "affine" in kwargs else None)
    torch.testing.assert_close(normscope.LayerNorm(8)(x), torch.nn.functional.layer_norm(x, (8,)))


def test_scope_axes_of_numpy_ints_resolve_to_python_ints():
    np = pytest.importorskip("numpy")
    s = Scope(reduce=(np.int64(-1),), affine=(np.int64(-1),))
    assert s == Scope.layer(1) and type(s.reduce[0]) is int
    assert type(s.resolve((4, 8)).reduce[0]) is int


@pytest.mark.parametrize("which", ["mask", "residual"])
def test_a_plan_is_not_reused_for_a_mask_or_residual_on_another_device(which):
    """validate() checks every tensor's device once per plan signature, so the signature holds each
    device: a call whose mask or residual moved must be refused as the first such call is."""
    x, w = torch.randn(2, 4, 6), torch.ones(6)
    if which == "mask":
        m = torch.rand(2, 1, 6) > 0.3

        def call(mask):
            return norm(x, Scope.group(2), mask=mask)
    else:
        m = torch.randn(2, 4, 6)

        def call(residual):
            return engine.add_norm(x, residual, Scope.rms(1), w)

    call(m)  # the plan of the call on the input's device
    with pytest.raises(ValueError, match=rf"expected `{which}` on cpu, got meta"):
        call(m.to("meta"))


@pytest.mark.parametrize("which", ["mean", "var"])
def test_running_statistics_on_another_device_are_refused_by_name(which):
    # a backend updates the running statistics in place: validate() checks their device as every
    # other tensor's, once per signature -- after a warm call with both on the input's device too
    x = torch.randn(4, 3, 5)
    good = engine.Running(torch.zeros(3), torch.ones(3), 0.1, True)
    norm(x, Scope.batch(1), running=good)
    moved = good._replace(**{which: getattr(good, which).to("meta")})
    with pytest.raises(ValueError, match=rf"expected `running.{which}` on cpu, got meta"):
        norm(x, Scope.batch(1), running=moved)


@pytest.fixture
def registry_restored():
    """The backends and their order as they were, and no plan made while they differed."""
    from normscope import _registry

    order, known = list(_registry.AUTO), dict(_registry.BACKENDS)
    yield
    _registry.AUTO[:] = order
    _registry.BACKENDS.clear()
    _registry.BACKENDS.update(known)
    _registry.clear_plans()


@pytest.mark.usefixtures("registry_restored")
@pytest.mark.parametrize("registered", ["new", "replacing"])
def test_a_registered_backend_runs_a_warm_layers_next_call(registered):
    """Every plan reads the registry (the automatic order, the backend by name): registering a backend
    must reach the plans a warm layer keeps (normscope.hot) and a warm functional call, not only the
    engine's table."""
    fill = 7.0

    def prepare(call, automatic):
        return lambda c: torch.full_like(c.x, fill)

    ln, x = normscope.LayerNorm(8), torch.randn(2, 8)
    torch.testing.assert_close(ln(x), torch.nn.functional.layer_norm(x, (8,)))  # planned on aten
    name, before = ("sevens", "aten") if registered == "new" else ("aten", "composite")  # aten: in its place
    engine.register_backend(engine.Backend(name, lambda c: None, prepare), before=before)
    torch.testing.assert_close(ln(x), torch.full_like(x, fill))
    assert engine.last_backend() == name


def test_choice_for_trace_matches_the_eager_choice():
    """While dynamo traces, the backend is chosen on a stand-in of the call's signature
    (engine._choice_for_trace); it must be the choice the real call gets, for every kind of call."""
    from normscope.engine import Call, Running, _as_traced, _choice_for_trace, _choose, _static_signature
    from normscope.scope import Scope

    x = torch.randn(4, 6, 5)
    w, b = torch.randn(6), torch.randn(6)
    mask = torch.rand(4, 1, 5) > 0.3
    run = Running(torch.zeros(6), torch.ones(6), 0.1, True)
    calls = [
        Call(x, Scope.layer(1).resolve(x.shape), torch.randn(5), torch.randn(5), 1e-5, None, None),
        Call(x, Scope.rms(1).resolve(x.shape), torch.randn(5), None, 1e-5, None, None),
        Call(x, Scope.batch(1).resolve(x.shape), w, b, 1e-5, None, run),
        Call(x, Scope.batch(1).resolve(x.shape), w, b, 1e-5, mask, run),
        Call(x, Scope.group(2).resolve(x.shape), w, b, 1e-5, mask, None),
        Call(x, Scope.group(6).resolve(x.shape), w, b, 1e-5, None, None, op="group_norm"),
        Call(x, Scope.instance().resolve(x.shape), w, b, 1e-5, None, None),
        Call(x.double(), Scope(reduce=(0, 2)).resolve(x.shape), None, None, 1e-5, None, None),
        Call(x, Scope.rms(1).resolve(x.shape), torch.randn(5), None, 1e-5, None, None, torch.randn(4, 6, 5), 1.0),
    ]
    for call in calls:
        for name in ("auto", "reference", "aten", "composite"):
            try:
                with _as_traced():  # as while tracing: engine.tracing() is what the choice reads
                    expected = _choose(call, name)
            except ValueError:
                expected = ValueError
            # None: no backend takes it -- the traced plan then traces choose(), which raises the ValueError
            # (raised inside _choice_for_trace, which dynamo runs as a constant, it came out wrapped)
            got = _choice_for_trace(_static_signature(call), name)
            got = ValueError if got is None else got
            assert got == expected, (call.scope, name)


def test_constant_when_compiled_marks_as_torch_does_without_importing_dynamo():
    # the mark is the one torch.compiler.assume_constant_result sets; import normscope loads no dynamo
    import subprocess
    import sys

    from normscope.engine import constant_when_compiled

    def f():
        return 1

    def g():
        return 1

    torch.compiler.assume_constant_result(f)
    constant_when_compiled(g)
    assert vars(f) == vars(g) and vars(g)
    code = "import sys, torch, normscope; print('torch._dynamo' in sys.modules, 'triton' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"], out.stdout


def test_is_compiling_answers_as_torch_eagerly_and_when_compiled_without_recompiling():
    """The engine's ``is_compiling`` (a flag read, where torch's compile session holds the flag)
    answers what ``torch.compiler.is_compiling()`` answers: False eagerly, True where dynamo traces
    a call of it -- and a compiled function that asks it runs its one graph on later calls (no
    guard on the flag, which is False whenever the graph runs)."""
    from torch._dynamo.testing import CompileCounter

    from normscope import _state

    assert _state.is_compiling() is False is torch.compiler.is_compiling()
    counter = CompileCounter()

    def f(x):
        return x + 1 if _state.is_compiling() else x - 1

    compiled = torch.compile(f, backend=counter)
    x = torch.zeros(3)
    for _ in range(3):
        assert torch.equal(compiled(x), x + 1)
    assert counter.frame_count == 1
    assert torch.equal(f(x), x - 1)
    torch._dynamo.reset()


# ----------------------------------------------------------------------------------------------
# one classification of a resolved scope (scope.Resolved.form), read by every backend


def _form_by_definition(shape, reduce, groups, group_dim, affine):
    """The canonical views of a resolved scope, each from its definition over sets of axes."""
    ndim, red, aff = len(shape), set(reduce), tuple(affine)
    kept = set(range(ndim)) - red
    rows = groups == 1 and bool(red) and aff in ((), tuple(sorted(red)))
    trailing = red == set(range(ndim - len(red), ndim))
    channel = None
    if ndim >= 2 and groups == 1 and len(kept) == 1:
        (d,) = kept
        channel = d if aff in ((), (d,)) else None
    per_channel = ndim >= 2 and aff in ((), (1,))
    sample_groups = per_channel and kept == {0} and (groups == 1 or group_dim == 1)
    instance = per_channel and ndim >= 3 and groups == 1 and kept == {0, 1}
    return (rows, trailing, channel, sample_groups, instance)


@settings(max_examples=hypothesis_examples(300), deadline=None)
@given(data=st.data())
def test_the_form_of_a_resolved_scope_is_its_definition(data):
    ndim = data.draw(st.integers(1, 5))
    shape = tuple(data.draw(st.lists(st.integers(1, 4), min_size=ndim, max_size=ndim)))
    reduce = data.draw(st.sets(st.integers(0, ndim - 1), min_size=1))
    affine_kind = data.draw(st.sampled_from(["none", "reduce", "axis1", "axis0", "last"]))
    affine = {
        "none": (),
        "reduce": tuple(sorted(reduce)),
        "axis1": (1,) if ndim >= 2 else (),
        "axis0": (0,),
        "last": (ndim - 1,),
    }[affine_kind]
    groups = 1
    if ndim >= 2 and 1 in reduce and data.draw(st.booleans()):
        shape = shape[:1] + (6,) + shape[2:]
        groups = data.draw(st.sampled_from([2, 3]))
    scope = Scope(reduce=tuple(reduce), affine=affine, groups=groups, group_dim=1)
    r = scope.resolve(shape)
    assert tuple(r.form) == _form_by_definition(r.shape, r.reduce, r.groups, r.group_dim, r.affine), r


def test_a_cold_layer_norm_call_classifies_its_scope_once(monkeypatch):
    """Every backend reads the one classification made when the scope is resolved: a cold call --
    its scope and shape never seen, so resolved, planned and run afresh -- classifies once."""
    from normscope import scope as scope_module

    calls = []
    classify = scope_module.classify

    def counting(*args):
        calls.append(args)
        return classify(*args)

    monkeypatch.setattr(scope_module, "classify", counting)
    x = torch.randn(3, 5, 41)  # a shape no other test resolves with this scope
    ln = normscope.LayerNorm(41)
    y = ln(x)
    assert len(calls) == 1, calls
    torch.testing.assert_close(y, torch.nn.functional.layer_norm(x, (41,), ln.weight, ln.bias))
    ln(x)  # warm: the plan, no resolution
    assert len(calls) == 1


def test_backends_read_the_form_not_their_own_derivation():
    # the four readers name the same views as the form for the named scopes of DESIGN.md
    from normscope.backends import aten, composite, rms, triton

    x = torch.randn(4, 6, 5)

    def call(scope, **kw):
        return engine.Call(x, scope.resolve(x.shape), None, None, 1e-5, None, None, **kw)

    assert aten.kind(call(Scope.layer(1))) == "layer_norm" and triton._kind(call(Scope.layer(1)).scope) == ("rows", 0)
    assert aten.kind(call(Scope.rms(1))) == "rms_norm" and rms.takes(call(Scope.rms(1))) is None
    assert aten.kind(call(Scope.batch(1))) == "batch_norm" and triton._kind(call(Scope.batch(1)).scope) == (
        "channels",
        1,
    )
    assert aten.kind(call(Scope.batch(-1))) == "batch_norm_last"
    assert aten.kind(call(Scope.instance())) == "instance_norm" and triton._kind(call(Scope.instance()).scope) == (
        "groups",
        6,
    )
    assert aten.kind(call(Scope.group(2))) == "group_norm" and triton._kind(call(Scope.group(2)).scope) == ("groups", 2)
    assert aten.kind(call(Scope.group(6), op="group_norm")) == "group_norm"  # InstanceNorm's scope, torch's op
    assert aten.kind(call(Scope.channels())) == "layer_norm" and triton._kind(call(Scope.channels()).scope) is None
    assert composite._view(call(Scope.group(2))) == (1, True, 2)
    assert composite._view(call(Scope.instance())) == (1, True, 6)
    assert composite._view(call(Scope.batch(-1))) == (2, False, 5)
    assert composite._view(call(Scope.rms(1))) is None and rms.takes(call(Scope.layer(1))) is not None


def test_a_plan_is_not_reused_for_parameters_of_another_dtype():
    """The engine's plans are per signature, and the choice and the runner read the dtypes of weight
    and bias (the rows path refuses a weight torch would promote; Llama's casting multiplies in the
    promoted dtype): a call whose weight has another dtype than a planned call's is planned afresh.
    Checked against the family's formula and the forced backend's refusal. (Shapes no other test uses:
    a plan made elsewhere for the second dtype would hide a stale one.)"""
    import normscope.functional as NF
    import normscope.functional_modern as FM

    x = torch.randn(3, 29)
    w32 = torch.randn(29)
    w64 = w32.double()
    FM.rms_norm(x, 29, w32, 1e-6, casting="llama")
    got = FM.rms_norm(x, 29, w64, 1e-6, casting="llama")
    expected = w64 * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))  # Llama's order, promoted
    assert got.dtype == expected.dtype == torch.float64
    torch.testing.assert_close(got, expected, rtol=0, atol=0)

    x = torch.randn(3, 31)
    with normscope.use_backend("rows"):
        NF.rms_norm(x, (31,), torch.randn(31), 1e-6)
        with pytest.raises(ValueError, match="cannot run"):  # torch's bits need the promoted product
            NF.rms_norm(x, (31,), torch.randn(31, dtype=torch.bfloat16), 1e-6)
