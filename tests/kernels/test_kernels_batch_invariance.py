"""Scope isolation of the Triton kernels: a sample's output and input gradient are bitwise the same
alone and inside batches of several sizes, at any position -- the kernels pack and split per scope,
never by the batch size. On CPU in Triton's interpreter (as the other kernel tests), with launch
settings small enough that these tiny shapes take several tiles and several splits per group.
BatchNorm's scope spans the batch by definition and is not here.
"""

import pytest
import torch

from conftest import TEST_DEVICE, sample_alone_and_in_batches

pytest.importorskip("triton", reason="the kernel tests need Triton (pip install 'normscope[kernels]')")

from normscope import functional as nf  # noqa: E402
from normscope import functional_modern as FM  # noqa: E402
from normscope.kernels import config as KC  # noqa: E402

DEV = torch.device(TEST_DEVICE)
#: (batch size, the sample's position): a neighbour after it, and neighbours on both sides
BATCHES = ((2, 0), (5, 3))

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


@pytest.fixture(autouse=True)
def _small_tiles(monkeypatch):
    """Tiles and split targets small enough that the shapes below loop and split: where a setting
    were chosen from the batch, the batch sizes here would choose differently."""
    knobs = {
        "GROUPS_CL_TILE": 16,
        "GROUPS_CL_WIDTH": 4,
        "GROUPS_CL_PROGRAMS": 8,
        "GROUPS_CL_MIN_SPLIT": 8,
        "GROUPS_TILE": 16,
        "ROWS_TILE": 32,
        "ROWS_MAX_FUSED_N": 32,  # rows longer than this take the looped path
        "ROWS_LOOP_BLOCK": 16,
        "ROWS_MAX_BLOCK_M": 4,
        "INTERPRETER_PROGRAMS": 3,
    }
    for name, value in knobs.items():
        monkeypatch.setattr(KC, name, value)


@pytest.mark.parametrize("layout", ("nchw", "channels_last"))
@pytest.mark.parametrize("groups", (2, 8))
def test_group_norm_kernels_are_batch_invariant(layout, groups):
    torch.manual_seed(0)
    c = 8
    w, b = torch.randn(c, device=DEV), torch.randn(c, device=DEV)
    sample = torch.randn(c, 6, 6, device=DEV)

    def fn(xb):
        if layout == "channels_last":
            xb = xb.contiguous(memory_format=torch.channels_last)
        return nf.group_norm(xb, groups, w, b, backend="triton")

    sample_alone_and_in_batches(fn, sample, BATCHES)


@pytest.mark.parametrize("centered", (True, False))
@pytest.mark.parametrize("n", (7, 40))
def test_rows_kernels_are_batch_invariant(centered, n):
    """LayerNorm and RMSNorm rows: a sample of several rows, alone and in batches; ``n = 40`` takes the
    looped path (longer than ROWS_MAX_FUSED_N here)."""
    torch.manual_seed(1)
    w, b = torch.randn(n, device=DEV), torch.randn(n, device=DEV)
    sample = torch.randn(3, n, device=DEV)

    def fn(xb):
        if centered:
            return nf.layer_norm(xb, (n,), w, b, backend="triton")
        return nf.rms_norm(xb, (n,), w, backend="triton")

    sample_alone_and_in_batches(fn, sample, BATCHES)


def test_fused_add_rms_norm_kernel_is_batch_invariant():
    torch.manual_seed(2)
    n = 12
    w = torch.randn(n, device=DEV)
    sample = torch.randn(3, 2 * n, device=DEV)  # x and the residual side by side, split in fn

    def fn(xb):
        y, h = nf.fused_add_rms_norm(xb[..., :n], xb[..., n:], w, backend="triton")
        return torch.cat([y, h], -1)

    sample_alone_and_in_batches(fn, sample, BATCHES)


def _modern(name: str):
    """(fn(xb) on the forced kernel, one sample) for each modern kernel op: per-sample modulation for
    AdaLN, q and k of a sample for QK-norm (k is a function of the sample too)."""
    g = torch.Generator().manual_seed(3)
    n = 8
    w, b = torch.randn(n, generator=g).to(DEV), torch.randn(n, generator=g).to(DEV)
    if name == "modulated_norm":
        # a sample: 3 tokens of width n, then its shift and scale rows
        def fn(xb):
            x, shift, scale = xb[:, :3], xb[:, 3], xb[:, 4]
            return FM.modulated_norm(x, shift, scale, w, b, norm="layer", backend="triton")

        return fn, torch.randn(5, n, generator=g).to(DEV)
    if name == "qk_norm":

        def fn(xb):  # (B, S, H, D): q its heads 0-1, k head 2
            q, k = xb[:, :, :2], xb[:, :, 2:]
            qn, kn = FM.qk_norm(q, k, w, b, casting="gemma", weight_offset=1.0, backend="triton")
            return torch.cat([qn, kn], 2)

        return fn, torch.randn(3, 3, n, generator=g).to(DEV)
    if name == "poly_norm":
        wp, bp = torch.randn(3, generator=g).to(DEV), torch.randn(1, generator=g).to(DEV)
        return (lambda xb: FM.poly_norm(xb, wp, bp, backend="triton")), torch.randn(3, n, generator=g).to(DEV)
    alpha, shift = torch.tensor(0.7).to(DEV), torch.tensor(0.1).to(DEV)
    return (lambda xb: FM.derf(xb, alpha, shift, w, b, backend="triton")), torch.randn(3, n, generator=g).to(DEV)


@pytest.mark.parametrize("name", ("modulated_norm", "qk_norm", "poly_norm", "derf"))
def test_modern_kernels_are_batch_invariant(name):
    fn, sample = _modern(name)
    sample_alone_and_in_batches(fn, sample, BATCHES)
