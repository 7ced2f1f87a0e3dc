"""What the training frameworks' ``DoctorCallback`` classes share: a :func:`normscope.watch` counted in the
framework's optimizer steps, its findings as log lines (each once), the figures a logger takes, the report
written at the end, and the stop on a non-finite value. The frameworks' own modules only translate their
events into these calls."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from torch import nn

STOP_ON = (None, "non-finite")


def check_options(owner: str, every: Any, stop_on: Any, filename: Any) -> None:
    if not isinstance(every, int) or isinstance(every, bool) or every < 1:
        raise ValueError(f"{owner}: expected `every` to be a positive int, got {every!r}")
    if stop_on not in STOP_ON:
        raise ValueError(f"{owner}: expected `stop_on` to be one of {list(STOP_ON)}, got {stop_on!r}")
    if filename is not None and (not isinstance(filename, str) or not filename or "/" in filename):
        raise ValueError(f"{owner}: expected `filename` to be a file name (no directory) or None, got {filename!r}")


class Watcher:
    """One framework run's watch: started on the model, stepped by the framework's step count."""

    def __init__(self, owner: str, every: int, checks: Any, stop_on: str | None, logger: logging.Logger) -> None:
        self.owner = owner
        self.every = every
        self.checks = checks
        self.stop_on = stop_on
        self.logger = logger
        self.watch = None
        self.logged: set[tuple] = set()
        self.stopped_at: dict | None = None

    def start(self, model: Any, step: int) -> None:
        from ..doctor._watch import Watch

        if not isinstance(model, nn.Module):
            raise TypeError(f"{self.owner}: expected the framework to pass the model (an nn.Module), got {model!r}")
        if self.watch is not None:
            self.watch.close()
        self.watch = Watch(model, self.every, checks=self.checks).start()
        self.logged = set()
        self.stopped_at = None
        self.watch.step(step)

    def step(self, step: int) -> None:
        if self.watch is not None:
            self.watch.step(step)

    def should_stop(self) -> bool:
        """Whether training should stop now (``stop_on="non-finite"`` and an inf/NaN was seen); says so once."""
        if self.stop_on != "non-finite" or self.watch is None or self.stopped_at is not None:
            return False
        nf = self.watch.non_finite
        if nf is None:
            return False
        self.stopped_at = nf
        self.logger.error(
            "normscope watch: stopping training: %s held %s at step %d (%s) -- the first inf/NaN of the run",
            nf["layer"] or "<model>",
            nf["value"],
            nf["step"],
            nf["where"],
        )
        return True

    def log(self) -> dict[str, float]:
        """Log each finding not logged before; return the figures for the framework's logger."""
        if self.watch is None:
            return {}
        report = self.watch.report()
        for f in report.findings:
            key = (f.check, f.module, f.severity)
            if key in self.logged:
                continue
            self.logged.add(key)
            level = {"error": logging.ERROR, "warning": logging.WARNING}.get(f.severity, logging.INFO)
            step = f.measured.get("step")
            self.logger.log(
                level,
                "normscope watch: %s %s %s%s: %s (fix: %s)",
                f.severity,
                f.check,
                f.module or "<model>",
                "" if step is None else f" at step {step}",
                f.reason,
                f.fix,
            )
        figures = {f"normscope/{s}s": float(report.count(s)) for s in ("error", "warning", "info")}
        nf = self.watch.non_finite
        if nf is not None:
            figures["normscope/non_finite_step"] = float(nf["step"])
        return figures

    def finish(self, directory: str | Path | None, filename: str | None, write: bool) -> Path | None:
        """Close the watch, log what is left, and write the report (JSON and HTML) into ``directory``; returns
        the JSON's path (None when nothing was written)."""
        if self.watch is None:
            return None
        self.watch.close()
        self.log()
        if not write or directory is None or filename is None:
            return None
        report = self.watch.report()
        folder = Path(directory)
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / filename
        path.write_text(report.to_json())
        from ..doctor._render import to_html  # the report with its pictures (inline SVG)

        path.with_suffix(".html").write_text(to_html(report))
        self.logger.info("normscope watch: the report is in %s", path)
        return path
