"""`normscope bench` and the candidate kernels: the ``candidates`` cases (``case@variant`` beside
the case that pins the default kernel), the measured-choice table naming a variant only where it measured
faster than torch and than the default kernel, and -- in Triton's interpreter -- that each case runs the
kernel its name says."""

import json
import os

import pytest

from normscope.tools import bench


def test_candidate_cases_are_a_group_of_their_own():
    assert bench.CASE_GROUPS["candidates"] == bench.CANDIDATE_CASES
    assert bench.CASE_GROUPS["default"] == bench.CASES  # the default selection is unchanged
    assert set(bench.CANDIDATE_CASES) <= set(bench.cases.KNOWN_CASES)
    for case in bench.CANDIDATE_CASES:
        base, variant = bench.cases.split_case(case)
        assert base in bench.cases.VARIANT_FAMILY and base in bench.report.CHOICE_OPS
        if variant is not None:
            assert base in bench.CANDIDATE_CASES, f"{case}: no case measures the default kernel beside it"
    plan = dict(((c, d), s) for c, d, s in bench.plan(bench.CANDIDATE_CASES, ["bf16"], "full"))
    assert plan[("group_norm_small@onchip", "bf16")] == (32, 256, 28, 28)  # a group the on-chip tile holds
    assert plan[("instance_norm_cl@onchip", "bf16")] == plan[("batch_norm@split", "bf16")] == (32, 256, 56, 56)
    assert plan[("masked_batch_norm@split", "bf16")] == bench.cases.MASKED["full"]


def test_variant_runs_says_where_the_on_chip_kernels_fall_back():
    import torch

    x = torch.empty(2, 256, 56, 56)
    assert bench.cases.variant_runs("instance_norm@onchip", [x])  # groups of 3136: on chip
    assert not bench.cases.variant_runs("group_norm@onchip", [x])  # 8 x 3136 > GROUPS_ONCHIP_MAX
    assert bench.cases.variant_runs("batch_norm@split", [x]) and bench.cases.variant_runs("batch_norm", [x])


def _timed(case, dtype, n, fwd, fwdbwd, variant_ran=None, shape=None):
    """fwd and fwd+bwd rows of one configuration: (normscope ms, torch ms) per mode."""
    rows = []
    for mode, (ns_ms, torch_ms) in (("fwd", fwd), ("fwd+bwd", fwdbwd)):
        impls = {"normscope": {"ms": ns_ms, "error": None, "ok": True}, "torch": {"ms": torch_ms, "error": None}}
        row = {"case": case, "dtype": dtype, "mode": mode, "shape": shape or [4, n], "n": n,
               "normscope_impl": "normscope (triton)", "impls": impls}  # fmt: skip
        if "@" in case:
            row["variant"] = case.partition("@")[2]
            row["variant_ran"] = True if variant_ran is None else variant_ran
        rows.append(row)
    return rows


def _report(results, failed=()):
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


def test_choice_table_names_a_variant_only_where_it_beats_torch_and_the_default_kernel():
    slow, fast, faster = ((1.0, 0.5), (1.0, 0.5)), ((1.0, 1.2), (1.0, 1.2)), ((1.0, 1.5), (1.0, 1.5))
    results = (
        _timed("batch_norm", "bf16", 100, *slow) + _timed("batch_norm@split", "bf16", 100, *fast)  # only split wins
        + _timed("batch_norm", "bf16", 200, *slow) + _timed("batch_norm@split", "bf16", 200, *faster)
        + _timed("batch_norm", "bf16", 300, *faster) + _timed("batch_norm@split", "bf16", 300, *fast)  # tiled wins
        + _timed("batch_norm", "bf16", 400, *fast) + _timed("batch_norm@split", "bf16", 400, *fast)  # a tie: tiled
        + _timed("batch_norm", "bf16", 500, *slow) + _timed("batch_norm@split", "bf16", 500, *slow)  # neither
        # GroupNorm: a variant must win in every memory format measured at n, and must have run
        + _timed("instance_norm", "fp32", 3136, *slow) + _timed("instance_norm_cl", "fp32", 3136, *slow)
        + _timed("instance_norm@onchip", "fp32", 3136, *fast) + _timed("instance_norm_cl@onchip", "fp32", 3136, *slow)
        + _timed("group_norm_small", "fp32", 6272, *slow) + _timed("group_norm_small_cl", "fp32", 6272, *slow)
        + _timed("group_norm_small@onchip", "fp32", 6272, *fast)
        + _timed("group_norm_small_cl@onchip", "fp32", 6272, *fast, variant_ran=False)
    )  # fmt: skip
    table = bench.choice_table(_report(results), date="2027-01-01")
    got = [(c["op"], c["dtype"], c["n_min"], c["n_max"], c.get("variant")) for c in table["choices"]]
    assert got == [
        ("batch_norm", "bfloat16", 100, 200, "split"),
        ("batch_norm", "bfloat16", 300, 400, None),
    ]
    assert "variant" not in table["choices"][1]  # the default kernel: the key left out, as older tables have it
    # what the table writes, the engine reads: the variant is known to the loader
    from normscope.backends import measured

    assert all(c.get("variant") in (None, *measured.VARIANTS[c["op"]]) for c in table["choices"])


def test_choice_table_a_failed_variant_configuration_does_not_qualify():
    """A candidate that failed at n (out of memory, say: no rows) leaves the default kernel the choice there."""
    fast, faster, slow = ((1.0, 1.2), (1.0, 1.2)), ((1.0, 2.0), (1.0, 2.0)), ((1.0, 0.5), (1.0, 0.5))
    results = _timed("batch_norm", "bf16", 100, *fast, shape=[100, 1, 1, 1])
    results += _timed("batch_norm", "bf16", 200, *slow, shape=[200, 1, 1, 1])
    results += _timed("batch_norm@split", "bf16", 200, *faster, shape=[200, 1, 1, 1])
    failed = [{"case": "batch_norm@split", "dtype": "bf16", "shape": [100, 1, 1, 1], "error": "OutOfMemoryError"}]
    table = bench.choice_table(_report(results, failed))
    assert [(c["n_min"], c["n_max"], c.get("variant")) for c in table["choices"]] == [
        (100, 100, None),
        (200, 200, "split"),
    ]


def test_problems_flags_a_variant_row_that_ran_the_default_kernel():
    rows = _timed("group_norm@onchip", "bf16", 25088, (1.0, 1.2), (1.0, 1.2), variant_ran=False)
    assert any("'onchip' kernel variant does not take this input" in p for p in bench.problems(_report(rows)))


@pytest.mark.smoke  # a dry run of the bench over every candidate case (30 s): CI runs it (-m smoke)
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs Triton's interpreter from the start")
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_dry_run_of_the_candidate_cases_runs_the_kernel_each_case_names(tmp_path, monkeypatch):
    """In the interpreter, tiny: every case runs on the Triton backend, passes the output check, and its
    launches are those of the kernel its name pins (the default for a plain case, the candidate for @variant)."""
    pytest.importorskip("triton")
    from normscope.kernels import channels, channels_split, groups, groups_onchip, variants

    monkeypatch.setitem(bench.cases.SPATIAL, "interpret", (1, 64, 2, 3))
    monkeypatch.setitem(bench.cases.SPATIAL_SMALL, "interpret", (1, 64, 2, 2))
    monkeypatch.setitem(bench.cases.MASKED, "interpret", (2, 3, 8))
    launched = []

    class Spy:
        def __init__(self, module, name, kernel):
            self.module, self.name, self.kernel = module, name, kernel

        def __getitem__(self, grid):
            launched.append((self.module, variants.forced("channels"), variants.forced("groups"), "bwd" in self.name))
            return self.kernel[grid]

    for module in (channels, channels_split, groups, groups_onchip):
        for name in dir(module):
            if name.endswith("_kernel") and hasattr(getattr(module, name), "__getitem__"):
                monkeypatch.setattr(module, name, Spy(module.__name__.rpartition(".")[2], name, getattr(module, name)))
    argv = ["--interpret", "--cases", "candidates", "--dtypes", "fp32", "--peers", "torch", "--strict"]
    assert bench.main([*argv, "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "bench-interpret-cpu.json").read_text())
    assert len(report["results"]) == 2 * len(bench.CANDIDATE_CASES) and bench.problems(report) == []
    for row in report["results"]:
        assert row["normscope_impl"] == "normscope (triton)" and row["impls"]["normscope"]["ok"] is True, row
    pins = {
        "channels": (1, "tiled"),
        "channels_split": (1, "split"),
        "groups": (2, "tiled"),
        "groups_onchip": (2, "onchip"),
    }
    for module, (at, pin) in pins.items():
        # forward launches happen inside the case's use_variant block; the backward's run later, after the
        # block, on the kernels of the forward's op
        seen = {launch[at] for launch in launched if launch[0] == module and not launch[3]}
        assert seen == {pin}, f"{module} launched forward kernels under pins {seen}"
        assert any(launch[0] == module and launch[3] for launch in launched), f"{module}: no backward launch"


def test_one_table_from_both_kinds_of_candidate_and_one_field_for_them(tmp_path):
    """A run holding the row cases' ``rows_once`` column and the spatial ``case@variant`` cases writes one table
    whose entries name their kernel in one field, ``"variant"``, which the engine's loader reads back."""
    from normscope.backends import measured

    rows = []
    for mode, ns, cand, eager in (("fwd", 1.0, 0.8, 2.0), ("fwd+bwd", 2.0, 1.6, 4.0)):
        impls = {
            "normscope": {"ms": ns, "error": None, "ok": True},
            "rows_once": {"ms": cand, "error": None, "ok": True},
            "torch": {"ms": eager, "error": None},
        }
        rows.append({"case": "layer_norm", "dtype": "bf16", "mode": mode, "shape": [4, 32768], "n": 32768,
                     "normscope_impl": "normscope (triton)", "impls": impls})  # fmt: skip
    slow, fast = ((1.0, 0.5), (1.0, 0.5)), ((1.0, 1.5), (1.0, 1.5))
    rows += _timed("batch_norm", "bf16", 100, *slow) + _timed("batch_norm@split", "bf16", 100, *fast)
    table = bench.choice_table(_report(rows), date="2027-01-01")
    got = [(c["op"], c.get("variant")) for c in table["choices"]]
    assert got == [("batch_norm", "split"), ("layer_norm", "rows_once")]
    assert all("kernel" not in c for c in table["choices"])
    path = bench.write_choice(_report(rows), tmp_path / "cuda-sm90.json", command="normscope bench")
    assert [c.variant for c in measured.load(path)] == ["split", "rows_once"]
