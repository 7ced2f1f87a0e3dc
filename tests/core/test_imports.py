"""The engine's modules depend on each other one way: no import cycle among the engine, the hot path,
the reference, the functional modules and the backends.

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

import normscope

SRC = Path(normscope.__file__).resolve().parent
#: the modules whose graph must have no cycle: the engine and everything between it and the user
CORE = ("engine", "hot", "reference", "scope", "_checks", "functional", "functional_modern", "backends")


def _module_name(path: Path) -> str:
    rel = path.relative_to(SRC.parent).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def _in_core(name: str) -> bool:
    parts = name.split(".")
    return len(parts) >= 2 and parts[0] == "normscope" and parts[1] in CORE


def _is_module(name: str) -> bool:
    path = SRC.parent / Path(*name.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def _imports(path: Path) -> set[str]:
    """The normscope modules ``path`` imports (``from . import x`` as the module ``x`` when it is one)."""
    me = _module_name(path)
    package = me if path.name == "__init__.py" else me.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            # `from . import rms`: the submodule itself; a name defined in the package: the package
            subs = [f"{target}.{a.name}" for a in node.names]
            real = [m for m in subs if _is_module(m)]
            found.update(real)
            if len(real) < len(subs):
                found.add(target)
    return {m for m in found if m.startswith("normscope")} - {me}


def _graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in SRC.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        if _in_core(name):
            graph[name] = {m for m in _imports(path) if _in_core(m) and m in modules}
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
    assert "normscope.backends.rms" in g["normscope.backends.aten"]
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_no_import_cycle_among_the_engine_functional_and_backends():
    cycle = _cycle(_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


@pytest.mark.parametrize("module", ["normscope.functional_modern", "normscope.functional", "normscope.engine"])
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
