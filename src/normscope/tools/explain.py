"""``normscope explain``: what one normalization layer does to one small tensor, in words and numbers.

For a layer -- any name of the table in :mod:`normscope.tools.named` (``batch``, ``layer``, ``instance``, ``group``,
``rms``, ``layer2d``, ``qknorm``, ``adaln``), its masked forms (``masked_batch``, ...), or a torch class name such as
``BatchNorm2d`` -- and an input (a small default one when no shape is given) it reports

* the *scope*: which axes share one mean and variance, how many scopes there are, how many
  elements each holds (valid elements only, for a masked norm);
* the statistics of every scope, from :mod:`normscope.reference`: mean, biased variance and 1/std;
  for RMSNorm, which subtracts no mean, the mean square and 1/rms instead (no mean is reported, as
  none is used);
* the normalized output of the normscope layer, and its largest difference to the ``torch.nn``
  layer of the same configuration, computed on the spot (for a layer torch has no class for: its
  ``torch.nn.functional`` equivalent; for a masked norm, torch has none: a float64 computation of each
  scope's mean and variance over its valid elements).

:func:`explain` returns all of it as a JSON-ready dict; :func:`render` prints it for people.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

import normscope

from .. import reference
from ..scope import Resolved, Scope
from ..terminal import Out, fmt, vec
from .named import MASKED, NAMED, parse, scope_ids

__all__ = [
    "KINDS",
    "BSD_KINDS",
    "UsageError",
    "default_shape",
    "explain",
    "parse_layer",
    "render",
    "scope_ids",
    "axis_names",
    "example_values",
]

#: the layers ``explain`` knows, with the torch class each compares against: the named layers that torch has
KINDS = {name: e.torch_class for name, e in NAMED.items() if e.torch_class is not None}

#: layers of the table that torch.nn has no class for, shown on (B, S, D) tokens and compared with
#: their torch.nn.functional equivalent (:meth:`normscope.tools.named.NamedLayer.torch_equivalent`)
BSD_KINDS = ("qknorm", "adaln")


#: where the affine of a BSD_KINDS layer comes from, in words (explain shows the output before it)
_AFFINE = {
    "qknorm": "weight: one value per head_dim position, shared by every head (Qwen3, Gemma 3); OLMo 2's norm "
    "over all heads is the rms layer over D",
    "adaln": "the affine is not a parameter: y * (1 + scale) + shift, with shift and scale computed from a "
    "conditioning tensor (Linear(SiLU(c)), one per sample or token); shown: the output before it, which is "
    "AdaLN-Zero's output at initialisation",
}

#: largest input explain accepts: it is for examples a person reads, not for tensors
MAX_ELEMENTS = 1 << 16


class UsageError(ValueError):
    """A bad command-line argument: ``argument`` names it (``--shape``), the message says why."""

    def __init__(self, argument: str, message: str) -> None:
        super().__init__(message)
        self.argument = argument


def parse_layer(name: str) -> tuple[str, int | None]:
    """``"BatchNorm2d"`` -> ``("batch", 2)``; ``"group"`` -> ``("group", None)``.

    The number is the spatial rank a torch class name implies (``1d``/``2d``/``3d``), else None. Names are read
    by :func:`normscope.tools.named.parse`, the one reader that ``draw`` uses too (a ``masked_`` prefix is accepted
    and not reported here: :func:`explain` reads it).
    """
    try:
        parsed = parse(name)
    except ValueError as e:
        raise UsageError("LAYER", str(e)) from None
    return parsed.name, parsed.spatial


def default_shape(kind: str, spatial: int | None = None) -> tuple[int, ...]:
    """The input ``explain`` uses when no shape is given: two samples, small enough to read every number,
    with more than one value in every scope. ``spatial`` is the rank a torch name implies (``BatchNorm2d``)."""
    if kind in ("batch", "instance"):
        return (2, 3, *((2,) * spatial if spatial and spatial > 1 else (4,)))
    return {"group": (2, 4, 3), "layer2d": (2, 3, 2, 2), "qknorm": (2, 3, 8)}.get(kind, (2, 3, 4))


def _default_divisor(n: int) -> int:
    """Groups (heads) when none are given: 2 where they divide ``n`` (``draw``'s default), else the smallest
    divisor above 1 (1 for ``n`` = 1)."""
    return next((g for g in (2, *range(3, n + 1)) if n % g == 0), 1)


def _default_lengths(n: int, length: int) -> tuple[int, ...]:
    """Valid lengths when a masked norm is asked for without ``--mask``: every other sample half padded."""
    return tuple(length if i % 2 == 0 else max(1, length // 2) for i in range(n))


def axis_names(rank: int) -> list[str]:
    """Conventional names of the axes of an input of ``rank``: (N, C, H, W) and friends."""
    return {1: ["D"], 2: ["N", "C"], 3: ["N", "C", "L"], 4: ["N", "C", "H", "W"], 5: ["N", "C", "D", "H", "W"]}.get(
        rank, [f"d{i}" for i in range(rank)]
    )


def example_values(shape: Sequence[int]) -> Tensor:
    """The default input: seeded normal values rounded to one decimal, like tutorials'
    hand-made examples (deterministic, easy to read, different in every position)."""
    g = torch.Generator().manual_seed(0)
    return (torch.randn(tuple(shape), generator=g) * 10).round() / 10


@dataclass(frozen=True)
class _Setup:
    kind: str
    shape: tuple[int, ...]
    groups: int | None  # GroupNorm's groups, QK-norm's heads
    last: int  # trailing axes of LayerNorm/RMSNorm
    eps: float
    lengths: tuple[int, ...] | None = None  # a masked norm: valid positions of each sample along the last axis

    @property
    def torch_name(self) -> str:
        entry = NAMED[self.kind]
        if entry.torch_class is None:
            return entry.title
        name = entry.torch_name(len(self.shape))
        return f"masked {name}" if self.lengths is not None else name

    def scope(self) -> Scope:
        if self.kind in BSD_KINDS:  # (B, S, D) tokens
            return NAMED[self.kind].scope("bsd", len(self.shape), self.groups or 1)
        # the (N, C, *) layout of the table; `last` matters to layer/rms only
        return NAMED[self.kind].scope("nchw", len(self.shape), self.groups or 1, self.last or None)

    def mask(self) -> Tensor | None:
        """The padding mask at the input's full shape (True = valid), or None."""
        if self.lengths is None:
            return None
        positions = torch.arange(self.shape[-1])
        valid = positions < torch.tensor(self.lengths).view(-1, *([1] * (len(self.shape) - 1)))
        return valid.expand(self.shape)

    def layer_args(self) -> tuple[tuple, dict]:
        c = self.shape[1] if len(self.shape) > 1 else None
        if self.kind in ("batch", "instance", "layer2d"):
            return (c,), {"eps": self.eps}
        if self.kind == "group":
            return (self.groups, c), {"eps": self.eps}
        return (list(self.shape[-self.last :]),), {"eps": self.eps}

    def layers(self) -> tuple[nn.Module, nn.Module]:
        """The normscope layer and its ``torch.nn`` namesake, same configuration, training mode."""
        args, kwargs = self.layer_args()
        ours = getattr(normscope, self.torch_name)(*args, **kwargs)
        theirs = getattr(nn, self.torch_name)(*args, **kwargs)
        return ours.train(), theirs.train()


def _setup(
    kind: str,
    spatial: int | None,
    shape: Sequence[int] | None,
    groups: int | None,
    last: int | None,
    eps: float,
    *,
    heads: int | None = None,
    lengths: Sequence[int] | None = None,
    masked: bool = False,
) -> _Setup:
    """Check the arguments (raising :class:`UsageError` naming the bad one) before any work. A missing shape,
    group count, head count or mask takes :func:`default_shape`'s and the defaults below."""
    masked = masked or lengths is not None
    if masked and kind not in MASKED:
        raise UsageError(
            "--mask", f"expected a layer with a masked form ({', '.join(MASKED)}), got --mask for {kind}"
        )
    shape = default_shape(kind, spatial) if shape is None else tuple(shape)
    rank = len(shape)
    if rank == 0 or any(not isinstance(s, int) or s < 1 for s in shape):
        raise UsageError("--shape", f"expected positive sizes such as 2,3,2,2, got {shape}")
    if math.prod(shape) > MAX_ELEMENTS:
        raise UsageError(
            "--shape",
            f"expected at most {MAX_ELEMENTS} elements (explain is for small examples), got {math.prod(shape)}",
        )
    if not (isinstance(eps, float | int) and eps >= 0):
        raise UsageError("--eps", f"expected a non-negative number, got {eps!r}")
    if heads is not None and kind != "qknorm":
        raise UsageError("--heads", f"only the qknorm layer takes --heads, got --heads {heads} for {kind}")
    if kind in BSD_KINDS:
        return _setup_bsd(kind, shape, groups, last, float(eps), heads)
    name = NAMED[kind].torch_class or NAMED[kind].title
    if kind in ("batch", "instance", "group"):
        lo, hi = (3 if kind == "instance" else 2), (5 if kind in ("batch", "instance") else 8)
        if spatial is not None:
            lo = hi = spatial + 2
            if kind == "batch" and spatial == 1:
                lo = 2  # torch's BatchNorm1d takes (N, C) as well as (N, C, L)
        if not lo <= rank <= hi:
            want = f"{lo} axes" if lo == hi else f"{lo} to {hi} axes"
            raise UsageError(
                "--shape",
                f"{name}{'' if spatial is None else f'{spatial}d'} expects {want} (N, C, ...), got {rank}: {shape}",
            )
    if kind == "layer2d" and rank < 2:
        raise UsageError("--shape", f"{name} expects (N, C, ...) with 2 axes at least, got {rank}: {shape}")
    if kind == "group":
        c = shape[1]
        if groups is None:
            groups = _default_divisor(c)
        if groups < 1 or c % groups:
            raise UsageError(
                "--groups",
                f"expected a number of groups dividing the {c} channels (valid: {_divisors(c)}), got {groups}",
            )
    elif groups is not None:
        raise UsageError(
            "--groups", f"only the group and qknorm layers take --groups, got --groups {groups} for {kind}"
        )
    if kind in ("layer", "rms"):
        if last is None:
            last = max(rank - 1, 1)  # everything but the batch axis: one scope per sample
        if not 1 <= last <= rank:
            raise UsageError("--last", f"expected 1 to {rank} trailing axes for an input of shape {shape}, got {last}")
    elif last is not None:
        raise UsageError("--last", f"only layer and rms take --last, got --last {last} for {kind}")
    if masked:
        lengths = _check_lengths(shape, lengths)
    setup = _Setup(kind, shape, groups, last or 0, float(eps), lengths)
    resolved = setup.scope().resolve(shape)
    mask = setup.mask()
    per_channel = resolved.count if mask is None else int(mask[:, 0].sum())
    if kind == "batch" and per_channel <= 1:
        valid = "" if mask is None else " valid"
        raise UsageError(
            "--mask" if mask is not None else "--shape",
            f"{setup.torch_name} in training needs more than one{valid} value per channel, got {per_channel} "
            f"for shape {shape}",
        )
    if kind == "instance" and mask is None and resolved.count <= 1:
        raise UsageError(
            "--shape",
            f"{setup.torch_name} in training needs more than one value per sample and channel, got "
            f"{resolved.count} for shape {shape}",
        )
    return setup


def _check_lengths(shape: tuple[int, ...], lengths: Sequence[int] | None) -> tuple[int, ...]:
    """A masked norm's valid lengths along the last axis, one per sample (each scope keeps one valid value)."""
    if len(shape) < 3:
        raise UsageError(
            "--shape",
            f"a masked norm needs (N, C, positions...) with 3 axes at least (the mask is along the last), got "
            f"{len(shape)}: {shape}",
        )
    n, length = shape[0], shape[-1]
    if lengths is None:
        return _default_lengths(n, length)
    lengths = tuple(lengths)
    if len(lengths) != n or any(not 1 <= v <= length for v in lengths):
        raise UsageError(
            "--mask",
            f"expected {n} valid lengths (one per sample), each 1 to {length} (the last axis), got "
            f"{','.join(map(str, lengths))}",
        )
    return lengths


def _setup_bsd(
    kind: str, shape: tuple[int, ...], groups: int | None, last: int | None, eps: float, heads: int | None
) -> _Setup:
    title = NAMED[kind].title
    if len(shape) != 3:
        raise UsageError(
            "--shape", f"{title} expects 3 axes (B, S, D): batch, tokens, features; got {len(shape)}: {shape}"
        )
    d = shape[2]
    if kind == "qknorm" and groups is not None:  # the heads are QK-norm's groups: --groups is accepted as --heads
        if heads is not None and heads != groups:
            raise UsageError("--heads", f"expected --heads and --groups to agree for qknorm, got {heads} and {groups}")
        heads, groups = groups, None
    if groups is not None:
        raise UsageError(
            "--groups", f"only the group and qknorm layers take --groups, got --groups {groups} for {kind}"
        )
    if kind == "qknorm":
        if heads is None:
            heads = _default_divisor(d)
        if heads < 1 or d % heads:
            raise UsageError(
                "--heads",
                f"expected a number of heads dividing the {d} features (valid: {_divisors(d)}), got {heads}",
            )
    if last is not None:
        raise UsageError("--last", f"only layer and rms take --last, got --last {last} for {kind}")
    return _Setup(kind, shape, heads, 0, eps)


def _outputs(setup: _Setup, x: Tensor) -> tuple[Tensor, Tensor, Tensor, str]:
    """``(y, y_torch, compared, what)``: normscope's output (the affine at its initial identity, or left out
    where it is not a parameter), an independent computation of the same normalization, which elements
    the two are compared on (a masked norm: the valid ones) and what computed the second."""
    from .. import functional_modern as FM

    kind, mask = setup.kind, setup.mask()
    everywhere = torch.ones(setup.shape, dtype=torch.bool)
    if mask is not None:
        return _masked_outputs(setup, x, mask)
    if kind == "qknorm":  # the (B, S, D) projection seen as (B, S, H, D/H) heads
        b, s, d = setup.shape
        h = setup.groups
        y = FM.qk_norm(x.view(b, s, h, d // h), x.view(b, s, h, d // h), eps=setup.eps)[0].reshape(b, s, d)
    elif kind == "adaln":
        y = FM.modulated_norm(x, eps=setup.eps)
    elif kind == "layer2d":
        y = normscope.LayerNorm2d(setup.shape[1], eps=setup.eps)(x)
    else:
        ours, theirs = setup.layers()
        return ours(x), theirs(x), everywhere, f"torch.nn.{setup.torch_name}"
    layout = "bsd" if kind in BSD_KINDS else "nchw"
    y_torch, what = NAMED[kind].torch_equivalent(x, layout, setup.groups or 1, setup.eps)
    return y, y_torch, everywhere, what


def _masked_outputs(setup: _Setup, x: Tensor, mask: Tensor) -> tuple[Tensor, Tensor, Tensor, str]:
    """A masked norm: the normscope layer (``mask=`` of BatchNorm, InstanceNorm, GroupNorm; ``normalize`` over
    the last axes for LayerNorm, whose module takes no mask) against each scope's mean and biased variance over
    its valid elements, computed directly in float64 (torch has no masked layer)."""
    kind, eps = setup.kind, setup.eps
    if kind == "layer":
        rank = len(setup.shape)
        y = normscope.normalize(x, dims=tuple(range(rank - setup.last, rank)), eps=eps, mask=mask)
    else:
        args, kwargs = setup.layer_args()
        y = getattr(normscope, NAMED[kind].torch_name(len(setup.shape)))(*args, **kwargs).train()(x, mask=mask[:, 0])
    ids = scope_ids(setup.scope().resolve(setup.shape), mask=mask)
    x64, y_ref = x.double(), torch.zeros(setup.shape, dtype=torch.float64)
    for sid in ids.unique().tolist():
        if sid < 0:
            continue
        members = ids == sid
        vals = x64[members]
        y_ref[members] = (vals - vals.mean()) / torch.sqrt(vals.var(unbiased=False) + eps)
    what = "each scope's torch.mean and torch.var over its valid elements, float64 (torch.nn has no masked layer)"
    return y, y_ref.float(), mask, what


def _divisors(n: int) -> list[int]:
    return [g for g in range(1, n + 1) if n % g == 0]


def _where(index: Sequence[int], resolved: Resolved, names: list[str]) -> str:
    """Name a scope by its kept coordinates: ``n=0, c=2`` or ``n=1, g=0 (c=0..1)``."""
    parts = []
    for d, i in enumerate(index):
        if d == resolved.group_dim and resolved.groups > 1:
            per = resolved.shape[d] // resolved.groups
            parts.append(f"g={i} ({names[d].lower()}={i * per}..{i * per + per - 1})")
        elif d not in resolved.reduce:
            parts.append(f"{names[d].lower()}={i}")
    return ", ".join(parts) or "all"


def describe(resolved: Resolved, names: list[str]) -> str:
    """The scope in one sentence."""
    d = resolved.group_dim
    reduced = [names[a] for a in resolved.reduce if not (resolved.groups > 1 and a == d)]
    kept = [names[a] for a in range(len(names)) if a not in resolved.reduce]
    if resolved.groups > 1:
        per = resolved.shape[d] // resolved.groups
        reduced = [f"{names[d]} (the {per} channels of one group)"] + reduced
        kept.append("group")
    what = "mean and variance" if resolved.centered else "mean square (no mean: uncentered)"
    if not kept:
        return f"one {what} over {', '.join(reduced)}: the whole input is one scope"
    return f"one {what} over {', '.join(reduced)}, separately for each {' and '.join(kept)}"


def explain(
    layer: str,
    shape: Sequence[int] | None = None,
    groups: int | None = None,
    values: Sequence[float] | Tensor | None = None,
    eps: float = 1e-5,
    last: int | None = None,
    *,
    heads: int | None = None,
    mask: Sequence[int] | None = None,
) -> dict:
    """Explain one layer on one input; everything JSON-serializable.

    Args:
        layer: a name of :func:`normscope.tools.named.spellings` (``batch``, ``layer``, ``instance``, ``group``,
            ``rms``, ``layer2d``, ``qknorm``, ``adaln``, ``masked_batch``, ...) or a torch class name.
        shape: the input shape, e.g. ``(2, 3, 2, 2)``. Default: :func:`default_shape` of the layer.
        groups: GroupNorm's number of groups; for ``qknorm`` the same as ``heads`` (its heads are groups of D).
            Refused for other layers. Default: 2 where it divides the channels, else their smallest divisor
            above 1.
        values: the input's values in row-major order. Default: :func:`example_values`.
        eps: added to the variance. Default: 1e-5.
        last: trailing axes normalized by LayerNorm/RMSNorm. Default: all but the first axis.
        heads: QK-norm's number of heads splitting D (refused for other layers). Default: as ``groups``.
        mask: valid lengths along the last axis, one per sample: the masked form of batch, instance, group
            or layer. Default: none, or for a ``masked_`` name every other sample half padded.

    Raises:
        UsageError: a bad argument, named in ``err.argument``.
    """
    try:
        kind, spatial, masked = parse(layer)
    except ValueError as e:
        raise UsageError("LAYER", str(e)) from None
    setup = _setup(kind, spatial, shape, groups, last, eps, heads=heads, lengths=mask, masked=masked)
    shape = setup.shape
    if values is None:
        x = example_values(shape)
    else:
        flat = torch.as_tensor(values, dtype=torch.float32).flatten()
        if flat.numel() != math.prod(shape):
            raise UsageError(
                "--values",
                f"expected {math.prod(shape)} values for shape {','.join(map(str, shape))}, got {flat.numel()}",
            )
        x = flat.reshape(shape)

    bsd = kind in BSD_KINDS
    names = ["B", "S", "D"] if bsd else axis_names(len(shape))
    resolved = setup.scope().resolve(shape)
    valid = setup.mask()
    ids = scope_ids(resolved, mask=valid)
    m = reference.moments(x, resolved, valid)
    rstd = reference.rstd(m.var, setup.eps)

    with torch.no_grad():
        y, y_torch, compared, torch_call = _outputs(setup, x)
    diff = _max_abs_diff(y[compared], y_torch[compared])
    agree = bool(torch.allclose(y[compared], y_torch[compared], atol=1e-6, rtol=1e-5, equal_nan=True))
    verdict = {"max_abs_diff": diff, "allclose": agree}
    if not agree:
        # torch is the floor, not the bar (DESIGN.md): where the two part, float64 says which is right; a
        # normscope output no further from it than torch's passes (torch's one-pass fp32 statistics lose
        # digits on an input such as 1e4 + small noise, or give a constant channel a nonzero output)
        y64 = _float64_output(x, ids, resolved.centered, setup.eps)[compared]
        ours, theirs = _max_abs_diff(y[compared], y64), _max_abs_diff(y_torch[compared], y64)
        verdict["float64_max_abs_diff"] = {"normscope": ours, "torch": theirs}
        verdict["closer_to_float64"] = bool(ours <= theirs)
    words = describe(resolved, names)
    if kind == "qknorm":
        words = words.replace("channels of one group", "features of one head").replace("and group", "and head")

    stats = []
    for sid, index in enumerate(_indices(resolved.stat_shape)):
        row = {"scope": sid, "where": _where(index, resolved, names), "count": int((ids == sid).sum())}
        if resolved.centered:
            row.update(mean=m.mean[index].item(), var=m.var[index].item())
        else:
            # uncentered (RMSNorm): the reference's "var" is the mean square and its mean is a placeholder
            # zero; reporting "mean 0" and a "variance" would describe statistics RMSNorm never computes
            row["mean_square"] = m.var[index].item()
        row["rstd"] = rstd[index].item()
        stats.append(row)
    return {
        "layer": kind,
        "torch_layer": setup.torch_name,
        "shape": list(shape),
        "axes": names,
        "groups": setup.groups,
        "last": setup.last if kind in ("layer", "rms") else None,
        "eps": setup.eps,
        "torch_call": torch_call,
        "affine": _AFFINE.get(kind),
        "scope": {
            "words": words,
            "reduced_axes": [names[d] for d in resolved.reduce],
            "grouped_axis": names[resolved.group_dim] if resolved.groups > 1 else None,
            "centered": resolved.centered,
            "num_scopes": len(stats),
            # counted from the id map: one size for an unmasked input; a masked one's scopes differ
            "elements_per_scope": stats[0]["count"] if len({r["count"] for r in stats}) == 1 else None,
        },
        "stats": stats,
        "input": x.tolist(),
        "scope_ids": ids.tolist(),
        "output": y.tolist(),
        "mask_lengths": None if setup.lengths is None else list(setup.lengths),
        "torch": verdict,
    }


def passed(result: dict) -> bool:
    """Whether :func:`explain`'s output is right: torch's within 1e-5, or no further than torch's from float64."""
    return bool(result["torch"]["allclose"] or result["torch"].get("closer_to_float64", False))


def _max_abs_diff(a: Tensor, b: Tensor) -> float:
    """max |a - b| in float64, where a NaN or infinity in both at one place counts as equal (torch's too)."""
    a, b = a.double(), b.double()
    same = (a == b) | (a.isnan() & b.isnan())
    d = torch.where(same, torch.zeros_like(a), (a - b).abs())
    return d.max().item() if d.numel() else 0.0


def _float64_output(x: Tensor, ids: Tensor, centered: bool, eps: float) -> Tensor:
    """Each scope's normalized values, computed in float64 from its own elements (the affine at identity)."""
    x64, y = x.double(), torch.full(x.shape, float("nan"), dtype=torch.float64)
    for sid in ids.unique().tolist():
        if sid < 0:
            continue
        members = ids == sid
        v = x64[members]
        mean = v.mean() if centered else v.new_zeros(())
        y[members] = (v - mean) / torch.sqrt((v - mean).square().mean() + eps)
    return y


def _indices(shape: Sequence[int]) -> list[tuple[int, ...]]:
    return [
        tuple(int(i) for i in idx)
        for idx in torch.cartesian_prod(*(torch.arange(s) for s in shape)).reshape(-1, len(shape))
    ]


MAX_ROWS = 48


def render(result: dict, out: Out) -> None:
    """Print an :func:`explain` result for people."""
    shape, names = result["shape"], result["axes"]
    scope = result["scope"]
    extra = f", groups={result['groups']}" if result["groups"] else ""
    if result["last"] and result["last"] < len(shape):
        k = result["last"]
        extra += ", normalized over the last axis" if k == 1 else f", normalized over the last {k} axes"
    out.heading(
        f"{result['torch_layer']} on an input of shape ({', '.join(f'{n}={s}' for n, s in zip(names, shape))}){extra}"
    )
    out.line(f"Scope: {scope['words']}.")
    if result.get("affine"):
        out.line(f"Affine: {result['affine']}.")
    if result.get("mask_lengths"):
        out.line(
            f"Mask: valid lengths {','.join(map(str, result['mask_lengths']))} along the last axis, one per sample; "
            "padding (scope -1) enters no statistic."
        )
    counts = sorted({s["count"] for s in result["stats"]})
    size = str(counts[0]) if len(counts) == 1 else f"{counts[0]} to {counts[-1]}"
    size += " valid" if result.get("mask_lengths") else ""
    out.line(
        f"       {scope['num_scopes']} scope(s) of {size} elements; "
        f"each element is normalized with the statistics of its scope (eps={fmt(result['eps'])})."
    )

    stats = result["stats"]
    if scope["centered"]:
        headers, keys = ["mean", "variance", "1/std"], ["mean", "var", "rstd"]
    else:
        headers, keys = ["mean square", "1/rms"], ["mean_square", "rstd"]
    out.table(
        ["scope", "where", "elements", *headers],
        [[s["scope"], s["where"], s["count"], *(fmt(s[k]) for k in keys)] for s in stats[:MAX_ROWS]],
        title="Statistics per scope",
        align="rlr" + "r" * len(keys),
    )
    if len(stats) > MAX_ROWS:
        out.line(f"  ... {len(stats) - MAX_ROWS} more scopes (use --json for all)")

    # rows over the first (up to) two axes, the rest of each row flattened
    lead = min(2, len(shape) - 1) if len(shape) > 1 else 0
    x = torch.tensor(result["input"]).reshape(math.prod(shape[:lead]), -1)
    y = torch.tensor(result["output"]).reshape(x.shape)
    ids = torch.tensor(result["scope_ids"]).reshape(x.shape)
    rows = []
    for r, index in enumerate(_indices(shape[:lead]) if lead else [()]):
        sids = sorted(set(ids[r].tolist()))
        rows.append(
            [
                " ".join(f"{n.lower()}={i}" for n, i in zip(names, index)) or "all",
                ",".join(map(str, sids)),
                vec(x[r].tolist(), 1),
                vec(y[r].tolist()),
            ]
        )
    out.table(["row", "scope", "input", "normalized (normscope)"], rows[:MAX_ROWS], title="Values", align="lrll")
    if len(rows) > MAX_ROWS:
        out.line(f"  ... {len(rows) - MAX_ROWS} more rows (use --json for all)")
    t = result["torch"]
    ok = passed(result)
    who = result.get("torch_call") or "torch.nn." + result["torch_layer"]
    if t["allclose"]:
        out.line(
            f"{who} gives the same output: max |normscope - torch| = {t['max_abs_diff']:.2e}  [{out.mark(True)}]",
            style="green",
        )
    else:
        out.line(f"{who} gives another output: max |normscope - torch| = {t['max_abs_diff']:.2e}")
        f64 = t["float64_max_abs_diff"]
        out.line(
            f"against float64 (each scope's mean and variance): max |normscope - float64| = {f64['normscope']:.2e}, "
            f"max |torch - float64| = {f64['torch']:.2e}: "
            + ("normscope is the closer one" if ok else "normscope is further off than torch")
            + f"  [{out.mark(ok)}]",
            style="green" if ok else "bold red",
        )
