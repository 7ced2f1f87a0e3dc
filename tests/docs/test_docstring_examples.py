"""Every docstring example in ``src/normscope`` (the ``>>>`` lines under ``Example::``) runs, with doctest.

Each docstring with examples is one test, run in a temporary directory (examples write pictures and
lab output) with ``torch``, ``nn`` and ``normscope`` predefined, as a reader of the API reference would
have them. An example that fails today is listed in :data:`KNOWN_FAILING` with the reason: it shows up
as an expected failure in every run (never a silent skip), and as an error once it passes, so the
list cannot go stale.
"""

from __future__ import annotations

import doctest
import importlib
import io
import pkgutil

import pytest
import torch

import normscope

#: docstring -> why its example fails as written. These live in files being rewritten elsewhere;
#: fix the docstring, then delete its line here.
KNOWN_FAILING: dict[str, str] = {}

#: docstrings whose example is not run here, with the reason (shown as a skip)
SKIP = {}


def _modules() -> list[str]:
    names = ["normscope"]
    for info in pkgutil.walk_packages(normscope.__path__, "normscope."):
        if info.name.rsplit(".", 1)[-1] != "__main__":  # importing one runs the command
            names.append(info.name)
    return names


def _doctests() -> list:
    finder = doctest.DocTestFinder()
    found, missing = [], []
    for name in _modules():
        try:
            module = importlib.import_module(name)
        except ImportError as e:  # an optional dependency that is not installed
            missing.append(pytest.param(None, id=name, marks=pytest.mark.skip(reason=f"cannot import: {e}")))
            continue
        for test in finder.find(module, name, extraglobs={"torch": torch, "nn": torch.nn, "normscope": normscope}):
            # a module also finds the docstrings of the names it imports: collect each in its own file only
            if test.examples and test.filename == module.__file__:
                found.append(pytest.param(test, id=test.name))
    return found + missing


DOCTESTS = _doctests()


def test_examples_were_found():
    names = {p.id for p in DOCTESTS}
    assert len(names) >= 20, sorted(names)  # a broken finder would otherwise pass by running nothing
    assert "normscope.functional.normalize" in names
    assert set(KNOWN_FAILING) <= names, set(KNOWN_FAILING) - names


@pytest.mark.parametrize("test", DOCTESTS)
def test_docstring_example(test, tmp_path, monkeypatch):
    if test.name in SKIP:
        pytest.skip(SKIP[test.name])
    monkeypatch.chdir(tmp_path)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    report = io.StringIO()
    result = runner.run(test, out=report.write, clear_globs=True)
    if test.name in KNOWN_FAILING:
        if result.failed:
            pytest.xfail(f"known failing example: {KNOWN_FAILING[test.name]}")
        pytest.fail(f"{test.name}'s example passes now: remove it from KNOWN_FAILING")
    assert result.failed == 0, report.getvalue()
