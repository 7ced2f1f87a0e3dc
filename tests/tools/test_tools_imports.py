"""The applications (normscope/tools/) use the library as a user would: no private name of the core; and the
core (the engine, the layers, ``normscope doctor``, the command line) uses no private name of the tools.

A private name is one with a leading underscore, as a module (``normscope._checks``) or as a name taken from a
module of the other side (``from normscope.engine import _fast``, ``from .. import _checks``) or read off one
(``normscope.kernels.rows._block``, ``nf._flat``). The source is read with ``ast``, imports inside functions
included, so a deferred import is judged too. Each side's own private names are its own to use.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from conftest import SRC, import_target
from conftest import import_graph_module_name as _module_name

TOOLS = SRC / "tools"


def _private(dotted: str) -> bool:
    return any(p.startswith("_") and not (p.startswith("__") and p.endswith("__")) for p in dotted.split("."))


def _core(dotted: str) -> bool:
    parts = dotted.split(".")
    return parts[0] == "normscope" and parts[1:2] != ["tools"]


def _tools(dotted: str) -> bool:
    return dotted.split(".")[:2] == ["normscope", "tools"]


def violations(source: str, module: str, is_package: bool = False, other=_core) -> list[str]:
    """Each private name of the other side (``other``: the core for a tool, the tools for the core) that
    ``source`` (the module ``module``) imports or reads."""
    package = module if is_package else module.rpartition(".")[0]
    found = []
    bound: dict[str, str] = {}  # local name -> the core module it stands for
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if other(a.name):
                    if _private(a.name):
                        found.append(f"line {node.lineno}: import {a.name}")
                    if a.asname:
                        bound[a.asname] = a.name
                    else:  # `import normscope.engine` binds `normscope`
                        bound[a.name.split(".")[0]] = a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            target = import_target(node, package)
            if not other(target):
                continue
            for a in node.names:
                name = f"{target}.{a.name}"
                if _private(name):
                    found.append(f"line {node.lineno}: from {target} import {a.name}")
                bound[a.asname or a.name] = name
    inner_ids = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and id(node) not in inner_ids:
            chain = []
            inner = node
            while isinstance(inner, ast.Attribute):
                chain.append(inner.attr)
                inner = inner.value
            if isinstance(inner, ast.Name) and inner.id in bound:
                dotted = ".".join([bound[inner.id], *reversed(chain)])
                # judged once, at the outermost attribute of a chain
                if _private(dotted) and not _private(bound[inner.id]):
                    found.append(f"line {node.lineno}: {dotted}")
    return found


def _tool_files() -> list[Path]:
    return sorted(TOOLS.rglob("*.py"))


@pytest.mark.parametrize(
    "source,module",
    [
        ("from normscope.engine import _fast", "normscope.tools.x"),
        ("from normscope import _checks", "normscope.tools.x"),
        ("from ... import _checks", "normscope.tools.viz.scopes"),
        ("from ...kernels.rows import _block", "normscope.tools.viz.scopes"),
        ("from .._draw import Figure", "normscope.tools.viz.scopes"),  # the tools' own: allowed, see below
        ("import normscope._checks", "normscope.tools.x"),
        ("import normscope\nnormscope.kernels.rows._block", "normscope.tools.x"),
        ("from normscope import functional as nf\nnf._flat(1)", "normscope.tools.x"),
        ("def f():\n    from ..engine import _fast", "normscope.tools.x"),
    ],
)
def test_the_reader_finds_each_kind_of_private_use(source, module):
    found = violations(source, module)
    if "_draw" in source:
        assert found == []  # normscope.tools._draw would be the tools' own
    else:
        assert len(found) == 1, found


def test_the_reader_passes_public_uses():
    source = (
        "import normscope\nfrom normscope import functional as nf\nfrom ... import engine\n"
        "normscope.__version__\nnf.normalize\nengine.norm\nfrom .._draw import Figure\n"
    )
    assert violations(source, "normscope.tools.viz.scopes") == []


def test_the_tools_are_read():
    files = _tool_files()
    names = {_module_name(p) for p in files}
    assert {"normscope.tools.tour", "normscope.tools.bench.cases", "normscope.tools.lab.norms"} <= names


@pytest.mark.parametrize("path", _tool_files(), ids=lambda p: str(p.relative_to(TOOLS)))
def test_the_tools_use_no_private_name_of_the_core(path):
    found = violations(path.read_text(), _module_name(path), is_package=path.name == "__init__.py")
    assert not found, f"{path.relative_to(SRC.parent)} uses private names of the core: {found}"


# ---------------------------------------------------------------------------------------------
# the other way: the core uses no private name of the tools


def _core_files() -> list[Path]:
    return sorted(p for p in SRC.rglob("*.py") if TOOLS not in p.parents)


@pytest.mark.parametrize(
    "source,module",
    [
        ("from .tools._draw import Figure", "normscope.cli"),
        ("from ..tools import _draw", "normscope.doctor.cli"),
        ("import normscope.tools._draw", "normscope.x"),
        ("from .tools import named\nnamed._TABLE", "normscope.cli"),
        ("def f():\n    from ..tools.lab import _quick", "normscope.doctor.cli"),
    ],
)
def test_the_reader_finds_each_private_use_of_the_tools(source, module):
    assert len(violations(source, module, other=_tools)) == 1


def test_the_reader_passes_the_cores_public_uses_of_the_tools():
    source = "from .tools import tour\nfrom .tools.named import spellings\ntour.main\nfrom ._checks import x\n"
    assert violations(source, "normscope.cli", other=_tools) == []


def test_the_core_is_read():
    names = {_module_name(p) for p in _core_files()}
    assert {"normscope.cli", "normscope.doctor.cli", "normscope.engine", "normscope.bench"} <= names
    assert not any(n.startswith("normscope.tools") for n in names)


@pytest.mark.parametrize("path", _core_files(), ids=lambda p: str(p.relative_to(SRC)))
def test_the_core_uses_no_private_name_of_the_tools(path):
    found = violations(path.read_text(), _module_name(path), is_package=path.name == "__init__.py", other=_tools)
    assert not found, f"{path.relative_to(SRC.parent)} uses private names of the tools: {found}"


# ---------------------------------------------------------------------------------------------
# the short public names (normscope.bench, ...) are the tools themselves

SHORT = ("bench", "lab", "viz", "explorer", "tour", "explain", "named")


@pytest.mark.parametrize("name", SHORT)
def test_each_short_name_gives_the_tools_objects(name):
    import importlib

    short = importlib.import_module(f"normscope.{name}")
    real = importlib.import_module(f"normscope.tools.{name}")
    assert short.__all__ == real.__all__
    for attr in real.__all__:
        assert getattr(short, attr) is getattr(real, attr), attr
    with pytest.raises(AttributeError):
        short.no_such_name  # noqa: B018


@pytest.mark.parametrize("name", ["bench", "lab", "viz", "explorer"])
def test_python_dash_m_on_a_short_name_runs_the_tool(name, monkeypatch, capsys):
    import runpy
    import sys

    monkeypatch.setattr(sys, "argv", [f"normscope.{name}", "--help"])
    with pytest.raises(SystemExit) as done:
        runpy.run_module(f"normscope.{name}", run_name="__main__")
    assert done.value.code == 0
    assert "usage:" in capsys.readouterr().out
