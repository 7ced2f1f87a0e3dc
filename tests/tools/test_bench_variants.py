"""`normscope bench` and normscope's candidate kernels (``bench.VARIANTS``: the read-once rows kernels):
timed in a column of their own beside the default kernel where they differ from it, flagged when they fail,
and named in the measured-choice table only where they beat both the default kernel and torch eager."""

import json
import os

import pytest

from normscope.tools import bench


def _timed(n, ours, torch_, candidate=None, ok=True, case="rms_norm", dtype="bf16"):
    """The fwd and fwd+bwd rows of one configuration; ``ours``, ``torch_``, ``candidate``: ms per mode."""
    rows = []
    for i, mode in enumerate(("fwd", "fwd+bwd")):
        impls = {"normscope": {"ms": ours[i], "error": None, "ok": True}, "torch": {"ms": torch_[i], "error": None}}
        if candidate is not None:
            impls["rows_once"] = {"ms": candidate[i], "error": None, "ok": ok}
        row = {"case": case, "dtype": dtype, "mode": mode, "shape": [4, n], "n": n, "impls": impls}
        rows.append({**row, "normscope_impl": "normscope (triton)"})
    return rows


def _report(results):
    return {
        "device": "NVIDIA H100 80GB HBM3",
        "device_type": "cuda",
        "device_class": "cuda-sm90",
        "interpret": False,
        "torch": "2.11.0",
        "triton": "3.6.0",
        "results": results,
    }


def test_choice_table_names_the_candidate_only_where_it_beats_the_default_and_torch_in_both_modes():
    torch_ms = (2.0, 4.0)
    results = (
        _timed(256, (1.0, 2.0), torch_ms)  # no candidate measured (it does not differ there): the default
        + _timed(32768, (1.0, 2.0), torch_ms, candidate=(0.8, 1.6))  # faster in both: the candidate
        + _timed(65536, (1.0, 2.0), torch_ms, candidate=(0.8, 1.6))
        + _timed(131072, (1.0, 2.0), torch_ms, candidate=(1.1, 1.5))  # slower forward: the default
        + _timed(262144, (3.0, 2.0), torch_ms, candidate=(0.9, 1.9))  # the default slower than torch: the candidate
        + _timed(524288, (1.0, 2.0), torch_ms, candidate=(0.5, 1.0), ok=False)  # wrong output: the default
        + _timed(1048576, (3.0, 5.0), torch_ms, candidate=(2.5, 4.5))  # neither beats torch: no entry
    )
    choices = bench.choice_table(_report(results))["choices"]
    got = [(c["n_min"], c["n_max"], c.get("variant"), c["speedup_fwd"], c["speedup_fwdbwd"]) for c in choices]
    assert got == [
        (256, 256, None, 2.0, 2.0),
        (32768, 65536, "rows_once", 2.5, 2.5),  # a change of kernel splits a run
        (131072, 131072, None, 2.0, 2.0),
        (262144, 262144, "rows_once", 2.222, 2.105),
        (524288, 524288, None, 2.0, 2.0),
    ]
    assert all(c["op"] == "rms_norm" and c["dtype"] == "bfloat16" for c in choices)


def test_the_table_the_bench_writes_is_one_the_engine_reads(tmp_path):
    from normscope.backends import measured

    results = _timed(32768, (1.0, 2.0), (2.0, 4.0), candidate=(0.8, 1.6), case="add_rms_norm")
    path = bench.write_choice(_report(results), tmp_path / "cuda-sm90.json", command="normscope bench")
    (choice,) = measured.load(path)
    assert choice == measured.Choice("fused_add_rms_norm", "bfloat16", 32768, 32768, "rows_once")


def test_problems_flag_a_candidate_that_fails_or_computes_something_else():
    ok = {"ms": 1.0, "error": None, "ok": True, "max_err": 0.0}
    row = {"case": "layer_norm", "dtype": "bf16", "mode": "fwd", "shape": [8, 32768]}
    row["normscope_impl"] = "normscope (triton)"
    report = {
        "device_type": "cuda",
        "results": [
            {**row, "impls": {"normscope": ok, "rows_once": {**ok, "ms": None, "error": "RuntimeError: launch"}}},
            {**row, "impls": {"normscope": ok, "rows_once": {**ok, "ok": False, "max_err": 0.5}}},
            {**row, "impls": {"normscope": ok, "rows_once": ok}},
        ],
    }
    found = bench.problems(report)
    assert len(found) == 2, found
    assert "normscope's rows_once kernels failed: RuntimeError: launch" in found[0]
    assert "rows_once output does not match torch (max error 0.5)" in found[1]


def test_variants_option(tmp_path, capsys):
    with pytest.raises(SystemExit):
        bench.main(["--quick", "--device", "cpu", "--variants", "fastest", "--out", str(tmp_path)])
    assert "unknown variant ['fastest']; expected a subset of: rows_once, or none" in capsys.readouterr().err


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="the dry run needs TRITON_INTERPRET=1 from the start"
)
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_dry_run_times_the_candidate_beside_the_default_kernel(tmp_path, monkeypatch):
    """The GPU run's code path on the CPU: at 64 columns the candidate runs the default kernel, so it
    is not timed; at 20000 and 40000 it is, checked against torch, with its ratio (the default's time over its)."""
    pytest.importorskip("triton")
    monkeypatch.setattr(bench.cases, "NS_INTERPRET", (64, 20000, 40000))
    argv = ["--interpret", "--cases", "rms_norm", "--dtypes", "fp32", "--peers", "torch", "--strict"]
    assert bench.main([*argv, "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "bench-interpret-cpu.json").read_text())
    assert report["variants"] == ["rows_once"]
    by_n = {}
    for row in report["results"]:
        by_n.setdefault(row["n"], []).append(row)
    assert all("rows_once" not in row["impls"] for row in by_n[64])
    for n in (20000, 40000):
        for row in by_n[n]:
            e = row["impls"]["rows_once"]
            assert e["ok"] is True and e["error"] is None and e["ms"] > 0, (n, row["mode"], e)
            assert e["ratio"] == pytest.approx(row["impls"]["normscope"]["ms"] / e["ms"])
    assert bench.problems(report) == []
    none = tmp_path / "none"
    assert bench.main([*argv, "--variants", "none", "--out", str(none)]) == 0
    report = json.loads((none / "bench-interpret-cpu.json").read_text())
    assert report["variants"] == [] and all("rows_once" not in r["impls"] for r in report["results"])
