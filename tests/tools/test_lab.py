"""normscope.tools.lab: every experiment at --smoke size, the results cache, determinism, the command
line and the norm adapter; the pieces of the experiments' designs that can be checked without
training (bucketed batching, the cluttered digits, the modern experiments' formulas); a --smoke run
records one thread and judges nothing."""

from __future__ import annotations

import json
from html import escape as html_escape

import pytest

pytest.importorskip("matplotlib")
pytest.importorskip("sklearn")

import torch  # noqa: E402

from normscope.tools import lab  # noqa: E402
from normscope.tools.lab import norms, verdicts  # noqa: E402
from normscope.tools.lab import verdicts as V  # noqa: E402

PNG = b"\x89PNG\r\n\x1a\n"

RESULT_KEYS = {"experiment", "title", "mode", "config", "seeds", "metrics", "verdicts", "skipped", "plots",
               "versions", "wall_s", "runs_cached", "runs_computed", "norm_sources"}

VERDICT_KEYS = {"claim", "published", "measured", "outcome", "rule"}


def reads_the_lab_run(test):
    """The tests reading the module's one lab run (`smoke`: every experiment, the whole pipeline): smoke tests
    (CI runs them, -m smoke; the README's command does not), on one worker (pytest-xdist) so the lab runs once."""
    return pytest.mark.smoke(pytest.mark.xdist_group("lab_smoke_run")(test))


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("lab")
    results = lab.run(mode="smoke", out=out)
    return out, results


@reads_the_lab_run
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
            # smoke runs barely train: their rules run but judge nothing
            assert v["outcome"] == verdicts.NOT_JUDGED or v["outcome"].startswith("skipped: "), v
        assert r["plots"], name
        for p in r["plots"]:
            data = (out / name / p).read_bytes()
            assert len(data) > 1000 and data.startswith(PNG), p


@reads_the_lab_run
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


@reads_the_lab_run
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


@reads_the_lab_run
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


def test_bucketed_batches_vary_the_pad_fraction():
    from normscope.tools.lab.data import padded_sequences
    from normscope.tools.lab.exp_padding import bucketed_batches

    _, mask, _ = padded_sequences(2000, seed=1234)
    batches = bucketed_batches(mask.sum(1), 32, torch.Generator().manual_seed(0))
    assert len(batches) == 2000 // 32
    flat = torch.cat(batches)
    assert len(set(flat.tolist())) == len(flat)  # each sequence at most once per epoch
    pads = [1 - float(mask[b].float().mean()) for b in batches]
    assert max(pads) - min(pads) > 0.5  # the mechanism: batches of short sequences are mostly padding
    lengths = mask.sum(1)
    assert all(int(lengths[b].max() - lengths[b].min()) <= 4 for b in batches)  # a batch holds similar lengths


def test_cluttered_digits_places_each_digit_on_the_canvas():
    from normscope.tools.lab.data import cluttered_digits, digits

    xtr, ytr, xte, yte = cluttered_digits(16, 0.0)
    assert xtr.shape[1:] == (1, 16, 16) and len(xtr) == len(digits()[0])
    assert torch.equal(ytr, digits()[1])
    # without noise, all but an 8x8 window is the (standardized) background value
    bg = xtr[0].flatten().mode().values
    assert int((xtr[0] != bg).sum()) <= 64


def test_smoke_records_one_thread_and_judges_nothing(tmp_path):
    from normscope.tools import lab

    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # the runner must record the 1 thread its runs used, not the caller's setting
    try:
        r = lab.run_one("contrast-style", "smoke", tmp_path)
    finally:  # the tests after this one in the process (a pytest-xdist worker) keep its thread count
        torch.set_num_threads(threads)
    assert r["versions"]["torch_threads"] == "1"
    assert r["verdicts"] and all(v["outcome"] == V.NOT_JUDGED for v in r["verdicts"])


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
