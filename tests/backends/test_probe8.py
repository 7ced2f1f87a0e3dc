"""Scope isolation with several intra-op threads: a sample's bits do not depend on its batch.

ATen's CPU reductions reduce a tensor into *one* value in two passes split across the threads once
it holds ``at::internal::GRAIN_SIZE`` (32768) elements, while a reduction into several values gives
each value to one thread, whole. So one large scope alone (a batch of one) was summed in another
order than the same scope among others: torch's own ``rms_norm`` on CPU, the rows backend's
single-row blocks and the reference's reductions gave a sample other bits alone than in a batch
(observed with ``torch.set_num_threads(2)``, the CI's two cores). Compared here: every sample alone,
and inside batches on both sides of the rows backend's automatic threshold, with two threads.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import normscope
import normscope.functional as F
import normscope.functional_modern as FM
from normscope._registry import SPLIT_ELEMENTS
from normscope.backends import rms


@pytest.fixture
def two_threads():
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(old)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(((a == b) | (a.isnan() & b.isnan())).all())


def _ops(n: int, dtype: torch.dtype) -> dict:
    g = torch.Generator().manual_seed(1)
    w = (1 + 0.1 * torch.randn(n, generator=g)).to(dtype)
    b = (0.1 * torch.randn(n, generator=g)).to(dtype)
    return {
        "layer_norm": lambda x: F.layer_norm(x, n, w, b),
        "rms_norm": lambda x: F.rms_norm(x, n, w, 1e-6),
        "rms_llama": lambda x: F.rms_norm(x, n, w, 1e-6, casting="llama"),
        "rms_gemma": lambda x: F.rms_norm(x, n, w - 1, 1e-6, weight_offset=1.0, casting="gemma"),
        "group_norm_1": lambda x: F.group_norm(x.view(x.shape[0], 4, -1), 1).view(x.shape),
        "instance_norm": lambda x: F.instance_norm(x.view(x.shape[0], 1, -1)).view(x.shape),
        "poly_norm": lambda x: FM.poly_norm(x, torch.ones(3, dtype=dtype), torch.zeros(1, dtype=dtype)),
        "fused_add_rms": lambda x: F.fused_add_rms_norm(x, 0.5 * x, w, 1e-6)[0],
    }


def _run(fn, x: torch.Tensor, dy: torch.Tensor, backend: str | None):
    x = x.clone().requires_grad_()
    with normscope.use_backend(backend) if backend else contextlib.nullcontext():
        y = fn(x)
        y.backward(dy)
    return y.detach(), x.grad


#: (row length, dtype, batch sizes): 40000 fp32 rows go to the rows backend from 27 rows
#: (MIN_AUTO_ELEMENTS), whole-input below BLOCKED_BYTES; 70000 bf16 rows are one row a block
#: (BLOCK_ELEMENTS) from 15 rows
CASES = [(40000, torch.float32, (4, 30)), (70000, torch.bfloat16, (3, 16))]


def test_the_cases_straddle_the_thresholds():
    for n, _, batches in CASES:
        assert min(batches) * n < rms.MIN_AUTO_ELEMENTS <= max(batches) * n
        assert n >= SPLIT_ELEMENTS  # a single value from more elements: ATen splits its reduction
    assert any(n > rms.BLOCK_ELEMENTS // 2 for n, _, _ in CASES)  # single-row blocks


@pytest.mark.parametrize("backend", [None, "aten", "rows", "reference"], ids=lambda b: b or "auto")
@pytest.mark.parametrize("op", sorted(_ops(8, torch.float32)))
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{str(c[1]).removeprefix('torch.')}")
def test_a_sample_is_the_same_alone_and_in_a_batch_with_two_threads(case, op, backend, two_threads):
    n, dtype, batches = case
    fn = _ops(n, dtype)[op]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(max(batches), n, generator=g).to(dtype)
    dy = torch.randn(max(batches), n, generator=g).to(dtype)
    try:
        results = {b: _run(fn, x[:b], dy[:b], backend) for b in batches}
    except ValueError as e:  # a forced backend that does not take the op says so
        assert "cannot run" in str(e)
        pytest.skip(str(e))
    for i in range(min(batches)):
        alone = _run(fn, x[i : i + 1], dy[i : i + 1], backend)
        for b, (y, gx) in results.items():
            assert _same(alone[0][0], y[i]), f"output of sample {i}: alone vs in a batch of {b}"
            assert _same(alone[1][0], gx[i]), f"input gradient of sample {i}: alone vs in a batch of {b}"


@pytest.mark.parametrize("backend", [None, "composite", "reference"], ids=lambda b: b or "auto")
@pytest.mark.parametrize("op", ["group_norm", "instance_norm"])
def test_a_masked_sample_is_the_same_alone_and_in_a_batch_with_two_threads(op, backend, two_threads):
    # one scope of 40000 elements alone (GroupNorm(1, 4)), its mask one flag per position; and
    # InstanceNorm's 10000-element scopes, below the split, as a control
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 4, 100, 100, generator=g)
    dy = torch.randn(3, 4, 100, 100, generator=g)
    mask = torch.rand(3, 100, 100, generator=g) > 0.3
    w, b = torch.rand(4, generator=g) + 0.5, torch.randn(4, generator=g)

    def fn(x, m):
        if op == "group_norm":
            return F.group_norm(x, 1, w, b, mask=m)
        return F.instance_norm(x, weight=w, bias=b, mask=m)

    def run(x, m, dy):
        x = x.clone().requires_grad_()
        with normscope.use_backend(backend) if backend else contextlib.nullcontext():
            y = fn(x, m)
        y.backward(dy)
        return y.detach(), x.grad

    y, gx = run(x, mask, dy)
    valid = mask[:, None].expand_as(x)
    for i in range(3):
        y1, g1 = run(x[i : i + 1], mask[i : i + 1], dy[i : i + 1])
        assert _same(y1[0][valid[i]], y[i][valid[i]]), f"valid outputs of sample {i}"
        assert _same(g1[0][valid[i]], gx[i][valid[i]]), f"valid input gradients of sample {i}"


def test_a_sample_alone_keeps_its_memory_format(two_threads):
    # the lone scope runs as a stride-0 pair, which has no memory format: the output keeps the input's
    x = torch.randn(1, 4, 100, 100).contiguous(memory_format=torch.channels_last)
    for backend in (None, "reference"):
        with normscope.use_backend(backend) if backend else contextlib.nullcontext():
            y = F.group_norm(x, 1)
        assert y.is_contiguous(memory_format=torch.channels_last)
        torch.testing.assert_close(y, torch.nn.functional.group_norm(x, 1))
