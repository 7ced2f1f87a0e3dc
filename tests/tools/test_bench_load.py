"""`normscope bench --threads N` and the load report: a loaded machine's figures are meaningless, so
the run says what the load was, warns when other work competes for the cores, and records both."""

import json

import pytest
import torch

from normscope.tools import bench


@pytest.fixture
def tiny(monkeypatch):
    monkeypatch.setattr(bench.cases, "NS_QUICK", (256,))
    monkeypatch.setattr(bench.cases, "QUICK_BYTES", 64 << 10)


def _run(tmp_path, *extra):
    argv = ["--quick", "--device", "cpu", "--cases", "rms_norm", "--dtypes", "fp32", "--out", str(tmp_path), *extra]
    assert bench.main(argv) == 0
    return json.loads((tmp_path / "bench-quick-cpu.json").read_text())


def test_threads_sets_torch_threads_for_the_run_and_restores_them(tmp_path, tiny, monkeypatch):
    before = torch.get_num_threads()
    seen = []
    real_run = bench.run

    def spy(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return real_run(*args, **kwargs)

    monkeypatch.setattr(bench, "run", spy)
    report = _run(tmp_path, "--threads", "1")
    assert seen == [1]
    assert report["load"]["threads"] == 1
    assert torch.get_num_threads() == before


def test_a_loaded_machine_is_reported_and_warned_about(tmp_path, tiny, monkeypatch, capsys):
    monkeypatch.setattr(bench.os, "getloadavg", lambda: (6.0, 5.5, 3.25))
    monkeypatch.setattr(bench.os, "cpu_count", lambda: 2)
    report = _run(tmp_path, "--threads", "1")
    out = capsys.readouterr().out
    assert "load average 6 / 5.5 / 3.25 (1 / 5 / 15 min) on 2 CPUs; 1 torch threads" in out
    assert "WARNING: the machine is loaded" in out
    assert report["load"] == {"load_average": [6.0, 5.5, 3.25], "cpus": 2, "threads": 1, "loaded": True}


def test_an_idle_machine_gets_no_warning(tmp_path, tiny, monkeypatch, capsys):
    monkeypatch.setattr(bench.os, "getloadavg", lambda: (0.2, 0.1, 0.0))
    monkeypatch.setattr(bench.os, "cpu_count", lambda: 2)
    report = _run(tmp_path, "--threads", "1")
    out = capsys.readouterr().out
    assert "load average 0.2 / 0.1 / 0 " in out and "WARNING" not in out
    assert report["load"]["loaded"] is False


def test_load_unknown_where_the_system_cannot_say(monkeypatch):
    def no_load():
        raise OSError("not available")

    monkeypatch.setattr(bench.os, "getloadavg", no_load)
    assert bench.load_status(2)["load_average"] is None and bench.load_status(2)["loaded"] is False


@pytest.mark.parametrize("bad", ["0", "-2", "two"])
def test_threads_must_be_a_positive_integer(bad, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--threads", bad])
    assert exit_info.value.code == 2
    assert f"argument --threads: expected a positive number of threads, got '{bad}'" in capsys.readouterr().err
