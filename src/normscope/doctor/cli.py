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
import importlib
import importlib.util
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
    p.add_argument("--all", action="store_true", help="list every finding (one per layer), not only the groups")
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
        render(report, plain=args.plain, all=args.all)
        if fixed is not None:
            print("\nfixes applied (to the model in memory; no file written):")
            for line in fixed[0] or ["(none of the findings has an automatic fix)"]:
                print(f"  {line}")
            print()
            render(fixed[1], plain=args.plain, title="after the fixes", all=args.all)
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


def render(report, plain: bool = False, title: str | None = None, all: bool = False) -> None:
    """The report in the terminal (rich when installed): its groups, one screen whatever the model's size;
    with ``all``, every finding too."""
    from ..terminal import Out
    from ._render import text_lines

    out = Out(plain=plain)
    for text, style in text_lines(report, all=all, title=title):
        if style == "heading":
            out.heading(text)
        else:
            out.line(text, style={"error": "bold red", "warning": "yellow", "info": "cyan"}.get(style or ""))


def to_html(report, fixed: tuple | None = None) -> str:
    """A self-contained HTML page of ``report`` (pictures inline; nothing is fetched)."""
    from ._render import to_html as page

    return page(report, fixed)


if __name__ == "__main__":
    raise SystemExit(main())
