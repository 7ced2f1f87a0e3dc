"""Scope isolation of the compiled Triton kernels on CUDA, with their real launch settings, at the
bench's sizes: a row alone and among 6, 254, 255, 256 and 299 other rows (one more or less than a
power of two, and counts Triton specializes differently: a multiple of 16, and 1) at every row length
the bench times; a GroupNorm / InstanceNorm sample alone and in batches of 2, 7 and 32 in both layouts.
Run with ``NORMSCOPE_TEST_DEVICE=cuda`` (benchmarks/gpu_check.sh tests); the interpreter cannot afford
these sizes, and test_kernels_batch_invariance.py holds the same property there with shrunken tiles
(its autouse fixture shrinks them, which is why these tests live in a file of their own).
"""

import pytest
import torch

from conftest import TEST_DEVICE, sample_alone_and_in_batches

pytest.importorskip("triton", reason="the kernel tests need Triton (pip install 'normscope[kernels]')")

from normscope import functional as nf  # noqa: E402
from normscope import functional_modern as FM  # noqa: E402

DEV = torch.device(TEST_DEVICE)

cuda_only = pytest.mark.skipif(DEV.type != "cuda", reason="realistic sizes run only with NORMSCOPE_TEST_DEVICE=cuda")
#: (batch size, the row's position): 6, 254, 255, 256 and 299 other rows around it
ROW_BATCHES = ((7, 3), (255, 254), (256, 0), (257, 128), (300, 299))
GROUP_BATCHES = ((2, 1), (7, 3), (32, 31))
#: every row length the bench times (normscope.bench.cases.NS_FULL), and the modern cases' widths
ROW_NS = (256, 1024, 4096, 8192, 16384, 32768, 65536, 131072, 262144)
MODERN_NS = (256, 1024, 4096, 8192, 16384)
CUDA_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@cuda_only
@pytest.mark.parametrize("dtype", CUDA_DTYPES)
@pytest.mark.parametrize("n", ROW_NS)
@pytest.mark.parametrize("op", ("layer_norm", "rms_norm", "add_rms_norm"))
def test_rows_kernels_are_batch_invariant_at_bench_sizes(op, n, dtype):
    g = torch.Generator().manual_seed(n)
    dt = CUDA_DTYPES[dtype]
    w, b = (torch.rand(n, generator=g) + 0.5).to(DEV, dt), torch.randn(n, generator=g).to(DEV, dt)
    if op == "add_rms_norm":
        sample = torch.randn(2 * n, generator=g).to(DEV, dt)  # x and the residual side by side

        def fn(xb):
            y, h = nf.fused_add_rms_norm(xb[..., :n], xb[..., n:], w, backend="triton")
            return torch.cat([y, h], -1)

    else:
        sample = (torch.randn(n, generator=g) * 2 + 1).to(DEV, dt)

        def fn(xb):
            if op == "layer_norm":
                return nf.layer_norm(xb, (n,), w, b, backend="triton")
            return nf.rms_norm(xb, (n,), w, backend="triton")

    sample_alone_and_in_batches(fn, sample, ROW_BATCHES)


@cuda_only
@pytest.mark.parametrize("dtype", CUDA_DTYPES)
@pytest.mark.parametrize("n", MODERN_NS)
@pytest.mark.parametrize("name", ("modulated_norm", "gemma_rms_norm", "poly_norm", "derf", "qk_norm"))
def test_modern_kernels_are_batch_invariant_at_bench_sizes(name, n, dtype):
    g = torch.Generator().manual_seed(n + 1)
    dt = CUDA_DTYPES[dtype]
    if name == "qk_norm":
        if n not in (256, 1024, 4096):
            pytest.skip("qk_norm's widths are head dims: 64, 128 and 256 run under n = 256, 1024, 4096")
        n = {256: 64, 1024: 128, 4096: 256}[n]
    w, b = (torch.rand(n, generator=g) + 0.5).to(DEV, dt), torch.randn(n, generator=g).to(DEV, dt)
    if name == "modulated_norm":
        sample = torch.randn(5, n, generator=g).to(DEV, dt)  # 3 tokens, then the sample's shift and scale

        def fn(xb):
            return FM.modulated_norm(xb[:, :3], xb[:, 3], xb[:, 4], w, None, norm="rms", backend="triton")

    elif name == "qk_norm":
        sample = torch.randn(4, 5, n, generator=g).to(DEV, dt)  # (S, H, D): q heads 0-3, k head 4

        def fn(xb):
            qn, kn = FM.qk_norm(xb[:, :, :4], xb[:, :, 4:], w, b, casting="gemma", weight_offset=1.0, backend="triton")
            return torch.cat([qn, kn], 2)

    elif name == "gemma_rms_norm":
        sample = torch.randn(n, generator=g).to(DEV, dt)

        def fn(xb):
            return FM.rms_norm(xb, (n,), w, 1e-6, weight_offset=1.0, casting="gemma", backend="triton")

    elif name == "poly_norm":
        wp, bp = torch.rand(3, generator=g).to(DEV, dt), torch.randn(1, generator=g).to(DEV, dt)
        sample = torch.randn(n, generator=g).to(DEV, dt)

        def fn(xb):
            return FM.poly_norm(xb, wp, bp, backend="triton")

    else:
        alpha, shift = torch.tensor(0.7).to(DEV, dt), torch.tensor(0.1).to(DEV, dt)
        sample = torch.randn(n, generator=g).to(DEV, dt)

        def fn(xb):
            return FM.derf(xb, alpha, shift, w, b, backend="triton")

    sample_alone_and_in_batches(fn, sample, ROW_BATCHES)


@cuda_only
@pytest.mark.parametrize("dtype", CUDA_DTYPES)
@pytest.mark.parametrize("layout", ("nchw", "channels_last"))
@pytest.mark.parametrize("op", ("group_norm", "instance_norm"))
def test_group_kernels_are_batch_invariant_at_bench_sizes(op, layout, dtype):
    """The bench's GroupNorm sample, (256, 56, 56) with 32 groups, and InstanceNorm on the same."""
    g = torch.Generator().manual_seed(5)
    dt = CUDA_DTYPES[dtype]
    c = 256
    w, b = (torch.rand(c, generator=g) + 0.5).to(DEV, dt), torch.randn(c, generator=g).to(DEV, dt)
    sample = (torch.randn(c, 56, 56, generator=g) * 2 + 1).to(DEV, dt)

    def fn(xb):
        if layout == "channels_last":
            xb = xb.contiguous(memory_format=torch.channels_last)
        if op == "group_norm":
            return nf.group_norm(xb, 32, w, b, backend="triton")
        return nf.instance_norm(xb, weight=w, bias=b, backend="triton")

    sample_alone_and_in_batches(fn, sample, GROUP_BATCHES)
