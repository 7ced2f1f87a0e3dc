"""ONNX export of models built from normscope layers.

Two exporters ship with torch, and both work (tested with onnxruntime, outputs within 1e-5):

* ``torch.onnx.export(model, args, dynamo=True)`` -- the ``torch.export``-based exporter (torch's
  default from 2.9 on; needs ``onnxscript``). It traces through the engine's Python dispatch
  (the backend choice and its cache run at trace time and leave only the chosen ATen ops in the
  graph), so nothing extra is needed.
* ``torch.onnx.export(model, args, f, dynamo=False)`` -- the TorchScript exporter, which torch deprecates. It has
  no conversion for ``aten::rms_norm`` (ONNX's ``RMSNormalization`` only exists from opset 23,
  beyond that exporter), which the engine uses for RMSNorm. :func:`register` adds one (the
  formula in ONNX ops); importing this module calls it, and :func:`export` is
  ``torch.onnx.export`` with the registration done first.

LayerNorm, GroupNorm and BatchNorm (eval) export as ATen's ops and become ONNX's
``LayerNormalization``, ``GroupNormalization``/``InstanceNormalization`` and
``BatchNormalization`` (or their decompositions). Masked normalization and the reference backend
export as plain arithmetic. :class:`normscope.SyncBatchNorm` exports like BatchNorm in eval mode
(inference never communicates).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["register", "export"]

_OPSETS = range(9, 21)  # the TorchScript exporter's opsets (it stops at 20)
_registered = [False]


def _rms_norm_symbolic(g, x, normalized_shape, weight, eps):
    """``aten::rms_norm`` as ONNX: x / sqrt(mean(x^2 over the last k axes) + eps) * weight."""
    from torch.onnx import symbolic_helper as sh

    k = len(sh._unpack_list(normalized_shape)) if sh._is_packed_list(normalized_shape) else len(
        sh._get_const(normalized_shape, "is", "normalized_shape")
    )
    # torch computes in the input's "opmath" type: float64 for float64 input, float32 for the rest
    # (half and bfloat16 included); its default eps is that type's machine epsilon
    typed = x.type()
    double = isinstance(typed, torch._C.TensorType) and typed.scalarType() == "Double"
    opmath = torch.float64 if double else torch.float32
    eps_v = sh._maybe_get_const(eps, "f")
    if sh._is_none(eps) or eps_v is None:
        eps_v = torch.finfo(opmath).eps
    axes = list(range(-k, 0))
    sq = g.op("Mul", x, x)
    if g.opset >= 18:
        ms = g.op("ReduceMean", sq, g.op("Constant", value_t=torch.tensor(axes, dtype=torch.long)), keepdims_i=1)
    else:
        ms = g.op("ReduceMean", sq, axes_i=axes, keepdims_i=1)
    eps_c = g.op("Constant", value_t=torch.tensor(float(eps_v), dtype=opmath))
    if g.opset >= 15:
        eps_c = g.op("CastLike", eps_c, x)
    y = g.op("Mul", x, g.op("Reciprocal", g.op("Sqrt", g.op("Add", ms, eps_c))))
    if not sh._is_none(weight):
        y = g.op("Mul", y, weight)
    return y


def register() -> None:
    """Teach the TorchScript exporter (``dynamo=False``) ``aten::rms_norm``. Idempotent."""
    if _registered[0]:
        return
    from torch.onnx import register_custom_op_symbolic

    for opset in _OPSETS:
        register_custom_op_symbolic("aten::rms_norm", _rms_norm_symbolic, opset)
    _registered[0] = True


def export(model: torch.nn.Module, args: Any, f: Any = None, **kwargs: Any) -> Any:
    """``torch.onnx.export`` after :func:`register`; same arguments and return value."""
    register()
    return torch.onnx.export(model, args, f, **kwargs)


register()
