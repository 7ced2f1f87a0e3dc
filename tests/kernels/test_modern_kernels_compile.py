"""The modern norms' fused kernels under ``torch.compile(fullgraph=True)``: registered ``torch.library``
ops trace as one node each (no graph break), forward and backward equal to eager.

CPU: the kernels run in Triton's interpreter (``backend="aot_eager"``: dynamo and AOT autograd trace the
graph, eager runs it, so the numbers are the kernels' own); tiny shapes.
"""

from __future__ import annotations

import pytest
import torch

from conftest import TEST_DEVICE

pytest.importorskip("triton", reason="the kernel tests need Triton (pip install 'normscope[kernels]')")

import normscope  # noqa: E402
from normscope import functional_modern as FM  # noqa: E402
from normscope.kernels import modern as _registers_the_ops  # noqa: E402, F401  (torch.ops.normscope.* below)

DEV = torch.device(TEST_DEVICE)
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def _leaves(*shapes, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).to(DEV).requires_grad_() for s in shapes]


def _check(fn, args, op):
    """fn under torch.compile(fullgraph=True) -- a graph break raises -- is one graph holding the op
    ``normscope::<op>``, and equals eager bit for bit, forward and every gradient, with the triton
    backend forced (aot_eager runs the traced graph eagerly, so the numbers are the kernels' own)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    with normscope.use_backend("triton"):
        compiled = torch.compile(fn, fullgraph=True, backend=counter)
        out = compiled(*args)
        got = torch.autograd.grad(out, args)
        eager = fn(*args)
        want = torch.autograd.grad(eager, args)
    assert normscope.last_backend() == "triton"
    assert counter.frame_count == 1 and f"normscope.{op}" in counter.graphs[0].code
    torch.testing.assert_close(out, eager, atol=0, rtol=0)
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e, atol=0, rtol=0)


@pytest.mark.parametrize("norm, per_token", [("layer", False), ("rms", True)])
def test_modulated_norm_compiles(norm, per_token):
    mshape = (2, 3, 8) if per_token else (2, 8)
    args = _leaves((2, 3, 8), mshape, mshape, (8,), *([(8,)] if norm == "layer" else []), seed=0)
    _check(
        lambda x, sh, sc, w, *b: FM.modulated_norm(x, sh, sc, w, *b, norm=norm).square().sum(), args, "modulated_fwd"
    )


class _Counting:
    """Stands in for a jitted kernel: counts launches, then launches the real one."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, 0

    def __getitem__(self, grid):
        self.launches += 1
        return self.kernel[grid]


def test_qk_norm_compiles(monkeypatch):
    from normscope.kernels import modern as MK

    counter = _Counting(MK._qk_fwd_kernel)
    monkeypatch.setattr(MK, "_qk_fwd_kernel", counter)
    args = _leaves((1, 3, 2, 8), (1, 3, 1, 8), (8,), (8,), seed=1)
    fn = lambda q, k, wq, wk: sum(  # noqa: E731
        t.square().sum() for t in FM.qk_norm(q, k, wq, wk, weight_offset=1.0, casting="gemma")
    )
    _check(fn, args, "qk_fwd")
    assert counter.launches == 2  # q and k in one launch, compiled and eager


def test_poly_norm_compiles():
    args = _leaves((2, 3, 8), (3,), (1,), seed=2)
    _check(lambda x, w, b: FM.poly_norm(x, w, b).square().sum(), args, "poly_fwd")


@pytest.mark.parametrize("affine", [True, False])
def test_derf_compiles(affine):
    args = _leaves((2, 3, 8), (1,), (1,), *([(8,), (8,)] if affine else []), seed=3)
    _check(lambda x, a, s, *wb: FM.derf(x, a, s, *wb).square().sum(), args, "derf_fwd")


def test_modern_op_registrations():
    """Schema, fake (meta) implementation and autograd registration of every modern op, by opcheck."""
    x, sh, sc, w, b, q, k = _leaves((6, 8), (2, 8), (2, 8), (8,), (8,), (4, 8), (2, 8), seed=4)
    a, s, pw, pb = _leaves((1,), (1,), (3,), (1,), seed=5)
    ops = torch.ops.normscope
    cases = [
        (ops.modulated_fwd.default, (x, sh, sc, w, b, 1e-6, True, 3, 3)),
        (ops.modulated_fwd.default, (x, None, x, None, None, 1e-6, False, 1, 1)),
        (ops.qk_fwd.default, (q, k, w, w, b, b, 1e-6, True, 1.0)),
        (ops.poly_fwd.default, (x, pw, pb, 1e-6)),
        (ops.derf_fwd.default, (x, a, s, w, b)),
        (ops.derf_fwd.default, (x, a, s, None, None)),
    ]
    for op, args in cases:
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))
    # the backward ops, on the forward ops' saved statistics (their autograd is the reference's, not theirs)
    with torch.no_grad():
        _, mean, rstd = ops.modulated_fwd(x, sh, sc, w, b, 1e-6, True, 3, 3)
        _, prstd = ops.poly_fwd(x, pw, pb, 1e-6)
    dy = torch.randn_like(x)
    for op, args in [
        (ops.modulated_bwd.default, (dy, x, sc, w, b, mean, rstd, True, 3)),
        (ops.modulated_bwd.default, (dy, x, None, None, None, mean, rstd, False, 1)),
        (ops.poly_bwd.default, (dy, x, pw, prstd)),
        (ops.derf_bwd.default, (dy, x, a, s, w)),
        (ops.derf_bwd.default, (dy, x, a, s, None)),
    ]:
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))
