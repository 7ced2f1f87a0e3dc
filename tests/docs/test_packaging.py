"""The built wheel carries the license its metadata declares, and the data files the package reads."""

import pathlib
import shutil
import subprocess
import sys
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_license_file_is_bsd3_in_the_repository():
    text = (ROOT / "LICENSE").read_text()
    assert text.startswith("BSD 3-Clause License")
    assert "the normscope authors" in text


def test_wheel_carries_the_license_and_an_spdx_expression(tmp_path):
    setuptools = pytest.importorskip("setuptools")
    if int(setuptools.__version__.split(".")[0]) < 77:
        pytest.skip(f"setuptools {setuptools.__version__} here; pyproject needs >= 77 (PEP 639 license fields)")
    # a copy of what the build reads, so that setuptools' build/ and egg-info land in tmp_path, not the checkout;
    # no build isolation: the installed setuptools builds it, so the test needs no network
    tree = tmp_path / "tree"
    shutil.copytree(ROOT / "src", tree / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, tree / name)
    r = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "whl"),
         str(tree)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    assert "deprecated" not in (r.stdout + r.stderr).lower(), r.stdout + r.stderr
    (wheel,) = (tmp_path / "whl").glob("normscope-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        (license_path,) = [n for n in names if n.endswith(".dist-info/licenses/LICENSE")]
        assert z.read(license_path).decode() == (ROOT / "LICENSE").read_text()
        (metadata,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        meta = z.read(metadata).decode()
    assert "License-Expression: BSD-3-Clause" in meta
    assert "Requires-Dist: numpy" in meta
    # the explorer serves its page from the package (importlib.resources), not from the checkout
    for page in ("index.html", "app.js", "style.css"):
        assert f"normscope/tools/explorer/static/{page}" in names
