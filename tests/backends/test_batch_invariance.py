"""Batch invariance of the RMS-scoped norms on CPU: a sample's output and input gradient are the
same bits alone, at another position and among other rows, whatever the batch size -- as torch.nn's
are. The batch sizes straddle every size threshold of the CPU paths (the automatic choice between
torch's op and the rows path at ``rms.MIN_AUTO_ELEMENTS``, the rows path's blocks of
``rms.BLOCK_ELEMENTS`` and whole-input fp32 below ``rms.BLOCKED_BYTES``), at row lengths 1024 and
4096. Weight gradients (a sum over rows) are checked to be the same from run to run.
"""

from __future__ import annotations

import pytest
import torch

import normscope
import normscope.functional_modern as FM
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
