"""``normscope doctor MODULE:CALLABLE``: the doctor on the command line.

``CALLABLE`` (a function in ``MODULE``, a module name or a ``.py`` file) builds the model and one
batch and returns ``(model, inputs)`` or ``(model, inputs, kwargs)``; ``inputs`` is a tensor or a
tuple of positional inputs. Nothing is downloaded and nothing of the user's is written: ``--fix``
converts the model in memory, prints the lines it applied and diagnoses the result again.

Exit status: 0 done (and nothing at or above ``--fail-on``), 1 findings at or above ``--fail-on``,
or the callable / the forward failed (the model is left as it was), 2 bad arguments.
"""

from __future__ import annotations

import argparse
import base64
import html
import importlib
import importlib.util
import io
import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any

__all__ = ["main", "load"]


class LoadError(Exception):
    """The MODULE:CALLABLE could not give a model and inputs; the message says why."""


def load(target: str) -> tuple[Any, tuple, dict]:
    """Import ``MODULE:CALLABLE``, call it, and check what it returned: ``(model, inputs, kwargs)``."""
    import torch

    module_name, sep, attr = target.rpartition(":")
    if not sep or not module_name or not attr:
        raise LoadError(f"expected MODULE:CALLABLE (e.g. mymodels:build or ./models.py:build), got {target!r}")
    try:
        if module_name.endswith(".py") or os.sep in module_name:
            path = Path(module_name)
            if not path.is_file():
                raise LoadError(f"no such file: {module_name!r}")
            spec = importlib.util.spec_from_file_location(f"_normscope_doctor_{path.stem}", path)
            module = importlib.util.module_from_spec(spec)
            sys.path.insert(0, str(path.resolve().parent))
            try:
                spec.loader.exec_module(module)
            finally:
                sys.path.remove(str(path.resolve().parent))
        else:
            if "" not in sys.path and os.getcwd() not in sys.path:  # as `python -m` finds the user's modules
                sys.path.insert(0, os.getcwd())
            module = importlib.import_module(module_name)
    except LoadError:
        raise
    except Exception as e:  # the user's module: any error is reported, with where it happened
        raise LoadError(f"importing {module_name!r} failed: {_where(e)}") from e
    fn = getattr(module, attr, None)
    if fn is None or not callable(fn):
        found = "nothing" if fn is None else type(fn).__name__
        raise LoadError(f"{module_name!r} has no callable {attr!r} (found {found})")
    try:
        got = fn()
    except Exception as e:  # the user's code
        raise LoadError(f"{target} raised {_where(e)}") from e
    if not isinstance(got, (tuple, list)) or len(got) not in (2, 3):
        raise LoadError(f"{target} must return (model, inputs) or (model, inputs, kwargs), got {_kind(got)}")
    model, inputs, kwargs = got[0], got[1], (got[2] if len(got) == 3 else {})
    if not isinstance(model, torch.nn.Module):
        raise LoadError(f"{target} returned a {_kind(model)} as the model, expected a torch.nn.Module")
    if isinstance(inputs, torch.Tensor):
        inputs = (inputs,)
    if not isinstance(inputs, (tuple, list)):
        raise LoadError(f"{target} returned {_kind(inputs)} as the inputs, expected a tensor or a tuple of inputs")
    if not isinstance(kwargs, dict):
        raise LoadError(f"{target} returned {_kind(kwargs)} as the keyword inputs, expected a dict")
    return model, tuple(inputs), kwargs


def _kind(v: Any) -> str:
    if isinstance(v, (tuple, list)):
        return f"a {type(v).__name__} of {len(v)}"
    return type(v).__name__


def _where(e: BaseException) -> str:
    tb = traceback.extract_tb(e.__traceback__)
    at = f" (at {Path(tb[-1].filename).name}:{tb[-1].lineno})" if tb else ""
    return f"{type(e).__name__}: {e}{at}"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="normscope doctor",
        description="Diagnose a model's normalization layers on one real batch: per layer, the number, the threshold "
        "and its source, and a fix.",
        epilog="CALLABLE returns (model, inputs) or (model, inputs, kwargs). Example: normscope doctor "
        "mymodels:build --fail-on error",
    )
    p.add_argument("target", metavar="MODULE:CALLABLE", help="e.g. mymodels:build or ./models.py:build")
    p.add_argument("--json", action="store_true", help="print the report as JSON (schema normscope.doctor/1)")
    p.add_argument("--html", metavar="PATH", help="also write a self-contained HTML report to PATH")
    p.add_argument("--fail-on", choices=("warning", "error"), help="exit 1 if a finding is at least this serious")
    p.add_argument("--fix", action="store_true", help="apply the fixes to the model in memory, print them, re-check")
    p.add_argument("--world-size", type=int, metavar="N", help="data-parallel processes the batch is split over")
    p.add_argument("--checks", metavar="A,B", help="run only these checks (comma-separated). Default: all")
    p.add_argument("--plain", action="store_true", help="plain text even when rich is installed")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run ``normscope doctor``; returns the exit status."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.world_size is not None and args.world_size < 1:
        parser.error(f"argument --world-size: expected a positive integer, got {args.world_size}")
    from .checks import CHECKS

    checks = None
    if args.checks is not None:
        checks = [c.strip() for c in args.checks.split(",") if c.strip()]
        unknown = [c for c in checks if c not in CHECKS]
        if unknown or not checks:
            parser.error(f"argument --checks: expected names from {', '.join(CHECKS)}, got {args.checks!r}")
    if args.html:
        parent = Path(args.html).resolve().parent
        if not parent.is_dir():
            parser.error(f"argument --html: the directory {str(parent)!r} does not exist")
        if Path(args.html).is_dir():
            parser.error(f"argument --html: expected a file to write, got the directory {args.html!r}")
    progress = (lambda line: None) if args.quiet else (lambda line: print(f"doctor: {line}", file=sys.stderr))
    progress(f"building {args.target}")
    try:
        model, inputs, kwargs = load(args.target)
    except LoadError as e:
        print(f"normscope doctor: {e}", file=sys.stderr)
        return 1
    from . import apply_fixes, doctor

    try:
        report = doctor(model, *inputs, world_size=args.world_size, checks=checks, progress=progress, **kwargs)
    except Exception as e:  # the user's forward: reported, and the doctor has put the model back
        print(f"normscope doctor: the model's forward raised {_where(e)}; the model is unchanged", file=sys.stderr)
        return 1
    fixed = None
    if args.fix:
        import copy

        batches = [inputs] if not kwargs else ([kwargs] if not inputs else None)
        model_copy = copy.deepcopy(model)
        model_copy, lines = apply_fixes(model_copy, report, batches)
        progress(f"re-checking after {len(lines)} fix line(s)")
        again = doctor(model_copy, *inputs, world_size=args.world_size, checks=checks, progress=progress, **kwargs)
        fixed = (lines, again)
    if args.json:
        doc = report.as_dict()
        if fixed is not None:
            doc["fix"] = {"applied": fixed[0], "after": fixed[1].as_dict()}
        print(json.dumps(doc, indent=2, allow_nan=False))
    else:
        render(report, plain=args.plain)
        if fixed is not None:
            print("\nfixes applied (to the model in memory; no file written):")
            for line in fixed[0] or ["(none of the findings has an automatic fix)"]:
                print(f"  {line}")
            print()
            render(fixed[1], plain=args.plain, title="after the fixes")
    if args.html:
        try:
            Path(args.html).write_text(to_html(report, fixed))
        except OSError as e:  # e.g. no permission: said in one line, after the report it could not save
            print(f"normscope doctor: argument --html: cannot write {args.html!r}: {e.strerror or e}", file=sys.stderr)
            return 1
        progress(f"HTML report written to {args.html}")
    final = fixed[1] if fixed is not None else report
    if args.fail_on:
        from ._report import SEVERITIES

        bad = SEVERITIES[: SEVERITIES.index(args.fail_on) + 1]
        if any(f.severity in bad for f in final.findings):
            return 1
    return 0


def _short(measured: dict) -> str:
    parts = []
    for k, v in measured.items():
        if isinstance(v, float):
            parts.append(f"{k}={v:.3g}")
        elif isinstance(v, (int, str, bool)) and len(str(v)) < 24:
            parts.append(f"{k}={v}")
        if len(parts) == 3:
            break
    return ", ".join(parts)


def render(report, plain: bool = False, title: str | None = None) -> None:
    """The report as a terminal table (rich when installed), most serious first, then the fixes."""
    from ..terminal import Out

    out = Out(plain=plain)
    out.heading(f"normscope doctor: {report.model}" + (f" ({title})" if title else ""))
    counts = ", ".join(f"{report.count(s)} {s}" for s in ("error", "warning", "info"))
    out.line(f"inputs {', '.join(report.inputs)}; {counts}; {report.seconds:.1f} s")
    if not report.findings:
        out.line("nothing found")
        return
    rows = [(f.severity, f.check, f.module or "<model>", _short(f.measured)) for f in report.findings]
    out.table(["severity", "check", "module", "measured"], rows, align="llll")
    for i, f in enumerate(report.findings, 1):
        out.line(f"{i}. [{f.severity}] {f.check} {f.module or '<model>'}: {f.reason}")
        out.line(f"   fix: {f.fix}")
    out.line("thresholds and their sources: --json or --html")


# ------------------------------------------------------------------------------------------ HTML

_CSS = """body{font:14px/1.45 system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#222}
table{border-collapse:collapse;width:100%}td,th{border-bottom:1px solid #ddd;padding:4px 6px;text-align:left;
vertical-align:top}code{background:#f4f4f4;padding:1px 3px}.error{color:#b00020;font-weight:bold}
.warning{color:#b36b00;font-weight:bold}.info{color:#1f5fa8}.bar{background:#4a7fc1;height:12px;display:inline-block}
figure{margin:1em 0}small{color:#666}"""


def _plots(report) -> list[tuple[str, str]]:
    """(title, inline image or HTML bars) for the checks where a picture says more."""
    series = [
        ("bn-elements", "elements per statistic", "elements", True),
        ("train-eval-drift", "running vs batch statistics (distance)", "distance", False),
        ("padding", "padded fraction of a statistic's positions", "pad_fraction_max", False),
    ]
    figures = []
    for check, label, key, log in series:
        items = [
            (f.module, f.measured[key], f.threshold)
            for f in report.findings
            if f.check == check and f.module and isinstance(f.measured.get(key), (int, float))
        ]
        if not items:
            continue
        figures.append((f"{check}: {label}", _bar_chart(items, label, log)))
    drift = [f for f in report.findings if f.check == "train-eval-drift" and "per_channel_mean_shift" in f.measured]
    if drift:
        hist = _histograms(drift[:6])
        if hist:
            figures.append(("train-eval-drift: per-channel |mu_B - mu| / sigma and |var_B / var - 1|", hist))
    return figures


def _png(fig) -> str:
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=90)
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode()


def _histograms(findings: list) -> str | None:
    """Per layer, histograms of its channels' mean shift and variance change (matplotlib only)."""
    try:
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, axes = plt.subplots(len(findings), 2, figsize=(7, 1.6 * len(findings) + 0.4), squeeze=False)
    for row, f in zip(axes, findings):
        for ax, key, color in zip(row, ("per_channel_mean_shift", "per_channel_var_change"), ("#4a7fc1", "#b36b00")):
            ax.hist(f.measured[key], bins=30, color=color)
            ax.set_title(f"{f.module}: {key.replace('per_channel_', '').replace('_', ' ')}", fontsize=8)
            ax.tick_params(labelsize=7)
    return f"<img alt='per-channel histograms' src='data:image/png;base64,{_png(fig)}'>"


def _bar_chart(items: list, label: str, log: bool) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt
    except ImportError:
        top = max(v for _, v, _ in items) or 1
        rows = "".join(
            f"<tr><td><code>{html.escape(m)}</code></td><td><span class='bar' style='width:{300 * v / top:.0f}px'>"
            f"</span> {v:.3g}</td></tr>"
            for m, v, _ in items
        )
        return f"<table>{rows}</table>"
    fig, ax = plt.subplots(figsize=(7, 0.35 * len(items) + 1.2))
    names = [m for m, _, _ in items]
    ax.barh(range(len(items)), [v for _, v, _ in items], color="#4a7fc1")
    ax.set_yticks(range(len(items)), names, fontsize=8)
    ax.invert_yaxis()
    for key, style in (("warning_below", "--"), ("error_below", ":"), ("warning_above", "--")):
        t = items[0][2].get(key)
        if isinstance(t, (int, float)) and t > 0:
            ax.axvline(t, color="#b36b00" if "warning" in key else "#b00020", ls=style, label=f"{key} {t:g}")
    if log:
        ax.set_xscale("log")
    ax.set_xlabel(label)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    return f"<img alt='{html.escape(label)}' src='data:image/png;base64,{_png(fig)}'>"


def _scalars(measured: dict) -> dict:
    """The figures of a finding without its long per-channel lists (those are plotted)."""
    return {k: v for k, v in measured.items() if not (isinstance(v, list) and len(v) > 16)}


def to_html(report, fixed: tuple | None = None) -> str:
    """A self-contained HTML page of ``report`` (images inline; nothing is fetched)."""
    e = html.escape
    rows = "".join(
        f"<tr><td class='{f.severity}'>{f.severity}</td><td>{e(f.check)}</td><td><code>{e(f.module or '<model>')}"
        f"</code></td><td>{e(f.reason)}<br><small>measured: {e(json.dumps(_scalars(f.as_dict()['measured'])))}"
        f"<br>threshold: {e(json.dumps(f.as_dict()['threshold']))}</small></td><td><code>{e(f.fix)}</code></td></tr>"
        for f in report.findings
    )
    figs = "".join(f"<figure><figcaption>{e(t)}</figcaption>{img}</figure>" for t, img in _plots(report))
    notes = "".join(f"<li>{e(k)}: {e(v['note'])}</li>" for k, v in report.checks.items() if v.get("note"))
    after = ""
    if fixed is not None:
        lines, again = fixed
        after = (
            "<h2>After the fixes</h2><pre>"
            + e("\n".join(lines) or "(no automatic fix)")
            + "</pre><p>"
            + e(", ".join(f"{again.count(s)} {s}" for s in ("error", "warning", "info")))
            + "</p>"
        )
    counts = ", ".join(f"{report.count(s)} {s}" for s in ("error", "warning", "info"))
    return (
        "<!doctype html><html><head><meta charset='utf-8'><title>normscope doctor: "
        f"{e(report.model)}</title><style>{_CSS}</style></head><body><h1>normscope doctor: {e(report.model)}</h1>"
        f"<p>inputs {e(', '.join(report.inputs))}; {counts}; {report.seconds:.1f} s</p>"
        "<table><tr><th>severity</th><th>check</th><th>module</th><th>finding</th><th>fix</th></tr>"
        f"{rows}</table>{figs}"
        + (f"<h2>Checks that did not apply</h2><ul>{notes}</ul>" if notes else "")
        + f"{after}</body></html>"
    )


if __name__ == "__main__":
    raise SystemExit(main())
