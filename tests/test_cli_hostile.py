"""The command line under hostile use: every bad input exits 2 with one line naming the argument,
no traceback, before any work; a missing optional package is one line naming the extra."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import run_cli as run

ROOT = Path(__file__).resolve().parents[1]
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
def test_draw_bad_sizes_exit_2_at_once(capsys, argv, argument):
    pytest.importorskip("matplotlib")
    t0 = time.monotonic()
    rc, _, err = run(capsys, *argv)
    assert rc == 2
    _one_line_error(err, argument)
    assert time.monotonic() - t0 < 10  # refused before drawing, not after minutes


def test_draw_largest_allowed_picture_is_drawn(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    from normscope.tools.viz.figures import MAX_ELEMENTS

    rc, out, err = run(capsys, "draw", "layer", "--shape", f"1,{MAX_ELEMENTS // 64},64", "-o", str(tmp_path / "a.png"))
    assert rc == 0, err
    assert (tmp_path / "a.png").read_bytes().startswith(b"\x89PNG")


def test_draw_unwritable_outputs_exit_2(capsys, a_file):
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


def test_tour_unwritable_pictures_exit_2_before_the_tour(capsys, a_file):
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
def test_missing_optional_package_is_one_line_naming_the_extra(tmp_path, blocked, argv, extra):
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
def test_lab_without_its_extra_leaves_no_output_directory(tmp_path, blocked):
    code = (
        f"import sys; sys.modules[{blocked!r}] = None\n"  # as if not installed
        "from normscope.cli import main\n"
        "sys.exit(main(['lab', 'batch-size', '--smoke']))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=180, cwd=tmp_path)
    assert r.returncode == 1 and "normscope[lab]" in r.stderr, r.stderr
    assert list(tmp_path.iterdir()) == []  # no empty lab-out/ in the directory it ran in


def test_numpy_is_a_core_dependency():
    # torch imports its numpy bridge at start-up and warns "Failed to initialize NumPy" on every command when
    # numpy is missing: the core install, not an extra, must bring it
    tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from Python 3.11")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = {re.split(r"[<>=!~\[ ]", d, maxsplit=1)[0].lower() for d in project["dependencies"]}
    assert {"torch", "numpy"} <= core, core
    extras = project["optional-dependencies"]
    lab = {re.split(r"[<>=!~\[ ]", d, maxsplit=1)[0].lower() for d in extras["lab"]}
    assert "rich" in lab  # the lab's progress display


def test_readme_convert_block_runs_as_written():
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, re.S)
    (block,) = [b for b in blocks if "normscope.convert(model)" in b]
    namespace: dict = {}
    exec(compile(block, "README convert block", "exec"), namespace)  # noqa: S102 - our own README
    assert "report" in namespace
