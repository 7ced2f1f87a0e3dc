"""The report for people: a terminal summary that fits one screen, and a self-contained HTML page with a
picture per measured quantity.

Both start from :meth:`Report.groups`: one entry per check and severity, its layers collapsed, the range
of its figure and one fix for the whole group. ``all=True`` (``normscope doctor --all``) adds every
finding, one per layer. The HTML page needs nothing from a network host: its style is inline, its
pictures are inline SVG (:mod:`normscope.doctor._svg`), it runs no script.
"""

from __future__ import annotations

import html
import json
from typing import Any

from ._finding import SEVERITIES
from ._svg import chart

__all__ = ["text_lines", "to_html", "DESCRIPTIONS"]

#: what each check's group says, in a few words (a check not listed shows its first finding's reason)
DESCRIPTIONS = {
    "bn-elements": "few values per BatchNorm statistic: noisy batch statistics",
    "train-eval-drift": "running statistics far from this batch's, beyond its sampling noise",
    "padding": "padded positions inside the statistics",
    "frozen-bn-updating": "frozen BatchNorms still updating their running statistics",
    "half-overflow": "values near or beyond the dtype's range",
    "eps-underflow": "eps below the half-precision dtype's resolution",
    "cancellation": "mean large against the std: a one-pass variance loses its digits",
    "dead-channels": "channels or scopes with variance below eps",
    "bias-before-norm": "a bias the following norm subtracts again",
    "post-ln": "norms on the residual stream (Post-LN)",
    "casting-order": "the casting order of half-precision RMS/LayerNorms",
    "batch-invariance": "a sample's output depends on the others in the batch",
    "syncbn": "SyncBatchNorm over uneven or single-process groups",
    "non-finite": "inf or NaN reached a norm",
    "residual-growth": "the residual stream grows with depth or over the steps",
}


def _num(v: float) -> str:
    if isinstance(v, float) and v.is_integer() and abs(v) < 1e15:
        return str(int(v))
    return f"{v:.3g}"


def _bound(group) -> str:
    """The threshold the group was held to, in words (``error below 100``)."""
    t = group.findings[0].threshold
    for key, v in t.items():
        if key.startswith(group.severity) and isinstance(v, (int, float)) and not isinstance(v, bool):
            return f"{key.replace('_', ' ')} {_num(float(v))}"
    return ""


def _figure(group) -> str:
    if group.measure is None:
        return ""
    lo, hi = group.low, group.high
    span = _num(lo) if lo == hi else f"{_num(lo)} to {_num(hi)}"
    bound = _bound(group)
    return f"{group.measure} {span}" + (f" ({bound})" if bound else "")


def _what(group) -> str:
    return DESCRIPTIONS.get(group.check) or group.findings[0].reason.split(": ")[0]


def text_lines(report, all: bool = False, title: str | None = None) -> list[tuple[str, str | None]]:
    """The report as terminal lines ``(text, style)``; style is a severity name or None. Without ``all``
    it fits one screen whatever the model's size: a line of counts, three lines per group (what, where,
    one fix) and the checks that found nothing; ``all`` adds every finding with its own fix."""
    out: list[tuple[str, str | None]] = []
    counts = ", ".join(f"{report.count(s)} {s}" for s in SEVERITIES)
    head = f"normscope {report.source}: {report.model}" + (f" ({title})" if title else "")
    groups = report.groups()
    out.append((head, "heading"))
    out.append(
        (f"inputs {', '.join(report.inputs) or '-'}; {report.seconds:.1f} s; {counts} in {len(groups)} group(s)", None)
    )
    if not report.findings:
        out.append(("nothing found", None))
    for g in groups:
        if g.modules == ("",):  # about the whole model: its own sentence says it
            out.append((f"{g.severity:<8}{g.check}: {g.findings[0].reason}", g.severity))
            out.append((f"        fix: {g.fix}", None))
            continue
        n = len(g.findings)
        figure = _figure(g)
        head = f"{g.severity:<8}{g.check}: {_what(g)} -- {n} layer{'s' if n != 1 else ''}"
        out.append((head + (f"; {figure}" if figure else ""), g.severity))
        out.append((f"        at {g.collapsed}", None))
        out.append((f"        fix: {g.fix}", None))
    quiet = [c for c, v in report.checks.items() if v.get("ran") and not any(f.check == c for f in report.findings)]
    skipped = [c for c, v in report.checks.items() if not v.get("ran")]
    if quiet:
        out.append((f"nothing found: {', '.join(quiet)}", None))
    if skipped:
        out.append((f"did not apply: {', '.join(skipped)} (report.checks, --json and --html say why)", None))
    if all:
        out.append(("", None))
        out.append(("every finding:", "heading"))
        for i, f in enumerate(report.findings, 1):
            out.append((f"{i}. [{f.severity}] {f.check} {f.module or '<model>'}: {f.reason}", f.severity))
            out.append((f"   fix: {f.fix}", None))
    elif any(len(g.findings) > 1 for g in groups):
        out.append(
            ("every layer with its own figures and fix: --all; thresholds and their sources: --json or --html", None)
        )
    return out


# ------------------------------------------------------------------------------------------ HTML

_CSS = """body{font:14px/1.45 system-ui,sans-serif;max-width:1100px;margin:1.5em auto;padding:0 1em;color:#222}
h1{font-size:1.45em;margin-bottom:.2em}h2{font-size:1.15em;margin:1.6em 0 .3em;border-bottom:1px solid #ddd}
table{border-collapse:collapse;width:100%}td,th{border-bottom:1px solid #e3e3e3;padding:4px 6px;text-align:left;
vertical-align:top}code{background:#f3f3f3;padding:1px 3px;font-size:12.5px;word-break:break-all}
.error{color:#b00020;font-weight:600}.warning{color:#a86400;font-weight:600}.info{color:#1f5fa8}
.counts span{margin-right:1em}figure{margin:.6em 0}figcaption{color:#555;font-size:12.5px}
details{margin:.4em 0}summary{cursor:pointer;color:#333}small{color:#666}svg.chart{max-width:100%;height:auto}"""


def _json(v: Any) -> str:
    return json.dumps(v, allow_nan=False)


def to_html(report, fixed: tuple | None = None) -> str:
    """A self-contained HTML page of ``report`` (and, with ``fixed = (lines, report after)``, what the
    automatic fixes changed): nothing is fetched, no script runs."""
    e = html.escape
    groups = report.groups()
    counts = "".join(f"<span class='{s}'>{report.count(s)} {s}</span>" for s in SEVERITIES)
    rows = "".join(
        f"<tr><td class='{g.severity}'>{g.severity}</td><td><a href='#check-{e(g.check)}'>{e(g.check)}</a></td>"
        + (
            f"<td colspan='4'>{e(g.findings[0].reason)}</td>"
            if g.modules == ("",)
            else f"<td>{e(_what(g))}</td><td>{len(g.findings)}</td><td><code>{e(g.collapsed)}</code></td>"
            f"<td>{e(_figure(g))}</td>"
        )
        + f"<td><code>{e(g.fix)}</code></td></tr>"
        for g in groups
    )
    summary = (
        "<table class='summary'><tr><th>severity</th><th>check</th><th>what</th><th>layers</th><th>where</th>"
        f"<th>measured</th><th>one fix for the group</th></tr>{rows}</table>"
        if groups
        else "<p>Nothing found.</p>"
    )
    sections = []
    for check in dict.fromkeys([g.check for g in groups] + [s.check for s in report.series]):
        pictures = "".join(
            f"<figure>{chart(s)}<figcaption>{e(s.title)}</figcaption></figure>"
            for s in report.series
            if s.check == check
        )
        details = []
        for g in (g for g in groups if g.check == check):
            items = "".join(
                f"<tr><td><code>{e(f.module or '<model>')}</code></td><td>{e(f.reason)}<br><small>measured: "
                f"{e(_json(_scalars(f.as_dict()['measured'])))}<br>threshold: {e(_json(f.as_dict()['threshold']))}"
                f"</small></td><td><code>{e(f.fix)}</code></td></tr>"
                for f in g.findings
            )
            details.append(
                f"<details><summary><span class='{g.severity}'>{g.severity}</span>: {len(g.findings)} finding(s), "
                f"each with its figures, threshold, source and fix</summary><table>{items}</table></details>"
            )
        note = report.checks.get(check, {}).get("note", "")
        sections.append(
            f"<section id='check-{e(check)}'><h2>{e(check)}</h2><p>{e(DESCRIPTIONS.get(check, ''))}"
            + (f" <small>({e(note)})</small>" if note else "")
            + f"</p>{pictures}{''.join(details)}</section>"
        )
    notes = "".join(
        f"<li><b>{e(k)}</b>: {e(v.get('note') or 'nothing found')}</li>"
        for k, v in report.checks.items()
        if not any(g.check == k for g in groups) and not any(s.check == k for s in report.series)
    )
    after = ""
    if fixed is not None:
        lines, again = fixed
        after = (
            "<h2>After the fixes</h2><pre>"
            + e("\n".join(lines) or "(no automatic fix)")
            + "</pre><p>"
            + e(", ".join(f"{again.count(s)} {s}" for s in SEVERITIES))
            + "</p>"
        )
    return (
        "<!doctype html><html lang='en'><head><meta charset='utf-8'><meta name='viewport' "
        "content='width=device-width, initial-scale=1'><title>normscope "
        f"{e(report.source)}: {e(report.model)}</title><style>{_CSS}</style></head><body>"
        f"<h1>normscope {e(report.source)}: {e(report.model)}</h1>"
        f"<p>inputs {e(', '.join(report.inputs))}; {report.seconds:.1f} s; "
        f"{len(report.layers)} norm layers measured</p>"
        f"<p class='counts'>{counts}</p>{summary}{''.join(sections)}"
        + (f"<h2>The other checks</h2><ul>{notes}</ul>" if notes else "")
        + f"{after}</body></html>"
    )


def _scalars(measured: dict) -> dict:
    """The figures of a finding without its long per-channel lists (those are drawn)."""
    return {k: v for k, v in measured.items() if not (isinstance(v, list) and len(v) > 16)}
