"""The ``"rows"`` backend: unmasked RMS scopes (RMSNorm) over rows, one reduction each way (:mod:`.rms`).

It takes every unmasked RMS scope without bias or running statistics (:func:`.rms.takes`) when forced
(``use_backend("rows")``, ``backend="rows"``), on any device, and refuses every other call with the
reason. Rows not dense in memory are handed to torch's op (the aten backend's runner), whose bits
for such a layout are torch's only.

Automatic choice: on CPU, from :data:`.rms.MIN_AUTO_ELEMENTS` elements, where
``benchmarks/results/cpu_speed.json`` measured it faster than ``torch.rms_norm`` forward and
forward+backward; under tracing torch.compile fuses torch's op itself. The choice is made on the
input's total size, which the batch decides, and that keeps the scope-isolation rule
(:mod:`normscope.engine`) only because the rows give every row torch's bits, output and input
gradient (``tests/backends/test_batch_invariance.py``): the two paths produce the same bits per scope.
"""

from __future__ import annotations

import math

from .. import engine
from ..engine import Backend, Call, Runner
from . import aten, rms

__all__ = ["NAME", "BACKEND"]

NAME = "rows"


def why_not(call: Call) -> str | None:
    reason = rms.takes(call)
    if reason is not None:
        return f"the rows backend runs unmasked RMS scopes (RMSNorm) only: {reason}"
    return None


def why_not_auto(call: Call) -> str | None:
    if call.x.device.type != "cpu":
        return "measured faster than torch's rms_norm on CPU only (benchmarks/results/cpu_speed.json)"
    if engine.tracing():
        return "traced: torch.compile fuses torch's rms_norm itself"
    if math.prod(call.scope.shape) < rms.MIN_AUTO_ELEMENTS:
        return f"below {rms.MIN_AUTO_ELEMENTS} elements torch's rms_norm is faster on CPU (rms.MIN_AUTO_ELEMENTS)"
    return None


def prepare(call: Call, automatic: bool) -> Runner:
    # rows not dense in memory go to torch's op, whose bits are torch's (see rms.prepare)
    return rms.prepare(call, aten.prepare(call, False) if aten.why_not(call) is None else None)


BACKEND = Backend(NAME, why_not, prepare, why_not_auto)
