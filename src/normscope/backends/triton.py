"""The ``"triton"`` backend: the one door into the fused kernels of :mod:`normscope.kernels`.

Every Triton op -- LayerNorm/RMSNorm rows, the fused residual add + RMSNorm, GroupNorm/InstanceNorm
groups, BatchNorm channels, and the modern norms' kernels (the modulated AdaLN norm, zero-centred
weights; see the end of this module) -- is reached only through here, and this module enforces the kernels'
contract so that a call either gives torch's numbers or is declined with its reason:

* **layout**: the kernels read a canonical view (unit-stride rows; contiguous or channels_last
  (N, C, *); contiguous (outer, C, inner)). Inputs of any other strides -- sliced, transposed,
  expanded (stride 0), offset storage -- are copied once by the kernel entry points, which also
  pass weights, biases and running buffers through :func:`normscope.kernels._common.dense` (a view
  such as ``base[::2]`` or ``g.expand(n)`` is materialised: C elements, not the activation); masks
  are made contiguous here. Outputs of the engine's calls are laid out by the engine as torch.nn's
  namesake lays them out, whatever the backend (:func:`normscope._strides.output_layout`); the modern
  ops here, which the engine does not run, keep a channels_last input's layout (:func:`_in_layout`).
* **dtypes**: float32/float16/bfloat16 input (statistics in fp32); anything else is declined.
* **scopes**: the last axes with a per-element affine (rows), (N, C, *) groups with a per-channel
  affine, per-channel statistics over every other axis (BatchNorm, masked too). Scopes of zero
  elements, masks on other scopes, running statistics on other scopes are declined; an empty batch runs
  on the reference, no kernel launched.
* **devices**: CUDA tensors; CPU tensors only under ``TRITON_INTERPRET=1`` (how the tests run them).
* **double backward**: the kernels' backward is a closed form; when autograd asks for a
  differentiable one (``create_graph=True``) the kernel modules differentiate their plain-PyTorch
  reference of the same call instead (see ``kernels/rows.py``'s ``_backward``), so gradient
  penalties work.

Automatic choice (:mod:`.measured`): only on CUDA, and only for an op, dtype and scope size that a
committed ``normscope bench`` table for this device class shows faster than ATen. With no table the
kernels are opt-in: ``use_backend("triton")``, ``backend="triton"`` or ``NORMSCOPE_BACKEND=triton``.
Which kernel of a family runs -- the default or a candidate (``rows_once``, ``split``, ``onchip``) -- is
:mod:`normscope.kernels.variants`'s choice, made per call: a ``use_variant`` block, a pin, the variant a
row of the same table names (none does), else the default.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from .. import engine
from .. import reference as ref
from .._strides import like_input
from ..engine import Backend, Call, Runner
from ..kernels import variants  # which kernel variant runs: imports no Triton (the kernels load lazily)
from . import aten, measured
from ._layout import channels_last

NAME = "triton"
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@engine.constant_when_compiled
def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def why_not(call: Call) -> str | None:
    """None when a kernel runs ``call`` exactly, else the reason it cannot."""
    x = call.x
    if not (x.device.type == "cuda" or x.device.type == "cpu" and _interpreting()):
        return (
            f"the Triton kernels run on CUDA tensors, got a {x.device.type} tensor (on CPU they run only "
            "under TRITON_INTERPRET=1)"
        )
    if x.dtype not in _DTYPES:
        return f"the kernels take float32/float16/bfloat16 input, got {x.dtype} (they accumulate in fp32)"
    s = call.scope
    if any(s.shape[d] == 0 for d in s.reduce if d != 0):
        # as the rows backend: a layer's own size (RMSNorm(0)) -- a batch that came empty (axis 0, which
        # BatchNorm's scope spans too) is taken, see prepare
        return "scopes of zero elements (a normalized size of 0), which have nothing to normalize"
    kind = _kind(s)
    if kind is None:
        return (
            "no kernel for this scope: kernels exist for the last axes with a per-element affine "
            "(LayerNorm/RMSNorm), for (N, C, *) groups with a per-channel affine (GroupNorm/InstanceNorm) "
            "and for per-channel statistics over every other axis (BatchNorm)"
        )
    if call.residual is not None:
        if kind[0] != "rows" or s.centered or call.bias is not None:
            return "the fused residual add has a kernel only for RMSNorm over the last axes, without bias"
        if call.residual.dtype not in _DTYPES:
            return f"the kernels take a float32/float16/bfloat16 residual, got {call.residual.dtype}"
    if call.residual is None and (call.casting != "torch" or call.weight_offset != 0.0):
        return "the model families' casting orders run on the other backends (forced: functional_modern's door)"
    if call.mask is not None and kind[0] != "channels":
        return "masked normalization has a kernel only for BatchNorm scopes (per-channel statistics)"
    if call.running is not None and kind[0] != "channels":
        return "running statistics have a kernel only for BatchNorm scopes"
    if call.running is not None and not call.running.use_input_stats:
        if call.running.mean is None or call.running.var is None:
            return "evaluation with running statistics needs running mean and var"
    return None


def why_not_auto(call: Call) -> str | None:
    """The automatic order takes a kernel only where a committed measurement shows it faster."""
    if call.x.device.type != "cuda":
        return "the kernels are chosen automatically only for CUDA tensors (here: forced, in the interpreter)"
    return measured.why_not(op_name(call), call.x.dtype, call.scope.count, call.x.device)


def op_name(call: Call) -> str:
    """The measured-choice table's name for the kernel that runs ``call``."""
    kind = _kind(call.scope)[0]
    if kind == "rows":
        if call.residual is not None:
            return "fused_add_rms_norm"
        return "layer_norm" if call.scope.centered else "rms_norm"
    if kind == "groups":
        return "group_norm"
    return "masked_batch_norm" if call.mask is not None else "batch_norm"


def _kind(s) -> tuple[str, int] | None:
    """("rows", 0), ("groups", G), ("channels", d) or None: the kernel view of a resolved scope, its
    classification (:attr:`normscope.scope.Resolved.form`) read in the kernels' order."""
    f = s.form
    if f.rows and f.trailing:
        return "rows", 0
    if s.centered and f.channel is not None:
        return "channels", f.channel  # BatchNorm: statistics per index of axis d over every other axis
    if f.sample_groups:
        return "groups", s.groups  # GroupNorm(G, C); G = 1: LayerNorm over (C, *), per-channel affine
    if f.instance:
        return "groups", s.shape[1]  # InstanceNorm: one group per channel
    return None


def prepare(call: Call, automatic: bool) -> Runner:
    kernel = _kernel_runner(call)
    # torch's CPU batch_norm kernel (BatchNorm's, InstanceNorm's) gives a scope of zero variance rstd 0
    # when eps == 0 -- the bias and zero gradients, not 1 / sqrt(0)'s NaN, which the kernels' rsqrt(var +
    # eps) gives, as torch's CUDA kernels do (reference.constant_gives_bias: CPU tensors, the
    # interpreter's). eps is no part of a plan's signature, so the call is told at run time, and runs on
    # the reference, which computes it so
    eps_zero_bias = ref.constant_gives_bias(call.scope, call.op, call.x.device)
    # an empty batch (an MoE expert given no tokens): no kernel launches on it, and torch returns it; the
    # reference gives the empty output and its gradients. A forced backend that refused it made a model
    # fail on one batch in many (scopes of zero elements are declined: see why_not)
    empty = any(n == 0 for n in call.scope.shape)

    def run(c: Call) -> Tensor:
        # torch.func transforms (vmap, grad, jvp, ...) and forward-mode AD's dual tensors: the kernels are
        # custom ops and autograd.Functions with neither batching nor forward-derivative rules (functorch's
        # "Cannot access storage of TensorWrapper", "must implement the jvp function"); the reference's
        # plain ops run there, as torch's own norms do. Asked at run time: one plan serves calls inside
        # transforms and out of them
        if empty or engine.transformed_eagerly() or eps_zero_bias and c.eps == 0:
            return engine.recompute(c)
        return kernel(c)

    if not automatic or call.residual is not None or aten.why_not(call) is not None:
        return run
    torch_op = aten.prepare(call, False)

    def run_auto(c: Call) -> Tensor:
        # Under autocast torch's layer_norm and group_norm run in fp32 (autocast casts their inputs: a
        # bf16 LayerNorm gives fp32 output), which the kernels, custom ops, do not: a choice made for
        # speed hands such a call to torch's op, the same op autocast sees in torch.nn's layer. Asked at
        # run time: the plan of a signature is made once, inside autocast or out of it
        if torch.is_autocast_enabled(c.x.device.type) or engine.transformed_eagerly():
            # and under transforms (see run above) torch's op, the one torch.nn's layer runs there
            engine.report_backend(aten.NAME)
            return torch_op(c)
        return run(c)

    return run_auto


def _table_variant(call: Call) -> str | None:
    """The kernel variant (:mod:`normscope.kernels.variants`) the committed measured-choice table of the
    call's device class names for its op, dtype and scope size: None -- the family's default kernel --
    unless a GPU measurement put a candidate there (no table is committed off CUDA, and none names a
    candidate yet). A ``use_variant`` block or a pin in kernels/config.py overrides it when the call runs."""
    x = call.x
    n = call.scope.count
    if engine.symbolic((n,)):
        return None
    return _measured_variant(op_name(call), x.dtype, int(n), x.device)


@engine.constant_when_compiled
def _measured_variant(op: str, dtype: torch.dtype, n: int, device: torch.device) -> str | None:
    # a constant under torch.compile: the table is read once, eagerly, not traced (its first read loads a file)
    return measured.variant(op, dtype, n, device)


def _kernel_runner(call: Call) -> Runner:
    kind, arg = _kind(call.scope)
    centered = call.scope.centered
    # the kernel families' entry points (kernels/variants.py), each on the variant that a use_variant block, a pin
    # or the table names -- the default kernels unless one does; asked per call, so an override reaches plans made
    # before it. The kernel modules -- and with them Triton, which reads TRITON_INTERPRET -- load on first use
    variant = _table_variant(call)
    if kind == "channels":
        d = arg

        def run_channels(c: Call) -> Tensor:
            r, w, b = c.running, c.weight, c.bias
            if r is not None and not r.use_input_stats:
                return variants.batch_norm(c.x, d, w, b, c.eps, r.mean, r.var, variant=variant)[0]
            pos_mask = None
            if c.mask is not None:
                pos_mask = engine.position_mask(c.mask, c.x, d)
                if pos_mask is None:  # the mask varies along the channel axis: no kernel for that
                    return engine.recompute(c)  # runs the reference and says so in last_backend()
                pos_mask = pos_mask.contiguous()  # the kernel reads one flag per position from memory
            y, mean, var, count = variants.batch_norm(c.x, d, w, b, c.eps, mask=pos_mask, variant=variant)
            if r is not None:  # the engine's own update rule (unbiased variance, momentum)
                shape = c.scope.stat_shape
                n = count if pos_mask is not None else c.scope.count
                engine.update_running(c, ref.Moments(mean.reshape(shape), var.reshape(shape), n))
            return y

        return run_channels
    if kind == "groups":

        def run_groups(c: Call) -> Tensor:
            return variants.group_norm(c.x, arg, c.weight, c.bias, c.eps, centered, variant=variant)

        return run_groups
    n = call.scope.count
    if call.residual is not None:

        def run_fused(c: Call) -> tuple[Tensor, Tensor]:
            y, s = variants.rows_norm(
                c.x,
                c.weight,
                None,
                c.eps,
                False,
                residual=c.residual,
                weight_offset=c.weight_offset,
                residual_fp32=c.residual_fp32,
                n=n,
                variant=variant,
            )
            return _in_layout(c.x, y), _in_layout(c.x, s)

        return run_fused

    def run_rows(c: Call) -> Tensor:
        # contiguous: the engine lays it out as torch's namesake (normscope._strides.output_layout)
        return variants.rows_norm(c.x, c.weight, c.bias, c.eps, centered, n=n, variant=variant)[0]

    return run_rows


BACKEND = Backend(NAME, why_not, prepare, why_not_auto, fuses_residual=True)


# ----------------------------------------------------------------------------------------------
# the modern norms' fused kernels (normscope.functional_modern): opt-in, reached only when the
# "triton" backend is forced (backend=, use_backend, NORMSCOPE_BACKEND) -- no measurement yet shows
# them faster on any device, so the automatic order never picks them


def why_not_rows_op(x: Tensor, n: int, *others: Tensor | None, max_n: int | None = None) -> str | None:
    """None when a modern rows kernel can run on ``x`` (rows of ``n`` elements) with ``others``
    (weights, modulations) beside it, else the reason."""
    if not (x.device.type == "cuda" or x.device.type == "cpu" and _interpreting()):
        return (
            f"the Triton kernels run on CUDA tensors, got a {x.device.type} tensor (on CPU they run only "
            "under TRITON_INTERPRET=1)"
        )
    if x.dtype not in _DTYPES:
        return f"the kernels take float32/float16/bfloat16 input, got {x.dtype} (they accumulate in fp32)"
    for t in others:
        if t is not None and (t.device != x.device or t.dtype not in _DTYPES):
            return f"every tensor must be float32/float16/bfloat16 on {x.device}, got {t.dtype} on {t.device}"
    if max_n is not None and n > max_n:
        return f"rows of {n} elements: this kernel keeps a row in registers, up to {max_n}"
    return None


def _in_layout(x: Tensor, y: Tensor) -> Tensor:
    """``y`` (a kernel's output, contiguous) in ``x``'s channels_last layout where ``x`` has one: the
    output layout of every backend, so a path never shows in the strides of what it returns."""
    fmt = channels_last(x)
    return y if fmt is None else y.contiguous(memory_format=fmt)


def _refuse(op: str, why: str) -> ValueError:
    return ValueError(f"backend {NAME!r} cannot run {op}: {why}")


def modulated_norm(
    x: Tensor,
    shift: Tensor | None,
    scale: Tensor | None,
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float,
    centered: bool,
) -> Tensor:
    """The fused AdaLN kernel (:func:`normscope.kernels.modern.modulated_rows`), or ValueError why not."""
    from ..kernels import config
    from ..kernels import modern as mk

    why = why_not_rows_op(x, x.shape[-1], shift, scale, weight, bias, max_n=config.ROWS_MAX_FUSED_N)
    if why is not None:
        raise _refuse("modulated_norm", why)
    engine.report_backend(NAME)  # last_backend(): this op ran on the kernels (or, empty, their reference)
    return _in_layout(x, mk.modulated_rows(x, shift, scale, weight, bias, eps, centered))


def offset_rows_norm(
    x: Tensor, n: int, weight: Tensor | None, bias: Tensor | None, eps: float, centered: bool, weight_offset: float
) -> Tensor:
    """Norm over the last ``n`` elements with the scale ``weight + weight_offset`` formed in fp32 in
    the kernel (never rounded to bf16: Liger #1462) and the result rounded once: Gemma's casting."""
    from ..kernels import rows

    why = why_not_rows_op(x, n, weight, bias)
    if why is not None:
        raise _refuse("a zero-centred-weight norm", why)
    engine.report_backend(NAME)
    return _in_layout(x, rows.rows_norm(x, weight, bias, eps, centered, weight_offset=weight_offset, n=n)[0])


def qk_norm(
    q: Tensor,
    k: Tensor,
    n: int,
    weights: tuple[Tensor | None, Tensor | None, Tensor | None, Tensor | None],
    eps: float,
    centered: bool,
    weight_offset: float,
) -> tuple[Tensor, Tensor]:
    """q and k normalized over rows of ``n`` elements in one launch (:func:`normscope.kernels.modern.qk_rows`)."""
    from ..kernels import config
    from ..kernels import modern as mk

    why = why_not_rows_op(q, n, k, *weights, max_n=config.ROWS_MAX_FUSED_N)
    if why is None and (q.dtype != k.dtype or len({w.dtype for w in weights if w is not None}) > 1):
        # name every dtype that takes part: the weights' are the ones that differ when q's and k's agree
        names = ("q_weight", "k_weight", "q_bias", "k_bias")
        got = "".join(f", {name} {w.dtype}" for name, w in zip(names, weights) if w is not None)
        why = f"q and k of one dtype and weights of one dtype, got q {q.dtype}, k {k.dtype}{got}"
    if why is not None:
        raise _refuse("qk_norm", why)
    engine.report_backend(NAME)
    qn, kn = mk.qk_rows(q, k, n, *weights, eps, centered, weight_offset)
    return _in_layout(q, qn), _in_layout(k, kn)


def poly_norm(x: Tensor, weight: Tensor, bias: Tensor, eps: float) -> Tensor:
    """PolyNorm in one launch forward and one backward (:func:`normscope.kernels.modern.poly_rows`)."""
    from ..kernels import config
    from ..kernels import modern as mk

    why = why_not_rows_op(x, x.shape[-1], weight, bias, max_n=config.ROWS_MAX_FUSED_N)
    if why is not None:
        raise _refuse("poly_norm", why)
    engine.report_backend(NAME)
    return _in_layout(x, mk.poly_rows(x, weight, bias, eps))


def derf(x: Tensor, alpha: Tensor, shift: Tensor, weight: Tensor | None, bias: Tensor | None) -> Tensor:
    """Derf, element-wise over rows (:func:`normscope.kernels.modern.derf_rows`); features on the last axis."""
    from ..kernels import config
    from ..kernels import modern as mk

    why = why_not_rows_op(x, x.shape[-1], alpha, shift, weight, bias, max_n=config.ROWS_MAX_FUSED_N)
    if why is None and (weight is None) != (bias is None):
        why = "the kernel takes both weight and bias, or neither"
    if why is not None:
        raise _refuse("derf", why)
    engine.report_backend(NAME)
    # element-wise: laid out as torch's element-wise ops lay out x's output (the other backends' composition)
    return like_input(x, mk.derf_rows(x, alpha, shift, weight, bias))
