"""normscope lab: small, real CPU training runs that reproduce the classic claims about
normalization, with plots, a claim verdict per experiment and one offline HTML report.

Command line::

    normscope lab [EXPERIMENT ...] [--quick|--full|--smoke] [--seeds K] [--out DIR] [--force]
    python -m normscope.tools.lab batch-size --smoke

Python::

    >>> import normscope.tools.lab
    >>> results = normscope.tools.lab.run(["batch-size"], mode="smoke", out="lab-out")

Each experiment writes ``<out>/<experiment>/result.json`` (config, seeds, per-run metrics,
versions, wall time, verdicts) and PNG plots; ``<out>/report.html`` indexes them all with the
images embedded. Finished runs are cached by a hash of their configuration: re-running skips
them unless ``force``. Needs the ``lab`` extra (matplotlib, scikit-learn).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from .core import EXPERIMENTS, MODES, Context, deterministic, versions, write_json
from .verdicts import NOT_JUDGED, Verdict, skipped

__all__ = ["EXPERIMENTS", "MAX_SEEDS", "run", "main"]

#: seeds are 0..K-1, each a full training run: more than this is a typo, not an experiment
MAX_SEEDS = 1000


def _module(name: str):
    return importlib.import_module(f".{EXPERIMENTS[name]}", __name__)


def _check(experiments: Sequence[str] | None, mode: str, seeds: int | None) -> list[str]:
    if mode not in MODES:
        raise ValueError(f"normscope.tools.lab.run: expected mode in {MODES}, got {mode!r}")
    names = list(experiments) if experiments else list(EXPERIMENTS)
    bad = [n for n in names if n not in EXPERIMENTS]
    if bad:
        raise ValueError(f"normscope.tools.lab.run: unknown experiment(s) {bad}; expected some of {list(EXPERIMENTS)}")
    if seeds is not None and (not isinstance(seeds, int) or isinstance(seeds, bool) or not 1 <= seeds <= MAX_SEEDS):
        raise ValueError(f"normscope.tools.lab.run: expected `seeds` to be an int in [1, {MAX_SEEDS}], got {seeds!r}")
    return names


def _out_dir(out: str | Path) -> Path:
    """``out`` as a directory we can write, created if needed; ValueError naming it otherwise."""
    path = Path(out)
    if path.exists() and not path.is_dir():
        raise ValueError(f"expected `out` to be a directory, got {str(path)!r}, which is a file")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        why = e.strerror or e
        raise ValueError(f"expected `out` to be a directory that can be created, got {str(path)!r}: {why}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"expected `out` to be a writable directory, got {str(path)!r} (permission denied)")
    return path


def run_one(name: str, mode: str, out: Path, seeds: int | None = None, force: bool = False) -> dict:
    """Run one experiment and write its ``result.json`` and plots; returns the result."""
    mod = _module(name)
    cfg = mod.config(mode)
    k = seeds if seeds is not None else cfg.get("seeds", 1)
    cfg = {**cfg, "seeds": k}
    ctx = Context(name, out / name, mode, list(range(k)), force=force, version=getattr(mod, "VERSION", "1"))
    load0 = os.getloadavg()[0]  # the wall time means little without the machine's load
    t0 = time.perf_counter()
    with deterministic(threads=1):
        try:
            metrics = mod.execute(ctx, cfg)
        finally:
            ctx.progress.close()
        try:
            vs: list[Verdict] = mod.verdicts(metrics)
        except (KeyError, TypeError, ValueError) as err:  # a missing piece leaves the rule without input
            vs = [skipped(getattr(mod, "TITLE", name), "-", f"no metrics ({err})")]
        if mode == "smoke":  # models that barely trained: the rules run (code path tested) but judge nothing
            vs = [v if v.outcome.startswith("skipped") else Verdict(v.claim, v.published, v.measured, NOT_JUDGED,
                                                                     v.rule) for v in vs]
        mod.plot(ctx, cfg, metrics)
        vers = versions()  # inside the context: records the thread count the runs used
    result = {
        "experiment": name,
        "title": mod.TITLE,
        "version": ctx.version,
        "about": (mod.__doc__ or "").strip(),
        "mode": mode,
        "config": cfg,
        "seeds": ctx.seeds,
        "metrics": metrics,
        "verdicts": [v.asdict() for v in vs],
        "skipped": ctx.skipped,
        "norm_sources": ctx.sources,
        "plots": ctx.plots,
        "versions": vers,
        "wall_s": time.perf_counter() - t0,
        "load_avg": {"start": load0, "end": os.getloadavg()[0]},
        "runs_cached": ctx.n_cached,
        "runs_computed": ctx.n_computed,
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    write_json(ctx.out / "result.json", result)
    return result


def run(experiments: Sequence[str] | None = None, mode: str = "quick", out: str | Path = "lab-out",
        seeds: int | None = None, force: bool = False, report: bool = True) -> dict[str, dict]:
    """Run experiments (all by default) and build the HTML report.

    Args:
        experiments: names from :data:`EXPERIMENTS`. Default: all.
        mode: ``"smoke"`` (seconds, for CI), ``"quick"`` (from under a minute to about an hour
            per experiment on a shared 2-core machine: ``normscope lab --list`` shows each one's
            measured time) or ``"full"`` (hours). Default: ``"quick"``.
        out: output directory. Default: ``"lab-out"``.
        seeds: number of seeds (0..K-1) instead of the mode's default. Default: None.
        force: recompute runs already in the cache. Default: False.
        report: write ``report.html`` and print the summary table. Default: True.

    Returns: experiment name -> result dict (as written to ``result.json``). On Ctrl-C the
    experiments already finished keep their results and the report is still written.
    """
    names = _check(experiments, mode, seeds)
    out = _out_dir(out)
    results: dict[str, dict] = {}
    try:
        for name in names:
            results[name] = run_one(name, mode, out, seeds, force)
    finally:
        if report:
            from .report import summary_table, write_report

            # this run's results only: older ones in `out` are named in the report, not mixed in
            path = write_report(out, list(results), requested=names)
            sys.stderr.write(summary_table(out, list(results)) + f"\nreport: {path}\n")
    return results


def _seeds(text: str) -> int:
    try:
        k = int(text)
    except ValueError:
        k = 0
    if not 1 <= k <= MAX_SEEDS:
        raise argparse.ArgumentTypeError(f"expected an integer in [1, {MAX_SEEDS}], got {text!r}")
    return k


#: the committed results of a source checkout (src/normscope/tools/lab -> docs/lab); an installed package has
#: none, and its --list says where the measured times are written instead
RESULTS = Path(__file__).resolve().parents[4] / "docs" / "lab"


def quick_time(name: str, results: str | Path | None = None) -> str:
    """How long ``name`` took in quick mode, as measured by the results in ``results`` (default: the
    checkout's committed ``docs/lab``): the wall time, the runs it includes and the machine's load, or
    "not measured"."""
    from .report import quick_times

    results = RESULTS if results is None else Path(results)
    if not results.is_dir():
        return "quick: measured times are in docs/lab.md (no results directory here)"
    t = quick_times(results).get(name)
    if t is None:
        return "quick: not measured yet"
    version = getattr(_module(name), "VERSION", "1")
    if t.get("version", version) != version:  # the settings changed since: the old time says nothing
        return f"quick: not measured for this version ({version}) yet"
    mins = t["wall_s"] / 60
    took = f"{mins:.0f} min" if mins >= 1 else f"{t['wall_s']:.0f} s"
    if t["runs_cached"]:
        took = f">= {took} ({t['runs_cached']} of {t['runs_cached'] + t['runs_computed']} runs were cached)"
    load = t.get("load_avg")
    where = "load not recorded"
    if load:
        where = f"load average {load['start']:.1f} at the start, {load['end']:.1f} at the end"
    return f"quick: {took}, 1 thread, 2-core machine shared with other jobs ({where}), {t['finished_at'][:10]}"


def _times_epilog() -> str:
    rows = "\n".join(f"  {n:16} {quick_time(n)}" for n in EXPERIMENTS)
    return ("measured --quick wall times of the committed results (one thread per run; a loaded machine is "
            "slower, an idle one faster):\n" + rows)


def main(argv: Sequence[str] | None = None) -> int:
    """``normscope lab`` command line; returns the exit status."""
    p = argparse.ArgumentParser(prog="normscope lab", description=__doc__.split("\n\n")[0],
                                epilog=_times_epilog(), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("experiments", nargs="*", metavar="EXPERIMENT",
                   help=f"some of: {', '.join(EXPERIMENTS)} (default: all)")
    g = p.add_mutually_exclusive_group()
    quick = "default; under a minute to about an hour per experiment, measured times below"
    for m, h in (("quick", quick), ("full", "hours per experiment"), ("smoke", "seconds (CI)")):
        g.add_argument(f"--{m}", dest="mode", action="store_const", const=m, help=h)
    p.add_argument(
        "--seeds", type=_seeds, default=None, metavar="K", help=f"number of seeds, 1 to {MAX_SEEDS} (default: per mode)"
    )
    p.add_argument("--out", default="lab-out", help="output directory (default: lab-out)")
    p.add_argument("--force", action="store_true", help="recompute runs found in the cache")
    p.add_argument("--list", action="store_true", help="list the experiments and exit")
    a = p.parse_args(argv)
    if a.list:
        try:
            for name in EXPERIMENTS:
                print(f"{name:16} {_module(name).TITLE}\n{'':16} {quick_time(name)}", flush=True)
        except BrokenPipeError:  # `--list | head -3`: the reader left; no traceback
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    mode = a.mode or "quick"
    # every argument checked before any work; errors raised later are the lab's, not usage errors
    try:
        _check(a.experiments, mode, a.seeds)
    except ValueError as err:
        p.error(str(err).removeprefix("normscope.tools.lab.run: "))
    missing = [m for m in ("matplotlib", "sklearn") if importlib.util.find_spec(m) is None]
    if missing:  # say so before any run (and before --out is created: nothing is left behind)
        need = " and ".join(missing)
        verb = "is" if len(missing) == 1 else "are"
        sys.stderr.write(f"normscope lab: needs {need}, which {verb} not installed (pip install 'normscope[lab]')\n")
        return 1
    try:
        _out_dir(a.out)
    except ValueError as err:
        p.error(f"argument --out: {err}")
    try:
        run(a.experiments, mode=mode, out=a.out, seeds=a.seeds, force=a.force)
    except KeyboardInterrupt:
        sys.stderr.write("\ninterrupted: finished experiments and runs are kept; re-run to continue\n")
        return 130
    return 0
