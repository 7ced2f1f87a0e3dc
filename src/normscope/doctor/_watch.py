"""``normscope.watch``: the doctor during training.

A context manager around any training loop that watches every normalization layer of a model with
forward hooks only -- no extra forward, no change to a parameter, buffer, gradient, mode or random
number generator -- and turns what the layers saw over the steps into the doctor's
:class:`~normscope.doctor.Report`::

    with normscope.watch(model, every=50) as w:
        for batch in loader:
            loss = model(batch).loss; loss.backward(); opt.step(); opt.zero_grad()
    print(w.report())       # each finding with measured["step"], the step it was first seen

What it costs, per norm and step: the largest and smallest value of the layer's input (two reductions,
which give max ``|x|`` with NaN and inf propagating) and one sum of its weight, bias and running statistics
(the output's extremes too for a layer that does not compute its statistics in float32), kept on the
tensors' device and read in one transfer at the next watched step -- the non-finite and half-overflow checks
see every step, to the exact step and layer. On every ``every``-th step each norm's statistics are measured
once more (two-pass mean and variance over its scope, float32), and on the first watched step the doctor's
one-batch checks run on copies of what the layers received.
"""

from __future__ import annotations

import contextvars
import dataclasses
import math
import random
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from ._finding import Finding, Series
from ._observe import Call, NormScope, Recorder, is_norm, norm_scope
from ._report import Report
from ._run import _describe, _first_tensor, _norm_calls, _running, _single_value_report
from .checks import (
    _DEAD_SOURCE,
    _DRIFT_SOURCE,
    _HALF,
    _OVERFLOW_SOURCE,
    CHECKS,
    DRIFT_WARNING,
    NOISE_MARGIN,
    Context,
    _computes_in_fp32,
    _dead,
    _distance,
    _noise_from_units,
    _noise_terms,
    _sample_units,
    _unit_moments,
)

__all__ = ["watch", "Watch", "WATCH_CHECKS"]

#: the checks over time, by identifier: the first three share the doctor's names, thresholds and sources
WATCH_CHECKS = ("non-finite", "train-eval-drift", "half-overflow", "dead-channels", "residual-growth")

#: the doctor's one-batch checks the watch does not run on its first step, and why (each needs more
#: forwards of the model, which the watch never runs; ``train-eval-drift`` is measured over time instead)
_NOT_ON_FIRST_STEP = {
    "batch-invariance": "needs a forward on the first sample alone, which the watch never runs: "
    "normscope.doctor(model, batch) runs it",
}

_NON_FINITE_SOURCE = (
    "IEEE 754 arithmetic: inf and NaN survive every sum and product after them, so one that reaches a norm "
    "reaches the loss; checked on every step (max and min of each norm's input, one sum of its weight, bias "
    "and running statistics; the output's max and min where the layer's statistics are not float32)"
)
_GROWTH_SOURCE = (
    "Xiong et al. 2020 (On Layer Normalization in the Transformer Architecture), Lemma 2: in a Pre-LN transformer "
    "at initialization E||x_l||^2 lies between (1 + l/2) d and (1 + 3l/2) d after l layers; with two Pre-LN norms "
    "(attention, feed-forward) per layer, the i-th norm after the first receives at most sqrt(1 + 3i/4) times the "
    "first one's RMS"
)
_MASSIVE_SOURCE = (
    "Sun et al. 2024 (Massive Activations in Large Language Models), Sec. 2: activations of magnitude above 100 "
    "and about 1,000 times the median magnitude of the hidden state; the median estimated here from an evenly "
    "strided sample of at most 16,384 values"
)
#: steps kept on the device before their values are read (one transfer), when no watched step comes first
_RESOLVE_EVERY = 64
MASSIVE_ABS = 100.0
MASSIVE_RATIO = 1000.0
_MEDIAN_SAMPLE = 16384


def watch(
    model: nn.Module, every: int = 50, *, checks: Iterable[str] | None = None, world_size: int | None = None
) -> Watch:
    """Watch ``model``'s normalization layers during training: a context manager around the loop.

    Each forward of ``model`` in training mode is a step, numbered from 0 (call :meth:`~normscope.doctor.Watch.step`
    for another count: optimizer steps under gradient accumulation, a trainer's global step). On
    every step each norm's input, weight, bias and running statistics are checked for inf/NaN (and the
    largest ``|x|`` kept); on every ``every``-th step each norm's statistics are recorded
    (:attr:`~normscope.doctor.Watch.history`); on the first of those the doctor's one-batch checks run. Forward hooks
    only: a watched run is bitwise the unwatched one -- losses, parameters, buffers, gradients,
    modes and random number generators. The hooks are removed on exit, also when the loop raises.

    Args:
        model: the ``nn.Module`` whose forward the loop calls.
        every: record the statistics every ``every`` steps (the first step always). Default: 50.
        checks: the identifiers to run: :data:`~normscope.doctor.WATCH_CHECKS` over time and the doctor's
            (:data:`normscope.doctor.CHECKS`) on the first watched step. Default: all.
        world_size: as :func:`normscope.doctor`'s, for its ``bn-elements`` check. Default: None.

    Returns:
        a :class:`~normscope.doctor.Watch`: ``with normscope.watch(model) as w: ...``, then ``w.report()``.

    Example::

        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8))
        >>> with normscope.watch(model, every=1) as w:
        ...     for _ in range(3):
        ...         model(torch.randn(2, 4)).sum().backward()
        >>> [row["step"] for row in w.history]
        [0, 1, 2]
    """
    return Watch(model, every, checks=checks, world_size=world_size)


def _check_args(model: Any, every: Any, checks: Any, world_size: Any) -> list[str]:
    if not isinstance(model, nn.Module):
        raise TypeError(f"watch: expected `model` to be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(every, int) or isinstance(every, bool) or every < 1:
        raise ValueError(f"watch: expected `every` to be a positive int, got {every!r}")
    if world_size is not None and (not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1):
        raise ValueError(f"watch: expected `world_size` to be a positive int or None, got {world_size!r}")
    if isinstance(checks, str):
        raise TypeError(f"watch: expected `checks` to be a list of check names, got the string {checks!r}")
    known = list(WATCH_CHECKS) + [c for c in CHECKS if c not in WATCH_CHECKS]
    names = known if checks is None else list(checks)
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"watch: expected `checks` from {known}, got unknown {unknown}")
    return names


@dataclass
class _Layer:
    """What the watch knows of one norm: its scope per input shape, and its figures over the steps."""

    path: str
    module: nn.Module
    scopes: dict = field(default_factory=dict)  # (shape, dtype) -> NormScope | None
    dtype: str | None = None
    peak: tuple[int, float] | None = None  # (step, max |x|) over every step
    half: tuple[int, float] | None = None  # the first step whose max |x| reached half the dtype's maximum
    over_fp16: tuple[int, float] | None = None  # float32 input beyond float16's range: the first step
    dead0: tuple[int, Tensor] | None = None  # the dead channels (a bool mask) at the first watched step
    dead_streak: Tensor | None = None  # per channel: the watched steps in a row, up to the last, it was dead
    dead_since: Tensor | None = None  # per channel: the first watched step of that run (-1: alive)
    dead_last: tuple[int, Tensor] | None = None


# A channel died during training where it was alive at the first watched step and dead at each of the last
# DEAD_PERSIST watched steps in a row: one batch cannot tell a dead channel from a sparse one it did not excite.
# Measured (timm's repvgg_a0, calibrated, SGD lr 0.01 momentum 0.9 at batch 8, its ReLU-fed identity BatchNorms):
# over 6 steps watched every 2, channels dead at the last watched step only were 5, at the last two 2, every one
# alive on 128 fresh images; over 30 steps watched on each, those dead at the last 2-5 watched steps were 7-8, every
# one dead on the 128 images too.
DEAD_PERSIST = 3


def _rng_state() -> tuple:
    np = sys.modules.get("numpy")
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda, random.getstate(), None if np is None else np.random.get_state()


def _set_rng_state(state: tuple) -> None:
    cpu, cuda, py, npy = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)
    random.setstate(py)
    if npy is not None:
        sys.modules["numpy"].random.set_state(npy)


def _first_input(args: tuple, kwargs: dict) -> Tensor | None:
    for v in (*args, *kwargs.values()):
        if isinstance(v, Tensor):
            return v
    return None


def _channel_dead_var(xf: Tensor, channel: int, centered: bool) -> Tensor:
    """Per channel: the variance (or mean square) over every other axis, two-pass (the doctor's
    ``dead-channels`` measure for per-channel norms other than BatchNorm)."""
    dims = tuple(i for i in range(xf.dim()) if i != channel)
    if not centered:
        return xf.square().mean(dims)
    mean = xf.mean(dims, keepdim=True)
    return (xf - mean).square().mean(dims)


class Watch:
    """A running watch over a model's norm layers (made by :func:`normscope.watch`).

    Use it as a context manager (``with normscope.watch(model) as w:``), or call :meth:`start` and
    :meth:`close` from a training framework's callbacks. :meth:`report` and :attr:`history` work
    during the run and after it.
    """

    def __init__(
        self, model: nn.Module, every: int = 50, *, checks: Iterable[str] | None = None, world_size: int | None = None
    ) -> None:
        self.names = _check_args(model, every, checks, world_size)
        self.model = model
        self.every = every
        self.world_size = world_size
        self._handles: list = []
        self._layers: dict[str, _Layer] = {}
        self._probes: dict = {}
        self._started_at: float | None = None
        self._seconds = 0.0
        # the step
        self._manual = False
        self._step: int | None = None
        self._first_step: int | None = None
        self._watched = False
        self._steps_seen = 0
        self._depth = 0
        self._in_forward = False  # a training-mode forward of the model is running (auto counting)
        self._trained = False  # the last forward of the model was in training mode
        self._busy = False  # the watch's own checks run copies of layers: their hooks must not record
        # this step's values: per norm call (path, call index, what, dtype) and two 0-d tensors
        self._calls: dict[str, int] = {}
        self._keys: list[tuple] = []
        self._vals: list[Tensor] = []
        self._pending: list[tuple[int, tuple, Tensor | list[Tensor]]] = []
        self._layouts: dict[tuple, tuple] = {}
        self._before: dict[str, tuple[Tensor, Tensor]] = {}
        self._measures: list[tuple[int, str, str, str, dict[str, Tensor]]] = []
        self._maxabs: dict[tuple[int, str], float] = {}
        self._watched_steps: list[int] = []
        self._history: list[dict[str, Any]] = []
        self._non_finite: dict[str, Any] | None = None
        # the first watched step: the doctor's one-batch checks
        self._recorder: Recorder | None = None
        self._first_hook = None
        self._first_running: dict | None = None
        self._first_args: tuple[tuple, dict] | None = None
        self._first_grad = False
        self._first_findings: list[Finding] = []
        self._first_notes: dict[str, str] = {}
        self._first_ran: list[str] = []
        self._stream: list[str] | None = None  # Pre-LN norms on the residual stream, in forward order
        self._stream_note = "no watched step yet"
        self._batch: int | None = None  # the samples in this step's forward (dim 0 of its first tensor input)
        self._stream_adds: int | None = None  # residual additions along it (None: counted by its norms)
        self._inputs: list[str] = []

    # ------------------------------------------------------------------------------ lifetime

    def __enter__(self) -> Watch:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> Watch:
        """Put the hooks on the model (``with`` does this)."""
        if self._handles:
            raise RuntimeError("Watch.start: this watch is already started")
        self._started_at = time.perf_counter()
        m = self.model
        self._handles.append(m.register_forward_pre_hook(self._root_before, with_kwargs=True))
        self._handles.append(m.register_forward_hook(self._root_after, always_call=True))
        for path, mod in m.named_modules():
            if not is_norm(mod):
                continue
            self._layers.setdefault(path, _Layer(path, mod))
            self._handles.append(mod.register_forward_hook(self._norm_hook(path), with_kwargs=True))
            if isinstance(mod, nn.modules.batchnorm._BatchNorm) and getattr(mod, "running_mean", None) is not None:
                self._handles.append(mod.register_forward_pre_hook(self._bn_before(path)))
        return self

    def close(self) -> None:
        """Remove the hooks (``with`` does this on exit, also when the loop raised); what was recorded stays."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._in_forward = False
        self._depth = 0
        self._end_step()
        if self._started_at is not None:
            self._seconds += time.perf_counter() - self._started_at
            self._started_at = None

    # ------------------------------------------------------------------------------ steps

    def step(self, n: int | None = None) -> int:
        """Start step ``n`` (default: the next one) and count steps by hand from now on: the model's
        forwards no longer advance the count, and every training-mode forward until the next call
        belongs to step ``n`` (several forwards per step under gradient accumulation). Calling it again
        with the current step's number changes nothing. Returns the step."""
        if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 0):
            raise ValueError(f"Watch.step: expected `n` to be a non-negative int or None, got {n!r}")
        self._manual = True
        if n is None:
            n = 0 if self._step is None else self._step + 1
        if n == self._step:
            return n
        self._end_step()
        self._begin_step(n)
        return n

    @property
    def current_step(self) -> int | None:
        """The step being recorded (None before the first)."""
        return self._step

    def _begin_step(self, n: int) -> None:
        self._step = n
        self._steps_seen += 1
        if self._first_step is None:
            self._first_step = n
        self._watched = (n - self._first_step) % self.every == 0
        self._calls = {}
        self._before = {}
        if self._watched:
            self._watched_steps.append(n)
            if len(self._watched_steps) == 1 and self._first_names():
                # the doctor's record of the first watched step: copies of every norm's inputs and outputs.
                # Its checks run in a forward hook put after the recorder's own, so that the recorder is
                # closed only once its hooks have run (torch reads whether a hook takes kwargs as it calls it)
                self._recorder = Recorder(self.model, None)
                self._first_hook = self.model.register_forward_hook(self._first_after, always_call=True)
                self._first_running = _running(self.model)
                self._first_grad = torch.is_grad_enabled()

    def _end_step(self) -> None:
        """The step is over (the forward ended, or the next step began): its values join the pending ones; a
        watched step is read at once, and the first watched step's checks run."""
        self._flush()
        if self._recorder is not None:
            self._finish_first()
        if self._measures:
            self._resolve()
            self._read_measures()

    def _flush(self) -> None:
        if not self._vals:
            return
        keys = tuple(self._keys)
        keys = self._layouts.setdefault(keys, keys)
        devices = {v.device for v in self._vals}
        vals: Tensor | list[Tensor] = torch.stack(self._vals) if len(devices) == 1 else list(self._vals)
        self._pending.append((self._step, keys, vals))
        self._keys, self._vals = [], []
        if len(self._pending) >= _RESOLVE_EVERY:
            self._resolve()

    # ------------------------------------------------------------------------------ hooks

    def _root_before(self, m: nn.Module, args: tuple, kwargs: dict) -> None:
        self._depth += 1
        if self._depth > 1 or self._busy:
            return
        self._trained = m.training
        if not m.training:
            return
        x0 = _first_tensor(args, kwargs)
        self._batch = int(x0.shape[0]) if x0 is not None and x0.dim() else None  # the drift's noise reads it
        self._in_forward = True
        if not self._manual:
            self._end_step()
            self._begin_step(0 if self._step is None else self._step + 1)
        if self._recorder is not None and self._first_args is None:
            self._first_args = (args, kwargs)
            self._inputs = [_describe(v) for v in args] + [f"{k}={_describe(v)}" for k, v in kwargs.items()]

    def _root_after(self, m: nn.Module, args: tuple, output: Any) -> None:
        self._depth = max(0, self._depth - 1)
        if self._depth or not self._in_forward:
            return
        self._in_forward = False
        self._trained = True
        self._flush()
        if self._measures:
            self._resolve()
            self._read_measures()

    def _first_after(self, m: nn.Module, args: tuple, output: Any) -> None:
        # after the recorder's hook on the model; not on a forward that raised (output None: torch is then
        # walking the live hook dict, which closing the recorder would change), nor on an eval forward
        if self._depth == 0 and self._trained and output is not None and self._recorder is not None:
            self._finish_first()

    def _forward_done(self) -> None:
        """The loop's forward is over (a framework's hook before the backward, where the model's own forward
        never runs): the first watched step's checks run now, while the weights are still the ones the
        forward used."""
        if self._recorder is not None and not self._depth:
            self._flush()
            self._finish_first()

    def _recording(self) -> bool:
        if self._busy or self._step is None:
            return False
        return self._in_forward if not self._manual else self.model.training

    def _bn_before(self, path: str):
        def hook(m: nn.Module, args: tuple) -> None:
            if self._watched and path not in self._before and self._recording() and not self._calls.get(path):
                self._before[path] = (m.running_mean.detach().clone(), m.running_var.detach().clone())

        return hook

    def _norm_hook(self, path: str):
        def hook(m: nn.Module, args: tuple, kwargs: dict, out: Any) -> None:
            if not self._recording():
                return
            index = self._calls.get(path, 0)
            self._calls[path] = index + 1
            x = _first_input(args, kwargs)
            keys, vals = self._keys, self._vals
            if x is not None and x.is_floating_point() and x.numel():
                xd = x.detach()
                vals.append(xd.amax())  # with amin: max |x|, and NaN and inf propagate
                vals.append(xd.amin())
                keys.append((path, index, "input", xd.dtype))
            if not _computes_in_fp32(m) and isinstance(out, Tensor) and out.is_floating_point() and out.numel():
                # a layer of another library may compute its statistics in the input's precision and overflow
                # inside; torch's and normscope's compute them in float32, so their output is finite wherever
                # their input, weight, bias and running statistics are (the one sum below)
                yd = out.detach()
                vals.append(yd.amax())
                vals.append(yd.amin())
                keys.append((path, index, "output", yd.dtype))
            params, buffers = m._parameters, m._buffers
            state = [t for t in (params.get("weight"), params.get("bias")) if t is not None and t.is_floating_point()]
            state += [t for t in (buffers.get("running_mean"), buffers.get("running_var")) if t is not None]
            if state:
                state = [t.detach() if t.dim() == 1 else t.detach().reshape(-1) for t in state]
                vals.append(torch.cat(state).sum() if len(state) > 1 else state[0].sum())
                keys.append((path, index, "state", state[0].dtype))
            if self._watched and index == 0 and x is not None and x.is_floating_point() and x.numel():
                self._measure(path, m, x.detach())

        return hook

    # ------------------------------------------------------------------------------ watched steps

    def _scope(self, layer: _Layer, x: Tensor) -> NormScope | None:
        key = (tuple(x.shape), x.dtype)
        if key not in layer.scopes:
            self._busy = True  # a family class's scope is probed on copies of it, which draw no random numbers
            state = _rng_state()
            try:
                layer.scopes[key] = norm_scope(layer.module, x, self._probes)
            finally:
                self._busy = False
                _set_rng_state(state)
        return layer.scopes[key]

    def _measure(self, path: str, m: nn.Module, x: Tensor) -> None:
        """A watched step's statistics of one norm's input, as 0-d tensors read at the step's end."""
        layer = self._layers[path]
        s = self._scope(layer, x)
        xf = x.float() if x.dtype in _HALF else x
        got: dict[str, Tensor] = {}
        kind = s.kind if s is not None else "unknown"
        if s is not None and (s.reduce or s.groups is not None) and s.kind != "frozen":
            units = _sample_units(xf, s.channel, self._batch) if s.kind == "batch" and s.channel is not None else None
            if units is not None:  # per unit (sample) first: the same two passes, and the drift's noise from them
                um, usq, mean = _unit_moments(units)
                var = usq.mean(0)
                xr = xf
            else:
                xr, dims = (xf.reshape(xf.shape[0], s.groups, -1), (2,)) if s.groups is not None else (xf, s.reduce)
                mean = xr.mean(dims, keepdim=True)
                var = (xr - mean).square().mean(dims)
                mean = mean.reshape(var.shape)
            got["rms"] = (var + mean.square()).mean().sqrt()
            if s.eps is not None:
                if s.kind in ("batch", "layer", "rms"):
                    dead_var = var if s.centered else var + mean.square()
                elif s.kind == "power":
                    dead_var = var + mean.square()
                else:  # instance, group: per channel over every other axis, as the doctor measures it
                    dead_var = _channel_dead_var(xf, s.channel if s.channel is not None else 1, s.centered)
                # the doctor's rule: below eps, and far below the layer's other channels (or exactly constant)
                dead = _dead(dead_var, dead_var.flatten().median(), s.eps)
                got["dead"] = dead.sum()
                got["of"] = torch.tensor(dead.numel())
                got["_mask"] = dead
            before = self._before.get(path)
            if s.kind == "batch" and before is not None:
                count = xr.numel() // max(1, var.numel())
                call = Call(
                    path, m, m.training, 0, 0, extra={"scope": s, "stats": (mean.double(), var.double(), count)}
                )
                mean_z, var_z = _distance(call, before[0], before[1], s.eps or 0.0)
                got["drift_mean_term"] = mean_z.mean()
                got["drift_var_term"] = var_z.mean()
                # what this batch's size alone gives, as the doctor estimates it (its margin below)
                if units is not None and units.shape[0] > 1:
                    nm, nv = _noise_from_units(um, usq, before[1], s.eps or 0.0)
                else:
                    nm, nv = _noise_terms(xf, s, before[1], s.eps or 0.0, self._batch)
                got["drift_noise"] = nm + nv
        else:
            got["rms"] = xf.square().mean().sqrt()
        if kind in ("layer", "rms"):
            flat = x.reshape(-1)
            got["median_abs"] = flat[:: max(1, flat.numel() // _MEDIAN_SAMPLE)].abs().float().median()
        self._measures.append((self._step, path, kind, str(x.dtype).replace("torch.", ""), got))

    def _read_measures(self) -> None:
        """The watched step's statistics, read in one transfer, as rows of :attr:`history`."""
        measures, self._measures = self._measures, []
        tensors = [t for *_, got in measures for k, t in got.items() if k != "_mask"]
        values = iter(torch.stack([t.double().to(tensors[0].device) for t in tensors]).tolist() if tensors else [])
        for step, path, kind, dtype, got in measures:
            row: dict[str, Any] = {"step": step, "layer": path, "kind": kind, "dtype": dtype}
            row["max_abs"] = self._maxabs.get((step, path))
            for k in got:
                if k != "_mask":
                    row[k] = next(values)
            for k in ("dead", "of"):
                if k in row:
                    row[k] = int(row[k])
            if "drift_mean_term" in row:
                row["drift"] = row["drift_mean_term"] + row["drift_var_term"]
            self._history.append(row)
            mask = got.get("_mask")
            if mask is not None:
                layer = self._layers[path]
                if layer.dead0 is None:
                    layer.dead0 = (step, mask)
                if layer.dead_streak is None or layer.dead_streak.shape != mask.shape:
                    # (per-token scopes change with the batch: a run in a row is one of the same shape)
                    layer.dead_streak = torch.zeros_like(mask, dtype=torch.int64)
                    layer.dead_since = torch.full_like(layer.dead_streak, -1)
                layer.dead_streak = (layer.dead_streak + 1) * mask
                layer.dead_since = torch.where(mask, torch.where(layer.dead_streak == 1, step, layer.dead_since), -1)
                layer.dead_last = (step, mask)

    # ------------------------------------------------------------------------------ every step

    def _resolve(self) -> None:
        """Read the pending steps' maxima (one transfer) and update the checks that see every step."""
        pending, self._pending = self._pending, []
        if not pending:
            return
        if all(isinstance(v, Tensor) for *_, v in pending) and len({v.device for *_, v in pending}) == 1:
            flat = torch.cat([v.double() for *_, v in pending]).tolist()  # one transfer
        else:  # norms on several devices (a model split over them)
            flat = []
            for *_, v in pending:
                flat.extend(v.double().tolist() if isinstance(v, Tensor) else [float(t) for t in v])
        i = 0
        watched = set(self._watched_steps)
        for step, keys, _ in pending:
            bad, previous, last = [], None, None
            for path, index, what, dtype in keys:
                if what == "state":  # one sum of the weight, bias and running statistics
                    a = b = flat[i]
                    i += 1
                else:  # the largest and smallest value
                    a, b = flat[i], flat[i + 1]
                    i += 2
                if path != last:
                    previous, last = last, path
                if not (math.isfinite(a) and math.isfinite(b)):
                    bad.append((path, index, what, dtype, a, b, previous))
                    continue
                if what != "input":
                    continue
                big = max(a, -b)
                if index == 0 and step in watched:
                    self._maxabs[(step, path)] = big
                layer = self._layers[path]
                layer.dtype = str(dtype).replace("torch.", "")
                if layer.peak is None or big > layer.peak[1]:
                    layer.peak = (step, big)
                if dtype in _HALF and layer.half is None and 2 * big >= torch.finfo(dtype).max:
                    layer.half = (step, big)
                if dtype == torch.float32 and layer.over_fp16 is None and big >= torch.finfo(torch.float16).max:
                    layer.over_fp16 = (step, big)
            if bad and self._non_finite is None:
                path, index, what, dtype, a, b, previous = bad[0]
                value = "nan" if math.isnan(a) or math.isnan(b) else "inf"
                self._non_finite = {
                    "step": step,
                    "layer": path,
                    "where": what,
                    "call": index,
                    "value": value,
                    "dtype": str(dtype).replace("torch.", ""),
                    "layers_at_step": len({p for p, *_ in bad}),
                    "previous_norm": previous,
                }

    @property
    def non_finite(self) -> dict[str, Any] | None:
        """The first inf/NaN the watch saw: ``{"step", "layer", "where"`` (``"input"``, ``"output"``, or
        ``"state"``: its weight, bias or running statistics), ``"value"`` ("nan" or "inf"), ...``}``, or None.
        Reading it reads the pending steps."""
        self._flush()
        self._resolve()
        return self._non_finite

    @property
    def history(self) -> list[dict[str, Any]]:
        """The statistics recorded on the watched steps, one row (a dict) per norm and step, in order:
        ``step``, ``layer`` (its path), ``kind`` (its scope: batch, layer, rms, group, ...), ``dtype``,
        ``max_abs`` (of its input), ``rms`` (of its input), ``dead`` and ``of`` (channels -- scopes for
        LayerNorm/RMSNorm -- whose variance is below eps), ``drift`` with ``drift_mean_term`` and
        ``drift_var_term`` (BatchNorm: the doctor's train-eval distance of this batch from the running
        statistics before it), ``median_abs`` (LayerNorm/RMSNorm). A list of plain rows: ``pandas.DataFrame(
        w.history)`` makes a table of it."""
        self._flush()
        if self._measures:
            self._resolve()
            self._read_measures()
        return [dict(r) for r in self._history]

    # ------------------------------------------------------------------------------ the first watched step

    def _first_names(self) -> list[str]:
        return [n for n in self.names if n in CHECKS and n not in _NOT_ON_FIRST_STEP and n != "train-eval-drift"]

    def _finish_first(self) -> None:
        recorder, self._recorder = self._recorder, None
        recorder.close()
        if self._first_hook is not None:
            self._first_hook.remove()
            self._first_hook = None
        after = _running(self.model)
        args, kwargs = self._first_args or ((), {})
        x0 = _first_tensor(args, kwargs)
        batch = int(x0.shape[0]) if x0 is not None else None
        names = self._first_names()
        step = self._watched_steps[0]
        state = _rng_state()
        self._busy = True
        try:
            if recorder.single_value is not None and "bn-elements" in names:
                found = _single_value_report(self.model, recorder.single_value, names, args, kwargs, None, 0.0)
                self._first_findings = [_at(f, step) for f in found.findings]
                self._first_ran = ["bn-elements"]
                return
            norms = _norm_calls(recorder.ordered(), self._probes)
            ctx = Context(
                self.model,
                batch,
                norms,
                self._first_running or {},
                after,
                None,  # mask=: the masks the model's modules receive are the recorder's
                self.world_size,
                lambda: None,
                self._first_grad and any(p.requires_grad for p in self.model.parameters()),
                self._probes,
                masks=recorder.masks,
            )
            # the probes run copies of single layers: outside autocast, and with the per-thread state
            # (last_backend, ...) they set kept away from the loop's
            with _no_autocast():
                found = contextvars.copy_context().run(_run_checks, ctx, names)
                stream, note, adds = contextvars.copy_context().run(_stream_norms, ctx)
                self._stream_adds = adds
            self._first_findings = [_at(f, step) for f in found]
            self._first_notes = dict(ctx.notes)
            self._first_ran = names
            self._stream, self._stream_note = stream, note
        finally:
            self._busy = False
            _set_rng_state(state)
            self._first_running = None

    # ------------------------------------------------------------------------------ the report

    def report(self) -> Report:
        """The doctor's :class:`~normscope.doctor.Report` of what the watch saw so far: each finding with
        ``measured["step"]``, the step it was first seen; ``checks`` lists the watch's checks
        (:data:`WATCH_CHECKS`) and the doctor's one-batch checks of the first watched step; ``series`` the
        statistics over the steps that the HTML report draws."""
        self._flush()
        if self._recorder is not None and not self._in_forward:
            self._finish_first()
        self._resolve()
        if self._measures:
            self._read_measures()
        findings = list(self._first_findings)
        checks: dict[str, dict[str, Any]] = {}
        for n in self._first_ran:
            checks[n] = {"ran": n not in self._first_notes, "note": self._first_notes.get(n, "")}
        for n, why in _NOT_ON_FIRST_STEP.items():
            if n in self.names:
                checks[n] = {"ran": False, "note": why}
        series: list[Series] = []
        rows = self._history
        if not self._steps_seen:
            for n in self.names:
                checks.setdefault(n, {"ran": False, "note": "no training-mode forward of the model was seen"})
        else:
            for name, fn in (
                ("non-finite", self._check_non_finite),
                ("train-eval-drift", self._check_drift),
                ("half-overflow", self._check_half),
                ("dead-channels", self._check_dead),
                ("residual-growth", self._check_growth),
            ):
                if name not in self.names:
                    continue
                found, note, drawn = fn(rows)
                findings.extend(found)
                series.extend(drawn)
                checks[name] = {"ran": not note, "note": note}
        seconds = self._seconds + (time.perf_counter() - self._started_at if self._started_at is not None else 0.0)
        return Report(
            findings,
            checks,
            model=type(self.model).__name__,
            inputs=list(self._inputs),
            world_size=self.world_size,
            seconds=seconds,
            series=series,
            layers=[(p, type(layer.module).__name__) for p, layer in self._layers.items()],
            source="watch",
        )

    def _check_non_finite(self, rows):
        nf = self._non_finite
        if nf is None:
            return [], "", []
        path, where, step, before = nf["layer"], nf["where"], nf["step"], nf["previous_norm"]
        half = nf["dtype"] in ("float16", "bfloat16")
        if where == "input":
            came = f"between {before} and this norm" if before else "before this norm (the batch, or the layers before)"
            reason = (
                f"the first inf/NaN of the run: this norm's input held {nf['value']} at step {step}, every norm "
                f"before it in the forward and every earlier step were finite -- it arose {came}"
            )
            fix = (
                "model = model.to(torch.bfloat16)  # float32's range: float16 overflowed before this norm"
                if nf["dtype"] == "float16"
                else f"torch.autograd.set_detect_anomaly(True)  # rerun step {step} from a checkpoint: names the op"
            )
        elif where == "output":
            reason = (
                f"the first inf/NaN of the run: this norm's output held {nf['value']} at step {step} while its "
                "input was finite -- the layer itself overflowed (statistics in its own precision, or its weight)"
            )
            fix = f"model.get_submodule({path!r}).float()  # statistics in float32"
        else:
            reason = (
                f"the first inf/NaN of the run: at step {step} this norm's input was finite but its weight, bias "
                f"or running statistics held {nf['value']} -- an optimizer step wrote it into the weights, or the "
                "running statistics overflowed in their own dtype"
                + (" (a variance above 65504 in float16)" if half else "")
            )
            fix = (
                f"model.get_submodule({path!r}).float()  # weights and running statistics in float32"
                if half
                else "torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # before each optimizer.step()"
            )
        measured = dict(nf)
        threshold = {"error": "any inf or NaN", "source": _NON_FINITE_SOURCE}
        return [Finding("non-finite", path, "error", measured, threshold, reason, fix)], "", []

    def _check_drift(self, rows):
        by: dict[str, list[tuple[int, float, float]]] = {}
        for r in rows:
            if r.get("drift") is not None and math.isfinite(r["drift"]):  # inf/NaN: the non-finite check's
                # beyond the batch's own sampling noise, as the doctor: by the threshold and by twice the noise
                # (torchvision's MNASNet at 8 images of 64 pixels: 32 values per statistic in its last stages)
                noise = r.get("drift_noise") or 0.0
                bound = noise + max(DRIFT_WARNING, NOISE_MARGIN * noise)
                by.setdefault(r["layer"], []).append((r["step"], r["drift"], bound))
        if not by:
            return [], "no BatchNorm with running statistics", []
        out = []
        for path, pts in by.items():
            run = []
            for step, d, bound in reversed(pts):
                if not d > bound:
                    break
                run.append((step, d))
            if not run:
                continue
            run.reverse()
            first, last = run[0], run[-1]
            # Stale statistics stay off; statistics catching up (a fresh model's initial ones, at the momentum's
            # pace) fall. Which one the trend can tell only over a span in which the running average could move
            # most of the way: (1 - momentum)^span, the weight the average still gives to where it stood at the
            # span's start, below 1/2. Over a shorter span a momentum below 0.01 is stale by design (it needs
            # over 70 forwards to move half way); any other is too early to judge.
            peak = max(d for _, d in run)
            m = self._layers[path].module
            momentum = m.momentum if isinstance(m.momentum, float) else 1 / max(1, int(m.num_batches_tracked or 1))
            span = last[0] - first[0]
            kept = (1 - momentum) ** span
            falling = last[1] <= 0.5 * peak
            ratio = last[1] / first[1]
            trend = "falling" if falling or ratio < 2 / 3 else ("rising" if ratio > 1.5 else "flat")
            if len(run) < 2:
                severity, why = "info", " (one watched step so far)"
            elif kept < 0.5:
                severity, why = ("info", " and catching up (falling)") if falling else ("warning", "")
            else:
                severity = "warning" if momentum < 0.01 else "info"
                why = "" if severity == "warning" else f" (momentum {momentum:g}: too few steps yet to tell a trend)"
            measured = {
                "step": first[0],
                "distance": last[1],
                "at_step": last[0],
                "first_distance": first[1],
                "max_distance": peak,
                "watched_steps_above": len(run),
                "trend": trend,
                "momentum": m.momentum,
                "start_weight_left": kept,
            }
            if severity == "warning":
                reason = (
                    f"the running statistics have stayed {_fmt(last[1])} away from the training batches' since step "
                    f"{first[0]} ({len(run)} watched steps, {trend}; momentum {momentum:g} keeps {100 * kept:.0f}% of "
                    "where they stood then): they do not follow the weights, so eval() normalizes with other numbers "
                    "than training does"
                )
            else:
                reason = (
                    f"the running statistics are {_fmt(last[1])} away from the training batch's at step {last[0]}{why}"
                    ": eval() now would normalize with other numbers than training does"
                )
            fix = "model = normscope.recalibrate(model, batches)  # a few training batches" + (
                f"; model.get_submodule({path!r}).momentum = 0.1"
                if isinstance(m.momentum, float) and m.momentum < 0.01
                else ""
            )
            out.append(
                Finding(
                    "train-eval-drift",
                    path,
                    severity,
                    measured,
                    {"warning_above": DRIFT_WARNING, "source": _DRIFT_SOURCE},
                    reason,
                    fix,
                )
            )
        drawn = [
            Series(
                "train-eval-drift",
                "train-eval distance of each BatchNorm's running statistics from the training batch (a warning "
                "beyond the batch's sampling noise plus max(0.133, twice the noise))",
                "distance",
                x="step",
                lines={path: [(step, d) for step, d, _ in pts] for path, pts in by.items()},
                thresholds={"warning": DRIFT_WARNING},
            )
        ]
        return out, "", drawn

    def _check_half(self, rows):
        out = []
        already = {
            f.module: f.severity for f in self._first_findings if f.check == "half-overflow"
        }  # the first step's own finding says more (the float32 copy): no second one for the same layer
        for path, layer in self._layers.items():
            hit = layer.half or layer.over_fp16
            if hit is None or path in already:
                continue
            dtype = getattr(torch, layer.dtype or "float32")
            big = torch.finfo(dtype).max
            step, value = hit
            peak_step, peak = layer.peak
            measured = {"step": step, "max_abs": value, "peak_max_abs": peak, "peak_step": peak_step}
            measured.update({"dtype": layer.dtype, "dtype_max": big, "headroom": big / peak if peak else math.inf})
            threshold = {"warning_above": big / 2, "source": _OVERFLOW_SOURCE}
            fix = "model = model.to(torch.bfloat16)  # float32's range with 8 bits of mantissa"
            if layer.half is not None:
                reason = (
                    f"|x| reached {_fmt(value)} at step {step}, within 2x of {layer.dtype}'s largest value "
                    f"({_fmt(big)}); the largest so far is {_fmt(peak)} (step {peak_step})"
                )
                out.append(Finding("half-overflow", path, "warning", measured, threshold, reason, fix))
            else:
                f16 = torch.finfo(torch.float16).max
                reason = (
                    f"|x| reached {_fmt(value)} at step {step}: this norm's input overflows if the model runs in "
                    "float16"
                )
                threshold = {"info_above": f16, "source": _OVERFLOW_SOURCE}
                out.append(Finding("half-overflow", path, "info", measured, threshold, reason, fix))
        lines: dict[str, list[tuple[int, float]]] = {}
        halves = {r["layer"] for r in rows if r["dtype"] in ("float16", "bfloat16")}
        for r in rows:
            if r["layer"] in halves and r["max_abs"] is not None:
                lines.setdefault(r["layer"], []).append((r["step"], r["max_abs"]))
        drawn = []
        if lines:
            dt = next(r["dtype"] for r in rows if r["layer"] in halves)
            big = torch.finfo(getattr(torch, dt)).max
            drawn.append(
                Series(
                    "half-overflow",
                    f"largest |x| each half-precision norm received ({dt})",
                    "max |x|",
                    x="step",
                    lines=lines,
                    thresholds={"warning": big / 2, f"{dt} maximum": big},
                    log=True,
                )
            )
        return out, "", drawn

    def _check_dead(self, rows):
        out = []
        for path, layer in self._layers.items():
            if layer.dead0 is None or layer.dead_streak is None or layer.dead_last is None:
                continue
            unit = "scopes" if self._kind(path) in ("layer", "rms") else "channels"
            if unit == "scopes" or layer.dead0[1].shape != layer.dead_streak.shape:
                continue  # per-token scopes are other tokens at every step: counted in the history, not followed
            died = (layer.dead_streak >= DEAD_PERSIST) & ~layer.dead0[1]
            new = died.nonzero().flatten()
            if new.numel() == 0:
                continue
            step = int(layer.dead_since[died].min())
            last_step, last = layer.dead_last
            eps = next((s.eps for s in layer.scopes.values() if s is not None), None)
            measured = {
                "step": step,
                unit: int(last.sum()),
                "at_first_step": int(layer.dead0[1].sum()),
                "of": int(last.numel()),
                "at_step": last_step,
                "died": int(new.numel()),
                "new_indices": [int(i) for i in new[:16]],
                "eps": eps,
            }
            out.append(
                Finding(
                    "dead-channels",
                    path,
                    "warning",
                    measured,
                    {"warning_below": eps, "dead_at_watched_steps_in_a_row": DEAD_PERSIST, "source": _DEAD_SOURCE},
                    f"{int(new.numel())} {unit} alive at step {layer.dead0[0]} died during training: variance below "
                    f"eps={eps:g} at every watched step from step {step} to step {last_step} ({int(last.sum())} dead "
                    f"now, {int(layer.dead0[1].sum())} at step {layer.dead0[0]})",
                    f"print(model.get_submodule({path!r}))  # {unit} {measured['new_indices'][:8]}: check the layer "
                    "before (dead ReLU, zero weights, a learning rate too high)",
                )
            )
        lines: dict[str, list[tuple[int, float]]] = {}
        for r in rows:
            if "dead" in r:
                lines.setdefault(r["layer"], []).append((r["step"], r["dead"]))
        lines = {k: v for k, v in lines.items() if any(d for _, d in v)}
        drawn = [Series("dead-channels", "dead channels (variance below eps) per norm", "count", "step", lines)]
        return out, "", drawn if lines else []

    def _kind(self, path: str) -> str | None:
        return next((s.kind for s in self._layers[path].scopes.values() if s is not None), None)

    def _check_growth(self, rows):
        stream = self._stream
        if not stream:
            return [], self._stream_note or "no Pre-LN norm on a residual stream", []
        out = []
        pos = {p: i for i, p in enumerate(stream)}
        by_step: dict[int, dict[str, dict]] = {}
        for r in rows:
            if r["layer"] in pos:
                by_step.setdefault(r["step"], {})[r["layer"]] = r
        first_path, last_path = stream[0], stream[-1]
        n = self._stream_adds if self._stream_adds else len(stream) - 1
        bound = math.sqrt(1 + 0.75 * n)
        ratios = [
            (s, got[last_path]["rms"] / got[first_path]["rms"])
            for s, got in sorted(by_step.items())
            if first_path in got and last_path in got and got[first_path]["rms"] > 0
        ]
        above = [(s, r) for s, r in ratios if r > bound]
        if n and above:
            step, ratio = above[0]
            growing = ratios[-1][1] > ratios[0][1] * 1.1
            out.append(
                Finding(
                    "residual-growth",
                    last_path,
                    "warning" if growing else "info",
                    {
                        "step": step,
                        "rms_ratio": ratio,
                        "rms_ratio_last": ratios[-1][1],
                        "rms_ratio_first_step": ratios[0][1],
                        "from": first_path,
                        "norms_between": len(stream) - 1,
                        "residual_branches": n,
                        "bound": bound,
                    },
                    {"info_above": bound, "source": _GROWTH_SOURCE},
                    f"the residual stream's RMS grows {_fmt(ratio)}x from {first_path} to {last_path} ({n} residual "
                    f"branches later) at step {step}, beyond the {_fmt(bound)}x a Pre-LN transformer has at "
                    "initialization"
                    + (f"; {_fmt(ratios[-1][1])}x at step {ratios[-1][0]}, growing" if growing else ""),
                    "# scale each block's output projection at init by 1/sqrt(2 * layers) (GPT-2), or use "
                    "LayerNorm Scaling / sandwich norms (normscope.SandwichNorm) on the deep layers",
                )
            )
        for path in stream:
            hit = next(
                (
                    (r["step"], r["max_abs"], r["median_abs"])
                    for r in rows
                    if r["layer"] == path
                    and r.get("median_abs")
                    and r["max_abs"] is not None
                    and r["max_abs"] > MASSIVE_ABS
                    and r["max_abs"] > MASSIVE_RATIO * r["median_abs"]
                ),
                None,
            )
            if hit is None:
                continue
            step, big, med = hit
            out.append(
                Finding(
                    "residual-growth",
                    path,
                    "warning",
                    {"step": step, "max_abs": big, "median_abs": med, "ratio": big / med},
                    {"massive_above": MASSIVE_ABS, "ratio_above": MASSIVE_RATIO, "source": _MASSIVE_SOURCE},
                    f"massive activations: at step {step} this norm's input reaches |x| = {_fmt(big)}, "
                    f"{_fmt(big / med)}x its median magnitude -- a few values dominate the residual stream",
                    f"print(model.get_submodule({path!r}))  # massive activations act as biases (Sun et al. 2024); "
                    "in float16 they are the first to overflow",
                )
            )
        lines = {p: [(s, got[p]["rms"]) for s, got in sorted(by_step.items()) if p in got] for p in stream}
        drawn = [
            Series(
                "residual-growth", "RMS of what each Pre-LN norm receives, over steps", "RMS", "step", lines, log=True
            )
        ]
        if by_step:
            steps = sorted(by_step)
            profile = {}
            for s in dict.fromkeys([steps[0], steps[-1]]):
                profile[f"step {s}"] = [(pos[p], r["rms"]) for p, r in by_step[s].items()]
            drawn.append(
                Series(
                    "residual-growth",
                    "RMS of the residual stream by Pre-LN norm",
                    "RMS",
                    "layer",
                    profile,
                    labels=list(stream),
                    thresholds={},
                    log=True,
                )
            )
        return out, "", drawn


def _fmt(v: float) -> str:
    return f"{v:.3g}"


def _at(f: Finding, step: int) -> Finding:
    return dataclasses.replace(f, measured={**f.measured, "step": step})


class _no_autocast:
    """No autocast on the devices torch autocasts (CPU, CUDA) while the checks probe copies of layers."""

    def __enter__(self) -> None:
        self._cms = [torch.autocast("cpu", enabled=False)]
        if torch.cuda.is_available():
            self._cms.append(torch.autocast("cuda", enabled=False))
        for cm in self._cms:
            cm.__enter__()

    def __exit__(self, *exc: object) -> None:
        for cm in reversed(self._cms):
            cm.__exit__(*exc)


def _run_checks(ctx: Context, names: list[str]) -> list[Finding]:
    found = []
    for name in names:
        found.extend(CHECKS[name](ctx))
    return found


def _residual_adds(start, end) -> int | None:
    """The residual additions on the stream from autograd node ``end`` back to node ``start``: at each addition
    the walk takes the skip (the operand the other is computed from), through single-input nodes (views, a layer
    scale, stochastic depth); None where the path is not such a chain. A stream may add branches whose pre-norm
    is no token norm (MaxViT's MBConv, a BatchNorm), which Xiong et al.'s count includes."""
    from .checks import _computed_from

    node, adds = end, 0
    for _ in range(100_000):
        if node is start:
            return adds
        nxt = [n for n, _ in node.next_functions if n is not None and type(n).__name__ != "AccumulateGrad"]
        if type(node).__name__.startswith("AddBackward") and len(nxt) == 2:
            a, b = nxt
            skip = a if _computed_from(b, id(a)) else b if _computed_from(a, id(b)) else None
            if skip is None:
                return None
            adds, node = adds + 1, skip
        elif len(nxt) == 1:
            node = nxt[0]
        else:
            return None
    return None


def _stream_norms(ctx: Context) -> tuple[list[str] | None, str, int | None]:
    """The LayerNorm/RMSNorm layers that receive the residual stream of a Pre-LN model, in forward order: the
    first token norm, and every later one whose input is made by an addition (``x + f(norm(x))``), without
    the Post-LN ones (whose residual passes through a norm) -- read from autograd's graph of the first watched
    step. QK-norms and norms inside a branch receive a projection's output and are left out."""
    token = [c for c in ctx.norms if c.extra["scope"].kind in ("layer", "rms")]
    if not token:
        return [], "no LayerNorm or RMSNorm", None
    if not ctx.grad_graph:
        return None, "no autograd graph on the first watched step (no gradient): the residual stream is not known", None
    notes = dict(ctx.notes)
    post = {f.module for f in CHECKS["post-ln"](ctx)}
    ctx.notes = notes
    if post:
        # Xiong et al.'s bound is for a stream that no norm rescales: in a Post-LN model (BERT, RoBERTa, ALBERT)
        # the norms left between its Post-LN ones are the embeddings' and first layer's, whose ratio measured
        # nothing (ALBERT's shared layers warned at step 0)
        return [], f"Post-LN: the residual stream passes through {len(post)} norm(s) (post-ln)", None
    stream = []
    for i, c in enumerate(token):
        if c.path in post:
            continue
        fn = c.extra.get("input_fn")
        if i == 0 or (fn is not None and type(fn).__name__.startswith("AddBackward")):
            stream.append(c)
    # a hierarchical model (Swin, MaxViT) has one stream per stage, each of its own width, joined by downsampling
    # that is no residual: the bound holds along one of them. The longest run of norms of one width is kept
    # (torchvision's maxvit_t warned from its first stage's 64 channels to its last stage's 512)
    width = {c.path: math.prod(c.args[0].shape[d] for d in c.extra["scope"].reduce) for c in token}
    runs: list[list[Call]] = []
    for c in stream:
        if runs and width[runs[-1][0].path] == width[c.path]:
            runs[-1].append(c)
        else:
            runs.append([c])
    # a stage's first norm receives the downsampling's output, no sum: it starts its stage's stream as the first
    # norm starts the model's (the token norm just before a run, of the run's width)
    order = {c.path: i for i, c in enumerate(token)}
    on_stream = {c.path for c in stream}
    for run in runs:
        i = order[run[0].path]
        before = token[i - 1] if i > 0 else None
        if before is not None and before.path not in on_stream and width[before.path] == width[run[0].path]:
            run.insert(0, before)
    longest = max(runs, key=len, default=[])
    longest = next((r for r in reversed(runs) if len(r) == len(longest)), longest)
    if len(longest) < 2:
        return [], "fewer than two norms on a residual stream", None
    first, last = longest[0].extra.get("input_fn"), longest[-1].extra.get("input_fn")
    adds = _residual_adds(first, last) if first is not None and last is not None else None
    return [c.path for c in longest], "", adds
