"""The report's pictures as inline SVG: a measured quantity against a model's norm layers in forward order
(or against training steps), with its thresholds drawn.

Plain SVG text, written here: no plotting library, nothing fetched, the same in every browser and in the
docs. Each point carries a ``<title>`` (the layer's path and its value) that a browser shows on hover;
points beyond a threshold are drawn in the threshold's colour, so where in the depth a problem starts
shows at a glance. Non-finite values are drawn at the edge of the plot, marked.
"""

from __future__ import annotations

import html
import math

from ._finding import Series

__all__ = ["chart"]

_W, _H = 760, 270  # the picture's size in CSS pixels
_LEFT, _RIGHT, _TOP = 64, 16, 14  # margins: tick labels left
_BOTTOM = {"layer": 84, "step": 40}  # below: slanted layer names, or step numbers
_COLORS = ("#3b6fb6", "#7a9a3a", "#8c5aa8", "#c0703a", "#3a9a9a", "#9a3a5a")
_LEVELS = {"error": "#b00020", "warning": "#c77c00", "info": "#1f5fa8"}


def _level(name: str) -> str:
    return next((c for k, c in _LEVELS.items() if k in name), "#666")


def _fmt(v: float) -> str:
    if v == 0 or not math.isfinite(v):
        return str(v)
    if 1e-3 <= abs(v) < 1e5:
        return f"{v:.4g}"
    return f"{v:.2e}"


def _ticks(lo: float, hi: float, log: bool) -> list[float]:
    if log:
        a, b = math.floor(math.log10(lo)), math.ceil(math.log10(hi))
        step = max(1, (b - a) // 6)
        return [10.0**e for e in range(a, b + 1, step)]
    if hi == lo:
        return [lo]
    raw = (hi - lo) / 5
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    start = math.ceil(lo / step) * step
    return [start + i * step for i in range(int((hi - start) / step + 1e-9) + 1)]


def chart(series: Series, width: int = _W, height: int = _H, standalone: bool = False) -> str:
    """``series`` as an ``<svg>`` element (a string), ``width`` x ``height`` CSS pixels; ``standalone``
    adds the SVG namespace that a ``.svg`` file needs (an HTML page's inline SVG does not)."""
    e = html.escape
    if series.x != "layer":
        height -= _BOTTOM["layer"] - _BOTTOM["step"]  # no layer names to make room for
    pw, ph = width - _LEFT - _RIGHT, height - _TOP - _BOTTOM["layer" if series.x == "layer" else "step"]
    points = [(x, y) for pts in series.lines.values() for x, y in pts]
    finite = [y for _, y in points if isinstance(y, (int, float)) and math.isfinite(y)]
    values = finite + [t for t in series.thresholds.values() if math.isfinite(t)]
    if series.log:
        values = [v for v in values if v > 0]
    if not values:
        values = [1.0] if series.log else [0.0, 1.0]
    lo, hi = min(values), max(values)
    if not series.log:
        lo = min(lo, 0.0)
        hi = hi if hi > lo else lo + 1.0
        pad = (hi - lo) * 0.06
        hi += pad
    else:
        lo, hi = lo / 2, hi * 2

    def ty(v: float) -> float:
        if not math.isfinite(v):
            v = hi if v > 0 or math.isnan(v) else lo
        if series.log:
            v = max(v, lo)
            return _TOP + ph * (1 - (math.log10(v) - math.log10(lo)) / (math.log10(hi) - math.log10(lo)))
        return _TOP + ph * (1 - (v - lo) / (hi - lo))

    if series.x == "layer":
        n = max(len(series.labels), 1 + max((int(x) for x, _ in points), default=0))
        x_lo, x_hi = -0.5, n - 0.5
    else:
        xs = [x for x, _ in points] or [0.0]
        x_lo, x_hi = min(xs), max(xs) if max(xs) > min(xs) else min(xs) + 1
        n = 0

    def tx(x: float) -> float:
        return _LEFT + pw * (x - x_lo) / (x_hi - x_lo)

    parts = [
        "<svg"
        + (" xmlns='http://www.w3.org/2000/svg'" if standalone else "")
        + f" class='chart' width='{width}' height='{height}' "
        f"viewBox='0 0 {width} {height}' role='img' aria-label='{e(series.title)}' data-check='{e(series.check)}'>",
        f"<rect x='{_LEFT}' y='{_TOP}' width='{pw}' height='{ph}' fill='#fafafa' stroke='#ccc'/>",
    ]
    for t in _ticks(lo if not series.log else max(lo, 1e-300), hi, series.log):
        if not lo <= t <= hi:
            continue
        y = ty(t)
        parts.append(f"<line x1='{_LEFT}' x2='{_LEFT + pw}' y1='{y:.1f}' y2='{y:.1f}' stroke='#e4e4e4'/>")
        label = f"{t:.0e}" if series.log and not 1e-3 <= t < 1e5 else _fmt(t)
        parts.append(f"<text x='{_LEFT - 4}' y='{y + 3:.1f}' font-size='10' text-anchor='end'>{e(label)}</text>")
    parts.append(
        f"<text x='12' y='{_TOP + ph / 2:.0f}' font-size='11' text-anchor='middle' "
        f"transform='rotate(-90 12 {_TOP + ph / 2:.0f})'>{e(series.y)}</text>"
    )
    if series.x == "layer":
        every = max(1, math.ceil(n / 24))
        for i, label in enumerate(series.labels):
            if i % every and i != n - 1:
                continue
            x = tx(i)
            short = label if len(label) <= 18 else "…" + label[-17:]
            parts.append(
                f"<text x='{x:.1f}' y='{_TOP + ph + 10}' font-size='9' text-anchor='end' "
                f"transform='rotate(-40 {x:.1f} {_TOP + ph + 10})'><title>{e(label)}</title>{e(short)}</text>"
            )
        parts.append(
            f"<text x='{_LEFT + pw / 2:.0f}' y='{height - 4}' font-size='11' text-anchor='middle'>"
            f"norm layers in forward order ({n})</text>"
        )
    else:
        for t in _ticks(x_lo, x_hi, False):
            x = tx(t)
            parts.append(f"<text x='{x:.1f}' y='{_TOP + ph + 14}' font-size='10' text-anchor='middle'>{_fmt(t)}</text>")
        parts.append(
            f"<text x='{_LEFT + pw / 2:.0f}' y='{height - 8}' font-size='11' text-anchor='middle'>{e(series.x)}</text>"
        )
    for name, value in series.thresholds.items():
        if not math.isfinite(value) or (series.log and value <= 0) or not lo <= value <= hi:
            continue
        y, c = ty(value), _level(name)
        parts.append(
            f"<line x1='{_LEFT}' x2='{_LEFT + pw}' y1='{y:.1f}' y2='{y:.1f}' stroke='{c}' stroke-dasharray='5 3'/>"
        )
        parts.append(
            f"<text x='{_LEFT + pw - 4}' y='{y - 3:.1f}' font-size='10' text-anchor='end' fill='{c}'>"
            f"{e(name)} {e(_fmt(value))}</text>"
        )
    above = [(k, v) for k, v in series.thresholds.items() if "below" not in k]
    below = [(k, v) for k, v in series.thresholds.items() if "below" in k]

    def color_of(y: float, default: str) -> str:
        if not math.isfinite(y):
            return _LEVELS["error"]
        for k, v in sorted(above, key=lambda kv: -kv[1]):
            if y > v:
                return _level(k)
        for k, v in sorted(below, key=lambda kv: kv[1]):
            if y < v:
                return _level(k)
        return default

    for i, (name, pts) in enumerate(series.lines.items()):
        base = _COLORS[i % len(_COLORS)]
        pts = sorted(pts)
        if len(pts) > 1:
            path = " ".join(f"{'M' if j == 0 else 'L'}{tx(x):.1f},{ty(y):.1f}" for j, (x, y) in enumerate(pts))
            parts.append(f"<path d='{path}' fill='none' stroke='{base}' stroke-width='1.2' opacity='0.7'/>")
        for x, y in pts:
            label = series.labels[int(x)] if series.x == "layer" and 0 <= int(x) < len(series.labels) else _fmt(x)
            tip = f"{label}: {name} = {_fmt(y)}"
            c = color_of(y, base) if i == 0 else base
            parts.append(
                f"<circle cx='{tx(x):.1f}' cy='{ty(y):.1f}' r='{2.6 if len(pts) < 120 else 1.6}' fill='{c}'>"
                f"<title>{e(tip)}</title></circle>"
            )
        if len(series.lines) > 1:
            ly = _TOP + 12 + 13 * i
            parts.append(f"<rect x='{_LEFT + 6}' y='{ly - 8}' width='10' height='3' fill='{base}'/>")
            parts.append(f"<text x='{_LEFT + 20}' y='{ly - 4}' font-size='10'>{e(name)}</text>")
    parts.append("</svg>")
    return "".join(parts)
