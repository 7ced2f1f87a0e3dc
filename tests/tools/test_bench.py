"""`normscope bench` on the CPU: the JSON it writes, --budget-s / --resume / --plot-only, the
correctness check that flags a wrong peer, the Liger adapter's calls (against a stand-in module),
and the CUDA-only branches of the timing with stand-ins for the CUDA calls."""

import inspect
import json
import math
import sys
import types

import pytest
import torch
import torch.nn.functional as F

from normscope.tools import bench


@pytest.fixture
def tiny(monkeypatch):
    monkeypatch.setattr(bench.cases, "NS_QUICK", (256,))
    monkeypatch.setattr(bench.cases, "QUICK_BYTES", 64 << 10)
    monkeypatch.setitem(bench.cases.MASKED, "quick", (2, 16, 32))
    monkeypatch.setitem(bench.cases.SPATIAL, "quick", (2, 64, 4, 4))


def test_bench_cpu_subset_writes_wellformed_json(tmp_path, tiny, capsys):
    rc = bench.main(
        ["--quick", "--device", "cpu", "--cases", "layer_norm,masked_batch_norm", "--dtypes", "fp32"]
        + ["--out", str(tmp_path)]
    )
    assert rc == 0
    report = json.loads((tmp_path / "bench-quick-cpu.json").read_text())
    assert report["device_type"] == "cpu" and report["torch"] == torch.__version__
    assert report["copy_gbs"] > 0 and report["complete"] is True and report["level"] == "quick"
    assert report["peers"] == ["torch"]  # plain CPU: no inductor, no Liger by default
    rows = report["results"]
    assert {(r["case"], r["mode"]) for r in rows} == {
        (c, m) for c in ("layer_norm", "masked_batch_norm") for m in ("fwd", "fwd+bwd")
    }
    for r in rows:
        assert set(r["impls"]) == {"normscope", "torch"}
        assert r["normscope_impl"].startswith("normscope (")
        assert r["bytes"] == math.prod(r["shape"]) * 4 * (2 if r["mode"] == "fwd" else 5)
        for e in r["impls"].values():
            assert e["error"] is None and e["ms"] > 0
            assert abs(e["gbs"] - r["bytes"] / (e["ms"] * 1e-3) / 1e9) < 1e-6 * e["gbs"]
            assert e["ok"] is True and e["max_err"] < 1e-4
    assert bench.problems(report) == []
    assert "layer_norm" in capsys.readouterr().out


def test_bench_rejects_unknown_case_and_peer(capsys):
    with pytest.raises(SystemExit):
        bench.main(["--cases", "nope"])
    assert "unknown case" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main(["--peers", "torch,apex"])
    assert "unknown peer ['apex']" in capsys.readouterr().err


def test_budget_stops_early_and_resume_finishes_without_redoing(tmp_path, tiny):
    args = ["--quick", "--device", "cpu", "--cases", "layer_norm,rms_norm,group_norm", "--dtypes", "fp32"]
    args += ["--out", str(tmp_path)]
    assert bench.main([*args, "--budget-s", "0"]) == 0  # one configuration at least, then stop
    first = json.loads((tmp_path / "bench-quick-cpu.json").read_text())
    assert first["complete"] is False
    assert [(r["case"], r["mode"]) for r in first["results"]] == [("layer_norm", "fwd"), ("layer_norm", "fwd+bwd")]
    assert [r["case"] for r in first["remaining"]] == ["rms_norm", "group_norm"]
    assert bench.main([*args, "--resume"]) == 0
    second = json.loads((tmp_path / "bench-quick-cpu.json").read_text())
    assert second["complete"] is True and "remaining" not in second
    assert [r["case"] for r in second["results"]] == ["layer_norm"] * 2 + ["rms_norm"] * 2 + ["group_norm"] * 2
    assert second["results"][:2] == first["results"]  # kept as measured, not measured again
    assert second["copy_gbs"] == first["copy_gbs"]


def test_resume_refuses_another_device_or_level(tmp_path, tiny):
    report = {"device": "NVIDIA H100 80GB HBM3", "level": "full", "copy_gbs": 3000.0, "results": []}
    with pytest.raises(ValueError, match="previous report's device is 'NVIDIA H100"):
        bench.run(["layer_norm"], ["fp32"], "quick", torch.device("cpu"), log=lambda s: None, previous=report)


def test_plot_only_redraws_from_the_json(tmp_path, tiny):
    pytest.importorskip("matplotlib")
    with pytest.raises(SystemExit):  # nothing to plot yet
        bench.main(["--plot-only", "--device", "cpu", "--out", str(tmp_path)])
    args = ["--quick", "--device", "cpu", "--cases", "rms_norm", "--dtypes", "fp32", "--out", str(tmp_path)]
    assert bench.main(args) == 0
    png = tmp_path / "bench-quick-cpu.png"
    png.unlink()
    assert bench.main(["--plot-only", "--device", "cpu", "--out", str(tmp_path)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _row(case="layer_norm", impl="normscope (triton)", **impls):
    return {"case": case, "dtype": "bf16", "mode": "fwd", "shape": [8, 256], "normscope_impl": impl, "impls": impls}


def test_problems_name_what_should_not_be_trusted():
    ok = {"ms": 1.0, "error": None, "ok": True, "max_err": 0.01}
    good = {"device_type": "cuda", "results": [_row(normscope=ok, liger={**ok, "ok": None, "check_error": "N"})]}
    assert bench.problems(good) == []  # a peer that raises (Liger past 65536) is a limitation, not a problem
    bad = {
        "device_type": "cuda",
        "failed": [{"case": "batch_norm", "dtype": "fp32", "shape": [32, 256, 56, 56], "error": "OutOfMemoryError"}],
        "results": [
            _row(impl="normscope (aten)", normscope=ok),
            _row(normscope={**ok, "ms": None, "error": "RuntimeError: boom"}),
            _row(normscope=ok, liger={**ok, "ok": False, "max_err": 0.7}),
        ],
    }
    found = bench.problems(bad)
    assert len(found) == 4, found
    assert "batch_norm fp32 32x256x56x56: failed: OutOfMemoryError" in found[0]
    assert "normscope ran 'normscope (aten)', not its Triton kernels" in found[1]
    assert "normscope failed: RuntimeError: boom" in found[2]
    assert "liger output does not match torch (max error 0.7)" in found[3]


def test_check_flags_a_peer_that_computes_something_else():
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(6, 32, generator=g), torch.rand(32, generator=g) + 0.5, torch.randn(32, generator=g)
    eager = lambda x, w, b: F.layer_norm(x, (32,), w, b, bench.EPS)  # noqa: E731
    impls = {
        "torch": eager,
        "same": lambda x, w, b: F.layer_norm(x.double(), (32,), w.double(), b.double(), bench.EPS).float(),
        "no_bias": lambda x, w, b: F.layer_norm(x, (32,), w, None, bench.EPS),
        "rms": lambda x, w, b: F.rms_norm(x, (32,), w, bench.EPS) + b,
        "raises": lambda x, w, b: 1 / 0,
    }
    got = bench.cases._check(impls, [x, w, b], eager, torch.float32)
    assert got["torch"]["ok"] and got["same"]["ok"] and got["same"]["max_err"] < 1e-5
    assert not got["no_bias"]["ok"] and not got["rms"]["ok"]
    assert got["raises"]["ok"] is None and got["raises"]["check_error"].startswith("ZeroDivisionError")


# ---------------------------------------------------------------------------------------------
# the Liger adapter, against a stand-in for liger_kernel.ops (the real one: test_bench_interpret.py)


class _Function:
    """Stands in for a Liger torch.autograd.Function: records the positional arguments of apply()."""

    def __init__(self, calls, name, nargs, impl):
        self.calls, self.name, self.nargs, self.impl = calls, name, nargs, impl

    def apply(self, *args):
        assert len(args) == self.nargs, (
            f"{self.name}.apply: {len(args)} arguments, liger-kernel 0.8.5 takes {self.nargs}"
        )
        self.calls.append((self.name, args))
        return self.impl(*args)


def _fake_liger(monkeypatch, calls):
    ops = types.ModuleType("liger_kernel.ops")
    ops.LigerLayerNormFunction = _Function(
        calls, "LN", 4, lambda x, w, b, eps: F.layer_norm(x, x.shape[-1:], w, b, eps)
    )
    ops.LigerRMSNormFunction = _Function(
        calls, "RMS", 7, lambda x, w, eps, off, mode, inplace, row: F.rms_norm(x, x.shape[-1:], w + off, eps)
    )
    ops.LigerFusedAddRMSNormFunction = _Function(
        calls,
        "FADD",
        7,
        lambda x, r, w, eps, off, mode, inplace: (F.rms_norm(x + r, x.shape[-1:], w + off, eps), x + r),
    )
    ops.LigerGroupNormFunction = _Function(calls, "GN", 6, lambda x, w, b, c, g, eps: F.group_norm(x, g, w, b, eps))
    pkg = types.ModuleType("liger_kernel")
    pkg.ops = ops
    monkeypatch.setitem(sys.modules, "liger_kernel", pkg)
    monkeypatch.setitem(sys.modules, "liger_kernel.ops", ops)


def test_liger_adapter_passes_the_like_for_like_arguments(monkeypatch):
    calls = []
    _fake_liger(monkeypatch, calls)
    peers, version, absent = bench.peers._liger_peers()
    assert absent is None and version is not None
    assert set(peers) == {"layer_norm", "rms_norm", "add_rms_norm", "group_norm", "group_norm_cl"}
    x, r, w, b = torch.randn(4, 64), torch.randn(4, 64), torch.rand(64) + 0.5, torch.randn(64)
    xs = torch.randn(2, 64, 3, 3)
    peers["layer_norm"](x, w, b)
    peers["rms_norm"](x, w)
    peers["add_rms_norm"](x, r, w)
    peers["group_norm"](xs, w, b)
    by_name = {name: args for name, args in calls}
    assert by_name["LN"][0] is x and by_name["LN"][1] is w and by_name["LN"][2] is b and by_name["LN"][3] == bench.EPS
    # RMSNorm: eps, no offset, "gemma" casting (fp32 throughout, one rounding), dx written over dy
    assert by_name["RMS"][2:] == (bench.EPS, 0.0, "gemma", True, None)
    assert by_name["FADD"][3:] == (bench.EPS, 0.0, "gemma", False)
    assert by_name["GN"][3:] == (64, bench.GROUPS, bench.EPS)


def test_liger_peer_enters_the_report_and_a_wrong_one_is_flagged(monkeypatch, tiny):
    calls = []
    _fake_liger(monkeypatch, calls)
    quiet = dict(log=lambda s: None, peers=["torch", "liger"])
    report = bench.run(["rms_norm", "group_norm"], ["fp32"], "quick", torch.device("cpu"), **quiet)
    for row in report["results"]:
        assert row["impls"]["liger"]["ok"] is True and row["impls"]["liger"]["ms"] > 0
    assert bench.problems(report) == []
    # an adapter that got Liger's offset wrong (Gemma's 1.0: a scale of 1 + w) must not be timed as a peer
    sys.modules["liger_kernel.ops"].LigerRMSNormFunction.impl = lambda x, w, eps, *rest: F.rms_norm(
        x, x.shape[-1:], w + 1.0, eps
    )
    report = bench.run(["rms_norm"], ["fp32"], "quick", torch.device("cpu"), **quiet)
    assert [p.split(": ", 1)[1] for p in bench.problems(report)][0].startswith("liger output does not match torch")


def test_liger_absent_is_recorded_with_the_reason(monkeypatch, tiny):
    for name in ("liger_kernel", "liger_kernel.ops"):  # import fails, even after a real import earlier
        monkeypatch.setitem(sys.modules, name, None)
    report = bench.run(["rms_norm"], ["fp32"], "quick", torch.device("cpu"), log=lambda s: None)
    assert report["liger"] is None and "ModuleNotFoundError" in report["liger_absent"]
    assert all("liger" not in r["impls"] for r in report["results"])


# ---------------------------------------------------------------------------------------------
# CUDA-only branches, with stand-ins for the CUDA calls (the real ones run in gpu_check.sh)


def test_cuda_timing_branch_calls_do_bench_and_the_memory_counters_as_they_exist(monkeypatch):
    triton_testing = pytest.importorskip("triton.testing")
    real = triton_testing.do_bench
    seen = {}

    def fake_do_bench(fn, **kwargs):
        inspect.signature(real).bind(fn, **kwargs)  # every keyword exists in the installed Triton
        assert kwargs["return_mode"] in inspect.getsource(real).split("assert return_mode in", 1)[1].split("]")[0]
        seen.update(kwargs)
        fn()
        return 0.25

    monkeypatch.setattr(triton_testing, "do_bench", fake_do_bench)
    for name, value in (("synchronize", None), ("reset_peak_memory_stats", None), ("memory_allocated", 1 << 20)):
        assert callable(getattr(torch.cuda, name))
        monkeypatch.setattr(torch.cuda, name, lambda *a, v=value: v)
    assert callable(torch.cuda.max_memory_allocated)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: 5 << 20)
    ran = []
    ms, peak, err = bench.timing._measure(lambda: lambda: ran.append(1), torch.device("cuda"), "full")
    assert (ms, peak, err) == (0.25, 4.0, None)
    assert seen == {"warmup": 25, "rep": 100, "return_mode": "median"} and len(ran) == 3


def test_measure_reports_a_closure_that_raises_while_being_built():
    def make():
        raise RuntimeError("Cannot launch Triton kernel since n = 131072 exceeds the recommended Triton blocksize")

    ms, peak, err = bench.timing._measure(make, torch.device("cpu"), "quick")
    assert ms is None and peak is None and err.startswith("RuntimeError: Cannot launch")


# ---------------------------------------------------------------------------------------------
# the measured-choice table (choice_table), on synthetic results whose answer is worked out by hand


def _timed(case, dtype, n, fwd, fwdbwd, ok=True, impl="normscope (triton)", shape=None):
    """The fwd and fwd+bwd rows of one configuration: (normscope ms, torch ms) per mode."""
    shape = shape or [4, n]
    rows = []
    for mode, (ns_ms, torch_ms) in (("fwd", fwd), ("fwd+bwd", fwdbwd)):
        impls = {"normscope": {"ms": ns_ms, "error": None, "ok": ok}, "torch": {"ms": torch_ms, "error": None}}
        rows.append(
            {"case": case, "dtype": dtype, "mode": mode, "shape": shape, "n": n, "normscope_impl": impl, "impls": impls}
        )
    return rows


def _cuda_report(results, failed=()):
    return {
        "device": "NVIDIA H100 80GB HBM3",
        "device_type": "cuda",
        "device_class": "cuda-sm90",
        "interpret": False,
        "torch": "2.11.0",
        "triton": "3.6.0",
        "results": results,
        "failed": list(failed),
    }


def test_choice_table_keeps_measured_runs_where_triton_is_correct_and_faster_in_both_modes():
    fast = ((1.0, 2.0), (1.0, 1.5))  # x2 fwd, x1.5 fwd+bwd
    results = (
        _timed("layer_norm", "bf16", 4096, (1.0, 1.4), (1.0, 1.2))  # x1.4, x1.2
        + _timed("layer_norm", "bf16", 1024, *fast)
        + _timed("layer_norm", "bf16", 8192, *fast)
        + _timed("layer_norm", "bf16", 16384, (1.0, 3.0), (1.0, 0.9))  # faster fwd, slower fwd+bwd: a gap
        + _timed("layer_norm", "bf16", 32768, *fast)
        + _timed("layer_norm", "bf16", 65536, *fast, ok=False)  # wrong output: a gap
        + _timed("layer_norm", "bf16", 131072, *fast)
        + _timed("layer_norm", "bf16", 262144, *fast, impl="normscope (aten)")  # not the kernel: a gap
        + _timed("layer_norm", "fp32", 1024, (2.0, 1.0), (1.0, 2.0))  # slower fwd: no entry at all
        + _timed("add_rms_norm", "bf16", 512, *fast)
        + _timed("add_rms_norm", "bf16", 2048, *fast)
    )
    table = bench.choice_table(_cuda_report(results), command="normscope bench --dtypes bf16", date="2026-11-23")
    assert {k: v for k, v in table.items() if k != "choices"} == {
        "schema": 1,
        "device_class": "cuda-sm90",
        "device_name": "NVIDIA H100 80GB HBM3",
        "torch": "2.11.0",
        "triton": "3.6.0",
        "command": "normscope bench --dtypes bf16",
        "date": "2026-11-23",
    }
    entry = lambda op, lo, hi, f, fb: {  # noqa: E731
        "op": op, "dtype": "bfloat16", "n_min": lo, "n_max": hi, "speedup_fwd": f, "speedup_fwdbwd": fb
    }  # fmt: skip
    assert table["choices"] == [
        entry("fused_add_rms_norm", 512, 2048, 2.0, 1.5),  # the bench's add_rms_norm, by the table's op name
        entry("layer_norm", 1024, 8192, 1.4, 1.2),  # the minimum over the run
        entry("layer_norm", 32768, 32768, 2.0, 1.5),
        entry("layer_norm", 131072, 131072, 2.0, 1.5),
    ]


def test_choice_table_a_failed_or_half_measured_configuration_splits_a_run_and_nothing_is_extrapolated():
    fast = ((1.0, 2.0), (1.0, 2.0))
    results = _timed("rms_norm", "fp32", 256, *fast) + _timed("rms_norm", "fp32", 4096, *fast)
    results += _timed("rms_norm", "fp32", 1024, *fast)[:1]  # fwd only: the budget ended before fwd+bwd
    results += _timed("rms_norm", "fp32", 65536, *fast) + _timed("rms_norm", "fp32", 262144, *fast)
    failed = [{"case": "rms_norm", "dtype": "fp32", "shape": [8, 131072], "error": "OutOfMemoryError"}]
    got = [(c["n_min"], c["n_max"]) for c in bench.choice_table(_cuda_report(results, failed))["choices"]]
    assert got == [(256, 256), (4096, 65536), (262144, 262144)]


def test_choice_table_group_norm_needs_every_memory_format_and_derives_n_from_the_shape():
    # no "n" in the rows (a report written before rows carried it): n = C/G * H * W = 256/32 * 56 * 56
    nchw = _timed("group_norm", "bf16", 0, (1.0, 2.0), (1.0, 1.5), shape=[32, 256, 56, 56])
    cl = _timed("group_norm_cl", "bf16", 0, (1.0, 1.2), (1.0, 1.1), shape=[32, 256, 56, 56])
    bn = _timed("batch_norm", "bf16", 0, (1.0, 1.3), (1.0, 1.3), shape=[32, 256, 56, 56])
    for row in nchw + cl + bn:
        del row["n"]
    table = bench.choice_table(_cuda_report(nchw + cl + bn))
    assert [(c["op"], c["n_min"], c["speedup_fwd"], c["speedup_fwdbwd"]) for c in table["choices"]] == [
        ("batch_norm", 32 * 56 * 56, 1.3, 1.3),
        ("group_norm", 8 * 56 * 56, 1.2, 1.1),
    ]
    cl[1]["impls"]["torch"]["ms"] = 0.5  # channels_last slower in fwd+bwd: GroupNorm at that n then does not qualify
    assert [c["op"] for c in bench.choice_table(_cuda_report(nchw + cl + bn))["choices"]] == ["batch_norm"]


def test_choice_table_refuses_a_report_not_measured_on_cuda():
    with pytest.raises(ValueError, match="expected a report measured on CUDA"):
        bench.choice_table({**_cuda_report([]), "device_type": "cpu"})
    with pytest.raises(ValueError, match="expected a report measured on CUDA"):
        bench.choice_table({**_cuda_report([]), "interpret": True})
    with pytest.raises(ValueError, match="expected `device_class`"):
        bench.choice_table({**_cuda_report([]), "device_class": None})


def test_write_choice_from_a_cuda_json_with_plot_only_and_refused_for_a_cpu_run(tmp_path, capsys):
    (tmp_path / "bench-cuda.json").write_text(
        json.dumps({**_cuda_report(_timed("layer_norm", "bf16", 4096, (1.0, 1.5), (1.0, 1.25))), "copy_gbs": 1.0})
    )
    measured = tmp_path / "measured"
    measured.mkdir()
    assert bench.main(["--plot-only", "--device", "cuda", "--out", str(tmp_path), "--write-choice", str(measured)]) == 0
    table = json.loads((measured / "cuda-sm90.json").read_text())
    assert table["choices"] == [
        {
            "op": "layer_norm",
            "dtype": "bfloat16",
            "n_min": 4096,
            "n_max": 4096,
            "speedup_fwd": 1.5,
            "speedup_fwdbwd": 1.25,
        }
    ]
    assert table["command"].startswith("normscope bench --plot-only")
    with pytest.raises(SystemExit):
        bench.main(["--quick", "--device", "cpu", "--out", str(tmp_path), "--write-choice", str(measured)])
    assert "--write-choice: the table is measured on CUDA; got device cpu" in capsys.readouterr().err


def test_rows_carry_the_scope_size_n(tmp_path, tiny):
    report = bench.run(
        ["rms_norm", "group_norm", "batch_norm", "masked_batch_norm"], ["fp32"], "quick", torch.device("cpu"),
        log=lambda s: None,
    )  # fmt: skip
    n = {r["case"]: r["n"] for r in report["results"]}
    assert n["rms_norm"] == 256 and n["group_norm"] == 64 // bench.GROUPS * 4 * 4 and n["batch_norm"] == 2 * 4 * 4
    # masked: the valid tokens of the (B, S) mask, between B * S/4 and B * S, counted by the run
    assert 2 * 16 // 4 <= n["masked_batch_norm"] <= 2 * 16
    assert report["device_class"] is None  # CPU: no device class, no table


def test_help_is_plain_text_not_restructuredtext(capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "``" not in out and ":func:" not in out and "::" not in out
    assert "Benchmark normscope's kernels against PyTorch eager" in out and "--write-choice PATH" in out
