"""`normscope bench --cases modern`: the modern norms' rows (AdaLN, QK-norm, Gemma RMSNorm, PolyNorm,
Derf) -- their plan and CLI group on any machine, and the interpreter-level run (``--interpret``)
of normscope's fused kernels against torch eager, torch.compile and Liger-Kernel's modern ops.

Every implementation's forward output must pass the bench's check against torch in fp32, and every
requested peer must either have run or be declined with a reason in the row.
"""

import json
import math
import os

import pytest
import torch
import torch.nn.functional as F

from normscope.kernels import config
from normscope.tools import bench
from normscope.tools.bench import cases

interpreted = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="the dry run needs TRITON_INTERPRET=1 from the start (conftest sets it when there is no GPU)",
)
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy in the interpreter, masked lanes

#: the modern cases Liger-Kernel 0.8.5 has an op for
LIGER_MODERN = {"modulated_rms_norm", "gemma_rms_norm", "poly_norm"}


def _liger_modern() -> bool:
    peers, _, _ = bench.peers._liger_peers()
    return peers is not None and LIGER_MODERN <= set(peers)


# ---------------------------------------------------------------------------------------------
# the plan and the CLI group (no interpreter)


def test_modern_cases_are_a_group_of_their_own_and_every_level_stays_within_the_kernels():
    assert not set(bench.MODERN_CASES) & set(bench.CASES)  # the default selection is unchanged
    assert bench.CASE_GROUPS["modern"] == bench.MODERN_CASES
    assert bench.CASE_GROUPS["all"] == (*bench.CASES, *bench.MODERN_CASES)
    for level in ("full", "quick", "interpret"):
        configs = bench.plan(bench.MODERN_CASES, ["fp32", "bf16"], level)
        assert {c for c, _, _ in configs} == set(bench.MODERN_CASES)
        for case, _, shape in configs:
            assert shape[-1] <= config.ROWS_MAX_FUSED_N, (level, case, shape)  # the fused kernels decline more
            if case == "qk_norm":
                assert len(shape) == 4 and shape[2] == cases.QK_HEADS
            elif case.startswith("modulated"):
                assert len(shape) == 3 and shape[0] == cases.MOD_BATCH
    # the other cases keep their interpreter widths (20000: normscope's looped path; 70000: Liger's limit)
    assert cases.NS_INTERPRET == (64, 20000, 70000)
    assert {s[-1] for _, _, s in bench.plan(["poly_norm"], ["fp32"], "interpret")} == set(cases.NS_MODERN["interpret"])


def test_cases_modern_selects_the_group_and_help_lists_it(tmp_path, monkeypatch, capsys):
    seen = {}

    def fake_run(cases_, dtypes, level, device, **kw):
        seen.update(cases=list(cases_), level=level)
        return {"results": [], "complete": True, "copy_gbs": 1.0, "device": "cpu", "interpret": False}

    monkeypatch.setattr(bench, "run", fake_run)
    monkeypatch.setattr(bench, "plot", lambda *a: False)
    out = ["--device", "cpu", "--out", str(tmp_path)]
    assert bench.main(["--cases", "modern", *out]) == 0
    assert seen["cases"] == list(bench.MODERN_CASES)
    assert bench.main(["--cases", "derf,rms_norm,derf", *out]) == 0
    assert seen["cases"] == ["derf", "rms_norm"]
    assert bench.main(out) == 0
    assert seen["cases"] == list(bench.CASES)  # the default: the ops of the measured-choice table
    with pytest.raises(SystemExit):
        bench.main(["--cases", "modren", *out])
    err = capsys.readouterr().err
    assert "unknown case/dtype ['modren']" in err and "groups: default, modern, all" in err
    with pytest.raises(SystemExit):
        bench.main(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--cases modern" in help_text and "modern: " + ", ".join(bench.MODERN_CASES) in help_text


def _bad(eager_case: str):
    """Near misses of each modern case's formula: the check must flag every one."""
    return {
        "modulated_rms_norm": lambda x, sh, sc: (
            F.rms_norm(x, x.shape[-1:], None, bench.EPS) * sc[:, None] + sh[:, None]
        ),
        "modulated_layer_norm": lambda x, sh, sc: (
            F.rms_norm(x, x.shape[-1:], None, bench.EPS) * (1 + sc[:, None]) + sh[:, None]
        ),
        "qk_norm": lambda q, k, wq, wk: (
            F.rms_norm(q, q.shape[-1:], wq, bench.EPS),
            F.rms_norm(k, k.shape[-1:], wq, 1),
        ),
        "gemma_rms_norm": lambda x, w: F.rms_norm(x, x.shape[-1:], w, bench.EPS),  # no offset: w, not 1 + w
        "poly_norm": lambda x, w, b: w[2] * cases._rms(x**3) + w[1] * cases._rms(x**2) + w[0] * cases._rms(x) + b,
        "derf": lambda x, a, s, w, b: w * torch.tanh(a * x + s) + b,  # DyT's map, not Derf's
    }[eager_case]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", bench.MODERN_CASES)
def test_the_check_flags_a_near_miss_of_each_modern_formula(case, dtype):
    shape = cases._modern_shape(case, 96, 4096)
    inputs, impls, _, _, _, eager, _ = cases._modern_case(
        case, shape, dtype, torch.device("cpu"), {"torch": True}, False
    )
    impls["wrong"] = _bad(case)
    got = cases._check(impls, inputs, eager, dtype)
    assert got["torch"]["ok"] is True and got["normscope"]["ok"] is True, got
    assert got["wrong"]["ok"] is False, got["wrong"]


# ---------------------------------------------------------------------------------------------
# the interpreter level: normscope's fused kernels, Liger's modern ops, torch.compile


def _dry_run(tmp_path, dtypes, peers):
    argv = ["--interpret", "--cases", "modern", "--dtypes", ",".join(dtypes), "--peers", ",".join(peers)]
    assert bench.main([*argv, "--strict", "--out", str(tmp_path)]) == 0, "problems(): see the captured output"
    return json.loads((tmp_path / "bench-interpret-cpu.json").read_text())


def _assert_rows(report, dtypes, peers):
    assert report["complete"] is True and bench.problems(report) == []
    expected = bench.plan(bench.MODERN_CASES, dtypes, "interpret")
    assert [(r["case"], r["dtype"], tuple(r["shape"])) for r in report["results"][::2]] == expected
    for row in report["results"]:
        where = (row["case"], row["dtype"], row["mode"], row["shape"])
        assert row["normscope_impl"] == "normscope (triton)", where  # the fused kernels, not a fallback
        declined = row.get("declined", {})
        # every requested peer ran or was declined, with a reason, never both
        assert set(row["impls"]) | set(declined) == {"normscope", *peers}, where
        assert not set(row["impls"]) & set(declined), where
        assert all(isinstance(why, str) and len(why) > 10 for why in declined.values()), (where, declined)
        for name, e in row["impls"].items():
            assert e["error"] is None and e["ms"] > 0, (where, name, e)
            assert e["ok"] is True, (where, name, e)
        numel = math.prod(row["shape"])
        if row["case"] == "qk_norm":  # k: a quarter of q's heads
            numel = numel * (cases.QK_HEADS + cases.QK_KV_HEADS) // cases.QK_HEADS
        e = torch.empty((), dtype=bench.DTYPES[row["dtype"]]).element_size()
        assert row["bytes"] == numel * e * (2 if row["mode"] == "fwd" else 5), where
        assert row["n"] == row["shape"][-1]


@pytest.mark.smoke  # a dry run of the whole bench: CI runs it (-m smoke), the README command does not
@interpreted
def test_modern_rows_on_the_kernels_against_torch_and_liger(tmp_path):
    """fp32: Liger's kernels compute correctly in the interpreter only there (its half-precision
    arithmetic runs on raw bits: see bench.peers._interpreter_shims)."""
    report = _dry_run(tmp_path, ["fp32"], ["torch", "liger"])
    _assert_rows(report, ["fp32"], ["torch", "liger"])
    for row in report["results"]:
        if _liger_modern():
            assert ("liger" in row["impls"]) == (row["case"] in LIGER_MODERN), row["case"]
        else:
            assert row["declined"]["liger"], row["case"]
    if _liger_modern():
        by_case = {r["case"]: r for r in report["results"]}
        assert "normscope rounds once" in by_case["modulated_rms_norm"]["impls"]["liger"]["note"]
        assert "input dtype" in by_case["poly_norm"]["impls"]["liger"]["note"]
        assert "note" not in by_case["gemma_rms_norm"]["impls"]["liger"]  # the same formula, the same rounding
        assert "RMSNorm only" in by_case["modulated_layer_norm"]["declined"]["liger"]
        assert "no Derf" in by_case["derf"]["declined"]["liger"]


@pytest.mark.smoke  # a dry run of the whole bench: CI runs it (-m smoke), the README command does not
@interpreted
def test_modern_rows_in_bf16_on_the_kernels(tmp_path):
    report = _dry_run(tmp_path, ["bf16"], ["torch"])
    _assert_rows(report, ["bf16"], ["torch"])
    assert max(r["impls"]["normscope"]["max_err"] for r in report["results"]) > 0  # bf16 output, checked as such


@pytest.mark.smoke  # a dry run of the whole bench: CI runs it (-m smoke), the README command does not
@interpreted
@pytest.mark.slow  # inductor's CPU compiles: ~30 s with a cold cache
def test_modern_rows_with_the_compile_peer(tmp_path, monkeypatch):
    monkeypatch.setitem(cases.NS_MODERN, "interpret", (64,))
    report = _dry_run(tmp_path, ["fp32"], ["torch", "compile"])
    _assert_rows(report, ["fp32"], ["torch", "compile"])


@interpreted
@pytest.mark.skipif(not _liger_modern(), reason="liger_kernel with the modern ops (0.8.5) is not importable")
def test_real_liger_modern_ops_through_the_adapter_match_float64_torch():
    """The adapter's calls: forward and every gradient against float64 torch (PolyNorm's (1,) bias
    reaches Liger as a 0-d view and gets its gradient back)."""
    peers, _, _ = bench.peers._liger_peers()
    g = torch.Generator().manual_seed(0)
    b_, s_, n = 2, 3, 48
    x = torch.randn(b_, s_, n, generator=g)
    shift, scale = 0.5 * torch.randn(b_, n, generator=g), 0.5 * torch.randn(b_, n, generator=g)
    w, wp, bp = 0.1 * torch.randn(n, generator=g), torch.tensor([0.3, 0.5, 0.2]), torch.tensor([0.4])
    oracles = {
        "modulated_rms_norm": (
            (x, shift, scale),
            lambda x, sh, sc: cases._rms(x) * (1 + sc[:, None]) + sh[:, None],
        ),
        "gemma_rms_norm": ((x, w), lambda x, w: cases._rms(x) * (1.0 + w)),
        "poly_norm": (
            (x, wp, bp),
            lambda x, w, b: w[0] * cases._rms(x**3) + w[1] * cases._rms(x**2) + w[2] * cases._rms(x) + b,
        ),
    }
    with bench.peers._interpreter_shims():
        for case, (inputs, oracle) in oracles.items():
            leaves = [t.clone().requires_grad_() for t in inputs]
            got = peers[case](*leaves)
            leaves64 = [t.double().requires_grad_() for t in inputs]
            want = oracle(*leaves64)
            torch.testing.assert_close(got.double(), want.detach(), atol=1e-5, rtol=1e-5, msg=f"{case} forward")
            cot = torch.randn(got.shape, generator=g)
            got_g = torch.autograd.grad(got, leaves, cot.clone())  # clone: in_place=True writes dx over it
            want_g = torch.autograd.grad(want, leaves64, cot.double())
            for i, (a, e) in enumerate(zip(got_g, want_g)):
                assert a.shape == e.shape, (case, i)
                torch.testing.assert_close(a.double(), e, atol=1e-4, rtol=1e-4, msg=f"{case} gradient {i}")
