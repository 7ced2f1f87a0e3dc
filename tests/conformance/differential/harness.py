"""The machinery of the differential suite: cases, layouts, running a path, comparing results.

A :class:`Case` holds float64 (or bool) master values and, for each tensor argument, the layout it
is handed over in. :meth:`Case.tensors` builds fresh tensors from the values every time it is
called -- in the case's dtype or in float64 -- so that running statistics updated in place by one
run never leak into another, and the normscope run, torch's run and the float64 run all see the
same numbers in the same strides.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

import normscope

# ----------------------------------------------------------------------------------------------
# layouts: the same values handed over in different strides

#: every layout a tensor argument may arrive in; ``layouts_for`` says which fit a given rank
LAYOUTS = ("contiguous", "strided", "expanded", "transposed", "channels_last", "offset")


def layouts_for(ndim: int, batched: bool = True) -> tuple[str, ...]:
    """The layouts a tensor of ``ndim`` dims can take. ``expanded`` repeats the first index of axis 0
    (stride 0 there): for a batched tensor every sample is the same, for a 1-D weight every value."""
    out = ["contiguous", "strided", "offset", "expanded"]
    if ndim >= 2:
        out.append("transposed")
    if ndim in (4, 5):
        out.append("channels_last")
    return tuple(out)


def lay(values: Tensor, layout: str, dtype: torch.dtype | None = None) -> Tensor:
    """A new tensor equal to ``values`` (cast to ``dtype``) in ``layout``'s strides."""
    v = values if dtype is None or values.dtype == torch.bool else values.to(dtype)
    if v.dim() == 0 or layout == "contiguous":
        return v.clone().contiguous()
    if layout == "strided":  # every other element of a buffer twice as long on the last axis
        buf = torch.zeros((*v.shape[:-1], 2 * v.shape[-1]), dtype=v.dtype)
        out = buf[..., ::2]
        out.copy_(v)
        return out
    if layout == "offset":  # a view that starts 5 elements into its storage
        buf = torch.zeros(v.numel() + 5, dtype=v.dtype)
        return buf[5:].view(v.shape).copy_(v)
    if layout == "expanded":  # stride 0 on axis 0: the values must repeat along it (see Case.expand)
        return v[:1].clone().expand(v.shape)
    if layout == "transposed":  # the last two axes swapped in memory (the batch axis too for 2-D)
        return v.transpose(-2, -1).contiguous().transpose(-2, -1)
    if layout == "channels_last":
        fmt = torch.channels_last if v.dim() == 4 else torch.channels_last_3d
        return v.contiguous(memory_format=fmt)
    raise ValueError(f"unknown layout {layout!r}; expected one of {LAYOUTS}")


# ----------------------------------------------------------------------------------------------
# a case


@dataclasses.dataclass(frozen=True)
class Arg:
    """One tensor argument: float64 (or bool) ``values``, the ``layout`` it is handed over in,
    whether it is differentiated (``grad``), whether axis 0 is the batch (``batched``) and whether it
    takes the case's dtype (``follows``; False keeps it float32, e.g. an fp32 weight on bf16 input)."""

    values: Tensor
    layout: str = "contiguous"
    grad: bool = False
    batched: bool = False
    follows: bool = True


@dataclasses.dataclass(frozen=True)
class Case:
    """One call of an op: its tensor arguments, static keyword arguments and dtype."""

    args: dict[str, Arg]
    dtype: torch.dtype
    kw: dict[str, Any] = dataclasses.field(default_factory=dict)

    def tensors(self, dtype: torch.dtype | None = None) -> dict[str, Tensor]:
        """Fresh tensors in their layouts, in the case's dtype (or ``dtype``: float64 for the truth)."""
        out = {}
        for name, a in self.args.items():
            if a.values.dtype == torch.bool:
                t = lay(a.values, a.layout)
            else:
                dt = dtype or (self.dtype if a.follows else torch.float32)
                t = lay(a.values, a.layout, dt)
                if a.grad:
                    t.requires_grad_(True)
            out[name] = t
        return out

    @property
    def batch(self) -> int:
        return next(a.values.shape[0] for a in self.args.values() if a.batched)

    def select(self, index: Sequence[int] | Tensor) -> Case:
        """The case on the samples ``index`` of every batched argument (layouts kept)."""
        idx = torch.as_tensor(index, dtype=torch.long)
        args = {n: dataclasses.replace(a, values=a.values[idx]) if a.batched else a for n, a in self.args.items()}
        return dataclasses.replace(self, args=args)

    def replace(self, **values: Tensor) -> Case:
        return dataclasses.replace(
            self, args={n: dataclasses.replace(a, values=values[n]) if n in values else a for n, a in self.args.items()}
        )


def arg(values: Tensor, layout: str = "contiguous", **flags) -> Arg:
    """An :class:`Arg` whose values agree with ``layout``: an expanded one repeats its first index."""
    if layout == "expanded" and values.dim() > 0:
        values = values[:1].expand(values.shape).clone()
    return Arg(values, layout, **flags)


# ----------------------------------------------------------------------------------------------
# running a path


def as_tuple(out) -> tuple[Tensor, ...]:
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


@dataclasses.dataclass
class Result:
    """Outputs, the gradients of every differentiated argument (by name) and the state the call
    left in its in-place arguments (running statistics, by name)."""

    outputs: tuple[Tensor, ...]
    grads: dict[str, Tensor | None]
    state: dict[str, Tensor]
    ran: str | None = None


class Cotangents:
    """Fixed upstream gradients, one per differentiable output: drawn once, on the first run, in
    float64 and rounded to that run's output dtypes (so that the float64 truth receives the very
    values the low-precision run did), then handed to every later run in its own output dtypes.

    :meth:`select` gives the rows of some samples (axis 0): a sample's upstream gradient is then the
    same wherever it sits in a batch. :meth:`where` zeroes some positions."""

    def __init__(
        self, seed: int = 7, values: list[Tensor] | None = None, keep: Callable[[Tensor], Tensor] | None = None
    ) -> None:
        self.seed, self.values, self.keep = seed, values, keep

    def __call__(self, outputs: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        if self.values is None:
            g = torch.Generator().manual_seed(self.seed)
            self.values = [torch.randn(o.shape, generator=g, dtype=torch.float64).to(o.dtype).double() for o in outputs]
            if self.keep is not None:
                self.values = [v * self.keep(v) for v in self.values]
        return tuple(v.to(o.dtype) for v, o in zip(self.values, outputs))

    def select(self, index) -> Cotangents:
        idx = torch.as_tensor(index, dtype=torch.long)
        return Cotangents(values=[v[idx] for v in self.values])

    @staticmethod
    def where(keep: Callable[[Tensor], Tensor], seed: int = 7) -> Cotangents:
        """Upstream gradients that are zero wherever ``keep(value)`` (a bool tensor broadcastable to
        the output) is False: a loss that ignores padded outputs."""
        return Cotangents(seed, keep=keep)


def execute(
    fn: Callable[[dict[str, Tensor], dict], Any],
    case: Case,
    *,
    dtype: torch.dtype | None = None,
    state: Sequence[str] = (),
    grads: bool = True,
    cot: Cotangents | None = None,
) -> Result:
    """Run ``fn(tensors, kw)`` on fresh tensors of ``case``; differentiate every output with the
    upstream gradients ``cot`` (default: a fresh :class:`Cotangents`) against the arguments marked
    ``grad``."""
    t = case.tensors(dtype)
    outputs = as_tuple(fn(t, case.kw))
    ran = normscope.last_backend()
    diff = [o for o in outputs if o.requires_grad]
    wrt = {n: t[n] for n, a in case.args.items() if a.grad}
    g: dict[str, Tensor | None] = {}
    if grads and diff and wrt:
        dys = (cot or Cotangents())(tuple(diff))
        got = torch.autograd.grad(diff, list(wrt.values()), dys, allow_unused=True)
        g = dict(zip(wrt, got))
    return Result(tuple(o.detach() for o in outputs), g, {n: t[n].detach().clone() for n in state if n in t}, ran)


# ----------------------------------------------------------------------------------------------
# comparing


def ulp(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps


#: the slack of the float64 comparison, in units of the dtype's eps times the result's scale. For
#: float64 input the "truth" is torch's own float64 computation (nothing more precise exists), so
#: the bound is two summation orders apart: a wider slack
SLACK_ULPS = {torch.float64: 64}
DEFAULT_SLACK_ULPS = 4


def assert_bitwise(name: str, got: Tensor | None, want: Tensor | None) -> None:
    """``got`` and ``want`` the same bits (NaN where NaN), with a message that says where they first differ."""
    if got is None or want is None:
        assert got is None and want is None, f"{name}: one side is None (got {got is None}, want {want is None})"
        return
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert got.dtype == want.dtype, f"{name}: dtype {got.dtype} != {want.dtype}"
    same = (got == want) | (got.isnan() & want.isnan()) if got.is_floating_point() else got == want
    if not bool(same.all()):
        where = tuple(int(i) for i in (~same).nonzero()[0])
        diff = (got.double() - want.double()).abs().nan_to_num(math.inf)
        raise AssertionError(
            f"{name}: {int((~same).sum())} of {same.numel()} elements differ in their bits; first at {where}: "
            f"{got[where].item()!r} vs {want[where].item()!r}; largest difference {diff.max().item():.3g}"
        )


def assert_accurate(
    name: str, got: Tensor | None, torch_same: Tensor | None, truth: Tensor | None, scale: float = 0.0
) -> None:
    """normscope's error against the float64 ``truth`` is no larger than torch's (``torch_same``,
    the oracle computed in the same dtype) plus :data:`SLACK_ULPS` ulps of the result's scale: its
    largest value, or ``scale`` when larger (a gradient that is zero in exact arithmetic is still
    computed as a difference of terms of that size)."""
    if got is None or truth is None:
        assert got is None and truth is None, f"{name}: one side is None (got {got is None}, truth {truth is None})"
        return
    assert got.shape == truth.shape, f"{name}: shape {tuple(got.shape)} != {tuple(truth.shape)}"
    g, t, s = got.double(), truth.double(), torch_same.double()
    # where the float64 value is finite but torch's overflows the dtype (a gradient past fp16's
    # range), normscope's may overflow too; elsewhere it is finite exactly where the truth is
    finite = t.isfinite() & s.isfinite()
    allowed = finite | (t.isfinite() & ~s.isfinite())
    bad = (g.isfinite() != t.isfinite()) & ~(allowed & ~finite)
    assert not bool(bad.any()), (
        f"{name}: non-finite where float64 and torch are finite (or the reverse) at "
        f"{tuple(int(i) for i in bad.nonzero()[0])}: {got[tuple(bad.nonzero()[0])].item()!r}"
    )
    if not bool(finite.any()):
        return
    g, t, s = g[finite], t[finite], s[finite]
    err, err_torch = (g - t).abs().max().item(), (s - t).abs().max().nan_to_num(0.0).item()
    scale = max(t.abs().max().item(), scale, 1e-30)
    ulps = SLACK_ULPS.get(got.dtype, DEFAULT_SLACK_ULPS)
    bound = err_torch + ulps * ulp(got.dtype) * scale
    assert err <= bound, (
        f"{name}: error vs float64 {err:.3g} > torch's {err_torch:.3g} + {ulps} ulp x {scale:.3g} "
        f"({got.dtype}, shape {tuple(got.shape)})"
    )


def conditioning(probe: Tensor, truth: Tensor) -> float:
    """The scale at which a float32 computation (``probe``) of a float64 result errs: its largest
    error in float32 ulps (:func:`sensitivity` of the fp32 result)."""
    return sensitivity(probe, truth, torch.float32)


def grad_scale(truth: Result, cot: Cotangents, values: Tensor) -> float:
    """The size of the terms a gradient with respect to an argument of ``values`` is made of:
    ``|dy| * |y| / |a|`` (a normalization's gradient is ``dy`` times outputs over the input's
    spread), with ``|a|`` the argument's root mean square."""
    dy = max((v.abs().max().item() for v in cot.values or () if v.numel()), default=0.0)
    y = max((o.double().abs().nan_to_num(0.0).max().item() for o in truth.outputs if o.numel()), default=0.0)
    a = values.double().square().mean().sqrt().item() if values.numel() else 0.0
    return dy * y / a if a > 0 else 0.0


def nudged(case: Case, seed: int = 11) -> Case:
    """``case`` with every element of every floating argument moved by one ulp of its own size, up or
    down at random (``v + eps * |v| * (+-1)``, eps of the dtype it runs in): the perturbation by which
    a backward-stable algorithm's result is exact. Run in float64, it shows how far a result moves
    when its inputs move by their own rounding -- by ``|x| * rstd`` ulps for a normalization, the
    error any fp32 algorithm makes on an input whose mean dwarfs its spread, however it sums (see
    :func:`sensitivity`). At random, not all one way: a normalization sees neither a common scaling
    nor a common shift of its input."""
    g = torch.Generator().manual_seed(seed)
    moved = {}
    for n, a in case.args.items():
        if a.values.is_floating_point():
            eps = ulp(case.dtype if a.follows else torch.float32)
            sign = torch.randint(0, 2, a.values.shape, generator=g).to(a.values.dtype) * 2 - 1
            moved[n] = a.values + a.values.abs() * eps * sign
    return case.replace(**moved)


def sensitivity(moved: Tensor | None, truth: Tensor | None, dtype: torch.dtype) -> float:
    """How far the float64 result ``moved`` (of :func:`nudged` inputs) lies from ``truth``, in ulps of
    ``dtype``: the result's scale for :func:`assert_accurate` (its slack is then a few times the move
    of a one-ulp nudge of the inputs -- backward stability -- where the result's own size is smaller)."""
    if moved is None or truth is None or not moved.is_floating_point():
        return 0.0
    finite = moved.isfinite() & truth.isfinite()
    if not bool(finite.any()):
        return 0.0
    return (moved.double() - truth.double())[finite].abs().max().item() / ulp(dtype)
