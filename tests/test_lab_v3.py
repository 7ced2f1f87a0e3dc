"""The lab's output for people: the summary table, the report, the time a run takes, the messages."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

from normscope.tools import lab
from normscope.tools.lab import report

DOCS_LAB = Path(__file__).resolve().parents[1] / "docs" / "lab"

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


def test_qk_norm_rule_every_outcome():
    from normscope.tools.lab.verdicts import INCONCLUSIVE, NOT_REPRODUCED, REPRODUCED, qk_norm_rule

    inf = float("inf")
    with_ = {1e-3: ([2.0, 2.1], [4.0, 4.0]), 1e-1: ([2.1, 2.0], [5.0, 5.0])}
    grows = {1e-3: ([2.0, 2.1], [5.0, 5.0]), 1e-1: ([inf, 3.0], [40.0, 60.0])}
    assert qk_norm_rule(grows, with_, 3.0).outcome == REPRODUCED
    # logits grow but training stays fine: (b) fails
    calm = {1e-3: ([2.0, 2.1], [5.0, 5.0]), 1e-1: ([2.1, 2.1], [40.0, 60.0])}
    assert qk_norm_rule(calm, with_, 3.0).outcome == NOT_REPRODUCED
    # unstable, but the logits did not grow 3x: (a) fails
    flat = {1e-3: ([2.0, 2.1], [5.0, 5.0]), 1e-1: ([inf, inf], [6.0, 6.0])}
    assert qk_norm_rule(flat, with_, 3.0).outcome == NOT_REPRODUCED
    # one seed without QK-norm was fine at that lr: not "every seed"
    one = {1e-3: ([2.0, 2.1], [5.0, 5.0]), 1e-1: ([inf, 2.1], [40.0, 60.0])}
    assert qk_norm_rule(one, with_, 3.0).outcome == NOT_REPRODUCED
    # QK-norm itself unstable at the high lr: no lr where it is stable and the other is not
    bad_with = {1e-3: ([2.0, 2.1], [4.0, 4.0]), 1e-1: ([2.6, 2.7], [5.0, 5.0])}
    assert qk_norm_rule(grows, bad_with, 3.0).outcome == NOT_REPRODUCED
    assert qk_norm_rule(grows, with_, 1.5).outcome.startswith(INCONCLUSIVE)


def test_derf_rule_every_outcome():
    from normscope.tools.lab.verdicts import INCONCLUSIVE, NOT_REPRODUCED, REPRODUCED, derf_rule

    ln = [2.00, 2.01, 2.02]
    assert derf_rule({"layer": ln, "dyt": [2.04] * 3, "derf": [1.99] * 3}, 3.0).outcome == REPRODUCED
    assert derf_rule({"layer": ln, "dyt": [2.10] * 3, "derf": [1.99] * 3}, 3.0).outcome == NOT_REPRODUCED
    assert derf_rule({"layer": ln, "dyt": [2.0] * 3, "derf": [2.0, float("inf"), 2.0]}, 3.0).outcome == NOT_REPRODUCED
    # a noisy LN widens the tolerance to 2x its seed std
    noisy = [1.9, 2.0, 2.1]
    assert derf_rule({"layer": noisy, "dyt": [2.15] * 3, "derf": [2.0] * 3}, 3.0).outcome == REPRODUCED
    assert derf_rule({"layer": ln, "dyt": ln, "derf": ln}, 1.0).outcome.startswith(INCONCLUSIVE)


def test_modern_derf_formula_and_qk_norm_model():
    import torch

    from normscope.tools.lab.exp_modern import _LM, Derf

    d = Derf(4)
    with torch.no_grad():
        d.alpha.fill_(0.7), d.shift.fill_(0.1), d.weight.copy_(torch.arange(1.0, 5.0)), d.bias.fill_(-0.5)
    x = torch.randn(2, 3, 4, dtype=torch.float64)
    want = torch.arange(1.0, 5.0, dtype=torch.float64) * torch.special.erf(0.7 * x + 0.1) - 0.5
    torch.testing.assert_close(d(x.float()).double(), want, atol=1e-6, rtol=1e-6)
    cfg = {"d": 16, "depth": 1, "heads": 2, "seq": 8}
    torch.manual_seed(0)
    m = _LM(cfg, "layer", qk_norm=True)
    blk = m.blocks[0]
    m(torch.randint(0, 128, (2, 8)))
    # the recorded largest logit is q.k/sqrt(d_head) of LayerNorm-ed q and k, causal positions only
    h = blk.n1(m.tok(torch.randint(0, 1, (1, 1))))  # shape check only
    assert h.shape[-1] == 16 and blk.qn is not None and 0 < blk.max_logit < 16**0.5 * 2


def test_docs_lab_table_is_the_committed_results():
    """docs/lab.md's results table is exactly what the committed result.json files generate."""
    text = (DOCS_LAB.parent / "lab.md").read_text()
    i, j = text.index(report.BEGIN) + len(report.BEGIN), text.index(report.END)
    assert text[i:j] == "\n" + report.markdown_table(DOCS_LAB)
