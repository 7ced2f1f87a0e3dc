"""The engine's modules depend on each other one way: no import cycle among the engine, the hot path,
the reference, the functional modules and the backends -- nor anywhere in the package (the layers, model
surgery, the registry, the integrations, the doctor, the tools).

The graph is read from the source with ``ast`` -- every ``import`` statement, at module level or
inside a function (a deferred import is still a dependency) -- so a cycle fails here even where
Python's import order happens to hide it. And each module imports first in a fresh interpreter.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ENGINE_PARTS, SRC, import_target
from conftest import import_graph_is_module as _is_module
from conftest import import_graph_module_name as _module_name
from conftest import module_imports as _imports

#: the engine's parts (normscope.engine's docstring), in their one-way order: each imports only those before it
#: the modules whose graph must have no cycle: the engine and everything between it and the user
CORE = (*ENGINE_PARTS, "hot", "reference", "scope", "_checks", "functional", "functional_modern", "backends", "modules")


def _in_core(name: str) -> bool:
    parts = name.split(".")
    return len(parts) >= 2 and parts[0] == "normscope" and parts[1] in CORE


def _graph(within=_in_core) -> dict[str, set[str]]:
    """Module -> the modules it imports, both ``within`` (default: the core; ``None``: every module)."""
    modules = {_module_name(p): p for p in SRC.rglob("*.py")}
    keep = within or (lambda name: True)
    graph = {}
    for name, path in modules.items():
        if keep(name):
            graph[name] = {m for m in _imports(path) if keep(m) and m in modules}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m) :] + [m]
            if m not in state:
                found = visit(m)
                if found:
                    return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state:
            found = visit(n)
            if found:
                return found
    return None


def test_the_graph_is_read():
    # the reader must see the edges it is meant to judge, or the cycle test proves nothing
    g = _graph()
    assert "normscope.functional_modern" in g["normscope.functional"]
    assert "normscope.engine" in g["normscope.hot"]
    assert "normscope.backends.rms" in g["normscope.backends.rows"]
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_no_import_cycle_among_the_engine_functional_and_backends():
    cycle = _cycle(_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_whole_packages_graph_is_read():
    # deferred imports (inside functions) across the package: the edges the cycles below were made of
    g = _graph(None)
    assert "normscope.modules" in g["normscope.registry"]  # inside get_norm's factories
    assert "normscope.tools.lab.report" in g["normscope.tools.lab"]  # inside run()
    assert "normscope.convert" in g["normscope.doctor._fix"]
    assert len(g) == len(list(SRC.rglob("*.py")))


def test_no_import_cycle_in_the_whole_package():
    """Every module under src/normscope, imports inside functions included: a layer module took model
    surgery's helpers (convert -> registry -> modules -> modules.frozen -> convert), the lab's report took
    its experiment list from the package that imports the report. What both sides need sits below both."""
    cycle = _cycle(_graph(None))
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_engine_parts_depend_one_way():
    g = _graph()
    for i, part in enumerate(ENGINE_PARTS):
        later = {f"normscope.{p}" for p in ENGINE_PARTS[i + 1 :]}
        bad = g[f"normscope.{part}"] & later
        assert not bad, f"normscope.{part} imports a later part: {bad}"
    assert {f"normscope.{p}" for p in ENGINE_PARTS[:-1]} <= g["normscope.engine"]


# ----------------------------------------------------------------------------------------------
# no module of the core reads another's private names

#: ``(module, "other._name")`` reads allowed, each with why
PRIVATE_ALLOWED: dict[tuple[str, str], str] = {}


def _private_reads(path: Path) -> set[str]:
    """``"module._name"`` for each private name of another module of the core that ``path`` reads: an
    attribute of a name bound to an imported module, or a ``from module import _name``."""
    me = _module_name(path)
    package = me if path.name == "__init__.py" else me.rsplit(".", 1)[0]
    bound: dict[str, str] = {}  # local name -> normscope module
    found = set()
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("normscope"):
                    bound[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            target = import_target(node, package)
            if not target.startswith("normscope"):
                continue
            for a in node.names:
                sub = f"{target}.{a.name}"
                if _is_module(sub):
                    bound[a.asname or a.name] = sub
                elif a.name.startswith("_") and not a.name.startswith("__") and target != me and _in_core(target):
                    found.add(f"{target}.{a.name}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound:
            attr = node.attr
            target = bound[node.value.id]
            if attr.startswith("_") and not attr.startswith("__") and target != me and _in_core(target):
                found.add(f"{target}.{attr}")
    return found


def test_the_private_read_finder_sees_reads(tmp_path):
    # the finder must see both kinds of read, or the test below proves nothing
    pkg = SRC / "backends"
    reads = _private_reads(pkg / "aten.py")
    assert all(r.startswith("normscope.") for r in reads)
    code = "from .. import engine\nfrom ..hot import _sig\nx = engine._BACKENDS\n"
    probe = pkg / "_probe_private_reads.py"
    try:
        probe.write_text(code)
        assert _private_reads(probe) == {"normscope.engine._BACKENDS", "normscope.hot._sig"}
    finally:
        probe.unlink()


def test_no_core_module_reads_another_modules_private_names():
    bad = []
    for path in sorted(SRC.rglob("*.py")):
        name = _module_name(path)
        if not _in_core(name):
            continue
        for read in sorted(_private_reads(path)):
            if (name, read) not in PRIVATE_ALLOWED:
                bad.append(f"{name} reads {read}")
    assert not bad, "private names read across modules (give them a public name in the package):\n" + "\n".join(bad)


@pytest.mark.parametrize(
    "module",
    ["normscope.functional_modern", "normscope.functional", "normscope.engine", "normscope.hot", "normscope.backends"]
    + [f"normscope.{p}" for p in ENGINE_PARTS[:-1]],
)
def test_each_module_imports_first_in_a_fresh_interpreter(module):
    code = f"import {module}, sys; assert {module!r} in sys.modules"
    env_path = str(SRC.parent)
    out = subprocess.run(
        [sys.executable, "-c", f"import sys; sys.path.insert(0, {env_path!r}); {code}"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
