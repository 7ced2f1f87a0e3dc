"""The ``"aten"`` backend: PyTorch's own fused ops, for the scopes that are exactly one of them.

``layer_norm``, ``rms_norm``, ``batch_norm`` (channel axis 1, or the last axis of a (..., C)
input), ``instance_norm`` and ``group_norm``: a scope runs here only when one of these computes it
exactly (same reduced axes, same affine axes, no mask). Then the numbers are torch's, bit for bit.

One guard, only when the engine *chooses* ATen for an fp32 CPU call: torch's CPU kernels apply a
normalization as one multiply-add, ``y = x * (rstd*w) + (b - mean*rstd*w)``. When ``|mean| * rstd``
is large both terms are huge and cancel: at mean 1e4, std 1e-2 they are ~1e6, whose fp32 spacing
(0.06) is a few percent of the output's unit spread, although the statistics themselves are
accurate. Such inputs are rare and show in the statistics the kernels return anyway, so the
automatic runner asks the native op for them and, for the rare call where a scope cancels
(``|mean| * rstd`` past 1024), recomputes it in the ``(x - mean) * rstd`` form of the reference, in
float64 (the fp32 sums of such an input lose what float64 keeps; see
:func:`normscope.engine.recompute`), and takes from that only the cancelling scopes' values: every
other scope keeps torch's bits, whatever it is batched with. A *forced* ``"aten"`` stays exactly torch.
"""

from __future__ import annotations

import ctypes
import functools
import math
import struct
import sys
import warnings
from collections.abc import Callable

import torch
from torch import Tensor

from .. import engine
from .. import reference as ref
from .._strides import strides_like_channels_last
from ..engine import Backend, Call, LayerEntry, Runner, Running
from ._layout import channels_last, reduced_last

NAME = "aten"

_CANCEL_LIMIT = 1024.0  # output error <~ 1024 * 2**-24 = 6e-5 of a unit, variance error <~ 1e-4
#: the input dtypes whose CPU kernels are guarded. The half types' kernels cancel too: a (near-)constant
#: scope at a large offset -- bf16 rows of mean 3e4 and std 10, constant once rounded -- came out 0.44
#: (bf16; fp16 at 1e4: 0.08) off the float64 result, where fp32 sums of the same values give the bias
#: exactly; measured, they part from the fp32 formula only past |mean| * rstd ~ 8800 (fp16), 3e5 (bf16)
_GUARDED = (torch.float32, torch.bfloat16, torch.float16)


def kind(call: Call) -> str | None:
    """Which ATen op computes this call exactly, or None: the scope's classification
    (:attr:`normscope.scope.Resolved.form`) read in ATen's order of preference."""
    s = call.scope
    if call.mask is not None or not s.centered and call.running is not None:
        return None
    f, ndim = s.form, len(s.shape)
    batch_stats = call.running is None or call.running.use_input_stats
    if s.centered and s.count == 1 and batch_stats and call.op != "group_norm":
        # a scope of one element (normalize over an axis of size 1): the exact answer is 0 before the
        # affine. torch's batch_norm kernel (BatchNorm's, InstanceNorm's: batch_norm over (1, N * C, 1))
        # gives such a scope's x - mean up to 1e-4 off 0 -- its one-value mean is not the value --
        # where layer_norm and group_norm give 0. Over the last axes, layer_norm; else the reference
        return "layer_norm" if f.rows else None
    one_per_channel = ndim == 2 and not s.reduce and s.affine in ((1,), ())  # GroupNorm(C, C) on (N, C)
    if (
        call.op == "group_norm"
        and call.running is None
        and s.centered
        and (f.sample_groups or f.instance or one_per_channel)
    ):
        # a GroupNorm layer's call: torch runs group_norm even where another op has the same scope
        # (GroupNorm(C, C) is InstanceNorm's scope; GroupNorm(1, C) on (N, C) is LayerNorm's; GroupNorm(C, C)
        # on (N, C) a scope of one element, which torch takes: the output is the bias)
        return "group_norm"
    if s.centered and f.channel is not None:
        if f.channel == 1:
            return "batch_norm"
        if f.channel == ndim - 1:
            return "batch_norm_last"
    if s.centered and f.instance:
        return "instance_norm"
    if call.running is not None:
        return None
    if f.rows:
        if s.centered:
            return "layer_norm"
        if call.bias is None:
            return "rms_norm"
    # torch.group_norm splits axis 1: a grouping of any other axis is not its op
    if s.centered and f.sample_groups:
        return "group_norm"  # groups of channels (also one group: LayerNorm with per-channel affine)
    return None


def _family(call: Call) -> bool:
    """A model family's options (:class:`normscope.engine.Call`): torch's op normalizes in fp32 without
    affine, :func:`normscope.reference.cast_affine` does the rest."""
    return call.casting != "torch" or call.weight_offset != 0.0


def why_not(call: Call) -> str | None:
    if _family(call) and call.residual is None and kind(call._replace(bias=None)) not in ("layer_norm", "rms_norm"):
        return "the model families' casting orders are for LayerNorm/RMSNorm scopes"
    if kind(call) is None:
        if call.mask is not None:
            return "ATen has no masked normalization"
        return "no ATen op computes this scope exactly"
    return None


def _cudnn() -> bool:
    # read per call, as torch.nn.functional does: users toggle cuDNN at run time. batch_norm and
    # instance_norm only: ATen ignores layer_norm's and group_norm's flag (deprecated), and not
    # reading it spares a compiled graph four guards (see normscope.hot, on a traced call)
    return torch.backends.cudnn.enabled


def _static(sizes: list) -> list:
    """Sizes as Python ints. Under the TorchScript tracer (ONNX export with ``dynamo=False``) ``x.shape`` holds
    0-d tensors, and a traced ``normalized_shape`` cannot be exported with a dynamic axis; the
    normalized axes are fixed by the layer's weight anyway, so freeze them (once, at prepare)."""
    if not any(isinstance(n, Tensor) for n in sizes):
        return sizes  # ints, or SymInts under torch.export (left symbolic)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        return [int(n) if isinstance(n, Tensor) else n for n in sizes]


def _running(r: Running | None) -> tuple:
    return (None, None, True, 0.0) if r is None else (r.mean, r.var, r.use_input_stats, r.momentum)


def prepare(call: Call, automatic: bool) -> Runner:
    if _family(call):
        return _runner(_family_entry(call, automatic))
    entry = _plain(call)
    if automatic:
        entry = _guard_cancellation(call, entry)
    return _runner(entry)


def _family_entry(call: Call, automatic: bool) -> LayerEntry:
    """A family's call: torch's op on the fp32 (fp64) input without affine -- the families' modules
    normalize exactly so, ``x32 * rsqrt(x32.pow(2).mean(-1) + eps)`` for RMSNorm -- then the family's
    affine and rounding (:func:`normscope.reference.cast_affine`)."""
    acc = ref.acc_dtype(call.x.dtype)
    plain = call._replace(x=engine.stand_in(tuple(call.x.shape), acc, call.x.device), weight=None, bias=None)
    plain = plain._replace(weight_offset=0.0, casting="torch")
    inner = _plain(plain)
    if automatic:
        inner = _guard_cancellation(plain, inner)
    s, offset, casting, cast_affine = call.scope, call.weight_offset, call.casting, ref.cast_affine
    w = call.weight
    if kind(plain) == "rms_norm" and (w is None or w.shape == tuple(s.shape[d] for d in s.reduce)):
        # the same bits in fewer ops (a small layer's cost is its op count): torch's rms_norm is
        # ``(x32 * r) * w32`` rounded once -- Gemma's order with ``w32 + offset`` as the weight, and
        # Llama's ``w * (x * r)`` itself when nothing is rounded between (fp32 input and weight) --
        # and without a weight ``(x32 * r)`` rounded to x's dtype, Llama's normalized value
        if offset == 0.0 and call.x.dtype == acc and (w is None or w.dtype == acc):
            return _plain(call._replace(weight_offset=0.0, casting="torch"))
        if casting == "llama" and offset == 0.0:
            rounded = _plain(call._replace(weight=None, weight_offset=0.0, casting="torch"))

            def llama(x: Tensor, w: Tensor | None, b: Tensor | None, eps: float, r: Running | None) -> Tensor:
                y = rounded(x, None, None, eps, None)
                return y if w is None else w * y

            return llama
        if casting != "llama":
            tail, moved = reduced_last(s)
            if not moved and acc == torch.float32 and call.x.dtype in _NARROW:
                # the common case (a half-precision input, the last axes): torch's op itself between
                # the two casts, each cast by its own method -- ``x.to(dtype)`` parses its arguments
                # in Python, ~1 us a call, a tenth of a small layer's cost (benchmarks/families.py)
                shape = _static([s.shape[d] for d in s.reduce])
                narrow = _NARROW[call.x.dtype]

                def gemma_half(x: Tensor, w: Tensor | None, b: Tensor | None, eps: float, r: Running | None) -> Tensor:
                    if w is not None:
                        w = w if w.dtype == acc else w.float()
                        w = w + offset if offset else w  # offset 0: the scale is the weight (as fp32 above)
                    return narrow(torch.rms_norm(x.float(), shape, w, eps))

                return gemma_half

            def gemma(x: Tensor, w: Tensor | None, b: Tensor | None, eps: float, r: Running | None) -> Tensor:
                # the casts only where they change a dtype: a no-op ``.to`` is still a dispatch, ~10 %
                # of a small layer's call
                if w is not None:
                    w = w if w.dtype == acc else w.to(acc)
                    w = w + offset if offset else w  # offset 0: the scale is the weight (as fp32 above)
                if x.dtype == acc:
                    return inner(x, w, None, eps, None)
                return inner(x.to(acc), w, None, eps, None).to(x.dtype)

            return gemma

    def run(x: Tensor, w: Tensor | None, b: Tensor | None, eps: float, r: Running | None) -> Tensor:
        return cast_affine(inner(x.to(acc), None, None, eps, None), s, w, b, offset, casting, x.dtype)

    return run


#: a half-precision tensor's cast back from fp32, by its method (:func:`_family_entry`)
_NARROW = {torch.bfloat16: Tensor.bfloat16, torch.float16: Tensor.half}


def _runner(entry: LayerEntry) -> Runner:
    """The runner of ``entry(x, weight, bias, eps, running)``, the form every runner here is written
    in: a layer's hot path calls the entry itself (:func:`normscope.engine.layer_entry`) and builds
    no :class:`Call` -- building one is ~1 us of a small layer's ~15 us call
    (``benchmarks/cpu_overhead.py``). The planned call's other fields are fixed by the plan: no
    mask, no residual (``kind``), ``op`` read at planning only."""

    def run(c: Call) -> Tensor:
        return entry(c.x, c.weight, c.bias, c.eps, c.running)

    run.layer_entry = entry
    return run


def _bn_layout(call: Call) -> tuple[Callable[..., tuple] | None, bool]:
    """How a CPU BatchNorm call's tensors are laid out for ATen's kernels: ``(fix, always)``, where
    ``fix(x, w, b, r) -> (x, w, b, r)`` is called on every call (``always``) or on a non-contiguous input
    only -- the common call asks one ``is_contiguous`` -- and is None where nothing needs it (another
    device). Two of ATen's CPU kernels go wrong on some strides:

    * **Views misread** (fp32/fp64): the backward's channels-last kernel -- an input with one
      position per channel ((N, C), (N, C, 1), every ``channel_dim=-1`` call, run as (rows, C)) or a
      channels_last one -- reads the weight, and in evaluation the running statistics, as contiguous
      memory: an expanded or strided one gives an input gradient off by up to ~1e38 (read past the
      tensor; torch.nn's own layer gives the same). They are made contiguous there (an evaluation
      reads its running statistics only; a training call updates its own in place, and its backward
      reads the batch's statistics), and the bias is then read through a stride, which keeps the
      forward on torch.nn's kernel (:func:`_read_through_a_stride`). Elsewhere they are left as
      given: the half types' kernels read them right.
    * **Evaluation of an input in neither contiguous layout** (a channel slice of a larger batch,
      ``h.chunk(2, dim=1)``'s halves; every dtype): ATen takes another kernel -- on an Intel Xeon
      1.3-2.4x further from float64 (rms error of output and input gradient, fp32/fp16/bf16), on an AMD
      EPYC about as near (its fp32 output 1.3x nearer at (24, 3)) -- and a sample
      alone -- contiguous: its one-sample batch stride is never read -- would take the contiguous
      one, so its result would depend on its batch (torch.nn's own layer gives it other bits in and
      out of its batch). Such an input runs as a contiguous copy: evaluation normalizes each element
      by its channel's running statistics, a per-sample norm held to batch invariance.

    Decided at planning what the signature fixes (device, dtype, shape); the layouts per call."""
    x0 = call.x
    if x0.device.type != "cpu":
        return None, False
    wide = x0.dtype in (torch.float32, torch.float64)
    one_position = kind(call) == "batch_norm_last" or x0.dim() <= 2 or math.prod(x0.shape[2:]) == 1

    def fix(
        x: Tensor, w: Tensor | None, b: Tensor | None, r: Running | None
    ) -> tuple[Tensor, Tensor | None, Tensor | None, Running | None]:
        evaluation = r is not None and not r.use_input_stats and r.mean is not None
        fmt = channels_last(x)  # None for a contiguous input, and for one in neither layout
        if fmt is None and evaluation and not x.is_contiguous():
            x = x.contiguous()
        if not wide or not (one_position or fmt is not None):
            return x, w, b, r
        # the channels-last kernel (fp32/fp64): its weight and an evaluation's statistics contiguous
        copied = False
        if w is not None and not w.is_contiguous():
            w, copied = w.contiguous(), True
        if evaluation and not (r.mean.is_contiguous() and r.var.is_contiguous()):
            r, copied = r._replace(mean=r.mean.contiguous(), var=r.var.contiguous()), True
        if copied and (b is None or b.is_contiguous()) and (r is None or r.mean is None or _contiguous_stats(r)):
            b = _read_through_a_stride(b, x.shape[1], w if w is not None else x)
        return x, w, b, r

    return fix, wide and one_position


def _contiguous_stats(r: Running) -> bool:
    return r.mean.is_contiguous() and r.var.is_contiguous()


def _read_through_a_stride(b: Tensor | None, channels: int, like: Tensor) -> Tensor:
    """``b`` (zeros for None) as a view with stride 2. torch.nn's call with a view among its weight,
    bias and running statistics takes ATen's elementwise forward (``x * alpha + beta`` by
    TensorIterator), which rounds otherwise than the all-contiguous kernel, by an ulp. Where
    :func:`_bn_layout` made the weight or statistics contiguous for the backward's sake, a bias read
    through a stride keeps the forward on torch.nn's kernel, so its bits stay torch's: the backward
    never reads the bias, and a zero bias adds nothing (``beta = 0 - mean * alpha``)."""
    if b is None:
        return like.new_zeros(2 * channels)[::2]
    return torch.stack((b, b), 1)[:, 0]


def _plain(call: Call) -> LayerEntry:
    k, s = kind(call), call.scope
    layout, always = _bn_layout(call) if k in ("batch_norm", "batch_norm_last") else (None, False)
    if k == "batch_norm":

        def run(x: Tensor, w: Tensor | None, b: Tensor | None, eps: float, r: Running | None) -> Tensor:
            if layout is not None and (always or not x.is_contiguous()):
                x, w, b, r = layout(x, w, b, r)
            rm, rv, training, mom = _running(r)
            return torch.batch_norm(x, w, b, rm, rv, training, mom, eps, _cudnn())

    elif k == "batch_norm_last":  # (..., C): channels last, e.g. (B, S, D)

        def run(x: Tensor, w: Tensor | None, b: Tensor | None, eps: float, r: Running | None) -> Tensor:
            x2 = x.reshape(-1, x.shape[-1])
            if layout is not None:  # always: one position per channel
                x2, w, b, r = layout(x2, w, b, r)
            rm, rv, training, mom = _running(r)
            return torch.batch_norm(x2, w, b, rm, rv, training, mom, eps, _cudnn()).reshape(x.shape)

    elif k == "instance_norm":

        def run(x: Tensor, w: Tensor | None, b: Tensor | None, eps: float, r: Running | None) -> Tensor:
            rm, rv, training, mom = _running(r)
            return torch.instance_norm(x, w, b, rm, rv, training, mom, eps, _cudnn())

    elif k == "group_norm":
        groups = _groups(s)

        def run(x: Tensor, w: Tensor | None, b: Tensor | None, eps: float, r: Running | None) -> Tensor:
            return torch.group_norm(x, groups, _ones_for_bias(w, b), b, eps)  # its cudnn flag: unused

    else:
        # layer_norm / rms_norm over any axes: move the reduced axes to the end (a view; free when
        # they already are the last ones)
        tail, moved = reduced_last(s)
        shape = _static([s.shape[d] for d in s.reduce])
        centered = k == "layer_norm"
        # torch.rms_norm's eps=None is the machine epsilon of its compute dtype (fp32 for fp16/bf16/
        # fp32, fp64 for fp64) -- the value RMSNorm(eps=None) resolves to. Passed as None, the same
        # number: measured ~1.5-2 us a call faster than the explicit float (benchmarks/cpu_overhead.py)
        default_eps = torch.finfo(torch.float64 if call.x.dtype == torch.float64 else torch.float32).eps

        def run(x: Tensor, w: Tensor | None, b: Tensor | None, eps: float, r: Running | None) -> Tensor:
            xm = x.movedim(s.reduce, tail) if moved else x
            if centered:
                y = torch.layer_norm(xm, shape, w, b, eps)  # its cudnn flag: unused
            else:
                y = torch.rms_norm(xm, shape, w, None if eps == default_eps else eps)
            return y.movedim(tail, s.reduce) if moved else y

    return run


_FP32_MAX = torch.finfo(torch.float32).max
_BOUNDED_MAX = 512  # statistics up to this many values are bounded in Python (_bounded), more with torch ops


def _torch_bounded(mean: Tensor, eps: float) -> bool:
    """Whether every ``|m| <= limit * sqrt(eps)``, by a torch reduction (any tensor, any size). True
    for a FakeTensor (``FakeTensorMode``: shapes and dtypes only): it has no values to bound, and
    none to recompute -- reading one raises, where torch's own op gives the fake output."""
    fake = sys.modules.get("torch._subclasses.fake_tensor")  # none exists before torch imports it
    if fake is not None and isinstance(mean, fake.FakeTensor):
        return True
    return eps > 0 and float(torch.linalg.vector_norm(mean.detach(), math.inf)) <= _CANCEL_LIMIT * math.sqrt(eps)


def _merge(y: Tensor, cancel: Tensor, wide: Callable[[], Tensor]) -> Tensor:
    """``y`` with the scopes flagged in ``cancel`` (a bool per scope, shaped to broadcast against
    ``y``) taken from ``wide()``, the float64 recomputation of the call: only a cancelling scope
    changes, so every other scope keeps torch's bits whatever it is batched with (scope isolation).
    Each scope's gradient flows through the path that computed it."""
    return torch.where(cancel, wide(), y)


def _cancelling(mean: Tensor, rstd: Tensor) -> Tensor:
    """Per scope, whether ``|mean| * rstd`` is past the limit (the statistics' own shape): the exact
    answer, once the bound on the means alone (:func:`_bounded`, :func:`_torch_bounded`) has not
    settled it."""
    return mean.detach().abs() * rstd.detach() > _CANCEL_LIMIT


_is_tracing = torch._C._is_tracing  # torch.jit.is_tracing() without its Python frames
_peek = torch._C._functorch.peek_interpreter_stack  # engine.transformed(), likewise


@functools.lru_cache(maxsize=1024)
def _bounded(n: int) -> Callable[[Tensor, float], bool] | None:
    """``bounded(mean, eps)``: whether every one of the ``n`` fp32 values of a contiguous CPU tensor
    ``mean`` has ``|m| <= limit * sqrt(eps)`` -- exactly (False for ``eps <= 0``; a tensor subclass
    by :func:`_torch_bounded`), and at the least cost this runs at per call: ~0.7 us for 32 values, ~2 us for 256
    on this VM, where the Euclidean norm of the values unpacked into Python floats takes ~1.1 and
    ~5.7 us, the largest part of a small InstanceNorm2d's overhead.

    The values' bits are read from memory as one Python integer, 32 bits a lane. Positive IEEE
    floats are ordered as their bits, so with the sign cleared (``& 0x7FFFFFFF`` in each lane)
    ``|m| <= bound`` is ``lane <= T``, T the bits of the largest fp32 at most the bound; adding
    ``2**31 - (T + 1)`` to every lane sets a lane's top bit exactly when ``lane > T``, and no lane
    carries into the next (both terms are below ``2**31``). NaN and inf have the largest bits: past
    the bound, to the exact check. None past :data:`_BOUNDED_MAX` values (or for none). Cached per
    ``n``; the addend per ``eps``."""
    if n > _BOUNDED_MAX or n == 0:
        return None
    raw = ctypes.c_char * (4 * n)
    ones = sum(1 << (32 * i) for i in range(n))  # 1 in every lane
    magnitude, top = ones * 0x7FFFFFFF, ones << 31
    from_bytes, order = int.from_bytes, sys.byteorder
    addends: dict[float, int] = {}

    def addend(eps: float) -> int:
        if len(addends) >= 64:
            addends.clear()
        bound = _CANCEL_LIMIT * math.sqrt(eps)
        if bound >= _FP32_MAX:
            t = 0x7F7FFFFF  # every finite fp32
        else:
            t = struct.unpack("=I", struct.pack("=f", bound))[0]
            if struct.unpack("=f", struct.pack("=I", t))[0] > bound:
                t -= 1  # rounded up to fp32: the next one down
        addends[eps] = a = ones * (0x80000000 - (t + 1))
        return a

    # the bytes at the last address read, as a ctypes array: a function of the address alone (it reads
    # the memory when read), made again only for another address -- the allocator mostly hands a
    # call's statistics the previous call's block; ~0.15 of ~0.8 us a call
    last: tuple[int, object] = (0, None)

    def bounded(mean: Tensor, eps: float) -> bool:
        nonlocal last
        if type(mean) is not Tensor:  # a subclass is not host memory: by its own ops
            return _torch_bounded(mean, eps)
        if not eps > 0:  # no bound
            return False
        address, view = last  # one read of the pair: another thread's store replaces it whole
        if address != (p := mean.data_ptr()):
            view = raw.from_address(p)
            last = (p, view)
        lanes = from_bytes(view, order) & magnitude
        return not (lanes + (addends.get(eps) or addend(eps))) & top

    return bounded


def _guard_cancellation(call: Call, plain: LayerEntry) -> LayerEntry:
    """Wrap the automatic ATen entry of an fp32 CPU call with the cancellation check above.

    The entries are written for their per-call cost (``benchmarks/cpu_overhead.py``): the tracing
    and transform questions asked of torch directly, the ordinary answer from the statistics bounded
    straight from memory (see the comment below)."""
    if call.x.dtype not in _GUARDED or call.x.device.type != "cpu":
        return plain  # fp64: nothing to gain; CUDA: the check would synchronize
    k, s, op = kind(call), call.scope, call.op
    if engine.tracing():
        return plain  # planned afresh, uncached, while compiling; the TorchScript tracer sees plain ops
    if s.count == 0 or any(n == 0 for n in s.shape):
        return plain  # empty input: torch's ops return early (the native ones would raise)

    def as_call(x: Tensor, w: Tensor | None, b: Tensor | None, eps: float, r: Running | None) -> Call:
        return Call(x, s, w, b, eps, None, r, op=op)  # the reference's recomputation, rare: see _runner

    # The ordinary call's answer, at the least per-call cost: rstd <= 1/sqrt(eps), so no scope can
    # cancel while every |mean| <= limit * sqrt(eps) (3.2 at eps 1e-5). The statistics (one per
    # scope; the native ops return them contiguous fp32 for an fp32 CPU input) are bounded so
    # straight from memory (_bounded; more statistics than it reads, by a torch reduction); the bound
    # only ever says "no": past it, _cancelling decides exactly, per scope.
    bounded = _bounded(math.prod(s.shape) // s.count) or _torch_bounded
    if call.x.dtype != torch.float32:
        # the half types' kernels return their statistics in the input's dtype; _bounded reads fp32
        # memory: widened first (exact), a small copy -- cheaper than the torch reduction
        fp32_bounded = bounded

        def bounded(mean: Tensor, eps: float) -> bool:
            return fp32_bounded(mean.float(), eps)

    native_layer_norm, native_batch_norm = torch.native_layer_norm, torch.native_batch_norm
    if k == "layer_norm":
        tail, moved = reduced_last(s)
        shape = _static([s.shape[d] for d in s.reduce])

        def run(x: Tensor, w: Tensor | None, b: Tensor | None, eps: float, r: Running | None) -> Tensor:
            if _is_tracing() or _peek() is not None:
                return plain(x, w, b, eps, r)
            y, mean, rstd = native_layer_norm(x.movedim(s.reduce, tail) if moved else x, shape, w, b, eps)
            # the flags' shape is the statistics' (*kept, 1, ...): they broadcast over the reduced axes
            if not bounded(mean, eps) and (cancel := _cancelling(mean, rstd)).any():
                if moved:
                    y, cancel = y.movedim(tail, s.reduce), cancel.movedim(tail, s.reduce)
                return _merge(y, cancel, lambda: engine.recompute(as_call(x, w, b, eps, r), wide=True))
            return y.movedim(tail, s.reduce) if moved else y

    elif k in ("batch_norm", "batch_norm_last"):
        last = k == "batch_norm_last"
        # evaluation bounds the running means: from memory where they are fp32 (the plan's signature
        # holds their dtype); engine.norm takes buffers of any dtype, which _bounded would read as fp32
        # (past the end of an fp16 buffer)
        r0 = call.running
        fp32_running = r0 is not None and r0.mean is not None and r0.mean.dtype == torch.float32
        running_bounded = bounded if fp32_running else _torch_bounded
        layout, always = _bn_layout(call)  # the guard runs on CPUs only (_guard_cancellation): not None

        def run(x: Tensor, w: Tensor | None, b: Tensor | None, eps: float, r: Running | None) -> Tensor:
            if _is_tracing() or _peek() is not None:
                return plain(x, w, b, eps, r)
            x2 = x.reshape(-1, x.shape[-1]) if last else x
            if always or not x2.is_contiguous():
                x2, w, b, r = layout(x2, w, b, r)
            if r is not None and not r.use_input_stats:  # evaluation: the running statistics decide
                # the same bound, on the running means (CPU tensors like the input, of the plan's
                # dtype): contiguity is what remains to ask
                rm, rv = r.mean, r.var
                within = running_bounded(rm, eps) if rm.is_contiguous() else _torch_bounded(rm, eps)
                # cudnn_enabled=False: this runner is the CPU one, where ATen never reads the flag
                y = torch.batch_norm(x2, w, b, rm, rv, False, 0.0, eps, False)
                y = y.reshape(x.shape) if last else y
                if not within and (cancel := _cancelling(rm, torch.rsqrt(rv + eps))).any():
                    cancel = _per_channel(cancel, x.dim(), last)
                    return _merge(y, cancel, lambda: engine.recompute(as_call(x, w, b, eps, r), wide=True))
                return y
            rm, rv, mom = (None, None, 0.0) if r is None else (r.mean, r.var, r.momentum)
            y, mean, invstd = native_batch_norm(x2, w, b, rm, rv, True, mom, eps)
            y = y.reshape(x.shape) if last else y
            if not bounded(mean, eps) and (cancel := _cancelling(mean, invstd)).any():
                # the kernel already updated the running statistics: the recomputation takes none
                cancel = _per_channel(cancel, x.dim(), last)
                return _merge(y, cancel, lambda: engine.recompute(as_call(x, w, b, eps, None), wide=True))
            return y

    elif k == "group_norm":
        groups = _groups(s)
        n, ch = s.shape[0], s.shape[1]
        hw = math.prod(s.shape[2:])

        def run(x: Tensor, w: Tensor | None, b: Tensor | None, eps: float, r: Running | None) -> Tensor:
            if _is_tracing() or _peek() is not None:
                return plain(x, w, b, eps, r)
            # as torch.group_norm: keep a channels_last input channels_last. The native op reads
            # weight and bias as contiguous memory (torch.group_norm makes them so, the native op
            # does not): a view (``base[::2]``, ``g.expand(C)``) would be read out of bounds
            # (torch.group_norm's layout: channels_last only where torch's strides test says so)
            fmt = channels_last(x) if strides_like_channels_last(x) else None
            xc = x.contiguous(memory_format=fmt or torch.contiguous_format)
            wc = _ones_for_bias(w, b)
            wc = None if wc is None else wc.contiguous()
            bc = None if b is None else b.contiguous()
            y, mean, rstd = torch.native_group_norm(xc, wc, bc, n, ch, hw, groups, eps)
            if not bounded(mean, eps) and (cancel := _cancelling(mean, rstd)).any():
                # (N, G) flags, one per (sample, group), over the group's channels and positions
                cancel = cancel.repeat_interleave(ch // groups, dim=1)
                cancel = cancel.view(n, ch, *([1] * (x.dim() - 2)))
                return _merge(y, cancel, lambda: engine.recompute(as_call(x, w, b, eps, r), wide=True))
            return y

    elif k == "instance_norm":
        n, ch = s.shape[0], s.shape[1]
        folded = (1, n * ch, *s.shape[2:])

        def run(x: Tensor, w: Tensor | None, b: Tensor | None, eps: float, r: Running | None) -> Tensor:
            if _is_tracing() or _peek() is not None or r is not None:
                return plain(x, w, b, eps, r)  # with running buffers torch's instance_norm averages them itself
            # as torch.instance_norm: BatchNorm over (1, N*C, *). Not group_norm with one group per
            # channel: ~4x faster forward on this CPU, but its outputs were measured ~1.25x further
            # from float64 (rms error) than instance_norm's, so not "no less accurate than torch"
            wn = None if w is None else w.repeat(n)
            bn = None if b is None else b.repeat(n)
            y, mean, invstd = native_batch_norm(x.contiguous().view(folded), wn, bn, None, None, True, 0.0, eps)
            y = y.view(x.shape)
            if not bounded(mean, eps) and (cancel := _cancelling(mean, invstd)).any():
                cancel = cancel.view(n, ch, *([1] * (x.dim() - 2)))  # one per (sample, channel)
                return _merge(y, cancel, lambda: engine.recompute(as_call(x, w, b, eps, r), wide=True))
            return y

    else:
        return plain
    return run


def _per_channel(flags: Tensor, ndim: int, last: bool) -> Tensor:
    """BatchNorm's (C,) flags shaped to broadcast over an input of ``ndim`` axes, channels on axis 1
    or (``last``) on the last axis."""
    return flags if last else flags.view(-1, *([1] * (ndim - 2)))


def _ones_for_bias(w: Tensor | None, b: Tensor | None) -> Tensor | None:
    """``w``, or ones where there is a bias and no weight: torch's group_norm backward raises "tensor
    does not have a device" for a bias without weight (torch 2.13). Products by one are exact, so the
    output and gradients are the bits of the call without weight; the ones need no gradient."""
    if w is None and b is not None:
        return torch.ones(b.shape, dtype=b.dtype, device=b.device)
    return w


def _groups(s) -> int:
    """torch.group_norm's num_groups for a scope it computes: one group per channel when the scope is
    InstanceNorm's (a GroupNorm(C, C) call), else the scope's groups."""
    return s.shape[1] if s.reduce == tuple(range(2, len(s.shape))) else s.groups


BACKEND = Backend(NAME, why_not, prepare)
