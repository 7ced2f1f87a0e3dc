"""``normscope explain``: what one normalization layer does to one small tensor, in words and numbers.

For a layer (``batch``, ``layer``, ``instance``, ``group``, ``rms`` or a torch name such as
``BatchNorm2d``) and an input shape it reports

* the *scope*: which axes share one mean and variance, how many scopes there are, how many
  elements each holds;
* the statistics of every scope, from :mod:`normscope.reference`: mean, biased variance and 1/std;
  for RMSNorm, which subtracts no mean, the mean square and 1/rms instead (no mean is reported, as
  none is used);
* the normalized output of the normscope layer, and its largest difference to the ``torch.nn``
  layer of the same configuration, computed on the spot.

:func:`explain` returns all of it as a JSON-ready dict; :func:`render` prints it for people.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

import normscope

from . import reference
from ._term import Out, fmt, vec
from .named import NAMED, scope_ids
from .scope import Resolved, Scope

__all__ = [
    "KINDS",
    "BSD_KINDS",
    "UsageError",
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
#: their torch.nn.functional equivalent (:meth:`normscope.named.NamedLayer.torch_equivalent`)
BSD_KINDS = ("qk", "adaln")

_ALIASES = {alias: name for name in KINDS for alias in NAMED[name].aliases}
_ALIASES.update({"qknorm": "qk", "adalnzero": "adaln", "adalayer": "adaln", "adaptivelayer": "adaln"})

#: where the affine of a BSD_KINDS layer comes from, in words (explain shows the output before it)
_AFFINE = {
    "qk": "weight: one value per head_dim position, shared by every head (Qwen3, Gemma 3); OLMo 2's norm "
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

    The number is the spatial rank a torch class name implies (``1d``/``2d``/``3d``), else None.
    """
    key = name.strip().lower().replace("_", "").replace("-", "")
    spatial = None
    if key[-2:] in ("1d", "2d", "3d"):
        spatial, key = int(key[-2]), key[:-2]
    for suffix in ("normalization", "norm"):
        if key.endswith(suffix) and key != suffix:
            key = key[: -len(suffix)]
            break
    key = _ALIASES.get(key, key)
    if key in BSD_KINDS and spatial is None:
        return key, None
    if key not in KINDS or (spatial is not None and not NAMED[key].per_rank):
        torch_names = ", ".join(f"{c}1d/2d/3d" if NAMED[k].per_rank else c for k, c in KINDS.items())
        names = ", ".join([*KINDS, *BSD_KINDS]) + f" (or torch names: {torch_names})"
        raise UsageError("LAYER", f"unknown layer {name!r}; expected one of {names}")
    return key, spatial


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
    groups: int | None
    last: int  # trailing axes of LayerNorm/RMSNorm
    eps: float

    @property
    def torch_name(self) -> str:
        if self.kind in BSD_KINDS:
            return NAMED[self.kind].title
        return NAMED[self.kind].torch_name(len(self.shape))

    def scope(self) -> Scope:
        if self.kind in BSD_KINDS:  # (B, S, D) tokens
            return NAMED[self.kind].scope("bsd", len(self.shape), self.groups or 1)
        # the (N, C, *) layout of the table; `last` matters to layer/rms only
        return NAMED[self.kind].scope("nchw", len(self.shape), self.groups or 1, self.last or None)

    def layer_args(self) -> tuple[tuple, dict]:
        c = self.shape[1] if len(self.shape) > 1 else None
        if self.kind in ("batch", "instance"):
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
    kind: str, spatial: int | None, shape: Sequence[int], groups: int | None, last: int | None, eps: float
) -> _Setup:
    """Check the arguments (raising :class:`UsageError` naming the bad one) before any work."""
    shape = tuple(shape)
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
    if kind in BSD_KINDS:
        return _setup_bsd(kind, shape, groups, last, float(eps))
    name = KINDS[kind]
    if kind in ("batch", "instance", "group"):
        lo, hi = (3 if kind == "instance" else 2), (5 if kind in ("batch", "instance") else 8)
        if spatial is not None:
            lo = hi = spatial + 2
        if not lo <= rank <= hi:
            want = f"{lo} axes" if lo == hi else f"{lo} to {hi} axes"
            raise UsageError(
                "--shape",
                f"{name}{'' if spatial is None else f'{spatial}d'} expects {want} (N, C, ...), got {rank}: {shape}",
            )
    if kind == "group":
        c = shape[1]
        if groups is None:
            raise UsageError("--groups", f"GroupNorm needs --groups G dividing the {c} channels; valid: {_divisors(c)}")
        if groups < 1 or c % groups:
            raise UsageError(
                "--groups",
                f"expected a number of groups dividing the {c} channels (valid: {_divisors(c)}), got {groups}",
            )
    elif groups is not None:
        raise UsageError("--groups", f"only the group layer takes --groups, got --groups {groups} for {kind}")
    if kind in ("layer", "rms"):
        if last is None:
            last = max(rank - 1, 1)  # everything but the batch axis: one scope per sample
        if not 1 <= last <= rank:
            raise UsageError("--last", f"expected 1 to {rank} trailing axes for an input of shape {shape}, got {last}")
    elif last is not None:
        raise UsageError("--last", f"only layer and rms take --last, got --last {last} for {kind}")
    setup = _Setup(kind, shape, groups, last or 0, float(eps))
    per_scope = setup.scope().resolve(shape).count
    if kind in ("batch", "instance") and per_scope <= 1:
        where = "per channel" if kind == "batch" else "per sample and channel"
        raise UsageError(
            "--shape",
            f"{setup.torch_name} in training needs more than one value {where}, got {per_scope} for shape {shape}",
        )
    return setup


def _setup_bsd(kind: str, shape: tuple[int, ...], groups: int | None, last: int | None, eps: float) -> _Setup:
    title = NAMED[kind].title
    if len(shape) != 3:
        raise UsageError(
            "--shape", f"{title} expects 3 axes (B, S, D): batch, tokens, features; got {len(shape)}: {shape}"
        )
    d = shape[2]
    if kind == "qk":
        if groups is None:
            raise UsageError(
                "--groups", f"QK-norm needs --groups H, the heads splitting the {d} features; valid: {_divisors(d)}"
            )
        if groups < 1 or d % groups:
            raise UsageError(
                "--groups",
                f"expected a number of heads dividing the {d} features (valid: {_divisors(d)}), got {groups}",
            )
    elif groups is not None:
        raise UsageError("--groups", f"only the group and qk layers take --groups, got --groups {groups} for {kind}")
    if last is not None:
        raise UsageError("--last", f"only layer and rms take --last, got --last {last} for {kind}")
    return _Setup(kind, shape, groups, 0, eps)


def _bsd_outputs(setup: _Setup, x: Tensor) -> tuple[Tensor, Tensor, str]:
    """normscope's output of a BSD_KINDS layer (its functional form, the affine left out), and the
    torch.nn.functional equivalent with what computed it."""
    from . import functional_modern as FM

    b, s, d = setup.shape
    if setup.kind == "qk":  # the (B, S, D) projection seen as (B, S, H, D/H) heads
        h = setup.groups
        y = FM.qk_norm(x.view(b, s, h, d // h), x.view(b, s, h, d // h), eps=setup.eps)[0].reshape(b, s, d)
    else:
        y = FM.modulated_norm(x, eps=setup.eps)
    y_torch, what = NAMED[setup.kind].torch_equivalent(x, "bsd", setup.groups or 1, setup.eps)
    return y, y_torch, what


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
    shape: Sequence[int],
    groups: int | None = None,
    values: Sequence[float] | Tensor | None = None,
    eps: float = 1e-5,
    last: int | None = None,
) -> dict:
    """Explain one layer on one input; everything JSON-serializable.

    Args:
        layer: ``batch``, ``layer``, ``instance``, ``group``, ``rms`` or a torch class name.
        shape: the input shape, e.g. ``(2, 3, 2, 2)``.
        groups: GroupNorm's number of groups (required for ``group``, refused otherwise).
        values: the input's values in row-major order. Default: :func:`example_values`.
        eps: added to the variance. Default: 1e-5.
        last: trailing axes normalized by LayerNorm/RMSNorm. Default: all but the first axis.

    Raises:
        UsageError: a bad argument, named in ``err.argument``.
    """
    kind, spatial = parse_layer(layer)
    setup = _setup(kind, spatial, shape, groups, last, eps)
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
    ids = scope_ids(resolved)
    m = reference.moments(x, resolved)
    rstd = reference.rstd(m.var, setup.eps)

    with torch.no_grad():
        if bsd:
            y, y_torch, torch_call = _bsd_outputs(setup, x)
        else:
            ours, theirs = setup.layers()
            y, y_torch, torch_call = ours(x), theirs(x), f"torch.nn.{setup.torch_name}"
    diff = (y - y_torch).abs().max().item()
    words = describe(resolved, names)
    if kind == "qk":
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
            # counted from the id map (every scope of an unmasked input has the same size)
            "elements_per_scope": stats[0]["count"],
        },
        "stats": stats,
        "input": x.tolist(),
        "scope_ids": ids.tolist(),
        "output": y.tolist(),
        "torch": {"max_abs_diff": diff, "allclose": bool(torch.allclose(y, y_torch, atol=1e-6, rtol=1e-5))},
    }


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
    out.line(
        f"       {scope['num_scopes']} scope(s) of {scope['elements_per_scope']} elements; "
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
    out.line(
        f"{result.get('torch_call') or 'torch.nn.' + result['torch_layer']} gives the same output: "
        f"max |normscope - torch| = {t['max_abs_diff']:.2e}  "
        f"[{out.mark(t['allclose'])}]",
        style="green" if t["allclose"] else "bold red",
    )
