"""normscope.tools.lab: every experiment at --smoke size, the verdict rules on fixed inputs, the results
cache, determinism and the norm adapter."""

from __future__ import annotations

import json
from html import escape as html_escape

import pytest

pytest.importorskip("matplotlib")
pytest.importorskip("sklearn")

import torch  # noqa: E402

from normscope.tools import lab  # noqa: E402
from normscope.tools.lab import norms, verdicts  # noqa: E402
from normscope.tools.lab.verdicts import NOT_REPRODUCED, REPRODUCED  # noqa: E402

PNG = b"\x89PNG\r\n\x1a\n"
RESULT_KEYS = {"experiment", "title", "mode", "config", "seeds", "metrics", "verdicts", "skipped", "plots",
               "versions", "wall_s", "runs_cached", "runs_computed", "norm_sources"}
VERDICT_KEYS = {"claim", "published", "measured", "outcome", "rule"}


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("lab")
    results = lab.run(mode="smoke", out=out)
    return out, results


def test_every_experiment_writes_result_plots_and_verdicts(smoke):
    out, results = smoke
    assert set(results) == set(lab.EXPERIMENTS)
    for name in lab.EXPERIMENTS:
        r = json.loads((out / name / "result.json").read_text())
        assert RESULT_KEYS <= set(r), name
        assert r["experiment"] == name and r["mode"] == "smoke"
        assert r["verdicts"], name
        for v in r["verdicts"]:
            assert VERDICT_KEYS <= set(v)
            # smoke runs barely train: their rules run but judge nothing (issue 16)
            assert v["outcome"] == verdicts.NOT_JUDGED or v["outcome"].startswith("skipped: "), v
        assert r["plots"], name
        for p in r["plots"]:
            data = (out / name / p).read_bytes()
            assert len(data) > 1000 and data.startswith(PNG), p


def test_report_embeds_images_and_every_verdict(smoke):
    out, results = smoke
    html = (out / "report.html").read_text()
    assert html.startswith("<!doctype html>")
    n_plots = sum(len(r["plots"]) for r in results.values())
    assert html.count("data:image/png;base64,") == n_plots
    assert "src=\"http" not in html  # opens offline
    for name, r in results.items():
        assert f"id='{name}'" in html
        for v in r["verdicts"]:
            assert html_escape(v["outcome"]) in html


def test_missing_norms_are_skipped_not_substituted(smoke):
    _, results = smoke
    pad = results["padding"]
    for name in ("power", "dyt"):
        if name not in pad["config"]["norms"]:
            continue  # this mode's design leaves it out (smoke runs the four norms its rule reads)
        why = norms.available(name, 8, "tokens")
        if why:  # not in this normscope: recorded as skipped, never run as something else
            assert name in pad["skipped"] and "needs" in pad["skipped"][name]
            assert all(r["norm"] != name for r in pad["metrics"]["runs"])
        else:
            assert any(r["norm"] == name for r in pad["metrics"]["runs"])


def test_cache_skips_finished_runs_and_force_recomputes(tmp_path):
    first = lab.run_one("batch-size", "smoke", tmp_path)
    assert first["runs_computed"] > 0 and first["runs_cached"] == 0
    again = lab.run_one("batch-size", "smoke", tmp_path)
    assert again["runs_computed"] == 0 and again["runs_cached"] == first["runs_computed"]
    assert again["metrics"]["summary"] == first["metrics"]["summary"]
    forced = lab.run_one("batch-size", "smoke", tmp_path, force=True)
    assert forced["runs_computed"] == first["runs_computed"] and forced["runs_cached"] == 0


def test_same_seed_same_numbers(smoke, tmp_path):
    out, results = smoke
    fresh = lab.run_one("batch-size", "smoke", tmp_path)  # a new directory: nothing cached
    assert fresh["runs_cached"] == 0
    a = [(r["norm"], r["batch"], r["err"], r["losses"]) for r in results["batch-size"]["metrics"]["runs"]]
    b = [(r["norm"], r["batch"], r["err"], r["losses"]) for r in fresh["metrics"]["runs"]]
    assert a == b


def test_cli(tmp_path, capsys):
    assert lab.main(["--list"]) == 0
    assert "batch-size" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        lab.main(["no-such-experiment", "--smoke", "--out", str(tmp_path)])
    with pytest.raises(ValueError, match="mode"):
        lab.run(["batch-size"], mode="medium", out=tmp_path)
    with pytest.raises(ValueError, match="seeds"):
        lab.run(["batch-size"], mode="smoke", out=tmp_path, seeds=0)


# ---------------------------------------------------------------------------------------------
# verdict rules on fixed inputs: both outcomes


def test_power_rule():
    assert verdicts.power_rule(90.0, 90.5, 85.0).outcome == REPRODUCED
    assert verdicts.power_rule(84.0, 90.5, 85.0).outcome == NOT_REPRODUCED


def test_rms_quality_rule():
    assert verdicts.rms_quality_rule(2.00, 2.03).outcome == REPRODUCED
    assert verdicts.rms_quality_rule(2.00, 2.20).outcome == NOT_REPRODUCED


def test_other_rules():
    assert verdicts.smoothness_rule({"loss_range": 0.1, "beta": 1.0}, {"loss_range": 0.5, "beta": 3.0}).outcome \
        == REPRODUCED
    assert verdicts.smoothness_rule({"loss_range": 0.6, "beta": 1.0}, {"loss_range": 0.5, "beta": 3.0}).outcome \
        == NOT_REPRODUCED
    assert verdicts.noisy_rule(90.0, 90.5, 95.0).outcome == REPRODUCED
    assert verdicts.noisy_rule(80.0, 90.5, 95.0).outcome == NOT_REPRODUCED
    drop = {"batch": 30.0, "instance": 1.0, "group:8": 3.0, "layer": 5.0}
    assert verdicts.contrast_rule(drop).outcome == REPRODUCED
    assert verdicts.contrast_rule({**drop, "instance": 10.0}).outcome == NOT_REPRODUCED
    assert verdicts.adain_rule(1e-5).outcome == REPRODUCED
    assert verdicts.adain_rule(0.1).outcome == NOT_REPRODUCED
    assert verdicts.sync_rule(20.0, 10.0, 12.0).outcome == REPRODUCED
    assert verdicts.sync_rule(20.0, 19.5, 12.0).outcome == NOT_REPRODUCED
    assert verdicts.skipped("c", "p", "needs X").outcome == "skipped: needs X"


# ---------------------------------------------------------------------------------------------
# the norm adapter


def test_adapter_builds_the_named_norms():
    x = torch.randn(3, 8, 4, 4)
    ln = norms.make("layer", 8)
    inst = norms.make("instance", 8)
    ref_ln = torch.nn.functional.group_norm(x, 1)
    ref_in = torch.nn.functional.instance_norm(x)
    torch.testing.assert_close(ln(x), ref_ln, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(inst(x), ref_in, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="layout"):
        norms.make("layer", 8, layout="images")


def test_masked_batchnorm_counts_only_valid_tokens():
    torch.manual_seed(0)
    x = torch.randn(4, 6, 5)
    mask = torch.rand(4, 6) > 0.4
    mask[:, 0] = True
    slot = norms.make("batch-masked", 5, "tokens")
    slot.train()
    y = slot(x, mask)
    valid = x[mask]  # (n_valid, 5): what BN should see
    rm, rv = torch.zeros(5), torch.ones(5)
    ref = torch.nn.functional.batch_norm(valid, rm, rv, training=True, momentum=0.1)
    torch.testing.assert_close(y[mask], ref, atol=1e-5, rtol=1e-5)
    inner = slot.inner
    torch.testing.assert_close(inner.running_mean, rm, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(inner.running_var, rv, atol=1e-6, rtol=1e-5)
    # plain BN counts the pads: its statistics differ
    plain = norms.make("batch", 5, "tokens")
    assert not torch.allclose(plain(x, mask)[mask], ref, atol=1e-3)


def test_adapter_reports_missing_norms():
    with pytest.raises(norms.Missing, match="needs"):
        norms.make("no-such-norm", 8, "tokens")
    assert "needs" in norms.available("no-such-norm", 8)
    assert norms.available("group:4", 8) is None
