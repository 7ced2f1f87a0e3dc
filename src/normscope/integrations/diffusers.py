"""Run ``diffusers`` models' normalization layers on normscope's engine, exactly.

As :mod:`normscope.integrations.transformers` does for language models: which classes, and how each
rounds, is found by **probing** the installed diffusers, not listed by hand. The candidates are the
``...Norm...`` classes of ``diffusers.models.normalization`` (where DiT, PixArt, SD3 and Flux take
theirs) and of any diffusers module a model's layers come from; each is patched only if a normscope
configuration gives its bits on random probes (random weights, fp32 and bf16, and an fp32
condition on a bf16 layer), else it is left alone and the report says why.

Two kinds of layer:

* **plain norms** (diffusers' ``RMSNorm``, ``FP32LayerNorm``): one tensor in, probed against
  :data:`normscope.integrations.transformers.CONFIGURATIONS` (RMS or LayerNorm, a casting order).
  diffusers' ``RMSNorm`` rounds as Llama's when its weight has the input's dtype; an fp32 weight on
  bf16 input (a norm kept in fp32) returns fp32 there, which no configuration reproduces, so that
  case runs diffusers' own code.
* **adaptive norms** (``AdaLayerNormZero``, ``AdaLayerNormZeroSingle``, ``AdaLayerNormContinuous``
  and any class with their call signatures, a ``linear`` projection and a ``norm``): each is a
  configuration of :class:`normscope.AdaLayerNorm` -- ``AdaLayerNormZero`` is its 6-chunk
  projection (``chunks=6, gate=True``), ``AdaLayerNormZeroSingle`` the 3-chunk one,
  ``AdaLayerNormContinuous`` the ``order="scale_shift"`` one that casts ``SiLU(cond)`` to x's dtype
  -- with diffusers' per-op rounding (``casting="eager"``).

A patched layer **stays an instance of its diffusers class**: patching makes a subclass whose only
change is ``forward`` (one call into normscope, same signature: ``emb=``, ``timestep``,
``class_labels``, ``hidden_dtype``, ``conditioning_embedding``), so ``state_dict`` keys,
Parameters, hooks and ``isinstance`` are unchanged. :func:`patch` switches the layers of a built
model (each probed with its own weights too); :func:`patch_classes` puts the subclasses in place
of the classes in diffusers' modules, so models built afterwards hold them; :func:`unpatch_classes`
undoes it. ``torch.nn.LayerNorm`` / ``RMSNorm`` / ``GroupNorm`` layers become their normscope
namesakes (:func:`normscope.convert`, lossless).

Not reproduced, so left alone and reported: layers whose forward takes other arguments (diffusers'
older ``AdaLayerNorm(x, timestep, temb)``, ``SD35AdaLayerNormZeroX``'s 9 chunks returned in
another order, ``AdaGroupNorm``), or that compute something else.
"""

from __future__ import annotations

import copy
import importlib
import inspect
import sys
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor, nn

from .. import functional_modern as FM
from .._surgery import class_named, generated, named
from ..modules.modern import AdaLayerNorm
from ._probe import eps_of, probe_input, randomized, restore_classes
from .transformers import CONFIGURATIONS, Exact, PatchReport

__all__ = ["patch", "patch_classes", "unpatch_classes", "candidates", "probe"]

_MODULE = "diffusers.models.normalization"
# (module name, class name) -> the original class, for unpatch_classes
_ORIGINAL_CLASSES: dict[tuple[str, str], type] = {}
# (original class, structure of an instance) -> (the configuration or None, why not)
_PROBED: dict[tuple, tuple[object | None, str | None]] = {}
_SUBCLASSES: dict[tuple[type, object], type] = {}
_PROBE_DTYPES = (torch.float32, torch.bfloat16)
# the other dtypes a model may be cast to after patching: a plain norm's configuration is probed on them too,
# and an input in one it does not reproduce runs diffusers' forward (diffusers' RMSNorm takes its variance
# of ``x.to(torch.float32)``, rounding fp64 input down; normscope computes fp64 in fp64)
_OTHER_DTYPES = (torch.float16, torch.float64)
# (original class, configuration) -> the dtypes of _OTHER_DTYPES it does not reproduce, over every structure probed
_UNREPRODUCED: dict[tuple[type, object], set[torch.dtype]] = {}


# -- the adaptive norms as AdaLayerNorm configurations -------------------------------------------------


# diffusers chunks the projection along dim 1 and broadcasts each chunk over the tokens: that is
# AdaLayerNorm's per-sample modulation for a (B, C) condition only. Any other condition runs
# diffusers' own forward, whatever it does with it; so does input in a dtype of _OTHER_DTYPES the
# configuration does not reproduce (an ``FP32LayerNorm`` inside rounds fp64 input to fp32).


def _zero_forward(self, x, timestep=None, class_labels=None, hidden_dtype=None, emb=None):
    if self.emb is not None:
        emb = self.emb(timestep, class_labels, hidden_dtype=hidden_dtype)
    if not isinstance(emb, Tensor) or emb.dim() != 2 or x.dtype in self._normscope_unreproduced:
        return self._normscope_original.forward(self, x, timestep, class_labels, hidden_dtype, emb)
    return AdaLayerNorm.forward(self, x, emb=emb)


def _single_forward(self, x, emb=None):
    if not isinstance(emb, Tensor) or emb.dim() != 2 or x.dtype in self._normscope_unreproduced:
        return self._normscope_original.forward(self, x, emb=emb)
    return AdaLayerNorm.forward(self, x, emb=emb)


def _continuous_forward(self, x, conditioning_embedding):
    c = conditioning_embedding
    if not isinstance(c, Tensor) or c.dim() != 2 or x.dtype in self._normscope_unreproduced:
        return self._normscope_original.forward(self, x, conditioning_embedding)
    return AdaLayerNorm.forward(self, x, conditioning_embedding)


class _Adaptive(NamedTuple):
    """How a call signature maps onto :class:`normscope.AdaLayerNorm`: the forward that keeps it,
    the order of the projection's chunks, and whether the layer is adaLN-Zero (a gate and more)."""

    forward: Callable
    order: str
    zero: bool


# forward parameter names (after self) -> configuration: the call sites of DiT, PixArt, SD3, Flux
_SIGNATURES: dict[tuple[str, ...], _Adaptive] = {
    ("x", "timestep", "class_labels", "hidden_dtype", "emb"): _Adaptive(_zero_forward, "shift_scale", True),
    ("x", "emb"): _Adaptive(_single_forward, "shift_scale", True),
    ("x", "conditioning_embedding"): _Adaptive(_continuous_forward, "scale_shift", False),
}


def _norm_dim(norm: nn.Module) -> int | None:
    for attr in ("normalized_shape", "dim"):
        shape = getattr(norm, attr, None)
        if isinstance(shape, (tuple, list, torch.Size)) and len(shape) == 1 and isinstance(shape[0], int):
            return int(shape[0])
    return None


class _AdaptiveConfig:
    """What :meth:`normscope.AdaLayerNorm.forward` reads, read from a diffusers layer's own
    ``linear`` and ``norm`` (properties: nothing is copied, a change to the layer is seen)."""

    casting = "eager"  # diffusers rounds each op to the input dtype

    @property
    def embedding_dim(self) -> int:
        return _norm_dim(self.norm)

    @property
    def cond_dim(self) -> int:
        return self.linear.in_features

    @property
    def chunks(self) -> int:
        return self.linear.out_features // self.embedding_dim

    @property
    def gate(self) -> bool:
        return self.chunks >= 3

    @property
    def norm_type(self) -> str:
        return "layer" if isinstance(self.norm, nn.LayerNorm) else "rms"

    @property
    def eps(self) -> float:
        return eps_of(self.norm)


_CONFIG_NAMES = ("embedding_dim", "cond_dim", "chunks", "gate", "norm_type", "eps", "casting", "order")


def _adaptive_unfit(m: nn.Module, sig: tuple[str, ...]) -> str | None:
    """Why ``m`` is not an AdaLayerNorm configuration by its structure; None if it may be."""
    if sig not in _SIGNATURES:
        return f"forward takes {list(sig)}, not one of the adaptive norms' call signatures"
    original = getattr(type(m), "_normscope_original", type(m))
    clash = [n for n in _CONFIG_NAMES if n in vars(m) or any(n in vars(c) for c in original.__mro__)]
    if clash:
        return f"its own attributes {clash} would be shadowed by the configuration's"
    linear, norm = getattr(m, "linear", None), getattr(m, "norm", None)
    if not isinstance(linear, nn.Linear) or not isinstance(norm, nn.Module):
        return "no `linear` projection and `norm` submodule"
    d = _norm_dim(norm)
    if d is None or eps_of(norm) is None:
        return f"its norm {type(norm).__name__} has no one-axis shape and eps"
    if linear.out_features % d:
        return f"the projection's {linear.out_features} outputs are not chunks of {d}"
    if _SIGNATURES[sig].zero and linear.out_features // d < 3:
        return "an adaLN-Zero signature with fewer than 3 chunks"
    if not _SIGNATURES[sig].zero and linear.out_features != 2 * d:
        return "a continuous signature with other than 2 chunks"
    return None


# -- the plain norms as CONFIGURATIONS --------------------------------------------------------------


def _plain_shape(m: nn.Module) -> tuple[int, ...] | None:
    for attr in ("normalized_shape", "dim"):
        shape = getattr(m, attr, None)
        if isinstance(shape, (tuple, list, torch.Size)) and all(isinstance(n, int) for n in shape):
            return tuple(shape)
    return None


def _plain_run(m: nn.Module, x: Tensor, how: Exact) -> Tensor:
    w, b, shape, eps = m.weight, getattr(m, "bias", None), _plain_shape(m), eps_of(m)
    if how.centered:
        return FM.layer_norm(x, shape, w, b, eps, weight_offset=how.weight_offset, casting=how.casting)
    return FM.rms_norm(x, shape, w, eps, weight_offset=how.weight_offset, casting=how.casting)


def _plain_forward(how: Exact, original: type) -> Callable:
    unreproduced = _UNREPRODUCED.setdefault((original, how), set())

    def forward(self, hidden_states: Tensor) -> Tensor:
        w = self.weight
        if (w is not None and w.dtype != hidden_states.dtype) or hidden_states.dtype in unreproduced:
            # a norm kept in another dtype than its input: diffusers promotes there, no configuration does;
            # or an input dtype the configuration does not give diffusers' bits on
            return original.forward(self, hidden_states)
        return _plain_run(self, hidden_states, how)

    return forward


def _plain_unfit(m: nn.Module, sig: tuple[str, ...]) -> str | None:
    if len(sig) != 1:
        return f"forward takes {list(sig)}: neither one tensor nor an adaptive norm's call signature"
    names = set(m._parameters)
    if names - {"weight", "bias"} or m._modules or m._buffers:
        return f"state other than weight/bias ({sorted(names)}, {list(m._modules)}, {list(m._buffers)})"
    if eps_of(m) is None or _plain_shape(m) is None:
        return "no eps and normalized shape (`normalized_shape` or `dim`)"
    return None


# -- probing --------------------------------------------------------------------------------------


def _signature(cls: type) -> tuple[str, ...]:
    return tuple(p for p in inspect.signature(cls.forward).parameters if p != "self")


def _outputs_agree(want, got) -> str | None:
    want = want if isinstance(want, tuple) else (want,)
    got = got if isinstance(got, tuple) else (got,)
    if len(want) != len(got):
        return f"returns {len(got)} outputs where the layer returns {len(want)}"
    for i, (a, b) in enumerate(zip(want, got)):
        if not isinstance(a, Tensor) or a.dtype != b.dtype or a.shape != b.shape:
            return f"output {i} is {b.dtype} {tuple(b.shape)}, the layer's is not"
        if not torch.equal(a, b):
            return f"output {i} differs by {(a.double() - b.double()).abs().max().item():.3g}"
    return None


def _twin(m: nn.Module) -> nn.Module:
    """A copy of ``m`` to probe on random weights; on the CPU where ``m``'s tensors are on the meta device (a
    model built before its checkpoint is loaded), where nothing runs."""
    twin = copy.deepcopy(m)
    return twin.to_empty(device="cpu") if any(t.is_meta for t in twin.parameters()) else twin


def _adaptive_probe(
    m: nn.Module, original: type, own_weights: bool, dtypes: tuple[torch.dtype, ...] = _PROBE_DTYPES
) -> str | None:
    """Run ``original.forward`` and the AdaLayerNorm configuration on a copy of ``m`` (its own
    weights, or random ones in each of ``dtypes``), with the condition in the layer's dtype and, for
    the continuous norm, in fp32 on a bf16 layer (diffusers casts it)."""
    how = _SIGNATURES[_signature(original)]
    twin = _twin(m)
    if getattr(twin, "emb", None) is not None:
        twin.emb = None  # the timestep embedding is diffusers' own code on both sides; probe the norm with emb=
    sub = _subclass(original, how)
    w = twin.linear.weight
    dtypes = (w.dtype,) if own_weights else dtypes
    d = _norm_dim(twin.norm)
    for dtype in dtypes:
        layer = twin if own_weights else randomized(copy.deepcopy(twin), dtype, recurse=True)
        conds = (dtype,) if how.zero or dtype == torch.float32 else (dtype, torch.float32)
        for cdtype in conds:
            x = probe_input((d,), dtype, w.device)  # (3, 5, D): batch 3, 5 tokens
            cond = probe_input((layer.linear.in_features,), cdtype, w.device, seed=2)[:, 0]  # (3, C)
            args = (x, cond) if not how.zero else (x,)
            kwargs = {} if not how.zero else {"emb": cond}
            with torch.no_grad():
                layer.__class__ = original  # a copy: its class is switched back and forth
                want = original.forward(layer, *args, **kwargs)
                layer.__class__ = sub
                got = sub.forward(layer, *args, **kwargs)
            why = _outputs_agree(want, got)
            if why is not None:
                chunks = layer.linear.out_features // d
                return f"AdaLayerNorm(chunks={chunks}, order={how.order!r}) {why} on {dtype} input, {cdtype} condition"
    return None


def _plain_probe(m: nn.Module, original: type) -> tuple[Exact | None, str | None]:
    """The first configuration that gives ``original``'s bits on random copies of ``m`` (fp32 and bf16),
    or None and why not. (:func:`patch` then checks that configuration on the layer's own weights.)"""
    misses = []
    has_bias = getattr(m, "bias", None) is not None
    for how in CONFIGURATIONS:
        if has_bias and not how.centered:
            continue
        miss = None
        for dtype in _PROBE_DTYPES:
            miss = _plain_miss(randomized(_twin(m), dtype), original, how, dtype)
            if miss is not None:
                misses.append(f"{how} {miss} on {dtype}")
                break
        if miss is None:
            _probe_other_dtypes(m, original, how)
            return how, None
    return None, "no normscope configuration reproduces it bit for bit (" + "; ".join(misses[:3]) + ")"


def _probe_other_dtypes(m: nn.Module, original: type, how: Exact) -> None:
    """Record in :data:`_UNREPRODUCED` the dtypes of :data:`_OTHER_DTYPES` on which ``how`` does not
    give ``original``'s bits for a random copy of ``m``: the patched layer runs diffusers' forward there."""
    missed = _UNREPRODUCED.setdefault((original, how), set())
    for dtype in _OTHER_DTYPES:
        if _plain_miss(randomized(_twin(m), dtype), original, how, dtype) is not None:
            missed.add(dtype)


def _plain_miss(layer: nn.Module, original: type, how: Exact, dtype: torch.dtype) -> str | None:
    """How ``how`` misses ``original``'s bits on ``layer`` for probe input in ``dtype`` (None: it gives them)."""
    device = torch.device("cpu") if layer.weight is None else layer.weight.device
    x = probe_input(_plain_shape(layer), dtype, device)
    with torch.no_grad():
        try:
            return _outputs_agree(original.forward(layer, x), _plain_run(layer, x, how))
        except (TypeError, ValueError, RuntimeError) as e:
            return f"raised {type(e).__name__}: {e}"


def _structure(m: nn.Module) -> tuple:
    """What decides whether a configuration reproduces an instance, besides its weights' values."""
    parts: list = [getattr(type(m), "_normscope_original", type(m))]
    for sub in [m, *m.children()]:
        parts.append(type(sub) if sub is not m else None)
        parts += [(n, None if p is None else tuple(p.shape)) for n, p in sub._parameters.items()]
        parts.append(eps_of(sub))
    return tuple(parts)


def probe(m: nn.Module) -> tuple[object | None, str | None]:
    """The normscope configuration that reproduces the diffusers layer ``m`` bit for bit (probed on
    a copy with random weights, fp32 and bf16; cached per class and structure), or ``(None, why)``."""
    if not isinstance(m, nn.Module):
        raise TypeError(f"probe: expected `m` to be a torch.nn.Module (a diffusers layer), got {type(m).__name__}")
    original = getattr(type(m), "_normscope_original", type(m))
    key = _structure(m)
    if key not in _PROBED:
        sig = _signature(original)
        if sig in _SIGNATURES:
            why = _adaptive_unfit(m, sig)
            if why is None:
                why = _adaptive_probe(m, original, own_weights=False)
            if why is None:  # the dtypes a model may be cast to after patching: diffusers' forward where missed
                missed = _UNREPRODUCED.setdefault((original, _SIGNATURES[sig]), set())
                missed.update(d for d in _OTHER_DTYPES if _adaptive_probe(m, original, False, (d,)) is not None)
            _PROBED[key] = (None, why) if why else (_SIGNATURES[sig], None)
        else:
            why = _plain_unfit(m, sig)
            _PROBED[key] = (None, why) if why else _plain_probe(m, original)
    return _PROBED[key]


def _subclass(original: type, how: object) -> type:
    """The subclass of ``original`` whose forward is normscope's ``how`` (made once per pair)."""
    if (original, how) not in _SUBCLASSES:
        key = f"_Exact_{original.__module__.replace('.', '_')}_{original.__qualname__.replace('.', '_')}"
        if isinstance(how, _Adaptive):
            bases, body = (_AdaptiveConfig, original), {"forward": how.forward, "order": how.order}
            doc = f"{original.__name__} computed by normscope.AdaLayerNorm (order={how.order!r}, casting='eager')"
        else:
            bases, body = (original,), {"forward": _plain_forward(how, original)}
            doc = f"{original.__name__} computed by normscope as {how}"
            key += f"_{how.casting}_{int(how.centered)}"
        sub = generated(
            original.__name__,
            bases,
            {
                **body,
                "__module__": __name__,
                "__qualname__": key,  # found here by pickle; the name stays diffusers'
                "__doc__": f"{doc} (bit for bit; see normscope.integrations.diffusers).\n\n{original.__doc__ or ''}",
                "_normscope_original": original,
                "_normscope_how": how,
                # the input dtypes of _OTHER_DTYPES that run diffusers' forward (the adaptive forwards read it)
                "_normscope_unreproduced": _UNREPRODUCED.setdefault((original, how), set()),
            },
            None if named(original) is None else (_rebuilt, (*named(original), how)),  # made again where loaded
        )
        setattr(sys.modules[__name__], key, sub)
        _SUBCLASSES[(original, how)] = sub
    return _SUBCLASSES[(original, how)]


def _rebuilt(module: str, qualname: str, how: object) -> type:
    """The class of a patched layer of the diffusers class ``module.qualname`` loaded from a pickle. Made here
    for the first time, its configuration was probed in another process on structures unknown here: every
    dtype of :data:`_OTHER_DTYPES` runs diffusers' forward (the original's bits, whatever they are)."""
    original = class_named(module, qualname)
    if (original, how) not in _SUBCLASSES:
        _UNREPRODUCED.setdefault((original, how), set()).update(_OTHER_DTYPES)
    return _subclass(original, how)


def _rebuilt_constructed(module: str, qualname: str, how: object) -> type:
    _rebuilt(module, qualname, how)
    return _constructed_subclass(class_named(module, qualname), how)


def _describe(how: object) -> str:
    if isinstance(how, _Adaptive):
        return f"AdaLayerNorm(order={how.order!r}, casting='eager'{', gate=True' if how.zero else ''})"
    return str(how)


# -- discovery --------------------------------------------------------------------------------------


def candidates() -> dict[str, type]:
    """The normalization classes of the installed diffusers' ``diffusers.models.normalization``
    (``{name: class}``): every ``nn.Module`` class there whose name says Norm."""
    module = importlib.import_module(_MODULE)
    return {
        name: cls
        for name, cls in vars(module).items()
        if isinstance(cls, type) and issubclass(cls, nn.Module) and "Norm" in name and cls.__module__ == _MODULE
    }


def _is_candidate(cls: type) -> bool:
    if "_normscope_original" in cls.__dict__:
        return True
    return cls.__module__.startswith("diffusers.") and "Norm" in cls.__name__


# -- patching -------------------------------------------------------------------------------------


def patch(model: nn.Module, *, verify: bool = True) -> PatchReport:
    """Run a built ``diffusers`` model's normalization layers on normscope, in place.

    Every layer of a diffusers norm class that a normscope configuration reproduces bit for bit
    (module docstring) keeps its identity -- same object, Parameters, hooks, ``state_dict`` keys,
    still an instance of its class, called as before -- with its class switched to the exact
    subclass; ``torch.nn`` LayerNorm, RMSNorm and GroupNorm layers become normscope's (lossless).

    Args:
        model: any ``torch.nn.Module`` (a diffusers model or a part of one).
        verify: also probe each layer with its own weights before switching it; a layer that
            differs is left alone and reported. Default: True.

    Returns:
        A printable :class:`~normscope.integrations.transformers.PatchReport`: layers replaced per
        class and how, classes skipped and why.

    Example::

        >>> from diffusers import DiTTransformer2DModel
        >>> from normscope.integrations.diffusers import patch
        >>> model = DiTTransformer2DModel(num_attention_heads=2, attention_head_dim=8, in_channels=4,
        ...     num_layers=2, sample_size=8, patch_size=2, num_embeds_ada_norm=10)
        >>> print(patch(model))
        normscope patched 7 normalization layer(s)
          AdaLayerNormZero: 2 replaced as AdaLayerNorm(order='shift_scale', casting='eager', gate=True)
          LayerNorm: 5 replaced
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"patch: expected `model` to be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(verify, bool):  # "no" is truthy: a string here would verify, silently
        raise TypeError(f"patch: expected `verify` to be a bool, got {verify!r}")
    from ..convert import convert

    report = PatchReport()
    for m in list(model.modules()):
        cls = type(m)
        if not _is_candidate(cls):
            continue
        original = getattr(cls, "_normscope_original", cls)
        name = original.__name__
        how, why = probe(m)
        if how is not None and verify:
            if isinstance(how, _Adaptive):  # meta weights: nothing to run on, the structure's probe stands
                why = None if m.linear.weight.is_meta else _adaptive_probe(m, original, own_weights=True)
            elif m.weight is not None and not m.weight.is_meta:
                # the class's configuration itself, on this layer's weights (not the first configuration
                # that matches them: fresh weights 1 and 0 give several configurations the same bits)
                dtype = m.weight.dtype
                if dtype not in _UNREPRODUCED.get((original, how), ()):
                    miss = _plain_miss(m, original, how, dtype)
                    why = None if miss is None else f"{how} {miss} on {dtype} with this layer's own weights"
        if how is None or why is not None:
            report.skipped[name] = why
            continue
        m.__class__ = _subclass(original, how)
        report.how[name] = _describe(how)
        report.replaced[name] = report.replaced.get(name, 0) + 1
    torch_norms = (nn.LayerNorm, nn.RMSNorm, nn.GroupNorm)
    _, converted = convert(model, where=lambda m: type(m) in torch_norms)
    for r in converted:
        name = r.source.split("(")[0].split(".")[-1]
        report.replaced[name] = report.replaced.get(name, 0) + 1
    return report


def patch_classes(*names: str) -> PatchReport:
    """Make diffusers build normscope-backed norms, before any model exists.

    Each class of :func:`candidates` (or only those named) that a normscope configuration
    reproduces bit for bit on probes (built with a small width and random weights) is replaced, in
    ``diffusers.models.normalization`` and in every loaded ``diffusers`` module that imported it, by
    its exact subclass, so models built afterwards hold layers that are still instances of the
    diffusers class. Models built before are untouched (use :func:`patch`).

    Args:
        *names: class names of :func:`candidates` (``"AdaLayerNormZero"``, ``"RMSNorm"``, ...).
            Default: all of them.

    Returns:
        A :class:`~normscope.integrations.transformers.PatchReport` with ``unit="class"``.

    Example::

        >>> from normscope.integrations.diffusers import patch_classes, unpatch_classes
        >>> patch_classes("AdaLayerNormZero").replaced
        {'AdaLayerNormZero': 1}
        >>> unpatch_classes()
        ['AdaLayerNormZero']
    """
    found = candidates()
    unknown = [n for n in names if n not in found]
    if unknown:
        raise ValueError(
            f"patch_classes: expected class names of {_MODULE} with a norm in them ({', '.join(sorted(found))}), "
            f"got {unknown}"
        )
    report = PatchReport(unit="class")
    for name in names or tuple(found):
        original = found[name].__dict__.get("_normscope_original", found[name])
        layer, why = _construct(original)
        how = None
        if layer is not None:
            how, why = probe(layer)
        if how is None:
            report.skipped[name] = why
            continue
        sub = _constructed_subclass(original, how)
        for mod in [m for k, m in list(sys.modules.items()) if k.startswith("diffusers.")]:
            if mod is not None and mod.__dict__.get(name) is original:
                _ORIGINAL_CLASSES.setdefault((mod.__name__, name), original)
                setattr(mod, name, sub)
        report.replaced[name] = 1
        report.how[name] = _describe(how)
    return report


def _construct(cls: type) -> tuple[nn.Module | None, str | None]:
    """``cls`` at a small width, as the probe builds it: (16,) for a norm, (16, 8) with a condition width."""
    for args in ((16,), (16, 8), (16, 1e-6)):
        try:
            return cls(*args), None
        except TypeError:
            continue
    return None, f"cannot build it as {cls.__name__}(16), (16, 8) or (16, eps)"


def _constructed_subclass(original: type, how: object) -> type:
    """The class :func:`patch_classes` puts in place of ``original``: the exact subclass, built as
    ``original`` is; an instance whose structure does not probe exact (a constructor option the
    class probe did not see -- another norm type, a bias) runs diffusers' own forward."""
    exact = _subclass(original, how)
    key = f"_Built{exact.__qualname__}"
    if not hasattr(sys.modules[__name__], key):

        def __init__(self, *args, **kwargs):
            original.__init__(self, *args, **kwargs)
            self._normscope_exact = probe(self)[0] == how

        def forward(self, *args, **kwargs):
            if self.__dict__.get("_normscope_exact", False):
                return exact.forward(self, *args, **kwargs)
            return original.forward(self, *args, **kwargs)

        sub = generated(
            original.__name__,
            (exact,),
            {"__init__": __init__, "forward": forward, "__module__": __name__, "__qualname__": key},
            None if named(original) is None else (_rebuilt_constructed, (*named(original), how)),
        )
        setattr(sys.modules[__name__], key, sub)
    return getattr(sys.modules[__name__], key)


def unpatch_classes() -> list[str]:
    """Undo :func:`patch_classes`: put the original classes back; returns their names (once each)."""
    return restore_classes(_ORIGINAL_CLASSES)
