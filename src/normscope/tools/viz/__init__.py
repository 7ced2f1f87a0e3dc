"""Pictures of normalization scopes, computed from the engine's own scope description.

:func:`scope_ids` maps every element of a tensor to the scope (the group of elements sharing one
mean and variance) it belongs to, using only :meth:`normscope.Scope.resolve`; :func:`draw` paints
it as the N x C x (H*W) cube of Wu & He (*Group Normalization*, 2018, Fig. 2) or as (B, S, D)
strips. Drawing needs matplotlib (``pip install 'normscope[viz]'``); the mapping does not.

Example::

    >>> from normscope.tools.viz import draw, draw_all
    >>> draw("group", groups=2).figure.savefig("groupnorm.svg")
    >>> files = draw_all("pictures/")    # one picture per layer and layout, and a grid of each
"""

from .scopes import (
    LAYERS,
    LAYOUTS,
    axis_labels,
    cube_faces,
    default_shape,
    layer_names,
    layer_scope,
    lengths_mask,
    scope_ids,
)

__all__ = [
    "LAYERS",
    "LAYOUTS",
    "axis_labels",
    "cube_faces",
    "default_shape",
    "layer_names",
    "layer_scope",
    "lengths_mask",
    "scope_ids",
    "picture_ids",
    "draw",
    "draw_grid",
    "draw_all",
    "main",
]


def __getattr__(name: str):
    # matplotlib is optional and slow to import: load the drawing module on first use only
    if name in ("draw", "draw_grid", "draw_all", "main", "picture_ids"):
        from . import figures as _figures

        return getattr(_figures, name)
    raise AttributeError(f"module 'normscope.tools.viz' has no attribute {name!r}")
