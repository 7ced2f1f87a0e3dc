"""Terminal output for normscope's commands: headings, aligned tables, pass/fail marks.

One helper for both sides of the package: the core's commands (``normscope doctor``, the ``normscope``
dispatcher) and the applications under :mod:`normscope.tools` (``tour``, ``explain``). It sits in the core,
with a public name, because the tools may use only the core's public names and the core imports nothing
private of the tools. It is not part of the numerical API (not in ``normscope.__all__``).

Uses `rich <https://github.com/Textualize/rich>`_ when it is importable (the ``cli`` extra) --
colours only when the terminal supports them (rich checks ``isatty``, ``NO_COLOR``, ``TERM``) --
and plain aligned text otherwise, so the tour runs on a bare ``pip install normscope``.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

__all__ = ["Out", "fmt", "vec"]


def fmt(v: float, digits: int = 6) -> str:
    """A statistic for people: ``8``, ``20``, ``0.105``, ``0.447214`` (``digits`` significant)."""
    if v != v:  # NaN
        return "nan"
    s = f"{v:.{digits}g}"
    return "0" if s == "-0" else s


def vec(values: Sequence[float], decimals: int = 4) -> str:
    """A short vector, fixed decimals so that columns line up: ``[+0.4472, -1.3416]``."""
    return "[" + ", ".join(f"{v:+.{decimals}f}".replace("-0.0000", "+0.0000") for v in values) + "]"


class Out:
    """Where the command line writes. ``plain=True`` (or rich missing) gives plain text."""

    def __init__(self, plain: bool = False) -> None:
        self._console = None
        if not plain:
            try:
                from rich.console import Console
            except ImportError:
                pass
            else:
                # markup off: our text is full of brackets ("[10, 2, 6, 14]") that rich would eat
                console = Console(markup=False, highlight=False)
                if not console.is_terminal:
                    # piped or captured: no colours, and no 80-column wrapping of the tables
                    console = Console(markup=False, highlight=False, width=160)
                self._console = console

    @property
    def rich(self) -> bool:
        return self._console is not None

    def line(self, text: str = "", style: str | None = None) -> None:
        if self._console is not None:
            self._console.print(text, style=style, soft_wrap=True)
        else:
            print(text, file=sys.stdout)

    def heading(self, text: str) -> None:
        if self._console is not None:
            self._console.print()
            self._console.rule(text, style="cyan", align="left")
        else:
            print(f"\n== {text} " + "=" * max(0, 76 - len(text)))

    def mark(self, ok: bool) -> str:
        return "ok" if ok else "FAIL"

    def table(
        self,
        headers: Sequence[str],
        rows: Sequence[Sequence[object]],
        title: str | None = None,
        align: str | None = None,
    ) -> None:
        """Print ``rows`` under ``headers``. ``align`` is one letter per column, ``l`` or ``r``
        (default: first column left, the others right, as numbers read best)."""
        cells = [[str(c) for c in row] for row in rows]
        align = align or "l" + "r" * (len(headers) - 1)
        if self._console is not None:
            from rich import box
            from rich.table import Table
            from rich.text import Text

            t = Table(title=title, box=box.SIMPLE_HEAD, title_justify="left", title_style="bold", pad_edge=False)
            for h, a in zip(headers, align):
                t.add_column(h, justify="right" if a == "r" else "left", no_wrap=True)
            for row in cells:
                t.add_row(*(Text(c, style=_style(c)) for c in row))
            natural = sum(max([len(h)] + [len(r[i]) for r in cells]) + 2 for i, h in enumerate(headers))
            if natural <= self._console.width:
                self._console.print(t)
                return
            # too wide for this terminal: rich would cut the numbers short ("0.44…"); plain text
            # lets the terminal wrap the lines instead, and loses nothing
        widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]

        def render(row: Sequence[str]) -> str:
            return "  ".join(c.rjust(w) if a == "r" else c.ljust(w) for c, w, a in zip(row, widths, align)).rstrip()

        if title:
            print(title)
        print("  " + render(headers))
        print("  " + render(["-" * w for w in widths]))
        for row in cells:
            print("  " + render(row))
        print()


def _style(cell: str) -> str | None:
    # pass/fail cells are the only coloured ones
    return {"ok": "green", "True": "green", "FAIL": "bold red", "False": "bold red"}.get(cell)
