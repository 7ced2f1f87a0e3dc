"""Shared machinery of the lab: run contexts, the results cache, seeding, progress and versions.

Every experiment is a sequence of *runs* (one configuration, one seed). A run's result is stored
as ``<out>/<experiment>/runs/<hash>.json`` where the hash covers the experiment name, its code
version and the run's full configuration: re-running the lab skips every finished run (unless
``force``), and an interrupted lab loses at most the run in flight.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

MODES = ("smoke", "quick", "full")


def config_hash(obj: Any) -> str:
    """A stable short hash of a JSON-able configuration (key order does not matter)."""
    blob = json.dumps(obj, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def write_json(path: Path, obj: Any) -> None:
    """Write atomically (temp file + rename) so Ctrl-C never leaves half a file behind."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1, sort_keys=True, default=_jsonable))
    os.replace(tmp, path)


def _jsonable(o: Any) -> Any:
    if isinstance(o, torch.Tensor):
        return o.tolist()
    if hasattr(o, "item"):
        return o.item()
    return str(o)


def versions() -> dict[str, str]:
    out = {"python": platform.python_version(), "torch": torch.__version__, "platform": platform.platform(),
           "cpu_count": str(os.cpu_count()), "torch_threads": str(torch.get_num_threads())}
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
    """One updating line on stderr: ``[experiment] label  12/40 ███░░░ info``."""

    def __init__(self, prefix: str, enabled: bool = True) -> None:
        self.prefix, self.enabled = prefix, enabled and os.environ.get("NORMSCOPE_LAB_QUIET") != "1"
        self._last = 0.0

    def __call__(self, label: str, done: int, total: int, info: str = "", force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if not force and done < total and now - self._last < 0.25:
            return
        self._last = now
        width = 20
        fill = int(width * done / max(total, 1))
        bar = "█" * fill + "░" * (width - fill)
        sys.stderr.write(f"\r[{self.prefix}] {label[:38]:<38} {done:>5}/{total:<5} {bar} {info[:30]:<30}")
        if done >= total:
            sys.stderr.write("\n")
        sys.stderr.flush()


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
        """Return the stored result of the run described by ``key``, or compute and store it."""
        h = config_hash({"experiment": self.name, "version": self.version, "key": key})
        path = self.out / "runs" / f"{h}.json"
        if path.exists() and not self.force:
            try:
                self.n_cached += 1
                return json.loads(path.read_text())["result"]
            except (json.JSONDecodeError, KeyError):
                self.n_cached -= 1  # a damaged file is recomputed
        t0 = time.perf_counter()
        result = fn()
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
