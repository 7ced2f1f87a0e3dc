"""The ``normscope`` command line: tour, explain, lazy subcommands, and the CI script.

Expected numbers are computed here independently (the statistics module, direct torch
reductions, torch.nn layers), never taken from the code under test.
TestHostile: bad input exits 2 with one line naming the argument."""

from __future__ import annotations

import json
import math
import os
import re
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import normscope
from conftest import run_cli as run
from normscope import cli

ROOT = Path(__file__).resolve().parents[2]


# the 2x3x2x2 tensor of seed article 004, written out again so the test does not trust the tour's copy
ARTICLE_DATA = [
    [[[0.1, 0.2], [0.3, 0.4]], [[1.0, 0.9], [1.2, -1.1]], [[1.1, 0.3], [-0.6, 0.2]]],
    [[[0.3, 0.8], [-0.2, -0.3]], [[-0.2, 2.1], [1.1, 0.2]], [[0.4, 0.7], [-2.1, 0.5]]],
]


def channel_stats() -> list[tuple[float, float]]:
    """(mean, population variance) of each channel of ARTICLE_DATA, in plain Python."""
    result = []
    for c in range(3):
        values = [v for sample in ARTICLE_DATA for row in sample[c] for v in row]
        result.append((statistics.fmean(values), statistics.pvariance(values)))
    return result


# ---------------------------------------------------------------------------------------------- tour


@pytest.mark.parametrize("style", ["--plain", None])
def test_tour_prints_the_articles_numbers(capsys, style):
    x = [10, 2, 6, 14]
    mean, var = statistics.fmean(x), statistics.pvariance(x)
    assert (mean, var) == (8, 20)
    rc, out, _ = run(capsys, "tour", *([style] if style else []))
    assert rc == 0
    assert f"= {mean:g}" in out and f"= {var:g}" in out
    normalized = [(v - mean) / math.sqrt(var + 1e-5) for v in x]
    assert "[" + ", ".join(f"{v:+.4f}" for v in normalized) + "]" in out
    for c, (m, v) in enumerate(channel_stats()[:2]):
        row = re.search(rf"^\s*{c}\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)\s*$", out, re.M)
        assert row is not None, out
        assert [float(t) for t in row.groups()] == pytest.approx([m, v, m, v], abs=1e-6)
    assert "checks passed" in out and "FAIL" not in out


def test_tour_names_the_articles_it_checks_against(capsys):
    rc, out, _ = run(capsys, "tour", "--plain")
    assert rc == 0
    assert "the article (rounded)" not in out
    section1 = out.split("== 2.")[0]
    assert 'From the article "Q5: Layer Normalization explained" (no author named).' in section1
    assert "the Q5 article (rounded)" in section1
    for number in ("2.", "3."):
        section = out.split(f"== {number}")[1].split("\n== ")[0]
        assert "From an untitled article on normalization from CNNs to the Transformer" in section
    rc, out, _ = run(capsys, "tour", "--json")
    sources = json.loads(out)["sources"]
    assert sources["layernorm_vector"]["title"] == "Q5: 层归一化（Layer Normalization）详解"
    assert set(sources) == {"layernorm_vector", "batchnorm_channels", "tokens"}


def test_tour_json_matches_independent_computation(capsys):
    rc, out, _ = run(capsys, "tour", "--json")
    assert rc == 0
    result = json.loads(out)
    assert result["passed"] is True
    assert result["checks"] and all(c["passed"] for c in result["checks"])

    ln = result["sections"]["layernorm_vector"]
    assert ln["mean"] == 8 and ln["var"] == 20
    expected = [(v - 8) / math.sqrt(20 + 1e-5) for v in (10, 2, 6, 14)]
    assert ln["normscope"] == pytest.approx(expected, abs=1e-6)
    assert ln["torch"] == pytest.approx(expected, abs=1e-6)

    bn = result["sections"]["batchnorm_channels"]
    stats = channel_stats()
    assert bn["mean"] == pytest.approx([m for m, _ in stats], abs=1e-6)
    assert bn["var"] == pytest.approx([v for _, v in stats], abs=1e-6)
    x = torch.tensor(ARTICLE_DATA)
    want = F.batch_norm(x, None, None, training=True, eps=1e-5)
    assert torch.allclose(torch.tensor(bn["normalized"]), want, atol=1e-6)

    tokens = result["sections"]["tokens"]
    for name in ("LayerNorm", "RMSNorm"):
        assert tokens[name]["manual_allclose"] is True and tokens[name]["normscope_allclose"] is True
        assert tokens[name]["normscope_max_abs_diff"] <= 1e-6

    sc = result["sections"]["scopes"]
    xs = torch.tensor(sc["x"], dtype=torch.float64)
    n, c = xs.shape[:2]
    by_layer = {  # the statistics of every scope, in id order, by direct reduction
        "BatchNorm2d": (xs.mean((0, 2, 3)), xs.var((0, 2, 3), unbiased=False)),
        "LayerNorm": (xs.mean((1, 2, 3)), xs.var((1, 2, 3), unbiased=False)),
        "InstanceNorm2d": (xs.mean((2, 3)).flatten(), xs.var((2, 3), unbiased=False).flatten()),
        "GroupNorm(2)": (
            xs.reshape(n, 2, -1).mean(-1).flatten(),
            xs.reshape(n, 2, -1).var(-1, unbiased=False).flatten(),
        ),
    }
    assert set(sc["layers"]) == set(by_layer)
    for name, (mean, var) in by_layer.items():
        layer = sc["layers"][name]
        assert layer["num_scopes"] == mean.numel()
        assert [s["count"] for s in layer["scopes"]] == [xs.numel() // mean.numel()] * mean.numel()
        assert [s["mean"] for s in layer["scopes"]] == pytest.approx(mean.tolist(), abs=1e-6)
        assert [s["var"] for s in layer["scopes"]] == pytest.approx(var.tolist(), abs=1e-6)
    assert sc["layers"]["GroupNorm(2)"]["scope_ids_nc"] == [[0, 0, 1, 1], [2, 2, 3, 3]]
    assert sc["layers"]["BatchNorm2d"]["scope_ids_nc"] == [list(range(c))] * n


def test_tour_fails_when_a_layer_is_wrong(capsys, monkeypatch):
    """The tour's checks are real: a LayerNorm that is off by 1% makes it exit 1."""
    monkeypatch.setattr(normscope.LayerNorm, "forward", lambda self, x: F.layer_norm(x, self.normalized_shape) * 1.01)
    rc, out, _ = run(capsys, "tour", "--plain")
    assert rc == 1
    assert "FAILED" in out and "normscope vs torch" in out
    rc, out, _ = run(capsys, "tour", "--json")
    assert rc == 1 and json.loads(out)["passed"] is False


def test_tour_pictures_hook(capsys, monkeypatch, tmp_path):
    calls = []
    fake = types.ModuleType("normscope.tools.viz")
    fake.draw_all = calls.append
    monkeypatch.setitem(sys.modules, "normscope.tools.viz", fake)
    rc, out, _ = run(capsys, "tour", "--plain", "--pictures", str(tmp_path))
    assert rc == 0 and calls == [str(tmp_path)]

    monkeypatch.setitem(sys.modules, "normscope.tools.viz", None)  # makes the import fail
    rc, out, err = run(capsys, "tour", "--plain", "--pictures", str(tmp_path))
    assert rc == 1 and "normscope.tools.viz" in err
    assert "checks" not in out  # refused before the tour ran, not after it


def test_tour_pictures_without_matplotlib_fails_before_the_checks(capsys, monkeypatch, tmp_path):
    """normscope.tools.viz imports (it needs matplotlib only to draw): the missing package must still be
    found up front, with the extra that installs it, and no check printed first."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    rc, out, err = run(capsys, "tour", "--plain", "--pictures", str(tmp_path))
    assert rc == 1
    assert out == ""
    assert "'matplotlib'" in err and "normscope[viz]" in err and "Traceback" not in err


# ---------------------------------------------------------------------------------------------- explain


def direct_stats(layer: str, x: torch.Tensor, groups: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-scope (mean, biased var), in scope-id order, by direct torch reductions."""
    n, c = x.shape[:2]
    if layer == "batch":
        dims = (0,) + tuple(range(2, x.dim()))
        return x.mean(dims), x.var(dims, unbiased=False)
    if layer == "instance":
        dims = tuple(range(2, x.dim()))
        return x.mean(dims).flatten(), x.var(dims, unbiased=False).flatten()
    if layer == "group":
        g = x.reshape(n, groups, -1)
        return g.mean(-1).flatten(), g.var(-1, unbiased=False).flatten()
    flat = x.reshape(n, -1)  # layer/rms default: every axis but the first
    if layer == "rms":
        return torch.zeros(n), flat.square().mean(-1)
    return flat.mean(-1), flat.var(-1, unbiased=False)


def torch_output(layer: str, x: torch.Tensor, groups: int | None) -> torch.Tensor:
    if layer == "batch":
        return F.batch_norm(x, None, None, training=True, eps=1e-5)
    if layer == "instance":
        return F.instance_norm(x, eps=1e-5)
    if layer == "group":
        return F.group_norm(x, groups, eps=1e-5)
    if layer == "rms":
        return F.rms_norm(x, x.shape[1:], eps=1e-5)
    return F.layer_norm(x, x.shape[1:], eps=1e-5)


EXPLAIN_CASES = [
    ("batch", "BatchNorm2d", (2, 3, 2, 2), None),
    ("batch", "batch", (4, 3), None),
    ("layer", "LayerNorm", (2, 3, 4), None),
    ("instance", "InstanceNorm1d", (2, 3, 5), None),
    ("instance", "instance", (2, 2, 3, 3), None),
    ("group", "GroupNorm", (2, 6, 2, 2), 3),
    ("rms", "rms", (3, 2, 4), None),
]


@pytest.mark.parametrize(("layer", "name", "shape", "groups"), EXPLAIN_CASES)
def test_explain_json_matches_torch(capsys, layer, name, shape, groups):
    argv = ["explain", name, "--shape", ",".join(map(str, shape)), "--json"]
    if groups:
        argv += ["--groups", str(groups)]
    rc, out, _ = run(capsys, *argv)
    assert rc == 0
    result = json.loads(out)
    x = torch.tensor(result["input"], dtype=torch.float64)
    assert tuple(x.shape) == shape
    mean, var = direct_stats(layer, x, groups)
    assert result["scope"]["num_scopes"] == mean.numel()
    assert result["scope"]["elements_per_scope"] == x.numel() // mean.numel()
    if layer == "rms":  # no mean is used, so none is reported; the second moment is the mean square
        assert all("mean" not in s and "var" not in s for s in result["stats"])
        assert [s["mean_square"] for s in result["stats"]] == pytest.approx(var.tolist(), abs=1e-6)
    else:
        assert [s["mean"] for s in result["stats"]] == pytest.approx(mean.tolist(), abs=1e-6)
        assert [s["var"] for s in result["stats"]] == pytest.approx(var.tolist(), abs=1e-6)
    want = torch_output(layer, x.float(), groups)
    assert torch.allclose(torch.tensor(result["output"]), want, atol=1e-5)
    assert result["torch"]["max_abs_diff"] <= 1e-6


def test_explain_prints_statistics_of_given_values(capsys):
    rc, out, _ = run(capsys, "explain", "layer", "--shape", "4", "--values", "10,2,6,14", "--plain")
    assert rc == 0
    row = re.search(r"^\s*0\s+all\s+4\s+(\S+)\s+(\S+)\s+(\S+)\s*$", out, re.M)
    assert row is not None, out
    assert [float(t) for t in row.groups()] == pytest.approx([8, 20, 1 / math.sqrt(20 + 1e-5)], rel=1e-5)
    assert "mean and variance over D" in out


@pytest.mark.parametrize(
    ("argv", "values", "build"),
    [
        # torch's fp32 LayerNorm loses digits on 1e4 + a small spread; its BatchNorm gives a constant channel -3e-5
        (["layer", "--shape", "3"], [1e4, 1e4, 1.0001e4], lambda: torch.nn.LayerNorm(3, elementwise_affine=False)),
        (["batch", "--shape", "2,1"], [5.0, 5.0], lambda: torch.nn.BatchNorm1d(1, affine=False)),
    ],
)
def test_explain_passes_where_normscope_is_closer_to_float64_than_torch(capsys, argv, values, build):
    # torch is the floor, not the bar: where the outputs part, the float64 formula decides
    text = ",".join(map(str, values))
    rc, out, _ = run(capsys, "explain", *argv, "--values", text, "--json")
    result = json.loads(out)
    x = torch.tensor(values, dtype=torch.float64).reshape(result["shape"])
    dims = tuple(range(1, x.dim())) if argv[0] == "layer" else (0,)
    y64 = (x - x.mean(dims, keepdim=True)) / torch.sqrt(x.var(dims, unbiased=False, keepdim=True) + 1e-5)
    y_torch = build().train()(x.float()).detach().double()
    assert (y_torch - y64).abs().max() > 1e-5  # torch is off here
    y = torch.tensor(result["output"], dtype=torch.float64)
    assert (y - y64).abs().max() <= (y_torch - y64).abs().max()
    t = result["torch"]
    assert not t["allclose"] and t["closer_to_float64"] and rc == 0
    assert t["float64_max_abs_diff"]["torch"] == pytest.approx((y_torch - y64).abs().max().item(), rel=1e-6)
    rc, out, _ = run(capsys, "explain", *argv, "--values", text, "--plain")
    assert rc == 0 and "normscope is the closer one  [ok]" in out and "FAIL" not in out


def test_explain_a_nan_input_gives_torch_s_nan(capsys):
    rc, out, _ = run(capsys, "explain", "layer", "--shape", "4", "--values", "1,2,nan,4", "--json")
    result = json.loads(out)
    want = torch.nn.LayerNorm(4)(torch.tensor([1.0, 2.0, float("nan"), 4.0]))
    assert want.isnan().all() and all(math.isnan(v) for v in result["output"])
    assert rc == 0 and result["torch"]["allclose"] and result["torch"]["max_abs_diff"] == 0.0


def test_explain_batchnorm1d_takes_n_c_as_torch_does(capsys):
    values = [0.5, -1.0, 2.0, 0.25, -0.75, 1.5]
    rc, out, _ = run(
        capsys, "explain", "BatchNorm1d", "--shape", "3,2", "--values", ",".join(map(str, values)), "--json"
    )
    result = json.loads(out)
    want = torch.nn.BatchNorm1d(2)(torch.tensor(values).reshape(3, 2))
    assert rc == 0 and result["torch_layer"] == "BatchNorm1d"
    assert torch.allclose(torch.tensor(result["output"]), want, atol=1e-6)


def test_explain_rms_labels_its_statistics_honestly(capsys):
    """RMSNorm subtracts no mean: the table shows the mean square and 1/rms, not "mean 0" and a
    "variance" that is really the mean square."""
    rc, out, _ = run(capsys, "explain", "rms", "--shape", "1,4", "--values", "1,2,3,4", "--plain")
    assert rc == 0
    header = next(line for line in out.splitlines() if line.lstrip().startswith("scope "))
    assert "mean square" in header and "1/rms" in header
    assert "variance" not in header and " mean " not in f" {header.replace('mean square', '')} "
    row = re.search(r"^\s*0\s+n=0\s+4\s+(\S+)\s+(\S+)\s*$", out, re.M)
    assert row is not None, out
    assert [float(t) for t in row.groups()] == pytest.approx([7.5, 1 / math.sqrt(7.5 + 1e-5)], rel=1e-5)


def test_explain_words_name_the_scope(capsys):
    rc, out, _ = run(capsys, "explain", "group", "--shape", "2,4,2,2", "--groups", "2", "--plain")
    assert rc == 0
    assert "over C (the 2 channels of one group), H, W, separately for each N and group" in out
    rc, out, _ = run(
        capsys,
        "explain",
        "BatchNorm2d",
        "--shape",
        "2,3,2,2",
        "--values",
        ",".join(str(v) for v in torch.tensor(ARTICLE_DATA).flatten().tolist()),
        "--plain",
    )
    assert rc == 0 and "over N, H, W, separately for each C" in out
    for c, (m, v) in enumerate(channel_stats()):
        assert re.search(rf"^\s*{c}\s+c={c}\s+8\s+{re.escape(f'{m:.6g}')}\s+{re.escape(f'{v:.6g}')}\s", out, re.M), out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["explain", "foo", "--shape", "2,3"], "argument LAYER: unknown layer 'foo'"),
        (["explain", "batch", "--shape", "2,x3"], "argument --shape"),
        (["explain", "batch", "--shape", "2,0,3"], "argument --shape"),
        (["explain", "batch", "--shape", "2,3", "--mask", "2,1"], "argument --shape: a masked norm needs"),
        (["explain", "masked_layer", "--shape", "2,3,4", "--mask", "4,5"], "argument --mask: expected 2 valid lengths"),
        (["explain", "rms", "--mask", "2,1"], "argument --mask: expected a layer with a masked form"),
        (["explain", "qknorm", "--groups", "2", "--heads", "4"], "argument --heads: expected --heads and --groups"),
        (["explain", "adaln", "--groups", "2"], "argument --groups: only the group and qknorm layers take --groups"),
        (["explain", "qknorm", "--shape", "2,3,6", "--heads", "4"], "argument --heads: expected a number of heads"),
        (["explain", "layer", "--heads", "2"], "argument --heads: only the qknorm layer"),
        (["explain", "BatchNorm2d", "--shape", "2,3,4"], "argument --shape: BatchNorm2d expects 4 axes"),
        (["explain", "batch", "--shape", "1,3"], "argument --shape: BatchNorm1d in training needs more than one value"),
        (["explain", "instance", "--shape", "2,3"], "argument --shape"),
        (
            ["explain", "group", "--shape", "2,6,4", "--groups", "4"],
            "argument --groups: expected a number of groups dividing the 6",
        ),
        (["explain", "group", "--shape", "2,6,4", "--groups", "0"], "argument --groups"),
        (["explain", "layer", "--shape", "2,3", "--groups", "2"], "argument --groups: only the group and qknorm"),
        (["explain", "layer", "--shape", "2,3", "--values", "1,2"], "argument --values: expected 6 values"),
        (["explain", "layer", "--shape", "2,3", "--values", "1,a"], "argument --values"),
        (["explain", "rms", "--shape", "2,3", "--last", "3"], "argument --last"),
        (["tour", "--bogus"], "unrecognized arguments"),
    ],
)
def test_bad_arguments_exit_2_naming_the_argument(capsys, argv, message):
    rc, _, err = run(capsys, *argv)
    assert rc == 2
    assert message in err


# ---------------------------------------------------------------------------------------------- routing


def test_lazy_commands_run_module_main_with_the_rest_of_argv(capsys, monkeypatch):
    seen = []
    fake = types.ModuleType("normscope_test_fake_cmd")
    fake.main = lambda argv: seen.append(argv) or 3
    monkeypatch.setitem(sys.modules, "normscope_test_fake_cmd", fake)
    monkeypatch.setitem(cli.COMMANDS, "fake", ("normscope_test_fake_cmd", "a test command"))
    rc, _, _ = run(capsys, "fake", "--size", "8", "-h")
    assert rc == 3 and seen == [["--size", "8", "-h"]]


def test_missing_lazy_module_gives_a_clear_message(capsys, monkeypatch):
    monkeypatch.setitem(cli.COMMANDS, "nothing", ("normscope._no_such_module", "missing"))
    rc, _, err = run(capsys, "nothing", "--x")
    assert rc == 1
    assert "normscope nothing" in err and "normscope._no_such_module" in err


def test_every_registered_command_is_listed_in_help(capsys):
    rc, out, _ = run(capsys, "--help")
    assert rc == 0
    for name in ["tour", "explain", *cli.COMMANDS]:
        assert re.search(rf"^\s+{name}\s", out, re.M), name


def test_python_dash_m_normscope_tour_subprocess():
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(
        [sys.executable, "-m", "normscope", "tour"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert "checks passed" in proc.stdout


# ---------------------------------------------------------------------------------------------- CI


def readme_commands() -> list[str]:
    """The shell lines inside the README's fenced code blocks."""
    lines, fence = [], None
    for line in (ROOT / "README.md").read_text().splitlines():
        if line.startswith("```"):
            fence = None if fence is not None else line[3:].strip()
        elif fence in ("bash", "sh", "shell") and line.strip():
            lines.append(line.strip())
    return lines


def test_ci_runs_the_readme_test_command_verbatim():
    tests = [line for line in readme_commands() if "pytest" in line and "pip install" in line]
    assert len(tests) == 1, tests  # exactly one set-up-and-test command
    script = (ROOT / ".ci" / "run").read_text()
    assert tests[0] in script.splitlines() or any(line.strip() == tests[0] for line in script.splitlines())
    assert "set -euo pipefail" in script
    assert os.access(ROOT / ".ci" / "run", os.X_OK)


def test_readme_has_exactly_two_setup_commands():
    setup = [line for line in readme_commands() if line.startswith(("pip install", "python3 -m pip install"))]
    assert len(setup) == 2, setup
    assert any(line.endswith("normscope tour") for line in setup)


@pytest.mark.smoke  # the whole benchmark script: CI runs it (-m smoke), the README command does not
def test_cpu_overhead_benchmark_smoke(tmp_path, capsys, monkeypatch):
    """The benchmark script runs and writes its JSON (timings themselves are not asserted)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("cpu_overhead", ROOT / "benchmarks" / "cpu_overhead.py")
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "cpu_overhead", bench)  # dataclasses look their module up
    spec.loader.exec_module(bench)
    out = tmp_path / "b.json"
    assert (
        bench.main(["--quick", "--cases", "LayerNorm:small,GroupNorm:small", "--rounds", "2", "--out", str(out)]) == 0
    )
    doc = json.loads(out.read_text())
    got = [(r["case"], r["mode"]) for r in doc["results"]]
    assert got == [(c, m) for c in ("LayerNorm:small", "GroupNorm:small") for m in ("fwd", "fwdbwd")]
    assert doc["machine"]["torch"] == torch.__version__ and doc["machine"]["torch_threads"] >= 1
    for r in doc["results"]:
        assert len(r["samples_us"]["torch"]) == len(r["samples_us"]["normscope"]) == 2
        assert r["ratio"] > 0
    with pytest.raises(SystemExit):
        bench.main(["--cases", "NoSuchNorm:small", "--out", str(out)])


@pytest.mark.parametrize("failing", [None, "pytest", "pip"])
def test_ci_script_runs_setup_then_tests_and_fails_when_they_fail(tmp_path, failing):
    """Run .ci/run against a stub python3 that logs its arguments: the install comes before
    pytest, and a failing pip or pytest makes the script fail."""
    stub = tmp_path / "python3"
    stub.write_text(
        "#!/usr/bin/env bash\n"
        f'echo "$*" >> "{tmp_path}/calls"\n'
        f'case "$*" in *"-m {failing or "NOTHING"}"*) exit 3 ;; esac\n'
        "exit 0\n"
    )
    stub.chmod(0o755)
    env = dict(os.environ, PATH=f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    proc = subprocess.run(["bash", str(ROOT / ".ci" / "run")], env=env, capture_output=True, text=True, timeout=60)
    calls = (tmp_path / "calls").read_text().splitlines()
    if failing is None:
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert calls[-2:] == ["-m pip install -c constraints.txt -e .[dev]", "-m pytest"]
    else:
        assert proc.returncode != 0
        assert "CI FAILED" in proc.stdout


ENV = {**os.environ, "PYTHONPATH": str(ROOT / "src")}


def _one_line_error(err: str, argument: str) -> str:
    lines = [ln for ln in err.strip().splitlines() if not ln.startswith(("usage:", " "))]
    assert "Traceback" not in err, err
    assert len(lines) == 1, err
    assert argument in lines[0], lines[0]
    return lines[0]


@pytest.fixture
def a_file(tmp_path) -> Path:
    f = tmp_path / "a-file"
    f.write_text("not a directory")
    return f


class TestHostile:
    """The command line under hostile use: every bad input exits 2 with one line naming the argument,
    no traceback, before any work; a missing optional package is one line naming the extra."""

    @pytest.mark.parametrize(
        "argv,argument",
        [
            (["draw", "group", "--shape", "300,300,300"], "--shape"),
            (["draw", "group", "--shape", "65,65"], "--shape"),
            (["draw", "group", "--shape", "0,6,4"], "--shape"),
            (["draw", "group", "--shape=-3,6,4"], "--shape"),
            (["draw", "group", "--shape", "3,-6,4"], "--shape"),
            (["draw", "group", "--groups", "0"], "--groups"),
            (["draw", "group", "--groups", "-2"], "--groups"),
            (["draw", "--layout", "bsd", "--mask", "5,-3"], "--mask"),
        ],
    )
    def test_draw_bad_sizes_exit_2_at_once(self, capsys, argv, argument):
        pytest.importorskip("matplotlib")
        t0 = time.monotonic()
        rc, _, err = run(capsys, *argv)
        assert rc == 2
        _one_line_error(err, argument)
        assert time.monotonic() - t0 < 10  # refused before drawing, not after minutes

    def test_draw_largest_allowed_picture_is_drawn(self, capsys, tmp_path):
        pytest.importorskip("matplotlib")
        from normscope.tools.viz.figures import MAX_ELEMENTS

        rc, out, err = run(
            capsys, "draw", "layer", "--shape", f"1,{MAX_ELEMENTS // 64},64", "-o", str(tmp_path / "a.png")
        )
        assert rc == 0, err
        assert (tmp_path / "a.png").read_bytes().startswith(b"\x89PNG")

    def test_draw_unwritable_outputs_exit_2(self, capsys, a_file):
        pytest.importorskip("matplotlib")
        rc, _, err = run(capsys, "draw", "group", "-o", str(a_file / "x.png"))
        assert rc == 2
        _one_line_error(err, "-o/--output")
        rc, _, err = run(capsys, "draw", "--all-dir", str(a_file / "pics"))
        assert rc == 2
        _one_line_error(err, "--all-dir")
        rc, _, err = run(capsys, "draw", "--all-dir", str(a_file))
        assert rc == 2
        _one_line_error(err, "--all-dir")
        assert a_file.read_text() == "not a directory"

    def test_tour_unwritable_pictures_exit_2_before_the_tour(self, capsys, a_file):
        rc, out, err = run(capsys, "tour", "--plain", "--pictures", str(a_file / "pics"))
        assert rc == 2 and out == ""
        _one_line_error(err, "--pictures")

    @pytest.mark.parametrize(
        "blocked,argv,extra",
        [
            ("matplotlib", ["draw", "group", "-o", "{tmp}/x.png"], "viz"),
            ("sklearn", ["lab", "batch-size", "--smoke", "--out", "{tmp}/lab"], "lab"),
        ],
    )
    def test_missing_optional_package_is_one_line_naming_the_extra(self, tmp_path, blocked, argv, extra):
        code = (
            f"import sys; sys.modules[{blocked!r}] = None\n"  # as if not installed
            "from normscope.cli import main\n"
            f"sys.exit(main({[a.format(tmp=tmp_path) for a in argv]!r}))\n"
        )
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=180)
        assert r.returncode == 1, r.stderr
        assert "Traceback" not in r.stderr, r.stderr
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and blocked in lines[0] and f"normscope[{extra}]" in lines[0], r.stderr

    @pytest.mark.parametrize("blocked", ["sklearn", "matplotlib"])
    def test_lab_without_its_extra_leaves_no_output_directory(self, tmp_path, blocked):
        code = (
            f"import sys; sys.modules[{blocked!r}] = None\n"  # as if not installed
            "from normscope.cli import main\n"
            "sys.exit(main(['lab', 'batch-size', '--smoke']))\n"
        )
        r = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=180, cwd=tmp_path
        )
        assert r.returncode == 1 and "normscope[lab]" in r.stderr, r.stderr
        assert list(tmp_path.iterdir()) == []  # no empty lab-out/ in the directory it ran in

    def test_numpy_is_a_core_dependency(self):
        # torch imports its numpy bridge at start-up and warns "Failed to initialize NumPy" on every command when
        # numpy is missing: the core install, not an extra, must bring it
        tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from Python 3.11")
        project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
        core = {re.split(r"[<>=!~\[ ]", d, maxsplit=1)[0].lower() for d in project["dependencies"]}
        assert {"torch", "numpy"} <= core, core
        extras = project["optional-dependencies"]
        lab = {re.split(r"[<>=!~\[ ]", d, maxsplit=1)[0].lower() for d in extras["lab"]}
        assert "rich" in lab  # the lab's progress display

    def test_readme_convert_block_runs_as_written(self):
        readme = (ROOT / "README.md").read_text()
        blocks = re.findall(r"```python\n(.*?)```", readme, re.S)
        (block,) = [b for b in blocks if "normscope.convert(model)" in b]
        namespace: dict = {}
        exec(compile(block, "README convert block", "exec"), namespace)  # noqa: S102 - our own README
        assert "report" in namespace
