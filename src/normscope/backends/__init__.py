"""Every backend of the engine, and their automatic order, in one place.

=============  ==============================================================================
``triton``     fused Triton kernels (:mod:`normscope.kernels`) behind one door that enforces their
               contract (:mod:`.triton`); chosen automatically only where a committed
               measurement on the device class shows it faster (:mod:`.measured`); registered
               when Triton is installed
``rows``       unmasked RMS scopes (RMSNorm) with one reduction each way and torch's bits per row
               (:mod:`.rows`, :mod:`.rms`); chosen automatically on CPU for large inputs
``aten``       PyTorch's own fused ops, for the scopes that are exactly one of them (:mod:`.aten`)
``composite``  masked BatchNorm/InstanceNorm/GroupNorm from a few large ATen ops with a
               closed-form backward (:mod:`.composite`)
``reference``  :mod:`normscope.reference`'s plain PyTorch ops: any scope, any device (:mod:`.reference`)
=============  ==============================================================================

Per call the engine (:mod:`normscope.engine`) runs the first backend of :data:`AUTOMATIC_ORDER`
that can run the call exactly and agrees to be chosen; a forced one (``backend=``,
:func:`normscope.use_backend`, ``NORMSCOPE_BACKEND``) runs or raises saying why.
``normscope.backends()`` (:func:`normscope.engine.backends`) lists the registered names in that order.
"""

from __future__ import annotations

from .. import engine
from ..kernels.fused import triton_available
from . import aten, composite, reference, rows

#: The automatic order: the first backend that takes a call runs it.
AUTOMATIC_ORDER = ("triton", "rows", "aten", "composite", "reference")

#: Whether Triton is importable, i.e. whether the ``"triton"`` backend is registered.
TRITON: bool = triton_available()

_modules = {"rows": rows, "aten": aten, "composite": composite, "reference": reference}
if TRITON:
    from . import triton

    _modules["triton"] = triton

for _name in AUTOMATIC_ORDER:
    if _name in _modules:
        engine.register_backend(_modules[_name].BACKEND)

__all__ = ["AUTOMATIC_ORDER", "TRITON", "aten", "composite", "reference", "rows", "measured"]
