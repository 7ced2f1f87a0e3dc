"""What the doctor looks at: the model's state (saved and put back bit for bit), each norm's scope
on the tensor it received, and a recorder of module calls made with forward hooks only."""

from __future__ import annotations

import copy
import random
import sys
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["Snapshot", "NormScope", "norm_scope", "scope_stats", "Recorder", "Call"]


# ------------------------------------------------------------------------------------------ state


class Snapshot:
    """Everything a diagnosis may change, taken before it runs and put back after, in place: every
    parameter's and buffer's values (the tensor objects stay the same, so optimizers and ties keep
    working), each parameter's ``.grad`` and ``requires_grad``, each module's ``training`` flag and
    its other plain (int, float, bool) attributes, and the random number generators (torch's CPU
    generator, CUDA's when initialized, Python's ``random``, NumPy's global one when imported)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.tensors: list[tuple[Tensor, Tensor]] = []
        self.grads: list[tuple[nn.Parameter, Tensor | None, bool]] = []
        seen: set[int] = set()
        for m in model.modules():
            for t in list(m._parameters.values()) + list(m._buffers.values()):
                if t is None or id(t) in seen:
                    continue
                seen.add(id(t))
                self.tensors.append((t, t.detach().clone()))
                if isinstance(t, nn.Parameter):
                    g = None if t.grad is None else t.grad.detach().clone()
                    self.grads.append((t, g, t.requires_grad))
        self.attrs = [(m, {k: v for k, v in vars(m).items() if type(v) in (bool, int, float)}) for m in model.modules()]
        self.rng_torch = torch.get_rng_state()
        self.rng_cuda = (
            torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
        )
        self.rng_python = random.getstate()
        np = sys.modules.get("numpy")
        self.rng_numpy = np.random.get_state() if np is not None else None

    def restore(self) -> None:
        with torch.no_grad():
            for t, saved in self.tensors:
                if t.shape != saved.shape or t.dtype != saved.dtype:  # a forward that reassigned .data
                    t.data = saved
                else:
                    t.copy_(saved)
        for p, g, requires_grad in self.grads:
            p.grad = g
            p.requires_grad_(requires_grad)
        for m, attrs in self.attrs:
            for k in [k for k, v in vars(m).items() if type(v) in (bool, int, float) and k not in attrs]:
                delattr(m, k)
            vars(m).update(attrs)
        torch.set_rng_state(self.rng_torch)
        if self.rng_cuda is not None:
            torch.cuda.set_rng_state_all(self.rng_cuda)
        random.setstate(self.rng_python)
        if self.rng_numpy is not None:
            sys.modules["numpy"].random.set_state(self.rng_numpy)


# ------------------------------------------------------------------------------------------ scopes


@dataclass(frozen=True)
class NormScope:
    """One norm's statistics on one input: which kind (``"batch"``, ``"instance"``, ``"group"``,
    ``"layer"``, ``"rms"``, ``"power"``, ``"frozen"``), the axes each statistic reduces (``reduce``,
    non-negative), the channel axis of a per-channel norm (else None), GroupNorm's group count,
    whether the mean is subtracted, and eps."""

    kind: str
    reduce: tuple[int, ...]
    channel: int | None
    groups: int | None
    centered: bool
    eps: float | None

    @property
    def batch_stats(self) -> bool:
        """Whether statistics span samples (axis 0 reduced) -- BatchNorm's and PowerNorm's."""
        return 0 in self.reduce and self.groups is None


_EPS_NAMES = ("eps", "variance_epsilon", "epsilon")


def _eps(m: nn.Module) -> float | None:
    for name in _EPS_NAMES:
        v = getattr(m, name, None)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return float(v)
    return None


def is_norm(m: nn.Module) -> bool:
    """A normalization layer: torch's, normscope's, or a model family's ``...Norm`` class with a weight."""
    from .. import modules as M

    known = (
        nn.modules.batchnorm._NormBase,
        nn.LayerNorm,
        nn.GroupNorm,
        nn.RMSNorm,
        M.FrozenBatchNorm2d,
        M.PowerNorm,
    )
    if isinstance(m, known):
        return True
    name = type(m).__name__
    if name.endswith("FrozenBatchNorm2d"):  # torchvision.ops' and timm's: fixed statistics as buffers
        return isinstance(getattr(m, "running_mean", None), Tensor)
    return name.endswith(("RMSNorm", "LayerNorm")) and isinstance(getattr(m, "weight", None), Tensor)


def probe(cls: type, cache: dict) -> Any:
    """``normscope.integrations.transformers.probe_class(cls)``'s configuration (or None), once per
    class per diagnosis (``cache``)."""
    if cls not in cache:
        from ..integrations._exact import probe_class

        cache[cls] = probe_class(cls)[0]
    return cache[cls]


def _centered(m: nn.Module, x: Tensor, cache: dict) -> bool:
    """Whether a LayerNorm/RMSNorm-like layer subtracts the mean: by type for torch's and normscope's,
    by a bit-for-bit probe for a model family's class, else by a shift probe (T5's "LayerNorm" is an
    RMSNorm)."""
    from .. import modules as M

    if isinstance(m, (nn.LayerNorm, M.LayerNorm)):
        return True
    if isinstance(m, nn.RMSNorm):
        return False
    exact = probe(type(m), cache)
    if exact is not None:
        return exact.centered
    return _shift_invariant(m, x, cache)


def _shift_invariant(m: nn.Module, x: Tensor, cache: dict) -> bool:
    """Whether a layer's output ignores a shift of its input (it subtracts the mean), probed once
    per class on a float32 copy with a random input shaped like one sample of ``x``; by its name
    (``...RMSNorm``: no) where the probe cannot run."""
    key = ("centered", type(m))
    if key not in cache:
        g = torch.Generator(device="cpu").manual_seed(0)
        z = torch.randn((2, *x.shape[1:]), generator=g).to(x.device)
        copy_ = copy.deepcopy(m).float()
        try:
            with torch.no_grad():
                y0, y1 = copy_(z), copy_(z + 3.0)
        except (RuntimeError, ValueError, TypeError):
            cache[key] = not type(m).__name__.endswith("RMSNorm")
        else:
            rel = (y1.double() - y0.double()).abs().max() / y0.double().abs().max().clamp_min(1e-30)
            cache[key] = bool(rel < 1e-3)
    return cache[key]


def norm_scope(m: nn.Module, x: Tensor, cache: dict) -> NormScope | None:
    """The scope of ``m``'s statistics on ``x``, None where it is not one of the known layouts
    (``cache``: see :func:`probe`)."""
    from .. import modules as M

    d = x.dim()
    eps = _eps(m)
    if isinstance(m, M.FrozenBatchNorm2d) or type(m).__name__.endswith("FrozenBatchNorm2d"):
        if d < 2:
            return None
        c = getattr(m, "channel_dim", 1) % d
        return NormScope("frozen", (), c, None, True, eps)
    if isinstance(m, M.PowerNorm):  # (B, S, D): a quadratic mean per feature over the positions
        return NormScope("power", tuple(range(d - 1)), d - 1, None, False, eps)
    if isinstance(m, nn.modules.batchnorm._BatchNorm):  # BatchNorm*d, SyncBatchNorm, BatchRenorm
        if d < 2:
            return None
        c = getattr(m, "channel_dim", 1) % d
        return NormScope("batch", tuple(i for i in range(d) if i != c), c, None, True, eps)
    if isinstance(m, nn.modules.instancenorm._InstanceNorm):
        if d < 3:
            return None
        return NormScope("instance", tuple(range(2, d)), 1, None, True, eps)
    if isinstance(m, nn.GroupNorm):
        if d < 2:
            return None
        return NormScope("group", tuple(range(1, d)), 1, m.num_groups, True, eps)
    if isinstance(m, M.LayerNorm2d):
        return NormScope("layer", (1,), None, None, True, eps) if d >= 2 else None
    centered = _centered(m, x, cache)
    shape = getattr(m, "normalized_shape", None)
    if not isinstance(shape, (tuple, list, torch.Size)):
        w = getattr(m, "weight", None)
        shape = tuple(w.shape) if isinstance(w, Tensor) else (x.shape[-1],)
    shape, k = tuple(shape), len(shape)
    kind = "layer" if centered else "rms"
    if k <= d and tuple(x.shape[d - k :]) == shape:
        return NormScope(kind, tuple(range(d - k, d)), None, None, centered, eps)
    if k == 1 and d >= 3 and x.shape[1] == shape[0]:  # a channels-first LayerNorm2d (timm's permutes inside)
        return NormScope(kind, (1,), None, None, centered, eps)
    return None


def scope_rows(x: Tensor, scope: NormScope) -> Tensor:
    """``x`` as (statistics, elements) in float64: one row per statistic of ``scope``."""
    x = x.detach().double()
    if scope.groups is not None:
        return x.reshape(x.shape[0] * scope.groups, -1)
    keep = [i for i in range(x.dim()) if i not in scope.reduce]
    return x.permute(*keep, *scope.reduce).reshape(-1, _numel(x.shape, scope.reduce))


def channel_rows(x: Tensor, channel: int) -> Tensor:
    """``x`` as (channels, elements) in float64: every value of a channel in one row."""
    return x.detach().double().movedim(channel, 0).reshape(x.shape[channel], -1)


def scope_stats(x: Tensor, scope: NormScope) -> tuple[Tensor, Tensor, int]:
    """Per statistic of ``scope``: the mean, the biased variance (float64, two-pass) and the count."""
    rows = scope_rows(x, scope)
    mean = rows.mean(1)
    var = (rows - mean[:, None]).square().mean(1)
    return mean, var, rows.shape[1]


def call_stats(call: Call) -> tuple[Tensor, Tensor, int]:
    """:func:`scope_stats` of a norm call's input, computed once (float64, Welford) and kept on the call."""
    if "stats" not in call.extra:
        x, s = call.args[0].detach(), call.extra["scope"]
        xd = x.double()
        if s.groups is not None:
            xd, dims = xd.reshape(x.shape[0], s.groups, -1), (2,)
        else:
            dims = s.reduce
        var, mean = torch.var_mean(xd, dim=dims, correction=0) if dims else (torch.zeros_like(xd), xd)
        call.extra["stats"] = (mean.flatten(), var.flatten(), _numel(xd.shape, dims))
    return call.extra["stats"]


def _numel(shape: torch.Size, dims: tuple[int, ...]) -> int:
    n = 1
    for i in dims:
        n *= shape[i]
    return n


# ------------------------------------------------------------------------------------------ recording


def copied(v: Any) -> Any:
    """``v`` with every tensor in it (tuples, lists, dicts included) detached and copied: the values as
    they are now, whatever in-place operation later writes into the original."""
    if isinstance(v, Tensor):
        return v.detach().clone()
    if isinstance(v, (tuple, list)):
        return type(v)(copied(x) for x in v) if type(v) in (tuple, list) else v
    if isinstance(v, dict):
        return {k: copied(x) for k, x in v.items()}
    return v


def first_sample(v: Any, n: int) -> Any:
    """``v``'s first sample, copied: every tensor whose dim 0 is the batch (``n``) cut to ``[:1]``; other
    tensors copied whole; containers (tuples, lists, dicts) followed."""
    if isinstance(v, Tensor):
        t = v.detach()
        return (t[:1] if t.dim() and t.shape[0] == n else t).clone()
    if type(v) in (tuple, list):
        return type(v)(first_sample(x, n) for x in v)
    if isinstance(v, dict):
        return {k: first_sample(x, n) for k, x in v.items()}
    return v


def cut_first(v: Any, n: int) -> Any:
    """``v`` for a batch of one: every tensor whose dim 0 is the batch (``n``) cut to ``[:1]`` (a view);
    containers followed; everything else as it is. The inputs of the forward on the first sample alone."""
    if isinstance(v, Tensor):
        return v[:1] if v.dim() and v.shape[0] == n else v
    if type(v) in (tuple, list):
        return type(v)(cut_first(x, n) for x in v)
    if isinstance(v, dict):
        return {k: cut_first(x, n) for k, x in v.items()}
    return v


def tensors_in(v: Any) -> list[Tensor]:
    """Every tensor in ``v`` (containers followed), in order."""
    if isinstance(v, Tensor):
        return [v]
    if isinstance(v, (tuple, list)):
        return [t for x in v for t in tensors_in(x)]
    if isinstance(v, dict):
        return [t for x in v.values() for t in tensors_in(x)]
    return []


def _version(t: Tensor) -> int | None:
    """The tensor's version counter (bumped by every in-place write); None for an inference tensor,
    which has none."""
    return None if t.is_inference() else t._version


@dataclass
class Call:
    """One call of one module in a recorded forward.

    Every tensor a check reads was copied when the module saw it -- the inputs before the module ran,
    the output when it returned -- so that in-place operations after it (``ReLU(inplace=True)``,
    ``x += residual``) cannot change what the checks measure."""

    path: str
    module: nn.Module
    training: bool
    index: int  # which call of this path (0: the first; a module called again gets 1, 2, ...)
    order: int  # the call's place in the forward, counted when it started
    args: tuple = ()  # norms: the positional inputs, copied before the call
    kwargs: dict = field(default_factory=dict)  # norms: the keyword inputs, copied before the call
    output: Any = None  # norms: the output, copied when the call returned
    producer: str | None = None  # the Linear/Conv whose output is this call's first input, unaltered
    sample: tuple | None = None  # (args, kwargs, output) of the first sample, copied, when recorded
    extra: dict = field(default_factory=dict)


@dataclass
class SeenMask:
    """A padding mask that some module of the forward received, read as (batch, positions) bool with
    True = a real position: the argument's ``name`` and ``form`` (``"2-D"``, ``"4-D additive"``, ...),
    the modules it was passed to (``paths``, in forward order) and the first call that received it
    (``order``)."""

    valid: Tensor
    name: str
    form: str
    paths: list[str]
    order: int


_PRODUCERS = (nn.Linear, nn.modules.conv._ConvNd)


class Recorder:
    """Forward pre-hooks and hooks on every module of a model (removed by :meth:`close`).

    With ``norms``, each norm's call is kept with copies of its inputs (taken before it ran) and of its
    output (taken when it returned). With ``samples``, every call keeps copies of its first sample's inputs and
    output (``batch``: the samples in the forward), for the batch-invariance check. With ``masks``,
    every padding mask a module receives by name (see :mod:`normscope.doctor._masks`) is collected in
    :attr:`masks`. The memory held is the norms' inputs and outputs, plus one sample's worth of every
    call with ``samples``."""

    def __init__(
        self, model: nn.Module, batch: int | None, *, norms: bool = True, samples: bool = False, masks: bool = True
    ) -> None:
        self.calls: list[Call] = []
        self.norms = norms
        self.masks: list[SeenMask] = []
        self.batch = batch
        self.samples = samples and bool(batch)
        self.watch_masks = masks
        self._count: dict[str, int] = {}
        self._started = 0
        self._open: dict[str, list[tuple]] = {}
        self._outputs: dict[int, tuple[str, weakref.ref, int | None]] = {}
        self._handles = []
        #: (path, input shape) of a BatchNorm about to normalize one value per channel in training,
        #: which torch refuses ("Expected more than 1 value per channel when training")
        self.single_value: tuple[str, tuple[int, ...]] | None = None
        for path, m in model.named_modules():
            self._handles.append(m.register_forward_pre_hook(self._before(path), with_kwargs=True))
            self._handles.append(m.register_forward_hook(self._after(path), with_kwargs=True))

    def _before(self, path: str):
        def hook(m: nn.Module, args: tuple, kwargs: dict) -> None:
            index = self._count.get(path, 0)
            self._count[path] = index + 1
            order, self._started = self._started, self._started + 1
            call = Call(path, m, m.training, index, order)
            x = next((a for a in args if isinstance(a, Tensor)), None)
            if self.norms and is_norm(m):
                if isinstance(m, nn.modules.batchnorm._BatchNorm):
                    self._one_value(path, m, x)
                call.args, call.kwargs = copied(args), copied(kwargs)
                if x is not None:
                    call.extra["input_fn"] = x.grad_fn  # post-ln reads autograd's graph where x was made
                    entry = self._outputs.get(id(x))
                    if entry is not None and entry[1]() is x and entry[2] == _version(x):
                        call.producer = entry[0]
            if self.samples:
                call.sample = (first_sample(args, self.batch), first_sample(kwargs, self.batch), None)
            if self.watch_masks:
                self._look_for_masks(path, m, args, kwargs, order)
            self._open.setdefault(path, []).append(call)

        return hook

    def _after(self, path: str):
        def hook(m: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            started = self._open.get(path)
            if not started:
                return
            call = started.pop()
            if self.norms and is_norm(m):
                call.output = copied(output)
                if isinstance(output, Tensor):
                    call.extra["output_fn"] = output.grad_fn
            if call.sample is not None:
                call.sample = (*call.sample[:2], first_sample(output, self.batch))
            if isinstance(m, _PRODUCERS) and isinstance(output, Tensor):
                self._outputs[id(output)] = (path, weakref.ref(output), _version(output))
            self.calls.append(call)

        return hook

    def _one_value(self, path: str, m: nn.Module, x: Tensor | None) -> None:
        if x is None or x.dim() < 2 or not (m.training or m.running_mean is None) or self.single_value:
            return
        c = getattr(m, "channel_dim", 1) % x.dim()
        if x.shape[c] and x.numel() // x.shape[c] == 1:
            self.single_value = (path, tuple(x.shape))

    def _look_for_masks(self, path: str, m: nn.Module, args: tuple, kwargs: dict, order: int) -> None:
        from ._masks import named_inputs, padding_mask

        for name, value in named_inputs(m, args, kwargs):
            found = padding_mask(name, value)
            if found is None:
                continue
            valid, form = found
            for seen in self.masks:
                if seen.valid.shape == valid.shape and torch.equal(seen.valid, valid):
                    if path not in seen.paths:
                        seen.paths.append(path)
                    break
            else:
                self.masks.append(SeenMask(valid, name, form, [path], order))

    def ordered(self) -> list[Call]:
        """The calls in the order they started (a parent before its children)."""
        return sorted(self.calls, key=lambda c: c.order)

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._outputs.clear()
        self._open.clear()
