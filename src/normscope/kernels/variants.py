"""Which kernel the ``"triton"`` backend runs for a rows call (LayerNorm, RMSNorm, the fused residual
add): today's rows kernels (:mod:`.rows`) or the read-once candidates (:mod:`.rows_once`).

The choice is made per row length -- a scope's own extent, so a row's bits never depend on how many
rows a call holds -- and, like every automatic choice of normscope, by a committed measurement: a row
of the device class's measured-choice table (``normscope.backends.measured``, its ``"kernel"`` field)
names the kernel for its (op, dtype, row-length range). Where no row names one, ``"rows"`` runs, on
every device; the candidates are off by default.

:func:`use_rows_kernel` overrides the table for the calls inside it (per thread and asyncio task, as
:func:`normscope.use_backend` is): what ``normscope bench`` does to time the candidates beside today's
kernels, and what the tests do to reach them. It chooses among the Triton kernels only: the backend is
still chosen (or forced) as always, and a call the ``"triton"`` backend does not run is not affected.

Nothing here imports Triton.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

__all__ = ["DEFAULT_ROWS_KERNEL", "ROWS_KERNELS", "forced_rows_kernel", "use_rows_kernel"]

#: the rows kernels by name: today's (:mod:`.rows`) and the read-once candidates (:mod:`.rows_once`)
ROWS_KERNELS = ("rows", "rows_once")
#: what runs where neither an override nor a measured-choice row names a kernel
DEFAULT_ROWS_KERNEL = "rows"

_FORCED: contextvars.ContextVar[str | None] = contextvars.ContextVar("normscope_rows_kernel", default=None)


def forced_rows_kernel() -> str | None:
    """The rows kernel :func:`use_rows_kernel` forces in this thread / task, or None."""
    return _FORCED.get()


# torch.compile: dynamo cannot trace ContextVar.get; it calls this once while tracing and keeps the
# answer (the mark torch.compiler.assume_constant_result sets, set directly as normscope._state's
# constant_when_compiled does -- kernels/ imports nothing of the engine): a graph keeps the kernel
# chosen when it was traced
forced_rows_kernel._dynamo_marked_constant = True  # type: ignore[attr-defined]


@contextlib.contextmanager
def use_rows_kernel(name: str | None) -> Iterator[None]:
    """Run rows calls of the ``"triton"`` backend on kernel ``name`` (one of :data:`ROWS_KERNELS`)
    inside the block, whatever the measured-choice table says; ``None`` restores the table's choice.
    Read when a call runs, so it holds for plans made before the block too; under ``torch.compile``
    the kernel chosen while tracing is the one the graph keeps."""
    if name is not None and name not in ROWS_KERNELS:
        raise ValueError(f"use_rows_kernel: expected one of {ROWS_KERNELS} or None, got {name!r}")
    token = _FORCED.set(name)
    try:
        yield
    finally:
        _FORCED.reset(token)
