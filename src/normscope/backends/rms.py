"""RMSNorm over rows with one reduction each way: the composite backend's unmasked RMS scopes.

torch's ``rms_norm`` on a CPU is not one kernel: it runs as a chain of ATen ops (upcast, square,
mean, add, rsqrt, two multiplies) and autograd differentiates that chain op by op, about twenty ATen
ops in the backward. Here the same function takes one reduction each way:

* **forward**: ``r = rsqrt(||x||^2 / N + eps)`` per row from one ``vector_norm`` (a single read of
  ``x``, accumulated in fp32 -- fp64 for fp64), then ``y = x * r * w``;
* **backward** (closed form): with ``gx = dy * x``,
  ``dx = r * (dy * w) - x * r^3 / N * (gx @ w)`` and ``dw = gx^T @ r``: one elementwise product and
  two matrix-vector products for the sums, and two fused passes for ``dx``.

Numbers: the statistics are accumulated in fp32 like torch's (which upcasts fp16/bf16 input to fp32
first), the output is rounded once to the input dtype; the tests bound the difference from torch and
from a float64 computation (``tests/test_cpu_rms.py``). There is no mean, so no cancellation: a large
offset is simply a large root mean square.

Double backward: the backward above is a closed form of the first derivative. When autograd asks
for a differentiable one (``create_graph=True``) it differentiates the reference computation of the
same rows instead, so higher-order gradients are exact (as :mod:`.composite` does for masks).

Speed: measured against ``F.rms_norm`` by ``benchmarks/cpu_overhead.py`` (cases ``RMSNorm:large``,
``RMSNorm-bf16:large`` and ``RMSNorm(RxN):rows``, the sizes around the threshold);
``benchmarks/results/cpu_speed.json`` is the committed measurement that makes it the automatic
choice on CPU from :data:`MIN_AUTO_ELEMENTS` elements (see :func:`normscope.backends.aten.why_not_auto`).
Below that the per-call cost of an ``autograd.Function`` outweighs the saved passes and torch's op runs.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .. import engine
from .. import reference as ref
from ..engine import Call, Runner
from ..scope import Scope
from . import reference as reference_backend
from ._layout import channels_last, reduced_last

__all__ = ["MIN_AUTO_ELEMENTS", "takes", "prepare"]

#: Smallest input (elements) for which the automatic order picks this path on a CPU:
#: benchmarks/results/cpu_speed.json measured it faster than ``F.rms_norm`` both ways from
#: 1024 x 1024 elements up (forward 0.2-0.7x, forward+backward 0.3x), while at 256 x 1024 only the
#: forward+backward was faster (0.53x) and the forward slower (1.29x: the per-call cost).
MIN_AUTO_ELEMENTS = 1024 * 1024

_FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def takes(call: Call) -> str | None:
    """None when ``call`` is an unmasked RMS scope this path runs, else why not."""
    s = call.scope
    if s.centered or call.mask is not None or call.running is not None or call.bias is not None:
        return "not an unmasked RMS scope without bias or running statistics"
    if s.groups != 1 or not s.reduce or s.affine not in (s.reduce, ()):
        return "an RMS scope over grouped axes or with an affine over other axes"
    if call.x.dtype not in _FLOATS:
        return f"floating-point input only, got {call.x.dtype}"
    return None


def _forward(x2: Tensor, weight: Tensor | None, eps: float) -> tuple[Tensor, Tensor]:
    """``(y, r)`` for a (R, N) input: ``r = rsqrt(mean(x^2) + eps)`` per row, ``y = x * r * w``."""
    n = x2.shape[1]
    acc = ref.acc_dtype(x2.dtype)
    # one read of x: sqrt(sum x^2) in the accumulation dtype (vector_norm upcasts as it reads)
    ss = torch.linalg.vector_norm(x2, 2, -1, keepdim=True, dtype=acc)
    r = ss.square_().div_(n).add_(eps).rsqrt_()  # (R, 1)
    y = torch.mul(x2, r)  # in acc: fp32 for fp16/bf16 input, as torch's rms_norm computes
    if weight is not None:
        y.mul_(weight)  # in place: no second large allocation
    # rounded once to x's dtype (a separate cast: a product writing into a bf16 out= was ~2x slower)
    return y.to(x2.dtype), r


class _RMSRows(torch.autograd.Function):
    """``y = x * rsqrt(mean(x^2) + eps) * w`` over the rows of a (R, N) view, closed-form backward."""

    @staticmethod
    def forward(ctx, x2: Tensor, weight: Tensor | None, eps: float) -> Tensor:
        y, r = _forward(x2, weight, eps)
        ctx.save_for_backward(x2, weight, r)
        ctx.eps = eps  # for the reference recomputation of a double backward
        return y

    @staticmethod
    def backward(ctx, dy: Tensor):
        x2, weight, r = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph=True: differentiate the reference instead
            return (*_reference_grads(ctx, dy, x2, weight), None)
        n = x2.shape[1]
        acc = r.dtype
        xf, g = x2.to(acc), dy.to(acc)
        w = None if weight is None else weight.to(acc)
        gx = g * xf
        grad_x = grad_w = None
        if weight is not None and ctx.needs_input_grad[1]:
            grad_w = torch.mv(gx.t(), r.view(-1)).to(weight.dtype)  # sum over rows of dy * x * r
        if ctx.needs_input_grad[0]:
            # the row sums of dy * w * x: one matrix-vector product (one sum without weight)
            dot = gx.sum(-1, keepdim=True) if w is None else torch.mv(gx, w).unsqueeze(-1)
            del gx
            # dx = r * dy * w - x * (r^3 / N * dot): one product into a new tensor, two in place
            c = r.pow(3).mul_(dot).div_(-n)
            grad_x = torch.mul(g, r) if w is None else torch.mul(g, w).mul_(r)
            grad_x = grad_x.addcmul_(xf, c).to(x2.dtype)
        return grad_x, grad_w, None


def _reference_grads(ctx, dy: Tensor, x2: Tensor, weight: Tensor | None) -> tuple:
    """Gradients of the reference computation of the same rows, differentiable (double backward)."""
    need = [t is not None and n for t, n in zip((x2, weight), ctx.needs_input_grad[:2])]
    scope = _ROWS_AFFINE if weight is not None else _ROWS
    rows = Call(x2, scope.resolve(tuple(x2.shape)), weight, None, ctx.eps, None, None)
    y = reference_backend.run(rows)
    wanted = [t for t, n in zip((x2, weight), need) if n]
    grads = iter(torch.autograd.grad(y, wanted, dy, create_graph=True, allow_unused=True))
    return tuple(next(grads) if n else None for n in need)


_ROWS_AFFINE = Scope.rms(1)
_ROWS = Scope(reduce=(-1,), centered=False)


def prepare(call: Call) -> Runner:
    """The runner of an RMS call (``takes(call)`` is None): the reduced axes moved last (a view,
    free when they already are), the input as (rows, N), one :class:`_RMSRows`."""
    s = call.scope
    tail, moved = reduced_last(s)
    n = math.prod([s.shape[d] for d in s.reduce])

    def run(c: Call) -> Tensor:
        if engine.transformed():
            # vmap / grad transforms: an autograd.Function in the forward(ctx) style cannot run
            # inside them; the reference's plain ops can
            return engine.recompute(c)
        xm = c.x.movedim(s.reduce, tail) if moved else c.x
        # the weight spans the reduced axes in their order, which is the order they have at the end
        w = None if c.weight is None else c.weight.reshape(n)
        x2 = xm.reshape(-1, n)
        if torch.is_grad_enabled() and (x2.requires_grad or w is not None and w.requires_grad):
            y = _RMSRows.apply(x2, w, float(c.eps))
        else:  # nothing to differentiate: skip the autograd.Function's per-call cost
            y = _forward(x2, w, c.eps)[0]
        y = y.view(xm.shape)
        y = y.movedim(tail, s.reduce) if moved else y
        fmt = channels_last(c.x)
        return y if fmt is None else y.contiguous(memory_format=fmt)  # torch keeps the input's layout

    return run
