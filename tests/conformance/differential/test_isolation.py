"""Scope isolation: a scope's bits come from its own elements and nothing else.

(b) A sample's output and input gradients are bit for bit the same alone, at another position of
    the batch and among other neighbours in a batch of another size -- for every per-sample op
    (BatchNorm in training is cross-sample by design: its scope *is* the batch; it is left out).
(c) Padded values change no bit of a valid output, of a valid input's gradient, of a weight's or
    bias's gradient, or of a running statistic (masked ops; the upstream gradient of padded outputs
    is zero, as a loss that ignores padding makes it).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from normscope import engine

from .conftest import DEFAULT_EXAMPLES, EXAMPLES, examples
from .harness import Case, Cotangents, assert_bitwise
from .ops import OPS, PATHS, THRESHOLDS, draw_case, forcing_shape, pairs, run


def _batched_grads(case: Case) -> list[str]:
    return [n for n, a in case.args.items() if a.batched and a.grad]


def _per_sample_layouts(case: Case) -> Case:
    """The case with every batched argument in a layout whose strides *within* a sample do not
    depend on the batch size: a transposed (B, N) view has its rows B elements apart, a layout of
    the batch, not of the scope (the scope's layout may choose its algorithm); it becomes strided."""
    args = {
        n: dataclasses.replace(a, layout="strided")
        if a.batched and a.layout == "transposed" and a.values.dim() == 2
        else a
        for n, a in case.args.items()
    }
    return dataclasses.replace(case, args=args)


def _check_batch_invariance(op, path, case: Case, data) -> None:
    case = _per_sample_layouts(case)
    b = case.batch
    i = data.draw(st.integers(0, b - 1), label="sample")
    # the same sample alone, and in a batch of b + 2 in reversed order (other neighbours, another
    # position) with two more copies of it at the end
    order = [*reversed(range(b)), i, i]
    # at least 17 samples (past batches of 8 and 16, where packing often changes), cycling through
    # the batch: a drawn batch of 3 would otherwise compare batches of 1, 3 and 5 only
    least = 9 if PATHS[path].tiny else 17
    order += [k % b for k in range(max(0, least - len(order)))]
    cot = Cotangents()
    full = run(op, path, case, cot=cot)
    runs = {
        f"in a batch of {b} at {i}": (full, i),
        "alone": (run(op, path, case.select([i]), cot=cot.select([i])), 0),
        f"in a batch of {len(order)} at {b - 1 - i}": (
            run(op, path, case.select(order), cot=cot.select(order)),
            b - 1 - i,
        ),
    }
    (first, (ref, at)), *others = runs.items()
    for where, (res, j) in others:
        for k, (o, want) in enumerate(zip(res.outputs, ref.outputs)):
            assert_bitwise(f"output {k} of sample {i} {where} vs {first}", o[j], want[at])
        for name in _batched_grads(case):
            g, want = res.grads.get(name), ref.grads.get(name)
            assert_bitwise(
                f"grad of {name} of sample {i} {where} vs {first}",
                None if g is None else g[j],
                None if want is None else want[at],
            )


@pytest.mark.parametrize("op,path", pairs(lambda op: op.per_sample))
def test_a_sample_is_the_same_alone_and_anywhere_in_a_batch(op, path):
    @examples(EXAMPLES.get(path, DEFAULT_EXAMPLES), key=f"{op.name}-{path}")
    @given(data=st.data())
    def check(data):
        _check_batch_invariance(op, path, draw_case(op, path, data), data)

    check()


def _threshold_params(prop: str):
    out = []
    for t in THRESHOLDS:
        if prop not in t.properties:
            continue
        for path in t.paths:
            out.append(pytest.param(t, path, id=f"{t.op}-{path}-{'x'.join(map(str, t.shape))}-{t.dtype_name}"))
    return out


@pytest.mark.parametrize("threshold,path", _threshold_params("b"))
def test_a_sample_is_the_same_on_both_sides_of_a_size_threshold(threshold, path):
    """One large shape per threshold (see THRESHOLDS): the batch crosses it, the sample alone does not."""
    op = OPS[threshold.op]

    @examples(1)
    @given(data=st.data())
    def check(data):
        with forcing_shape(threshold.shape, threshold.k_or_groups):
            case = draw_case(op, path, data, dtypes=(threshold.dtype,))
        _check_batch_invariance(op, path, case, data)

    check()


#: the Triton kernels' size thresholds (kernels/config.py, read at launch) scaled down so that the
#: interpreter crosses them on small shapes: (op, settings, shape, k or groups, input layout)
TRITON_SCALED = [
    pytest.param("layer_norm", {"ROWS_MAX_FUSED_N": 8}, (5, 17), 1, None, id="rows-looped-layer"),
    pytest.param("rms_norm", {"ROWS_MAX_FUSED_N": 8}, (5, 2, 17), 1, None, id="rows-looped-rms"),
    pytest.param(
        "group_norm",
        {"GROUPS_CL_TILE": 16, "GROUPS_CL_MIN_SPLIT": 16, "GROUPS_CL_PROGRAMS": 8},
        (3, 4, 4, 4),
        2,
        "channels_last",
        id="groups-channels-last-split",
    ),
    # rows packed several to a program (block_m = ROWS_TILE // 8 = 4 rows of 5): 9 rows in 3 programs
    pytest.param("layer_norm", {"ROWS_TILE": 32, "ROWS_MAX_BLOCK_M": 4}, (9, 5), 1, None, id="rows-packed"),
    # a group of 2 x 16 positions in tiles of 16 (contiguous input)
    pytest.param("group_norm", {"GROUPS_TILE": 16}, (3, 4, 4, 4), 2, None, id="groups-tiled"),
]


@pytest.mark.parametrize("op_name,settings,shape,k_or_groups,layout", TRITON_SCALED)
def test_a_sample_is_the_same_past_the_kernels_thresholds(op_name, settings, shape, k_or_groups, layout, monkeypatch):
    """The kernels split and pack per scope, never per batch: a sample's bits do not depend on how
    many samples share the launch, past each kernel threshold too."""
    if "triton" not in engine.backends():
        pytest.skip("Triton is not installed")
    from normscope.kernels import config

    for name, value in settings.items():
        monkeypatch.setattr(config, name, value)
    op = OPS[op_name]

    @examples(1)
    @given(data=st.data())
    def check(data):
        with forcing_shape(shape, k_or_groups, layout):
            case = draw_case(op, "triton", data, dtypes=(torch.float32,))
        _check_batch_invariance(op, "triton", case, data)

    check()


# ----------------------------------------------------------------------------------------------
# (c) padding


PADDING = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf"), "large": 1e30}


def _valid(mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The mask (N, *) as a bool tensor over (N, C, *): the channel axis is 1."""
    return torch.broadcast_to(mask.unsqueeze(1), like.shape)


@pytest.mark.parametrize("op,path", pairs(lambda op: op.mask is not None))
def test_padded_values_change_no_valid_bit(op, path):
    @examples(EXAMPLES.get(path, DEFAULT_EXAMPLES), key=f"{op.name}-{path}")
    @given(data=st.data())
    def check(data):
        case = draw_case(op, path, data)
        x, mask = case.args["x"], case.args[op.mask].values
        if x.layout == "expanded":  # padding differs between samples: not one repeated sample
            case = dataclasses.replace(case, args={**case.args, "x": dataclasses.replace(x, layout="strided")})
        kind = data.draw(st.sampled_from(sorted(PADDING)), label="padding")
        value = PADDING[kind] if case.dtype != torch.float16 or kind != "large" else 6e4
        valid = _valid(mask, x.values)
        padded = case.replace(x=torch.where(valid, x.values, torch.tensor(value, dtype=torch.float64)))

        def keep(v):
            return _valid(mask, v) if v.shape == x.values.shape else torch.ones((), dtype=torch.bool)

        plain, odd = run(op, path, case, cot=Cotangents.where(keep)), run(op, path, padded, cot=Cotangents.where(keep))
        assert_bitwise(f"valid outputs with {kind} padding", odd.outputs[0][valid], plain.outputs[0][valid])
        for name, g in plain.grads.items():
            h = odd.grads[name]
            if name == "x":
                g, h = g[valid], h[valid]
            assert_bitwise(f"grad of {name} with {kind} padding", h, g)
        for name, s in plain.state.items():
            assert_bitwise(f"{name} with {kind} padding", odd.state[name], s)

    check()
