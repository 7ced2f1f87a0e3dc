"""Every backend is a path of the suite, every public op is in its table, and the table is honest:
each listed path runs the op (``last_backend()`` says so) and every other backend refuses it."""

from __future__ import annotations

import contextlib

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
