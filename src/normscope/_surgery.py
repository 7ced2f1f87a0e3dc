"""What model surgery (:func:`normscope.convert`) and freezing (:func:`normscope.freeze_batchnorm`,
a layer module) share: a layer's copy to probe and its probe input, and the classes made at run time
(a norm followed by its child modules, the integrations' exact subclasses) with the way they pickle.

Below both: a layer module does not import the surgery module, which imports the registry, which
imports the layers.
"""

from __future__ import annotations

import copy
import copyreg
import importlib
from collections import OrderedDict
from typing import Any

import torch
from torch import nn

__all__ = ["HOOKS", "channels", "sample", "bare_copy", "probe_input", "generated", "named", "class_named", "then"]


#: every dict of hooks a module holds: a probe's copy has none of them, a conversion moves them
HOOKS = (
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)


def channels(m: nn.Module) -> int | None:
    """A norm layer's channel count, read off whatever its class keeps it as (None where it keeps none)."""
    for attr in ("num_features", "num_channels"):
        v = getattr(m, attr, None)
        if isinstance(v, int):
            return v
    shape = getattr(m, "normalized_shape", None)
    if shape:
        return int(shape[-1])
    w = getattr(m, "weight", None)  # torchvision's FrozenBatchNorm2d, timm's RmsNorm: sized by their weight
    if isinstance(w, torch.Tensor) and w.dim() == 1:
        return int(w.shape[0])
    return None


def sample(base: type, m: nn.Module) -> tuple[int, ...]:
    """A small input shape for ``m``, a layer whose torch.nn base is ``base``."""
    c = channels(m) or 1
    if issubclass(base, (nn.LayerNorm, nn.RMSNorm)):
        return (3, 5, *m.normalized_shape)
    if base in (nn.BatchNorm1d, nn.InstanceNorm1d):
        return (4, c, 3)
    if base in (nn.BatchNorm3d, nn.InstanceNorm3d):
        return (2, c, 2, 3, 2)
    return (2, c, 3, 5)


def bare_copy(m: nn.Module) -> nn.Module:
    """A copy of ``m`` to probe: no hooks (a user's hook must not run on probe input)."""
    twin = copy.deepcopy(m)
    for sub in twin.modules():
        for attr in HOOKS:
            if getattr(sub, attr, None):
                setattr(sub, attr, OrderedDict())
    return twin


def probe_input(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The probe's input: the same values on every call (seeded), offset from 0 and not unit-scaled."""
    g = torch.Generator().manual_seed(0)
    return (torch.randn(shape, generator=g) * 2 + 0.5).to(device=device, dtype=dtype)


class _Generated(type):
    """The metaclass of the classes normscope makes at run time (:func:`then`'s, the integrations' exact
    subclasses). By name such a class exists only in the process that made it, so a model saved whole
    (``torch.save(model)``, a worker process started by spawn) would not load anywhere else: it is pickled
    as the call that makes it again (``_normscope_rebuild``: a function of this package and its arguments)."""


copyreg.pickle(_Generated, lambda cls: cls.__dict__["_normscope_rebuild"])


def generated(name: str, bases: tuple[type, ...], namespace: dict[str, Any], rebuild: tuple | None) -> type:
    """``type(name, bases, namespace)``, pickled as ``rebuild`` (``(function, args)``: the call that
    returns this class in any process). Without one (a class made from a class defined inside a
    function), or with bases of another metaclass, the class is pickled by name, as any class."""
    if rebuild is None or not all(issubclass(_Generated, type(b)) for b in bases):  # type, or a generated base
        return type(name, bases, namespace)
    return _Generated(name, bases, {**namespace, "_normscope_rebuild": rebuild})


def named(cls: type) -> tuple[str, str] | None:
    """Where another process finds the class ``cls`` (module, qualified name), for a rebuild's arguments;
    None for a class defined inside a function (found by no name)."""
    return None if "<locals>" in cls.__qualname__ else (cls.__module__, cls.__qualname__)


def class_named(module: str, qualname: str) -> type:
    """The class :func:`named` names, as its library defines it: where a ``patch_classes`` put a generated
    subclass in its place, the original that subclass was made from."""
    found: Any = importlib.import_module(module)
    for part in qualname.split("."):
        found = getattr(found, part)
    return getattr(found, "_normscope_original", found)


_THEN: dict[tuple[type, type | None], type] = {}


def then(cls: type, source: type | None = None) -> type:
    """``cls`` followed by its child modules in order: timm's NormAct layers (norm, drop, activation)
    as a normscope layer with the same submodules under the same names.

    ``source``: the class converted losslessly (timm's ``BatchNormAct2d``), a second base after ``cls``: code
    that tells such a layer by its class -- timm's ``freeze_batch_norm_2d`` and ``convert_sync_batchnorm``,
    which carry its ``act`` and ``drop`` over, a model's own ``isinstance`` -- still does. Without it they
    took the layer for a plain BatchNorm2d and dropped its activation (a frozen EfficientNet 3.5 off). The
    source's methods come after ``cls``'s in the method order, and the forward is this one. Not where the
    two bases admit no method order (or metaclass): then ``cls`` alone."""
    key = (cls, source)
    if key not in _THEN:

        def forward(self, input: torch.Tensor) -> torch.Tensor:
            y = cls.forward(self, input)
            for module in self._modules.values():
                y = module(y)
            return y

        name = f"_Then_{cls.__name__}" + ("" if source is None else f"_{source.__name__}")
        ns = {"forward": forward, "__module__": __name__, "__qualname__": name}
        made = None
        if source is not None and not issubclass(cls, source) and named(source) is not None:
            try:
                made = generated(cls.__name__, (cls, source), ns, (then, (cls, source)))
            except TypeError:  # no consistent method order (or metaclass) for the two
                made = None
        if made is None:
            ns["__qualname__"] = name = f"_Then_{cls.__name__}"
            made = _THEN.get((cls, None)) or generated(cls.__name__, (cls,), ns, (then, (cls,)))
            _THEN[(cls, None)] = made
        _THEN[key] = made
        globals()[name] = made  # found by pickle
    return _THEN[key]
