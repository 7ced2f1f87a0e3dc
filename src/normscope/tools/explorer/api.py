"""The explorer's JSON API: one small worked example of a scope, computed by the real library.

``scope_example(request) -> response`` validates a request dict completely before any work and
raises :class:`ApiError` (an HTTP status and a message for the page) on bad input. The server
(:mod:`normscope.tools.explorer.server`) is only transport around it, so everything here is testable
without sockets.

The example tensor is ``torch.randn(shape, generator=torch.Generator().manual_seed(seed))`` rounded
to two decimals (numbers a reader can check by hand); the statistics come from
:func:`normscope.reference.moments`, the output from the engine (:func:`normscope.engine.norm`), and
``check`` compares that output with an independent computation: the matching
``torch.nn.functional`` op, or (with a padding mask, which torch's norms do not take) a float64
per-scope formula.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from ... import engine, reference
from ..viz.scopes import (
    HIGHLIGHT,
    LAYERS,
    LAYOUTS,
    PALETTE,
    axis_labels,
    cube_faces,
    layer_names,
    layer_scope,
    lengths_mask,
    scope_ids,
)

__all__ = ["ApiError", "LIMITS", "scope_example", "layers_info", "example_input"]

# bounded work per request: the page is for looking at, not for benchmarking
LIMITS = {"max_elements": 4096, "max_dim": 64, "max_groups": 64, "max_body_bytes": 16384}
_FIELDS = {"layer", "layout", "shape", "groups", "mask", "eps", "seed"}


class ApiError(Exception):
    """A request the API refuses: ``status`` (4xx) and a message that names the field."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


def _int(v: Any, name: str, lo: int, hi: int) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise ApiError(400, f"expected `{name}` to be an integer in [{lo}, {hi}], got {v!r}")
    return v


def layers_info() -> dict:
    """What the page needs to build its controls: the layers, layouts, defaults and limits."""
    return {
        "layers": [
            {"name": s.name, "title": s.title, "note": s.note, "layouts": [lo for lo in LAYOUTS if getattr(s, lo)]}
            for s in LAYERS.values()
        ],
        "layouts": {lo: {"axes": list(axis_labels(lo))} for lo in LAYOUTS},
        "defaults": {
            "layer": "group",
            "layout": "nchw",
            "shape": {"nchw": [3, 6, 4], "bsd": [2, 5, 6]},
            "groups": 2,
            "mask": None,
            "eps": 1e-5,
            "seed": 0,
        },
        "limits": LIMITS,
        "palette": list(PALETTE),
        "highlight": HIGHLIGHT,
    }


def example_input(shape: tuple[int, ...], seed: int) -> Tensor:
    """The worked example's input: standard normal from ``seed``, rounded to two decimals."""
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float32)
    return torch.round(x * 100) / 100


_F32_TINY = torch.finfo(torch.float32).tiny


def _check_body(req: Any) -> None:
    """Types of a request body, checked before any lookup: a list or object where a name belongs
    (``{"layer": [1]}``) must be a 400, not an unhashable-type error deep inside."""
    if not isinstance(req, dict):
        raise ApiError(400, f"expected a JSON object, got {type(req).__name__}")
    unknown = sorted(set(req) - _FIELDS)
    if unknown:
        raise ApiError(400, f"unknown field(s) {unknown}: expected some of {sorted(_FIELDS)}")
    for name in ("layer", "layout"):
        if name in req and not isinstance(req[name], str):
            raise ApiError(400, f"expected `{name}` to be a string, got {type(req[name]).__name__} {req[name]!r:.60}")
    eps = req.get("eps", 1e-5)
    # the example is computed in float32: an eps that rounds to 0 (or to a subnormal) there would
    # divide by zero and send NaN, which is not JSON
    if isinstance(eps, (int, float)) and not isinstance(eps, bool) and 0 < eps < _F32_TINY:
        raise ApiError(400, f"expected `eps` to be at least {_F32_TINY:.4g} (float32's smallest normal), got {eps!r}")


def _validate(req: Any) -> dict:
    _check_body(req)
    layout = req.get("layout", "nchw")
    if layout not in LAYOUTS:
        raise ApiError(400, f"expected `layout` to be one of {list(LAYOUTS)}, got {layout!r}")
    layer = req.get("layer", "group")
    if layer not in LAYERS:
        raise ApiError(400, f"expected `layer` to be one of {list(LAYERS)}, got {layer!r}")
    if getattr(LAYERS[layer], layout) is None:
        raise ApiError(
            400, f"layer {layer!r} is not defined in layout {layout!r}: expected one of {layer_names(layout)}"
        )
    shape = req.get("shape", [3, 6, 4] if layout == "nchw" else [2, 5, 6])
    ranks = (3, 4) if layout == "nchw" else (3,)
    if not isinstance(shape, list) or len(shape) not in ranks:
        want = "(N, C, L) or (N, C, H, W)" if layout == "nchw" else "(B, S, D)"
        raise ApiError(
            400, f"expected `shape` to be a list of {' or '.join(map(str, ranks))} integers {want}, got {shape!r}"
        )
    shape = tuple(_int(s, f"shape[{i}]", 1, LIMITS["max_dim"]) for i, s in enumerate(shape))
    if math.prod(shape) > LIMITS["max_elements"]:
        raise ApiError(
            413,
            f"expected at most {LIMITS['max_elements']} elements, got shape {list(shape)} "
            f"= {math.prod(shape)} elements",
        )
    groups = _int(req.get("groups", 2), "groups", 1, LIMITS["max_groups"])
    seed = _int(req.get("seed", 0), "seed", 0, 2**31 - 1)
    eps = req.get("eps", 1e-5)
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not (0 < eps <= 1) or not math.isfinite(eps):
        raise ApiError(400, f"expected `eps` to be a number in (0, 1], got {eps!r}")
    mask = req.get("mask")
    if mask is not None:
        axis = "S (tokens)" if layout == "bsd" else "H·W (positions)"
        n_axis = shape[1] if layout == "bsd" else math.prod(shape[2:])
        if not isinstance(mask, list) or len(mask) != shape[0]:
            raise ApiError(
                400, f"expected `mask` to be null or a list of {shape[0]} valid lengths along {axis}, got {mask!r}"
            )
        mask = [_int(v, f"mask[{i}]", 0, n_axis) for i, v in enumerate(mask)]
    try:
        scope = layer_scope(layer, layout, groups, len(shape))
        resolved = scope.resolve(shape)
    except ValueError as e:  # e.g. groups not dividing the channels: the engine's own message
        raise ApiError(400, str(e)) from None
    return {
        "layer": layer,
        "layout": layout,
        "shape": shape,
        "groups": groups,
        "seed": seed,
        "eps": float(eps),
        "mask": mask,
        "scope": scope,
        "resolved": resolved,
    }


def _per_scope_float64(x: Tensor, ids: Tensor, centered: bool, eps: float) -> Tensor:
    # the definition, by scope id: mean and biased variance of each scope's valid members only
    x64, flat = x.double().flatten(), ids.flatten()
    valid = flat >= 0
    k, v = flat[valid], x64[valid]
    n = max(int(flat.max()) + 1, 1)
    count = torch.bincount(k, minlength=n).double().clamp_min(1)
    mean = torch.zeros(n, dtype=torch.float64).index_add_(0, k, v) / count
    if not centered:
        mean.zero_()
    var = torch.zeros(n, dtype=torch.float64).index_add_(0, k, (v - mean[k]).square()) / count
    y = torch.zeros_like(x64)
    y[valid] = (v - mean[k]) / torch.sqrt(var[k] + eps)
    return y.reshape(x.shape)


def _r(t: Tensor) -> list:
    # 6 significant digits are plenty for a page and keep the JSON small
    return [float(f"{v:.6g}") for v in t.flatten().tolist()]


def scope_example(req: Any) -> dict:
    """Compute the worked example for a request (see the module docstring); raises ApiError."""
    v = _validate(req)
    shape, layout, resolved = v["shape"], v["layout"], v["resolved"]
    x = example_input(shape, v["seed"])
    mask = lengths_mask(shape, v["mask"], layout) if v["mask"] is not None else None
    ids = scope_ids(resolved, shape, mask)
    m = reference.moments(x, resolved, mask)
    y = engine.norm(x, resolved, eps=v["eps"], mask=mask)
    n_stats = math.prod(resolved.stat_shape)
    count = m.count.flatten() if isinstance(m.count, Tensor) else torch.full((n_stats,), m.count)
    valid = ids >= 0
    ref_y = None
    if mask is None:
        try:
            ref_y, against = LAYERS[v["layer"]].torch_equivalent(x, layout, v["groups"], v["eps"])
        except (ValueError, RuntimeError) as e:
            # torch refuses some shapes the engine handles (one element per instance or channel)
            against = f"float64 per-scope formula (torch.nn.functional refused: {e})"
    else:
        against = "float64 per-scope formula (torch.nn norms take no mask)"
    if ref_y is None:
        ref_y = _per_scope_float64(x, ids, resolved.centered, v["eps"])
    diff = float((y.double() - ref_y.double())[valid].abs().max()) if bool(valid.any()) else 0.0
    shape3 = (shape[0], shape[1], math.prod(shape[2:])) if layout == "nchw" else shape
    # colour by order of first appearance, as the static pictures do
    order: dict[int, int] = {}
    for i in ids.flatten().tolist():
        if i >= 0 and i not in order:
            order[i] = len(order)
    return {
        "layer": v["layer"],
        "title": LAYERS[v["layer"]].title + (f" (G={v['groups']})" if v["layer"] == "group" else ""),
        "note": LAYERS[v["layer"]].note,
        "layout": layout,
        "shape": list(shape),
        "picture_shape": list(shape3),
        "axes": list(axis_labels(layout)),
        "groups": v["groups"],
        "eps": v["eps"],
        "seed": v["seed"],
        "mask": v["mask"],
        "scope": repr(v["scope"]),
        "resolved": {
            "reduce": list(resolved.reduce),
            "centered": resolved.centered,
            "groups": resolved.groups,
            "group_dim": resolved.group_dim,
            "stat_shape": list(resolved.stat_shape),
        },
        "n_scopes": len(order),
        "scope_ids": ids.flatten().tolist(),
        "colors": {str(k): PALETTE[j % len(PALETTE)] for k, j in order.items()},
        "values": _r(x),
        "mean": _r(m.mean),
        "var": _r(m.var),
        "count": [int(c) for c in count.tolist()],
        "output": _r(y),
        "check": {"against": against, "max_abs_diff": diff},
        "torch_max_abs_diff": diff,
        "faces": cube_faces(shape3, layout),
    }
