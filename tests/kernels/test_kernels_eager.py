"""The kernels' eager path and their torch.library custom ops are one function: in eager mode every
kernel op runs through a plain ``torch.autograd.Function`` (kernels/_eager.py: the custom op's
dispatch cost more CPU time than an H100 needed for the kernels), under torch.compile through the
custom op. Both call the same launches; here each op's output and every gradient are bitwise equal
on the two paths (the custom op forced in eager mode), eager mode never enters the custom ops, and
double backward still works. In Triton's interpreter on CPU, or compiled with NORMSCOPE_TEST_DEVICE=cuda."""

from __future__ import annotations

import pytest
import torch

from conftest import TEST_DEVICE

pytest.importorskip("triton", reason="the kernel tests need Triton (pip install 'normscope[kernels]')")

from normscope import functional as nf  # noqa: E402
from normscope import functional_modern as FM  # noqa: E402
from normscope.kernels import _eager  # noqa: E402
from normscope.kernels import channels as CH  # noqa: E402
from normscope.kernels import groups as G  # noqa: E402
from normscope.kernels import modern as MK  # noqa: E402
from normscope.kernels import rows as R  # noqa: E402

DEV = torch.device(TEST_DEVICE)
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def _cases():
    """name -> (fn(*leaves) on the forced Triton backend, leaves)."""
    g = torch.Generator().manual_seed(0)

    def r(*shape):
        return torch.randn(shape, generator=g)

    n = 24
    rm, rv = torch.zeros(6, device=DEV), torch.ones(6, device=DEV)
    mask = (torch.arange(5)[None, :] < torch.tensor([[5], [2], [3]]))[..., None].to(DEV)
    return {
        "layer_norm": (lambda x, w, b: nf.layer_norm(x, (n,), w, b, backend="triton"), (r(5, n), r(n), r(n))),
        "rms_norm": (lambda x, w: nf.rms_norm(x, (n,), w, backend="triton"), (r(5, n), r(n))),
        "fused_add_rms_norm": (
            lambda x, res, w: nf.fused_add_rms_norm(x, res, w, backend="triton"),
            (r(5, n), r(5, n), r(n)),
        ),
        "group_norm": (lambda x, w, b: nf.group_norm(x, 3, w, b, backend="triton"), (r(2, 6, 4, 5), r(6), r(6))),
        "group_norm_channels_last": (
            lambda x, w, b: nf.group_norm(x.contiguous(memory_format=torch.channels_last), 3, w, b, backend="triton"),
            (r(2, 6, 4, 5), r(6), r(6)),
        ),
        "batch_norm": (
            lambda x, w, b: nf.batch_norm(x, rm.clone(), rv.clone(), w, b, True, backend="triton"),
            (r(3, 6, 4), r(6), r(6)),
        ),
        "masked_batch_norm": (
            lambda x, w, b: nf.normalize(x, keep=-1, weight=w, bias=b, affine_dims=-1, mask=mask, backend="triton"),
            (r(3, 5, 8), r(8), r(8)),
        ),
        "modulated_norm": (
            lambda x, sh, sc, w, b: FM.modulated_norm(x, sh, sc, w, b, norm="layer", backend="triton"),
            (r(2, 3, n), r(2, n), r(2, n), r(n), r(n)),
        ),
        "qk_norm": (lambda q, k, w: FM.qk_norm(q, k, w, backend="triton"), (r(2, 3, 4, 16), r(2, 3, 2, 16), r(16))),
        "poly_norm": (lambda x, w, b: FM.poly_norm(x, w, b, backend="triton"), (r(5, n), r(3), r(1))),
        "derf": (
            lambda x, a, s, w, b: FM.derf(x, a, s, w, b, backend="triton"),
            (r(5, n), r(1), r(1), r(n), r(n)),
        ),
    }


CASES = _cases()


def _run(name):
    fn, inputs = CASES[name]
    leaves = [t.to(DEV).requires_grad_() for t in inputs]
    outs = fn(*leaves)
    outs = outs if isinstance(outs, tuple) else (outs,)
    g = torch.Generator().manual_seed(1)
    cots = [torch.randn(o.shape, generator=g).to(DEV, o.dtype) for o in outs]
    return outs, torch.autograd.grad(outs, leaves, cots, allow_unused=True)


@pytest.mark.parametrize("name", CASES)
def test_eager_path_and_custom_op_are_bitwise_equal(name, monkeypatch):
    eager_outs, eager_grads = _run(name)
    monkeypatch.setattr(_eager, "traced", lambda args: True)  # the custom ops, as torch.compile sees them
    op_outs, op_grads = _run(name)
    for i, (a, b) in enumerate(zip(eager_outs, op_outs)):
        assert torch.equal(a, b), f"{name}: output {i} differs between the eager path and the custom op"
    for i, (a, b) in enumerate(zip(eager_grads, op_grads)):
        assert (a is None) == (b is None), f"{name}: gradient {i} present on one path only"
        assert a is None or torch.equal(a, b), f"{name}: gradient {i} differs between the eager path and the custom op"


def _refuse(*args, **kwargs):
    raise AssertionError("eager mode entered a custom op")


@pytest.mark.parametrize("name", CASES)
def test_eager_mode_does_not_dispatch_the_custom_ops(name, monkeypatch):
    for module, ops in (
        (R, ("rows_fwd", "rows_bwd")),
        (G, ("groups_fwd", "groups_bwd")),
        (CH, ("channels_fwd", "channels_bwd")),
        (MK, ("modulated_fwd", "modulated_bwd", "qk_fwd", "rows_bwd", "poly_fwd", "poly_bwd", "derf_fwd", "derf_bwd")),
    ):
        for op in ops:
            monkeypatch.setattr(module, op, _refuse)
    outs, grads = _run(name)
    assert all(torch.isfinite(o).all() for o in outs)
    assert any(gr is not None for gr in grads)


def test_no_grad_calls_skip_autograd_and_double_backward_matches_float64():
    x = torch.randn(4, 16, device=DEV, requires_grad=True)
    w = torch.rand(16, device=DEV, requires_grad=True)
    with torch.no_grad():
        y = nf.rms_norm(x, (16,), w, backend="triton")
    assert y.grad_fn is None
    y = nf.rms_norm(x, (16,), w, backend="triton")
    (gx,) = torch.autograd.grad(y.square().sum(), x, create_graph=True)
    (ggx,) = torch.autograd.grad(gx.sum(), x)
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double()
    y64 = torch.nn.functional.rms_norm(x64, (16,), w64)
    (g64,) = torch.autograd.grad(y64.square().sum(), x64, create_graph=True)
    (gg64,) = torch.autograd.grad(g64.sum(), x64)
    torch.testing.assert_close(gx.double(), g64, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(ggx.double(), gg64, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("name", CASES)
def test_traces_record_the_custom_ops_not_the_launch(name):
    """A trace (make_fx with fake tensors, as AOTAutograd traces a compiled backward outside dynamo,
    where ``torch.compiler.is_compiling()`` is False) must record the custom ops: launching a kernel on
    fake tensors fails ("Cannot access data pointer"), as it did on an H100 under torch 2.11."""
    from torch.fx.experimental.proxy_tensor import make_fx

    fn, inputs = CASES[name]

    def fwd_bwd(*leaves):
        outs = fn(*leaves)
        outs = outs if isinstance(outs, tuple) else (outs,)
        live = [t for t in leaves if t.requires_grad]
        return torch.autograd.grad(sum(o.float().sum() for o in outs), live, allow_unused=True)

    leaves = [t.to(DEV).requires_grad_() for t in inputs]
    graph = make_fx(fwd_bwd, tracing_mode="fake", _allow_non_fake_inputs=True)(*leaves).graph  # BN closes over buffers
    ops = {str(n.target) for n in graph.nodes if n.op == "call_function" and "normscope" in str(n.target)}
    assert any("fwd" in op for op in ops) and any("bwd" in op for op in ops), f"{name}: traced ops {sorted(ops)}"
