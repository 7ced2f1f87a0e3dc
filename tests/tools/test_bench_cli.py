"""`normscope bench` as a new user meets it: the first line says what is measured and what cannot be
here, one ratio convention (normscope time / peer time) in the log and the JSON, the files go to the
directory the user names (default: the current directory) and the path is said on screen."""

import json
import re

import pytest
import torch

from normscope.tools import bench


@pytest.fixture
def tiny(monkeypatch):
    monkeypatch.setattr(bench.cases, "NS_QUICK", (256,))
    monkeypatch.setattr(bench.cases, "QUICK_BYTES", 64 << 10)


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_without_cuda_the_first_line_says_the_kernels_are_not_measured(tmp_path, tiny, no_cuda, capsys):
    assert bench.main(["--cases", "layer_norm", "--dtypes", "fp32", "--out", str(tmp_path)]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("no CUDA device: the Triton kernels are not measured; normscope runs its CPU paths")
    assert "PyTorch eager" in first


def test_ratio_is_normscope_time_over_peer_time_in_the_json_and_the_log(tmp_path, tiny, no_cuda, capsys):
    assert bench.main(["--cases", "layer_norm,rms_norm", "--dtypes", "fp32", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    report = json.loads((tmp_path / "bench-quick-cpu.json").read_text())
    assert report["ratio_rule"] == "normscope time / peer time (below 1: normscope is faster)"
    assert report["ratio_rule"] in out  # the table's header says it
    lines = [line for line in out.splitlines() if " | normscope " in line]
    assert len(lines) == len(report["results"]) == 4
    for row, line in zip(report["results"], lines):
        ns, eager = row["impls"]["normscope"], row["impls"]["torch"]
        assert "ratio" not in ns  # a ratio to itself says nothing
        assert eager["ratio"] == pytest.approx(ns["ms"] / eager["ms"], rel=1e-12)
        (printed,) = re.findall(r"ratio (\d+\.\d+)", line)
        assert float(printed) == pytest.approx(ns["ms"] / eager["ms"], abs=0.006)


def test_default_output_is_the_current_directory_and_said_on_screen(tmp_path, tiny, no_cuda, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert bench.main(["--cases", "rms_norm", "--dtypes", "fp32"]) == 0
    out = capsys.readouterr().out
    assert (tmp_path / "bench-quick-cpu.json").is_file()
    assert not (tmp_path / "benchmarks").exists()
    assert f"results: {tmp_path.resolve() / 'bench-quick-cpu.json'}" in out.splitlines()[1]


def test_out_names_a_directory_created_if_missing(tmp_path, tiny, no_cuda, capsys):
    target = tmp_path / "a" / "b"
    assert bench.main(["--cases", "rms_norm", "--dtypes", "fp32", "--out", str(target)]) == 0
    assert (target / "bench-quick-cpu.json").is_file()
    assert str(target / "bench-quick-cpu.json") in capsys.readouterr().out


def test_help_gives_measured_durations_and_no_stale_promise(capsys):
    with pytest.raises(SystemExit):
        bench.main(["--help"])
    text = capsys.readouterr().out
    assert "about a minute" not in text and "benchmarks/results" not in text
    assert "13-21 s" in text  # measured: see the report of the change that wrote it
    assert "normscope time / peer time (below 1: normscope is faster)" in text
    assert "default: the current directory" in text


class TestHostile:
    """Bad arguments exit 2 with one line naming the argument, before any measurement or file."""

    @pytest.mark.parametrize(
        ("args", "says"),
        [
            (["--device", "tpu"], "argument --device: expected cuda or cpu, got 'tpu'"),
            (["--device", "meta"], "argument --device: expected cuda or cpu, got 'meta'"),
            (["--device", "cuda"], "argument --device: 'cuda' asked for, but this torch sees no CUDA device"),
            (["--cases", ","], "expected at least one case"),
            (["--dtypes", ","], "expected at least one dtype"),
            (["--budget-s", "-5"], "argument --budget-s: expected a non-negative number of seconds, got '-5'"),
            (["--budget-s", "nan"], "argument --budget-s: expected a non-negative number of seconds, got 'nan'"),
        ],
    )
    def test_bad_argument(self, args, says, tmp_path, no_cuda, capsys):
        with pytest.raises(SystemExit) as e:
            bench.main(["--cases", "layer_norm", "--out", str(tmp_path), *args])
        assert e.value.code == 2
        captured = capsys.readouterr()
        assert says in captured.err and "Traceback" not in captured.err
        assert captured.out == "" and list(tmp_path.iterdir()) == []  # nothing measured, nothing written

    def test_out_that_cannot_be_a_directory(self, tmp_path, no_cuda, capsys):
        (tmp_path / "file").write_text("")
        with pytest.raises(SystemExit) as e:
            bench.main(["--cases", "layer_norm", "--out", str(tmp_path / "file" / "d")])
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert "argument --out: cannot create the directory" in err and "Not a directory" in err

    @pytest.mark.parametrize("text", ["{not json", '{"results": 3}', "[]"])
    @pytest.mark.parametrize("mode", ["--plot-only", "--resume"])
    def test_a_json_in_out_that_is_no_bench_report(self, text, mode, tmp_path, no_cuda, capsys):
        (tmp_path / "bench-quick-cpu.json").write_text(text)
        with pytest.raises(SystemExit) as e:
            bench.main([mode, "--cases", "layer_norm", "--out", str(tmp_path)])
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert "argument --out:" in err and "bench JSON" in err and "Traceback" not in err
        assert (tmp_path / "bench-quick-cpu.json").read_text() == text  # left as it was
