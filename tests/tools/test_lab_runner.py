"""The lab's runner under hostile use: Ctrl-C during the multi-process experiment, damaged cache
files, concurrent writers, logs that are not terminals, and bad command-line arguments."""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from normscope.tools import lab
from normscope.tools.lab.core import Context, Progress, write_json

ENV = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src")}


# -- write_json ---------------------------------------------------------------------------------------


def test_concurrent_writers_of_one_file_do_not_collide(tmp_path):
    path = tmp_path / "r.json"
    errors: list[BaseException] = []

    def writer(i: int) -> None:
        try:
            for j in range(40):
                write_json(path, {"writer": i, "j": j, "pad": "x" * 5000})
        except BaseException as e:  # the shared temp name of old: FileNotFoundError on rename
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:3]
    assert json.loads(path.read_text())["j"] == 39
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]  # no temp file left behind


# -- the cache -------------------------------------------------------------------------------------------

DAMAGED = {
    "not utf-8": b"\xff\xfe\x00",
    "truncated": b'{"key": {"a": 1}, "res',
    "a list": b"[]",
    "result not an object": b'{"key": {"a": 1}, "result": 5}',
    "no result": b'{"key": {"a": 1}}',
    "another key": b'{"key": {"a": 2}, "result": {"v": 99}}',
    "empty": b"",
}


@pytest.mark.parametrize("what", sorted(DAMAGED))
def test_a_damaged_cache_file_is_named_and_recomputed(tmp_path, capsys, what):
    ctx = Context("demo", tmp_path, "smoke", [0], progress=Progress("demo", enabled=False))
    calls = []
    assert ctx.cached({"a": 1}, lambda: calls.append(1) or {"v": 1}) == {"v": 1}
    (path,) = (tmp_path / "runs").iterdir()
    path.write_bytes(DAMAGED[what])
    capsys.readouterr()
    again = Context("demo", tmp_path, "smoke", [0], progress=Progress("demo", enabled=False))
    assert again.cached({"a": 1}, lambda: calls.append(1) or {"v": 1}) == {"v": 1}
    assert len(calls) == 2 and again.n_computed == 1 and again.n_cached == 0
    err = capsys.readouterr().err
    assert str(path) in err and "recomputing" in err
    # and the recomputed file serves the next run
    third = Context("demo", tmp_path, "smoke", [0], progress=Progress("demo", enabled=False))
    assert third.cached({"a": 1}, lambda: calls.append(1) or {"v": 1}) == {"v": 1}
    assert len(calls) == 2 and third.n_cached == 1


# -- progress --------------------------------------------------------------------------------------------


def test_progress_in_a_log_is_plain_lines(monkeypatch):
    monkeypatch.delenv("NORMSCOPE_LAB_QUIET", raising=False)
    log = io.StringIO()
    p = Progress("batch-size", stream=log)
    for step in range(0, 101):
        p("BN b=2 s=0", step, 100, f"loss {1 / (step + 1):.3f}")
    p("GN b=2 s=0", 0, 10)
    p("GN b=2 s=0", 10, 10, "done")
    p.close()
    text = log.getvalue()
    assert "\r" not in text and not set(text) & set("█░━╸╺▏▕")
    lines = text.splitlines()
    assert lines[0] == "[batch-size] BN b=2 s=0 0/100 loss 1.000"
    assert "[batch-size] BN b=2 s=0 100/100 loss 0.010" in lines
    assert lines[-1] == "[batch-size] GN b=2 s=0 10/10 done"
    assert len(lines) <= 6  # not one line per step


def test_progress_on_a_terminal_uses_rich_bars(monkeypatch):
    pytest.importorskip("rich")
    monkeypatch.delenv("NORMSCOPE_LAB_QUIET", raising=False)
    out = io.StringIO()
    p = Progress("sync", stream=out)
    p._terminal = True  # what rich decides for a tty
    p("4 gloo ranks, seed 0", 0, 1, "batch")
    assert p._live is not None
    p("4 gloo ranks, seed 0", 1, 1, "done")
    p.close()
    assert p._live is None and "4 gloo ranks, seed 0" in out.getvalue()


def test_quiet_progress_writes_nothing(monkeypatch):
    monkeypatch.setenv("NORMSCOPE_LAB_QUIET", "1")
    log = io.StringIO()
    Progress("x", stream=log)("a", 1, 1)
    assert log.getvalue() == ""


# -- the command line ----------------------------------------------------------------------------------------


def _usage_error(argv, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        lab.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "Traceback" not in "\n".join(err)
    return err[-1]


def test_huge_seeds_is_a_usage_error(capsys, tmp_path):
    msg = _usage_error(["batch-size", "--smoke", "--seeds", "99999999999999999999", "--out", str(tmp_path)], capsys)
    assert "--seeds" in msg and "99999999999999999999" in msg
    with pytest.raises(ValueError, match="seeds"):
        lab.run(["batch-size"], mode="smoke", out=tmp_path, seeds=10**20)


def test_out_that_is_a_file_or_under_a_file_is_a_usage_error(capsys, tmp_path):
    f = tmp_path / "file.txt"
    f.write_text("x")
    for out in (f, f / "sub"):
        msg = _usage_error(["batch-size", "--smoke", "--out", str(out)], capsys)
        assert "--out" in msg and str(out) in msg
    assert f.read_text() == "x"


def test_list_into_a_closed_pipe_has_no_traceback():
    r = subprocess.run(
        f"{sys.executable} -m normscope.tools.lab --list | head -1",
        shell=True,
        capture_output=True,
        text=True,
        env=ENV,
        timeout=120,
    )
    assert r.stdout.count("\n") == 1
    assert "Traceback" not in r.stderr and "BrokenPipe" not in r.stderr, r.stderr


# -- Ctrl-C during the multi-process experiment --------------------------------------------------------------

_SCRIPT = textwrap.dedent(
    """
    import json, os, signal, sys, time
    # Ctrl-C as in a terminal, whoever started the test run: a process that starts with SIGINT ignored
    # (a background job of a non-interactive shell is started so, and its children inherit it) gets no
    # KeyboardInterrupt from the test's SIGINT
    signal.signal(signal.SIGINT, signal.default_int_handler)
    from pathlib import Path
    from normscope.tools.lab import exp_sync
    from normscope.tools.lab.core import Context, Progress

    def fake_worker(rank, port, cfg, variants, seed, out):  # a rank that has finished and lingers
        if rank == 0 and os.environ.get("FINISHED") == "1":
            Path(out).write_text(json.dumps({"batch": {"err": 12.5, "source": "test"}}))
        print(f"rank {os.getpid()}", flush=True)
        time.sleep(300)

    exp_sync._worker = fake_worker
    ctx = Context("sync", Path(sys.argv[1]), "smoke", [0], progress=Progress("sync", enabled=False))
    try:
        ctx.cached({"seed": 0}, lambda: exp_sync._launch({}, ["batch"], 0))
    except KeyboardInterrupt:
        print(f"interrupted computed={ctx.n_computed}", flush=True)
    """
)


def _dead(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True
    return "State:\tZ" in state  # a zombie has exited; only its parent's bookkeeping is left


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc to see whether the ranks are gone")
@pytest.mark.parametrize("finished", [False, True])
def test_sigint_stops_the_ranks_and_keeps_a_finished_run(tmp_path, finished):
    script = tmp_path / "launch.py"
    script.write_text(_SCRIPT)
    env = {**ENV, "FINISHED": "1" if finished else "0"}
    proc = subprocess.Popen(
        [sys.executable, str(script), str(tmp_path / "out")], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        pids: list[int] = []  # four ranks print to one pipe: two lines can interleave ("rank 1rank 2")
        while len(pids) < 4:
            line = proc.stdout.readline()
            assert line, f"the ranks' output ended after {len(pids)} pids"
            pids += [int(p) for p in re.findall(r"rank (\d+)", line)]
        time.sleep(0.5)  # rank 0 has written its file before printing
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=60)
        elapsed = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert elapsed < 30, f"the main process lived {elapsed:.0f} s after SIGINT"
    assert proc.returncode == 0 and f"interrupted computed={int(finished)}" in rest
    assert all(_dead(p) for p in pids), "rank processes still running after SIGINT"
    runs = list((tmp_path / "out" / "runs").glob("*.json")) if (tmp_path / "out" / "runs").exists() else []
    if finished:
        assert len(runs) == 1 and json.loads(runs[0].read_text())["result"]["batch"]["err"] == 12.5
    else:
        assert runs == []
