"""The lab's outputs for people: one self-contained HTML page (images embedded as base64, opens
offline) and a plain-text summary table for the terminal."""

from __future__ import annotations

import base64
import html
import json
import shutil
import textwrap
import time
from collections.abc import Sequence
from pathlib import Path

from .core import EXPERIMENTS

_CSS = """
body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#222}
table{border-collapse:collapse;margin:.6em 0}td,th{border:1px solid #ccc;padding:.3em .6em;vertical-align:top;
font-size:.92em}th{background:#f3f3f3}.ok{background:#dff5df}.no{background:#fde2e2}.skip{background:#eee}
img{max-width:100%;border:1px solid #ddd;margin:.4em .4em 0 0}pre{background:#f7f7f7;padding:.6em;overflow:auto;
font-size:.8em}section{border-top:2px solid #444;margin-top:2em}
"""


def load_results(out: Path, experiments: Sequence[str] | None = None) -> list[dict]:
    """Every ``<out>/<experiment>/result.json`` that exists, in the lab's experiment order (only
    those of ``experiments`` if given)."""
    found = []
    for name in EXPERIMENTS:
        if experiments is not None and name not in experiments:
            continue
        p = Path(out) / name / "result.json"
        if p.exists():
            try:
                found.append(json.loads(p.read_text()))
            except json.JSONDecodeError:
                continue
    return found


def _cls(outcome: str) -> str:
    if outcome == "reproduced":
        return "ok"
    return "skip" if outcome.startswith(("skipped", "inconclusive", "not judged")) else "no"


def _img(path: Path) -> str:
    data = base64.b64encode(path.read_bytes()).decode()
    return f'<img alt="{html.escape(path.name)}" src="data:image/png;base64,{data}">'


def _when(r: dict) -> str:
    return f"{r.get('mode', '?')} mode, finished {r.get('finished_at', '?')}"


def write_report(out: str | Path, experiments: Sequence[str] | None = None,
                 requested: Sequence[str] | None = None) -> Path:
    """Write ``<out>/report.html`` from the results in ``out``: those of ``experiments`` only if
    given (what one ``run`` finished), every one found otherwise. Results found in ``out`` but left
    out are named at the end, with their mode and date, never mixed into the verdicts;
    ``requested`` names not finished are listed as not run."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    results = load_results(out, experiments)
    older = [r for r in load_results(out) if experiments is not None and r["experiment"] not in experiments]
    e = html.escape
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>normscope lab</title><style>{_CSS}</style>"
             "</head><body><h1>normscope lab</h1>",
             f"<p>Small, real training runs on CPU that test classic claims about normalization. Generated "
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}. Each verdict follows a rule fixed in code "
             f"(<code>normscope/tools/lab/verdicts.py</code>) before the runs; wall times are of a shared machine.</p>"]
    parts.append("<h2>Verdicts</h2><table><tr><th>experiment</th><th>claim</th><th>published</th>"
                 "<th>measured</th><th>verdict</th></tr>")
    for r in results:
        for v in r["verdicts"]:
            parts.append(f"<tr><td><a href='#{e(r['experiment'])}'>{e(r['experiment'])}</a></td><td>{e(v['claim'])}"
                         f"</td><td>{e(v['published'])}</td><td>{e(v['measured'])}</td>"
                         f"<td class='{_cls(v['outcome'])}'>{e(v['outcome'])}</td></tr>")
    parts.append("</table>")
    wanted = requested if requested is not None else EXPERIMENTS if experiments is None else experiments
    missing = [n for n in wanted if n not in {r["experiment"] for r in results}]
    if missing:
        parts.append(f"<p>Not run (or interrupted): {e(', '.join(missing))}</p>")
    for r in results:
        parts.append(f"<section id='{e(r['experiment'])}'><h2>{e(r['experiment'])}: {e(r['title'])}</h2>")
        parts.append(f"<p>{e(r['about']).replace(chr(10) + chr(10), '</p><p>')}</p>")
        parts.append("<table><tr><th>claim</th><th>rule (fixed beforehand)</th><th>measured</th><th>verdict</th></tr>")
        for v in r["verdicts"]:
            parts.append(f"<tr><td>{e(v['claim'])}<br><small>{e(v['published'])}</small></td><td>{e(v['rule'])}</td>"
                         f"<td>{e(v['measured'])}</td><td class='{_cls(v['outcome'])}'>{e(v['outcome'])}</td></tr>")
        parts.append("</table>")
        for name in r["plots"]:
            p = out / r["experiment"] / name
            if p.exists():
                parts.append(_img(p))
        if r["skipped"]:
            parts.append("<p><b>Skipped variants:</b> " + e("; ".join(f"{k}: {v}" for k, v in r["skipped"].items()))
                         + "</p>")
        if r["norm_sources"]:
            parts.append("<p><small>norm layers used: " + e("; ".join(f"{k}: {v}" for k, v in
                                                                     r["norm_sources"].items())) + "</small></p>")
        parts.append(f"<p><small>mode {e(r['mode'])}, finished {e(str(r.get('finished_at', '?')))}, seeds "
                     f"{e(str(r['seeds']))}, wall {r['wall_s']:.1f} s{e(_load_note(r))} "
                     f"({r['runs_computed']} runs computed, {r['runs_cached']} from cache), torch "
                     f"{e(r['versions'].get('torch', '?'))}</small></p>")
        parts.append(f"<details><summary>config</summary><pre>{e(json.dumps(r['config'], indent=1))}</pre></details>")
        parts.append("</section>")
    if older:
        parts.append("<section><h2>Not in this report</h2><p>Earlier results in this directory, not produced by "
                     "this run: " + e("; ".join(f"{r['experiment']} ({_when(r)})" for r in older)) + "</p></section>")
    parts.append("</body></html>")
    path = out / "report.html"
    tmp = path.with_suffix(".tmp")
    tmp.write_text("\n".join(parts))
    tmp.replace(path)
    return path


def summary_table(out: str | Path, experiments: Sequence[str] | None = None, width: int | None = None) -> str:
    """Plain text for the terminal: per verdict, the experiment and outcome, then the claim and
    what was measured, whole (wrapped to ``width``, the terminal's by default; never cut)."""
    width = width or max(60, min(shutil.get_terminal_size((100, 24)).columns, 120))
    lines = []
    for r in load_results(Path(out), experiments):
        for v in r["verdicts"]:
            lines.append(f"{r['experiment']}: {v['outcome']}")
            for label, text in (("claim", v["claim"]), ("measured", v["measured"])):
                lines.extend(textwrap.wrap(text, width, initial_indent=f"  {label}: ",
                                           subsequent_indent=" " * (len(label) + 4)))
    return "\n".join(lines)


def _load_note(r: dict) -> str:
    load = r.get("load_avg")
    if not load:
        return ""
    return f", 1-min load average {load['start']:.1f} at the start, {load['end']:.1f} at the end"


BEGIN, END = "<!-- lab-table:begin (generated from result.json) -->", "<!-- lab-table:end -->"


def markdown_table(out: str | Path) -> str:
    """The docs' results table, every cell copied from ``<out>/<experiment>/result.json``
    (``verdicts[i].claim``, ``.measured``, ``.outcome``, ``len(seeds)``, ``wall_s``): no number in
    it is typed by hand."""
    rows = ["| experiment | claim | measured | verdict | seeds |", "|---|---|---|---|---|"]
    walls = []
    for r in load_results(Path(out)):
        walls.append(f"{r['experiment']} {r['wall_s']:.0f} s")
        for v in r["verdicts"]:
            cells = (r["experiment"], v["claim"], v["measured"], v["outcome"], str(len(r["seeds"])))
            rows.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
    return "\n".join(rows) + "\n\nWall time per experiment (`wall_s`): " + ", ".join(walls) + ".\n"


def update_doc(doc: str | Path, out: str | Path) -> None:
    """Replace the text between the lab-table markers in ``doc`` with :func:`markdown_table`."""
    doc = Path(doc)
    text = doc.read_text()
    i, j = text.index(BEGIN) + len(BEGIN), text.index(END)
    doc.write_text(text[:i] + "\n" + markdown_table(out) + text[j:])


def quick_times(out: str | Path) -> dict[str, dict]:
    """Per experiment, the measured time of its quick-mode result in ``out`` (what ``--list`` and
    ``--help`` show)."""
    keep = ("wall_s", "runs_computed", "runs_cached", "finished_at", "load_avg", "version")
    return {r["experiment"]: {k: r[k] for k in keep if k in r} for r in load_results(Path(out)) if r["mode"] == "quick"}


if __name__ == "__main__":  # python -m normscope.tools.lab.report docs/lab docs/lab.md
    import sys

    update_doc(sys.argv[2], sys.argv[1])
    write_report(sys.argv[1])
