"""The registry: every path (backend) and every op of normscope, each described once.

A **path** is a way a call can run: the automatic choice, or one forced backend: ``rows`` is the
CPU RMS rows backend (``backends/rows.py``, unmasked RMS scopes), ``composite`` the masked one.

An **op** is a public callable: how to draw its inputs (:class:`~.harness.Case`), how to call it, its
oracle (torch's op or module, or the model family's code, run in the same dtype; the float64 truth
is the oracle on float64 inputs unless ``truth`` says otherwise), the paths that run it, and which
properties apply.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as TF
from hypothesis import strategies as st
from torch import Tensor, nn
from torch.func import functional_call

import normscope
from normscope import engine
from normscope import functional as NF
from normscope import functional_modern as FM

from .harness import Case, Result, arg, execute, layouts_for

F32, F64, BF16, F16 = torch.float32, torch.float64, torch.bfloat16, torch.float16
ALL_DTYPES = (F32, F64, BF16, F16)
TRITON_DTYPES = (F32, BF16, F16)  # the kernels decline fp64


@dataclasses.dataclass(frozen=True)
class Path:
    """``backend``: what ``use_backend`` forces (None: the automatic choice). ``reports``: what
    ``last_backend()`` must say after a call on it (None: whatever the automatic order picked)."""

    backend: str | None
    reports: str | None
    dtypes: tuple[torch.dtype, ...] = ALL_DTYPES
    tiny: bool = False  # the Triton interpreter runs a program at a time: small shapes only


PATHS = {
    "auto": Path(None, None),
    "aten": Path("aten", "aten"),
    "rows": Path("rows", "rows"),  # the CPU RMS rows backend (backends/rows.py, backends/rms.py)
    "composite": Path("composite", "composite"),  # masked BatchNorm/InstanceNorm/GroupNorm
    "reference": Path("reference", "reference"),
    "triton": Path("triton", "triton", TRITON_DTYPES, tiny=True),
}


# ----------------------------------------------------------------------------------------------
# drawing inputs

#: row lengths that straddle the thresholds of the rows paths (see the package docstring): 1, the
#: RSTD_CHUNK boundaries (128, 256 and a tail), odd and prime lengths. The first choice of each
#: list is an ordinary value, not the smallest: hypothesis's first example takes every first choice
ROW_LENGTHS = (7, 1, 2, 31, 64, 127, 128, 255, 256, 257, 300, 1000, 1024)
#: the same for the Triton interpreter (its packing of rows per program changes at powers of two)
TINY_ROW_LENGTHS = (9, 1, 3, 8, 33)
CAP = 20_000  # most elements of a drawn input: the whole suite stays within CI's minutes
TINY_CAP = 1_500
#: (B, C, L) -- or rows of 4096 -- past the size at which the code's automatic choice changes path
#: (MIN_AUTO_ELEMENTS, 2^20 elements). The drawn inputs stop at CAP, so a backend that takes only large calls
#: (as the rows path is chosen only past that size) is reached by none of them: every unlisted backend must
#: refuse its ops here too
PAST_EVERY_THRESHOLD = (33, 8, 4096)


def seed_of(data) -> int:
    return data.draw(st.integers(0, 2**31 - 1), label="seed")


def values(shape, dtype: torch.dtype, seed: int, scale: float = 1.0, offset: float = 0.0) -> Tensor:
    """float64 values already rounded to ``dtype`` (so the float64 truth sees the same inputs)."""
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(shape, generator=g, dtype=F64) * scale + offset
    return v.to(dtype).to(F64)


def draw_batch(data, rest: int, tiny: bool) -> int:
    """A batch size in 1..300, shrunk so that the input holds at most the cap of elements."""
    b = data.draw(st.just(3) | st.integers(1, 300), label="batch")
    cap = TINY_CAP if tiny else CAP
    return max(1, min(b, cap // max(rest, 1)))


#: a layout every tensor argument of the next draws takes where it can (:func:`forcing_layout`)
_FORCED_LAYOUT: list[str] = []


@contextlib.contextmanager
def forcing_layout(layout: str):
    """Inside, every tensor argument drawn takes ``layout`` where its rank allows (else it is
    contiguous; a buffer written in place is strided instead of expanded)."""
    _FORCED_LAYOUT.append(layout)
    try:
        yield
    finally:
        _FORCED_LAYOUT.pop()


def _forced_layout(ndim: int, writable: bool = False) -> str | None:
    if not _FORCED_LAYOUT:
        return None
    layout = _FORCED_LAYOUT[-1]
    if writable and layout == "expanded":
        return "strided"
    return layout if layout in layouts_for(ndim) else "contiguous"


def draw_layout(data, ndim: int, label: str, batched: bool = True) -> str:
    return _forced_layout(ndim) or data.draw(st.sampled_from(layouts_for(ndim, batched)), label=f"layout[{label}]")


def draw_scale(data) -> tuple[float, float]:
    """(scale, offset) of an input: ordinary, small, large, and an offset 1000x the spread (the
    cancellation the aten backend guards, backends/aten.py)."""
    return data.draw(st.sampled_from(SCALES), label="scale")


#: (scale, offset) of drawn inputs; the last has |mean| * rstd ~3000 at eps 1e-5, past the aten
#: backend's _CANCEL_LIMIT (1024): (1e-2, 1e1) stops at ~950, below it
SCALES = ((1.0, 0.0), (3.0, 0.5), (1e-3, 0.0), (1e2, -1.0), (1e-2, 1e1), (1e-3, 1e1))


def x_arg(data, shape, dtype, seed, label="x", **flags) -> Any:
    scale, offset = draw_scale(data)
    layout = draw_layout(data, len(shape), label)
    if label == "x" and _FORCED and _FORCED[-1][2] is not None and not _FORCED_LAYOUT:
        layout = _FORCED[-1][2]
    return arg(values(shape, dtype, seed, scale, offset), layout, grad=True, batched=True, **flags)


def param_arg(data, shape, dtype, seed, label, *, offset=1.0, scale=0.5, follows=True, grad=True) -> Any:
    """A weight-like argument; ``grad=False``: a buffer written in place (running statistics), which
    no stride-0 layout can be (torch refuses to write one as well)."""
    choices = [lt for lt in layouts_for(len(shape), False) if grad or lt != "expanded"]
    layout = _forced_layout(len(shape), writable=not grad) or data.draw(
        st.sampled_from(choices), label=f"layout[{label}]"
    )
    dt = dtype if follows else F32
    return arg(values(shape, dt, seed, scale, offset), layout, grad=grad, follows=follows)


def mask_arg(data, shape, seed, label="mask") -> Any:
    """A bool mask, True = valid, with at least one valid position per sample (an all-padded sample
    has a documented result of its own, tested in tests/layers/test_masks.py)."""
    g = torch.Generator().manual_seed(seed)
    m = torch.rand(shape, generator=g) < data.draw(st.sampled_from([0.3, 0.7, 1.0]), label="valid fraction")
    m.reshape(shape[0], -1)[:, 0] = True
    layout = draw_layout(data, len(shape), label)
    a = arg(m, layout, batched=True)
    return a


#: a shape the next draws must use instead of drawing one (:func:`forcing_shape`)
_FORCED: list[tuple] = []


@contextlib.contextmanager
def forcing_shape(shape: tuple[int, ...], k_or_groups: int = 1, x_layout: str | None = None):
    """Inside, :func:`rows_shape` and :func:`channels_shape` return ``(shape, k_or_groups)`` (and the
    input ``x`` takes ``x_layout`` if given): the threshold cases, a shape past a size threshold,
    everything else still drawn."""
    _FORCED.append((tuple(shape), k_or_groups, x_layout))
    try:
        yield
    finally:
        _FORCED.pop()


def rows_shape(data, tiny: bool, max_trailing: int = 1) -> tuple[tuple[int, ...], int]:
    """(B, [M,] N...) with the last ``k`` axes normalized; returns (shape, k)."""
    if _FORCED:
        return _FORCED[-1][:2]
    k = data.draw(st.integers(1, max_trailing), label="normalized axes")
    lengths = TINY_ROW_LENGTHS if tiny else ROW_LENGTHS
    trailing = tuple(data.draw(st.sampled_from(lengths), label="row length") for _ in range(k))
    if k > 1:
        trailing = (min(trailing[0], 8), *trailing[1:])
    mid = data.draw(st.sampled_from([(3,), (), (1,), (16,)]), label="middle axes")
    rest = math.prod(mid) * math.prod(trailing)
    return (draw_batch(data, rest, tiny), *mid, *trailing), k


def channels_shape(data, tiny: bool, min_spatial: int = 0, groups: bool = False) -> tuple[tuple[int, ...], int]:
    """(B, C, *spatial) and a group count G dividing C (1 unless ``groups``)."""
    if _FORCED:
        return _FORCED[-1][:2]
    c = data.draw(st.sampled_from([4, 1, 2, 3, 8] if tiny else [4, 1, 2, 3, 6, 8, 16, 32]), label="channels")
    nsp = data.draw(st.integers(min_spatial, 3), label="spatial axes")
    sizes = (3, 1, 2, 5, 8) if tiny else (3, 1, 2, 5, 7, 8, 17)
    spatial = tuple(data.draw(st.sampled_from(sizes), label="spatial size") for _ in range(nsp))
    if min_spatial and math.prod(spatial) < 2:
        spatial = (*spatial[:-1], 2)
    divisors = sorted((d for d in range(1, c + 1) if c % d == 0), key=lambda d: (d != 2, d))  # 2 first
    g = data.draw(st.sampled_from(divisors), label="groups") if groups else 1
    rest = c * math.prod(spatial)
    b = draw_batch(data, rest, tiny)
    if tiny:  # the interpreter runs one program per (sample, group): keep them few
        b = max(1, min(b, 32 // c))
    if groups and rest // g < 2:  # torch refuses one value per group in a batch of one
        spatial, rest = (*spatial, 2), 2 * rest
        b = max(1, min(b, (TINY_CAP if tiny else CAP) // rest))
    return (b, c, *spatial), g


def optional(data, label: str) -> bool:
    """Whether an optional argument is given: drawn, except in the forced cases (a threshold's
    shape, one layout for all), which give every argument (a minimal draw would give none)."""
    if _FORCED or _FORCED_LAYOUT:
        return True
    return data.draw(st.sampled_from([True, False]), label=f"has {label}")


# ----------------------------------------------------------------------------------------------
# oracles that are not one torch call: the model families' code and direct formulas


def acc_of(x: Tensor) -> torch.dtype:
    return F64 if x.dtype == F64 else F32


def llama_rms(x: Tensor, w: Tensor | None, eps: float) -> Tensor:
    """transformers' LlamaRMSNorm / Qwen3RMSNorm.forward, verbatim but for the fp32 (fp64 for fp64)."""
    input_dtype = x.dtype
    h = x.to(acc_of(x))
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return h.to(input_dtype) if w is None else w * h.to(input_dtype)


def gemma_rms(x: Tensor, w: Tensor | None, eps: float, offset: float) -> Tensor:
    """transformers' Gemma3RMSNorm (offset 1) and Olmo2RMSNorm (offset 0) order: scale in fp32, cast last."""
    h = x.to(acc_of(x))
    out = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if w is not None:
        out = out * (offset + w.to(acc_of(x)))
    return out.type_as(x)


def masked_direct(x: Tensor, mask: Tensor, reduce: tuple[int, ...], eps: float, groups: int = 1) -> Tensor:
    """Masked centred normalization from its definition: statistics over the valid elements of each
    scope (``reduce`` axes of ``x`` viewed with axis 1 split into ``groups``), every element
    normalized with them; in fp32 (fp64 for fp64) and rounded once."""
    acc = acc_of(x)
    b, c = x.shape[:2]
    xg = x.to(acc).reshape(b, groups, c // groups, *x.shape[2:])
    m = torch.broadcast_to(mask.reshape(mask.shape[0], 1, 1, *mask.shape[1:]), xg.shape).to(acc)
    dims = tuple(d + 1 if d >= 1 else d for d in reduce)  # axes of x -> axes of the grouped view
    if groups > 1 or 1 in reduce:
        dims = tuple(sorted({*dims, 2}))
    count = m.sum(dims, keepdim=True)
    mean = (xg * m).sum(dims, keepdim=True) / count
    var = ((xg - mean) ** 2 * m).sum(dims, keepdim=True) / count
    return ((xg - mean) * torch.rsqrt(var + eps)).reshape(x.shape)


def channel_affine(y: Tensor, w: Tensor | None, b: Tensor | None, dim: int = 1) -> Tensor:
    view = [1] * y.dim()
    view[dim] = -1
    if w is not None:
        y = y * w.to(y.dtype).reshape(view)
    if b is not None:
        y = y + b.to(y.dtype).reshape(view)
    return y


# ----------------------------------------------------------------------------------------------
# the op table


@dataclasses.dataclass(frozen=True)
class Op:
    """One public op.

    * ``covers``: the public names it stands for (``functional.layer_norm``, ``LayerNorm``, ...);
      the suite fails when a name of a module's ``__all__`` is in no op and not in :data:`NOT_OPS`.
    * ``draw(data, dtype, tiny)``: a :class:`~.harness.Case` (``tiny``: for the Triton interpreter).
    * ``run(t, kw)`` / ``oracle(t, kw)``: normscope's call and torch's (or the family's) on the
      tensors ``t`` of a case; ``truth``: the float64 computation when it is not the oracle's.
    * ``paths``: every path that runs it; forcing any other backend must raise ValueError.
    * ``per_sample``: samples are independent (property b); ``mask``: the mask argument (property c);
      ``state``: arguments updated in place (running statistics), compared as outputs.
    * ``bitwise``: paths whose outputs and gradients are promised bit for bit with the oracle;
      ``bitwise_forward``: paths whose outputs (not gradients) are (the families' promise);
      ``exact_outputs``: outputs bit for bit with the oracle on every path (fused_add's residual).
    * ``engine``: the op runs through the engine's dispatch, so ``last_backend()`` names its path.
    """

    name: str
    covers: tuple[str, ...]
    draw: Callable[..., Case]
    run: Callable[[dict, dict], Any]
    oracle: Callable[[dict, dict], Any]
    paths: tuple[str, ...]
    truth: Callable[[dict, dict], Any] | None = None
    per_sample: bool = True
    mask: str | None = None
    state: tuple[str, ...] = ()
    bitwise: tuple[str, ...] = ()
    bitwise_forward: tuple[str, ...] = ()
    exact_outputs: tuple[int, ...] = ()
    engine: bool = True
    dtypes: tuple[torch.dtype, ...] = ALL_DTYPES


OPS: dict[str, Op] = {}


def register(op: Op) -> Op:
    assert op.name not in OPS, op.name
    for p in op.paths + op.bitwise + op.bitwise_forward:
        assert p in PATHS, f"{op.name}: unknown path {p!r}"
    OPS[op.name] = op
    return op


# -- LayerNorm / RMSNorm over the last axes ------------------------------------------------------


def _draw_rows(centered: bool):
    def draw(data, dtype, tiny=False) -> Case:
        shape, k = rows_shape(data, tiny, max_trailing=1 if tiny else 2)
        s = seed_of(data)
        norm_shape = shape[-k:]
        args = {"x": x_arg(data, shape, dtype, s)}
        if optional(data, "weight"):
            args["weight"] = param_arg(data, norm_shape, dtype, s + 1, "weight")
        if centered and optional(data, "bias"):
            args["bias"] = param_arg(data, norm_shape, dtype, s + 2, "bias", offset=0.0)
        eps = data.draw(st.sampled_from([1e-5, 1e-6] if centered else [None, 1e-6, 1e-5]), label="eps")
        return Case(args, dtype, {"shape": norm_shape, "eps": eps})

    return draw


register(
    Op(
        "layer_norm",
        ("functional.layer_norm",),
        _draw_rows(True),
        lambda t, kw: NF.layer_norm(t["x"], kw["shape"], t.get("weight"), t.get("bias"), kw["eps"]),
        lambda t, kw: TF.layer_norm(t["x"], kw["shape"], t.get("weight"), t.get("bias"), kw["eps"]),
        ("auto", "aten", "reference", "triton"),
        bitwise=("aten",),
    )
)
register(
    Op(
        "rms_norm",
        ("functional.rms_norm",),
        _draw_rows(False),
        lambda t, kw: NF.rms_norm(t["x"], kw["shape"], t.get("weight"), kw["eps"]),
        lambda t, kw: TF.rms_norm(t["x"], kw["shape"], t.get("weight"), kw["eps"]),
        ("auto", "aten", "rows", "reference", "triton"),
        bitwise=("aten",),
    )
)


#: the model families' (casting, weight_offset): Llama's order, Gemma's with its ``1 + w`` and without
FAMILIES = (("llama", 0.0), ("gemma", 1.0), ("gemma", 0.0))


def families(tiny: bool) -> tuple[tuple[str, float], ...]:
    """The families a path runs: the Triton kernels (the one ``tiny`` path) decline Llama's order,
    which rounds between the normalization and the scale -- with a reason, which
    ``test_registry.test_triton_declines_llamas_order`` holds them to."""
    return FAMILIES[1:] if tiny else FAMILIES


def _draw_family_rms(data, dtype, tiny=False) -> Case:
    shape, _ = rows_shape(data, tiny)
    s = seed_of(data)
    casting, offset = data.draw(st.sampled_from(families(tiny)), label="family")
    # Llama's weight may be fp32 on bf16 input (the product then promotes)
    follows = casting != "llama" or data.draw(st.booleans(), label="weight in the input's dtype")
    w = param_arg(data, shape[-1:], dtype, s + 1, "weight", offset=0.0 if offset else 1.0, scale=0.1, follows=follows)
    eps = data.draw(st.sampled_from([1e-6, 1e-5]), label="eps")
    return Case(
        {"x": x_arg(data, shape, dtype, s), "weight": w}, dtype, {"casting": casting, "offset": offset, "eps": eps}
    )


def _family_rms(t, kw):
    if kw["casting"] == "llama":
        return llama_rms(t["x"], t["weight"], kw["eps"])
    return gemma_rms(t["x"], t["weight"], kw["eps"], kw["offset"])


register(
    Op(
        "rms_norm_family",
        ("functional_modern.rms_norm",),
        _draw_family_rms,
        lambda t, kw: NF.rms_norm(
            t["x"], t["x"].shape[-1], t["weight"], kw["eps"], weight_offset=kw["offset"], casting=kw["casting"]
        ),
        _family_rms,
        ("auto", "aten", "rows", "reference", "triton"),
        bitwise_forward=("auto",),
    )
)


def _draw_family_layer(data, dtype, tiny=False) -> Case:
    shape, _ = rows_shape(data, tiny)
    s = seed_of(data)
    args = {
        "x": x_arg(data, shape, dtype, s),
        "weight": param_arg(data, shape[-1:], dtype, s + 1, "weight", offset=0.0, scale=0.1),
        "bias": param_arg(data, shape[-1:], dtype, s + 2, "bias", offset=0.0),
    }
    return Case(args, dtype, {"eps": 1e-6})


def _family_layer(t, kw):
    x = t["x"]
    acc = acc_of(x)
    y = TF.layer_norm(x.to(acc), x.shape[-1:], None, None, kw["eps"])
    return (y * (1.0 + t["weight"].to(acc)) + t["bias"].to(acc)).to(x.dtype)


register(
    Op(
        "layer_norm_family",
        ("functional_modern.layer_norm",),
        _draw_family_layer,
        lambda t, kw: FM.layer_norm(
            t["x"], t["x"].shape[-1], t["weight"], t["bias"], kw["eps"], weight_offset=1.0, casting="gemma"
        ),
        _family_layer,
        ("auto", "aten", "reference", "triton"),
    )
)


def _draw_fused_add(data, dtype, tiny=False) -> Case:
    shape, _ = rows_shape(data, tiny)
    s = seed_of(data)
    args = {"x": x_arg(data, shape, dtype, s), "residual": x_arg(data, shape, dtype, s + 3, "residual")}
    if optional(data, "weight"):
        args["weight"] = param_arg(data, shape[-1:], dtype, s + 1, "weight")
    return Case(args, dtype, {"eps": 1e-6})


def _fused_add_oracle(t, kw):
    h = t["x"] + t["residual"]  # torch adds half types in fp32 and rounds once, as the definition does
    return TF.rms_norm(h, h.shape[-1:], t.get("weight"), kw["eps"]), h


register(
    Op(
        "fused_add_rms_norm",
        ("functional.fused_add_rms_norm",),
        _draw_fused_add,
        lambda t, kw: NF.fused_add_rms_norm(t["x"], t["residual"], t.get("weight"), kw["eps"]),
        _fused_add_oracle,
        ("auto", "aten", "rows", "reference", "triton"),
        exact_outputs=(1,),
    )
)


# -- (N, C, *) scopes: GroupNorm, InstanceNorm, BatchNorm, masked and not ---------------------------


def _draw_group(masked: bool):
    def draw(data, dtype, tiny=False) -> Case:
        shape, g = channels_shape(data, tiny, min_spatial=1 if masked else 0, groups=True)
        s = seed_of(data)
        args = {"x": x_arg(data, shape, dtype, s)}
        if optional(data, "affine"):
            # weight and bias together: torch's CPU group_norm backward with a bias and no weight
            # raises "tensor does not have a device" (torch 2.13), and so does the aten path
            args["weight"] = param_arg(data, shape[1:2], dtype, s + 1, "weight")
            args["bias"] = param_arg(data, shape[1:2], dtype, s + 2, "bias", offset=0.0)
        if masked:
            args["mask"] = mask_arg(data, (shape[0], *shape[2:]), s + 4)
        return Case(args, dtype, {"groups": g, "eps": 1e-5})

    return draw


def _masked_group_oracle(t, kw):
    x = t["x"]
    y = masked_direct(x, t["mask"], tuple(range(1, x.dim())), kw["eps"], kw["groups"])
    return channel_affine(y, t.get("weight"), t.get("bias")).to(x.dtype)


register(
    Op(
        "group_norm",
        ("functional.group_norm",),
        _draw_group(False),
        lambda t, kw: NF.group_norm(t["x"], kw["groups"], t.get("weight"), t.get("bias"), kw["eps"]),
        lambda t, kw: TF.group_norm(t["x"], kw["groups"], t.get("weight"), t.get("bias"), kw["eps"]),
        ("auto", "aten", "reference", "triton"),
        bitwise=("aten",),
    )
)
register(
    Op(
        "group_norm_masked",
        (),
        _draw_group(True),
        lambda t, kw: NF.group_norm(t["x"], kw["groups"], t.get("weight"), t.get("bias"), kw["eps"], mask=t["mask"]),
        _masked_group_oracle,
        ("auto", "composite", "reference"),
        mask="mask",
    )
)


def _draw_instance(masked: bool):
    def draw(data, dtype, tiny=False) -> Case:
        shape, _ = channels_shape(data, tiny, min_spatial=1)
        s = seed_of(data)
        args = {"x": x_arg(data, shape, dtype, s)}
        if optional(data, "affine"):
            args["weight"] = param_arg(data, shape[1:2], dtype, s + 1, "weight")
            args["bias"] = param_arg(data, shape[1:2], dtype, s + 2, "bias", offset=0.0)
        if masked:
            args["mask"] = mask_arg(data, (shape[0], *shape[2:]), s + 4)
        elif not tiny and optional(data, "running statistics"):
            args["running_mean"] = param_arg(data, shape[1:2], dtype, s + 5, "running_mean", offset=0.0, grad=False)
            args["running_var"] = param_arg(data, shape[1:2], dtype, s + 6, "running_var", grad=False)
            args["running_var"] = dataclasses.replace(args["running_var"], values=args["running_var"].values.abs())
        return Case(args, dtype, {"eps": 1e-5, "momentum": 0.1})

    return draw


def _instance(fn):
    def run(t, kw):
        return fn(
            t["x"], t.get("running_mean"), t.get("running_var"), t.get("weight"), t.get("bias"), True,
            kw["momentum"], kw["eps"], **({"mask": t["mask"]} if "mask" in t else {}),
        )  # fmt: skip

    return run


def _masked_instance_oracle(t, kw):
    x = t["x"]
    y = masked_direct(x, t["mask"], tuple(range(2, x.dim())), kw["eps"], groups=x.shape[1])
    return channel_affine(y, t.get("weight"), t.get("bias")).to(x.dtype)


register(
    Op(
        "instance_norm",
        ("functional.instance_norm",),
        _draw_instance(False),
        _instance(NF.instance_norm),
        _instance(TF.instance_norm),
        ("auto", "aten", "reference", "triton"),
        state=("running_mean", "running_var"),
        bitwise=("aten",),
    )
)
register(
    Op(
        "instance_norm_masked",
        (),
        _draw_instance(True),
        _instance(NF.instance_norm),
        _masked_instance_oracle,
        ("auto", "composite", "reference"),
        mask="mask",
    )
)


def _draw_batch(training: bool, masked: bool = False):
    def draw(data, dtype, tiny=False) -> Case:
        shape, _ = channels_shape(data, tiny, min_spatial=1 if masked else 0)
        if training and math.prod(shape) // shape[1] < 2:
            shape = (max(2, shape[0]), *shape[1:])
        s = seed_of(data)
        c = shape[1:2]
        args = {"x": x_arg(data, shape, dtype, s)}
        if optional(data, "affine"):
            args["weight"] = param_arg(data, c, dtype, s + 1, "weight")
            args["bias"] = param_arg(data, c, dtype, s + 2, "bias", offset=0.0)
        args["running_mean"] = param_arg(data, c, dtype, s + 5, "running_mean", offset=0.0, grad=False)
        rv = param_arg(data, c, dtype, s + 6, "running_var", grad=False)
        args["running_var"] = dataclasses.replace(rv, values=rv.values.abs() + 0.1)
        if masked:
            args["mask"] = mask_arg(data, (shape[0], *shape[2:]), s + 4)
        return Case(args, dtype, {"eps": 1e-5, "momentum": 0.1, "training": training})

    return draw


def _batch(fn):
    def run(t, kw):
        extra = {"mask": t["mask"]} if "mask" in t else {}
        return fn(
            t["x"], t["running_mean"], t["running_var"], t.get("weight"), t.get("bias"), kw["training"],
            kw["momentum"], kw["eps"], **extra,
        )  # fmt: skip

    return run


def _masked_batch_oracle(t, kw):
    """Masked BatchNorm from its definition, with the running update (unbiased with the valid count)."""
    x, m = t["x"], t["mask"]
    acc = acc_of(x)
    xv = x.to(acc).movedim(1, -1)[m]  # (valid positions, C)
    n = xv.shape[0]
    mean, var = xv.mean(0), xv.var(0, unbiased=False)
    view = [1, -1] + [1] * (x.dim() - 2)
    y = (x.to(acc) - mean.reshape(view)) * torch.rsqrt(var.reshape(view) + kw["eps"])
    with torch.no_grad():
        f = kw["momentum"]
        for buf, new in ((t["running_mean"], mean), (t["running_var"], var * n / max(n - 1, 1))):
            buf.copy_(buf.to(acc) * (1 - f) + new.detach() * f)
    return channel_affine(y, t.get("weight"), t.get("bias")).to(x.dtype)


def _torch_batch_norm(x, running_mean, running_var, weight=None, bias=None, training=False, *args):
    """torch's ``F.batch_norm``: its forward's bits as it computes them on the views given, its gradient
    with the weight -- and in evaluation the running statistics -- contiguous where ATen's CPU backward
    misreads them: fp32/fp64 input with one position per channel ((N, C), (N, C, 1)) or channels_last,
    whose kernel reads them as contiguous memory (an expanded or strided one gives an input gradient off
    by up to ~1e38). (The contiguous copies alone would change the forward too: ATen's forward takes
    another kernel, an ulp apart, when all its tensors are contiguous.)

    In evaluation, an input in neither contiguous layout is copied to a contiguous one first, as
    normscope does (``_bn_layout``): ATen's kernel for it is less accurate, and not batch-invariant."""
    d = x.dim()
    cl = torch.channels_last if d == 4 else torch.channels_last_3d if d == 5 else None
    channels_last = False
    if x.device.type == "cpu" and not x.is_contiguous():
        channels_last = cl is not None and x.is_contiguous(memory_format=cl)
        if not training and not channels_last:
            x = x.contiguous()
    one_position = d <= 2 or math.prod(x.shape[2:]) == 1
    if not (x.dtype in (torch.float32, torch.float64) and (one_position or channels_last)):
        return TF.batch_norm(x, running_mean, running_var, weight, bias, training, *args)
    w, rm, rv = weight, running_mean, running_var
    with torch.no_grad():  # the forward's bits: on the views, the running statistics on copies in training
        if training and rm is not None:
            rm, rv = (torch.empty_strided(t.shape, t.stride(), dtype=t.dtype).copy_(t) for t in (rm, rv))
        bits = TF.batch_norm(x, rm, rv, w, bias, training, *args)
    weight = None if weight is None else weight.contiguous()
    if not training and running_mean is not None:
        running_mean, running_var = running_mean.contiguous(), running_var.contiguous()
    y = TF.batch_norm(x, running_mean, running_var, weight, bias, training, *args)
    # bits' values, y's gradient: written under y, whose backward does not read it (autograd's version
    # counter would say so); an op on the graph would hand the backward another upstream gradient's layout
    y.detach().copy_(bits)
    return y


_RUNNING = ("running_mean", "running_var")
register(
    Op(
        "batch_norm",
        ("functional.batch_norm",),
        _draw_batch(True),
        _batch(NF.batch_norm),
        _batch(_torch_batch_norm),
        ("auto", "aten", "reference", "triton"),
        per_sample=False,  # training: the batch is the scope, by design
        state=_RUNNING,
        bitwise=("aten",),
    )
)
register(
    Op(
        "batch_norm_eval",
        (),
        _draw_batch(False),
        _batch(NF.batch_norm),
        _batch(_torch_batch_norm),
        ("auto", "aten", "reference", "triton"),
        state=_RUNNING,
        bitwise=("aten",),
    )
)
register(
    Op(
        "batch_norm_masked",
        (),
        _draw_batch(True, masked=True),
        _batch(NF.batch_norm),
        _masked_batch_oracle,
        ("auto", "composite", "reference", "triton"),
        per_sample=False,
        mask="mask",
        state=_RUNNING,
    )
)


def _draw_normalize(data, dtype, tiny=False) -> Case:
    shape, _ = channels_shape(data, tiny, min_spatial=1)  # (N, C) would be the rows of LayerNorm
    s = seed_of(data)
    args = {
        "x": x_arg(data, shape, dtype, s),
        "weight": param_arg(data, shape[1:2], dtype, s + 1, "weight"),
        "bias": param_arg(data, shape[1:2], dtype, s + 2, "bias", offset=0.0),
    }
    return Case(args, dtype, {"eps": 1e-5})


register(
    Op(
        "normalize",  # the generic engine entry, on a scope no torch-named op has: LayerNorm over axis 1
        ("functional.normalize", "normalize"),
        _draw_normalize,
        lambda t, kw: NF.normalize(t["x"], dims=1, weight=t["weight"], bias=t["bias"], eps=kw["eps"]),
        lambda t, kw: TF.layer_norm(
            t["x"].movedim(1, -1), t["x"].shape[1:2], t["weight"], t["bias"], kw["eps"]
        ).movedim(-1, 1),
        ("auto", "aten", "reference"),
    )
)


def _draw_lrn(data, dtype, tiny=False) -> Case:
    shape, _ = channels_shape(data, tiny, min_spatial=1)
    size = data.draw(st.integers(1, 5), label="size")
    x = x_arg(data, shape, dtype, seed_of(data))
    if len(shape) > 3 and x.layout == "transposed":
        # torch's own local_response_norm views a 4-D/5-D input in a way these strides refuse
        # (RuntimeError "view size is not compatible"), and normscope runs torch's op
        x = dataclasses.replace(x, layout="strided")
    return Case({"x": x}, dtype, {"size": size})


register(
    Op(
        "local_response_norm",  # outside the mean/variance family: ATen's op, no backend to choose
        ("functional.local_response_norm",),
        _draw_lrn,
        lambda t, kw: NF.local_response_norm(t["x"], kw["size"]),
        lambda t, kw: TF.local_response_norm(t["x"], kw["size"]),
        ("auto",),
        bitwise=("auto",),
        engine=False,
        dtypes=(F32, F64),  # torch's avg_pool3d, which it runs on, has no CPU half kernels
    )
)


def _draw_adain(data, dtype, tiny=False) -> Case:
    shape, _ = channels_shape(data, tiny, min_spatial=1)
    s = seed_of(data)
    style_shape = (shape[0], shape[1], *(n + 1 for n in shape[2:]))
    args = {
        "content": x_arg(data, shape, dtype, s, "content"),
        "style": x_arg(data, style_shape, dtype, s + 1, "style"),
    }
    return Case(args, dtype, {"eps": 1e-5})


def _adain_oracle(t, kw):
    """Huang & Belongie's AdaIN from its formula: biased instance statistics, eps inside the root."""
    c, s = t["content"], t["style"]
    acc = acc_of(c)
    dims = tuple(range(2, c.dim()))

    def stats(u):
        u = u.to(acc)
        return u.mean(dims, keepdim=True), torch.sqrt(u.var(dims, unbiased=False, keepdim=True) + kw["eps"])

    (mc, sc), (ms, ss) = stats(c), stats(s)
    return ((c.to(acc) - mc) / sc * ss + ms).to(c.dtype)


register(
    Op(
        "adain",  # engine.stats and engine.apply: the two pure steps, no dispatch
        ("functional.adain",),
        _draw_adain,
        lambda t, kw: NF.adain(t["content"], t["style"], kw["eps"]),
        _adain_oracle,
        ("auto",),
        engine=False,
    )
)


# -- the modern norms -------------------------------------------------------------------------------


def _draw_modulated(norm: str):
    def draw(data, dtype, tiny=False) -> Case:
        shape, _ = rows_shape(data, tiny)
        s = seed_of(data)
        per_token = optional(data, "per-token modulation")
        mshape = shape if per_token else (shape[0], shape[-1])
        args = {
            "x": x_arg(data, shape, dtype, s),
            "shift": x_arg(data, mshape, dtype, s + 1, "shift"),
            "scale": dataclasses.replace(x_arg(data, mshape, dtype, s + 2, "scale")),
        }
        if optional(data, "elementwise affine"):
            args["weight"] = param_arg(data, shape[-1:], dtype, s + 3, "weight")
            if norm == "layer":
                args["bias"] = param_arg(data, shape[-1:], dtype, s + 4, "bias", offset=0.0)
        return Case(args, dtype, {"eps": 1e-6, "norm": norm})

    return draw


def _modulated_oracle(t, kw):
    """DiT's adaLN modulation, ``norm(x) * (1 + scale) + shift``, in fp32 and rounded once."""
    x = t["x"]
    acc = acc_of(x)
    d = x.shape[-1]

    def mod(m):
        return m.to(acc).reshape(m.shape[0], *([1] * (x.dim() - 2)), d) if m.dim() == 2 and x.dim() > 2 else m.to(acc)

    w = None if t.get("weight") is None else t["weight"].to(acc)
    if kw["norm"] == "layer":
        b = None if t.get("bias") is None else t["bias"].to(acc)
        y = TF.layer_norm(x.to(acc), (d,), w, b, kw["eps"])
    else:
        y = TF.rms_norm(x.to(acc), (d,), w, kw["eps"])
    return (y * (1 + mod(t["scale"])) + mod(t["shift"])).to(x.dtype)


def _modulated_run(t, kw):
    return NF.modulated_norm(t["x"], t["shift"], t["scale"], t.get("weight"), t.get("bias"), kw["eps"], norm=kw["norm"])


register(
    Op(
        "modulated_norm_layer",
        ("functional.modulated_norm", "functional_modern.modulated_norm"),
        _draw_modulated("layer"),
        _modulated_run,
        _modulated_oracle,
        ("auto", "aten", "reference", "triton"),
    )
)
register(
    Op(
        "modulated_norm_rms",
        ("functional.modulated_norm", "functional_modern.modulated_norm"),
        _draw_modulated("rms"),
        _modulated_run,
        _modulated_oracle,
        ("auto", "aten", "rows", "reference", "triton"),
    )
)


def _draw_qk(data, dtype, tiny=False) -> Case:
    d = data.draw(st.sampled_from((4, 8, 16) if tiny else (8, 16, 64, 128)), label="head_dim")
    h = data.draw(st.sampled_from((1, 2, 4)), label="heads")
    hk = data.draw(st.sampled_from([n for n in (1, 2, 4) if h % n == 0]), label="kv heads")
    seq = data.draw(st.sampled_from((1, 3, 16)), label="seq")
    layout = data.draw(st.sampled_from(["bshd", "bhsd"]), label="qk layout")
    per_head = data.draw(st.booleans(), label="per head")
    casting, offset = data.draw(st.sampled_from(families(tiny)), label="family")
    b = draw_batch(data, seq * (h + hk) * d, tiny)
    s = seed_of(data)

    def shape(heads):
        return (b, seq, heads, d) if layout == "bshd" else (b, heads, seq, d)

    wq = (d,) if per_head else (h * d,)
    wk = (d,) if per_head else (hk * d,)
    w_off, w_scale = (0.0, 0.1) if offset else (1.0, 0.5)
    args = {
        "q": x_arg(data, shape(h), dtype, s, "q"),
        "k": x_arg(data, shape(hk), dtype, s + 1, "k"),
        "q_weight": param_arg(data, wq, dtype, s + 2, "q_weight", offset=w_off, scale=w_scale),
        "k_weight": param_arg(data, wk, dtype, s + 3, "k_weight", offset=w_off, scale=w_scale),
    }
    kw = {"layout": layout, "per_head": per_head, "casting": casting, "offset": offset, "eps": 1e-6}
    return Case(args, dtype, kw)


def _qk_oracle(t, kw):
    """Qwen3 (llama casting), Gemma 3 (gemma casting, 1 + w) per head; OLMo 2 (gemma casting over
    H * head_dim, before the head split) without ``per_head``."""
    out = []
    for name in ("q", "k"):
        x, w = t[name], t[f"{name}_weight"]
        bshd = x if kw["layout"] == "bshd" else x.transpose(1, 2)
        flat = bshd if kw["per_head"] else bshd.flatten(-2)
        if kw["casting"] == "llama":
            y = llama_rms(flat, w, kw["eps"])
        else:
            y = gemma_rms(flat, w, kw["eps"], kw["offset"])
        y = y if kw["per_head"] else y.unflatten(-1, bshd.shape[-2:])
        out.append(y if kw["layout"] == "bshd" else y.transpose(1, 2))
    return tuple(out)


register(
    Op(
        "qk_norm",
        ("functional.qk_norm", "functional_modern.qk_norm"),
        _draw_qk,
        lambda t, kw: NF.qk_norm(
            t["q"],
            t["k"],
            t["q_weight"],
            t["k_weight"],
            kw["eps"],
            layout=kw["layout"],
            per_head=kw["per_head"],
            weight_offset=kw["offset"],
            casting=kw["casting"],
        ),  # fmt: skip
        _qk_oracle,
        ("auto", "aten", "rows", "reference", "triton"),
        bitwise_forward=("auto",),
    )
)


def _draw_poly(data, dtype, tiny=False) -> Case:
    shape, _ = rows_shape(data, tiny)
    s = seed_of(data)
    args = {
        "x": x_arg(data, shape, dtype, s),
        "weight": param_arg(data, (3,), dtype, s + 1, "weight", offset=1 / 3, scale=0.1),
        "bias": param_arg(data, (1,), dtype, s + 2, "bias"),
    }
    return Case(args, dtype, {"eps": 1e-6})


def _poly_oracle(t, kw):
    """PolyCom's PolyNorm (Motif's and Liger's module): three RMS norms of powers of x, in fp32."""
    x = t["x"]
    acc = acc_of(x)
    xf, w, b = x.to(acc), t["weight"].to(acc), t["bias"].to(acc)

    def norm(u):
        return u * torch.rsqrt(u.pow(2).mean(-1, keepdim=True) + kw["eps"])

    return (w[0] * norm(xf**3) + w[1] * norm(xf**2) + w[2] * norm(xf) + b).to(x.dtype)


register(
    Op(
        "poly_norm",
        ("functional.poly_norm", "functional_modern.poly_norm"),
        _draw_poly,
        lambda t, kw: NF.poly_norm(t["x"], t["weight"], t["bias"], kw["eps"]),
        _poly_oracle,
        ("auto", "aten", "rows", "reference", "triton"),
    )
)


def _draw_derf(data, dtype, tiny=False) -> Case:
    shape, _ = rows_shape(data, tiny)
    s = seed_of(data)
    args = {
        "x": x_arg(data, shape, dtype, s),
        "alpha": param_arg(data, (1,), dtype, s + 1, "alpha", offset=0.5, scale=0.1),
        "shift": param_arg(data, (1,), dtype, s + 2, "shift", offset=0.0, scale=0.1),
        "weight": param_arg(data, shape[-1:], dtype, s + 3, "weight"),
        "bias": param_arg(data, shape[-1:], dtype, s + 4, "bias", offset=0.0),
    }
    return Case(args, dtype, {"n": shape[-1]})


def _derf_oracle(t, kw):
    x = t["x"]
    acc = acc_of(x)
    y = torch.erf(x.to(acc) * t["alpha"].to(acc) + t["shift"].to(acc))
    return (y * t["weight"].to(acc) + t["bias"].to(acc)).to(x.dtype)


register(
    Op(
        "derf",  # element-wise: no statistics, so every backend name but triton runs the same torch ops
        ("functional.derf", "functional_modern.derf"),
        _draw_derf,
        lambda t, kw: NF.derf(t["x"], t["alpha"], t["shift"], t["weight"], t["bias"]),
        _derf_oracle,
        ("auto", "triton"),
        engine=False,
    )
)


# -- the layers: a normscope module and its oracle module, called with the case's tensors as their
#    parameters and buffers (torch.func.functional_call), so weight layouts reach the layers too


def layer_op(
    name: str,
    make: Callable[[dict], nn.Module],
    twin: Callable[[dict], nn.Module],
    draw: Callable[..., Case],
    paths: tuple[str, ...],
    *,
    inputs: tuple[str, ...] = ("x",),
    train: bool = True,
    **flags,
) -> Op:
    """An op for the layer class ``name``: ``make(kw)`` builds it, ``twin(kw)`` the oracle module with
    the same parameter and buffer names; every other tensor of the case is a parameter or buffer."""

    def call(factory):
        def run(t, kw):
            module = factory(kw).train(train)
            state = {n: v for n, v in t.items() if n not in inputs}
            return functional_call(module, state, tuple(t[n] for n in inputs))

        return run

    return Op(name, (name,), draw, call(make), call(twin), paths, **flags)


class _LayerNorm2dTwin(nn.Module):
    """timm's LayerNorm2d: LayerNorm over channels of (N, C, H, W), by permuting."""

    def __init__(self, c, eps):
        super().__init__()
        self.weight, self.bias, self.eps = nn.Parameter(torch.ones(c)), nn.Parameter(torch.zeros(c)), eps

    def forward(self, x):
        return TF.layer_norm(x.permute(0, 2, 3, 1), x.shape[1:2], self.weight, self.bias, self.eps).permute(0, 3, 1, 2)


class _DyTTwin(nn.Module):
    """DyT (Zhu et al. 2025): ``w * tanh(alpha * x) + b``, the authors' module."""

    def __init__(self, c):
        super().__init__()
        self.alpha, self.weight, self.bias = (
            nn.Parameter(torch.ones(1)),
            nn.Parameter(torch.ones(c)),
            nn.Parameter(torch.zeros(c)),
        )

    def forward(self, x):
        return torch.tanh(self.alpha * x) * self.weight + self.bias


class _FormulaTwin(nn.Module):
    """A module whose forward is one of the formulas above, over its own named parameters; its
    inputs are handed to the formula under ``inputs``' names."""

    def __init__(self, fn, kw, inputs=("x",), **params):
        super().__init__()
        self.fn, self.kw, self.inputs = fn, kw, inputs
        for n, shape in params.items():
            self.register_parameter(n, nn.Parameter(torch.ones(shape)))

    def forward(self, *xs):
        t = dict(self.named_parameters())
        t.update(zip(self.inputs, xs))
        return self.fn(t, self.kw)


class _PowerNormEvalTwin(nn.Module):
    """PowerNorm (Shen et al. 2020) in evaluation: ``x / sqrt(running_phi + eps) * w + b``."""

    def __init__(self, c, eps):
        super().__init__()
        self.weight, self.bias, self.eps = nn.Parameter(torch.ones(c)), nn.Parameter(torch.zeros(c)), eps
        self.register_buffer("running_phi", torch.ones(c))
        self.register_buffer("ema_gz", torch.zeros(1, 1, c))
        self.register_buffer("num_batches_tracked", torch.tensor(0))

    def forward(self, x):
        return x * torch.rsqrt(self.running_phi.to(x.dtype) + self.eps) * self.weight + self.bias


class _AdaLNTwin(nn.Module):
    """diffusers' AdaLayerNormZero-style adaLN: SiLU, Linear to (shift, scale), the modulation in fp32."""

    def __init__(self, d, cond, eps):
        super().__init__()
        self.linear, self.eps = nn.Linear(cond, 2 * d), eps

    def forward(self, x, cond):
        shift, scale = self.linear(TF.silu(cond)).chunk(2, dim=-1)
        return _modulated_oracle({"x": x, "shift": shift, "scale": scale}, {"norm": "layer", "eps": self.eps})


def _draw_layer_rows(centered: bool):
    def draw(data, dtype, tiny=False) -> Case:
        shape, _ = rows_shape(data, tiny)
        s = seed_of(data)
        args = {"x": x_arg(data, shape, dtype, s), "weight": param_arg(data, shape[-1:], dtype, s + 1, "weight")}
        if centered:
            args["bias"] = param_arg(data, shape[-1:], dtype, s + 2, "bias", offset=0.0)
        return Case(args, dtype, {"n": shape[-1], "eps": 1e-5})

    return draw


def _draw_layer_channels(
    *, dims: int | None, params=("weight", "bias"), running=False, tracked=True, steps=3, groups=False, spatial=0
):
    def draw(data, dtype, tiny=False) -> Case:
        shape, g = channels_shape(data, tiny, min_spatial=spatial, groups=groups)
        if dims is not None:  # BatchNorm1d/2d/3d: (N, C, L), (N, C, H, W), (N, C, D, H, W)
            shape = (*shape[:2], *(max(n, 2) for n in (shape[2:] + (2, 3, 2))[: dims - 2]))
            if math.prod(shape) // shape[1] < 2:
                shape = (2, *shape[1:])
        s = seed_of(data)
        c = shape[1:2]
        args = {"x": x_arg(data, shape, dtype, s)}
        for i, p in enumerate(params):
            args[p] = param_arg(data, c, dtype, s + 1 + i, p, offset=0.0 if p == "bias" else 1.0)
        if running:
            args["running_mean"] = param_arg(data, c, dtype, s + 5, "running_mean", offset=0.0, grad=False)
            rv = param_arg(data, c, dtype, s + 6, "running_var", grad=False)
            args["running_var"] = dataclasses.replace(rv, values=rv.values.abs() + 0.1)
            if tracked:
                args["num_batches_tracked"] = arg(torch.tensor(steps, dtype=torch.long))
        return Case(args, dtype, {"c": shape[1], "groups": g, "eps": 1e-5})

    return draw


def _draw_dyt(data, dtype, tiny=False) -> Case:
    case = _draw_derf(data, dtype, tiny)
    args = {n: a for n, a in case.args.items() if n != "shift"}
    return dataclasses.replace(case, args=args, kw={"n": case.args["x"].values.shape[-1]})


_ENGINE_ROWS = ("auto", "aten", "reference", "triton")
_ENGINE_CHANNELS = ("auto", "aten", "reference", "triton")

register(
    layer_op(
        "LayerNorm",
        lambda kw: normscope.LayerNorm(kw["n"], kw["eps"]),
        lambda kw: nn.LayerNorm(kw["n"], kw["eps"]),
        _draw_layer_rows(True),
        _ENGINE_ROWS,
        bitwise=("aten",),
    )
)
register(
    layer_op(
        "RMSNorm",
        lambda kw: normscope.RMSNorm(kw["n"], kw["eps"]),
        lambda kw: nn.RMSNorm(kw["n"], kw["eps"]),
        _draw_layer_rows(False),
        ("auto", "aten", "rows", "reference", "triton"),
        bitwise=("aten",),
    )
)
register(
    layer_op(
        "GroupNorm",
        lambda kw: normscope.GroupNorm(kw["groups"], kw["c"], kw["eps"]),
        lambda kw: nn.GroupNorm(kw["groups"], kw["c"], kw["eps"]),
        _draw_layer_channels(dims=None, groups=True, spatial=1),
        _ENGINE_CHANNELS,
        bitwise=("aten",),
    )
)
for _k in (1, 2, 3):
    register(
        layer_op(
            f"BatchNorm{_k}d",
            lambda kw, k=_k: getattr(normscope, f"BatchNorm{k}d")(kw["c"], kw["eps"]),
            lambda kw, k=_k: getattr(nn, f"BatchNorm{k}d")(kw["c"], kw["eps"]),
            _draw_layer_channels(dims=_k + 2, running=True),
            _ENGINE_CHANNELS,
            per_sample=False,
            state=(*_RUNNING, "num_batches_tracked"),
            bitwise=("aten",),
        )
    )
    register(
        layer_op(
            f"InstanceNorm{_k}d",
            lambda kw, k=_k: getattr(normscope, f"InstanceNorm{k}d")(kw["c"], kw["eps"], affine=True),
            lambda kw, k=_k: getattr(nn, f"InstanceNorm{k}d")(kw["c"], kw["eps"], affine=True),
            _draw_layer_channels(dims=_k + 2),
            _ENGINE_CHANNELS,
            bitwise=("aten",),
        )
    )
    register(
        layer_op(
            f"BatchRenorm{_k}d",  # at the first warmup step r, d are (1, 0): BatchNorm's numbers and updates
            lambda kw, k=_k: getattr(normscope, f"BatchRenorm{k}d")(kw["c"], kw["eps"], warmup_iters=1000),
            lambda kw, k=_k: getattr(nn, f"BatchNorm{k}d")(kw["c"], kw["eps"]),
            _draw_layer_channels(dims=_k + 2, running=True, steps=0),
            ("auto",),  # training computes its moments with the reference directly: no backend to force
            engine=False,
            per_sample=False,
            state=(*_RUNNING, "num_batches_tracked"),
        )
    )
register(
    layer_op(
        "SyncBatchNorm",  # one process, no group: BatchNorm
        lambda kw: normscope.SyncBatchNorm(kw["c"], kw["eps"]),
        lambda kw: nn.BatchNorm1d(kw["c"], kw["eps"]),
        _draw_layer_channels(dims=3, running=True),
        ("auto", "aten", "reference", "triton"),
        per_sample=False,
        state=(*_RUNNING, "num_batches_tracked"),
    )
)
register(
    layer_op(
        "FrozenBatchNorm2d",  # torchvision's: BatchNorm evaluation with buffers for weight and bias
        lambda kw: normscope.FrozenBatchNorm2d(kw["c"], kw["eps"]),
        lambda kw: nn.BatchNorm2d(kw["c"], kw["eps"]).eval(),
        _draw_layer_channels(dims=4, running=True, tracked=False),
        ("auto", "aten", "reference", "triton"),
        train=False,
    )
)
register(
    layer_op(
        "LocalResponseNorm",
        lambda kw: normscope.LocalResponseNorm(3),
        lambda kw: nn.LocalResponseNorm(3),
        _draw_layer_channels(dims=None, params=(), spatial=1),
        ("auto",),
        bitwise=("auto",),
        engine=False,
        dtypes=(F32, F64),
    )
)
register(
    layer_op(
        "LayerNorm2d",
        lambda kw: normscope.LayerNorm2d(kw["c"], kw["eps"]),
        lambda kw: _LayerNorm2dTwin(kw["c"], kw["eps"]),
        _draw_layer_channels(dims=4),
        ("auto", "aten", "reference"),
    )
)
register(
    layer_op(
        "DyT",
        lambda kw: normscope.DyT(kw["n"]),
        lambda kw: _DyTTwin(kw["n"]),
        _draw_dyt,
        ("auto",),
        engine=False,
    )
)
register(
    layer_op(
        "Derf",
        lambda kw: normscope.Derf(kw["n"]),
        lambda kw: _FormulaTwin(_derf_oracle, kw, alpha=(1,), shift=(1,), weight=(kw["n"],), bias=(kw["n"],)),
        _draw_derf,
        ("auto", "triton"),
        engine=False,
    )
)
register(
    layer_op(
        "PolyNorm",
        lambda kw: normscope.PolyNorm(eps=kw["eps"]),
        lambda kw: _FormulaTwin(_poly_oracle, kw, weight=(3,), bias=(1,)),
        _draw_poly,
        ("auto", "aten", "rows", "reference", "triton"),
    )
)
register(
    layer_op(
        "QKNorm",
        lambda kw: normscope.QKNorm(
            kw["d"],
            kw["h"],
            kw["hk"],
            per_head=kw["per_head"],
            eps=kw["eps"],
            layout=kw["layout"],
            weight_offset=kw["offset"],
            casting=kw["casting"],
        ),  # fmt: skip
        lambda kw: _FormulaTwin(_qk_oracle, kw, ("q", "k"), q_weight=(1,), k_weight=(1,)),
        lambda data, dtype, tiny=False: _qk_layer_case(_draw_qk(data, dtype, tiny)),
        ("auto", "aten", "rows", "reference", "triton"),
        inputs=("q", "k"),
        bitwise_forward=("auto",),
    )
)


def _qk_layer_case(case: Case) -> Case:
    q, k = case.args["q"].values, case.args["k"].values
    h_axis = 2 if case.kw["layout"] == "bshd" else 1
    kw = dict(case.kw, d=q.shape[-1], h=q.shape[h_axis], hk=k.shape[h_axis])
    return dataclasses.replace(case, kw=kw)


def _draw_adaln(data, dtype, tiny=False) -> Case:
    shape, _ = rows_shape(data, tiny)
    d, s = shape[-1], seed_of(data)
    cond = data.draw(st.sampled_from([3, 16]), label="cond_dim")
    args = {
        "x": x_arg(data, shape, dtype, s),
        "cond": x_arg(data, (shape[0], cond), dtype, s + 1, "cond"),
        "linear.weight": param_arg(data, (2 * d, cond), dtype, s + 2, "linear.weight", offset=0.0, scale=0.3),
        "linear.bias": param_arg(data, (2 * d,), dtype, s + 3, "linear.bias", offset=0.0, scale=0.3),
    }
    return Case(args, dtype, {"d": d, "cond": cond, "eps": 1e-6})


register(
    layer_op(
        "AdaLayerNorm",
        lambda kw: normscope.AdaLayerNorm(kw["d"], kw["cond"], eps=kw["eps"]),
        lambda kw: _AdaLNTwin(kw["d"], kw["cond"], kw["eps"]),
        _draw_adaln,
        ("auto", "aten", "reference", "triton"),
        inputs=("x", "cond"),
        # its condition goes through nn.Linear, whose CPU matrix product is not batch-invariant
        # (torch's own: the twin differs the same way); modulated_norm holds the norm's part of (b)
        per_sample=False,
    )
)
register(
    layer_op(
        "AdaIN",
        lambda kw: normscope.AdaIN(kw["eps"]),
        lambda kw: _FormulaTwin(_adain_oracle, kw, ("content", "style")),
        _draw_adain,
        ("auto",),
        inputs=("content", "style"),
        engine=False,
    )
)


def _draw_power(data, dtype, tiny=False) -> Case:
    shape, _ = rows_shape(data, tiny)
    s, c = seed_of(data), shape[-1]
    args = {
        "x": x_arg(data, shape, dtype, s),
        "weight": param_arg(data, (c,), dtype, s + 1, "weight"),
        "bias": param_arg(data, (c,), dtype, s + 2, "bias", offset=0.0),
        "running_phi": arg(values((c,), dtype, s + 3).abs() + 0.1),
        "ema_gz": arg(torch.zeros(1, 1, c, dtype=F64)),
        "num_batches_tracked": arg(torch.tensor(5, dtype=torch.long)),
    }
    return Case(args, dtype, {"n": c, "eps": 1e-5})


register(
    layer_op(
        "PowerNorm",  # evaluation: the running quadratic mean normalizes (training: tests/layers/test_powernorm.py)
        lambda kw: normscope.PowerNorm(kw["n"], kw["eps"]),
        lambda kw: _PowerNormEvalTwin(kw["n"], kw["eps"]),
        _draw_power,
        ("auto",),
        train=False,
        engine=False,
    )
)


#: public names that are not ops of the suite, each with the reason (and where it is tested)
NOT_OPS = {
    "functional.CASTINGS": "a constant: the casting names, drawn by rms_norm_family and qk_norm",
    "functional_modern.CASTINGS": "a constant, as above",
    "freeze_batchnorm": "model surgery, not a normalization (tests/layers/test_convert.py)",
    "unfreeze_batchnorm": "model surgery, not a normalization (tests/layers/test_convert.py)",
}


def public_names() -> set[str]:
    """Every public callable the table must cover: the functional modules' ``__all__`` and the layers."""
    names = {f"functional.{n}" for n in NF.__all__}
    names |= {f"functional_modern.{n}" for n in FM.__all__}
    # rms_norm / layer_norm of functional_modern (left out of its __all__ so as not to shadow
    # functional's) carry the family options: public, documented in docs/modern.md
    names |= {"functional_modern.rms_norm", "functional_modern.layer_norm"}
    names |= set(normscope.modules.__all__)
    names.add("normalize")
    return names


def covered_names() -> set[str]:
    return {n for op in OPS.values() for n in op.covers}


def pairs(select: Callable[[Op], bool] = lambda op: True) -> list:
    """``pytest.param(op, path)`` for every registered op and each of its paths."""
    import pytest

    return [pytest.param(op, p, id=f"{op.name}-{p}") for op in OPS.values() if select(op) for p in op.paths]


# ----------------------------------------------------------------------------------------------
# size thresholds: one large shape past each (the drawn shapes are the other side)


def _numel(shape, dtype, k):
    return math.prod(shape)


def _nbytes(shape, dtype, k):
    return math.prod(shape) * dtype.itemsize


def _sample(shape, dtype, k):  # the elements of one sample: a batch of one is one scope this large
    return math.prod(shape[1:])


def _positions(shape, dtype, k):  # the positions of one (sample, channel) scope
    return math.prod(shape[2:])


def _row_stats(shape, dtype, k):  # the statistics of a LayerNorm over the last k axes
    return math.prod(shape[:-k])


def _group_stats(shape, dtype, groups):
    return shape[0] * groups


def _instance_stats(shape, dtype, k):
    return shape[0] * shape[1]


@dataclasses.dataclass(frozen=True)
class Threshold:
    """A shape past a size threshold of the code, for ``op`` on ``paths``; ``properties``: which
    of (a) torch's numbers and (b) batch invariance it is checked for. ``constant`` names the
    threshold in the package (``"backends.rms.MIN_AUTO_ELEMENTS"``) and ``size(shape, dtype,
    k_or_groups)`` the quantity the code compares with it: ``test_registry`` reads the value from
    the code and holds the shape past it, so that a changed threshold cannot leave the case behind."""

    op: str
    shape: tuple[int, ...]
    k_or_groups: int
    dtype: torch.dtype
    paths: tuple[str, ...]
    properties: str
    constant: str
    size: Callable[[tuple[int, ...], torch.dtype, int], int]

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")


_MIN_AUTO, _BLOCKED, _BLOCK = (
    "backends.rms.MIN_AUTO_ELEMENTS",
    "backends.rms.BLOCKED_BYTES",
    "backends.rms.BLOCK_ELEMENTS",
)
_BOUNDED, _SPLIT, _SUM_BLOCK = "backends.aten._BOUNDED_MAX", "_registry.SPLIT_ELEMENTS", "backends.composite.SUM_BLOCK"
_RMS_BATCH = (300, 4096)  # 1.2M elements; a sample: 4096
THRESHOLDS = (
    Threshold("rms_norm", _RMS_BATCH, 1, F32, ("auto", "aten", "rows"), "ab", _MIN_AUTO, _numel),
    Threshold("rms_norm", _RMS_BATCH, 1, BF16, ("auto", "rows"), "ab", _BLOCK, _numel),  # bf16 rows by blocks
    Threshold("rms_norm", (300, 16, 1024), 1, F32, ("auto", "rows"), "b", _BLOCKED, _nbytes),  # 19.7 MB fp32
    Threshold("rms_norm_family", (1, 1024, 1024), 1, F32, ("auto",), "a", _MIN_AUTO, _numel),  # the family's bits
    Threshold("rms_norm_family", (1, 1024, 1024), 1, BF16, ("auto",), "a", _MIN_AUTO, _numel),
    Threshold("RMSNorm", _RMS_BATCH, 1, F32, ("auto",), "b", _MIN_AUTO, _numel),  # through the layer
    Threshold("poly_norm", _RMS_BATCH, 1, F32, ("auto",), "b", _MIN_AUTO, _numel),  # three RMS scopes
    Threshold("modulated_norm_rms", _RMS_BATCH, 1, F32, ("auto",), "b", _MIN_AUTO, _numel),  # under AdaLN
    Threshold("fused_add_rms_norm", _RMS_BATCH, 1, F32, ("auto",), "b", _MIN_AUTO, _numel),  # after the add
    Threshold("layer_norm", (600, 8), 1, F32, ("auto",), "ab", _BOUNDED, _row_stats),
    Threshold("group_norm", (300, 4, 2), 2, F32, ("auto",), "ab", _BOUNDED, _group_stats),
    Threshold("instance_norm", (200, 4, 3), 1, F32, ("auto",), "ab", _BOUNDED, _instance_stats),
    # one sample alone past SPLIT_ELEMENTS runs as a stride-0 pair (_registry._pairing): the drawn inputs
    # (CAP) never hold such a sample, so this is the one case where the lone sample takes that road
    Threshold("layer_norm", (3, 33000), 1, F32, ("auto", "aten", "reference"), "ab", _SPLIT, _sample),
    Threshold("group_norm", (2, 4, 8500), 2, F32, ("auto", "aten", "reference"), "ab", _SPLIT, _sample),
    # the rows path's own check of a lone row of SPLIT_ELEMENTS or more (rms.py)
    Threshold(
        "rms_norm", (3, 33000), 1, F32, ("auto", "rows", "reference"), "ab", "backends.rms.SPLIT_ELEMENTS", _sample
    ),
    # a masked scope of more than SUM_BLOCK positions is summed by blocks (composite); drawn scopes hold
    # at most 17^3 positions
    Threshold("instance_norm_masked", (2, 1, 16500), 1, F32, ("auto", "composite"), "ab", _SUM_BLOCK, _positions),
    Threshold("group_norm_masked", (2, 2, 16500), 1, F32, ("auto", "composite"), "ab", _SUM_BLOCK, _positions),
)

#: every size constant of the modules that choose a path or a blocking by size, and how the suite
#: meets it: a Threshold above, a drawn size, a Triton setting scaled in the interpreter
#: (test_isolation.TRITON_SCALED), or why it is no threshold of a result's bits. test_registry reads
#: the modules and fails on a constant named nowhere here.
SIZE_MODULES = ("backends.rms", "backends.aten", "backends.composite", "backends.rows", "_registry", "kernels.config")
SIZES_MET_ELSEWHERE = {
    "backends.rms.DW_GROUP_ROWS": "drawn row counts 1..300 x middle axes cross 16",
    "backends.aten._CANCEL_LIMIT": "draw_scale's (1e-3, 1e1): |mean| * rstd ~3000 past 1024 (test_registry checks it)",
    "_registry.MAX_PLANS": "a bound on a cache, not on a result's bits (tests/core/test_hot_path_state.py)",
    "_registry.GENERATION": "a counter, not a size",
    "backends.aten._FP32_MAX": "fp32's largest value, not a size",
    "kernels.config.ROWS_LOOP_BLOCK": "the looped chunk is min(it, ROWS_MAX_FUSED_N): scaled with the latter",
    "kernels.config.INTERPRETER_PROGRAMS": "drawn batches of 1..32 rows or scopes, past its 4 programs",
    "kernels.config.GROUPS_CL_WIDTH": "scaled with GROUPS_CL_TILE (groups-channels-last-split) through the tile",
    # BatchNorm's channels kernel: its scope is the batch (no per-sample property); its blocking is
    # crossed in tests/kernels/test_kernels.py, not here
    "kernels.config.CHANNELS_BLOCK_P": "BatchNorm's channels kernel: tests/kernels/test_kernels.py (not this suite)",
    "kernels.config.CHANNELS_MAX_BLOCK_C": "as CHANNELS_BLOCK_P",
    # the candidate kernels (kernels/variants.py): off unless forced (use_variant), pinned or named by a
    # measured row, so no path of this suite reaches them (NORMSCOPE_TEST_KERNEL_VARIANTS runs its Triton paths
    # on them); their own files cross their tiles, chunks and splits with every flag, dtype, stride and batch
    **{
        f"kernels.config.{n}": "the read-once rows candidates: tests/kernels/test_kernels_rows_once.py (off here)"
        for n in ("ROWS_ONCE_MAX_N", "ROWS_ONCE_FWD_CHUNK", "ROWS_ONCE_BWD_CHUNK")
    },
    **{
        f"kernels.config.{n}": "a candidate kernel's setting: tests/kernels/test_kernels_variants.py (off by default)"
        for n in (
            "CHANNELS_SPLIT_TILE",
            "CHANNELS_SPLIT_BLOCK_C",
            "CHANNELS_SPLIT_BLOCK_I",
            "CHANNELS_SPLIT_MIN_TILES",
            "CHANNELS_SPLIT_MAX",
            "CHANNELS_SPLIT_WARPS",
            "GROUPS_ONCHIP_MAX",
            "GROUPS_ONCHIP_WIDTH",
            "GROUPS_ONCHIP_WARP_ELEMS",
            "GROUPS_ONCHIP_MAX_WARPS",
        )
    },
    # launch parameters that the interpreter never reads (warps, programs per SM of a GPU)
    **{
        f"kernels.config.{n}": "a GPU launch parameter (warps or programs per SM): not read in the interpreter"
        for n in (
            "CHANNELS_PROGRAMS_PER_SM",
            "CHANNELS_WARPS",
            "GROUPS_MAX_WARPS",
            "GROUPS_WARP_ELEMS",
            "ROWS_BWD_PROGRAMS_PER_SM",
            "ROWS_LOOP_BWD_PROGRAMS_PER_SM",
            "ROWS_LOOP_WARP_ELEMS",
            "ROWS_MAX_WARPS",
            "ROWS_WARP_ELEMS",
            "ROWS_ONCE_WARPS",
            "ROWS_ONCE_SPLIT_WARPS",
            "ROWS_ONCE_BWD_WARPS",
            "ROWS_ONCE_BLOCKS_PER_SM",
        )
    },
}


# ----------------------------------------------------------------------------------------------
# running an op on a path


def draw_case(op: Op, path: str, data, dtypes: tuple[torch.dtype, ...] | None = None) -> Case:
    p = PATHS[path]
    allowed = [d for d in (dtypes or op.dtypes) if d in p.dtypes]
    dtype = data.draw(st.sampled_from(allowed), label="dtype")
    return op.draw(data, dtype, p.tiny)


def run(op: Op, path: str, case: Case, **kw) -> Result:
    """``op`` on ``case`` with the path's backend forced; asserts that the path is what ran."""
    p = PATHS[path]
    with engine.use_backend(p.backend):
        result = execute(op.run, case, state=op.state, **kw)
    if op.engine and p.reports is not None:
        assert result.ran == p.reports, f"{op.name} on path {path!r}: last_backend() says {result.ran!r}"
    return result
