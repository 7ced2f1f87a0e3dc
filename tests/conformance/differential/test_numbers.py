"""(a) torch's numbers, or the model family's: bit for bit where normscope promises them, else no
further from a float64 computation than torch is (plus a few ulps) -- outputs, every gradient and
the running statistics a call updates."""

from __future__ import annotations

import math
import os

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import Tensor

from .conftest import DEFAULT_EXAMPLES, EXAMPLES, RAISED, examples
from .harness import (
    LAYOUTS,
    SLACK_ULPS,
    Cotangents,
    assert_accurate,
    assert_bitwise,
    conditioning,
    execute,
    grad_scale,
    nudged,
    sensitivity,
)
from .ops import OPS, PATHS, THRESHOLDS, draw_case, forcing_layout, forcing_shape, pairs, run


def _interpreted_bf16(path: str, dtype: torch.dtype) -> bool:
    """Triton's CPU interpreter (3.6) converts fp32 to bf16 toward zero, where compiled Triton and
    torch round to nearest even (triton-lang/triton#8322); tests/kernels/test_kernels_edges.py holds the
    kernels' bf16 results to that rounding there."""
    return path == "triton" and dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1"


def _bf16_toward_zero(t: Tensor) -> Tensor:
    """``t`` (float64) rounded to fp32, then to bf16 toward zero (the fp32 value's low 16 bits dropped)."""
    bits = t.float().contiguous().view(torch.int32) & -65536
    return bits.view(torch.float32).to(torch.bfloat16)


#: Paths whose outputs and input gradient are torch's bits where forced ``aten`` is, except in a scope
#: whose statistics cancel (|mean| * rstd past the limit: ``backends/aten.py``), which the automatic
#: fp32 CPU path recomputes in float64: the automatic choice (ATen with that guard, or the CPU rows
#: path, which takes torch's rounding steps row by row), and the rows path forced. Their weight and
#: bias gradients are sums of their own (``backends/rms.py``): held to float64 like any other path.
_TORCH_BUT_CANCELLING = ("auto", "rows")


def _bitwise_or_closer(name: str, got: Tensor, want: Tensor, truth: Tensor, sensitive: float = 0.0) -> bool:
    """``got`` is torch's ``want`` bit for bit, except elements no further from the float64 ``truth``
    than torch's (a recomputed cancelling scope: correctly rounded, where torch's is not). Whether
    every element was torch's. ``sensitive``: :func:`harness.sensitivity` of the result, whose float64
    truth is then itself that many float64 ulps uncertain (a few)."""
    assert got.shape == want.shape and got.dtype == want.dtype, f"{name}: {got.shape}/{got.dtype} vs torch's"
    same = (got == want) | (got.isnan() & want.isnan())
    if bool(same.all()):
        return True
    d = ~same
    g, w, t = got[d].double(), want[d].double(), truth[d].double()
    # a hair of slack: the engine's float64 recomputation and this float64 truth may differ in their
    # last float64 bits, which can move a rounding to the dtype only at a tie
    slack = 1e-6 * torch.finfo(got.dtype).eps * max(t.abs().max().item(), 1e-30)
    # and the float64 truth's own error, where the result amplifies its inputs' rounding (an output
    # of |mean| * rstd ~1e4: the truth is ~1e-12 off, and torch's exact 0 may land nearer by chance)
    slack = max(slack, SLACK_ULPS[torch.float64] * torch.finfo(torch.float64).eps * sensitive)
    worse = (g - t).abs() > (w - t).abs().nan_to_num(math.inf) + slack
    assert not bool(worse.any()), (
        f"{name}: {int(d.sum())} elements differ from torch's bits, {int(worse.sum())} of them further from "
        f"float64 than torch's; first: {g[worse][0].item()!r} vs torch {w[worse][0].item()!r}, "
        f"truth {t[worse][0].item()!r}"
    )
    return False


def _check(op, path, case):
    cot = Cotangents()
    got = run(op, path, case, cot=cot)
    want = execute(op.oracle, case, state=op.state, cot=cot)
    truth = execute(op.truth or op.oracle, case, dtype=torch.float64, state=op.state, cot=cot)
    # float64 has no more precise truth: the oracle in float32 measures how ill-conditioned each
    # result is (a gradient that is zero in exact arithmetic, a scope of one element), and the
    # slack is taken at that scale
    probe = (
        execute(op.oracle, case, dtype=torch.float32, state=op.state, cot=cot) if case.dtype == torch.float64 else None
    )
    # below float64, each result's scale is also how far it moves when the inputs move by one ulp
    # (harness.nudged): an input whose mean dwarfs its spread leaves every fp32 algorithm ulps of the
    # mean off, torch's as well; which of two lands nearer is then a coin toss per scope, not accuracy
    moved = (
        execute(op.truth or op.oracle, nudged(case), dtype=torch.float64, state=op.state, cot=cot)
        if case.dtype != torch.float64
        else None
    )
    exact = path in op.bitwise
    # torch's bits but where a scope's statistics cancel (see _TORCH_BUT_CANCELLING)
    guarded = not exact and path in _TORCH_BUT_CANCELLING and "aten" in op.bitwise
    # every output torch's bits: then the input's gradient is too, on a guarded path -- unless the
    # guard recomputed a cancelling scope (it then reports the reference): a half-precision output may
    # round to torch's bits where the recomputed gradient does not
    all_torch = got.ran != "reference"
    for i, (g, w, t) in enumerate(zip(got.outputs, want.outputs, truth.outputs)):
        if i in op.exact_outputs and _interpreted_bf16(path, case.dtype):
            assert_bitwise(f"output {i} (the interpreter's bf16 rounding)", g, _bf16_toward_zero(t))
        elif exact or path in op.bitwise_forward or i in op.exact_outputs:
            assert_bitwise(f"output {i}", g, w)
        elif guarded and g is not None and g.is_floating_point():
            sens = 0.0 if moved is None else sensitivity(moved.outputs[i], t, g.dtype)
            all_torch = _bitwise_or_closer(f"output {i}", g, w, t, sens) and all_torch
        else:
            all_torch = False
            if probe is not None:
                scale = conditioning(probe.outputs[i], t)
            else:
                scale = sensitivity(moved.outputs[i], t, g.dtype)
            assert_accurate(f"output {i}", g, w, t, scale)
    for name, g in got.grads.items():
        w, t = want.grads.get(name), truth.grads.get(name)
        if exact or guarded and all_torch and name == "x":
            assert_bitwise(f"grad of {name}", g, w)
        else:
            scale = grad_scale(truth, cot, case.args[name].values)
            if probe is not None and probe.grads.get(name) is not None:
                scale = max(scale, conditioning(probe.grads[name], t))
            elif moved is not None and g is not None:
                scale = max(scale, sensitivity(moved.grads.get(name), t, g.dtype))
            assert_accurate(f"grad of {name}", g, w, t, scale)
    for name, g in got.state.items():
        if exact or not g.is_floating_point():
            assert_bitwise(f"state {name}", g, want.state[name])
        else:
            t = truth.state[name]
            if probe is not None and probe.state.get(name) is not None:
                scale = conditioning(probe.state[name], t)
            else:
                scale = 0.0 if moved is None else sensitivity(moved.state.get(name), t, g.dtype)
            assert_accurate(f"state {name}", g, want.state[name], t, scale)


def _by_dtype():
    """Every op, path and dtype they both take: a fault in one dtype (a wrong rounding of bf16 only)
    is met by construction, not by a lucky draw."""
    return [
        pytest.param(op, path, dtype, id=f"{op.name}-{path}-{str(dtype).removeprefix('torch.')}")
        for op in OPS.values()
        for path in op.paths
        for dtype in op.dtypes
        if dtype in PATHS[path].dtypes
    ]


@pytest.mark.parametrize("op,path,dtype", _by_dtype())
def test_matches_torch(op, path, dtype):
    # the examples of a path shared out between its dtypes, at least one each
    n = -(-max(EXAMPLES.get(path, DEFAULT_EXAMPLES), RAISED) // 2)

    @examples(n, key=f"{op.name}-{path}-{dtype}")
    @given(data=st.data())
    def check(data):
        _check(op, path, draw_case(op, path, data, dtypes=(dtype,)))

    check()


def _thresholds():
    return [
        pytest.param(t, p, id=f"{t.op}-{p}-{'x'.join(map(str, t.shape))}-{t.dtype_name}")
        for t in THRESHOLDS
        if "a" in t.properties
        for p in t.paths
    ]


@pytest.mark.parametrize("threshold,path", _thresholds())
def test_matches_torch_past_a_size_threshold(threshold, path):
    """One large shape per threshold (see THRESHOLDS); the drawn shapes above are the other side."""
    op = OPS[threshold.op]

    @examples(1, key=f"{threshold.op}-{path}-{threshold.shape}")
    @given(data=st.data())
    def check(data):
        with forcing_shape(threshold.shape, threshold.k_or_groups):
            case = draw_case(op, path, data, dtypes=(threshold.dtype,))
        _check(op, path, case)

    check()


@pytest.mark.parametrize("layout", [lt for lt in LAYOUTS if lt != "contiguous"])
@pytest.mark.parametrize("op,path", pairs())
def test_matches_torch_with_every_argument_in_one_layout(op, path, layout):
    """Each layout for every tensor argument at once (the drawn cases above mix them): a fast path
    that reads a view as if it were contiguous shows here."""

    @examples(1, key=f"{op.name}-{path}-{layout}")
    @given(data=st.data())
    def check(data):
        with forcing_layout(layout):  # fp32: the dtype the most fast paths take
            case = draw_case(op, path, data, dtypes=(torch.float32,) if torch.float32 in op.dtypes else None)
        _check(op, path, case)

    check()
