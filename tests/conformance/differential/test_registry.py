"""Every backend is a path of the suite, every public op is in its table, and the table is honest:
each listed path runs the op (``last_backend()`` says so) and every other backend refuses it."""

from __future__ import annotations

import contextlib
import importlib
import math
import re

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from normscope import engine

from .conftest import examples
from .harness import Case
from .ops import (
    NOT_OPS,
    OPS,
    PAST_EVERY_THRESHOLD,
    PATHS,
    SCALES,
    SIZE_MODULES,
    SIZES_MET_ELSEWHERE,
    THRESHOLDS,
    covered_names,
    draw_case,
    forcing_shape,
    pairs,
    public_names,
    run,
)


def test_every_registered_backend_is_a_path():
    # each path is forced by its own backend's name: two paths of one backend would test one twice
    forced = [p.backend for p in PATHS.values() if p.backend is not None]
    assert len(forced) == len(set(forced)), f"paths sharing a forced backend: {sorted(forced)}"
    assert all(p.reports == p.backend for p in PATHS.values()), "a forced path reports its own name"
    paths = set(forced)
    registered = set(engine.backends())
    assert registered <= paths, (
        f"backends with no path in tests/conformance/differential/ops.py PATHS: {registered - paths}"
    )
    unknown = paths - registered - {"triton"}  # triton is registered only where Triton is installed
    assert not unknown, f"paths of PATHS whose backend is not registered: {unknown}"


def test_every_public_op_is_in_the_table():
    public, covered = public_names(), covered_names() | set(NOT_OPS)
    assert not public - covered, (
        f"public names in no op of tests/conformance/differential/ops.py: {sorted(public - covered)}"
    )
    assert not covered - public, f"ops or NOT_OPS entries that name nothing public: {sorted(covered - public)}"


@pytest.mark.parametrize("op,path", pairs())
@examples(1)
@given(data=st.data())
def test_each_listed_path_runs_the_op(op, path, data):
    if path == "triton" and "triton" not in engine.backends():
        pytest.skip("Triton is not installed")
    run(op, path, draw_case(op, path, data, dtypes=(torch.float32,)), grads=False)


def _unlisted():
    out = []
    for op in OPS.values():
        if not op.engine:
            continue  # no backend to choose: the forced one is never read
        listed = {PATHS[p].backend for p in op.paths}
        out += [pytest.param(op, b, id=f"{op.name}-{b}") for b in engine.backends() if b not in listed]
    return out


@pytest.mark.parametrize("op,backend", _unlisted())
@examples(1)
@given(data=st.data())
def test_every_unlisted_backend_refuses_the_op(op, backend, data):
    """A backend that starts taking an op fails here until the op lists it (and so is tested) -- at the
    drawn sizes and past the automatic choice's size threshold, where a path measured faster only on
    large calls takes them."""
    assert _takes(op, backend, data) is None


def _takes(op, backend: str, data) -> str | None:
    """Where ``backend``, forced, runs ``op`` instead of refusing it: None when it refuses everywhere."""
    sizes = [False] if backend == "triton" else [False, True]  # Triton's interpreter: small shapes only
    for large in sizes:
        with forcing_shape(PAST_EVERY_THRESHOLD, 1) if large else contextlib.nullcontext():
            case: Case = op.draw(data, torch.float32, backend == "triton")
        try:
            with engine.use_backend(backend):
                op.run(case.tensors(), case.kw)
        except ValueError:
            continue  # refused with a reason, as a backend must for a call it does not take
        shapes = {name: tuple(a.values.shape) for name, a in case.args.items()}
        return f"{backend} ran {op.name}, which does not list it, on {shapes}"
    return None


def test_a_backend_that_takes_only_large_calls_is_caught():
    """The check above must see a backend gated by size: one that refuses every drawn call and takes
    (1 % wrong) those of 2^20 elements or more, first in the automatic order, is run by no other test."""
    from normscope import _registry

    order, known = list(_registry.AUTO), dict(_registry.BACKENDS)
    ref = known["reference"]

    def why_not(call):
        return "measured faster only from 2^20 elements" if call.x.numel() < 2**20 else ref.why_not(call)

    def prepare(call, automatic):
        inner = ref.prepare(call, automatic)
        return lambda c: inner(c) * 1.01

    engine.register_backend(engine.Backend("large_only", why_not, prepare), before=order[0])
    try:

        @examples(1)
        @given(data=st.data())
        def check(data):
            assert _takes(OPS["batch_norm"], "large_only", data) is not None

        check()
    finally:
        _registry.AUTO[:] = order
        _registry.BACKENDS.clear()
        _registry.BACKENDS.update(known)
        _registry.clear_plans()


@pytest.mark.parametrize("name", ["rms_norm_family", "qk_norm", "QKNorm"])
def test_triton_declines_llamas_order(name):
    """The family draws leave Llama's order out of the Triton path (``ops.families``): forced there,
    it must be refused with the reason, never run with other rounding."""
    if "triton" not in engine.backends():
        pytest.skip("Triton is not installed")
    op, refused = OPS[name], []

    @examples(10)
    @given(data=st.data())
    def check(data):
        case = op.draw(data, torch.float32, False)
        if case.kw["casting"] != "llama":
            return
        with engine.use_backend("triton"), pytest.raises(ValueError, match="casting"):
            op.run(case.tensors(), case.kw)
        refused.append(case)

    check()
    assert refused, "no example drew Llama's order: the test checked nothing"


def test_each_op_and_path_draws_its_own_examples():
    """Hypothesis's derandomized seed is a digest of the test function: every op and path of a
    parametrized test shared one, so each drew the same choices (the same dtype in each example: bf16
    on no CPU path). ``examples(key=...)`` seeds each pair by its key."""
    drawn: dict[str, list[int]] = {}
    for key in ("layer_norm-aten", "rms_norm-rows", "group_norm-reference"):

        @examples(3, key=key)
        @given(data=st.data())
        def check(data):
            drawn.setdefault(key, []).append(data.draw(st.integers(0, 2**31 - 1)))  # noqa: B023 - run at once

        check()
    assert len({tuple(v) for v in drawn.values()}) == len(drawn), f"the same draws for different keys: {drawn}"


def _code_value(dotted: str) -> int:
    module, _, name = dotted.rpartition(".")
    return getattr(importlib.import_module(f"normscope.{module}"), name)


@pytest.mark.parametrize(
    "t", THRESHOLDS, ids=[f"{t.op}-{'x'.join(map(str, t.shape))}-{t.constant.rpartition('.')[2]}" for t in THRESHOLDS]
)
def test_each_threshold_shape_is_past_the_codes_value(t):
    """The value is read from the code, not copied: a threshold moved past its case fails here."""
    value = _code_value(t.constant)
    size = t.size(t.shape, t.dtype, t.k_or_groups)
    # the code's comparison: these take their path *from* the value (>=), the others past it (>)
    inclusive = t.constant.endswith(("MIN_AUTO_ELEMENTS", "SPLIT_ELEMENTS"))
    assert size >= value if inclusive else size > value, (
        f"{t.op} {t.shape} {t.dtype}: {t.size.__name__} {t.size(t.shape, t.dtype, t.k_or_groups)} is not past "
        f"{t.constant} = {value}"
    )


def _size_constants() -> set[str]:
    out = set()
    for module in SIZE_MODULES:
        m = importlib.import_module(f"normscope.{module}")
        for name, value in vars(m).items():
            if re.fullmatch(r"_?[A-Z][A-Z0-9_]*", name) and type(value) in (int, float) and not name.startswith("__"):
                out.add(f"{module}.{name}")
    return out


def test_every_size_constant_of_the_code_is_met():
    """A size threshold added to the code fails here until a Threshold crosses it (or the table says
    how the suite meets it): the suite's claim to straddle every threshold is checked, not trusted."""
    from .test_isolation import TRITON_SCALED

    met = {t.constant for t in THRESHOLDS} | set(SIZES_MET_ELSEWHERE)
    met |= {f"kernels.config.{name}" for p in TRITON_SCALED for name in p.values[1]}
    missing = _size_constants() - met
    assert not missing, f"size constants of the code that no case of the differential suite crosses: {sorted(missing)}"
    stale = met - _size_constants()
    assert not stale, f"thresholds named in tests/conformance/differential/ops.py that the code no longer has: {stale}"


def test_some_drawn_scale_cancels_past_the_aten_guard():
    """``backends.aten._CANCEL_LIMIT``, read from the code: a drawn scale must put |mean| * rstd past it
    (the float64 recomputation of a cancelling scope) and another below it."""
    limit = _code_value("backends.aten._CANCEL_LIMIT")
    ratios = [abs(offset) / math.sqrt(scale**2 + 1e-5) for scale, offset in SCALES]
    assert max(ratios) > limit > min(ratios), (ratios, limit)
