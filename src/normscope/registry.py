"""Normalization layers by name, for model surgery, configs and the lab (after timm's
``create_norm``): every entry takes the channel count first.

    get_norm("group:32", 256)                  # GroupNorm(32, 256)
    get_norm("layer", 768, eps=1e-6)           # LayerNorm(768, eps=1e-6)
    get_norm(functools.partial(normscope.BatchNorm2d, momentum=0.01), 64)
    get_norm("layernorm2d", 96)                # timm's names work too (see TIMM_NAMES)

Names are matched exactly, as torch matches its string options (``nonlinearity="relu"``,
``padding_mode="zeros"``): lower-case, no surrounding whitespace, and ``":G"`` only after
``"group"``/``"groupnorm"`` with ``G`` a positive integer written in ASCII digits. ``"GROUP:2"``,
``" layer"``, ``"batch:"`` raise ValueError naming the valid forms, instead of meaning something by
accident. One exception, on purpose: timm's own names (:data:`TIMM_NAMES`) are also matched the way
timm's ``get_norm_layer`` matches them -- underscores dropped, case ignored (``"Group_Norm"``,
``"LayerNorm2d"``) -- so a timm config string builds here what it builds there.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import re
from collections.abc import Callable
from typing import Any

from torch import nn

from . import _checks as check

__all__ = ["get_norm", "norm_names", "register_norm", "NormSpec", "TIMM_NAMES"]

NormSpec = str | type | functools.partial | Callable[..., nn.Module]

# name -> "module:attribute" (imported on first use, so an optional or not-yet-written layer such
# as SyncBatchNorm costs nothing until asked for) or a factory(num_channels, **kwargs)
_REGISTRY: dict[str, str | Callable[..., nn.Module]] = {}
_NAME = re.compile(r"[a-z0-9_]+")
_GROUPS = re.compile(r"[1-9][0-9]*")  # "group:G": ASCII digits, no sign, no leading zero, no spaces


def register_norm(name: str, target: str | Callable[..., nn.Module]) -> None:
    """Register ``name`` for :func:`get_norm`: a factory ``f(num_channels, **kwargs)`` or a lazy
    ``"package.module:Attribute"`` import path."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        # names are matched exactly (module docstring): one that get_norm could never match is refused
        raise ValueError(
            "register_norm: expected `name` to be a non-empty lower-case identifier (letters, digits, '_'), "
            f"got {name!r}"
        )
    # checked now, not at the first get_norm: a typo here would otherwise surface far from its cause
    if isinstance(target, str):
        module, sep, attr = target.partition(":")
        if not (sep and module and attr):
            raise ValueError(f"register_norm: expected `target` as 'package.module:Attribute', got {target!r}")
    elif not callable(target):
        raise TypeError(
            f"register_norm: expected `target` to be a layer class, a factory f(num_channels, **kwargs) or a "
            f"'package.module:Attribute' string, got {type(target).__name__} {target!r}"
        )
    _REGISTRY[name] = target


def norm_names() -> list[str]:
    """The registered names (``"group"`` also takes ``"group:G"``)."""
    return sorted(_REGISTRY)


def _largest_divisor(c: int, at_most: int) -> int:
    return max(g for g in range(1, min(c, at_most) + 1) if c % g == 0)


def _group(num_channels: int, num_groups: int | None = None, **kw: Any) -> nn.Module:
    from .modules import GroupNorm

    if num_groups is None:  # the default 32, clipped to a divisor of the channel count
        num_groups = _largest_divisor(num_channels, 32)
    return GroupNorm(num_groups, num_channels, **kw)


def _identity(num_channels: int, **kw: Any) -> nn.Module:
    return nn.Identity()


def _group1(num_channels: int, **kw: Any) -> nn.Module:
    from .modules import GroupNorm

    return GroupNorm(1, num_channels, **kw)


def _adaln_zero(num_channels: int, **kw: Any) -> nn.Module:
    from .modules import AdaLayerNorm

    kw.setdefault("gate", True)  # adaLN-Zero: the gate on the branch output
    return AdaLayerNorm(num_channels, **kw)


def _eps_default(target: str, eps: float) -> Callable[..., nn.Module]:
    # timm's own classes default to a different eps than torch's (LayerNorm, LayerNorm2d and RmsNorm
    # use 1e-6): under timm's name, compute what timm's layer computes
    def factory(num_channels: int, **kw: Any) -> nn.Module:
        module, _, attr = target.partition(":")
        kw.setdefault("eps", eps)
        return getattr(importlib.import_module(module), attr)(num_channels, **kw)

    factory.__name__ = f"{target.rpartition(':')[2]}(eps={eps:g})"
    return factory


#: timm's ``create_norm`` names (timm.layers.get_norm_layer) -> what they build there. Each
#: resolves to the normscope layer computing the same thing, with timm's defaults. Not mapped,
#: because normscope has no layer for them: the *fp32 variants (``layernormfp32``, ...), ``rmsnorm2d``
#: and ``simplenorm*``.
TIMM_NAMES: dict[str, str] = {
    "batchnorm": "torch.nn.BatchNorm2d",
    "batchnorm2d": "torch.nn.BatchNorm2d",
    "batchnorm1d": "torch.nn.BatchNorm1d",
    "groupnorm": "timm GroupNorm(C, num_groups=32, eps=1e-5)",
    "groupnorm1": "timm GroupNorm1(C): one group, eps=1e-5",
    "layernorm": "timm LayerNorm(C, eps=1e-6)",
    "layernorm2d": "timm LayerNorm2d(C, eps=1e-6): LayerNorm over C of (N, C, H, W)",
    "rmsnorm": "timm RmsNorm(C, eps=1e-6)",
    "frozenbatchnorm2d": "torchvision.ops.misc.FrozenBatchNorm2d(C, eps=1e-5)",
}


for _name, _target in {
    "batch": "normscope.modules:BatchNorm2d",
    "batch1d": "normscope.modules:BatchNorm1d",
    "batch2d": "normscope.modules:BatchNorm2d",
    "batch3d": "normscope.modules:BatchNorm3d",
    "layer": "normscope.modules:LayerNorm",
    "rms": "normscope.modules:RMSNorm",
    "instance": "normscope.modules:InstanceNorm2d",
    "instance1d": "normscope.modules:InstanceNorm1d",
    "instance2d": "normscope.modules:InstanceNorm2d",
    "instance3d": "normscope.modules:InstanceNorm3d",
    "group": _group,
    "layer2d": "normscope.modules:LayerNorm2d",
    "batchrenorm": "normscope.modules:BatchRenorm2d",
    "batchrenorm1d": "normscope.modules:BatchRenorm1d",
    "batchrenorm2d": "normscope.modules:BatchRenorm2d",
    "batchrenorm3d": "normscope.modules:BatchRenorm3d",
    "power": "normscope.modules:PowerNorm",
    "frozen": "normscope.modules:FrozenBatchNorm2d",
    "sync": "normscope.modules.syncbatchnorm:SyncBatchNorm",
    "dyt": "normscope.modules:DyT",
    "derf": "normscope.modules:Derf",
    "polynorm": "normscope.modules:PolyNorm",
    "adaln": "normscope.modules:AdaLayerNorm",  # get_norm("adaln", D, cond_dim=...)
    "adaln_zero": _adaln_zero,
    "qknorm": "normscope.modules:QKNorm",  # the channel count is head_dim
    # zero-centred weight and the families' casting orders (standalone layers, no transformers needed)
    "gemma_rms": "normscope.integrations.transformers:GemmaRMSNorm",  # scale 1 + w in fp32, cast last
    "llama_rms": "normscope.integrations.transformers:LlamaRMSNorm",  # cast, then scale
    "none": _identity,
    "identity": _identity,
    # timm's names (TIMM_NAMES)
    "batchnorm": "normscope.modules:BatchNorm2d",
    "batchnorm2d": "normscope.modules:BatchNorm2d",
    "batchnorm1d": "normscope.modules:BatchNorm1d",
    "groupnorm": _group,
    "groupnorm1": _group1,
    "layernorm": _eps_default("normscope.modules:LayerNorm", 1e-6),
    "layernorm2d": "normscope.modules:LayerNorm2d",  # its eps default is already timm's 1e-6
    "rmsnorm": _eps_default("normscope.modules:RMSNorm", 1e-6),
    "frozenbatchnorm2d": "normscope.modules:FrozenBatchNorm2d",
}.items():
    register_norm(_name, _target)


def _forms() -> str:
    return f"one of: {', '.join(norm_names())}, or 'group:G' with G a positive integer"


def _resolve_name(
    name: str, where: str = "get_norm", argument: str = "spec", also: str = ""
) -> tuple[Callable[..., nn.Module], dict[str, Any]]:
    """The factory and extra options ``name`` stands for; refusals name the caller (``where``), its
    argument (``argument``) and the other forms it accepts (``also``, before the names):
    :func:`get_norm`'s ``spec``, :func:`normscope.convert`'s ``to``."""
    key, sep, arg = name.partition(":")
    if key not in _REGISTRY:
        # timm's names as timm's get_norm_layer matches them: "Group_Norm", "LayerNorm2d"
        timm_key = key.replace("_", "").lower()
        if timm_key in TIMM_NAMES:
            key = timm_key
    if key not in _REGISTRY:
        hint = ""
        if key.strip().lower() in _REGISTRY or key.strip().lower().replace("_", "") in TIMM_NAMES:
            hint = " (names are exact: lower-case, no surrounding spaces)"
        raise ValueError(f"{where}: unknown norm in `{argument}`: expected {also}{_forms()}{hint}; got {name!r}")
    extra: dict[str, Any] = {}
    if sep:
        if key not in ("group", "groupnorm"):
            raise ValueError(
                f"{where}: only 'group:G' takes an argument; expected `{argument}` {key!r} without ':', got {name!r}"
            )
        if not _GROUPS.fullmatch(arg):
            raise ValueError(
                f"{where}: expected `{argument}` 'group:G' with G a positive integer (ASCII digits, e.g. 'group:32'), "
                f"got {name!r}"
            )
        extra["num_groups"] = int(arg)
    target = _REGISTRY[key]
    if isinstance(target, str):
        module, _, attr = target.partition(":")
        try:
            target = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"{where}: norm {key!r} needs {target}, which is not available: {e}") from e
    return target, extra


def _module(built: object, spec: object) -> nn.Module:
    """What a registered or given factory built, if it is a module: anything else (a factory that returns
    None or a tensor) would otherwise fail far from its cause, in ``convert`` as "'str' object has no
    attribute 'to'"."""
    if not isinstance(built, nn.Module):
        raise TypeError(
            f"get_norm: expected `spec` {spec!r} to build an nn.Module, got {type(built).__name__} {built!r}"
        )
    return built


def _check_arguments(factory: Callable, spec: object, args: tuple, kwargs: dict) -> None:
    """A TypeError naming ``spec`` and the constructor's signature where its arguments do not fit
    (``get_norm("adaln", 8)`` without ``cond_dim``), before it is called: Python's own message named
    ``AdaLayerNorm.__init__()`` and no way out."""
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):  # no signature to read (a builtin): the call itself says what is wrong
        return
    try:
        signature.bind(*args, **kwargs)
    except TypeError as e:
        name = getattr(factory, "__qualname__", type(factory).__name__)
        signature = signature.replace(return_annotation=inspect.Signature.empty)
        raise TypeError(f"get_norm: {spec!r} cannot be built so ({e}); its constructor is {name}{signature}") from None


def get_norm(spec: NormSpec, num_channels: int, **kwargs: Any) -> nn.Module:
    """Build a normalization layer for ``num_channels`` channels.

    Args:
        spec: a registered name (see :func:`norm_names`; ``"group:G"`` sets the groups, plain
            ``"group"`` takes ``num_groups=`` or defaults to the largest divisor of
            ``num_channels`` up to 32), a layer class, or a ``functools.partial`` / callable taking
            the channel count first.
        num_channels: channels (or features) of the input.
        **kwargs: passed to the layer's constructor (``eps=``, ``affine=``...).

    Returns:
        The new module (``nn.Identity()`` for ``"none"``/``"identity"``).

    Raises:
        ValueError: an unknown or malformed name (``"GROUP:2"``, ``" layer"``, ``"batch:"``): names
            are exact (module docstring); the message lists the valid ones and repeats the one given.

    Example::

        >>> normscope.get_norm("group:8", 64)  # doctest: +ELLIPSIS
        GroupNorm(8, 64, eps=1e-05, affine=True...)
    """
    num_channels = check.size(num_channels, "num_channels", "get_norm")  # a Python int, from NumPy's too
    if isinstance(spec, str):
        factory, extra = _resolve_name(spec)
        if "num_groups" in extra and "num_groups" in kwargs:
            raise ValueError(f"get_norm: {spec!r} sets num_groups; got num_groups={kwargs['num_groups']!r} too")
        _check_arguments(factory, spec, (num_channels,), {**extra, **kwargs})
        return _module(factory(num_channels, **extra, **kwargs), spec)
    if callable(spec):
        if isinstance(spec, type) and issubclass(spec, nn.GroupNorm):  # the one class taking groups first
            groups = kwargs.pop("num_groups", None) or _largest_divisor(num_channels, 32)
            return spec(groups, num_channels, **kwargs)
        return _module(spec(num_channels, **kwargs), spec)
    raise TypeError(f"get_norm: expected `spec` to be a name, a class or a callable, got {type(spec).__name__}")
