"""`normscope bench --interpret`: the GPU run's code paths on the CPU, in Triton's interpreter.

normscope forced onto its Triton kernels, the Liger-Kernel peer when ``liger_kernel`` is importable
(it is not a dependency: ``pip install --no-deps --target DIR liger-kernel==0.8.5`` and put DIR on
PYTHONPATH to run those parts), torch.compile on inductor's CPU backend (marked slow), every case,
the JSON and the PNG. Sizes are tiny: the interpreter runs each program in Python.
"""

import json
import os
import sys

import pytest
import torch
import torch.nn.functional as F

from normscope.tools import bench

pytest.importorskip("triton", reason="the dry run needs Triton")
pytestmark = [
    pytest.mark.skipif(
        os.environ.get("TRITON_INTERPRET") != "1",
        reason="the dry run needs TRITON_INTERPRET=1 from the start (conftest sets it when there is no GPU)",
    ),
    pytest.mark.filterwarnings("ignore::RuntimeWarning"),  # numpy in the interpreter, on masked-out lanes
]


def _liger_importable() -> bool:
    peers, _, _ = bench.peers._liger_peers()
    return peers is not None


@pytest.fixture
def tiny(monkeypatch):
    monkeypatch.setattr(bench.cases, "NS_INTERPRET", (64, 20000))  # 20000: normscope's looped path
    monkeypatch.setitem(bench.cases.SPATIAL, "interpret", (1, 64, 3, 2))
    monkeypatch.setitem(bench.cases.MASKED, "interpret", (2, 6, 8))


def _dry_run(tmp_path, cases, dtypes, peers):
    argv = ["--interpret", "--cases", ",".join(cases), "--dtypes", ",".join(dtypes), "--peers", ",".join(peers)]
    assert bench.main([*argv, "--strict", "--out", str(tmp_path)]) == 0, "problems(): see the captured output"
    return json.loads((tmp_path / "bench-interpret-cpu.json").read_text())


@pytest.mark.smoke  # a dry run of the whole bench: CI runs it (-m smoke), the README command does not
def test_dry_run_of_every_case_on_the_kernels(tmp_path, tiny):
    report = _dry_run(tmp_path, bench.CASES, ["fp32", "bf16"], ["torch", "liger"])
    assert report["interpret"] is True and report["complete"] is True and report["level"] == "interpret"
    expected = bench.plan(bench.CASES, ["fp32", "bf16"], "interpret")
    assert len(report["results"]) == 2 * len(expected)
    for row in report["results"]:
        assert row["normscope_impl"] == "normscope (triton)", row
        for name in ("normscope", "torch"):
            e = row["impls"][name]
            assert e["error"] is None and e["ms"] > 0, (row["case"], name, e)
            assert e["ok"] is True, (row["case"], row["dtype"], name, e)
    assert bench.problems(report) == []
    png = tmp_path / "bench-interpret-cpu.png"
    if pytest.importorskip("matplotlib"):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    if _liger_importable():
        assert report["liger"] and report["liger_absent"] is None
        for row in report["results"]:
            e = row["impls"].get("liger")
            if row["case"] in ("batch_norm", "masked_batch_norm"):
                assert e is None  # no Liger counterpart
            elif row["dtype"] == "fp32":
                assert e["ok"] is True and e["error"] is None, (row["case"], e)
    else:
        assert report["liger"] is None and report["liger_absent"]


@pytest.mark.smoke  # a dry run of the whole bench: CI runs it (-m smoke), the README command does not
@pytest.mark.slow
def test_dry_run_with_the_compile_peer(tmp_path, tiny, monkeypatch):
    monkeypatch.setattr(bench.cases, "NS_INTERPRET", (64,))
    report = _dry_run(tmp_path, ["add_rms_norm", "group_norm_cl", "masked_batch_norm"], ["fp32"], ["torch", "compile"])
    for row in report["results"]:
        assert row["impls"]["compile"]["ok"] is True and row["impls"]["compile"]["ms"] > 0, row


def test_interpret_refuses_a_triton_already_compiling(monkeypatch, capsys):
    monkeypatch.delenv("TRITON_INTERPRET")
    assert "triton" in sys.modules
    with pytest.raises(SystemExit):
        bench.main(["--interpret"])
    assert "Triton was imported before TRITON_INTERPRET=1" in capsys.readouterr().err


def test_interpreter_shims_are_undone():
    from triton.runtime import interpreter

    before = interpreter._implicit_cvt
    with bench.peers._interpreter_shims():
        assert interpreter._implicit_cvt is not before
    assert interpreter._implicit_cvt is before


# ---------------------------------------------------------------------------------------------
# the real Liger-Kernel, through the adapter, against float64 torch


@pytest.mark.skipif(not _liger_importable(), reason="liger_kernel is not importable (the bench extra installs it)")
def test_real_liger_through_the_adapter_matches_float64_torch():
    peers, _, _ = bench.peers._liger_peers()
    g = torch.Generator().manual_seed(0)
    m, n, eps = 6, 48, bench.EPS
    x, r = torch.randn(m, n, generator=g), torch.randn(m, n, generator=g)
    w, b = torch.rand(n, generator=g) + 0.5, torch.randn(n, generator=g)
    xs = torch.randn(2, 64, 3, 2, generator=g)
    ws, bs = torch.rand(64, generator=g) + 0.5, torch.randn(64, generator=g)
    cases = {
        "layer_norm": ((x, w, b), lambda x, w, b: F.layer_norm(x, (n,), w, b, eps)),
        "rms_norm": ((x, w), lambda x, w: F.rms_norm(x, (n,), w, eps)),
        "add_rms_norm": ((x, r, w), lambda x, r, w: (F.rms_norm(x + r, (n,), w, eps), x + r)),
        "group_norm": ((xs, ws, bs), lambda x, w, b: F.group_norm(x, bench.GROUPS, w, b, eps)),
    }
    with bench.peers._interpreter_shims():
        for case, (inputs, oracle) in cases.items():
            leaves = [t.clone().requires_grad_() for t in inputs]
            got = peers[case](*leaves)
            got = got if isinstance(got, tuple) else (got,)
            leaves64 = [t.double().requires_grad_() for t in inputs]
            want = oracle(*leaves64)
            want = want if isinstance(want, tuple) else (want,)
            assert len(got) == len(want), case
            for a, e in zip(got, want):
                assert a.dtype == torch.float32 and a.shape == e.shape, case
                torch.testing.assert_close(a.double(), e.detach(), atol=1e-5, rtol=1e-5, msg=f"{case} forward")
            cots = [torch.randn(t.shape, generator=g) for t in got]
            # clones: Liger's RMSNorm (in_place=True) writes dx over the cotangent it is given
            got_g = torch.autograd.grad(got, leaves, [c.clone() for c in cots])
            want_g = torch.autograd.grad(want, leaves64, [c.double() for c in cots])
            for i, (a, e) in enumerate(zip(got_g, want_g)):
                torch.testing.assert_close(a.double(), e, atol=1e-4, rtol=1e-4, msg=f"{case} gradient {i}")
