"""The candidate kernels -- the split BatchNorm (kernels/channels_split.py) and the on-chip
GroupNorm / InstanceNorm (kernels/groups_onchip.py) -- against independent float64 oracles, and the
rules that keep them off until a measurement picks them (kernels/variants.py, backends/measured.py).

On CPU in Triton's interpreter at tiny shapes (tests/conftest.py), with launch settings shrunk so that
the shapes take many tiles and splits; ``NORMSCOPE_TEST_DEVICE=cuda`` runs the same tests compiled, plus
realistic sizes, more than 2^31 elements and batch invariance at the bench's sizes. Oracles: torch in
float64 (``F.batch_norm``, ``F.group_norm``, the formula for the RMS and masked variants); low precision
follows the kernels' rule: error against float64 at most twice torch's in the same dtype, plus a small
atol. Spies on the kernel modules check that the candidate ran -- and the default kernels did not.
(``NORMSCOPE_TEST_KERNEL_VARIANTS=channels:split,groups:onchip`` also runs the default kernel tests on them.)
"""

import json

import pytest
import torch
import torch.nn.functional as F

from conftest import TEST_DEVICE, sample_alone_and_in_batches

pytest.importorskip("triton", reason="the kernel tests need Triton (pip install 'normscope[kernels]')")

import normscope  # noqa: E402
from normscope import _registry  # noqa: E402
from normscope import functional as nf  # noqa: E402
from normscope.backends import measured  # noqa: E402
from normscope.kernels import channels as CH  # noqa: E402
from normscope.kernels import channels_split as CS  # noqa: E402
from normscope.kernels import config as KC  # noqa: E402
from normscope.kernels import groups as G  # noqa: E402
from normscope.kernels import groups_onchip as GO  # noqa: E402
from normscope.kernels import variants  # noqa: E402

DEV = torch.device(TEST_DEVICE)
ON_CPU = DEV.type == "cpu"
cuda_only = pytest.mark.skipif(ON_CPU, reason="realistic sizes run only with NORMSCOPE_TEST_DEVICE=cuda")
CL = {4: torch.channels_last, 5: torch.channels_last_3d}

# eps=0 and masked lanes make numpy warn inside the interpreter (never stored)
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

SPLIT_KERNELS = [f"_{v}_{k}_kernel" for v in ("cols", "rows") for k in ("stats", "apply", "bwd_sums", "bwd_dx")]
TILED_CHANNELS = ("_stats_kernel", "_apply_kernel", "_bwd_sums_kernel", "_bwd_dx_kernel")
ONCHIP_KERNELS = ("_nchw_fwd_kernel", "_nchw_bwd_kernel", "_cl_fwd_kernel", "_cl_bwd_kernel")
TILED_GROUPS = ("_groups_fwd_kernel", "_groups_bwd_kernel", "_groups_cl_stats_kernel", "_groups_cl_apply_kernel",
                "_groups_cl_bwd_sums_kernel", "_groups_cl_bwd_dx_kernel")  # fmt: skip


class _Spy:
    """Stands in for a kernel: counts launches and records their arguments, then runs the kernel."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append((grid, args, kwargs))
            return self.kernel[grid](*args, **kwargs)

        return launch


def _spy(monkeypatch, module, names) -> dict[str, _Spy]:
    out = {}
    for name in names:
        out[name] = _Spy(getattr(module, name))
        monkeypatch.setattr(module, name, out[name])
    return out


def _ran(spies) -> set[str]:
    return {name for name, s in spies.items() if s.launches}


@pytest.fixture
def split(monkeypatch):
    """The split BatchNorm pinned, spies on it and on the default channels kernels: ``(split spies, the default)``."""
    monkeypatch.setattr(KC, "CHANNELS_VARIANT", "split")
    return _spy(monkeypatch, CS, SPLIT_KERNELS), _spy(monkeypatch, CH, TILED_CHANNELS)


@pytest.fixture
def onchip(monkeypatch):
    """The on-chip groups kernels pinned, spies on them and on the default: ``(on-chip spies, the default)``."""
    monkeypatch.setattr(KC, "GROUPS_VARIANT", "onchip")
    return _spy(monkeypatch, GO, ONCHIP_KERNELS), _spy(monkeypatch, G, TILED_GROUPS)


@pytest.fixture(params=["default", "tiny"])
def split_tiles(request, monkeypatch):
    """Default settings (these shapes: one tile, one split) and tiny ones: tiles of 2 x 4 / 4 x 2, one tile a
    split, so that every loop runs several times and the combine has up to 16 splits."""
    if request.param == "tiny":
        for name, value in (("CHANNELS_SPLIT_TILE", 8), ("CHANNELS_SPLIT_BLOCK_C", 4), ("CHANNELS_SPLIT_BLOCK_I", 2),
                            ("CHANNELS_SPLIT_MIN_TILES", 1)):  # fmt: skip
            monkeypatch.setattr(KC, name, value)
    return request.param


def _grads(outputs, inputs, cotangents):
    return torch.autograd.grad(outputs, [t for t in inputs if t is not None], cotangents, allow_unused=True)


def _within_twice_torch(ours, torch_same, want, dtype, what):
    atol = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-2}[dtype]
    for i, (got, tt, w) in enumerate(zip(ours, torch_same, want)):
        assert got.dtype == tt.dtype, f"{what} output {i}: dtype {got.dtype}, torch gives {tt.dtype}"
        err_k = (got.double() - w).abs().max().item()
        err_t = (tt.double() - w).abs().max().item()
        bound = 2 * err_t + atol * w.abs().max().item() + atol
        assert err_k <= bound, f"{what} output {i}: error {err_k:.3g} > bound {bound:.3g} (torch's {err_t:.3g})"


# ---------------------------------------------------------------------------------------------
# the split BatchNorm


def _layout(x, kind):
    return x.contiguous(memory_format=CL[x.dim()]) if kind == "cl" else x


# (shape, layout): channels innermost ((N, C), channels_last, channels_last_3d) and NCHW ((N, C, L), (N, C, H, W))
BN_CASES = [
    ((6, 5), "nchw"),
    ((4, 3, 7), "nchw"),
    ((3, 4, 5, 2), "nchw"),
    ((2, 5, 3, 4), "cl"),
    ((2, 3, 2, 3, 2), "cl"),
]


@pytest.mark.parametrize("shape,layout", BN_CASES, ids=[f"{'x'.join(map(str, s))}-{k}" for s, k in BN_CASES])
def test_split_batch_norm_training_eval_and_running_stats_match_float64(split, split_tiles, shape, layout):
    spies, tiled = split
    g = torch.Generator().manual_seed(len(shape))
    c = shape[1]
    x = _layout((torch.randn(shape, generator=g) * 2 + 100).to(DEV), layout).requires_grad_()  # a large offset too
    w = torch.randn(c, generator=g).to(DEV).requires_grad_()
    b = torch.randn(c, generator=g).to(DEV).requires_grad_()
    rm, rv = torch.randn(c, generator=g).to(DEV), (torch.rand(c, generator=g) + 0.5).to(DEV)
    rm_t, rv_t = rm.clone(), rv.clone()
    with normscope.use_backend("triton"):
        y = nf.batch_norm(x, rm, rv, w, b, training=True, momentum=0.2)
        assert normscope.last_backend() == "triton"
    assert y.is_contiguous(memory_format=CL[x.dim()]) if layout == "cl" else y.is_contiguous()
    F.batch_norm(x, rm_t, rv_t, w, b, True, 0.2)
    y64 = F.batch_norm(x.double(), None, None, w.double(), b.double(), True)
    torch.testing.assert_close(y.double(), y64, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(rm, rm_t, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(rv, rv_t, atol=1e-5, rtol=1e-5)
    dy = torch.randn(shape, generator=g).to(DEV)
    for a, e in zip(_grads(y, (x, w, b), dy), _grads(y64, (x, w, b), dy.double())):
        torch.testing.assert_close(a.double(), e.double(), atol=1e-4, rtol=1e-4)
    with normscope.use_backend("triton"):
        ye = nf.batch_norm(x, rm, rv, w, b, training=False)
    ye64 = F.batch_norm(x.double(), rm.double(), rv.double(), w.double(), b.double(), False)
    torch.testing.assert_close(ye.double(), ye64, atol=1e-4, rtol=1e-5)
    for a, e in zip(_grads(ye, (x, w, b), dy), _grads(ye64, (x, w, b), dy.double())):
        torch.testing.assert_close(a.double(), e.double(), atol=1e-4, rtol=1e-5)
    view = "cols" if len(shape) == 2 or layout == "cl" else "rows"
    assert _ran(spies) == {n for n in SPLIT_KERNELS if n.startswith(f"_{view}_")}
    assert not _ran(tiled), "the default channels kernels ran"


def test_split_tiny_tiles_really_split(monkeypatch):
    """What the "tiny" settings do to the shapes here: several tiles per row and up to 16 splits."""
    for name, value in (("CHANNELS_SPLIT_TILE", 8), ("CHANNELS_SPLIT_BLOCK_C", 4), ("CHANNELS_SPLIT_BLOCK_I", 2),
                        ("CHANNELS_SPLIT_MIN_TILES", 1)):  # fmt: skip
        monkeypatch.setattr(KC, name, value)
    cols = CS.launch_plan(2 * 3 * 4, 5, 1)  # channels_last (2, 5, 3, 4): 24 positions in tiles of 2
    assert (cols["block_r"], cols["block_q"], cols["splits"]) == (2, 4, 12) and cols["block_s"] == 16
    rows = CS.launch_plan(3, 4, 10)  # (3, 4, 5, 2): 3 rows of 10 in tiles of 4 x 2
    assert (rows["block_r"], rows["block_q"], rows["tiles_i"], rows["splits"]) == (4, 2, 5, 5)
    monkeypatch.undo()
    # the defaults: a scope is split by its own extent only, at most CHANNELS_SPLIT_MAX times
    big = CS.launch_plan(32, 256, 3136)
    assert big["splits"] <= KC.CHANNELS_SPLIT_MAX and big["block_q"] == KC.CHANNELS_SPLIT_BLOCK_I
    assert CS.launch_plan(32, 7, 3136) == CS.launch_plan(32, 4096, 3136)  # the channel count changes nothing


@pytest.mark.parametrize("view", ["cols", "rows"])
def test_split_large_offset_small_spread_normalizes_to_unit_variance(split, split_tiles, view):
    """Mean 1e4, std 1e-2 in fp32: each split shifts by its first tile's mean, and the splits combine
    relative to the first one's shift -- the variance survives (E[x^2] - E[x]^2 would return noise)."""
    g = torch.Generator().manual_seed(3)
    shape = (64, 3) if view == "cols" else (4, 3, 16)
    x = (torch.randn(shape, generator=g, dtype=torch.float64) * 1e-2 + 1e4).float().to(DEV)
    y = nf.batch_norm(x, None, None, None, None, True, 0.1, 1e-12, backend="triton")  # eps far below the variance
    red = (0,) if view == "cols" else (0, 2)
    torch.testing.assert_close(y.double().var(red, unbiased=False), torch.ones(3, dtype=torch.float64, device=DEV),
                               atol=2e-3, rtol=0)  # fmt: skip
    want = F.batch_norm(x.double(), None, None, training=True, eps=1e-12)
    torch_err = (F.batch_norm(x, None, None, training=True, eps=1e-12).double() - want).abs().max().item()
    assert (y.double() - want).abs().max().item() <= 2 * torch_err + 1e-6


@pytest.mark.parametrize("masked", [False, True])
def test_split_outlier_first_value_keeps_torchs_accuracy(split, split_tiles, masked):
    """A channel whose first valid value is an outlier (1e4 among values ~1): the shift is a tile's mean,
    not that value (which once cost the default kernel ~40x torch's error). Padding holds NaN."""
    g = torch.Generator().manual_seed(14)
    x = torch.randn(8, 3, 5, generator=g)
    mask = torch.ones(8, 5, dtype=torch.bool)
    if masked:
        mask[0, :2] = False
        x[~mask.unsqueeze(1).expand_as(x)] = float("nan")
    x[0, :, 2] = 1e4
    valid = mask.unsqueeze(1).expand_as(x).clone()
    xv = x.transpose(0, 1)[valid.transpose(0, 1)].view(3, -1)
    want = F.layer_norm(xv.double(), (xv.shape[1],))
    torch_err = F.layer_norm(xv, (xv.shape[1],)).double() - want
    others = xv != 1e4
    y = nf.batch_norm(x.to(DEV), None, None, None, None, True, mask=mask.to(DEV) if masked else None, backend="triton")
    got = y.cpu().transpose(0, 1)[valid.transpose(0, 1)].view(3, -1)
    err = (got.double() - want)[others].abs().max().item()
    bound = torch_err[others].abs().max().item()
    assert err <= 2 * bound + 1e-7, f"kernel {err:.3g} vs torch {bound:.3g} against float64"


@pytest.mark.parametrize("layout", ["nchw", "cl"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_split_low_precision_error_at_most_twice_torch(split, dtype, layout):
    g = torch.Generator().manual_seed(12)
    x = _layout((torch.randn(4, 6, 5, 3, generator=g) * 3 + 1).to(DEV, dtype), layout).requires_grad_()
    w = (torch.rand(6, generator=g) + 0.5).to(DEV).requires_grad_()
    b = torch.randn(6, generator=g).to(DEV).requires_grad_()
    dy = torch.randn(4, 6, 5, 3, generator=g).to(DEV, dtype)
    y_k = nf.batch_norm(x, None, None, w, b, training=True, backend="triton")
    y_t = F.batch_norm(x, None, None, w, b, True)
    y64 = F.batch_norm(x.double(), None, None, w.double(), b.double(), True)
    ours = (y_k, *_grads(y_k, (x, w, b), dy))
    theirs = (y_t, *_grads(y_t, (x, w, b), dy))
    want = (y64, *_grads(y64, (x, w, b), dy.double()))
    _within_twice_torch(ours, theirs, want, dtype, f"split BatchNorm {dtype} {layout}")


def _masked_bn64(x, w, b, mask, d, eps=1e-5):
    """float64 masked BatchNorm from the formula: statistics per index of axis ``d`` over the positions
    ``mask`` (x's shape without axis d) keeps; padded outputs follow the same formula."""
    xf = x.double().movedim(d, -1)
    mf = mask.double().unsqueeze(-1)
    red = tuple(range(xf.dim() - 1))
    cnt = mf.sum(red)
    mean = torch.where(mf != 0, xf, 0).sum(red) / cnt.clamp_min(1)
    var = torch.where(mf != 0, (xf - mean) ** 2, 0).sum(red) / cnt.clamp_min(1)
    rstd = torch.where(cnt > 0, torch.rsqrt(var + eps), 0)
    y = (xf - mean) * rstd * w.double() + b.double()
    return y.movedim(-1, d)


@pytest.mark.parametrize("layout", ["bsd", "ncl"])
def test_split_masked_batch_norm_matches_float64_and_the_reference(split, split_tiles, layout):
    """(B, S, D) over the last axis (channels innermost) and (N, C, L) over axis 1 (NCHW), a sequence
    entirely padding among them; output, every gradient and the running statistics."""
    spies, tiled = split
    g = torch.Generator().manual_seed(13)
    b_, s_, d_ = 3, 7, 5
    lengths = torch.tensor([7, 3, 0])
    pos = torch.arange(s_)[None, :] < lengths[:, None]  # (B, S)
    if layout == "bsd":
        x = torch.randn(b_, s_, d_, generator=g) + 50
        mask, d, call_mask = pos, 2, pos[..., None]
    else:
        x = torch.randn(b_, d_, s_, generator=g) + 50
        mask, d, call_mask = pos, 1, pos[:, None, :]
    x = x.to(DEV).requires_grad_()
    w = torch.randn(d_, generator=g).to(DEV).requires_grad_()
    b = torch.randn(d_, generator=g).to(DEV).requires_grad_()
    dy = torch.randn(x.shape, generator=g).to(DEV)
    rm, rv = torch.zeros(d_, device=DEV), torch.ones(d_, device=DEV)
    with normscope.use_backend("triton"):
        y = normscope.engine.norm(x, normscope.Scope.batch(d), w, b, 1e-5, mask=call_mask.to(DEV),
                                  running=normscope.engine.Running(rm, rv, 0.3, True))  # fmt: skip
        assert normscope.last_backend() == "triton"
    y64 = _masked_bn64(x, w, b, mask.to(DEV), d)
    torch.testing.assert_close(y.double(), y64, atol=2e-5, rtol=1e-5)
    for a, e in zip(_grads(y, (x, w, b), dy), _grads(y64, (x, w, b), dy.double())):
        torch.testing.assert_close(a.double(), e.double(), atol=1e-4, rtol=1e-4)
    rm_r, rv_r = torch.zeros(d_, device=DEV), torch.ones(d_, device=DEV)
    with normscope.use_backend("reference"):
        normscope.engine.norm(x.double(), normscope.Scope.batch(d), None, None, 1e-5, mask=call_mask.to(DEV),
                              running=normscope.engine.Running(rm_r, rv_r, 0.3, True))  # fmt: skip
    torch.testing.assert_close(rm, rm_r, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(rv, rv_r, atol=1e-4, rtol=1e-5)
    assert _ran(spies) and not _ran(tiled)
    # the mask is read from the bool's own memory: the kernels got a uint8 view of it, no converted copy
    stats = spies["_cols_stats_kernel" if layout == "bsd" else "_rows_stats_kernel"].launches[0][1]
    assert stats[1].dtype == torch.uint8


def test_split_masked_edges_all_padding_is_the_bias_and_padding_changes_no_valid_bit(split, split_tiles):
    g = torch.Generator().manual_seed(14)
    x = torch.randn(2, 4, 3, generator=g).to(DEV)
    w, b = torch.randn(3, generator=g).to(DEV), torch.randn(3, generator=g).to(DEV)
    none = torch.zeros(2, 4, 1, dtype=torch.bool, device=DEV)
    y = nf.normalize(x, keep=-1, weight=w, bias=b, affine_dims=-1, mask=none, backend="triton")
    torch.testing.assert_close(y, b.expand(2, 4, 3), rtol=0, atol=0)  # no valid position: the bias, not NaN
    mask = torch.tensor([[1, 1, 0, 0], [1, 0, 1, 0]], dtype=torch.bool, device=DEV)[..., None]
    outs = []
    cot = torch.randn(2, 4, 3, generator=g).to(DEV) * mask  # valid outputs only: padding gets no cotangent
    for pad in (0.0, float("nan"), float("inf"), 3e38):
        xp = torch.where(mask, x, pad).requires_grad_()
        y = nf.normalize(xp, keep=-1, weight=w, bias=b, affine_dims=-1, mask=mask, backend="triton")
        (gx,) = torch.autograd.grad(y, xp, cot)
        outs.append((y[mask.expand_as(y)], gx[mask.expand_as(gx)]))
    for y, gx in outs[1:]:
        assert torch.equal(y, outs[0][0]) and torch.equal(gx, outs[0][1])


def test_split_channel_isolation_and_determinism(split, split_tiles):
    """A channel's bits depend on its own values only: the same among 9, 4 or 1 channels and at
    another channel index (the channel blocks change, the tiles and splits do not); two runs agree."""
    g = torch.Generator().manual_seed(21)
    for shape, d in (((6, 5, 9), 2), ((3, 9, 4, 2), 1)):  # (B, S, D) innermost; NCHW
        x = (torch.randn(shape, generator=g) * 3 + 7).to(DEV)
        dy = torch.randn(shape, generator=g).to(DEV)

        def run(xs, dys, d=d):
            xs = xs.detach().requires_grad_()
            w = torch.ones(xs.shape[d], device=DEV, requires_grad=True)
            y = nf.normalize(xs, keep=d, weight=w, affine_dims=d, backend="triton")
            return (y, *torch.autograd.grad(y, (xs, w), dys))

        full = run(x, dy)
        again = run(x, dy)
        for a, e in zip(full, again):
            assert torch.equal(a, e), "two runs differ"
        perm = torch.tensor([4, 0, 8, 2, 6, 1, 3, 7, 5], device=DEV)
        permuted = run(x.index_select(d, perm), dy.index_select(d, perm))
        for a, e, dim in zip(permuted, full, (d, d, 0)):
            assert torch.equal(a, e.index_select(dim, perm)), "a channel's bits moved with its index"
        for k in (4, 1):  # an even and an odd channel count beside 9
            few = run(x.narrow(d, 0, k), dy.narrow(d, 0, k))
            for a, e, dim in zip(few, full, (d, d, 0)):
                assert torch.equal(a, e.narrow(dim, 0, k)), "a channel's bits changed with the channel count"


def test_split_reads_channels_last_in_place(split):
    spies, _ = split
    g = torch.Generator().manual_seed(22)
    x = torch.randn(2, 6, 3, 5, generator=g).to(DEV).contiguous(memory_format=torch.channels_last)
    y = nf.batch_norm(x, None, None, None, None, True, backend="triton")
    (launch,) = spies["_cols_stats_kernel"].launches
    assert launch[1][0].data_ptr() == x.data_ptr(), "the input was copied before the kernel read it"
    assert spies["_cols_apply_kernel"].launches[0][1][1].data_ptr() == y.data_ptr()
    assert y.is_contiguous(memory_format=torch.channels_last)


def test_split_op_registrations_compile_and_double_backward(split):
    x = torch.randn(3, 4, 5, device=DEV, requires_grad=True)
    w, b = torch.randn(4, device=DEV, requires_grad=True), torch.randn(4, device=DEV, requires_grad=True)
    torch.library.opcheck(
        torch.ops.normscope.channels_split_fwd.default, (x, w, b, None, None, None, 1e-5),
        test_utils=("test_schema", "test_faketensor", "test_autograd_registration"),
    )  # fmt: skip
    f = torch.compile(lambda x, w, b: variants.batch_norm(x, 1, w, b)[0].square().sum(), fullgraph=True,
                      backend="aot_eager")  # fmt: skip
    out = f(x, w, b)
    want = F.batch_norm(x, None, None, w, b, True).square().sum()
    torch.testing.assert_close(out, want, atol=1e-4, rtol=1e-5)
    for a, e in zip(torch.autograd.grad(out, (x, w, b)), torch.autograd.grad(want, (x, w, b))):
        torch.testing.assert_close(a, e, atol=1e-4, rtol=1e-4)
    # create_graph=True: a gradient penalty through the kernel's backward (it differentiates the reference)
    y = nf.batch_norm(x, None, None, w, b, True, backend="triton")
    (gx,) = torch.autograd.grad(y.pow(3).sum(), x, create_graph=True)
    got = torch.autograd.grad(gx.square().sum(), (x, w))
    x64, w64, b64 = (t.detach().double().requires_grad_() for t in (x, w, b))
    (g64,) = torch.autograd.grad(F.batch_norm(x64, None, None, w64, b64, True).pow(3).sum(), x64, create_graph=True)
    for a, e in zip(got, torch.autograd.grad(g64.square().sum(), (x64, w64))):
        torch.testing.assert_close(a.double(), e.double(), atol=1e-3, rtol=1e-3)


def _refuse(*args, **kwargs):
    raise AssertionError("eager mode entered a custom op")


def test_eager_mode_runs_the_candidates_without_their_custom_ops(split, onchip, monkeypatch):
    for module, ops in ((CS, ("split_fwd", "split_bwd")), (GO, ("onchip_fwd", "onchip_bwd"))):
        for op in ops:
            monkeypatch.setattr(module, op, _refuse)
    x = torch.randn(2, 4, 3, 3, device=DEV, requires_grad=True)
    for y in (nf.batch_norm(x, None, None, training=True, backend="triton"), nf.group_norm(x, 2, backend="triton")):
        (gx,) = torch.autograd.grad(y.square().sum(), x)
        assert torch.isfinite(gx).all()
    assert _ran(split[0]) and _ran(onchip[0])


# ---------------------------------------------------------------------------------------------
# the on-chip GroupNorm / InstanceNorm


def _group64(x, groups, w, b, centered, eps=1e-5):
    x, w, b = (t.double() if t is not None else None for t in (x, w, b))
    if centered:
        return F.group_norm(x, groups, w, b, eps)
    xg = x.reshape(x.shape[0], groups, -1)
    y = (xg * torch.rsqrt(xg.square().mean(-1, keepdim=True) + eps)).reshape(x.shape)
    shape = [1, x.shape[1]] + [1] * (x.dim() - 2)
    y = y * w.reshape(shape) if w is not None else y
    return y + b.reshape(shape) if b is not None else y


GN_CASES = [
    ((2, 6, 5, 3), 3, "nchw"), ((3, 4, 7), 4, "nchw"), ((2, 4, 3, 3), 1, "nchw"), ((2, 6, 1, 5), 6, "nchw"),
    ((2, 6, 5, 3), 3, "cl"), ((2, 8, 3, 5), 8, "cl"), ((2, 8, 3, 5), 1, "cl"), ((2, 6, 2, 3, 2), 2, "cl"),
]  # fmt: skip


@pytest.fixture(params=["default", "narrow"])
def onchip_width(request, monkeypatch):
    """channels_last programs of up to 16 channels side by side (default), or 2: several group blocks a
    sample, a masked group lane (G = 3 in blocks of 2), a group wider than the width (G = 1)."""
    if request.param == "narrow":
        monkeypatch.setattr(KC, "GROUPS_ONCHIP_WIDTH", 2)
    return request.param


@pytest.mark.parametrize(
    "shape,groups,layout", GN_CASES, ids=[f"{'x'.join(map(str, s))}-G{g}-{k}" for s, g, k in GN_CASES]
)
@pytest.mark.parametrize("centered,affine", [(True, True), (True, False), (False, True)])
def test_onchip_forward_and_gradients_match_float64(onchip, onchip_width, shape, groups, layout, centered, affine):
    spies, tiled = onchip
    g = torch.Generator().manual_seed(sum(shape) + groups)
    x = _layout((torch.randn(shape, generator=g) * 2 + 5).to(DEV), layout).requires_grad_()
    w = torch.randn(shape[1], generator=g).to(DEV).requires_grad_() if affine else None
    b = torch.randn(shape[1], generator=g).to(DEV).requires_grad_() if affine else None
    y = variants.group_norm(x, groups, w, b, 1e-5, centered)
    assert y.stride() == x.stride()  # channels_last in, channels_last out, as torch's CPU group_norm
    y64 = _group64(x, groups, w, b, centered)
    torch.testing.assert_close(y.double(), y64, atol=2e-5, rtol=1e-5)
    dy = _layout(torch.randn(shape, generator=g).to(DEV), layout)
    for a, e in zip(_grads(y, (x, w, b), dy), _grads(y64, (x, w, b), dy.double())):
        torch.testing.assert_close(a.double(), e.double(), atol=5e-5, rtol=1e-4)
    kind = "cl" if layout == "cl" else "nchw"
    assert _ran(spies) == {f"_{kind}_fwd_kernel", f"_{kind}_bwd_kernel"}
    assert not _ran(tiled), "the default groups kernels ran"


@pytest.mark.parametrize("layout", ["nchw", "cl"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_onchip_low_precision_error_at_most_twice_torch(onchip, dtype, layout):
    g = torch.Generator().manual_seed(7)
    x = _layout((torch.randn(2, 8, 4, 5, generator=g) * 3 + 1).to(DEV, dtype), layout).requires_grad_()
    w = (torch.rand(8, generator=g) + 0.5).to(DEV, dtype).requires_grad_()
    b = torch.randn(8, generator=g).to(DEV, dtype).requires_grad_()
    dy = torch.randn(2, 8, 4, 5, generator=g).to(DEV, dtype)
    y_k, y_t = variants.group_norm(x, 4, w, b), F.group_norm(x, 4, w, b)
    ours = (y_k, *_grads(y_k, (x, w, b), dy))
    theirs = (y_t, *_grads(y_t, (x, w, b), dy))
    want = (_group64(x, 4, w, b, True), *_grads(_group64(x, 4, w, b, True), (x, w, b), dy.double()))
    _within_twice_torch(ours, theirs, want, dtype, f"on-chip GroupNorm {dtype} {layout}")


@pytest.mark.parametrize("layout", ["nchw", "cl"])
def test_onchip_outlier_offset_and_constant_groups(onchip, layout):
    """An outlier first element (1e4 among ~1): no worse than twice torch against float64; mean 1e4 with
    std 1e-2 normalizes to unit variance; a constant group near fp32's max gives exactly the bias."""
    g = torch.Generator().manual_seed(13)
    x = torch.randn(2, 4, 4, 4, generator=g)
    x[:, 0, 0, 0] = x[:, 2, 0, 0] = 1e4
    x = _layout(x.to(DEV), layout)
    want = F.group_norm(x.double(), 2)
    others = torch.ones_like(want, dtype=torch.bool)
    others[:, 0, 0, 0] = others[:, 2, 0, 0] = False
    torch_err = (F.group_norm(x, 2).double() - want)[others].abs().max().item()
    err = (variants.group_norm(x, 2).double() - want)[others].abs().max().item()
    assert err <= 2 * torch_err + 1e-7, f"kernel {err:.3g} vs torch {torch_err:.3g} against float64"
    off = _layout((torch.randn(2, 4, 4, 4, generator=g, dtype=torch.float64) * 1e-2 + 1e4).float().to(DEV), layout)
    y = variants.group_norm(off, 2, eps=1e-12).double().reshape(2, 2, -1)
    torch.testing.assert_close(y.var(-1, unbiased=False), torch.ones(2, 2, dtype=torch.float64, device=DEV),
                               atol=2e-3, rtol=0)  # fmt: skip
    c = _layout(torch.full((2, 4, 4, 4), 3e38, device=DEV), layout)
    b = torch.randn(4, generator=g).to(DEV)
    torch.testing.assert_close(variants.group_norm(c, 2, None, b), b[:, None, None].expand(2, 4, 4, 4), rtol=0, atol=0)


@pytest.mark.parametrize("layout", ["nchw", "cl"])
@pytest.mark.parametrize("groups", [2, 8])
def test_onchip_is_batch_invariant(onchip, onchip_width, layout, groups):
    """A sample's output and input gradient bitwise the same alone and inside batches (GroupNorm and, with
    8 groups of 8 channels, InstanceNorm): a group is one program's, whatever the batch."""
    torch.manual_seed(0)
    w, b = torch.randn(8, device=DEV), torch.randn(8, device=DEV)
    sample = torch.randn(8, 6, 6, device=DEV)

    def fn(xb):
        return nf.group_norm(_layout(xb, layout), groups, w, b, backend="triton")

    sample_alone_and_in_batches(fn, sample, ((2, 0), (5, 3)))
    assert _ran(onchip[0]) and not _ran(onchip[1])


def test_onchip_weight_gradients_are_deterministic(onchip):
    g = torch.Generator().manual_seed(8)
    for layout in ("nchw", "cl"):
        x = _layout(torch.randn(3, 8, 3, 5, generator=g).to(DEV), layout)
        w = torch.randn(8, generator=g).to(DEV).requires_grad_()
        b = torch.randn(8, generator=g).to(DEV).requires_grad_()
        dy = torch.randn(3, 8, 3, 5, generator=g).to(DEV)
        first, second = (torch.autograd.grad(variants.group_norm(x, 4, w, b), (w, b), dy) for _ in range(2))
        assert all(torch.equal(a, e) for a, e in zip(first, second))


def test_onchip_group_too_large_for_the_tile_runs_the_default_kernels(onchip, monkeypatch):
    spies, tiled = onchip
    monkeypatch.setattr(KC, "GROUPS_ONCHIP_MAX", 16)  # a group of 2 x 12 positions: 2 x 16 = 32 > 16
    g = torch.Generator().manual_seed(9)
    x = torch.randn(2, 4, 3, 4, generator=g).to(DEV).requires_grad_()
    y = nf.group_norm(x, 2, backend="triton")
    torch.testing.assert_close(y, F.group_norm(x, 2), atol=1e-5, rtol=1e-5)
    torch.autograd.grad(y.sum(), x)
    assert not _ran(spies) and _ran(tiled)
    assert not GO.fits(x, 2) and GO.fits(x, 4)


def test_onchip_op_registrations_compile_and_double_backward(onchip):
    x = torch.randn(2, 4, 3, device=DEV, requires_grad=True)
    w, b = torch.randn(4, device=DEV, requires_grad=True), torch.randn(4, device=DEV, requires_grad=True)
    torch.library.opcheck(
        torch.ops.normscope.groups_onchip_fwd.default, (x, w, b, 2, 1e-5, True),
        test_utils=("test_schema", "test_faketensor", "test_autograd_registration"),
    )  # fmt: skip
    xc = torch.randn(2, 4, 3, 2, device=DEV).contiguous(memory_format=torch.channels_last).requires_grad_()
    torch.library.opcheck(  # the fake's strides: channels_last kept
        torch.ops.normscope.groups_onchip_fwd.default, (xc, w, b, 2, 1e-5, True), test_utils=("test_faketensor",)
    )
    f = torch.compile(
        lambda x, w, b: variants.group_norm(x, 2, w, b).square().sum(), fullgraph=True, backend="aot_eager"
    )
    out = f(x, w, b)
    want = F.group_norm(x, 2, w, b).square().sum()
    torch.testing.assert_close(out, want, atol=1e-4, rtol=1e-5)
    for a, e in zip(torch.autograd.grad(out, (x, w, b)), torch.autograd.grad(want, (x, w, b))):
        torch.testing.assert_close(a, e, atol=1e-4, rtol=1e-4)
    y = variants.group_norm(x, 2, w, b)
    (gx,) = torch.autograd.grad(y.pow(3).sum(), x, create_graph=True)
    got = torch.autograd.grad(gx.square().sum(), (x, w))
    x64, w64, b64 = (t.detach().double().requires_grad_() for t in (x, w, b))
    (g64,) = torch.autograd.grad(F.group_norm(x64, 2, w64, b64).pow(3).sum(), x64, create_graph=True)
    for a, e in zip(got, torch.autograd.grad(g64.square().sum(), (x64, w64))):
        torch.testing.assert_close(a.double(), e.double(), atol=1e-3, rtol=1e-3)


# ---------------------------------------------------------------------------------------------
# off by default: who chooses a variant


def test_candidates_are_off_without_a_pin_or_a_table_row(monkeypatch):
    """No pin, no measured row (none is committed for any variant): the automatic choice and a forced
    use_backend("triton") both run the default kernels."""
    split_spies, onchip_spies = _spy(monkeypatch, CS, SPLIT_KERNELS), _spy(monkeypatch, GO, ONCHIP_KERNELS)
    assert KC.CHANNELS_VARIANT is None and KC.GROUPS_VARIANT is None and KC.ROWS_VARIANT is None
    x = torch.randn(2, 4, 3, 3, device=DEV, requires_grad=True)
    with normscope.use_backend("triton"):
        ys = [nf.batch_norm(x, None, None, training=True), nf.group_norm(x, 2), nf.instance_norm(x)]
        ys.append(nf.normalize(x, keep=1, mask=torch.rand(2, 1, 3, 3, device=DEV) > 0.3))
    torch.autograd.grad(sum(y.sum() for y in ys), x)
    assert not _ran(split_spies) and not _ran(onchip_spies)
    for f in (measured.resources.files(measured.__package__) / "measured").iterdir():
        if f.name.endswith(".json"):
            assert all("variant" not in c for c in json.loads(f.read_text())["choices"]), f.name


def test_a_table_row_names_a_variant_and_a_pin_overrides_it(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setitem(measured._TABLES, "cpu", (
        measured.Choice("batch_norm", "float32", 64, 4096, "split"),
        measured.Choice("batch_norm", "float32", 8192, 8192),
        measured.Choice("group_norm", "bfloat16", 1, 100, "onchip"),
    ))  # fmt: skip
    assert measured.variant("batch_norm", torch.float32, 64, cpu) == "split"
    assert measured.variant("batch_norm", torch.float32, 8192, cpu) is None  # the default kernel, chosen by measurement
    assert measured.variant("batch_norm", torch.float32, 5000, cpu) is None  # no row: nothing extrapolated
    assert measured.variant("batch_norm", torch.bfloat16, 64, cpu) is None
    assert measured.variant("group_norm", torch.bfloat16, 100, cpu) == "onchip"
    assert variants.resolve("channels", "split") == "split" and variants.resolve("channels") == "tiled"
    # one order for every family: a block's use_variant, then the process-wide pin, then the table, then the default
    for family, (default, candidate) in variants.FAMILIES.items():
        assert variants.resolve(family) == default and variants.resolve(family, candidate) == candidate
        monkeypatch.setattr(KC, variants.KNOBS[family], default)
        assert variants.resolve(family, candidate) == default  # the pin beats the table
        with variants.use_variant(family, candidate):
            assert variants.resolve(family) == candidate  # the block beats the pin
            with variants.use_variant(family, None):
                assert variants.resolve(family, candidate) == default  # lifted: the pin again
        monkeypatch.setattr(KC, variants.KNOBS[family], None)
    with variants.use_variant("channels", "tiled"):
        assert variants.resolve("channels", "split") == "tiled"  # the bench measures what a case names
    monkeypatch.setattr(KC, "GROUPS_VARIANT", "fast")
    with pytest.raises(ValueError, match="GROUPS_VARIANT: expected one of"):
        variants.resolve("groups")
    with pytest.raises(ValueError, match=r"use_variant: expected one of \('tiled', 'onchip'\) or None for 'groups'"):
        with variants.use_variant("groups", "split"):
            pass
    # the Triton backend hands the table's variant to the kernels (no committed table names one, and none is
    # committed off CUDA)
    from normscope.backends import triton as tb

    x = torch.randn(3, 4, 5, device=DEV)
    call = normscope.engine.Call(x, normscope.Scope.batch(1).resolve(x.shape), None, None, 1e-5, None, None)
    assert tb._table_variant(call) is None  # no committed row names a variant; off CUDA there is no table
    spies = _spy(monkeypatch, CS, SPLIT_KERNELS)
    monkeypatch.setattr(tb, "_table_variant", lambda call: "split")
    _registry.clear_plans()
    try:
        y = nf.batch_norm(x, None, None, training=True, backend="triton")
    finally:
        _registry.clear_plans()
    assert _ran(spies) and normscope.last_backend() == "triton"
    torch.testing.assert_close(y, F.batch_norm(x, None, None, training=True), atol=1e-5, rtol=1e-5)


def test_measured_table_validates_variant_names(tmp_path):
    def table(choices):
        p = tmp_path / "cuda-sm90.json"
        p.write_text(json.dumps({"schema": 1, "device_class": "cuda-sm90", "choices": choices}))
        return p

    row = {"op": "batch_norm", "dtype": "float32", "n_min": 1, "n_max": 2}
    assert measured.load(table([{**row, "variant": "split"}])) == (
        measured.Choice("batch_norm", "float32", 1, 2, "split"),
    )
    with pytest.raises(ValueError, match="unknown variant 'onchip' for batch_norm"):
        measured.load(table([{**row, "variant": "onchip"}]))
    with pytest.raises(ValueError, match="unknown variant"):
        measured.load(table([{**row, "op": "layer_norm", "variant": "split"}]))


# ---------------------------------------------------------------------------------------------
# CUDA only: realistic sizes, more than 2^31 elements, batch invariance at the bench's sizes


@cuda_only
@pytest.mark.parametrize("case", ["nchw", "cl", "bsd", "nc"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_batch_norm_at_realistic_sizes(split, case, dtype):
    shape = {"nchw": (32, 64, 28, 28), "cl": (16, 64, 28, 28), "bsd": (16, 512, 768), "nc": (4096, 512)}[case]
    d = 2 if case == "bsd" else 1
    g = torch.Generator().manual_seed(sum(shape))
    c = shape[d]
    x = _layout((torch.randn(shape, generator=g) * 2 + 3).to(DEV, dtype), "cl" if case == "cl" else "").requires_grad_()
    w = (torch.rand(c, generator=g) + 0.5).to(DEV).requires_grad_()
    b = torch.randn(c, generator=g).to(DEV).requires_grad_()
    dy = torch.randn(shape, generator=g).to(DEV, dtype)
    if case == "bsd":  # masked BatchNorm1d over the features of padded sequences
        lengths = torch.randint(shape[1] // 8, shape[1] + 1, (shape[0],), generator=g)
        mask = (torch.arange(shape[1])[None, :] < lengths[:, None]).to(DEV)
        y = nf.normalize(x, keep=-1, weight=w, bias=b, affine_dims=-1, mask=mask[..., None], backend="triton")
        y64 = _masked_bn64(x, w, b, mask, 2)
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        for i, (got, want) in enumerate(
            zip((y, *_grads(y, (x, w, b), dy)), (y64, *_grads(y64, (x, w, b), dy.double())))
        ):
            err, scale = (got.double() - want).abs().max().item(), want.abs().max().item()
            assert err <= tol * (1 + scale), f"masked BatchNorm {dtype} output {i}: error {err:.3g}"
        return
    rm, rv = torch.zeros(c, device=DEV), torch.ones(c, device=DEV)
    rm_t, rv_t = rm.clone(), rv.clone()
    y_k = nf.batch_norm(x, rm, rv, w, b, True, 0.1, 1e-5, backend="triton")
    y_t = F.batch_norm(x, rm_t, rv_t, w, b, True, 0.1, 1e-5)
    y64 = F.batch_norm(x.double(), None, None, w.double(), b.double(), True, 0.1, 1e-5)
    torch.testing.assert_close(rm, rm_t, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(rv, rv_t, atol=1e-5, rtol=1e-4)
    ours = (y_k, *_grads(y_k, (x, w, b), dy))
    theirs = (y_t, *_grads(y_t, (x, w, b), dy))
    want = (y64, *_grads(y64, (x, w, b), dy.double()))
    _within_twice_torch(ours, theirs, want, dtype, f"split BatchNorm {shape} {dtype} {case}")


@cuda_only
@pytest.mark.parametrize("shape,groups", [((8, 64, 32, 32), 64), ((8, 256, 28, 28), 32), ((4, 96, 17, 13), 8)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["nchw", "cl"])
def test_onchip_at_realistic_sizes(onchip, shape, groups, dtype, layout):
    g = torch.Generator().manual_seed(sum(shape))
    x = _layout((torch.randn(shape, generator=g) * 3 + 1).to(DEV, dtype), layout).requires_grad_()
    w = (torch.rand(shape[1], generator=g) + 0.5).to(DEV, dtype).requires_grad_()
    b = torch.randn(shape[1], generator=g).to(DEV, dtype).requires_grad_()
    dy = torch.randn(shape, generator=g).to(DEV, dtype)
    y_k = nf.group_norm(x, groups, w, b, 1e-5, backend="triton")
    y_t = F.group_norm(x, groups, w, b, 1e-5)
    y64 = _group64(x, groups, w, b, True)
    ours = (y_k, *_grads(y_k, (x, w, b), dy))
    theirs = (y_t, *_grads(y_t, (x, w, b), dy))
    want = (y64, *_grads(y64, (x, w, b), dy.double()))
    _within_twice_torch(ours, theirs, want, dtype, f"on-chip GroupNorm({groups}) {shape} {dtype} {layout}")
    assert _ran(onchip[0]) and not _ran(onchip[1])


@cuda_only
@pytest.mark.parametrize("kind", ["split_rows", "split_cols", "onchip_nchw", "onchip_cl"])
def test_candidates_past_2_31_elements(split, onchip, kind):
    """Offsets past 2**31 elements (bf16, 4.3 GB): an int32 index would wrap around."""
    if torch.cuda.get_device_properties(DEV).total_memory < (40 << 30):
        pytest.skip("needs a GPU with at least 40 GB")
    torch.manual_seed(18)
    big = 2**31
    with torch.no_grad():
        if kind.startswith("split"):
            if kind == "split_rows":
                x = torch.randn(16, 2, big // 32 + 7, device=DEV, dtype=torch.bfloat16)
            else:  # channels_last: channels innermost, (N*H*W, C) read in place
                x = torch.randn(2, 64, 8192, big // (2 * 64 * 8192) + 1, device=DEV, dtype=torch.bfloat16)
                x = x.contiguous(memory_format=torch.channels_last)
            y, mean, var, _ = variants.batch_norm(x, 1, None, None, 1e-5)
            for c in (0, x.shape[1] - 1):
                xc = x[:, c]
                m64 = xc.sum(dtype=torch.float64) / xc.numel()
                v64 = sum(((row.double() - m64) ** 2).sum() for row in xc) / xc.numel()
                torch.testing.assert_close(mean[c].double(), m64, atol=1e-4, rtol=0)
                torch.testing.assert_close(var[c].double(), v64, atol=0, rtol=1e-4)
                tail = xc[-1].reshape(-1)[-1000:].double()
                want = (tail - m64) / torch.sqrt(v64 + 1e-5)
                torch.testing.assert_close(y[-1, c].reshape(-1)[-1000:].double(), want, atol=2e-2, rtol=1e-2)
        else:  # InstanceNorm: many small groups, the last ones past element 2**31
            x = torch.randn(16, big // (16 * 4096) + 8, 64, 64, device=DEV, dtype=torch.bfloat16)
            if kind == "onchip_cl":
                x = x.contiguous(memory_format=torch.channels_last)
            y = variants.group_norm(x, x.shape[1], None, None, 1e-5)
            for n, c in ((0, 0), (15, x.shape[1] - 1)):
                want = F.group_norm(x[n : n + 1, c : c + 1].double(), 1, eps=1e-5)
                torch.testing.assert_close(y[n : n + 1, c : c + 1].double(), want, atol=2e-2, rtol=1e-2)
    del x, y
    torch.cuda.empty_cache()


@cuda_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["nchw", "cl"])
@pytest.mark.parametrize("op", ["group_norm_small", "instance_norm"])
def test_onchip_is_batch_invariant_at_bench_sizes(onchip, op, layout, dtype):
    """The bench's on-chip samples -- InstanceNorm on (256, 56, 56), GroupNorm(32) on (256, 28, 28) --
    alone and in batches of 2, 7 and 32, output and input gradient bitwise."""
    g = torch.Generator().manual_seed(5)
    c, hw = 256, (28 if op == "group_norm_small" else 56)
    w, b = (torch.rand(c, generator=g) + 0.5).to(DEV, dtype), torch.randn(c, generator=g).to(DEV, dtype)
    sample = (torch.randn(c, hw, hw, generator=g) * 2 + 1).to(DEV, dtype)

    def fn(xb):
        xb = _layout(xb, layout)
        if op == "group_norm_small":
            return nf.group_norm(xb, 32, w, b, backend="triton")
        return nf.instance_norm(xb, weight=w, bias=b, backend="triton")

    sample_alone_and_in_batches(fn, sample, ((2, 1), (7, 3), (32, 31)))
    assert _ran(onchip[0]) and not _ran(onchip[1])
