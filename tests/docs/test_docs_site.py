"""The documentation site's own rules (docs/conf.py): what makes the strict build fail, and the
docstring preprocessing that keeps PyTorch-style text valid reStructuredText.

The full build runs in CI (``.ci/run``); here a two-page project exercises the same extension in a
couple of seconds.
"""

from __future__ import annotations

import ast
import base64
import importlib.util
import re
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("sphinx", reason="the docs extra is not installed (pip install -e '.[docs]')")
pytest.importorskip("myst_parser", reason="the docs extra is not installed (pip install -e '.[docs]')")

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def conf():
    spec = importlib.util.spec_from_file_location("normscope_docs_conf", ROOT / "docs" / "conf.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_stars_of_shapes_and_globs_are_escaped_but_not_markup_or_code(conf):
    lines = [
        "Input: (N, C, *). Output: same shape; (*, D) and (N, *, C) too.",
        "* ``mask``: a list item's star is markup",
        "the *fp32 variants and ``simplenorm*``",
        "the *concatenation* of every rank's batch",
        "Example::",
        "",
        "    y = a * b",
        "back to text: (N, C, *)",
    ]
    conf._escape_stars(None, "function", "f", None, {}, lines)
    assert lines == [
        "Input: (N, C, \\*). Output: same shape; (\\*, D) and (N, \\*, C) too.",
        "* ``mask``: a list item's star is markup",
        "the \\*fp32 variants and ``simplenorm*``",
        "the *concatenation* of every rank's batch",
        "Example::",
        "",
        "    y = a * b",
        "back to text: (N, C, \\*)",
    ]


def _node(target, module=None):
    return {"refdomain": "py", "reftarget": target, "py:module": module, "py:class": None}


def test_a_reference_to_something_real_but_unlisted_becomes_text_and_a_missing_one_still_warns(conf):
    contnode = object()
    real = _node("normscope.tools.bench.cases")  # a real submodule with no page of its own
    assert conf._unlinked_but_real(None, None, real, contnode) is contnode
    relative = _node("allowed_hosts", module="normscope.tools.explorer")  # defined in normscope.tools.explorer.server
    assert conf._unlinked_but_real(None, None, relative, contnode) is contnode
    assert conf._unlinked_but_real(None, None, _node("normscope.no_such_name"), contnode) is None
    assert conf._unlinked_but_real(None, None, _node("no_such_name", module="normscope"), contnode) is None


def _build(tmp_path: Path, index: str, module_source: str) -> tuple[int, str]:
    """Build a one-page site with docs/conf.py's extension, strict; returns (status, warnings)."""
    from io import StringIO

    from sphinx.application import Sphinx

    src = tmp_path / "src"
    src.mkdir()
    (src / "fake_public.py").write_text(textwrap.dedent(module_source))
    (src / "conf.py").write_text(
        "import importlib.util, sys\n"
        f"sys.path.insert(0, {str(src)!r})\n"
        f"spec = importlib.util.spec_from_file_location('c', {str(ROOT / 'docs' / 'conf.py')!r})\n"
        "c = importlib.util.module_from_spec(spec); spec.loader.exec_module(c)\n"
        "extensions = ['sphinx.ext.autodoc', 'sphinx.ext.napoleon']\n"
        "nitpicky = True\n"
        "setup = c.setup\n"
        "html_math_renderer = 'mathtext'\n"
    )
    (src / "index.rst").write_text(textwrap.dedent(index))
    warnings = StringIO()
    sys.modules.pop("fake_public", None)
    app = Sphinx(
        str(src), str(src), str(tmp_path / "out"), str(tmp_path / "doctrees"), "html",
        status=None, warning=warnings, warningiserror=False, keep_going=True,
    )  # fmt: skip
    app.build()
    return app.statuscode, warnings.getvalue()


def test_a_public_name_without_a_docstring_fails_the_build(tmp_path, conf):
    source = '''
        """A module."""
        __all__ = ["documented", "bare"]

        def documented():
            """Has one."""

        def bare():
            pass
    '''
    _, warnings = _build(tmp_path, "Title\n=====\n\n.. normscope-api:: fake_public\n", source)
    assert "fake_public.bare is public (in __all__) but has no docstring" in warnings
    assert "documented" not in warnings


def test_a_reference_to_nothing_fails_the_build(tmp_path, conf):
    source = '''
        """A module."""
        __all__ = ["f"]

        def f():
            """See :func:`normscope.functional.layer_norm` and :func:`normscope.functional.no_such_thing`."""
    '''
    _, warnings = _build(tmp_path, "Title\n=====\n\n.. normscope-api:: fake_public\n", source)
    assert "normscope.functional.no_such_thing" in warnings
    assert "normscope.functional.layer_norm" not in warnings  # real: shown as text, no warning


def test_a_constants_sentence_with_a_colon_is_not_read_as_its_type(conf):
    # napoleon's output for "#: The automatic order: the first backend that takes a call runs it."
    lines = ["the first backend that takes a call runs it.", "", ":type: The automatic order"]
    conf._no_inline_type(None, "data", "AUTOMATIC_ORDER", None, {}, lines)
    assert lines == ["The automatic order: the first backend that takes a call runs it.", ""]
    typed = ["Whether Triton is importable.", "", ":type: bool"]  # a real type stays
    conf._no_inline_type(None, "data", "TRITON", None, {}, typed)
    assert typed == ["Whether Triton is importable.", "", ":type: bool"]


def test_formulas_are_rendered_at_build_time_into_embedded_images(tmp_path, conf):
    source = r'''
        """A module."""
        __all__ = ["f"]

        def f():
            r"""Normalize.

            .. math:: y = \frac{x - \mathrm{E}[x]}{\sqrt{\mathrm{Var}[x] + \epsilon}} \gamma + \beta

            with :math:`\gamma` a scale.
            """
    '''
    status, warnings = _build(tmp_path, "Title\n=====\n\n.. normscope-api:: fake_public\n", source)
    # (a second Sphinx app in one process re-registers Sphinx's own nodes: that warning is not about the page)
    ours = [line for line in warnings.splitlines() if "WARNING" in line and "is already registered" not in line]
    assert status == 0 and not ours, ours
    html = (tmp_path / "out" / "index.html").read_text()
    images = re.findall(r'<img class="math" src="data:image/svg\+xml;base64,([^"]+)" alt="([^"]*)"', html)
    assert [alt for _, alt in images] == [
        r"y = \frac{x - \mathrm{E}[x]}{\sqrt{\mathrm{Var}[x] + \epsilon}} \gamma + \beta",
        r"\gamma",
    ]
    for data, _ in images:
        svg = base64.b64decode(data).decode()
        assert svg.lstrip().startswith("<?xml") and "<svg" in svg and "<path" in svg  # drawn glyphs
    # the LaTeX source appears only in the alt text, never as the page's visible text; nothing is fetched
    visible = re.sub(r'<img class="math"[^>]*>', "", html)
    assert r"\frac" not in visible and r"\gamma" not in visible
    assert "mathjax" not in html.lower()


def test_a_formula_mathtext_cannot_draw_fails_the_build_naming_it(tmp_path, conf):
    source = r'''
        """A module."""
        __all__ = ["f"]

        def f():
            r"""See :math:`\Big( x \Big)`."""
    '''
    _, warnings = _build(tmp_path, "Title\n=====\n\n.. normscope-api:: fake_public\n", source)
    assert r"mathtext cannot render the formula '\\Big( x \\Big)'" in warnings


def _names_in_code_blocks(text: str) -> set[str]:
    """Every ``normscope.X`` a Python code block of ``text`` uses: imports, ``alias.attr`` chains through
    the names imported, and ``Class.constructor(...).method`` (a method of what a classmethod returns)."""
    found: set[str] = set()
    for block in re.findall(r"```python\n(.*?)```", text, re.S):
        tree = ast.parse(block)
        alias: dict[str, str] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.split(".")[0] == "normscope":
                        alias[a.asname or "normscope"] = a.name if a.asname else "normscope"
                        found.add(a.name)
            elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "normscope":
                for a in node.names:
                    alias[a.asname or a.name] = f"{node.module}.{a.name}"
                    found.add(f"{node.module}.{a.name}")

        def dotted(node, alias=alias) -> str | None:
            parts = []
            while isinstance(node, ast.Attribute):
                parts.append(node.attr)
                node = node.value
            if isinstance(node, ast.Name) and node.id in alias:
                return ".".join([alias[node.id], *reversed(parts)])
            return None

        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute):
                name = dotted(node)
                if name:
                    found.add(name)
                elif isinstance(node.value, ast.Call) and (ctor := dotted(node.value.func)):
                    found.add(f"{ctor.rsplit('.', 1)[0]}.{node.attr}?")  # checked only where the owner is a class
    return found


def test_every_normscope_name_in_readme_and_docs_code_is_in_the_api_reference(tmp_path):
    from io import StringIO

    from sphinx.application import Sphinx

    used: dict[str, str] = {}
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for name in _names_in_code_blocks(page.read_text()):
            used.setdefault(name, page.name)
    assert "normscope.Scope.group" in used and "normscope.Scope.resolve?" in used  # the README's example
    docs = str(ROOT / "docs")
    app = Sphinx(docs, docs, str(tmp_path / "out"), str(tmp_path / "doctrees"), "dummy", status=None,
                 warning=StringIO(), freshenv=True)  # fmt: skip
    app.build()
    objects = app.env.domains["py"].objects
    missing = []
    for name, page in sorted(used.items()):
        if name.endswith("?"):
            name = name[:-1]
            if objects.get(name.rsplit(".", 1)[0], (None, None, "?"))[2] != "class":
                continue  # a call on something that is not a documented class's constructor
        if name not in objects:
            missing.append(f"{name} ({page})")
    assert not missing, missing
    for name in ("use_backend", "last_backend", "get_norm", "register_norm", "norm_names", "Scope.layer",
                 "Scope.rms", "Scope.batch", "Scope.instance", "Scope.group", "Scope.channels", "Scope.resolve"):
        assert f"normscope.{name}" in objects, name


@pytest.mark.parametrize("page", ["README.md", "docs/integrations.md"])
def test_the_onnx_examples_run_quietly(tmp_path, page):
    # the export examples must not bury their result under the exporter's progress lines or a warning the
    # reader can do nothing about (the README says in words that torch deprecates the TorchScript exporter)
    for module in ("onnx", "onnxscript", "onnxruntime"):
        pytest.importorskip(module, reason="the integrations extra is not installed")
    import subprocess

    text = (ROOT / page).read_text()
    blocks = [b for b in re.findall(r"```python\n(.*?)```", text, re.S) if "torch.onnx.export" in b]
    assert blocks
    for block in blocks:
        r = subprocess.run(
            [sys.executable, "-c", block], cwd=tmp_path, capture_output=True, text=True, timeout=300,
            env={**__import__("os").environ, "PYTHONPATH": str(ROOT / "src")},
        )  # fmt: skip
        assert r.returncode == 0, r.stderr
        out = r.stdout + r.stderr
        assert "[torch.onnx]" not in out and "DeprecationWarning" not in out, out
    if page == "README.md":
        assert "torch deprecates the TorchScript exporter" in (ROOT / page).read_text()
