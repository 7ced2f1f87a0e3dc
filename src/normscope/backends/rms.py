"""RMSNorm over rows with one reduction each way: the rows backend's unmasked RMS scopes (:mod:`.rows`).

torch's ``rms_norm`` on a CPU is not one kernel: it runs as a chain of ATen ops (upcast, square,
mean, add, rsqrt, two multiplies) and autograd differentiates that chain op by op, about twenty ATen
ops in the backward. Here the same function takes one reduction each way:

* **forward**: ``r = rsqrt(mean(x^2) + eps)`` per row, then ``y = x * r * w``;
* **backward** (closed form): ``dx`` from elementwise products and one row reduction, ``dw`` from
  batched products (:func:`_backward`). ``dw`` sums the rows in groups of :data:`DW_GROUP_ROWS`
  (one batched product), then the groups: one long matrix-vector product added the rows one after
  another, an error growing with their number (~17x torch's at 8192 rows in fp32), the groups keep
  it at torch's for the same time.

**Torch's bits, row by row.** Every rounding step of the output and of ``dx`` is the one torch's
``rms_norm`` and autograd's differentiation of it take (the same ATen ops on the same values, in the
same order, none fused), and a row's reduction in torch depends on the row alone. So a row's output
and input gradient are torch's, bit for bit, whichever of the two paths runs -- and the automatic
choice between them, made on the input's total size (:data:`MIN_AUTO_ELEMENTS`), never makes a
sample's result depend on its batch (``tests/backends/test_batch_invariance.py``). This is also why the model
families' casting orders, whose modules compute ``x * rsqrt(x.pow(2).mean(-1) + eps)``, are exact
here at every size. What the path saves is torch's full-size temporaries and autograd's chain of
twenty-odd ops, not any rounding. ``dw`` is a sum over rows (no per-row bits to keep): it is summed
its own way, as accurate as torch's and the same from run to run.

Blocks of rows: fp16/bf16 both ways, and fp32/fp64 from :data:`BLOCKED_BYTES`,
run block by block (:data:`BLOCK_ELEMENTS` elements a block). Each block is upcast once into fp32
buffers that stay in cache, and every pass above runs over the block there; the outputs are written
(rounded once to the input dtype) block by block. Over the whole input the fp32 upcasts and
products would be full-size temporaries: several more passes over memory and, for large ones, fresh
pages from the system on every call -- measured ~10x slower for bf16, and the reason a large fp32
backward gains too. Small fp32/fp64 inputs keep the whole-input calls (fewer of them).

Numbers: the statistics are accumulated in fp32 like torch's (which upcasts fp16/bf16 input to fp32
first), the output is rounded once to the input dtype. There is no mean, so no cancellation: a large
offset is simply a large root mean square.

Double backward: the backward above is a closed form of the first derivative. When autograd asks
for a differentiable one (``create_graph=True``) it differentiates the reference computation of the
same rows instead, so higher-order gradients are exact (as :mod:`.composite` does for masks).

Speed: measured against ``F.rms_norm`` by ``benchmarks/cpu_overhead.py`` (cases ``RMSNorm:large``,
``RMSNorm-bf16:large``, ``RMSNorm(RxN):rows`` and, with this path forced, ``RMSNorm-rows(RxN)`` over
row lengths 256, 1024 and 4096). ``benchmarks/results/cpu_speed_rms_rows.json`` (one thread, a shared
2-core VM): at 8192 x 1024 the median time ratio to torch is 0.47 forward and 0.32 forward +
backward in fp32, 0.21 and 0.22 in bf16. Fwd+bwd of RMSNorm(4096) on 8192 rows grows the process by
+423 MiB (torch +806) in fp32 and +169 MiB (torch +870) in bf16 (``cpu_overhead.peak_memory``): the
output, the input gradient -- in fp32 its two terms, one full-size tensor more, see :class:`_RMSRows`
-- and ~31 MiB torch's first explicit-gradient ``backward`` spends importing sympy, for both. The
automatic choice on CPU from :data:`MIN_AUTO_ELEMENTS` elements
(:func:`normscope.backends.rows.why_not_auto`) is made on the total size because the crossover is
one of total size, whatever the row length: below it the per-call cost of an ``autograd.Function``
outweighs the saved passes (see the constant).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from .. import engine
from .. import reference as ref
from .._registry import SPLIT_ELEMENTS
from ..engine import Call, Runner
from ..scope import Scope
from . import reference as reference_backend
from ._layout import channels_last, reduced_last

__all__ = ["MIN_AUTO_ELEMENTS", "takes", "prepare"]

#: Smallest input (elements) for which the automatic order picks this path on a CPU. Measured with the
#: path forced against torch's op (``benchmarks/results/cpu_speed_rms_rows.json``, median time ratio
#: forward / forward+backward): at 65K elements it is slower at every row length (16 x 4096: 1.81 /
#: 1.11, 64 x 1024: 1.73 / 1.12, 256 x 256: 1.82 / 1.00); at 262K faster but by little forward (64 x
#: 4096: 0.97 / 0.54, 256 x 1024: 0.93 / 0.83, 1024 x 256: 0.87 / 0.90); from 1M elements faster both
#: ways at every length (256 x 4096: 0.90 / 0.60, 1024 x 1024: 0.88 / 0.46, 4096 x 256: 0.86 / 0.42).
#: The crossover is one of total size, not of row length, and the choice may be made on the total
#: size because the two paths give every row the same bits (the module docstring).
MIN_AUTO_ELEMENTS = 1024 * 1024

_FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def takes(call: Call) -> str | None:
    """None when ``call`` is an unmasked RMS scope this path runs, else why not."""
    s = call.scope
    if s.centered or call.mask is not None or call.running is not None or call.bias is not None:
        return "not an unmasked RMS scope without bias or running statistics"
    if not s.form.rows:
        return "an RMS scope over grouped axes or with an affine over other axes"
    if any(s.shape[d] == 0 for d in s.reduce):
        return "an empty scope (a normalized size of 0), which has no rows to run"
    if call.x.dtype not in _FLOATS:
        return f"floating-point input only, got {call.x.dtype}"
    w, acc = call.weight, ref.acc_dtype(call.x.dtype)
    family = call.casting != "torch" or call.weight_offset != 0.0  # any weight: see prepare
    if w is not None and not family and w.dtype not in (call.x.dtype, acc):
        # torch multiplies by such a weight in the promoted dtype (fp64 for an fp64 weight): other bits
        return f"a weight of the input's dtype or {acc} only, got {w.dtype} for {call.x.dtype} input"
    return None


#: Elements per block of rows (at least one row) where the work runs block by block: the passes over
#: a block run while it is in cache and each temporary is one block, not a full-size fp32 copy.
#: 2^17 (512 KiB an fp32 buffer): the three or four buffers a pass reads and writes fit a 2 MiB L2,
#: where a bf16<->fp32 copy runs ~2x faster per element than out of L3. Measured against 2^19 (a
#: shared 2-core Sapphire Rapids VM, one thread, min of 9 interleaved runs, forward / backward ms):
#: 8192 x 1024 bf16 13.8 / 34.7 -> 11.0 / 26.6, fp32 25.9 / 43.6 -> 24.2 / 36.0; 8192 x 4096 bf16
#: 125 / 234 -> 106 / 195; 2^16 was no faster.
BLOCK_ELEMENTS = 1 << 17

#: fp32/fp64, forward and backward: block by block from this many bytes of one full-size tensor up
#: (below it the full-size temporaries are reused by the allocator, stay in cache and the fewer calls
#: win: measured backward crossover ~12 MiB at N = 1024, 2x faster at 32 MiB). fp16/bf16 always go by
#: blocks.
BLOCKED_BYTES = 16 << 20


def _blocks(rows: int, n: int, low: bool, itemsize: int) -> tuple[int, list[tuple[int, int]]]:
    """``(step, [(start, stop), ...])``: the (R, N) rows cut into blocks of about :data:`BLOCK_ELEMENTS`
    -- or, for fp32/fp64 input under :data:`BLOCKED_BYTES`, the whole input as one block (fewer
    calls). ``low``: fp16/bf16 input, always by blocks (each block upcast once)."""
    if not low and rows * n * itemsize < BLOCKED_BYTES:
        return rows, [(0, rows)]
    step = max(1, BLOCK_ELEMENTS // max(n, 1))
    return step, [(s, min(s + step, rows)) for s in range(0, rows, step)]


def _forward(x2: Tensor, weight: Tensor | None, eps: float, scale: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """``(y, r)`` for a (R, N) input: ``r = rsqrt(mean(x^2) + eps)`` per row, ``y = x * r * w``.

    By blocks of rows (:func:`_blocks`) for fp16/bf16 and for fp32/fp64 from
    :data:`BLOCKED_BYTES`: a block read once from memory for its norms stays in cache for
    its products (the weight's product in place, in cache). Over the whole input the weight's
    product is another full pass over memory: 8192 x 1024 fp32 forward at 0.70 of torch's time
    that way, 0.54-0.65 by blocks when the allocator keeps memory (``--keep-freed-memory``; 0.39 either way with
    glibc's default, where torch's temporaries are fresh pages). fp16/bf16 blocks are
    upcast once into an fp32 buffer, computed there and rounded once into ``y`` (over the whole input
    the upcasts are full-size temporaries, fresh pages from the system each call: ~10x slower).

    ``scale`` (with ``weight`` None): Llama's casting, ``y = scale * (x * r).to(x.dtype)`` in the
    promoted dtype of ``scale`` and ``x``, block by block (a separate product is another pass over
    memory: 1.5x the plain rows' time at 8192 x 1024 bf16)."""
    rows, n = x2.shape
    acc = ref.acc_dtype(x2.dtype)
    w = None if weight is None else weight if weight.dtype == acc else weight.to(acc)
    low = x2.dtype != acc
    step, blocks = _blocks(rows, n, low, x2.element_size())
    out = x2.dtype if scale is None else torch.promote_types(scale.dtype, x2.dtype)
    y = torch.empty((rows, n), dtype=out, device=x2.device)
    r = torch.empty((rows, 1), dtype=acc, device=x2.device)
    m = min(step, rows)
    buf, sq = (torch.empty((m, n), dtype=acc, device=x2.device) for _ in range(2)) if low else (None, None)
    # Llama's rounded normalized value: straight into y's block where y has x's dtype (the scale's
    # product then in place), else a block buffer
    in_y = scale is not None and out == x2.dtype
    rounded = None if scale is None or in_y else torch.empty((m, n), dtype=x2.dtype, device=x2.device)
    for s, e in blocks:
        xc, rc = x2[s:e], r[s:e]
        if low:
            xc = buf[: e - s].copy_(xc)
        _rstd(xc, eps, rc, sq[: e - s] if low else y[s:e] if scale is None or in_y else rounded[: e - s])
        if scale is not None:  # Llama: x * r rounded to x's dtype, then the scale's product
            if in_y:
                yc = y[s:e]
                (yc.copy_(xc.mul_(rc)) if low else torch.mul(xc, rc, out=yc)).mul_(scale)
            else:
                yc = xc.mul_(rc) if low else torch.mul(xc, rc, out=rounded[: e - s])
                torch.mul(rounded[: e - s].copy_(yc), scale, out=y[s:e])
            continue
        yc = xc.mul_(rc) if low else torch.mul(xc, rc, out=y[s:e])  # x * r * w in fp32, as torch ...
        if w is not None:
            yc.mul_(w)
        if low:
            y[s:e].copy_(yc)  # ... rounded once to x's dtype
    return y, r


def _rstd(xc: Tensor, eps: float, out: Tensor, sq: Tensor) -> None:
    """``out = rsqrt(mean(x^2) + eps)`` per row of a (R, N) block, by the very ops torch's
    ``rms_norm`` runs (``pow(2)``, ``mean``, ``add``, ``rsqrt``), so every row gets torch's bits.

    A row's reduction in torch does not depend on the other rows of the tensor (its order is fixed
    by the row's length and layout), so a block of rows gives each row the bits the whole input
    does, and the automatic choice between torch's op and this path, made on the input's size,
    changes no bit of any row (see the module docstring). ``sq``: a buffer of ``xc``'s shape and dtype
    for the squares (the block of the output, overwritten next, where it has that dtype)."""
    sq = torch.pow(xc, 2, out=sq)
    if _lone(sq):
        out.copy_(torch.mean(sq.expand(2, -1), -1, keepdim=True)[:1])
    else:
        torch.mean(sq, -1, keepdim=True, out=out)
    out.add_(eps).rsqrt_()


def _lone(t: Tensor) -> bool:
    """Whether ``t`` is a block of one row long enough for ATen to split its reduction across the
    threads (:data:`normscope._registry.SPLIT_ELEMENTS`): in a block of several rows each row is
    reduced whole by one thread, so a lone row -- a batch's last block, or every block of rows longer
    than half a block -- is reduced as a stride-0 pair of itself instead, and gets the same bits.
    With one thread every reduction is one pass: the row alone."""
    return t.shape[0] == 1 and t.shape[1] >= SPLIT_ELEMENTS and torch.get_num_threads() > 1


def _row_sums(t: Tensor) -> Tensor:
    """``t.sum(-1, keepdim=True)`` of a (R, N) block, a lone row as a stride-0 pair (:func:`_lone`)."""
    return t.expand(2, -1).sum(-1, keepdim=True)[:1] if _lone(t) else t.sum(-1, keepdim=True)


#: ``dw`` sums dy * x * r over the rows in groups of this many (one batched product), then adds the
#: groups' sums in float64: one long matrix-vector product accumulates the rows one after another, an
#: error growing with their count (at 8192 rows, 17x torch's, whose sum is pairwise); groups of 64
#: summed in fp32 were still ~1.3x torch's (1.8e-7 vs 1.4e-7 relative, 8192 x 1024), groups of 16
#: summed in float64 0.6x (8.3e-8), at the same time.
DW_GROUP_ROWS = 16


def _weighted_row_sum(gx: Tensor, r: Tensor) -> Tensor:
    """``sum_i r[i] * gx[i, :]`` for a contiguous (R, N) ``gx`` and (R, 1) ``r``, by groups of rows;
    float64 for fp32 (the groups' sums added in float64), else ``gx``'s dtype."""
    rows, n = gx.shape
    k = rows // DW_GROUP_ROWS
    full = k * DW_GROUP_ROWS
    total = None
    wide = torch.float64 if gx.dtype == torch.float32 else gx.dtype
    # products, which autocast (a backward run inside its block) would take in bf16/fp16: the sums of
    # torch's backward are not autocast's (ref.no_autocast)
    with ref.no_autocast(gx.device):
        if k:  # one batched product gives each group's sum, then a sum over the groups
            groups = torch.bmm(r[:full].reshape(k, 1, DW_GROUP_ROWS), gx[:full].view(k, DW_GROUP_ROWS, n))
            total = groups.sum(0, dtype=wide).view(n)
        if full < rows:
            rest = torch.mv(gx[full:].t(), r[full:].view(-1)).to(wide)
            total = rest if total is None else total.add_(rest)
    return torch.zeros(n, dtype=wide, device=gx.device) if total is None else total


def _backward(
    x2: Tensor,
    dy: Tensor,
    weight: Tensor | None,
    r: Tensor,
    need_x: bool,
    need_w: bool,
    scale: Tensor | None = None,
    split: bool = False,
    shape: tuple[int, ...] | None = None,
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """Closed-form ``(dx, dw)`` of :func:`_forward`, by blocks of rows (``dw`` summed over the blocks)
    for fp16/bf16 and large fp32/fp64 (:data:`BLOCKED_BYTES`).

    ``dx`` is the gradient autograd computes through torch's ``rms_norm`` (``y = x * r * w``,
    ``r = rsqrt(mean(x^2) + eps)``), op for op and in its order, so its bits are torch's for every
    row: ``da = dy * w``; ``dr = sum(da * x)``; ``g = (-0.5 * dr) * r^3 / N``;
    ``dx = da * r + g * (2 * x)`` -- each a separate rounding, no fused multiply-add (whose rounding
    differs), one row reduction (never a matrix-vector product: BLAS takes rows in unrolled groups and
    the remainder another way, so a row's bits would depend on how many rows the call holds).
    ``dw = sum_i r_i * (dy_i * x_i)`` is its own sum (:func:`_weighted_row_sum`), as accurate as
    torch's and the same from run to run, though not bitwise torch's.

    ``scale`` (Llama's casting, see :func:`_forward`): autograd's gradient of the normalized value is
    ``dy * scale`` rounded to x's dtype (the dtype of the rounded value it flows into), then the path
    without weight; the scale's own is ``sum_i dy_i * (x_i * r_i).to(x.dtype)``.

    ``split`` (an input in the accumulation dtype, see :class:`_RMSRows`): ``dx``'s two terms are
    returned apart, ``(da * r, g * (2 * x), dw)``, for autograd to add as it adds torch's; otherwise
    ``(dx, None, dw)``. ``shape``: the shape ``dx`` and its terms are allocated in (R x N elements;
    default ``(R, N)``), returned in it."""
    rows, n = x2.shape
    acc = r.dtype
    w = None if weight is None else weight.to(acc)
    need_s = need_w and scale is not None
    need_w = need_w and w is not None
    grad_s = None
    low = x2.dtype != acc or dy.dtype != acc
    step, blocks = _blocks(rows, n, low, r.element_size())
    m = min(step, rows)
    shape = (rows, n) if shape is None else shape
    full_x = torch.empty(shape, dtype=x2.dtype, device=x2.device) if need_x else None
    split = split and need_x and not low
    full_pow = torch.empty(shape, dtype=x2.dtype, device=x2.device) if split else None
    grad_x = None if full_x is None else full_x.view(rows, n)
    grad_pow = None if full_pow is None else full_pow.view(rows, n)
    grad_w = None
    # fp32/fp64 block temporaries where dx's own block is overwritten next (dw's product in dx's block,
    # dr's in the second term's): two blocks of peak memory fewer, the same values
    in_dx = need_x and not low
    prod = torch.empty((m, n), dtype=acc, device=x2.device) if need_w and not in_dx else None
    xbuf, gbuf = (torch.empty((m, n), dtype=acc, device=x2.device) for _ in range(2)) if low else (None, None)
    alone = need_s or need_x and not split
    scratch = torch.empty((m, n), dtype=acc, device=x2.device) if alone else None
    if scale is not None:  # block buffers: dy * scale (its dtype), rounded to x's dtype
        sd = torch.empty((m, n), dtype=torch.promote_types(scale.dtype, x2.dtype), device=x2.device)
        rounded = sd if sd.dtype == x2.dtype else torch.empty((m, n), dtype=x2.dtype, device=x2.device)
        ones = torch.ones((m, 1), dtype=acc, device=x2.device)
    for s, e in blocks:
        xc, gc, rc = x2[s:e], dy[s:e], r[s:e]
        if low:  # upcast once into fp32 buffers of one block
            xc = xbuf[: e - s].copy_(xc)
        if scale is not None:
            k = e - s
            if need_s:  # the scale's gradient: dy times the rounded normalized value, summed over rows
                t = torch.mul(xc, rc, out=scratch[:k])
                # dy upcast into its block buffer first: a product of fp32 and bf16 upcasts a
                # temporary of its own (an allocation and a pass more); the same values
                g32 = gc if gc.dtype == acc else gbuf[:k].copy_(gc)
                t.copy_(rounded[:k].copy_(t)).mul_(g32)
                part = _weighted_row_sum(t, ones[:k])  # groups of rows in batched products, as dw's
                grad_s = part if grad_s is None else grad_s.add_(part)
            # the normalized value's gradient: dy * scale, rounded to x's dtype as autograd rounds it
            gc = rounded[:k].copy_(torch.mul(gc, scale, out=sd[:k]))
        if low:
            gc = gbuf[: e - s].copy_(gc)
        if need_w:
            gx = torch.mul(gc, xc, out=grad_x[s:e] if prod is None else prod[: e - s])
            if weight.dtype == torch.float64 and acc != torch.float64:
                # an fp64 weight's gradient in fp64, as torch gives it (rare: fp32 input, fp64 weight)
                part = _weighted_row_sum(gc.double() * xc.double(), rc.double())
            else:  # sum over rows of dy * x * r
                part = _weighted_row_sum(gx, rc)
            grad_w = part if grad_w is None else grad_w.add_(part)
        if need_x:
            # da = dy * w: in the upcast dy's buffer (then rounded once into dx), or straight into dx
            out = gc if low else grad_x[s:e]
            if w is not None:
                torch.mul(gc, w, out=out)
            elif not low:
                out.copy_(gc)
            tmp = grad_pow[s:e] if scratch is None else scratch[: e - s]
            dr = _row_sums(torch.mul(out, xc, out=tmp))
            # torch: (-0.5 * dr) * r^3, its mean's backward / N, its square's * (2 * x); x * (2 * g)
            # rounds as g * (2 * x) does: doubling is exact
            g = dr.mul_(-0.5).mul_(rc.pow(3)).div_(n).mul_(2.0)
            if split:
                out.mul_(rc)
                torch.mul(xc, g, out=grad_pow[s:e])
            else:
                out.mul_(rc).add_(torch.mul(xc, g, out=tmp))
            if low:
                grad_x[s:e].copy_(out)
    if need_w and grad_w is None:  # no rows
        grad_w = torch.zeros(n, dtype=weight.dtype, device=x2.device)
    if need_s:
        grad_s = torch.zeros(n, dtype=scale.dtype, device=x2.device) if grad_s is None else grad_s.to(scale.dtype)
        return full_x, full_pow, grad_s
    return full_x, full_pow, None if grad_w is None else grad_w.to(weight.dtype)


class _Rows(NamedTuple):
    """How a Function sees its input: ``rows(x)``, the (R, N) rows of ``x`` (the reduced axes moved
    last, a view where they already are), and ``back(g)``, a gradient allocated in ``shape(x)`` in
    ``x``'s axis order."""

    reduce: tuple[int, ...]
    tail: tuple[int, ...]
    moved: bool
    n: int

    def rows(self, x: Tensor) -> Tensor:
        return (x.movedim(self.reduce, self.tail) if self.moved else x).reshape(-1, self.n)

    def shape(self, x: Tensor) -> torch.Size:
        """The shape of ``x`` with the reduced axes last: a gradient is allocated in it, so that where
        nothing moved it is returned as it was allocated (below)."""
        return x.movedim(self.reduce, self.tail).shape if self.moved else x.shape

    def back(self, g: Tensor | None) -> Tensor | None:
        """A gradient allocated in :meth:`shape`, in ``x``'s axis order. Where nothing moved it is
        returned itself, not a view: autograd adds a second gradient into a tensor in place, and takes
        one as the input's ``.grad``, only when it holds the tensor's storage alone -- a view of it
        costs a full-size copy (fp32 RMSNorm(4096) on 8192 rows: +128 MiB of peak memory)."""
        if g is None or not self.moved:
            return g
        return g.movedim(self.tail, self.reduce)


# Why the input comes twice. torch's rms_norm differentiates its input through two ops, ``x * r``
# and ``x.pow(2)``, and autograd adds their two gradients into the input's gradient one after the
# other -- together with whatever else flows into it (a residual stream's gradient, say), in autograd's
# order. One gradient summed here first, then added to the rest, rounds differently: the same row
# would then get other bits on this path than on torch's, and the automatic choice between the two,
# made on the input's size, would make a sample's gradient depend on its batch. So where nothing
# lies between (an input already in the accumulation dtype: torch's upcast is then no op), the input
# is handed in twice, as torch's two ops take it, and each gets its own term back. A reduced-precision
# input is upcast by torch first, and the two terms meet in that upcast's fp32 gradient: one term,
# summed here in the same order. The rows are taken inside the Function for the same reason: a view
# made outside would be an autograd node adding the two terms before the rest.


def _copied(x2: Tensor, x: Tensor) -> Tensor | None:
    """The rows to save beside ``x``: None where they are a view of it, rebuilt in the backward --
    saved-tensor hooks (``save_on_cpu``, activation offloading) pack each saved tensor, and a view
    saved beside its base is packed a second time (fp32: 2.1x the input's bytes, against 1.0x)."""
    same = x2.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
    return None if same else x2


class _RMSRows(torch.autograd.Function):
    """``y = x * rsqrt(mean(x^2) + eps) * w`` over the rows of ``x`` (:class:`_Rows`), closed-form
    backward; ``x_again`` is ``x`` (see above)."""

    @staticmethod
    def forward(ctx, x: Tensor, x_again: Tensor | None, weight: Tensor | None, eps: float, rows: _Rows) -> Tensor:
        x2 = rows.rows(x)
        y, r = _forward(x2, weight, eps)
        ctx.save_for_backward(x, _copied(x2, x), weight, r)
        ctx.eps, ctx.rows = eps, rows  # eps: for the reference recomputation of a double backward
        return y

    @staticmethod
    def backward(ctx, dy: Tensor):
        x, x2, weight, r = ctx.saved_tensors
        x2 = ctx.rows.rows(x) if x2 is None else x2
        if torch.is_grad_enabled() or _batched(dy):  # see _reference_grads
            gx, gw = _reference_grads(ctx, dy, x, weight)
            return gx, None, gw, None, None
        need_x = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        need_w = weight is not None and ctx.needs_input_grad[2]
        split = ctx.needs_input_grad[1]
        shape = ctx.rows.shape(x)
        grad_mul, grad_pow, grad_w = _backward(x2, dy, weight, r, need_x, need_w, split=split, shape=shape)
        return ctx.rows.back(grad_mul), ctx.rows.back(grad_pow), grad_w, None, None


class _LlamaRows(torch.autograd.Function):
    """Llama's casting over the rows of ``x``, ``y = w * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)``
    (``w``: the scale, in the promoted dtype), closed-form backward; ``x_again`` as :class:`_RMSRows`'s."""

    @staticmethod
    def forward(ctx, x: Tensor, x_again: Tensor | None, scale: Tensor, eps: float, rows: _Rows) -> Tensor:
        x2 = rows.rows(x)
        y, r = _forward(x2, None, eps, scale=scale)
        ctx.save_for_backward(x, _copied(x2, x), scale, r)
        ctx.eps, ctx.rows = eps, rows
        return y

    @staticmethod
    def backward(ctx, dy: Tensor):
        x, x2, scale, r = ctx.saved_tensors
        x2 = ctx.rows.rows(x) if x2 is None else x2
        if torch.is_grad_enabled() or _batched(dy):  # see _reference_grads
            gx, gs = _reference_grads(ctx, dy, x, scale, "llama")
            return gx, None, gs, None, None
        need_x, need_s = ctx.needs_input_grad[0] or ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        split, shape = ctx.needs_input_grad[1], ctx.rows.shape(x)
        grad_mul, grad_pow, grad_s = _backward(x2, dy, None, r, need_x, need_s, scale, split, shape)
        return ctx.rows.back(grad_mul), ctx.rows.back(grad_pow), grad_s, None, None


def _batched(dy: Tensor) -> bool:
    """Whether a backward runs under vmap: autograd's batched gradients (``is_grads_batched=True``, which
    ``torch.autograd.functional.jacobian(vectorize=True)`` and gradcheck's batched check use) run it under
    torch's legacy vmap, whose batched ``dy`` is no functorch tensor and pushes no functorch interpreter
    (:func:`normscope.engine.transformed` is False there); torch.func's transforms push one."""
    return _legacy_batched(dy) or engine.transformed()


_legacy_batched = torch._C._functorch.is_legacy_batchedtensor


def _reference_grads(ctx, dy: Tensor, x: Tensor, weight: Tensor | None, casting: str = "torch") -> tuple:
    """Gradients of the reference computation of the same rows, instead of the closed form: differentiable
    where autograd asks for a graph of the backward (``create_graph=True``: double backward), and batched
    where it runs the backward under vmap (``is_grads_batched=True``, ``jacobian(vectorize=True)``), where
    the closed form's ``out=`` ops have no batching rule and raised."""
    create = torch.is_grad_enabled()
    need_x = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
    need = [t is not None and n for t, n in zip((x, weight), (need_x, ctx.needs_input_grad[2]))]
    scope = _ROWS_AFFINE if weight is not None else _ROWS
    with torch.enable_grad():  # a backward without create_graph runs with grad off: the recomputation needs it
        x2 = ctx.rows.rows(x)
        rows = Call(x2, scope.resolve(tuple(x2.shape)), weight, None, ctx.eps, None, None, casting=casting)
        y = reference_backend.run(rows)
    wanted = [t for t, n in zip((x, weight), need) if n]
    grads = iter(torch.autograd.grad(y, wanted, dy, create_graph=create, allow_unused=True))
    return tuple(next(grads) if n else None for n in need)


_ROWS_AFFINE = Scope.rms(1)
_ROWS = Scope(reduce=(-1,), centered=False)


def _dense_rows(xm: Tensor, k: int) -> bool:
    """Whether the last ``k`` axes of ``xm`` (a row) are dense in memory, last axis fastest: then
    torch reduces each row alone, in an order set by its length (what this path does)."""
    expected = 1
    for size, stride in zip(reversed(xm.shape[-k:]), reversed(xm.stride()[-k:])):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def prepare(call: Call, strided: Runner | None = None) -> Runner:
    """The runner of an RMS call (``takes(call)`` is None): the reduced axes moved last (a view,
    free when they already are), the input as (rows, N), one :class:`_RMSRows`.

    ``strided``: torch's op for the same call (the aten backend's runner), run on rows that are not
    dense in memory -- torch reduces those in another order (across rows, by the layout) than the
    dense rows this path reduces, so their bits are torch's only from torch's op.

    The model families' casting orders (:func:`normscope.reference.cast_affine`), exactly: Gemma's
    ``(x32 * r * (w32 + offset)).to(x.dtype)`` is these rows with the fp32 scale ``w32 + offset`` as
    their weight (they compute in fp32 and round once); Llama's ``w * (x32 * r).to(x.dtype)`` is the
    rows without weight, then the weight's product (for fp32 input and weight, the rows with the
    weight: ``w * (x * r)`` is ``(x * r) * w``)."""
    s = call.scope
    tail, moved = reduced_last(s)
    n = math.prod([s.shape[d] for d in s.reduce])
    offset, casting = call.weight_offset, call.casting
    acc = ref.acc_dtype(call.x.dtype)
    w = call.weight
    if casting == "llama" and offset == 0.0 and call.x.dtype == acc and (w is None or w.dtype == acc):
        casting = "torch"  # nothing is rounded between the normalization and the scale: the same bits
    llama, scaled = casting == "llama", casting != "torch" or offset != 0.0
    fused = llama and offset == 0.0  # Llama's scale inside the rows (with an offset: cast_affine after)
    rows = _Rows(tuple(s.reduce), tuple(tail), moved, n)

    def run(c: Call) -> Tensor:
        if engine.transformed():
            # vmap / grad transforms: an autograd.Function in the forward(ctx) style cannot run
            # inside them; the reference's plain ops can
            return engine.recompute(c)
        x = c.x
        xm = x.movedim(s.reduce, tail) if moved else x
        if strided is not None and not _dense_rows(xm, len(tail)):
            return strided(c)
        # the weight spans the reduced axes in their order, which is the order they have at the end
        w = None if c.weight is None else c.weight.reshape(n)
        if scaled and not llama and w is not None:
            w = w.to(acc) + offset if offset else w.to(acc)  # Gemma's 1 + w, formed in fp32
        # inference mode records no graph even where grad mode is on (``torch.enable_grad()`` inside it):
        # torch's ops give an output that requires no grad there, and the Function would save an
        # inference tensor, which autograd refuses
        grad = (
            torch.is_grad_enabled()
            and not torch.is_inference_mode_enabled()
            and (x.requires_grad or w is not None and w.requires_grad)
        )
        if grad:
            if x.is_inference():
                # a tensor made under torch.inference_mode() (it requires no grad; the weight does): the
                # Function saves its input for the weight's gradient, which autograd refuses for an
                # inference tensor, where torch's op saves only its own intermediates. A normal copy
                # (the same values, each row dense as it was: the same bits) is saved instead
                x = x.clone()
            # the input twice where torch's two gradient terms reach it directly (see _RMSRows)
            again = x if x.dtype == acc and x.requires_grad else None
            if fused and w is not None:
                y = _LlamaRows.apply(x, again, w, float(c.eps), rows)
            else:
                y = _RMSRows.apply(x, again, None if llama else w, float(c.eps), rows)
        else:  # nothing to differentiate: skip the autograd.Function's per-call cost
            x2 = xm.reshape(-1, n)
            if fused and w is not None:
                y = _forward(x2, None, c.eps, scale=w)[0]
            else:
                y = _forward(x2, None if llama else w, c.eps)[0]
        y = y.view(xm.shape)
        y = y.movedim(tail, s.reduce) if moved else y
        fmt = channels_last(c.x)
        y = y if fmt is None else y.contiguous(memory_format=fmt)  # torch keeps the input's layout
        if llama and not fused:
            return ref.cast_affine(y, s, c.weight, None, offset, casting, c.x.dtype)
        return y

    return run
