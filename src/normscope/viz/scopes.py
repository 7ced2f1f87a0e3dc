"""Scope -> picture: which elements share one mean and variance, computed from the engine's scope.

Nothing here knows what BatchNorm or GroupNorm *is*: :func:`scope_ids` reads only the
:class:`~normscope.scope.Resolved` description (reduced axes, groups, grouped axis) that the engine
itself computes with, so a new scope draws itself correctly without any drawing code of its own.

The pictures use two layouts, as the source articles do:

* ``"nchw"`` -- the N x C x (H*W) cube of a convolutional activation (Wu & He, *Group
  Normalization*, ECCV 2018, Figure 2);
* ``"bsd"`` -- the (batch, sequence, features) view of a transformer activation, where LayerNorm is a
  strip per token and padding is drawn (and excluded from the statistics when a mask is given).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ..scope import Resolved, Scope

__all__ = [
    "PALETTE",
    "HIGHLIGHT",
    "LAYOUTS",
    "LAYERS",
    "LayerSpec",
    "layer_names",
    "layer_scope",
    "scope_ids",
    "lengths_mask",
    "default_shape",
    "axis_labels",
    "cube_faces",
]

LAYOUTS = ("nchw", "bsd")

# shared by the static pictures and the web page: a soft qualitative palette for the other
# scopes (by order of first appearance) and one strong colour for the highlighted scope
PALETTE = (
    "#8fb8de",
    "#f4b183",
    "#a9d18e",
    "#ffd966",
    "#c5a3d9",
    "#9dd9d2",
    "#f4a6b7",
    "#c9c9a3",
    "#b4c7e7",
    "#f8cbad",
    "#c6e0b4",
    "#e2c4f0",
)
HIGHLIGHT = "#c0392b"

# default shapes: small enough to count the cells, large enough to show every scope's extent
_DEFAULT_SHAPE = {"nchw": (3, 6, 4), "bsd": (2, 5, 6)}
_AXES = {"nchw": ("N", "C", "H·W"), "bsd": ("B", "S", "D")}


@dataclass(frozen=True)
class LayerSpec:
    """A named layer of the picture registry: its scope in each layout (None: not meaningful there)."""

    name: str
    title: str
    nchw: object  # callable (groups) -> Scope, or None
    bsd: object
    note: str


LAYERS: dict[str, LayerSpec] = {
    s.name: s
    for s in (
        LayerSpec(
            "batch",
            "BatchNorm",
            lambda g: Scope.batch(),
            lambda g: Scope.batch(channel_dim=-1),
            "one mean/var per channel, over the batch and every position (in (B,S,D): per feature, "
            "over every token of every sequence -- padding included unless masked)",
        ),
        LayerSpec(
            "layer",
            "LayerNorm",
            lambda g: Scope.layer(2),
            lambda g: Scope.layer(1),
            "one mean/var per sample over (C, H·W); in (B,S,D) one per token, a strip over D",
        ),
        LayerSpec(
            "instance",
            "InstanceNorm",
            lambda g: Scope.instance(),
            lambda g: Scope(keep=(0, 2), affine=(2,)),
            "one mean/var per (sample, channel), over the positions",
        ),
        LayerSpec(
            "group",
            "GroupNorm",
            lambda g: Scope.group(g),
            lambda g: Scope(keep=(0,), groups=g, group_dim=2, affine=(2,)),
            "one mean/var per (sample, group of C/G channels), over the positions",
        ),
        LayerSpec(
            "rms",
            "RMSNorm",
            lambda g: Scope.rms(2),
            lambda g: Scope.rms(1),
            "LayerNorm's scope without the mean: one mean square per sample (per token in (B,S,D))",
        ),
        LayerSpec(
            "layer2d",
            "LayerNorm2d (channels)",
            lambda g: Scope.channels(),
            None,
            "channels-first LayerNorm (ConvNeXt): one mean/var per (sample, position), over C",
        ),
    )
}


def layer_names(layout: str | None = None) -> list[str]:
    """Names of the registry, optionally only those meaningful in ``layout``."""
    return [n for n, s in LAYERS.items() if layout is None or getattr(s, layout) is not None]


def _check_layout(layout: str) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"expected `layout` to be one of {list(LAYOUTS)}, got {layout!r}")
    return layout


def layer_scope(name: str, layout: str = "nchw", groups: int = 2) -> Scope:
    """The engine scope of a named layer in a layout, e.g. ``layer_scope("group", "nchw", 2)``.

    Raises ValueError listing the valid names for an unknown name, or when the layer has no meaning
    in the layout (LayerNorm2d is channels-first).
    """
    _check_layout(layout)
    if name not in LAYERS:
        raise ValueError(f"expected `layer` to be one of {list(LAYERS)}, got {name!r}")
    if not isinstance(groups, int) or isinstance(groups, bool) or groups < 1:
        raise ValueError(f"expected `groups` to be a positive int, got {groups!r}")
    fn = getattr(LAYERS[name], layout)
    if fn is None:
        raise ValueError(f"layer {name!r} is not defined in layout {layout!r}: expected one of {layer_names(layout)}")
    return fn(groups)


def default_shape(layout: str) -> tuple[int, ...]:
    """The default picture shape of a layout: (N, C, H·W) = (3, 6, 4) or (B, S, D) = (2, 5, 6)."""
    return _DEFAULT_SHAPE[_check_layout(layout)]


def axis_labels(layout: str) -> tuple[str, str, str]:
    """Axis names of a layout's three picture axes."""
    return _AXES[_check_layout(layout)]


def lengths_mask(shape: Sequence[int], lengths: Sequence[int], layout: str) -> Tensor:
    """A padding mask from per-sample valid lengths, shaped to broadcast against ``shape``.

    In ``"bsd"`` the lengths count tokens (axis 1) and the mask is (B, S, 1); in ``"nchw"`` they
    count positions in row-major H·W order (the picture's third axis) and the mask is (N, 1, H, W).
    True marks a valid element.
    """
    _check_layout(layout)
    shape = tuple(shape)
    lengths = list(lengths)
    if len(shape) < 3:
        raise ValueError(f"expected a shape of rank >= 3 for a padding mask, got {shape}")
    n_pos = shape[1] if layout == "bsd" else math.prod(shape[2:])
    if len(lengths) != shape[0]:
        raise ValueError(f"expected `mask` to give one length per sample ({shape[0]}), got {len(lengths)}: {lengths}")
    for n in lengths:
        if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= n_pos:
            raise ValueError(f"expected every `mask` length to be an int in [0, {n_pos}], got {n!r}")
    valid = torch.arange(n_pos)[None, :] < torch.tensor(lengths)[:, None]  # (N, positions)
    if layout == "bsd":
        return valid.reshape(shape[0], shape[1], *([1] * (len(shape) - 2)))
    return valid.reshape(shape[0], 1, *shape[2:])


def scope_ids(scope: Scope | Resolved, shape: Sequence[int], mask: Tensor | None = None) -> Tensor:
    """For every element of a tensor of ``shape``, the id of the scope it belongs to.

    Elements with the same id share one mean and variance. The id is the flat index into the
    engine's statistics tensor (shape ``resolved.stat_shape``, as returned by
    :func:`normscope.reference.moments`), so ``moments(x, r).mean.flatten()[ids]`` is each
    element's mean. Elements excluded by ``mask`` (False) get -1.

    Derived only from the resolved scope: a non-reduced axis indexes the statistics, a reduced axis
    does not, and a grouped axis indexes them by ``channel // (C / groups)``.

    Args:
        scope: a :class:`Scope` (resolved against ``shape``) or an already resolved scope.
        shape: the tensor shape.
        mask: optional bool tensor broadcastable to ``shape``; True = valid. Default: None.

    Shape:
        returns a LongTensor of ``shape``.

    Example::

        >>> scope_ids(Scope.group(2), (1, 4, 2))[0]
        tensor([[0, 0], [0, 0], [1, 1], [1, 1]])
    """
    shape = tuple(int(s) for s in shape)
    r = scope if isinstance(scope, Resolved) else scope.resolve(shape)
    if tuple(r.shape) != shape:
        raise ValueError(f"expected a scope resolved for shape {shape}, got one resolved for {tuple(r.shape)}")
    stat = r.stat_shape
    ids = torch.arange(math.prod(stat)).reshape(stat)
    if r.groups > 1:
        # each group's statistic covers C/G consecutive channels of the grouped axis
        ids = ids.repeat_interleave(shape[r.group_dim] // r.groups, dim=r.group_dim)
    ids = ids.expand(shape).clone()
    if mask is not None:
        if not isinstance(mask, Tensor) or mask.dtype != torch.bool:
            raise TypeError(f"expected `mask` to be a bool tensor, got {getattr(mask, 'dtype', type(mask).__name__)}")
        ids[~mask.expand(shape)] = -1
    return ids


# -- geometry of the cube, shared by the matplotlib figure and the web page ---------------------

# oblique projection of the depth axis: how far right and up one step back goes
_DX, _DY = 0.62, 0.42


def _proj(d: float, h: float, v: float, nv: int) -> tuple[float, float]:
    # picture coordinates: x right, y up; the vertical axis index 0 is at the top
    return (round(h + _DX * d, 4), round((nv - v) + _DY * d, 4))


def cube_faces(shape3: Sequence[int], layout: str = "nchw") -> list[dict]:
    """The visible faces of the picture cube, one parallelogram per surface cell.

    ``shape3`` is the 3-d picture shape: (N, C, L) in ``"nchw"`` (depth N, horizontal C, vertical
    L = H·W) or (B, S, D) in ``"bsd"`` (depth B, vertical S, horizontal D). Each face is
    ``{"index": flat element index, "face": "front"|"top"|"side", "points": [[x, y] * 4]}``
    in picture units (y up). Faces are ordered back to front, so painting in order is correct.
    """
    _check_layout(layout)
    if len(shape3) != 3:
        raise ValueError(f"expected a 3-d picture shape, got {tuple(shape3)}")
    a0, a1, a2 = (int(s) for s in shape3)
    if layout == "nchw":
        nd, nh, nv = a0, a1, a2
        flat = lambda d, h, v: (d * a1 + h) * a2 + v  # noqa: E731
    else:
        nd, nv, nh = a0, a1, a2
        flat = lambda d, h, v: (d * a1 + v) * a2 + h  # noqa: E731
    faces: list[dict] = []
    # top surface (v = 0) and side surface (h = nh - 1), back (large d) to front
    for d in range(nd - 1, -1, -1):
        for h in range(nh):
            pts = [_proj(d, h, 0, nv), _proj(d, h + 1, 0, nv), _proj(d + 1, h + 1, 0, nv), _proj(d + 1, h, 0, nv)]
            faces.append({"index": flat(d, h, 0), "face": "top", "points": [list(p) for p in pts]})
        for v in range(nv):
            pts = [_proj(d, nh, v, nv), _proj(d + 1, nh, v, nv), _proj(d + 1, nh, v + 1, nv), _proj(d, nh, v + 1, nv)]
            faces.append({"index": flat(d, nh - 1, v), "face": "side", "points": [list(p) for p in pts]})
    for h in range(nh):
        for v in range(nv):
            pts = [_proj(0, h, v, nv), _proj(0, h + 1, v, nv), _proj(0, h + 1, v + 1, nv), _proj(0, h, v + 1, nv)]
            faces.append({"index": flat(0, h, v), "face": "front", "points": [list(p) for p in pts]})
    return faces
