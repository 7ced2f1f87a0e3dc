"""The ``normscope`` command line.

Built-in commands::

    normscope tour [--json] [--plain] [--pictures DIR]
    normscope explain LAYER [--shape N,C,H,W] [--groups G] [--heads H] [--mask L1,L2,...] [--values v1,v2,...]
                      [--last K] [--eps E] [--json]

Commands provided by optional parts of the package are imported only when run (so ``normscope
tour`` never pays for them and a missing part gives a clear message, not a traceback); each
receives the rest of the command line as ``module.main(argv) -> int``. To add one, add a row to
:data:`COMMANDS`.

Exit status: 0 success, 1 a check or command failed, 2 bad arguments.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from collections.abc import Sequence

__all__ = ["COMMANDS", "main"]

#: lazily imported subcommands: name -> (module, help). The module's ``main(argv)`` runs them.
COMMANDS: dict[str, tuple[str, str]] = {
    "bench": (
        "normscope.tools.bench",
        "benchmark normscope against PyTorch, torch.compile and Liger (its Triton kernels on CUDA, else its CPU paths)",
    ),
    "doctor": ("normscope.doctor.cli", "diagnose a model's normalization layers on one real batch"),
    "draw": ("normscope.tools.viz", "draw pictures of each normalization's scope"),
    "explore": ("normscope.tools.explorer", "open the interactive scope explorer (a local web page)"),
    "lab": ("normscope.tools.lab", "small CPU training runs that reproduce the classic claims"),
}


#: optional packages -> the extra that installs them, for the "not installed" message
_EXTRA_OF = {
    "matplotlib": "viz",
    "sklearn": "lab",
    "rich": "cli",
    "triton": "kernels",
    "liger_kernel": "bench",
    "transformers": "integrations",
    "onnx": "integrations",
    "onnxruntime": "integrations",
    "onnxscript": "integrations",
}


def _missing_dependency(e: ImportError) -> str | None:
    """The one-line message for an optional third-party package that is not installed, else None
    (an import error inside normscope itself is a bug and keeps its traceback)."""
    cause = e if isinstance(e, ModuleNotFoundError) else e.__cause__
    if not isinstance(cause, ModuleNotFoundError) or not cause.name:
        return None
    top = cause.name.split(".")[0]
    if top == "normscope":
        return None
    if top == "numpy":  # a core dependency, lost from a broken environment
        return "needs the package 'numpy', which is not installed (pip install numpy; normscope depends on it)"
    extra = _EXTRA_OF.get(top)
    how = f"pip install 'normscope[{extra}]'" if extra else 'pip install -e ".[dev]"'
    return f"needs the package {top!r}, which is not installed ({how})"


def _shape(text: str) -> tuple[int, ...]:
    try:  # "2,3,2,2" or "2x3x2x2"
        shape = tuple(int(s) for s in text.strip().replace("x", ",").split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated positive integers such as 2,3,2,2, got {text!r}"
        ) from None
    if not shape or any(s < 1 for s in shape):
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers such as 2,3,2,2, got {text!r}")
    return shape


def _values(text: str) -> list[float]:
    try:
        return [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers such as 10,2,6,14, got {text!r}") from None


def _lengths(text: str) -> list[int]:
    try:
        lengths = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        lengths = []
    if not lengths:
        raise argparse.ArgumentTypeError(f"expected comma-separated lengths such as 4,2, got {text!r}")
    return lengths


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        v = 0
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return v


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="normscope",
        description="Every normalization layer is mean, variance, normalize, affine over a different scope.",
    )
    from ._version import __version__

    parser.add_argument("--version", action="version", version=f"normscope {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    tour = sub.add_parser(
        "tour",
        help="the classic worked examples of normalization, recomputed and checked against torch",
        description="Recompute the worked examples that tutorials on normalization use, by hand, with normscope "
        "and with torch.nn, and check that they agree. Exits 1 if any check fails.",
    )
    tour.add_argument("--json", action="store_true", help="print machine-readable results")
    tour.add_argument("--plain", action="store_true", help="plain text even when rich is installed")
    tour.add_argument(
        "--pictures", metavar="DIR", help="also draw the scope pictures into DIR (needs normscope.tools.viz)"
    )

    from .tools.named import spellings

    explain = sub.add_parser(
        "explain",
        help="one layer on one small tensor: its scope, statistics, output and the torch comparison",
        description="Explain what one normalization layer does to a small tensor. Every option has a default: "
        "`normscope explain NAME` works for every NAME below.",
        epilog="examples:\n"
        "  normscope explain group\n"
        "  normscope explain layer --shape 4 --values 10,2,6,14\n"
        "  normscope explain BatchNorm2d --shape 2,3,2,2\n"
        "  normscope explain qknorm --shape 2,3,8 --heads 4\n"
        "  normscope explain masked_batch --shape 2,3,5 --mask 5,2 --json",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    explain.add_argument(
        "layer",
        metavar="LAYER",
        help=f"{', '.join(spellings())} (or torch names: BatchNorm2d, LayerNorm, GroupNorm, LayerNorm2d, ...)",
    )
    explain.add_argument(
        "--shape",
        type=_shape,
        help="input shape, e.g. 2,3,2,2 (N,C,H,W; B,S,D for qknorm and adaln). Default: a small one",
    )
    explain.add_argument(
        "--groups",
        type=_positive_int,
        help="group layer: number of groups (qknorm: the same as --heads). Default: 2, or the smallest divisor of C",
    )
    explain.add_argument(
        "--heads",
        type=_positive_int,
        help="qknorm layer: number of heads splitting D. Default: 2, or the smallest divisor",
    )
    explain.add_argument(
        "--mask",
        type=_lengths,
        metavar="L1,L2,...",
        help="masked batch/instance/group/layer: valid lengths along the last axis, one per sample. "
        "Default (masked_ names): every other sample half padded",
    )
    explain.add_argument("--values", type=_values, help="input values in row-major order. Default: a seeded example")
    explain.add_argument(
        "--last", type=_positive_int, help="layer/rms: number of trailing axes normalized. Default: all but the first"
    )
    explain.add_argument("--eps", type=float, default=1e-5, help="added to the variance. Default: 1e-5")
    explain.add_argument("--json", action="store_true", help="print machine-readable results")
    explain.add_argument("--plain", action="store_true", help="plain text even when rich is installed")

    for name, (module, help_text) in COMMANDS.items():
        # listed for --help; run by _run_lazy before argparse sees the rest of the line
        sub.add_parser(name, help=f"{help_text} [{module}]", add_help=False)
    return parser


def _run_lazy(name: str, argv: list[str]) -> int:
    module_name, _ = COMMANDS[name]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name is not None and module_name.startswith(e.name):
            print(
                f"normscope {name}: this installation has no {module_name} (the part of normscope that provides "
                f"`{name}`); update normscope to a version that includes it.",
                file=sys.stderr,
            )
        else:
            print(
                f"normscope {name}: {module_name} needs the package {e.name!r}, which is not installed. "
                f'Install normscope\'s optional dependencies (e.g. pip install -e ".[dev]").',
                file=sys.stderr,
            )
        return 1
    entry = getattr(module, "main", None)
    if entry is None:
        print(f"normscope {name}: {module_name} has no main(argv) function", file=sys.stderr)
        return 1
    try:
        rc = entry(argv)
    except ImportError as e:
        # an optional dependency imported on first use (matplotlib when drawing, ...): one line, the extra
        message = _missing_dependency(e)
        if message is None:
            raise
        print(f"normscope {name}: {message}", file=sys.stderr)
        return 1
    return int(rc or 0)


def _writable_dir(text: str, argument: str, parser: argparse.ArgumentParser) -> None:
    """Create the output directory ``text`` now, before any work, or exit 2 naming ``argument``."""
    path = os.path.abspath(text)
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        parser.error(f"argument {argument}: cannot create the directory {text!r}: {e.strerror or e}")
    if not os.access(path, os.W_OK | os.X_OK):
        parser.error(f"argument {argument}: cannot write into {text!r}: permission denied")


def _tour(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from .terminal import Out
    from .tools import tour

    if args.pictures:
        _writable_dir(args.pictures, "--pictures", parser)
        # find out now whether drawing can work, not after every check has been printed
        viz, message = _drawing_module()
        if viz is None:
            print(f"normscope tour --pictures: {message}; nothing was run.", file=sys.stderr)
            return 1
    sections = tour.run()
    result = tour.as_json(sections)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        tour.render(sections, Out(plain=args.plain))
    if args.pictures:
        try:
            viz.draw_all(args.pictures)
        except ImportError as e:
            message = _missing_dependency(e)
            if message is None:
                raise
            print(f"normscope tour --pictures: {message}", file=sys.stderr)
            return 1
        except OSError as e:
            print(f"normscope tour: error: argument --pictures: cannot write: {e.strerror or e}", file=sys.stderr)
            return 2
        if not args.json:
            print(f"pictures written to {args.pictures}")
    return 0 if result["passed"] else 1


def _drawing_module():
    """``(normscope.tools.viz, None)`` when pictures can be drawn here, else ``(None, why)``.

    ``normscope.tools.viz`` imports matplotlib only on first use of a drawing function, so importing the
    package proves nothing: matplotlib is imported here too (drawing imports it anyway)."""
    try:
        viz = importlib.import_module("normscope.tools.viz")
    except ModuleNotFoundError as e:
        return None, f"drawing needs normscope.tools.viz and its dependencies, not available here ({e.name})"
    try:
        importlib.import_module("matplotlib")
    except ImportError:
        return None, "drawing needs the package 'matplotlib', which is not installed (pip install 'normscope[viz]')"
    return viz, None


def _explain(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from .terminal import Out
    from .tools import explain

    try:
        result = explain.explain(
            args.layer,
            args.shape,
            groups=args.groups,
            values=args.values,
            eps=args.eps,
            last=args.last,
            heads=args.heads,
            mask=args.mask,
        )
    except explain.UsageError as e:
        parser.error(f"argument {e.argument}: {e}")  # exits with status 2
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        explain.render(result, Out(plain=args.plain))
    return 0 if explain.passed(result) else 1


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (argparse errors raise SystemExit(2))."""
    try:
        return _main(list(sys.argv[1:] if argv is None else argv))
    except BrokenPipeError:  # `normscope tour | head`: the reader left; don't print a traceback
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


def _main(argv: list[str]) -> int:
    if argv and argv[0] in COMMANDS:
        return _run_lazy(argv[0], argv[1:])
    parser = _build_parser()
    args = parser.parse_args(argv)
    if args.command == "tour":
        return _tour(args, parser._subparsers._group_actions[0].choices["tour"])
    if args.command == "explain":
        sub = parser._subparsers._group_actions[0].choices["explain"]  # errors read "normscope explain: ..."
        return _explain(args, sub)
    parser.print_help()
    return 2
