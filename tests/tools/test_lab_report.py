"""The lab's output for people: the summary table, the report, the time a run takes, the messages.
The docs' lab table is generated from result.json and is the committed results."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

from normscope.tools import lab
from normscope.tools.lab import report
from normscope.tools.lab.verdicts import REPRODUCED  # noqa: E402

DOCS_LAB = Path(__file__).resolve().parents[2] / "docs" / "lab"

LONG_CLAIM = "BatchNorm's error rises as the batch shrinks from 32 to 2 images per step while GroupNorm holds steady"

LONG_MEASURED = (
    "BN 7.6±0.6 -> 30.1±2.2 (batch 32 -> 2), GN 8.1±0.7 -> 8.4±0.9 (test error %, mean±std over seeds), "
    "and a tail that must not be cut: the end"
)


def _fake(
    out: Path,
    name: str,
    claim: str = "a claim",
    measured: str = "m",
    finished: str = "2026-01-01T00:00:00Z",
    mode: str = "quick",
) -> None:
    d = out / name
    d.mkdir(parents=True, exist_ok=True)
    r = {
        "experiment": name,
        "title": f"title of {name}",
        "about": "about",
        "mode": mode,
        "config": {},
        "seeds": [0],
        "metrics": {},
        "verdicts": [{"claim": claim, "published": "p", "measured": measured, "outcome": "reproduced", "rule": "r"}],
        "skipped": {},
        "norm_sources": {},
        "plots": [],
        "versions": {"torch": "x"},
        "wall_s": 12.0,
        "runs_cached": 0,
        "runs_computed": 1,
        "finished_at": finished,
    }
    (d / "result.json").write_text(json.dumps(r))


def _flat(text: str) -> str:
    return re.sub(r"\s+", " ", text)


def test_summary_table_never_cuts_the_claim_or_the_measurement(tmp_path):
    _fake(tmp_path, "batch-size", LONG_CLAIM, LONG_MEASURED)
    for width in (60, 100, 200):
        table = report.summary_table(tmp_path, width=width)
        flat = _flat(table)
        assert LONG_CLAIM in flat and LONG_MEASURED in flat
        assert max(len(line) for line in table.splitlines()) <= max(width, 60)


def test_report_and_table_show_only_this_runs_results(tmp_path, monkeypatch, capsys):
    _fake(tmp_path, "padding", "an older padding claim", finished="2025-05-05T00:00:00Z", mode="smoke")

    def fake_run_one(name, mode, out, seeds=None, force=False):
        _fake(out, name, "this run's claim")
        return json.loads((out / name / "result.json").read_text())

    monkeypatch.setattr(lab, "run_one", fake_run_one)
    lab.run(["batch-size"], mode="quick", out=tmp_path)
    page = (tmp_path / "report.html").read_text()
    assert "this run&#x27;s claim" in page or "this run's claim" in page
    assert "an older padding claim" not in page
    assert "padding (smoke mode, finished 2025-05-05T00:00:00Z)" in page  # named, not mixed in
    err = capsys.readouterr().err
    assert "this run's claim" in err and "older padding claim" not in err
    # regenerating a whole directory (docs/lab) still takes every result
    report.write_report(tmp_path)
    assert "an older padding claim" in (tmp_path / "report.html").read_text()


def test_list_and_help_show_each_experiments_measured_quick_time(capsys):
    assert lab.main(["--list"]) == 0
    listing = capsys.readouterr().out
    with pytest.raises(SystemExit):
        lab.main(["--help"])
    helptext = capsys.readouterr().out
    assert "minutes on 2 CPU cores" not in helptext
    for name in lab.EXPERIMENTS:
        line = lab.quick_time(name)
        assert line.startswith("quick: ")
        assert line in listing and line in _flat(helptext) or line in helptext
        path = DOCS_LAB / name / "result.json"
        if path.exists():
            r = json.loads(path.read_text())
            if r["mode"] == "quick" and r.get("version", "?") == getattr(lab._module(name), "VERSION", "1"):
                mins = r["wall_s"] / 60
                assert (f"{mins:.0f} min" if mins >= 1 else f"{r['wall_s']:.0f} s") in line, (name, line)


def test_quick_times_are_read_from_the_committed_results():
    """The lab reads the checkout's docs/lab itself: no copy of the times in the package source to drift."""
    assert lab.RESULTS == DOCS_LAB
    times = report.quick_times(DOCS_LAB)
    assert times, "docs/lab holds quick-mode results"
    name = next(iter(times))
    assert lab.quick_time(name) == lab.quick_time(name, DOCS_LAB)


def test_quick_time_without_results_says_where_they_are(tmp_path):
    assert "docs/lab.md" in lab.quick_time("sync", tmp_path / "absent")
    assert lab.quick_time("sync", tmp_path) == "quick: not measured yet"


def _timed(out: Path, **fields) -> Path:
    record = {"experiment": "sync", "mode": "quick", "runs_computed": 1, "runs_cached": 0}
    record.update(fields)
    (out / "sync").mkdir(parents=True, exist_ok=True)
    (out / "sync" / "result.json").write_text(json.dumps(record))
    return out


def test_quick_time_of_a_changed_experiment_is_not_claimed(tmp_path):
    old = _timed(tmp_path / "old", wall_s=90.0, finished_at="2026-01-01T00:00:00Z", version="0-old")
    assert "not measured for this version" in lab.quick_time("sync", old)
    loaded = _timed(
        tmp_path / "loaded", wall_s=90.0, finished_at="2026-01-01T00:00:00Z", load_avg={"start": 3.0, "end": 4.5}
    )
    line = lab.quick_time("sync", loaded)
    assert line.startswith("quick: 2 min") and "load average 3.0 at the start, 4.5 at the end" in line


@pytest.mark.parametrize("missing,verb", [({"matplotlib", "sklearn"}, "are"), ({"sklearn"}, "is")])
def test_missing_extras_message_is_grammatical(monkeypatch, capsys, tmp_path, missing, verb):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n in missing else real(n, *a))
    assert lab.main(["batch-size", "--smoke", "--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert f"which {verb} not installed" in err


def test_docs_lab_table_is_the_committed_results():
    """docs/lab.md's results table is exactly what the committed result.json files generate."""
    text = (DOCS_LAB.parent / "lab.md").read_text()
    i, j = text.index(report.BEGIN) + len(report.BEGIN), text.index(report.END)
    assert text[i:j] == "\n" + report.markdown_table(DOCS_LAB)


def test_docs_table_is_generated_from_result_json(tmp_path):
    from normscope.tools.lab.report import markdown_table

    v = {"claim": "c", "published": "p", "measured": "m 1.23", "outcome": REPRODUCED, "rule": "r"}
    (tmp_path / "padding").mkdir()
    (tmp_path / "padding" / "result.json").write_text(
        json.dumps({"experiment": "padding", "verdicts": [v], "seeds": [0, 1, 2], "wall_s": 12.5, "mode": "quick"})
    )
    table = markdown_table(tmp_path)
    assert "| padding | c | m 1.23 | reproduced | 3 |" in table
    assert "padding 12 s" in table
