"""Batch invariance of the RMS-scoped norms on CPU: a sample's output and input gradient are the
same bits alone, at another position and among other rows, whatever the batch size -- as torch.nn's
are. The batch sizes straddle every size threshold of the CPU paths (the automatic choice between
torch's op and the rows path at ``rms.MIN_AUTO_ELEMENTS``, the rows path's blocks of
``rms.BLOCK_ELEMENTS`` and whole-input fp32 below ``rms.BLOCKED_BYTES``), at row lengths 1024 and
4096. Weight gradients (a sum over rows) are checked to be the same from run to run. The last
section holds every per-sample norm to the same with two intra-op threads, where one large scope alone
is reduced in another order than among others.
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

#: batch sizes per row length: with 1024-element rows the automatic choice moves at 1024 rows, with
#: 4096 at 256 (``rms.MIN_AUTO_ELEMENTS``); the fp32 blocks start at 4096 and 1024 rows
BATCHES = {1024: (1, 2, 3, 7, 16, 255, 256, 300, 1024, 4096), 4096: (1, 2, 3, 7, 16, 255, 256, 300, 1024)}


def test_the_batches_straddle_the_thresholds():
    # guard: if a threshold moves, the sizes above must still cross it (else the test proves nothing)
    for n, batches in BATCHES.items():
        for threshold in (rms.MIN_AUTO_ELEMENTS, rms.BLOCKED_BYTES // 4):
            assert min(batches) * n < threshold <= max(batches) * n
        assert min(batches) * n < rms.BLOCK_ELEMENTS < max(batches) * n


def _rms(n, dtype):
    return normscope.RMSNorm(n, eps=1e-6, dtype=dtype)


def _llama(n, dtype):
    w = torch.nn.Parameter(1 + 0.1 * torch.randn(n, generator=torch.Generator().manual_seed(1)).to(dtype))
    return lambda x: FM.rms_norm(x, n, w, 1e-6, casting="llama")


def _gemma(n, dtype):
    w = torch.nn.Parameter(0.1 * torch.randn(n, generator=torch.Generator().manual_seed(1)).to(dtype))
    return lambda x: FM.rms_norm(x, n, w, 1e-6, weight_offset=1.0, casting="gemma")


def _poly(n, dtype):
    return normscope.PolyNorm(dtype=dtype)


def _qk(n, dtype):
    layer = normscope.QKNorm(n, casting="llama", dtype=dtype)

    def run(x):  # every row a (token, head) of q and of k: (B, S=1, H=1, D)
        q, k = layer(x[:, None, None, :], 2 * x[:, None, None, :])
        return (q + k).squeeze(2).squeeze(1)

    return run


def _modulated(n, dtype):
    g = torch.Generator().manual_seed(2)
    shift, scale = (0.1 * torch.randn(1, n, generator=g).to(dtype) for _ in range(2))
    return lambda x: FM.modulated_norm(x, shift, scale, norm="rms")


OPS = {"RMSNorm": _rms, "llama": _llama, "gemma": _gemma, "PolyNorm": _poly, "QKNorm": _qk, "modulated-rms": _modulated}


def _run(fn, x: torch.Tensor, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.clone().requires_grad_()
    y = fn(x)
    y.backward(dy)
    return y.detach(), x.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("n", sorted(BATCHES))
@pytest.mark.parametrize("op", sorted(OPS))
def test_a_sample_has_the_same_bits_in_every_batch(op, n, dtype):
    torch.manual_seed(0)
    fn = OPS[op](n, dtype)
    top = max(BATCHES[n])
    xs = (3 * torch.randn(top, n)).to(dtype)
    dys = torch.randn(top, n).to(dtype)
    sample, dsample = xs[:1], dys[:1]
    y1, g1 = _run(fn, sample, dsample)
    for b in BATCHES[n]:
        at = b // 2  # the sample in the middle of its batch: neighbours on both sides
        x, dy = xs[:b].clone(), dys[:b].clone()
        x[at], dy[at] = sample[0], dsample[0]
        y, g = _run(fn, x, dy)
        assert torch.equal(y[at], y1[0]), f"{op} {dtype} N={n}: output of a sample differs in a batch of {b}"
        assert torch.equal(g[at], g1[0]), f"{op} {dtype} N={n}: input gradient differs in a batch of {b}"


#: fp16 and fp64 rows of 1024 (the batches above run fp32 and bf16): fp16 goes by blocks at every size like
#: bf16; fp64 is whole-input below ``rms.BLOCKED_BYTES`` -- 2048 rows of 8-byte elements, half fp32's --
#: and by blocks above; the automatic choice moves at 1024 rows
_WIDE_BATCHES = (1, 3, 1023, 1025, 2049)


def test_the_wide_batches_straddle_the_thresholds():
    rows = [b * 1024 for b in _WIDE_BATCHES]
    for threshold in (rms.MIN_AUTO_ELEMENTS, rms.BLOCKED_BYTES // 8, rms.BLOCK_ELEMENTS):
        assert min(rows) < threshold <= max(rows)


@pytest.mark.parametrize("op", ["RMSNorm", "gemma"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float64], ids=str)
def test_a_sample_has_the_same_bits_in_every_batch_in_fp16_and_fp64(dtype, op):
    torch.manual_seed(0)
    fn = OPS[op](1024, dtype)
    top = max(_WIDE_BATCHES)
    xs, dys = (3 * torch.randn(top, 1024)).to(dtype), torch.randn(top, 1024).to(dtype)
    y1, g1 = _run(fn, xs[:1], dys[:1])
    for b in _WIDE_BATCHES:
        at = b - 1  # the last row: in the last (possibly partial) block
        x, dy = xs[:b].clone(), dys[:b].clone()
        x[at], dy[at] = xs[0], dys[0]
        y, g = _run(fn, x, dy)
        assert torch.equal(y[at], y1[0]), f"{op} {dtype}: output differs in a batch of {b}"
        assert torch.equal(g[at], g1[0]), f"{op} {dtype}: input gradient differs in a batch of {b}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rows", [300, 2048])
def test_weight_gradients_are_the_same_run_to_run(rows, dtype):
    torch.manual_seed(0)
    layer = normscope.RMSNorm(1024, dtype=dtype)
    x, dy = torch.randn(rows, 1024).to(dtype), torch.randn(rows, 1024).to(dtype)
    grads = []
    for _ in range(3):
        layer.weight.grad = None
        layer(x).backward(dy)
        grads.append(layer.weight.grad.clone())
    assert all(torch.equal(grads[0], g) for g in grads[1:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("weight", ["none", "same", "fp32"])
def test_the_rows_path_gives_torchs_bits(dtype, weight, monkeypatch):
    """The two CPU paths agree bit for bit -- output and input gradient -- which is what makes the
    automatic choice between them harmless: by whole input and by small blocks of rows (ragged last)."""
    torch.manual_seed(0)
    n = 1000
    x, dy = (3 * torch.randn(37, n)).to(dtype), torch.randn(37, n).to(dtype)
    w = None if weight == "none" else torch.randn(n).to(dtype if weight == "same" else torch.float32)
    want_y, want_g = _run(lambda t: torch.rms_norm(t, (n,), w, 1e-6), x, dy)
    for blocked in (False, True):
        if blocked:
            monkeypatch.setattr(rms, "BLOCK_ELEMENTS", 5 * n)
            monkeypatch.setattr(rms, "BLOCKED_BYTES", 0)
        y, g = _run(lambda t: normscope.functional.rms_norm(t, (n,), w, 1e-6, backend="rows"), x, dy)
        assert torch.equal(y, want_y) and torch.equal(g, want_g), f"blocked={blocked}"


# -- an input that flows elsewhere too -----------------------------------------------------------------
#
# In a model the normalized tensor is also the residual stream: its gradient is the norm's plus the
# stream's, added by autograd. torch's rms_norm hands autograd two terms (through ``x * r`` and through
# ``x.pow(2)``), so the sum is ``(stream + term1) + term2``; the rows path must hand over the same
# two, or its gradient -- and so a sample's, when the batch size picks the path -- rounds otherwise.

_SHAPES_ELSEWHERE = [(300, 4096), (3, 16, 1024), (40, 31)]


@pytest.mark.parametrize("shape", _SHAPES_ELSEWHERE, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("casting", ["torch", "llama", "gemma"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_rows_path_gradient_with_a_residual_stream_is_torchs(shape, casting, dtype, layout):
    g = torch.Generator().manual_seed(3)
    n = shape[-1]
    base = torch.randn(shape, generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(n, generator=g)).to(dtype)
    stream_w = torch.randn(shape, generator=g).to(dtype)
    cot = torch.randn(shape, generator=g).to(dtype)
    offset = 1.0 if casting == "gemma" else 0.0

    def grads(backend):
        x = base.clone() if layout == "contiguous" else base.transpose(-2, -1).contiguous().transpose(-2, -1)
        x.requires_grad_(True)
        h = x * 1  # a node whose gradient buffer receives the norm's terms and the stream's
        if backend == "torch":  # the model family's / torch's own composition, differentiated by autograd
            h32 = h.float()
            r = torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + 1e-6)
            if casting == "llama":
                y = w * (h32 * r).to(dtype)
            else:
                y = (h32 * r * (w.float() + offset)).to(dtype)
        else:
            y = FM.rms_norm(h, n, w, 1e-6, weight_offset=offset, casting=casting, backend=backend)
        loss = (y * cot).sum() + (h * stream_w).sum()  # the stream's use comes after the norm's
        (gx,) = torch.autograd.grad(loss, x)
        return y.detach(), gx

    want_y, want_g = grads("torch")
    for backend in ("rows", "aten"):
        got_y, got_g = grads(backend)
        assert torch.equal(got_y, want_y), f"{backend}: output"
        assert torch.equal(got_g, want_g), (
            f"{backend}: input gradient, {(got_g != want_g).sum().item()} of {got_g.numel()} elements differ"
        )


# -- several intra-op threads ---------------------------------------------------------------------------
#
# Scope isolation with several intra-op threads: a sample's bits do not depend on its batch.
#
# ATen's CPU reductions reduce a tensor into *one* value in two passes split across the threads once
# it holds ``at::internal::GRAIN_SIZE`` (32768) elements, while a reduction into several values gives
# each value to one thread, whole. So one large scope alone (a batch of one) was summed in another
# order than the same scope among others: torch's own ``rms_norm`` on CPU, the rows backend's
# single-row blocks and the reference's reductions gave a sample other bits alone than in a batch
# (observed with ``torch.set_num_threads(2)``, the CI's two cores). Compared here: every sample alone,
# and inside batches on both sides of the rows backend's automatic threshold, with two threads.


@pytest.fixture
def two_threads():
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(old)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(((a == b) | (a.isnan() & b.isnan())).all())


def _threaded_ops(n: int, dtype: torch.dtype) -> dict:
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


def _run_forced(fn, x: torch.Tensor, dy: torch.Tensor, backend: str | None):
    x = x.clone().requires_grad_()
    with normscope.use_backend(backend) if backend else contextlib.nullcontext():
        y = fn(x)
        y.backward(dy)
    return y.detach(), x.grad


#: (row length, dtype, batch sizes): 40000 fp32 rows go to the rows backend from 27 rows
#: (MIN_AUTO_ELEMENTS), whole-input below BLOCKED_BYTES; 70000 bf16 rows are one row a block
#: (BLOCK_ELEMENTS) from 15 rows
THREADED_CASES = [(40000, torch.float32, (4, 30)), (70000, torch.bfloat16, (3, 16))]


def test_the_cases_straddle_the_thresholds():
    for n, _, batches in THREADED_CASES:
        assert min(batches) * n < rms.MIN_AUTO_ELEMENTS <= max(batches) * n
        assert n >= SPLIT_ELEMENTS  # a single value from more elements: ATen splits its reduction
    assert any(n > rms.BLOCK_ELEMENTS // 2 for n, _, _ in THREADED_CASES)  # single-row blocks


@pytest.mark.parametrize("backend", [None, "aten", "rows", "reference"], ids=lambda b: b or "auto")
@pytest.mark.parametrize("op", sorted(_threaded_ops(8, torch.float32)))
@pytest.mark.parametrize("case", THREADED_CASES, ids=lambda c: f"{c[0]}-{str(c[1]).removeprefix('torch.')}")
def test_a_sample_is_the_same_alone_and_in_a_batch_with_two_threads(case, op, backend, two_threads):
    n, dtype, batches = case
    fn = _threaded_ops(n, dtype)[op]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(max(batches), n, generator=g).to(dtype)
    dy = torch.randn(max(batches), n, generator=g).to(dtype)
    try:
        results = {b: _run_forced(fn, x[:b], dy[:b], backend) for b in batches}
    except ValueError as e:  # a forced backend that does not take the op says so
        assert "cannot run" in str(e)
        pytest.skip(str(e))
    for i in range(min(batches)):
        alone = _run_forced(fn, x[i : i + 1], dy[i : i + 1], backend)
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


def _each_sample_as_in_its_batch(run, x, mask, dy) -> None:
    """``run(x, mask, dy) -> (output, input gradient)`` of each sample alone, its bits as in the batch's."""
    y, gx = run(x, mask, dy)
    for i in range(x.shape[0]):
        y1, g1 = run(x[i : i + 1], mask[i : i + 1], dy[i : i + 1])
        assert _same(y1[0], y[i]), f"outputs of sample {i}"
        assert _same(g1[0], gx[i]), f"input gradients of sample {i}"


#: (B, C, L) views of tensors whose batch axis is not the outermost in memory, as a (L, B, C) or (C, B, L)
#: activation permuted to channels-first: dense as a batch, but one sample of it is not
_NOT_OUTERMOST = {
    "CBL": lambda t: t.permute(1, 0, 2).contiguous().permute(1, 0, 2),
    "LBC": lambda t: t.permute(2, 0, 1).contiguous().permute(1, 2, 0),
    "LCB": lambda t: t.permute(2, 1, 0).contiguous().permute(2, 1, 0),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("backend", [None, "composite"], ids=lambda b: b or "auto")
@pytest.mark.parametrize("layout", sorted(_NOT_OUTERMOST))
@pytest.mark.parametrize("op", ["group_norm", "instance_norm"])
def test_a_masked_sample_is_the_same_alone_and_in_a_batch_whose_samples_are_not_outermost(op, layout, backend, dtype):
    # the composite backend decided its layout (a dense copy or not) on the whole tensor: a sample
    # alone, a view with gaps, was copied and summed in another order than in the batch (input
    # gradients 2.4e-7 apart in fp32 for the "CBL" layout, outputs too for the others; bf16 outputs
    # 2e-3 apart for "LBC", where the fp32 copy of the sample alone took an order of its own)
    g = torch.Generator().manual_seed(0)
    x = _NOT_OUTERMOST[layout](torch.randn(5, 8, 600, generator=g).to(dtype))
    dy = torch.randn(5, 8, 600, generator=g).to(dtype)
    mask = torch.rand(5, 600, generator=g) > 0.3
    w, b = (torch.rand(8, generator=g) + 0.5).to(dtype), torch.randn(8, generator=g).to(dtype)

    def run(x, m, dy):
        # a copy with x's own strides (clone() makes a view with gaps contiguous)
        x = torch.empty_strided(x.shape, x.stride(), dtype=dtype).copy_(x).requires_grad_()
        with normscope.use_backend(backend) if backend else contextlib.nullcontext():
            if op == "group_norm":
                y = F.group_norm(x, 2, w, b, mask=m)
            else:
                y = F.instance_norm(x, weight=w, bias=b, mask=m)
        y.backward(dy)
        assert normscope.last_backend() == "composite"
        return y.detach(), x.grad

    _each_sample_as_in_its_batch(run, x, mask, dy)


_REFERENCE_OPS = {
    # the automatic choice for a masked RMS scope (no composite form) is the reference
    "masked_rms": (None, lambda x, m: normscope.normalize(x, dims=(1, 2), centered=False, mask=m)),
    "group_norm": ("reference", lambda x, m: F.group_norm(x, 2, mask=m[:, 0])),
    "layer_norm_2d": ("reference", lambda x, m: normscope.normalize(x, dims=1)),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("layout", sorted(_NOT_OUTERMOST))
@pytest.mark.parametrize("op", sorted(_REFERENCE_OPS))
def test_a_sample_on_the_reference_is_the_same_alone_and_in_a_batch_whose_samples_are_not_outermost(op, layout, dtype):
    # ATen's reductions (and autograd's sums in the backward) merge the axes of a sample with gaps one
    # way alone and another in a batch: input gradients 2.4e-7 apart in fp32 before the reference made
    # such a sample contiguous
    backend, fn = _REFERENCE_OPS[op]
    g = torch.Generator().manual_seed(0)
    x = _NOT_OUTERMOST[layout](torch.randn(5, 8, 300, generator=g).to(dtype))
    dy = torch.randn(5, 8, 300, generator=g).to(dtype)
    mask = torch.rand(5, 1, 300, generator=g) > 0.3

    def run(x, m, dy):
        x = torch.empty_strided(x.shape, x.stride(), dtype=dtype).copy_(x).requires_grad_()
        with normscope.use_backend(backend) if backend else contextlib.nullcontext():
            y = fn(x, m)
        y.backward(dy)
        assert normscope.last_backend() == "reference"
        return y.detach(), x.grad

    _each_sample_as_in_its_batch(run, x, mask, dy)


def test_a_transposed_row_on_the_reference_is_the_same_alone_and_in_a_batch():
    # a (D, B) tensor viewed as (B, D) rows: LayerNorm's input gradient on the reference differed alone
    g = torch.Generator().manual_seed(0)
    x = torch.randn(257, 17, generator=g).t()
    dy = torch.randn(17, 257, generator=g)
    w, b = torch.randn(257, generator=g), torch.randn(257, generator=g)

    def run(x, dy):
        x = torch.empty_strided(x.shape, x.stride()).copy_(x).requires_grad_()
        with normscope.use_backend("reference"):
            y = F.layer_norm(x, 257, w, b)
        y.backward(dy)
        return y.detach(), x.grad

    y, gx = run(x, dy)
    for i in range(17):
        y1, g1 = run(x[i : i + 1], dy[i : i + 1])
        assert _same(y1[0], y[i]), f"output of row {i}"
        assert _same(g1[0], gx[i]), f"input gradient of row {i}"


def test_a_sample_alone_keeps_its_memory_format(two_threads):
    # the lone scope runs as a stride-0 pair, which has no memory format: the output keeps the input's
    x = torch.randn(1, 4, 100, 100).contiguous(memory_format=torch.channels_last)
    for backend in (None, "reference"):
        with normscope.use_backend(backend) if backend else contextlib.nullcontext():
            y = F.group_norm(x, 1)
        assert y.is_contiguous(memory_format=torch.channels_last)
        torch.testing.assert_close(y, torch.nn.functional.group_norm(x, 1))


# -- a lone group ------------------------------------------------------------------------------------
#
# ATen's CPU GroupNorm backward takes a lone group (N * G == 1: one sample, GroupNorm(1, C)) another
# way than the same group among others once it has several intra-op threads, at any size: the input
# gradient of a (1, 4, 30) fp32 or (1, 2, 30) fp64 sample alone was 1.5e-8 / 1.7e-16 off its bits in a
# batch, on the aten path as in torch's own op. Such a sample runs as a stride-0 pair of itself, as a
# large scope does; a channels_last one runs alone (torch's channels_last kernel takes it as in a batch).

_LONE_GROUP_CASES = [
    ((4, 30), torch.float32, "contiguous"),
    ((2, 30), torch.float64, "contiguous"),
    ((3, 30), torch.float64, "contiguous"),
    ((4, 5, 6), torch.float32, "contiguous"),
    ((4, 5, 6), torch.float32, "channels_last"),
    ((4, 5, 6), torch.float64, "channels_last"),
    ((4, 5, 6), torch.float32, "transposed"),
]


@pytest.mark.parametrize("backend", [None, "aten", "reference"], ids=lambda b: b or "auto")
@pytest.mark.parametrize("case", _LONE_GROUP_CASES, ids=lambda c: "x".join(map(str, c[0])) + f"-{c[1]}-{c[2]}")
def test_a_lone_group_is_the_same_alone_and_in_a_batch_with_two_threads(case, backend, two_threads):
    shape, dtype, layout = case
    g = torch.Generator().manual_seed(0)
    xs = (3 * torch.randn(7, *shape, generator=g) + 0.5).to(dtype)
    dys = torch.randn(7, *shape, generator=g).to(dtype)
    w = (torch.rand(shape[0], generator=g) + 0.5).to(dtype)
    b = torch.randn(shape[0], generator=g).to(dtype)

    def laid(t):
        if layout == "channels_last":
            return t.contiguous(memory_format=torch.channels_last)
        if layout == "transposed":
            return t.transpose(-1, -2).contiguous().transpose(-1, -2)
        return t

    def run(fn, x, dy):
        x = laid(x).clone(memory_format=torch.preserve_format).requires_grad_()
        with normscope.use_backend(backend) if backend else contextlib.nullcontext():
            y = fn(x)
        y.backward(dy)
        return y.detach(), x.grad

    layer = normscope.GroupNorm(1, shape[0], dtype=dtype)
    with torch.no_grad():
        layer.weight.copy_(w), layer.bias.copy_(b)
    ops = {"functional": lambda x: F.group_norm(x, 1, w, b), "module": layer}
    for name, fn in ops.items():
        alone = run(fn, xs[:1], dys[:1])
        for n in (2, 3, 7):
            at = n // 2
            x, dy = xs[:n].clone(), dys[:n].clone()
            x[at], dy[at] = xs[0], dys[0]
            y, gx = run(fn, x, dy)
            assert _same(alone[0][0], y[at]), f"{name}: output alone vs in a batch of {n}"
            assert _same(alone[1][0], gx[at]), f"{name}: input gradient alone vs in a batch of {n}"
            if backend != "reference":  # the aten path's bits are torch.nn's, in a batch
                ty, tg = run(lambda x: torch.nn.functional.group_norm(x, 1, w, b), x, dy)
                assert _same(y, ty) and _same(gx, tg), f"{name}: torch's bits in a batch of {n}"
            with torch.no_grad():  # inference: the forward alone (not paired) has the batch's bits too
                with normscope.use_backend(backend) if backend else contextlib.nullcontext():
                    y0 = fn(laid(xs[:1].clone()))
            assert _same(y0[0], y[at]), f"{name}: output alone without grad vs in a batch of {n}"


#: per-sample norms, masked and not: a sample's bits must not depend on its address in memory
_ADDRESS_OPS = {
    "group_norm-masked": lambda x, m: F.group_norm(x, 2, mask=m),
    "instance_norm-masked": lambda x, m: F.instance_norm(x, mask=m),
    "group_norm": lambda x, m: F.group_norm(x, 2),
    "layer_norm": lambda x, m: F.layer_norm(x, (x.shape[-1],)),
    "rms_norm": lambda x, m: F.rms_norm(x, (x.shape[-1],)),
}


@pytest.mark.parametrize(
    ("op", "backend"),
    [(op, b) for op in sorted(_ADDRESS_OPS) for b in (None, "reference", "composite" if "masked" in op else "aten")],
    ids=lambda v: v or "auto",
)
def test_a_sample_has_the_same_bits_wherever_it_lies_in_memory(op, backend):
    # sample i of a batch starts i * C * L elements into the batch's memory, a sample alone at the
    # allocator's aligned start: BLAS's products round by the data's alignment (MKL peels to an aligned
    # address), so a sum taken as a matrix product gave a sample in a batch other bits than alone. Here
    # the same sample at every 4-byte offset of a 64-byte line: the same output and input gradient bits
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, 4, 1000, generator=g)
    dy = torch.randn(1, 4, 1000, generator=g)
    mask = torch.rand(1, 1000, generator=g) > 0.3
    got = []
    for offset in range(16):
        buf = torch.zeros(offset + x.numel())
        buf[offset:] = x.flatten()
        buf.requires_grad_()
        xv = buf[offset:].view(x.shape)
        with normscope.use_backend(backend) if backend else contextlib.nullcontext():
            y = _ADDRESS_OPS[op](xv, mask)
        y.backward(dy)
        got.append((y.detach(), buf.grad[offset:].view(x.shape)))
    for offset, (y, gx) in enumerate(got[1:], 1):
        assert _same(y, got[0][0]), f"output at an offset of {offset} elements"
        assert _same(gx, got[0][1]), f"input gradient at an offset of {offset} elements"
