"""Scope -> picture: which elements share one mean and variance, computed from the engine's scope.

Nothing here knows what BatchNorm or GroupNorm *is*: :func:`scope_ids` (from :mod:`normscope.tools.named`, the
table of named layers that explain and the explorer read too) reads only the
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

import torch
from torch import Tensor

from ...scope import Scope
from ..named import LAYOUTS, NAMED, check_layout, get, names, scope_ids

__all__ = [
    "PALETTE",
    "HIGHLIGHT",
    "LAYOUTS",
    "LAYERS",
    "layer_names",
    "layer_scope",
    "scope_ids",
    "lengths_mask",
    "default_shape",
    "axis_labels",
    "cube_faces",
]

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


#: the named layers: the one table of :mod:`normscope.tools.named`, which explain and the explorer read too
LAYERS = NAMED
layer_names = names


def layer_scope(name: str, layout: str = "nchw", groups: int = 2, ndim: int = 3) -> Scope:
    """The engine scope of a named layer in a layout, e.g. ``layer_scope("group", "nchw", 2)``.

    ``ndim`` is the rank of the input (LayerNorm and RMSNorm in nchw normalize everything but the batch axis;
    the default 3 is the picture's (N, C, H·W)). Raises ValueError listing the valid names for an unknown name,
    or when the layer has no meaning in the layout (LayerNorm2d is channels-first).
    """
    check_layout(layout)
    return get(name).scope(layout, ndim, groups)


def default_shape(layout: str) -> tuple[int, ...]:
    """The default picture shape of a layout: (N, C, H·W) = (3, 6, 4) or (B, S, D) = (2, 5, 6)."""
    return _DEFAULT_SHAPE[check_layout(layout)]


def axis_labels(layout: str) -> tuple[str, str, str]:
    """Axis names of a layout's three picture axes."""
    return _AXES[check_layout(layout)]


def lengths_mask(shape: Sequence[int], lengths: Sequence[int], layout: str) -> Tensor:
    """A padding mask from per-sample valid lengths, shaped to broadcast against ``shape``.

    In ``"bsd"`` the lengths count tokens (axis 1) and the mask is (B, S, 1); in ``"nchw"`` they
    count positions in row-major H·W order (the picture's third axis) and the mask is (N, 1, H, W).
    True marks a valid element.
    """
    check_layout(layout)
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
    check_layout(layout)
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
