"""The bench's peers besides torch eager and torch.compile: Liger-Kernel's Triton autograd
Functions, and the shims that let them run in Triton's CPU interpreter (``--interpret``)."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator

from .cases import EPS, GROUPS

PEERS = ("torch", "compile", "liger")
#: what each peer is, in words (the run's first line)
PEER_NAMES = {"torch": "PyTorch eager", "compile": "torch.compile", "liger": "Liger-Kernel"}
#: why a requested peer has no entry in a case's rows (recorded per row as ``declined``)
DECLINED = {
    "liger": {
        "batch_norm": "Liger-Kernel has no BatchNorm op",
        "batch_norm_cl": "Liger-Kernel has no BatchNorm op",
        "masked_batch_norm": "Liger-Kernel has no BatchNorm op",
        "instance_norm": "Liger-Kernel has no InstanceNorm op",
        "instance_norm_cl": "Liger-Kernel has no InstanceNorm op",
        "modulated_layer_norm": "Liger-Kernel's modulated op (LigerModulatedRMSNorm) is RMSNorm only",
        "qk_norm": "Liger-Kernel has no QK-norm op (its Gemma 3 RMSNorm subclass is applied per tensor, "
        "not q and k in one launch)",
        "derf": "Liger-Kernel has no Derf op",
    }
}
#: what a reader of a row must know about a peer that ran (recorded per row as that peer's ``note``)
NOTES = {
    "liger": {
        "modulated_rms_norm": "rounds RMSNorm(x) to the input dtype, then computes (1 + scale) and + shift in "
        "the input dtype (as eager does); normscope rounds once. Same values in fp32",
        "poly_norm": "forms x^3, x^2 and their mean squares in the input dtype; normscope in fp32, rounding "
        "once. Same values in fp32",
    }
}
#: the Liger-Kernel release the adapter (:func:`_liger_peers`) was checked against: API read, and
#: run on CPU in Triton's interpreter (benchmarks/README.md). Carry the same wheel to the GPU host
#: (it is pure Python; its one undeclared need, ``packaging``, is there already):
#:   python3 -m pip download --no-deps -d .whl liger-kernel==0.8.5
LIGER_CHECKED = "0.8.5"


def _liger_peers() -> tuple[dict[str, Callable] | None, str | None, str | None]:
    """Liger-Kernel's peers per case, its version, and why it is absent (None when present).

    The adapter calls Liger's Triton ``torch.autograd.Function`` classes directly (the ``nvidia-triton``
    implementation, which ``LigerLayerNorm`` / ``LigerRMSNorm`` / ``LigerGroupNorm`` /
    ``LigerFusedAddRMSNorm`` run on a GPU without the optional CuTe-DSL / cuTile packages) so that
    it gets the bench's own input, weight and bias tensors -- the same values, ``eps = EPS`` (Liger's
    modules default to 1e-6), and gradients for the same leaves. Checked against liger-kernel
    ``LIGER_CHECKED`` (0.8.5); signatures there:

    * ``LigerLayerNormFunction.apply(X, W, B, eps)``
    * ``LigerRMSNormFunction.apply(X, W, eps, offset, casting_mode, in_place, row_mode)``: offset
      0.0; casting_mode ``"gemma"`` -- everything in fp32, one rounding of the output, which is what
      normscope's kernel and ``F.rms_norm`` compute (the default ``"llama"`` rounds ``x * rstd`` to
      the input dtype before the weight multiply); ``in_place=True``, ``LigerRMSNorm``'s default:
      dx overwrites dy (each peer has its own cotangent here, so that is harmless), whereas
      ``in_place=False`` adds a ``zeros_like`` pass that no other peer pays
    * ``LigerFusedAddRMSNormFunction.apply(X, R, W, eps, offset, casting_mode, in_place)`` -> ``(Y, X + R)``:
      offset 0.0, ``"gemma"``, ``in_place=False`` (the module's default; its dx is ``empty_like``)
    * ``LigerGroupNormFunction.apply(X, W, B, num_channels, num_groups, eps)``: makes a
      channels_last input contiguous first and returns NCHW (its cost, measured as such)

    The modern cases (checked against 0.8.5 the same way):

    * ``LigerModulatedRMSNormFunction.apply(X, W, scale, shift, eps, offset, casting_mode, in_place)``
      (``modulated_rms_norm``): ``y = (1 + scale) * RMSNorm(x) + shift``, scale/shift (B, D) broadcast
      over x's (B, S, D) rows -- the formula of the bench's eager AdaLN. No weight (DiT's norm has
      none), offset 0.0, ``"gemma"`` casting, ``in_place=True`` (the default). Its rounding differs from
      normscope's in half precision: the norm is rounded to the input dtype, then ``(1 + scale)`` and
      ``+ shift`` are computed in the input dtype (as eager does); normscope rounds once
      (:data:`NOTES`). Identical in fp32.
    * ``LigerRMSNormFunction`` with offset 1.0 and ``"gemma"`` casting (``gemma_rms_norm``):
      ``(x32 * rstd * (1 + w32)).to(x.dtype)``, transformers' ``GemmaRMSNorm`` exactly.
    * ``LigerPolyNormFunction.apply(X, W, B, eps, in_place)`` (``poly_norm``): PolyCom's formula,
      ``w0 rms(x^3) + w1 rms(x^2) + w2 rms(x) + b``, weight (3,) in that order; its module
      initialises (1/3, 1/3, 1/3) and 1.0, as normscope's ``PolyNorm``. Its bias is 0-d (its backward
      returns a 0-d gradient), so the adapter passes the bench's (1,) bias as a 0-d view. It forms the
      powers in the input dtype (:data:`NOTES`).

    Liger's kernels keep a row in one block: N > 65536 raises ``RuntimeError`` (recorded as that
    peer's error for the row).
    """
    try:
        from liger_kernel.ops import (
            LigerFusedAddRMSNormFunction,
            LigerGroupNormFunction,
            LigerLayerNormFunction,
            LigerRMSNormFunction,
        )
    except Exception as exc:  # noqa: BLE001 - any failure to import means "not measured", with the reason
        return None, None, f"{type(exc).__name__}: {exc}"
    try:
        from importlib.metadata import version

        ver = version("liger-kernel")
    except Exception:  # noqa: BLE001 - a copy without its dist-info
        ver = "unknown"
    peers = {
        "layer_norm": lambda x, w, b: LigerLayerNormFunction.apply(x, w, b, EPS),
        "rms_norm": lambda x, w: LigerRMSNormFunction.apply(x, w, EPS, 0.0, "gemma", True, None),
        "add_rms_norm": lambda x, r, w: LigerFusedAddRMSNormFunction.apply(x, r, w, EPS, 0.0, "gemma", False),
        "group_norm": lambda x, w, b: LigerGroupNormFunction.apply(x, w, b, x.shape[1], GROUPS, EPS),
    }
    peers["group_norm_cl"] = peers["group_norm"]
    try:  # the modern ops: absent from older releases, which still measure the others
        from liger_kernel.ops import LigerModulatedRMSNormFunction, LigerPolyNormFunction
    except ImportError:
        return peers, ver, None
    peers["modulated_rms_norm"] = lambda x, shift, scale: LigerModulatedRMSNormFunction.apply(
        x, None, scale, shift, EPS, 0.0, "gemma", True
    )
    peers["gemma_rms_norm"] = lambda x, w: LigerRMSNormFunction.apply(x, w, EPS, 1.0, "gemma", True, None)
    peers["poly_norm"] = lambda x, w, b: LigerPolyNormFunction.apply(x, w, b.reshape(()), EPS, True)
    return peers, ver, None


@contextlib.contextmanager
def _interpreter_shims() -> Iterator[None]:
    """Make Triton 3.6's CPU interpreter run what the GPU compiler runs (``--interpret`` only; undone on exit).

    1. NumPy >= 2.4 refuses ``int(array_of_shape_(1,))`` in loops with runtime bounds: normscope's
       own fix, which the kernels apply when imported under the interpreter (kernels/_common.py).
    2. The interpreter passes float kernel arguments as Python floats, where the compiler passes
       fp32 scalars: Liger's ``eps.to(tl.float32)`` fails on them. Wrap them as fp32 scalars.
    3. ``triton.language.extra.libdevice`` functions have no body in the interpreter (they return
       None): Liger imports ``rsqrt`` from there. Point its modules' ``rsqrt`` at ``tl.rsqrt``.

    Left as is: the interpreter does bf16 arithmetic on the raw 16-bit integers, so a kernel that
    computes in bf16 without converting first (Liger's fused add + RMSNorm adds ``X + R``, its
    GroupNorm sums ``X``, in bf16) computes garbage on CPU: the check flags it, :func:`problems`
    leaves it out with ``--interpret``; on a GPU that is real bf16 arithmetic, and checked as such.
    """
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    # importing the kernels under the interpreter (TRITON_INTERPRET=1 is set before Triton is: see
    # _use_interpreter) applies normscope's own fix of 1.
    import normscope.kernels.rows  # noqa: F401
    cvt = interpreter._implicit_cvt

    def implicit_cvt(arg):
        if isinstance(arg, float):
            return tl.tensor(interpreter.TensorHandle(np.array([arg], dtype=np.float32), tl.float32), tl.float32)
        return cvt(arg)

    def rsqrt(x):  # looked up at call time, inside a kernel, where the interpreter has patched tl
        return tl.rsqrt(x)

    undo = [(interpreter, "_implicit_cvt", cvt)]
    interpreter._implicit_cvt = implicit_cvt
    for name in ("layer_norm", "rms_norm", "fused_add_rms_norm", "group_norm", "modulated_rms_norm", "poly_norm"):
        mod = sys.modules.get(f"liger_kernel.ops.{name}")
        if mod is not None and hasattr(mod, "rsqrt"):
            undo.append((mod, "rsqrt", mod.rsqrt))
            mod.rsqrt = rsqrt
    try:
        yield
    finally:
        for obj, attr, old in reversed(undo):
            setattr(obj, attr, old)
