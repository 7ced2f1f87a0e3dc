r"""Sphinx configuration of normscope's documentation site: the narrative pages of ``docs/`` and an API
reference generated from the docstrings.

Build it (the ``docs`` extra installs what it needs)::

    python3 -m pip install -e ".[docs]"
    python3 -m sphinx -W --keep-going -n -b html docs build/docs     # open build/docs/index.html

Why Sphinx rather than mkdocs-material + mkdocstrings: normscope's docstrings follow PyTorch's and are
written in reStructuredText (``code``, :class:`~normscope.Scope`, :math:`...`, ``Example::`` blocks,
Google-style ``Args:``). Sphinx renders them as written and *resolves* every cross-reference, so
``-n -W`` turns a reference to a name that does not exist into a failed build; mkdocstrings would
print the roles as raw text and check nothing. The narrative pages stay Markdown (MyST).

The build is strict and offline:

* ``-W --keep-going -n``: every warning -- a broken reference, a malformed docstring, a page left
  out of the table of contents, a public name without a docstring (checked below) -- fails it.
* nothing is fetched at build or view time: no intersphinx (references to torch are not linked,
  see ``nitpick_ignore_regex``), no MathJax, and the furo theme uses the system's fonts.

Formulas (``:math:`` in docstrings, ``$...$`` in pages) are rendered at build time by matplotlib's
mathtext into SVG images embedded in the page (``data:`` URIs: no file, no host). Why mathtext: MathJax
is a CDN script (or 1.5 MB of vendored JavaScript run on every page); ``sphinx.ext.imgmath`` needs LaTeX
and dvipng, which neither CI nor a docs contributor's machine has (no TeX here, ~300 MB with it);
mathtext is pure Python, already a dependency of the plots, and covers the TeX our formulas use
(``\frac``, ``\sqrt``, ``\mathrm``, ``\text``, ``\left( \right)``, Greek, sub/superscripts). A formula
it cannot parse fails the strict build, naming the formula; the image's ``alt`` text is its LaTeX
source, so screen readers and text browsers still get it.

The API pages list the public names with ``.. normscope-api:: MODULE``, which expands to one entry
per name in ``MODULE.__all__``: a name added to ``__all__`` appears in the reference with no edit
here, and fails the build if it has no docstring.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import pathlib
import re
import sys

from docutils import nodes
from docutils.statemachine import StringList
from sphinx.util import logging
from sphinx.util.docutils import SphinxDirective

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(ROOT, "src"))  # the checkout's code, installed or not

import normscope  # noqa: E402

project = "normscope"
author = "the normscope authors"
release = normscope.__version__
copyright = "normscope authors, BSD-3-Clause"  # noqa: A001 - Sphinx's name

extensions = ["sphinx.ext.autodoc", "sphinx.ext.napoleon", "myst_parser"]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
# docs/lab/ holds the lab's generated report and plots (linked, not pages); conf.py is not a page
exclude_patterns = ["_build", "lab/**", "conf.py"]
html_extra_path = ["lab"] if os.path.isdir(os.path.join(os.path.dirname(__file__), "lab")) else []

html_theme = "furo"
html_title = f"normscope {release}"
html_static_path: list[str] = []
html_show_sourcelink = False
html_copy_source = False
html_math_renderer = "mathtext"  # registered in setup(); never MathJax (a CDN script)

# Markdown: "## Set up" gets an anchor (#set-up) so pages can link to sections
myst_heading_anchors = 3
myst_enable_extensions = ["dollarmath"]

autodoc_member_order = "bysource"
autodoc_typehints = "description"
# a method documents itself or is left out: an override without a docstring (forward, extra_repr) would
# otherwise show torch's text for nn.Module ("Define the computation performed at every call...")
autodoc_inherit_docstrings = False
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_custom_sections = ["Shape"]  # torch's "Shape:" section, kept as written

nitpicky = True
# no intersphinx (it downloads inventories): references into torch, the standard library and typing
# stay plain text instead of failing the strict build
nitpick_ignore_regex = [
    (r"py:.*", r"(torch|nn|F|Tensor|typing|collections|dataclasses|enum|contextlib|pathlib|argparse)(\..*)?"),
    (r"py:.*", r"(int|float|bool|str|bytes|dict|list|tuple|set|type|object|None|callable|Callable|Sequence)"),
    (r"py:.*", r"(Iterable|Iterator|Mapping|Any|Literal|Optional|Union|Self|Module|Parameter|dtype|device)"),
    (r"py:.*", r"(optional|default|torch\.Size|Size|ellipsis|NoneType|Path|os\.PathLike)"),
]

logger = logging.getLogger("normscope.docs")


def _public(module_name: str) -> list[tuple[str, object]]:
    module = importlib.import_module(module_name)
    names = getattr(module, "__all__", None)
    if names is None:
        raise ValueError(f"normscope-api: {module_name} has no __all__ to list")
    return [(name, getattr(module, name)) for name in names]


class NormscopeApi(SphinxDirective):
    """``.. normscope-api:: normscope.functional``: one autodoc entry per name of the module's
    ``__all__`` (classes with their public methods, functions, submodules as a link line)."""

    required_arguments = 1
    has_content = False

    def run(self) -> list[nodes.Node]:
        module_name = self.arguments[0]
        lines = [f".. currentmodule:: {module_name}", ""]
        for name, obj in _public(module_name):
            # constants are documented by a ``#:`` comment autodoc reads from the source; classes,
            # functions and modules need a docstring of their own (not one inherited from torch)
            documented = inspect.ismodule(obj) or inspect.isclass(obj) or inspect.isroutine(obj)
            if documented and not (obj.__doc__ or "").strip():
                logger.warning(
                    f"{module_name}.{name} is public (in __all__) but has no docstring",
                    location=(self.env.docname, self.lineno),
                )
            qualified = f"{module_name}.{name}"
            if inspect.ismodule(obj):
                lines += [f"* ``{qualified}``: module :mod:`{obj.__name__}`", ""]
            elif inspect.isclass(obj):
                lines += [f".. autoclass:: {name}", "   :members:", ""]
            elif callable(obj) and getattr(obj, "__name__", None):
                # a name public in two namespaces (normscope.normalize, normscope.functional.normalize) is
                # documented, and can be referenced, under each
                lines += [f".. autofunction:: {name}", ""]
            else:
                lines += [f".. autodata:: {name}", "   :no-value:", ""]
        container = nodes.section()
        container.document = self.state.document
        self.state.nested_parse(StringList(lines, source=f"<normscope-api {module_name}>"), 0, container)
        return container.children


def _resolve(dotted: str) -> bool:
    """Whether ``dotted`` names an existing module or attribute (importing the longest module prefix)."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        try:
            for attr in parts[i:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return False
        return True
    return False


def _unlinked_but_real(app, env, node, contnode):
    """``missing-reference``: a reference to something that exists but has no page (a private helper,
    a submodule, torch or the standard library, which are not linked offline) becomes plain code; a
    reference into normscope that names nothing keeps its warning, which fails the strict build."""
    if node.get("refdomain") != "py":
        return None
    target = node["reftarget"].lstrip("~.")
    if any(c.isspace() for c in target):
        # napoleon reads a ``#:`` comment "words: more words" as "type: description"; not a reference
        return contnode
    module, cls = node.get("py:module"), node.get("py:class")
    # relative names are looked up where a reader would: the page's module, its class, the modules
    # inside it (a re-exported function's docstring names its neighbours), and normscope's namespace
    candidates = [target, f"normscope.{target}"]
    if module:
        candidates += [f"{module}.{target}"] + ([f"{module}.{cls}.{target}"] if cls else [])
        try:  # loads the submodules the module itself imports
            importlib.import_module(module)
        except ImportError:
            pass
        candidates += [f"{sub}.{target}" for sub in list(sys.modules) if sub.startswith(module + ".")]
    if any(_resolve(c) for c in candidates):
        return contnode
    top = target.split(".")[0]
    if top != "normscope" and importlib.util.find_spec(top) is None and not module:
        return contnode  # a package not installed in this environment: nothing to check against
    return None


def _no_docstring_of_the_type(app, what, name, obj, options, lines):
    """A constant without a ``#:`` comment would show the docstring of its type ("dict() -> new empty
    dictionary"): drop it."""
    if what in ("data", "attribute") and lines:
        type_doc = inspect.getdoc(type(obj)) or ""
        if type_doc and "\n".join(lines).strip() == type_doc.strip():
            lines.clear()


_LITERAL = re.compile(r"``.*?``")
_SHAPE_STAR = re.compile(r"(?<=[(\s])\*(?='?[),])")  # (N, C, *), (N, *, C), (*, D), *'
_LONE_STAR = re.compile(r"(?<![*\\])\*(?!\*)")


def _escape_stars(app, what, name, obj, options, lines):
    """Docstrings write shapes as in PyTorch's text, ``(N, C, *)``, and globs as ``simplenorm*``; in
    reStructuredText a lone ``*`` opens emphasis (a warning, and a garbled line). Escape the shape
    wildcard, and the lone stars of a line whose stars cannot pair up; literal blocks (``::``,
    ``>>>``) and ``inline literals`` are left alone."""
    literal_indent = None
    for i, line in enumerate(lines):
        indent = len(line) - len(line.lstrip())
        if literal_indent is not None:
            if line.strip() and indent <= literal_indent:
                literal_indent = None
            else:
                continue
        if line.lstrip().startswith(">>>") or line.lstrip().startswith("..."):
            continue
        bullet = re.match(r"\s*[*-] ", line)  # a list item's "* " is markup, not a star to pair
        head, text = (line[: bullet.end()], line[bullet.end() :]) if bullet else ("", line)
        parts, literals = _LITERAL.split(text), _LITERAL.findall(text)
        parts = [_SHAPE_STAR.sub(r"\\*", part) for part in parts]
        if sum(len(_LONE_STAR.findall(part)) for part in parts) % 2:
            parts = [_LONE_STAR.sub(r"\\*", part) for part in parts]
        lines[i] = head + "".join(p + (literals[j] if j < len(literals) else "") for j, p in enumerate(parts))
        if line.rstrip().endswith("::"):
            literal_indent = indent


#: rendered formulas, by (LaTeX source, display): one page shows the same formula many times
_MATH_CACHE: dict[tuple[str, bool], str] = {}


def render_math(latex: str, display: bool = False) -> str:
    """``<img>`` markup of ``latex`` rendered by matplotlib's mathtext: an SVG in a ``data:`` URI,
    the formula's baseline on the text's. ValueError for TeX that mathtext does not know."""
    key = (latex, display)
    if key not in _MATH_CACHE:
        import base64
        import io

        import matplotlib

        matplotlib.use("Agg")
        from matplotlib import mathtext
        from matplotlib.font_manager import FontProperties

        # one line of TeX: a display block written over several lines is one formula
        tex = " ".join(latex.split())
        buf = io.BytesIO()
        rc = {"svg.hashsalt": "normscope", "svg.fonttype": "path", "mathtext.fontset": "cm", "savefig.transparent": True}
        with matplotlib.rc_context(rc):
            try:
                depth = mathtext.math_to_image(
                    f"${tex}$", buf, prop=FontProperties(size=18 if display else 12), format="svg"
                )
            except ValueError as e:
                raise ValueError(f"mathtext cannot render the formula {tex!r}: {str(e).splitlines()[-1]}") from None
        data = base64.b64encode(buf.getvalue()).decode("ascii")
        alt = tex.replace("&", "&amp;").replace('"', "&quot;").replace("<", "&lt;")
        style = "" if display else f' style="vertical-align: -{depth:.1f}pt"'
        _MATH_CACHE[key] = f'<img class="math" src="data:image/svg+xml;base64,{data}" alt="{alt}"{style}>'
    return _MATH_CACHE[key]


#: the formulas are black glyphs in an image: furo's dark theme (chosen, or "auto" on a dark system) inverts them
_MATH_STYLE = """<style>
img.math { display: inline; }
div.math { text-align: center; margin: 0.6em 0; }
body[data-theme="dark"] img.math { filter: invert(1); }
@media (prefers-color-scheme: dark) { body:not([data-theme="light"]) img.math { filter: invert(1); } }
</style>"""


def _math_style(app, pagename, templatename, context, doctree):
    context["metatags"] = context.get("metatags", "") + _MATH_STYLE


def _math_markup(self, node, display: bool) -> str:
    try:
        return render_math(node.astext(), display)
    except ValueError as e:  # a formula the build cannot show: a warning, which fails the strict build
        logger.warning(str(e), location=node)
        return self.starttag(node, "code", CLASS="math") + self.encode(node.astext()) + "</code>"


def _visit_math(self, node):
    self.body.append(_math_markup(self, node, display=False))
    raise nodes.SkipNode


def _visit_math_block(self, node):
    self.body.append(f'<div class="math">{_math_markup(self, node, display=True)}</div>')
    raise nodes.SkipNode


_REMOTE = re.compile(r"""<(?:script|img|link|iframe)\b[^>]*\b(?:src|href)=["'](?:https?:)?//""", re.I)


def _nothing_fetched(app, exception):
    """After the build: a page that would load a script, style, font or image from another host
    (a theme or extension update adding a CDN) is a warning, so the strict build fails."""
    if exception is not None or app.builder.format != "html":
        return
    for path in sorted(pathlib.Path(app.outdir).rglob("*.html")):
        match = _REMOTE.search(path.read_text(encoding="utf-8"))
        if match:
            logger.warning(f"{path.relative_to(app.outdir)} loads a remote resource: {match.group(0)}")


def _site_links(app, relative_path, parent_docname, content):
    """The README links to ``benchmarks/README.md`` (right on GitHub); on the site that page is
    ``docs/benchmarks.md``, which includes it."""
    if relative_path.name == "README.md" and relative_path.parent.name != "benchmarks":
        content[0] = content[0].replace("](benchmarks/README.md)", "](docs/benchmarks.md)")


def _no_inline_type(app, what, name, obj, options, lines):
    """Napoleon reads the first line of a constant's ``#:`` comment as "type: description" when it
    has a colon, so "The automatic order: the first backend ..." became the type "The automatic
    order". A type with spaces in it is words: put the sentence back together."""
    if what not in ("data", "attribute"):
        return
    for i, line in enumerate(lines):
        if line.startswith(":type: ") and " " in line[len(":type: ") :].strip():
            words = line[len(":type: ") :].strip()
            del lines[i]
            first = next((j for j, text in enumerate(lines) if text.strip()), None)
            if first is None:
                lines.append(words)
            else:
                lines[first] = f"{words}: {lines[first]}"
            return


def setup(app):
    app.connect("autodoc-process-docstring", _no_inline_type, priority=900)  # after napoleon
    app.connect("include-read", _site_links)
    app.connect("build-finished", _nothing_fetched)
    app.add_html_math_renderer("mathtext", (_visit_math, None), (_visit_math_block, None))
    app.connect("html-page-context", _math_style)
    app.connect("autodoc-process-docstring", _escape_stars)
    app.connect("autodoc-process-docstring", _no_docstring_of_the_type)
    app.add_directive("normscope-api", NormscopeApi)
    app.connect("missing-reference", _unlinked_but_real)
    return {"parallel_read_safe": True}
