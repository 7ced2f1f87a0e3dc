"""The engine's contract: the call a backend runs and the backend that runs it.

:class:`Call` is everything one normalization needs; :class:`Backend` is what a way of running calls
promises (``why_not``, ``why_not_auto``, ``prepare``). Nothing here runs or chooses anything: the
registry and the automatic choice (:mod:`normscope._registry`), the planning of traced calls
(:mod:`normscope._planning`) and the entry points (:mod:`normscope.engine`) build on these types,
and so do the backends. Depends on :mod:`normscope.scope` only.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

from torch import Tensor

from .scope import Resolved

__all__ = ["Running", "Call", "call_of", "Runner", "LayerEntry", "Backend", "ENV_VAR"]

#: the environment variable that forces a backend process-wide (``use_backend`` and ``backend=`` win)
ENV_VAR = "NORMSCOPE_BACKEND"


class Running(NamedTuple):
    """Running statistics of a BatchNorm/InstanceNorm-style layer (1-d tensors over the affine
    axis, or None when the layer tracks none).

    ``momentum`` is the update factor actually used this step (the layer resolves torch's
    ``momentum=None`` cumulative average into ``1 / num_batches_tracked``).
    ``use_input_stats``: normalize with this batch's statistics (and update the running ones if
    present), or with the running ones (evaluation).
    """

    mean: Tensor | None
    var: Tensor | None
    momentum: float
    use_input_stats: bool


class Call(NamedTuple):
    """Everything a backend needs for one normalization.

    With ``residual`` the call is the fused ``h = x + residual; y = norm(h)`` of :func:`add_norm`:
    ``h`` is rounded to the residual's dtype (fp32 with ``residual_fp32``) before it is normalized,
    and the scale is ``weight + weight_offset``. Only a backend with ``fuses_residual`` sees such a
    call; for the others the engine adds first.

    ``weight_offset`` and ``casting`` are a model family's options for the last-axes LayerNorm and
    RMSNorm scopes: the scale is ``weight + weight_offset`` formed in fp32 (Gemma's ``1 + w`` is 1.0),
    and ``casting`` says where the result is rounded to the input dtype -- ``"torch"`` (torch's layers;
    with an offset, as ``"gemma"``), ``"gemma"`` (normalize, scale and shift in fp32, round last) or
    ``"llama"`` (normalize in fp32, round, then scale in the weight's dtype).
    :func:`normscope.reference.cast_affine` is the definition; a backend runs such a call exactly or
    declines it in ``why_not``.

    ``op`` names the torch op a layer stands for when two ops compute the same scope: GroupNorm(C, C)
    resolves to InstanceNorm's scope, but torch runs it through ``group_norm`` (more accurate in half
    precision, and it keeps channels_last), so ``op="group_norm"`` asks the aten backend for that op.
    """

    x: Tensor
    scope: Resolved
    weight: Tensor | None
    bias: Tensor | None
    eps: float
    mask: Tensor | None
    running: Running | None
    residual: Tensor | None = None
    weight_offset: float = 0.0
    residual_fp32: bool = False
    op: str | None = None
    casting: str = "torch"


Runner = Callable[[Call], Tensor]

#: ``entry(x, weight, bias, eps, running)``: a plan run on a layer's call, whose other fields are the
#: planned call's (see :func:`layer_entry`)
LayerEntry = Callable[[Tensor, "Tensor | None", "Tensor | None", float, "Running | None"], Tensor]


#: ``call_of((x, scope, weight, bias, eps, mask, running, residual, weight_offset, residual_fp32, op,
#: casting))``:
#: a :class:`Call` from all its fields, in order, without the NamedTuple's Python-level ``__new__``
#: (a frame that is a measurable share of a small layer's per-call cost); for the layers' hot path.
call_of = functools.partial(tuple.__new__, Call)


def _anything(call: Call) -> str | None:
    return None


class Backend(NamedTuple):
    """A way to run calls.

    * ``why_not(call)``: None when the backend runs ``call`` exactly (torch's numbers, or the
      reference's where torch has no op), else a short reason. Forced and automatic choice both ask.
    * ``prepare(call, automatic)``: the function that runs calls like ``call``; ``automatic`` says
      whether the engine chose it (a backend may guard an automatic run, see the aten backend). The
      function may carry a ``layer_entry`` attribute, the same run as ``entry(x, weight, bias, eps,
      running)``, which layers call without building a :class:`Call` (:func:`layer_entry`).
    * ``why_not_auto(call)``: asked only by the automatic order, after ``why_not``: a reason not to
      be *chosen* for a call it could run (a fast path not measured faster on this device).
    * ``fuses_residual``: it runs :func:`add_norm` calls itself (else the engine adds first).

    ``why_not``, ``why_not_auto`` and ``prepare`` may look only at the call's *signature* -- the
    resolved scope (shape included), dtype, device, which of mask, running statistics, weight,
    bias and residual are present and their shapes and dtypes, and which axes the mask broadcasts
    over -- because their answers are cached per signature (:func:`signature`). Strides are not in
    it: a backend handles any layout itself.
    """

    name: str
    why_not: Callable[[Call], str | None]
    prepare: Callable[[Call, bool], Runner]
    why_not_auto: Callable[[Call], str | None] = _anything
    fuses_residual: bool = False
