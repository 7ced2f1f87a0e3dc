"""Shared machinery of the lab: run contexts, the results cache, seeding, progress and versions.

Every experiment is a sequence of *runs* (one configuration, one seed). A run's result is stored
as ``<out>/<experiment>/runs/<hash>.json`` where the hash covers the experiment name, its code
version and the run's full configuration: re-running the lab skips every finished run (unless
``force``), and an interrupted lab loses at most the run in flight. A damaged cache file (truncated,
edited, from another version) is reported by name and recomputed, never trusted.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

MODES = ("smoke", "quick", "full")
# experiment name -> module of this package (imported lazily: an experiment's import cost is paid only if it
# runs). Here, below the package and its report, which both read it: the report took it from the package,
# which imports the report
EXPERIMENTS = {
    "batch-size": "exp_batch_size",
    "padding": "exp_padding",
    "smoothness": "exp_smoothness",
    "prenorm": "exp_prenorm",
    "rms-vs-layer": "exp_rms_vs_layer",
    "contrast-style": "exp_contrast_style",
    "sync": "exp_sync",
    "modern": "exp_modern",
}


def config_hash(obj: Any) -> str:
    """A stable short hash of a JSON-able configuration (key order does not matter)."""
    blob = json.dumps(obj, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def write_json(path: Path, obj: Any) -> None:
    """Write atomically (temp file + rename) so Ctrl-C never leaves half a file behind.

    The temporary file has a unique name in the target's directory (same file system, so the rename
    is atomic): two writers of the same path each rename a complete file, and the last one wins.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(obj, indent=1, sort_keys=True, default=_jsonable)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _jsonable(o: Any) -> Any:
    if isinstance(o, torch.Tensor):
        return o.tolist()
    if hasattr(o, "item"):
        return o.item()
    return str(o)


def versions() -> dict[str, str]:
    out = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "cpu_count": str(os.cpu_count()),
        "torch_threads": str(torch.get_num_threads()),
    }
    for mod in ("normscope", "numpy", "sklearn", "matplotlib"):
        try:
            out[mod] = getattr(__import__(mod), "__version__", "?")
        except Exception:  # an optional package missing is information, not an error
            out[mod] = "missing"
    return out


@contextlib.contextmanager
def deterministic(threads: int = 1) -> Iterator[None]:
    """Deterministic kernels and a fixed intra-op thread count (the result of a float reduction
    depends on how it is split across threads), restored afterwards."""
    old_threads = torch.get_num_threads()
    old_det = torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.set_num_threads(old_threads)
        torch.use_deterministic_algorithms(old_det)


def seed_all(seed: int) -> torch.Generator:
    """Seed torch's global generator (parameter init, dropout, noise) and return a separate
    generator for data order, so that the data order does not depend on the model."""
    torch.manual_seed(seed)
    g = torch.Generator()
    g.manual_seed(10_000 + seed)
    return g


class Progress:
    """Progress of the runs on stderr, through `rich <https://github.com/Textualize/rich>`_, which
    knows a terminal from a log: on a terminal, live bars (``[experiment] label  12/40 ━━━ info``);
    in a log, a pipe or CI (or without rich), plain lines when a label starts and ends and at most
    every ``log_every`` seconds between -- no carriage returns, no bar characters.

    ``NORMSCOPE_LAB_QUIET=1`` silences it. Call :meth:`close` when done (stops the live display).
    """

    def __init__(self, prefix: str, enabled: bool = True, stream: Any = None, log_every: float = 30.0) -> None:
        self.prefix, self.enabled = prefix, enabled and os.environ.get("NORMSCOPE_LAB_QUIET") != "1"
        self.stream = stream
        self.log_every = log_every
        self._live = None  # rich.progress.Progress while bars are shown
        self._tasks: dict[str, Any] = {}
        self._logged: dict[str, float] = {}
        self._terminal: bool | None = None

    def _out(self):
        return self.stream if self.stream is not None else sys.stderr

    def _is_terminal(self) -> bool:
        if self._terminal is None:
            try:
                from rich.console import Console
            except ImportError:
                self._terminal = False  # no rich: plain lines everywhere
            else:
                self._terminal = Console(file=self._out()).is_terminal
        return self._terminal

    def __call__(self, label: str, done: int, total: int, info: str = "", force: bool = False) -> None:
        if not self.enabled:
            return
        if self._is_terminal():
            self._bar(label, done, total, info)
        else:
            self._line(label, done, total, info, force)

    def _bar(self, label: str, done: int, total: int, info: str) -> None:
        if self._live is None:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
            from rich.progress import Progress as RichProgress

            self._live = RichProgress(
                TextColumn(f"[{self.prefix}] {{task.description}}", markup=False),
                MofNCompleteColumn(),
                BarColumn(),
                TextColumn("{task.fields[info]}", markup=False),
                TimeElapsedColumn(),
                console=Console(file=self._out()),
            )
            self._live.start()
        task = self._tasks.get(label)
        if task is None:
            task = self._tasks[label] = self._live.add_task(label[:38], total=max(total, 1), info="")
        self._live.update(task, completed=done, total=max(total, 1), info=info[:30])

    def _line(self, label: str, done: int, total: int, info: str, force: bool) -> None:
        now = time.monotonic()
        first = label not in self._logged
        if not (first or force or done >= total or now - self._logged[label] >= self.log_every):
            return
        self._logged[label] = now
        out = self._out()
        out.write(f"[{self.prefix}] {label} {done}/{total} {info}".rstrip() + "\n")
        out.flush()

    def close(self) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None
            self._tasks.clear()


class InterruptedWithResult(KeyboardInterrupt):
    """Ctrl-C arrived after a run had finished: carries its ``result`` so the cache keeps it."""

    def __init__(self, result: dict) -> None:
        super().__init__()
        self.result = result


def _read_cached(path: Path, key: dict) -> dict | None:
    # json round-trips the key (tuples become lists): compare it as stored
    expected = json.loads(json.dumps(key, default=_jsonable))
    why = None
    try:
        stored = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        why = f"unreadable ({type(e).__name__}: {e})"
    else:
        if not isinstance(stored, dict) or not isinstance(stored.get("result"), dict):
            why = "not a stored run (expected an object with a `result` object)"
        elif stored.get("key") != expected:
            why = "stored for a different configuration"
    if why is None:
        return stored["result"]
    sys.stderr.write(f"normscope lab: cache file {path} is damaged: {why}; recomputing it\n")
    return None


@dataclass
class Context:
    """What an experiment gets: where to write, the cache, the seeds and a progress line."""

    name: str
    out: Path
    mode: str
    seeds: list[int]
    force: bool = False
    progress: Progress = field(default=None)  # type: ignore[assignment]
    version: str = "1"
    n_cached: int = 0
    n_computed: int = 0
    plots: list[str] = field(default_factory=list)
    sources: dict[str, str] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        if self.progress is None:
            self.progress = Progress(self.name)

    def cached(self, key: dict, fn: Callable[[], dict]) -> dict:
        """Return the stored result of the run described by ``key``, or compute and store it.

        A stored file that cannot be read back as this run's result (not JSON, not UTF-8, not an
        object with this ``key`` and a dict ``result``) is named on stderr and recomputed, so one
        damaged file never breaks later runs. ``fn`` may raise :class:`InterruptedWithResult` (the
        run finished as Ctrl-C arrived): its result is stored before the interrupt goes on.
        """
        h = config_hash({"experiment": self.name, "version": self.version, "key": key})
        path = self.out / "runs" / f"{h}.json"
        if path.exists() and not self.force:
            stored = _read_cached(path, key)
            if stored is not None:
                self.n_cached += 1
                return stored
        t0 = time.perf_counter()
        try:
            result = fn()
        except InterruptedWithResult as stop:
            write_json(path, {"key": key, "result": stop.result, "wall_s": time.perf_counter() - t0})
            self.n_computed += 1
            raise KeyboardInterrupt from None
        write_json(path, {"key": key, "result": result, "wall_s": time.perf_counter() - t0})
        self.n_computed += 1
        return result

    def savefig(self, fig: Any, name: str) -> str:
        import matplotlib.pyplot as plt

        path = self.out / f"{name}.png"
        fig.savefig(path, dpi=110, bbox_inches="tight")
        plt.close(fig)
        self.plots.append(path.name)
        return path.name


def pyplot():
    """matplotlib's pyplot on the non-interactive Agg backend (works without a display)."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def mean_std(values: list[float]) -> tuple[float, float]:
    import statistics

    vals = [float(v) for v in values]
    if not vals:
        return float("nan"), float("nan")
    return statistics.fmean(vals), (statistics.stdev(vals) if len(vals) > 1 else 0.0)
