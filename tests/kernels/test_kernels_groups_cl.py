"""The channels_last GroupNorm / InstanceNorm kernels, on CPU in Triton's interpreter (or compiled on a GPU).

On CPU the kernels run in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1 for this folder).
Shapes are tiny: the interpreter is slow. ``NORMSCOPE_TEST_DEVICE=cuda`` (see tests/conftest.py) runs
the same tests on the compiled kernels: numbers are drawn on the CPU, then moved, and the expected
output layout is what torch's CPU ``group_norm`` gives (torch's CUDA one may differ).
The oracle is float64 PyTorch (``F.group_norm`` on ``x.double()``, the RMS variant written out);
low-precision dtypes follow flash-attention's rule: the kernel's error against float64 is at most
twice the same-dtype PyTorch error plus a small atol. Every numeric test also checks, through a spy
on the kernels, that the channels_last kernels ran and the NCHW ones did not.
"""

import inspect

import pytest
import torch
import torch.nn.functional as F

from conftest import TEST_DEVICE

pytest.importorskip("triton", reason="the kernel tests need Triton (pip install 'normscope[kernels]')")

#: where every test's tensors live (see conftest.py)
DEV = torch.device(TEST_DEVICE)

import normscope  # noqa: E402
from normscope import functional as nf  # noqa: E402
from normscope.kernels import config as KC  # noqa: E402
from normscope.kernels import groups as G  # noqa: E402

# eps=0 and masked padding lanes make numpy warn inside the interpreter (never stored)
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

CL_KERNELS = ("_groups_cl_stats_kernel", "_groups_cl_apply_kernel", "_groups_cl_bwd_sums_kernel",
              "_groups_cl_bwd_dx_kernel")  # fmt: skip
NCHW_KERNELS = ("_groups_fwd_kernel", "_groups_bwd_kernel")
CL = {4: torch.channels_last, 5: torch.channels_last_3d}
_REAL = {name: getattr(G, name) for name in CL_KERNELS + NCHW_KERNELS}


class _Spy:
    """Stands in for a kernel: records each launch's grid and arguments, then runs the kernel."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append((grid, args, kwargs))
            return self.kernel[grid](*args, **kwargs)

        return launch


class _Forbidden:
    def __getitem__(self, grid):
        raise AssertionError("the NCHW kernel ran on a channels_last input")


@pytest.fixture(autouse=True)
def spies(monkeypatch):
    """Every test: the channels_last kernels are spied on, the NCHW kernels may not run."""
    out = {}
    for name in CL_KERNELS:
        out[name] = _Spy(_REAL[name])
        monkeypatch.setattr(G, name, out[name])
    for name in NCHW_KERNELS:
        monkeypatch.setattr(G, name, _Forbidden())
    return out


def _ran(spies, backward=True):
    names = CL_KERNELS if backward else CL_KERNELS[:2]
    return all(spies[n].launches for n in names)


@pytest.fixture(params=["default", "tiles"])
def tiles(request, monkeypatch):
    """Default knobs (small inputs: one tile, one split), and tiny tiles: a group block of 2 groups
    (1-channel InstanceNorm: 4), tiles of 2 positions, a 6-channel group walked in 2 channel blocks,
    and the positions cut into 2-6 splits so that the second (combining) stage has work."""
    if request.param == "tiles":
        _tiny_tiles(monkeypatch)
    return request.param


def _tiny_tiles(monkeypatch):
    knobs = (("GROUPS_CL_TILE", 8), ("GROUPS_CL_WIDTH", 4), ("GROUPS_CL_PROGRAMS", 12), ("GROUPS_CL_MIN_SPLIT", 1))
    for name, value in knobs:
        monkeypatch.setattr(KC, name, value)


def test_tiny_tiles_really_loop(tiles):
    """The "tiles" knobs make every loop of the kernels run more than once on the shapes below."""
    bs, bg, bc, _, chunk, splits = G._cl_config(3, 2, 35)  # (2, 6, 7, 5), G = 3
    if tiles == "default":
        assert (bg, bc, splits) == (4, 2, 1) and chunk >= 35  # one program per sample: a masked group lane
        return
    assert bg == 2 and bc == 2 and chunk > bs and splits > 1  # group block of 2 of 3 groups: masked lane
    bs, bg, bc, _, chunk, splits = G._cl_config(1, 6, 35)  # G = 1: a 6-channel group in 4-channel blocks
    assert bg == 1 and bc == 4 and chunk > bs and splits > 1
    bs, bg, bc, _, chunk, splits = G._cl_config(6, 1, 35)  # G = C: InstanceNorm
    assert bg == 4 and bc == 1 and chunk > bs and splits > 1


def _cl(t):
    return t.to(DEV).contiguous(memory_format=CL[t.dim()])


def _group64(x, groups, w, b, centered, eps=1e-5):
    """float64 oracle: torch's group_norm, or the RMS variant written out."""
    x, w, b = (t.double() if t is not None else None for t in (x, w, b))
    if centered:
        return F.group_norm(x, groups, w, b, eps)
    return _rms(x, groups, w, b, eps)


def _rms(x, groups, w, b, eps=1e-5):
    xg = x.reshape(x.shape[0], groups, -1)
    y = (xg * torch.rsqrt(xg.square().mean(-1, keepdim=True) + eps)).reshape(x.shape)
    shape = [1, x.shape[1]] + [1] * (x.dim() - 2)
    y = y * w.reshape(shape) if w is not None else y
    return y + b.reshape(shape) if b is not None else y


def _grads(outputs, inputs, cotangents):
    inputs = [t for t in inputs if t is not None]
    return torch.autograd.grad(outputs, inputs, cotangents)


def _inputs(shape, seed, dtype=torch.float32, affine="wb", offset=5.0):
    g = torch.Generator().manual_seed(seed)
    x = _cl((torch.randn(shape, generator=g) * 2 + offset).to(dtype)).requires_grad_()
    c = shape[1]
    w = (torch.rand(c, generator=g) + 0.5).to(DEV, dtype).requires_grad_() if "w" in affine else None
    b = torch.randn(c, generator=g).to(DEV, dtype).requires_grad_() if "b" in affine else None
    dy = _cl(torch.randn(shape, generator=g).to(dtype))
    return x, w, b, dy


SHAPES = [((2, 6, 7, 5), 3), ((2, 6, 7, 5), 1), ((2, 6, 7, 5), 6), ((2, 4, 3, 2, 3), 2)]  # G=1, G=C, 5-D


@pytest.mark.parametrize("shape,groups", SHAPES, ids=["G3", "G1", "GC", "5d"])
@pytest.mark.parametrize("centered,affine", [(True, "wb"), (True, ""), (False, "w"), (True, "b"), (False, "wb")])
def test_forward_and_every_gradient_match_float64(spies, shape, groups, centered, affine):
    x, w, b, dy = _inputs(shape, sum(shape) + len(affine))
    y = G.group_norm(x, groups, w, b, 1e-5, centered)
    assert y.is_contiguous(memory_format=CL[len(shape)]) and not y.is_contiguous()
    y64 = _group64(x, groups, w, b, centered)
    torch.testing.assert_close(y.double(), y64, atol=2e-5, rtol=1e-5)
    got = _grads(y, (x, w, b), dy)
    want = _grads(y64, (x, w, b), dy.double())
    assert got[0].is_contiguous(memory_format=CL[len(shape)])  # dx in x's layout
    for a, e in zip(got, want):
        torch.testing.assert_close(a.double(), e.double(), atol=5e-5, rtol=1e-4)
    assert _ran(spies)


@pytest.mark.parametrize("shape,groups", SHAPES[:3], ids=["G3", "G1", "GC"])
@pytest.mark.parametrize("centered,affine", [(True, "wb"), (False, "w")])
def test_many_tiles_and_splits_match_float64(spies, monkeypatch, shape, groups, centered, affine):
    _tiny_tiles(monkeypatch)  # the default knobs: the test above
    x, w, b, dy = _inputs(shape, 3 * groups)
    y = G.group_norm(x, groups, w, b, 1e-5, centered)
    y64 = _group64(x, groups, w, b, centered)
    torch.testing.assert_close(y.double(), y64, atol=2e-5, rtol=1e-5)
    for a, e in zip(_grads(y, (x, w, b), dy), _grads(y64, (x, w, b), dy.double())):
        torch.testing.assert_close(a.double(), e.double(), atol=5e-5, rtol=1e-4)
    assert spies[CL_KERNELS[0]].launches[0][0][1] > 1  # the grid is (sample x group blocks, splits > 1)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("centered", [True, False])
def test_low_precision_error_at_most_twice_torch(spies, dtype, centered):
    shape, groups = (2, 6, 7, 5), 3
    x, w, b, dy = _inputs(shape, 7, dtype, offset=1.0)
    y_k = G.group_norm(x, groups, w, b, 1e-5, centered)
    y_t = F.group_norm(x, groups, w, b, 1e-5) if centered else _rms(x, groups, w, b)  # same dtype
    y64 = _group64(x, groups, w, b, centered)
    atol = {torch.float16: 1e-3, torch.bfloat16: 1e-2, torch.float32: 1e-5}[dtype]
    triples = zip((y_k, *_grads(y_k, (x, w, b), dy)), (y_t, *_grads(y_t, (x, w, b), dy)),
                  (y64, *_grads(y64, (x, w, b), dy.double())))  # fmt: skip
    for what, (got, torch_, want) in zip(("y", "dx", "dw", "db"), triples):
        assert got.dtype == dtype
        err_k = (got.double() - want).abs().max().item()
        err_t = (torch_.double() - want).abs().max().item()
        assert err_k <= 2 * err_t + atol * want.abs().max().item() + atol, (what, err_k, err_t)
    assert _ran(spies)


def test_large_offset_normalizes_to_unit_variance(spies, tiles):
    # mean 1e4, std 1e-2 in fp32: E[x^2] - E[x]^2 (or x * rstd - mean * rstd) would lose every digit;
    # torch's CPU channels_last group_norm gives NaN or ~1e-4 here with eps=0
    g = torch.Generator().manual_seed(3)
    x = _cl(1e4 + 1e-2 * torch.randn(2, 6, 7, 5, generator=g))
    y, mean, rstd = torch.ops.normscope.groups_fwd(x, None, None, 3, 0.0, True)
    var = y.double().reshape(2, 3, -1).var(-1, unbiased=False)
    torch.testing.assert_close(var, torch.ones_like(var), atol=1e-3, rtol=0)
    x64 = x.double().reshape(2 * 3, -1)
    torch.testing.assert_close(mean.double(), x64.mean(-1), atol=1e-3, rtol=0)
    torch.testing.assert_close(rstd.double(), x64.var(-1, unbiased=False).rsqrt(), rtol=1e-3, atol=0)
    assert _ran(spies, backward=False)


@pytest.mark.parametrize("centered", [True, False])
def test_saved_statistics_are_the_nchw_ops(spies, tiles, centered):
    """fp32 mean/rstd per (sample, group), in the layout the NCHW op saves them."""
    x, w, b, _ = _inputs((2, 6, 7, 5), 11)
    y, mean, rstd = torch.ops.normscope.groups_fwd(x.detach(), w.detach(), b.detach(), 3, 1e-5, centered)
    assert mean.dtype == rstd.dtype == torch.float32 and mean.shape == rstd.shape == (6,)
    x64 = x.detach().double().reshape(6, -1)
    want_mean = x64.mean(-1) if centered else torch.zeros(6, dtype=torch.float64, device=DEV)
    want_var = x64.var(-1, unbiased=False) if centered else x64.square().mean(-1)
    torch.testing.assert_close(mean.double(), want_mean, atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(rstd.double(), (want_var + 1e-5).rsqrt(), atol=0, rtol=1e-5)
    assert _ran(spies, backward=False)


def _cpu_leaf(t):
    """t's values and strides on the CPU, as a new leaf: torch's CPU group_norm is the layout oracle."""
    return t.detach().cpu().requires_grad_(t.requires_grad)


def test_output_layout_matches_torch_group_norm(spies):
    g = torch.Generator().manual_seed(5)
    cases = [(2, 6, 7, 5), (1, 6, 7, 5), (2, 6, 1, 5), (2, 4, 3, 2, 3)]
    for shape in cases:
        x = _cl(torch.randn(shape, generator=g)).requires_grad_()
        w = torch.randn(shape[1], generator=g).to(DEV).requires_grad_()
        dy = _cl(torch.randn(shape, generator=g))
        x_t, w_t = _cpu_leaf(x), _cpu_leaf(w)
        y, y_t = G.group_norm(x, 2, w), F.group_norm(x_t, 2, w_t)
        assert y.stride() == y_t.stride(), shape
        dx, dx_t = torch.autograd.grad(y, x, dy)[0], torch.autograd.grad(y_t, x_t, dy.cpu())[0]
        assert dx.stride() == dx_t.stride(), shape
        # an incoming gradient in the other layout is accepted (copied to x's) and gives the same dx
        dx_c = torch.autograd.grad(G.group_norm(x, 2, w), x, dy.contiguous())[0]
        torch.testing.assert_close(dx_c, dx, atol=0, rtol=0)
        assert dx_c.stride() == dx_t.stride()
    assert _ran(spies)


def test_other_strides_are_copied_to_nchw_like_torch(spies, monkeypatch):
    """Strides that are neither NCHW nor channels_last: one copy, the NCHW kernel, an NCHW output."""
    nchw = _Spy(_REAL["_groups_fwd_kernel"])
    monkeypatch.setattr(G, "_groups_fwd_kernel", nchw)
    g = torch.Generator().manual_seed(6)
    swapped = torch.randn(2, 6, 5, 7, generator=g).to(DEV).transpose(2, 3)  # (2, 6, 7, 5), H and W swapped
    ncl = torch.randn(2, 7, 6, generator=g).to(DEV).transpose(1, 2)  # 3-D (N, C, L) stored as (N, L, C)
    # one sample, strides (C, 1, W*C, C): is_contiguous(channels_last) (a size-1 axis' stride is ignored),
    # but torch's layout test calls it contiguous-format (a permuted attention output in a diffusers UNet)
    one = torch.randn(7, 5, 6, generator=g).to(DEV).permute(2, 0, 1)[None]
    for x in (swapped, ncl, one):
        y, y_t = G.group_norm(x, 3), F.group_norm(x.cpu(), 3)
        assert y.is_contiguous() and y.stride() == y_t.stride()
        torch.testing.assert_close(y.cpu(), y_t, atol=1e-5, rtol=1e-5)
    assert len(nchw.launches) == 3 and not spies[CL_KERNELS[0]].launches


def test_deterministic(spies, tiles):
    """Two runs give the same bits. (The interpreter runs programs one after another, so atomics would
    pass the comparison here: the kernels' source is checked for them too.)"""
    for name in CL_KERNELS:
        assert "atomic" not in inspect.getsource(_REAL[name].fn)
    x, w, b, dy = _inputs((2, 6, 7, 5), 8)
    runs = []
    for _ in range(2):
        y = G.group_norm(x, 3, w, b)
        runs.append((y, *_grads(y, (x, w, b), dy)))
    for a, e in zip(*runs):
        assert torch.equal(a, e)
    assert _ran(spies)


@pytest.mark.parametrize("shape", [(2, 6, 7, 5), (2, 4, 3, 2, 3)], ids=["4d", "5d"])
def test_no_nchw_copy_is_made(spies, shape):
    """The kernels get the caller's own memory: x and dy as passed, y and dx as returned. A copy to
    NCHW and back (or the NCHW kernel, forbidden by the fixture) fails this."""
    x, w, b, dy = _inputs(shape, 9)
    y = G.group_norm(x, 2, w, b)
    dx = torch.autograd.grad(y, x, dy)[0]
    (_, stats, _), (_, apply, _) = spies[CL_KERNELS[0]].launches[0], spies[CL_KERNELS[1]].launches[0]
    assert stats[0].data_ptr() == x.data_ptr() and apply[0].data_ptr() == x.data_ptr()
    assert apply[3].data_ptr() == y.data_ptr()
    (_, sums, _), (_, dxk, _) = spies[CL_KERNELS[2]].launches[0], spies[CL_KERNELS[3]].launches[0]
    assert sums[0].data_ptr() == dy.data_ptr() and sums[1].data_ptr() == x.data_ptr()
    assert dxk[0].data_ptr() == dy.data_ptr() and dxk[1].data_ptr() == x.data_ptr()
    assert dxk[7].data_ptr() == dx.data_ptr()


def test_engine_runs_group_and_instance_norm_channels_last(spies):
    g = torch.Generator().manual_seed(10)
    x = _cl(torch.randn(2, 6, 4, 3, generator=g) + 3).requires_grad_()
    gn, inn = normscope.GroupNorm(3, 6), normscope.InstanceNorm2d(6, affine=True)
    with torch.no_grad():
        for p in (gn.weight, gn.bias, inn.weight, inn.bias):
            p.normal_(generator=g)
    gn, inn = gn.to(DEV), inn.to(DEV)
    with normscope.use_backend("triton"):
        y1 = gn(x)
        assert normscope.last_backend() == "triton"
        y2 = inn(x)
        assert normscope.last_backend() == "triton"
        y3 = nf.group_norm(x, 1, gn.weight, gn.bias)  # GroupNorm(1, C)
        assert normscope.last_backend() == "triton"
    # the layout torch's ops return: channels_last out of group_norm, contiguous (NCHW) out of instance_norm
    assert all(y.is_contiguous(memory_format=torch.channels_last) and not y.is_contiguous() for y in (y1, y3))
    assert y2.is_contiguous() and y2.stride() == F.instance_norm(x.detach(), weight=inn.weight, bias=inn.bias).stride()
    xd = x.double()
    ref1 = F.group_norm(xd, 3, gn.weight.double(), gn.bias.double(), gn.eps)
    ref2 = F.instance_norm(xd, weight=inn.weight.double(), bias=inn.bias.double(), eps=inn.eps)
    ref3 = F.group_norm(xd, 1, gn.weight.double(), gn.bias.double())
    for got, ref in ((y1, ref1), (y2, ref2), (y3, ref3)):
        torch.testing.assert_close(got.double(), ref, atol=2e-5, rtol=1e-5)
    params = (x, gn.weight, gn.bias, inn.weight, inn.bias)
    got = _grads(y1.sum() + y2.square().sum() + y3.pow(3).sum(), params, None)
    want = _grads(ref1.sum() + ref2.square().sum() + ref3.pow(3).sum(), params, None)
    for a, e in zip(got, want):
        torch.testing.assert_close(a.double(), e.double(), atol=1e-4, rtol=1e-4)
    assert len(spies[CL_KERNELS[0]].launches) == 3 and len(spies[CL_KERNELS[3]].launches) == 3


def test_op_registrations_report_channels_last_strides(spies):
    """opcheck's fake-tensor test compares the fake impl's strides with the real op's."""
    for shape in ((2, 4, 3, 5), (2, 4, 3, 2, 3)):
        x, w, b, dy = _inputs(shape, 12)
        torch.library.opcheck(
            torch.ops.normscope.groups_fwd.default, (x, w, b, 2, 1e-5, True),
            test_utils=("test_schema", "test_faketensor", "test_autograd_registration"),
        )  # fmt: skip
        _, mean, rstd = torch.ops.normscope.groups_fwd(x.detach(), w.detach(), b.detach(), 2, 1e-5, True)
        torch.library.opcheck(
            torch.ops.normscope.groups_bwd.default, (dy, x.detach(), w.detach(), mean, rstd, 2, True, True),
            test_utils=("test_schema", "test_faketensor"),
        )  # fmt: skip
    assert _ran(spies)


def test_compiles_without_graph_breaks(spies):
    x, w, b, dy = _inputs((2, 4, 3, 5), 13)

    def f(x, w, b):
        return G.group_norm(x, 2, w, b) * 2

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    out = compiled(x, w, b)
    eager = f(x, w, b)
    assert out.stride() == eager.stride() == F.group_norm(_cpu_leaf(x), 2, _cpu_leaf(w), _cpu_leaf(b)).stride()
    torch.testing.assert_close(out, eager)
    got = torch.autograd.grad(out, (x, w, b), dy)
    for a, e in zip(got, torch.autograd.grad(eager, (x, w, b), dy)):
        torch.testing.assert_close(a, e)
    assert got[0].stride() == x.stride()
    assert len(spies[CL_KERNELS[0]].launches) == 2 and len(spies[CL_KERNELS[3]].launches) == 2
