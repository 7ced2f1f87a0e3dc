"""Smoke test of `normscope bench` in its CPU mode: a tiny subset, checking the JSON it writes."""

import json

import torch

from normscope import bench


def test_bench_cpu_subset_writes_wellformed_json(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bench, "NS_QUICK", (256,))
    monkeypatch.setattr(bench, "QUICK_BYTES", 64 << 10)
    rc = bench.main(
        [
            "--quick",
            "--device",
            "cpu",
            "--cases",
            "layer_norm,masked_batch_norm",
            "--dtypes",
            "fp32",
            "--out",
            str(tmp_path),
        ]
    )
    assert rc == 0
    report = json.loads((tmp_path / "bench-quick-cpu.json").read_text())
    assert report["device_type"] == "cpu" and report["torch"] == torch.__version__
    assert report["copy_gbs"] > 0
    rows = report["results"]
    assert {(r["case"], r["mode"]) for r in rows} == {
        (c, m) for c in ("layer_norm", "masked_batch_norm") for m in ("fwd", "fwd+bwd")
    }
    for r in rows:
        assert set(r["impls"]) == {"normscope", "torch"}
        assert r["normscope_impl"].startswith("normscope (")
        numel = 1
        for d in r["shape"]:
            numel *= d
        assert r["bytes"] == numel * 4 * (2 if r["mode"] == "fwd" else 5)
        for e in r["impls"].values():
            assert e["error"] is None and e["ms"] > 0
            assert abs(e["gbs"] - r["bytes"] / (e["ms"] * 1e-3) / 1e9) < 1e-6 * e["gbs"]
    assert "layer_norm" in capsys.readouterr().out


def test_bench_rejects_unknown_case(capsys):
    import pytest

    with pytest.raises(SystemExit):
        bench.main(["--cases", "nope"])
    assert "unknown case" in capsys.readouterr().err
