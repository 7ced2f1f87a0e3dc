"""Pictures of scopes: the N x C x (H*W) cube and the (B, S, D) strip view, with matplotlib.

Every picture is computed from :func:`normscope.tools.viz.scopes.scope_ids`, i.e. from the engine's own
resolved scope; this module only paints ids. Figures are built on :class:`matplotlib.figure.Figure`
directly (no pyplot, no GUI backend), so drawing works headless and in threads.
"""

from __future__ import annotations

import colorsys
import math
import os
from collections.abc import Sequence
from pathlib import Path

from torch import Tensor, nn

from ...scope import Scope
from ..named import module_scope, parse, spellings
from .scopes import (
    HIGHLIGHT,
    LAYERS,
    PALETTE,
    axis_labels,
    cube_faces,
    default_shape,
    layer_names,
    layer_scope,
    lengths_mask,
    scope_ids,
)

__all__ = ["draw", "draw_all", "picture_ids", "PALETTE", "HIGHLIGHT"]

#: the most elements a picture may have: one cell is drawn per element, and beyond this the picture is
#: unreadable and drawing it takes minutes and gigabytes (the explorer's limit too)
MAX_ELEMENTS = 4096

PADDING = "#d9d9d9"
EDGE = "#4a4a4a"
_SHADE = {"front": 1.0, "top": 1.12, "side": 0.82}  # light from the top-left: a cube, not a hexagon


def _require_matplotlib():
    try:
        from matplotlib.figure import Figure
        from matplotlib.patches import Polygon, Rectangle
    except ImportError as e:  # pragma: no cover - exercised only without the extra
        raise ImportError("normscope.tools.viz needs matplotlib: pip install 'normscope[viz]'") from e
    return Figure, Polygon, Rectangle


def _shade(color: str, factor: float) -> tuple[float, float, float]:
    r, g, b = (int(color[i : i + 2], 16) / 255 for i in (1, 3, 5))
    h, lum, s = colorsys.rgb_to_hls(r, g, b)
    return colorsys.hls_to_rgb(
        h, max(0.0, min(1.0, lum * factor if factor < 1 else lum + (1 - lum) * (factor - 1) * 2)), s
    )


def _module_scope(m: nn.Module, layout: str, ndim: int) -> tuple[Scope, str]:
    """The picture scope of a torch/normscope norm layer (by type, from the table of named layers) and its title."""
    try:
        name, scope = module_scope(m, layout, ndim)
    except TypeError:
        raise TypeError(f"draw: expected a layer name, a Scope or a norm layer, got {type(m).__name__}") from None
    if name == "group":
        return scope, f"GroupNorm (G={m.num_groups})"
    if name in ("layer", "rms"):
        return scope, f"{type(m).__name__}({tuple(m.normalized_shape)})"
    return scope, LAYERS[name].title


def _resolve_target(target, layout: str, groups: int, ndim: int = 3) -> tuple[Scope, str]:
    if isinstance(target, Scope):
        return target, "custom scope"
    if isinstance(target, str):
        target = parse(target).name  # the names explain accepts: aliases and torch class names too
        title = LAYERS[target].title
        scope = layer_scope(target, layout, groups, ndim)
        if target == "group":
            title = f"GroupNorm (G={groups})"
        return scope, title
    if isinstance(target, nn.Module):
        return _module_scope(target, layout, ndim)
    raise TypeError(
        f"draw: expected a layer name {layer_names()}, a Scope or a norm layer, got {type(target).__name__}"
    )


def picture_ids(
    scope: Scope,
    shape: Sequence[int],
    layout: str = "nchw",
    mask: Tensor | Sequence[int] | None = None,
) -> Tensor:
    """Scope ids on the 3-d picture grid: (N, C, H·W) for nchw (trailing axes flattened), (B, S, D) for bsd.

    ``mask`` is a bool tensor broadcastable to ``shape`` or a list of per-sample lengths
    (see :func:`normscope.tools.viz.scopes.lengths_mask`).
    """
    shape = tuple(int(s) for s in shape)
    _check_shape(shape, "shape")
    if layout == "bsd" and len(shape) != 3:
        raise ValueError(f"expected a (B, S, D) shape for layout 'bsd', got {shape}")
    if layout == "nchw" and len(shape) < 3:
        raise ValueError(f"expected an (N, C, *) shape with at least 3 axes for layout 'nchw', got {shape}")
    if mask is not None and not isinstance(mask, Tensor):
        mask = lengths_mask(shape, mask, layout)
    ids = scope_ids(scope, shape, mask)
    return ids.reshape(shape[0], shape[1], -1)


def _colors(ids: Tensor, hl: int) -> dict[int, str]:
    # stable colour per id: the order of first appearance, so neighbouring scopes differ
    order: dict[int, str] = {}
    for i in ids.flatten().tolist():
        if i >= 0 and i not in order:
            order[i] = PALETTE[len(order) % len(PALETTE)]
    order[hl] = HIGHLIGHT
    return order


def _face_style(i: int, hl: int, colors: dict[int, str], face: str) -> dict:
    if i < 0:
        return {"facecolor": _shade(PADDING, _SHADE[face]), "hatch": "////", "edgecolor": "#8a8a8a"}
    if i == hl:
        return {"facecolor": _shade(colors[i], _SHADE[face]), "edgecolor": EDGE}
    # the other scopes recede: their colour a third of the way to white, so the shaded scope reads first
    r, g, b = _shade(colors[i], _SHADE[face])
    return {"facecolor": tuple(c + (1 - c) * 0.35 for c in (r, g, b)), "edgecolor": "#7a7a7a"}


def _pick_highlight(ids: Tensor, highlight: int | None) -> int:
    flat = ids.flatten()
    if highlight is not None:
        if not 0 <= highlight < flat.numel():
            raise ValueError(f"expected `highlight` to be an element index in [0, {flat.numel() - 1}], got {highlight}")
        return int(flat[highlight])
    valid = flat[flat >= 0]
    return int(valid[0]) if valid.numel() else -1


def _draw_cube(ax, ids: Tensor, layout: str, hl: int) -> None:
    _, Polygon, _ = _require_matplotlib()
    shape3 = tuple(ids.shape)
    flat = ids.flatten().tolist()
    colors = _colors(ids, hl)
    for f in cube_faces(shape3, layout):
        i = flat[f["index"]]
        ax.add_patch(Polygon(f["points"], closed=True, linewidth=0.6, **_face_style(i, hl, colors, f["face"])))
    # the cube's outline and the axis labels
    a0, a1, a2 = shape3
    nd, nh, nv = (a0, a1, a2) if layout == "nchw" else (a0, a2, a1)
    dlab, hlab, vlab = (axis_labels(layout)[k] for k in ((0, 1, 2) if layout == "nchw" else (0, 2, 1)))
    from .scopes import _DX, _DY

    ax.text(nh / 2, -0.45, hlab, ha="center", va="top", fontsize=11)
    ax.text(-0.35, nv / 2, vlab, ha="right", va="center", fontsize=11)
    ax.text(-0.2 + _DX * nd / 2, nv + _DY * nd / 2 + 0.25, dlab, ha="right", va="bottom", fontsize=11)
    ax.set_xlim(-1.4, nh + _DX * nd + 0.6)
    ax.set_ylim(-1.2, nv + _DY * nd + 0.8)


def _draw_slices(ax, ids: Tensor, layout: str, hl: int) -> None:
    """One grid per sample, side by side: rows = the vertical axis, columns = the horizontal axis."""
    _, _, Rectangle = _require_matplotlib()
    colors = _colors(ids, hl)
    a0, a1, a2 = ids.shape
    # nchw: a sample is C x L -> draw L rows x C columns (like the cube's front face); bsd: S rows x D columns
    grid = ids.transpose(1, 2) if layout == "nchw" else ids
    rows, cols = grid.shape[1], grid.shape[2]
    gap = 1.2
    s0, sh, sv = (axis_labels(layout)[k] for k in ((0, 1, 2) if layout == "nchw" else (0, 2, 1)))
    for n in range(a0):
        x0 = n * (cols + gap)
        for r in range(rows):
            for c in range(cols):
                i = int(grid[n, r, c])
                st = _face_style(i, hl, colors, "front")
                ax.add_patch(Rectangle((x0 + c, rows - r - 1), 1, 1, linewidth=0.6, **st))
        ax.text(x0 + cols / 2, rows + 0.25, f"{s0} = {n}", ha="center", va="bottom", fontsize=10)
        ax.text(x0 + cols / 2, -0.3, sh, ha="center", va="top", fontsize=10)
    ax.text(-0.3, rows / 2, sv, ha="right", va="center", fontsize=10)
    ax.set_xlim(-1.2, a0 * (cols + gap) - gap + 0.3)
    ax.set_ylim(-1.1, rows + 1.0)


def draw(
    layer_or_scope: str | Scope | nn.Module,
    layout: str = "nchw",
    groups: int = 2,
    shape: Sequence[int] | None = None,
    mask: Tensor | Sequence[int] | None = None,
    ax=None,
    *,
    view: str | None = None,
    highlight: int | None = None,
    title: str | None = None,
):
    """Draw which elements share one mean and variance.

    The cells of one scope (by default the scope of the first valid element, which is always on the
    visible faces) are shaded in red; every other scope is lightly coloured by id; masked padding is
    grey and hatched.

    Args:
        layer_or_scope: a layer name (``"batch"``, ``"layer"``, ``"instance"``, ``"group"``, ``"rms"``,
            ``"layer2d"``), a :class:`~normscope.Scope`, or a torch/normscope norm layer instance.
        layout: ``"nchw"`` (the N x C x H·W cube) or ``"bsd"`` ((B, S, D) strips). Default: ``"nchw"``.
        groups: GroupNorm's number of groups. Default: 2.
        shape: the tensor shape. Default: (3, 6, 4) for nchw, (2, 5, 6) for bsd.
        mask: per-sample valid lengths (positions in nchw, tokens in bsd) or a bool tensor. Default: None.
        ax: matplotlib Axes to draw into; a new figure when None. Default: None.
        view: ``"cube"`` or ``"slices"`` (one grid per sample). Default: cube for nchw, slices for bsd.
        highlight: flat index of the element whose scope is shaded. Default: the first valid element.
        title: the panel title. Default: the layer's name.

    Returns:
        the matplotlib Axes.

    Example::

        >>> ax = draw("group", groups=2)
        >>> ax.figure.savefig("groupnorm.svg")
    """
    Figure, _, _ = _require_matplotlib()
    if layout not in ("nchw", "bsd"):
        raise ValueError(f"draw: expected `layout` to be 'nchw' or 'bsd', got {layout!r}")
    view = view or ("cube" if layout == "nchw" else "slices")
    if view not in ("cube", "slices"):
        raise ValueError(f"draw: expected `view` to be 'cube' or 'slices', got {view!r}")
    shape = tuple(shape) if shape is not None else default_shape(layout)
    scope, default_title = _resolve_target(layer_or_scope, layout, groups, len(shape))
    ids = picture_ids(scope, shape, layout, mask)
    hl = _pick_highlight(ids, highlight)
    if ax is None:
        fig = Figure(figsize=(4.2, 3.6) if view == "cube" else (1.4 + 1.1 * ids.shape[0] * 2.2, 3.0), dpi=110)
        ax = fig.add_subplot(1, 1, 1)
    (_draw_cube if view == "cube" else _draw_slices)(ax, ids, layout, hl)
    ax.set_aspect("equal")
    ax.axis("off")
    n_hl = int((ids == hl).sum()) if hl >= 0 else 0
    n_scopes = len(set(ids[ids >= 0].tolist()))
    ax.set_title(title or default_title, fontsize=13, fontweight="bold", pad=4)
    ax.text(
        0.5,
        -0.02,
        f"{n_scopes} scopes; shaded: one scope of {n_hl} elements",
        transform=ax.transAxes,
        ha="center",
        va="top",
        fontsize=8.5,
        color="#444444",
    )
    return ax


def _save(fig, path: str | os.PathLike) -> Path:
    path = Path(path)
    ext = path.suffix.lower().lstrip(".")
    if ext not in ("png", "svg", "pdf"):
        raise ValueError(f"expected an output file ending in .png, .svg or .pdf, got {str(path)!r}")
    path.parent.mkdir(parents=True, exist_ok=True)
    # no timestamps in svg/pdf so that regenerated docs pictures only change when the picture does
    meta = {"Date": None} if ext in ("svg", "pdf") else {}
    if ext == "svg":
        import matplotlib

        matplotlib.rcParams["svg.hashsalt"] = "normscope"
    fig.savefig(path, bbox_inches="tight", metadata=meta, dpi=130 if ext == "png" else None)
    return path


def draw_grid(
    names: Sequence[str],
    layout: str = "nchw",
    groups: int = 2,
    shape: Sequence[int] | None = None,
    mask: Tensor | Sequence[int] | None = None,
    view: str | None = None,
):
    """A figure with one panel per layer name (layers not defined in ``layout`` are skipped)."""
    Figure, _, _ = _require_matplotlib()
    names = [n for n in names if n not in LAYERS or getattr(LAYERS[n], layout) is not None]
    if not names:
        raise ValueError(f"expected at least one layer defined in layout {layout!r}: {layer_names(layout)}")
    view = view or ("cube" if layout == "nchw" else "slices")
    ncols = 3 if view == "cube" else 2
    nrows = -(-len(names) // ncols)
    cell = (4.0, 3.5) if view == "cube" else (5.6, 3.0)
    fig = Figure(figsize=(cell[0] * ncols, cell[1] * nrows), dpi=110)
    for k, name in enumerate(names):
        ax = fig.add_subplot(nrows, ncols, k + 1)
        draw(name, layout, groups, shape, mask, ax=ax, view=view)
    fig.subplots_adjust(wspace=0.05, hspace=0.25)
    return fig


def draw_all(directory: str | os.PathLike, fmt: str = "png", groups: int = 2) -> list[Path]:
    """Write one picture per layer and layout, and a grid per layout, into ``directory``.

    Files: ``scope-<layer>-nchw.<fmt>``, ``scope-<layer>-bsd.<fmt>`` (with padding: lengths 5 and 3),
    ``scopes-nchw.<fmt>``, ``scopes-bsd.<fmt>``. Returns the written paths.
    """
    out = Path(directory)
    written: list[Path] = []
    bsd_mask = [5, 3]
    for layout in ("nchw", "bsd"):
        mask = bsd_mask if layout == "bsd" else None
        for name in layer_names(layout):
            ax = draw(name, layout, groups, mask=mask)
            written.append(_save(ax.figure, out / f"scope-{name}-{layout}.{fmt}"))
        written.append(_save(draw_grid(layer_names(layout), layout, groups, mask=mask), out / f"scopes-{layout}.{fmt}"))
    return written


def _check_shape(shape: Sequence[int], what: str) -> None:
    if any(s < 1 for s in shape):
        raise ValueError(f"expected `{what}` to have positive sizes, got {list(shape)}")
    n = 1
    for s in shape:
        n *= s
    if n > MAX_ELEMENTS:
        raise ValueError(
            f"expected `{what}` to have at most {MAX_ELEMENTS} elements (one cell each in the picture), "
            f"got {list(shape)} = {n} elements"
        )


def _writable(path: Path, what: str) -> None:
    """Create ``path`` (a directory) if needed and check that files can be written into it."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OSError(f"argument {what}: cannot create the directory {str(path)!r}: {e.strerror or e}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise OSError(f"argument {what}: cannot write into {str(path)!r}: permission denied")


def _int_list(text: str, what: str) -> list[int]:
    try:
        vals = [int(t) for t in text.replace("x", ",").split(",") if t.strip()]
    except ValueError:
        raise ValueError(f"expected `{what}` as comma-separated integers like 3,6,4, got {text!r}") from None
    if not vals:
        raise ValueError(f"expected `{what}` as comma-separated integers like 3,6,4, got {text!r}")
    return vals


def main(argv: Sequence[str] | None = None) -> int:
    """``normscope draw [LAYER ...|all] [--layout nchw|bsd] [--groups G] [--shape N,C,L] [--mask L1,L2] -o FILE``."""
    import argparse

    p = argparse.ArgumentParser(prog="normscope draw", description="Draw which elements share one mean and variance.")
    p.add_argument(
        "layers",
        nargs="*",
        default=["all"],
        help=f"layer names ({', '.join(spellings())}; torch names such as BatchNorm2d too) or 'all' (a grid)",
    )
    p.add_argument(
        "--layout",
        choices=("nchw", "bsd"),
        default=None,
        help="the N×C×H·W cube or (B,S,D) strips (default: nchw, or bsd for layers only defined there: qknorm, adaln)",
    )
    p.add_argument("--view", choices=("cube", "slices"), default=None, help="cube or one grid per sample")
    p.add_argument("--groups", type=int, default=2, help="GroupNorm groups (default 2)")
    p.add_argument("--shape", default=None, help="tensor shape, e.g. 3,6,4 (nchw) or 2,5,6 (bsd)")
    p.add_argument("--mask", default=None, help="valid lengths per sample, e.g. 5,3 (padding drawn hatched)")
    p.add_argument("-o", "--output", default=None, help="output .png/.svg/.pdf (default scope-<layer>.png)")
    p.add_argument("--all-dir", default=None, help="write every picture (draw_all) into this directory instead")
    args = p.parse_args(argv)
    try:
        if args.groups < 1:
            raise ValueError(f"expected `--groups` to be a positive integer, got {args.groups}")
        if args.all_dir:
            _writable(Path(args.all_dir), "--all-dir")
            for path in draw_all(args.all_dir, groups=args.groups):
                print(path)
            return 0
        shape = _int_list(args.shape, "--shape") if args.shape else None
        if shape is not None:
            _check_shape(shape, "--shape")
        mask = _int_list(args.mask, "--mask") if args.mask else None
        if mask is not None and any(v < 0 for v in mask):
            raise ValueError(f"expected `--mask` to be non-negative lengths, got {mask}")
        if args.output is not None:
            _writable(Path(args.output).resolve().parent, "-o/--output")
        parsed = [] if args.layers == ["all"] else [parse(n) for n in args.layers]
        layout = args.layout or (
            "bsd" if parsed and all(LAYERS[q.name].nchw is None for q in parsed) else "nchw"
        )
        names = layer_names(layout) if args.layers == ["all"] else [q.name for q in parsed]
        if mask is None and any(q.masked for q in parsed):  # a masked_ name without --mask: a picture with padding
            shape3 = shape or default_shape(layout)
            positions = shape3[1] if layout == "bsd" else math.prod(shape3[2:])
            mask = [positions if i % 2 == 0 else max(1, positions // 2) for i in range(shape3[0])]
        if len(names) == 1:
            title = f"masked {LAYERS[names[0]].title}" if parsed[0].masked else None
            fig = draw(names[0], layout, args.groups, shape, mask, view=args.view, title=title).figure
        else:
            fig = draw_grid(names, layout, args.groups, shape, mask, view=args.view)
        stem = "-".join(("masked_" if q.masked else "") + q.name for q in parsed) if 0 < len(parsed) <= 2 else "all"
        out = args.output or f"scope-{stem}-{layout}.png"
        print(_save(fig, out))
    except (ValueError, TypeError) as e:
        print(f"normscope draw: error: {e}", file=__import__("sys").stderr)
        return 2
    except OSError as e:  # an output that cannot be written: say which, not a traceback
        if str(e).startswith("argument "):
            msg = str(e)
        else:
            target = e.filename or args.output or args.all_dir
            msg = f"argument -o/--output: cannot write {str(target)!r}: {e.strerror or e}"
        print(f"normscope draw: error: {msg}", file=__import__("sys").stderr)
        return 2
    return 0
