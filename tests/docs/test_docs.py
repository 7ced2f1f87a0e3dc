"""Every code block of the documentation a user reads runs as written: README.md, docs/*.md and
benchmarks/README.md.

* ``python`` blocks run in order, one namespace per page (a later block may use an earlier one's
  names, as a reader following the page would).
* ``bash`` blocks run line by line in a shell, with this checkout's ``src`` first on PYTHONPATH.
* Output samples (``text``, ``json``, ...) are not code and are not run.
* A block that cannot run here is marked on the line before its fence, with the reason:
  ``<!-- docs-test: skip needs a CUDA GPU -->``. It is reported as a skip with that reason.
* A block that runs a whole tool (the lab's pipeline, every picture) is marked the same way as a smoke
  test: ``<!-- docs-test: smoke runs the lab's whole pipeline -->``. The README's test command leaves it
  out; CI runs it (``python3 -m pytest -m smoke``). A page's blocks share one namespace, so a block
  that is not smoke must not need a smoke block's names.

Every page runs in a temporary directory of its own (blocks write pictures and ONNX files). The
pages and the rules of the site build are checked here too.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: the pages whose code blocks run: every one (a block that cannot run here is marked, with why)
PAGES = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md")), "benchmarks/README.md"]
NOT_RUN: dict[str, str] = {}

RUN = {"python", "py", "bash", "sh", "shell", "console"}
MARKER = re.compile(r"<!--\s*docs-test:\s*(?P<kind>skip|smoke)\s+(?P<reason>.+?)\s*-->")
FENCE = re.compile(r"^(?P<indent> {0,3})(?P<fence>`{3,}|~{3,})\s*(?P<lang>[\w+-]*)")


@dataclass
class Block:
    page: str
    line: int  # of the opening fence, 1-based
    lang: str
    code: str
    skip: str | None  # the skip marker's reason
    smoke: str | None = None  # the smoke marker's reason

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def blocks(page: str, text: str | None = None) -> list[Block]:
    """The fenced code blocks of a Markdown page, with the skip marker that precedes each."""
    lines = (ROOT / page).read_text().splitlines() if text is None else text.splitlines()
    found, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, lang, start = m["fence"], m["lang"].lower(), i
        body = []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            body.append(lines[i][len(m["indent"]) :])
            i += 1
        if i == len(lines):
            raise ValueError(f"{page}:{start + 1}: code block never closed")
        before = next((lines[j] for j in range(start - 1, -1, -1) if lines[j].strip()), "")
        marker = MARKER.search(before)
        kind, reason = (marker["kind"], marker["reason"]) if marker else (None, None)
        code = "\n".join(body) + "\n"
        skip, smoke = (reason if kind == "skip" else None), (reason if kind == "smoke" else None)
        found.append(Block(page, start + 1, lang, code, skip, smoke))
        i += 1
    return found


def _params():
    params = []
    for page in PAGES:
        for b in blocks(page):
            if b.lang not in RUN:
                continue
            # a page's blocks share a namespace and a directory (page_state): one worker runs them, in order
            marks = [pytest.mark.xdist_group(f"docs:{page}")] + ([pytest.mark.smoke] if b.smoke else [])
            marks += [pytest.mark.skip(reason=NOT_RUN[page])] if page in NOT_RUN else []
            params.append(pytest.param(b, id=b.id, marks=marks))
    return params


BLOCKS = _params()


@pytest.fixture(scope="module")
def page_state(tmp_path_factory):
    """Per page: its working directory and the namespace its python blocks share."""
    state: dict[str, tuple[Path, dict]] = {}

    def get(page: str):
        if page not in state:
            state[page] = (tmp_path_factory.mktemp(re.sub(r"\W", "_", page)), {"__name__": "__docs__"})
        return state[page]

    return get


def _env(tmp: Path) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT / "src") + os.pathsep + env.get("PYTHONPATH", "")
    env["MPLBACKEND"] = "Agg"
    if shutil.which("normscope") is None:  # not installed: the same command through this interpreter
        shim = tmp / "bin" / "normscope"
        shim.parent.mkdir(exist_ok=True)
        shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m normscope "$@"\n')
        shim.chmod(0o755)
        env["PATH"] = f"{shim.parent}{os.pathsep}{env['PATH']}"
    env.setdefault("PYTHON", sys.executable)
    return env


@pytest.mark.parametrize("block", BLOCKS)
def test_code_block_runs_as_written(block: Block, page_state, monkeypatch):
    if block.skip:
        pytest.skip(f"marked in {block.page}: {block.skip}")
    cwd, namespace = page_state(block.page)
    if block.lang in ("python", "py"):
        monkeypatch.chdir(cwd)
        monkeypatch.setenv("MPLBACKEND", "Agg")
        exec(compile(block.code, block.id, "exec"), namespace)  # noqa: S102 - our own documentation
        return
    env = _env(cwd)
    for n, line in enumerate(block.code.splitlines()):
        command = line.split(" #", 1)[0].strip()  # a trailing "# comment" explains, it is not an argument
        if not command or command.startswith("#"):
            continue
        command = re.sub(r"^\$\s+", "", command)
        proc = subprocess.run(["bash", "-c", command], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, f"{block.page}:{block.line + 1 + n}: `{command}` exited {proc.returncode}\n" + (
            proc.stdout[-2000:] + proc.stderr[-3000:]
        )


# ---------------------------------------------------------------------------------------- the runner


def test_runner_finds_blocks_and_markers():
    text = "intro\n\n<!-- docs-test: skip needs a GPU -->\n```python\nx = 1\n```\n\n```bash\necho hi\n```\n"
    found = blocks("README.md", text)
    assert [(b.lang, b.line, b.skip, b.code) for b in found] == [
        ("python", 4, "needs a GPU", "x = 1\n"),
        ("bash", 8, None, "echo hi\n"),
    ]
    assert [b.smoke for b in found] == [None, None]
    (smoke,) = blocks("README.md", "<!-- docs-test: smoke runs a whole tool -->\n```bash\necho hi\n```\n")
    assert (smoke.skip, smoke.smoke) == (None, "runs a whole tool")
    with pytest.raises(ValueError, match="never closed"):
        blocks("README.md", "```python\nx = 1\n")


def test_every_page_has_its_blocks_collected():
    ids = {p.id for p in BLOCKS}
    for page in ("README.md", "docs/beyond.md", "docs/integrations.md", "docs/kernels.md"):
        assert any(i.startswith(page + ":") for i in ids), page
    assert len(ids) >= 20, ids  # a broken parser would otherwise pass by running nothing


def test_every_skip_says_why():
    for page in PAGES:
        for b in blocks(page):
            if b.skip is not None:
                assert len(b.skip.split()) >= 2, f"{b.id}: say why it cannot run here, got {b.skip!r}"
            if b.smoke is not None:
                assert len(b.smoke.split()) >= 2, f"{b.id}: say which whole tool it runs, got {b.smoke!r}"


# ------------------------------------------------------------------------------------- what pages say


USER_PAGES = ["README.md", "benchmarks/README.md", *(p for p in PAGES if p.startswith("docs/"))]


@pytest.mark.parametrize("page", USER_PAGES)
def test_no_issue_numbers_or_development_history(page):
    """A reader cannot follow "issue 15" or "the measurements before the last change"."""
    text = (ROOT / page).read_text()
    for pattern in (r"\bissue\s*#?\d+", r"\bissues?\s+\d+", r"(?<![\w/])#\d{1,3}\b(?!\w)", r"\btoday\b"):
        hits = [m.group(0) for m in re.finditer(pattern, text, re.I)]
        assert not hits, f"{page}: {hits}"


def test_readme_is_a_front_page():
    text = (ROOT / "README.md").read_text()
    assert len(text.split()) <= 1500, len(text.split())
    for peer in ("torch.nn", "Liger-Kernel", "Apex", "Transformer Engine", "timm"):
        assert f"| {peer} " in text or f" {peer} |" in text, peer  # a column of the comparison table


def test_readme_says_where_a_cpu_torch_comes_from():
    """constraints.txt pins a plain ``torch==X``: from PyPI that is the CUDA build on Linux (gigabytes of CUDA
    packages), whatever the pin's comment says. Unless the pin itself names the CPU build (``+cpu``) or its
    index, the README must say how to get the CPU one -- it said "constraints.txt pins the CPU build"."""
    pins = (ROOT / "constraints.txt").read_text()
    torch_pin = re.search(r"^torch==(\S+)", pins, re.M)
    assert torch_pin, "constraints.txt pins no torch"
    cpu_index = "download.pytorch.org/whl/cpu"
    pinned_to_cpu = "+cpu" in torch_pin[1] or re.search(rf"^\s*--(extra-)?index-url\s+\S*{cpu_index}", pins, re.M)
    if not pinned_to_cpu:
        assert cpu_index in (ROOT / "README.md").read_text()


def test_readme_extras_table_lists_every_extra():
    tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from Python 3.11")
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    text = (ROOT / "README.md").read_text()
    listed = set(re.findall(r"^\| `([\w-]+)` \|", text, re.M))
    assert listed == set(extras), (sorted(listed), sorted(extras))


def test_ci_builds_the_site_strictly():
    script = (ROOT / ".ci" / "run").read_text()
    build = [line.strip() for line in script.splitlines() if "sphinx" in line and not line.strip().startswith("#")]
    assert build and all(flag in build[-1] for flag in ("-W", "-n", "--keep-going")), build
    assert '".[docs]"' in script
