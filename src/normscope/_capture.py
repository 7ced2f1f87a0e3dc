"""What the hot path (:mod:`normscope.hot`) learns from a checked call: the plan it dispatched.

:func:`record` opens a slot that :func:`normscope.engine.dispatch` fills with the ``(call, plan)`` it
runs next; :func:`capture` makes dispatch plan as for a traced call and collect the plans instead
of running anything (the planning of a call dynamo traces, on stand-ins). Both are per thread and
per asyncio task (contextvars), as the rest of what a call reads besides its arguments
(:mod:`normscope._state`). Depends on :mod:`normscope._state` only.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator

from ._state import as_traced

__all__ = ["CAPTURED", "RECORDS", "record", "recorded", "decline_record", "capture"]

#: inside capture(): the list dispatch() appends the plans it made to instead of running them
CAPTURED: contextvars.ContextVar[list | None] = contextvars.ContextVar("normscope_captured", default=None)
#: the slots of the checked calls in progress (record()), innermost last
RECORDS: contextvars.ContextVar[tuple] = contextvars.ContextVar("normscope_records", default=())


def record(start: Callable[[], None] | None = None) -> list:
    """Open a slot in which :func:`normscope.engine.dispatch` records the ``(call, (name, runner))``
    it runs next on this thread (see :func:`recorded`); ``start``: called once, when that call has
    passed every check and is about to run (a layer's bookkeeping, such as counting a batch, that a
    refused call must not do and a call that raises while it runs must have done, as torch's layers do)."""
    slot = [None, start]
    RECORDS.set((*RECORDS.get(), slot))
    return slot


def recorded(slot: list) -> tuple | None:
    """Close ``slot``: the ``(call, plan)`` dispatched while it was open, or None when there was none,
    more than one, or the checked call declined (:func:`decline_record`)."""
    stack = RECORDS.get()
    for i in range(len(stack) - 1, -1, -1):
        if stack[i] is slot:
            RECORDS.set(stack[:i] + stack[i + 1 :])
            break
    return slot[0] or None


def decline_record() -> None:
    """The call being checked must not be remembered (see :func:`normscope.hot.per_call`)."""
    stack = RECORDS.get()
    if stack:
        stack[-1][0] = False


@contextlib.contextmanager
def capture() -> Iterator[list]:
    """Inside: :func:`normscope.engine.dispatch` plans as for a traced call (``tracing()`` is True)
    and appends ``(call, (name, runner))`` to the yielded list instead of running anything."""
    captured: list = []
    token = CAPTURED.set(captured)
    try:
        with as_traced():
            yield captured
    finally:
        CAPTURED.reset(token)
