"""The engine: one entry point that normalizes over a scope, and the backends that can run it.

``norm(x, scope, ...)`` resolves the scope on ``x``'s shape and hands a :class:`Call` to a
backend. Three kinds exist:

* ``"aten"``  -- PyTorch's own fused ops (``layer_norm``, ``rms_norm``, ``batch_norm``,
  ``instance_norm``, ``group_norm``), used when the scope matches one of them *exactly*;
* ``"triton"`` -- fused kernels for CUDA tensors (:mod:`normscope.kernels`, when Triton is
  installed; registered on import of that package);
* ``"composite"`` -- masked BatchNorm / InstanceNorm / GroupNorm from a few large ATen ops with a
  closed-form backward, any device (:mod:`normscope.composite`);
* ``"reference"`` -- :mod:`normscope.reference`, plain PyTorch ops, any scope, any device.

Per call the first backend of the automatic order that supports the call runs. A user can force
one: the ``backend=`` argument, else :func:`use_backend` (a context manager), else the
``NORMSCOPE_BACKEND`` environment variable. A forced backend that cannot run a call raises
ValueError saying why -- it never silently falls back. :func:`last_backend` says which one ran.

Running statistics live here too, between the two steps: with ``running=Running(...)`` the batch
statistics update the running estimates (``use_input_stats=True``) or the running estimates
replace them (``False``).
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Callable, Iterator
from typing import NamedTuple

import torch
from torch import Tensor

from . import reference as ref
from .scope import Resolved, Scope

__all__ = [
    "Running",
    "Call",
    "Backend",
    "norm",
    "register_backend",
    "backends",
    "use_backend",
    "last_backend",
]

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
    """Everything a backend needs for one normalization."""

    x: Tensor
    scope: Resolved
    weight: Tensor | None
    bias: Tensor | None
    eps: float
    mask: Tensor | None
    running: Running | None


class Backend(NamedTuple):
    """A way to run calls.

    ``why_not(call)`` returns None when the backend can run ``call``, else a short reason;
    ``prepare(call)`` returns the function that runs it. Both may look only at the call's
    *signature* -- the resolved scope (shape included), dtype, device type, which of mask,
    running statistics, weight and bias are present, and which axes the mask broadcasts over --
    because their answers are cached per signature (:func:`signature`). Strides are not in it: a
    backend handles any layout itself.
    """

    name: str
    why_not: Callable[[Call], str | None]
    prepare: Callable[[Call], Callable[[Call], Tensor]]


# ----------------------------------------------------------------------------------------------
# reference backend: moments -> (running statistics) -> rstd -> apply


def _update_running(call: Call, m: ref.Moments) -> None:
    run, s = call.running, call.scope
    if run.mean is None or run.var is None or run.momentum == 0.0:
        return
    # statistics may be finer than the buffers (InstanceNorm: one per sample and channel); the
    # buffers hold their average over the extra kept axes, as torch's instance_norm does
    extra = tuple(d for d in range(len(s.shape)) if d not in s.reduce and d not in s.affine)
    count = m.count
    if isinstance(count, int) and count == 0:  # empty batch: no statistics (NaN), and torch leaves the buffers
        return
    with torch.no_grad():
        mean, var = m.mean.detach(), m.var.detach()
        if isinstance(count, Tensor):
            n = count.detach()
            unbiased = var * n / (n - 1).clamp_min(1)
        else:
            unbiased = var * (count / (count - 1)) if count > 1 else var
        if extra:
            mean, unbiased = mean.mean(extra, keepdim=True), unbiased.mean(extra, keepdim=True)
        f = run.momentum
        run.mean.mul_(1 - f).add_(mean.reshape(run.mean.shape).to(run.mean.dtype), alpha=f)
        run.var.mul_(1 - f).add_(unbiased.reshape(run.var.shape).to(run.var.dtype), alpha=f)


def _running_as_stats(call: Call) -> tuple[Tensor, Tensor]:
    s, run = call.scope, call.running
    shape = [s.shape[d] if d in s.affine else 1 for d in range(len(s.shape))]
    dt = ref.acc_dtype(call.x.dtype)
    mean = run.mean.to(dt).reshape(shape)
    return mean, ref.rstd(run.var.to(dt).reshape(shape), call.eps)


def _reference_run(call: Call) -> Tensor:
    run = call.running
    if run is not None and not run.use_input_stats:
        mean, rstd = _running_as_stats(call)
    else:
        m = ref.moments(call.x, call.scope, call.mask)
        if run is not None:
            _update_running(call, m)
        mean, rstd = m.mean, ref.rstd(m.var, call.eps, m.count)
    return ref.apply(call.x, mean, rstd, call.scope, call.weight, call.bias)


def _reference_why_not(call: Call) -> str | None:
    if call.running is not None and not call.running.use_input_stats:
        if call.running.mean is None or call.running.var is None:
            return "evaluation with running statistics needs running mean and var"
    return None


# ----------------------------------------------------------------------------------------------
# aten backend: only scopes that are exactly one of torch's fused ops


def _aten_kind(call: Call) -> str | None:
    """Which ATen op computes this call exactly, or None."""
    s, ndim = call.scope, len(call.scope.shape)
    if call.mask is not None or not s.centered and call.running is not None:
        return None
    reduce, affine = s.reduce, s.affine
    every_but = lambda *kept: reduce == tuple(d for d in range(ndim) if d not in kept)  # noqa: E731
    if s.groups == 1 and s.centered:
        if ndim >= 2 and every_but(1) and affine in ((1,), ()):
            return "batch_norm"
        if ndim >= 2 and every_but(ndim - 1) and affine in ((ndim - 1,), ()):
            return "batch_norm_last"
        if ndim >= 3 and every_but(0, 1) and affine in ((1,), ()):
            return "instance_norm"
    if call.running is not None:
        return None
    if s.groups == 1 and reduce and affine in (reduce, ()):
        if s.centered:
            return "layer_norm"
        if call.bias is None:
            return "rms_norm"
    # torch.group_norm splits axis 1: a grouping of any other axis is not its op
    if s.centered and ndim >= 2 and every_but(0) and affine in ((1,), ()) and (s.groups == 1 or s.group_dim == 1):
        return "group_norm"  # groups of channels (also one group: LayerNorm with per-channel affine)
    return None


def _aten_why_not(call: Call) -> str | None:
    if _aten_kind(call) is None:
        if call.mask is not None:
            return "ATen has no masked normalization"
        return "no ATen op computes this scope exactly"
    return None


def _aten_prepare(call: Call) -> Callable[[Call], Tensor]:
    kind, s = _aten_kind(call), call.scope

    def running(c: Call) -> tuple:
        r = c.running
        return (None, None, True, 0.0) if r is None else (r.mean, r.var, r.use_input_stats, r.momentum)

    if kind == "batch_norm":

        def run(c: Call) -> Tensor:
            rm, rv, training, mom = running(c)
            return torch.batch_norm(c.x, c.weight, c.bias, rm, rv, training, mom, c.eps, _cudnn())
    elif kind == "batch_norm_last":  # (..., C): channels last, e.g. (B, S, D)

        def run(c: Call) -> Tensor:
            rm, rv, training, mom = running(c)
            x2 = c.x.reshape(-1, c.x.shape[-1])
            return torch.batch_norm(x2, c.weight, c.bias, rm, rv, training, mom, c.eps, _cudnn()).reshape(c.x.shape)
    elif kind == "instance_norm":

        def run(c: Call) -> Tensor:
            rm, rv, training, mom = running(c)
            return torch.instance_norm(c.x, c.weight, c.bias, rm, rv, training, mom, c.eps, _cudnn())
    elif kind == "group_norm":

        def run(c: Call) -> Tensor:
            return torch.group_norm(c.x, s.groups, c.weight, c.bias, c.eps, _cudnn())
    else:
        # layer_norm / rms_norm over any axes: move the reduced axes to the end (a view; free when
        # they already are the last ones)
        k = len(s.reduce)
        ndim = len(s.shape)
        tail = tuple(range(ndim - k, ndim))
        shape = _static([s.shape[d] for d in s.reduce])
        op = torch.layer_norm if kind == "layer_norm" else None
        if s.reduce == tail:
            if op is not None:

                def run(c: Call) -> Tensor:
                    return op(c.x, shape, c.weight, c.bias, c.eps, _cudnn())
            else:

                def run(c: Call) -> Tensor:
                    return torch.rms_norm(c.x, shape, c.weight, c.eps)
        else:

            def run(c: Call) -> Tensor:
                xm = c.x.movedim(s.reduce, tail)
                if op is not None:
                    y = op(xm, shape, c.weight, c.bias, c.eps, _cudnn())
                else:
                    y = torch.rms_norm(xm, shape, c.weight, c.eps)
                return y.movedim(tail, s.reduce)

    return run


# torch's CPU kernels apply a normalization as one multiply-add, y = x * (rstd*w) + (b - mean*rstd*w).
# When |mean| * rstd is large both terms are huge and cancel: at mean 1e4, std 1e-2 they are ~1e6, whose
# fp32 spacing (0.06) is a few percent of the output's unit spread, although the statistics themselves
# are accurate. Such inputs are rare and show in the statistics the kernels return anyway, so when the
# engine *chooses* ATen for an fp32 CPU call it asks the native op for them and recomputes the rare
# cancelling call in the (x - mean) * rstd form of the reference. A *forced* "aten" stays exactly torch.
_CANCEL_LIMIT = 1024.0  # output error <~ 1024 * 2**-24 = 6e-5 of a unit, variance error <~ 1e-4


def _tracing() -> bool:
    return torch.compiler.is_compiling() or torch.jit.is_tracing()


_INF = float("inf")


def _cancels(mean: Tensor, rstd: Tensor) -> bool:
    # two small ops on the per-scope statistics (detached: no autograd graph); this runs on every
    # automatic fp32 CPU call, so it is kept to the cheapest form that measures max |mean| * rstd
    if mean.numel() == 0:
        return False
    return torch.linalg.vector_norm(mean.detach() * rstd.detach(), _INF).item() > _CANCEL_LIMIT


def _recompute(c: Call) -> Tensor:
    """Run ``c`` on the reference from inside another backend's runner, and say so in last_backend()."""
    _last[0] = "reference"
    return _reference_run(c)


def position_mask(mask: Tensor, x: Tensor, d: int) -> Tensor | None:
    """A mask as one flag per position -- a view with x's shape without axis ``d`` -- or None when it
    varies along ``d`` (no per-position form: backends that need one leave the call to the reference)."""
    k = d - (x.dim() - mask.dim())  # the mask's axis that broadcasts against x's axis d
    if k >= 0 and mask.shape[k] != 1:
        return None
    return torch.broadcast_to(mask, x.shape).select(d, 0)


def _guard_cancellation(call: Call, plain: Callable[[Call], Tensor]) -> Callable[[Call], Tensor]:
    """Wrap the automatic ATen runner of an fp32 CPU call with the cancellation check above."""
    if call.x.dtype != torch.float32 or call.x.device.type != "cpu":
        return plain  # half types: output rounding dominates; CUDA: the check would synchronize
    kind, s = _aten_kind(call), call.scope
    if kind == "layer_norm":
        k, ndim = len(s.reduce), len(s.shape)
        tail = tuple(range(ndim - k, ndim))
        shape = _static([s.shape[d] for d in s.reduce])
        moved = s.reduce != tail

        def run(c: Call) -> Tensor:
            if _tracing():
                return plain(c)
            xm = c.x.movedim(s.reduce, tail) if moved else c.x
            y, mean, rstd = torch.native_layer_norm(xm, shape, c.weight, c.bias, c.eps)
            if _cancels(mean, rstd):
                return _recompute(c)
            return y.movedim(tail, s.reduce) if moved else y

    elif kind in ("batch_norm", "batch_norm_last"):

        def run(c: Call) -> Tensor:
            r = c.running
            if _tracing():
                return plain(c)
            if r is not None and not r.use_input_stats:  # evaluation: the running statistics decide
                return _recompute(c) if _cancels(r.mean, torch.rsqrt(r.var + c.eps)) else plain(c)
            rm, rv, mom = (None, None, 0.0) if r is None else (r.mean, r.var, r.momentum)
            x = c.x if kind == "batch_norm" else c.x.reshape(-1, c.x.shape[-1])
            y, mean, invstd = torch.native_batch_norm(x, c.weight, c.bias, rm, rv, True, mom, c.eps)
            if _cancels(mean, invstd):  # the kernel already updated the running statistics
                return _recompute(c._replace(running=None))
            return y if kind == "batch_norm" else y.reshape(c.x.shape)

    elif kind == "group_norm":

        def run(c: Call) -> Tensor:
            if _tracing():
                return plain(c)
            x = c.x
            n, ch = x.shape[0], x.shape[1]
            hw = x.numel() // max(n * ch, 1)
            # as torch.group_norm: keep a channels_last input channels_last
            cl = x.dim() == 4 and not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last)
            x = x.contiguous(memory_format=torch.channels_last if cl else torch.contiguous_format)
            y, mean, rstd = torch.native_group_norm(x, c.weight, c.bias, n, ch, hw, s.groups, c.eps)
            return _recompute(c) if _cancels(mean, rstd) else y

    elif kind == "instance_norm":

        def run(c: Call) -> Tensor:
            if _tracing() or c.running is not None:
                return plain(c)  # with running buffers torch's instance_norm averages them itself
            # as torch.instance_norm: BatchNorm over (1, N*C, *)
            x = c.x
            n, ch = x.shape[0], x.shape[1]
            w = None if c.weight is None else c.weight.repeat(n)
            b = None if c.bias is None else c.bias.repeat(n)
            xr = x.contiguous().view(1, n * ch, *x.shape[2:])
            y, mean, invstd = torch.native_batch_norm(xr, w, b, None, None, True, 0.0, c.eps)
            return _recompute(c) if _cancels(mean, invstd) else y.view(x.shape)

    else:
        return plain
    return run


def _cudnn() -> bool:
    # read per call, as torch.nn.functional does: users toggle cuDNN at run time
    return torch.backends.cudnn.enabled


def _static(sizes: list) -> list:
    """Sizes as Python ints. Under the TorchScript tracer (legacy ONNX export) ``x.shape`` holds
    0-d tensors, and a traced ``normalized_shape`` cannot be exported with a dynamic axis; the
    normalized axes are fixed by the layer's weight anyway, so freeze them (once, at prepare)."""
    if not any(isinstance(n, Tensor) for n in sizes):
        return sizes  # ints, or SymInts under torch.export (left symbolic)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        return [int(n) if isinstance(n, Tensor) else n for n in sizes]


# ----------------------------------------------------------------------------------------------
# registry and dispatch

_BACKENDS: dict[str, Backend] = {}
_AUTO: list[str] = []
_forced: list[str] = []  # stack of use_backend() names
_last: list[str | None] = [None]
_PLANS: dict[tuple, tuple[str, Callable[[Call], Tensor]]] = {}
_MAX_PLANS = 4096


def register_backend(backend: Backend, *, auto_first: bool = False, before: str | None = None) -> None:
    """Add a backend. ``auto_first`` puts it ahead of the others in the automatic order (fast
    kernels that decline, through ``why_not``, what they cannot do better than ATen); ``before``
    puts it just ahead of the named one; otherwise it goes last."""
    _BACKENDS[backend.name] = backend
    if backend.name in _AUTO:
        _AUTO.remove(backend.name)
    if auto_first:
        at = 0
    elif before is not None and before in _AUTO:
        at = _AUTO.index(before)
    else:
        at = len(_AUTO)
    _AUTO.insert(at, backend.name)
    _PLANS.clear()


def backends() -> list[str]:
    """Names of the registered backends, in automatic order."""
    return list(_AUTO)


def _reference_prepare(call: Call) -> Callable[[Call], Tensor]:
    return _reference_run


register_backend(Backend("aten", _aten_why_not, _aten_prepare))
register_backend(Backend("reference", _reference_why_not, _reference_prepare))


@contextlib.contextmanager
def use_backend(name: str | None) -> Iterator[None]:
    """Force a backend inside a ``with`` block (``None`` restores automatic choice)."""
    if name is not None:
        _check_backend_name(name, "use_backend(name)")
    _forced.append(name or "auto")
    try:
        yield
    finally:
        _forced.pop()


def last_backend() -> str | None:
    """Name of the backend that ran the most recent normalization (None before any)."""
    return _last[0]


def _check_backend_name(name: str, where: str) -> None:
    if name != "auto" and name not in _BACKENDS:
        valid = ", ".join(["auto", *_BACKENDS])
        raise ValueError(f"{where}: unknown backend {name!r}; expected one of: {valid}")


def _requested(backend: str | None) -> str:
    if backend is not None:
        _check_backend_name(backend, "backend")
        return backend
    if _forced:
        return _forced[-1]
    env = os.environ.get(ENV_VAR)
    if env:
        _check_backend_name(env, f"environment variable {ENV_VAR}")
        return env
    return "auto"


def signature(call: Call) -> tuple:
    """What a backend's choice may depend on (see :class:`Backend`)."""
    r = call.running
    return (
        call.scope,
        call.x.dtype,
        call.x.device.type,
        # which axes the mask broadcasts over (a per-position mask vs one that varies by channel)
        None if call.mask is None else tuple(n == 1 for n in call.mask.shape),
        None if r is None else (r.use_input_stats, r.mean is None, r.var is None),
        call.weight is None,
        call.bias is None,
    )


def _plan(call: Call, name: str) -> tuple[str, Callable[[Call], Tensor]]:
    automatic = name == "auto"
    if automatic:
        for name in _AUTO:
            if _BACKENDS[name].why_not(call) is None:
                break
        else:  # pragma: no cover - the reference runs every call it is given
            raise ValueError(_BACKENDS["reference"].why_not(call))
    else:
        reason = _BACKENDS[name].why_not(call)
        if reason is not None:
            raise ValueError(f"backend {name!r} cannot run this normalization: {reason}")
    runner = _BACKENDS[name].prepare(call)
    if automatic and name == "aten":
        runner = _guard_cancellation(call, runner)
    return name, runner


def dispatch(call: Call, backend: str | None = None) -> Tensor:
    """Run ``call`` on the requested backend, or on the first automatic one that supports it."""
    requested = _requested(backend)
    if torch.compiler.is_compiling():
        # under dynamo the planning is traced once per graph anyway; storing it in _PLANS would be
        # a side effect on a dict keyed by trace-time objects (Resolved) that dynamo cannot replay,
        # which breaks torch.compile(fullgraph=True)
        plan = _plan(call, requested)
        _last[0] = plan[0]
        return plan[1](call)
    key = (signature(call), requested)
    try:
        plan = _PLANS.get(key)
    except TypeError:
        # symbolic sizes (torch.export / torch.compile with dynamic dims, e.g. ONNX export with a
        # dynamic batch) are unhashable: choose afresh, uncached -- this runs once, at trace time
        plan = _plan(call, requested)
        _last[0] = plan[0]
        return plan[1](call)
    if plan is None:
        plan = _plan(call, requested)
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.clear()
        _PLANS[key] = plan
    _last[0] = plan[0]
    return plan[1](call)


def norm(
    x: Tensor,
    scope: Scope | Resolved,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float = 1e-5,
    *,
    mask: Tensor | None = None,
    running: Running | None = None,
    backend: str | None = None,
) -> Tensor:
    """Normalize ``x`` over ``scope``: the one engine behind every layer.

    Inputs are assumed valid (layers and :func:`normscope.normalize` check them first); this is
    the hot path.
    """
    resolved = scope if isinstance(scope, Resolved) else scope.resolve(x.shape)
    return dispatch(Call(x, resolved, weight, bias, eps, mask, running), backend)


def stats(x: Tensor, scope: Scope | Resolved, mask: Tensor | None = None, eps: float = 0.0) -> tuple[Tensor, Tensor]:
    """``(mean, rstd)`` of every scope of ``x`` in fp32 (fp64 for fp64 input), shaped to broadcast
    against ``x`` (one value per group on a grouped axis)."""
    resolved = scope if isinstance(scope, Resolved) else scope.resolve(tuple(x.shape))
    m = ref.moments(x, resolved, mask)
    return m.mean, ref.rstd(m.var, eps, m.count)


def apply(
    x: Tensor,
    mean: Tensor,
    rstd: Tensor,
    scope: Scope | Resolved,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
) -> Tensor:
    """Normalize ``x`` with given statistics and apply the affine (the second pure step)."""
    resolved = scope if isinstance(scope, Resolved) else scope.resolve(tuple(x.shape))
    return ref.apply(x, mean, rstd, resolved, weight, bias)
