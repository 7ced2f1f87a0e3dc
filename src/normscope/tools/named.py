"""The teaching metadata of the registry's names: the table that ``explain``, ``draw`` and ``explore`` read.

The names are the registry's (:func:`normscope.norm_names`, what :func:`normscope.get_norm` builds):
``"batch"``, ``"layer"``, ``"instance"``, ``"group"``, ``"rms"``, ``"layer2d"``, ``"qknorm"``, ``"adaln"``. This
table adds what teaching needs to a name of that one list, and names nothing the registry does not know. Its
:class:`NamedLayer` says how to title and describe it, which ``torch.nn`` classes are that
layer, how to build its :class:`~normscope.scope.Scope` for an input's layout and rank, and how
``torch.nn.functional`` computes the same normalization (without affine), which the tools compare their
output against. :func:`scope_ids` numbers the scopes of a tensor for their tables and pictures.

Two layouts, as the source articles draw them:

* ``"nchw"`` -- (N, C, *) activations of a convolutional network (Wu & He, *Group Normalization*, 2018, Fig. 2);
* ``"bsd"`` -- (batch, sequence, features) activations of a transformer, features last.

Example::

    >>> from normscope.tools.named import NAMED, scope_ids
    >>> NAMED["group"].scope("nchw", ndim=4, groups=2)
    Scope(reduce=None, keep=(0,), centered=True, groups=2, group_dim=1, affine=(1,))
    >>> scope_ids(NAMED["group"].scope("nchw", groups=2), (1, 4, 2))[0]
    tensor([[0, 0], [0, 0], [1, 1], [1, 1]])
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..modules.layernorm2d import LayerNorm2d
from ..scope import Resolved, Scope

__all__ = [
    "LAYOUTS",
    "MASKED",
    "NAMED",
    "NamedLayer",
    "ParsedName",
    "check_layout",
    "get",
    "module_scope",
    "names",
    "parse",
    "scope_ids",
    "spellings",
]

LAYOUTS = ("nchw", "bsd")

#: builds a layout's scope from (input rank, groups, trailing axes of LayerNorm/RMSNorm or None)
ScopeFn = Callable[[int, int, "int | None"], Scope]
#: the same normalization by torch.nn.functional, no affine: (x, groups, eps) -> (y, what computed it)
TorchFn = Callable[[Tensor, int, float], "tuple[Tensor, str]"]


@dataclass(frozen=True)
class NamedLayer:
    """One named layer of the teaching tools.

    Attributes:
        name: the key, a name of the registry (``"group"``; :func:`normscope.get_norm` builds the layer).
        title: what pictures and pages call it (``"GroupNorm"``).
        note: its scope in one sentence, for the explorer page.
        torch_class: the ``torch.nn`` class family (``"BatchNorm"``), or None when torch has none (LayerNorm2d).
        per_rank: the torch class is named per spatial rank (``BatchNorm1d``/``2d``/``3d``).
        aliases: short names accepted for it (``"bn"``).
        module_types: classes whose instances are this layer (torch's, or normscope's where torch has none).
        nchw, bsd: the scope in each layout as ``(ndim, groups, last) -> Scope``; None: not meaningful there.
        torch_nchw, torch_bsd: the same normalization by ``torch.nn.functional`` in each layout.
    """

    name: str
    title: str
    note: str
    torch_class: str | None
    per_rank: bool
    aliases: tuple[str, ...]
    module_types: tuple[type, ...]
    nchw: ScopeFn | None
    bsd: ScopeFn | None
    torch_nchw: TorchFn | None
    torch_bsd: TorchFn | None

    @property
    def layouts(self) -> tuple[str, ...]:
        """The layouts it is defined in."""
        return tuple(lo for lo in LAYOUTS if getattr(self, lo) is not None)

    @property
    def torch_names(self) -> tuple[str, ...]:
        """The ``torch.nn`` class names that are this layer (``BatchNorm1d``, ``BatchNorm2d``, ``BatchNorm3d``)."""
        if self.torch_class is None:
            return ()
        return tuple(f"{self.torch_class}{k}d" for k in (1, 2, 3)) if self.per_rank else (self.torch_class,)

    def torch_name(self, ndim: int) -> str:
        """The ``torch.nn`` class for an input of rank ``ndim``: ``BatchNorm2d`` for (N, C, H, W)."""
        if self.torch_class is None:
            raise ValueError(f"layer {self.name!r} has no torch.nn class (torch has no {self.title})")
        return f"{self.torch_class}{max(ndim - 2, 1)}d" if self.per_rank else self.torch_class

    def scope(self, layout: str = "nchw", ndim: int = 3, groups: int = 2, last: int | None = None) -> Scope:
        """The engine scope in ``layout`` for an input of rank ``ndim``.

        Args:
            layout: ``"nchw"`` or ``"bsd"``. Default: ``"nchw"``.
            ndim: the input's rank (LayerNorm/RMSNorm in nchw normalize all but the batch axis). Default: 3.
            groups: GroupNorm's number of groups. Default: 2.
            last: LayerNorm/RMSNorm's number of trailing axes. Default: all but the batch axis in nchw, D in bsd.

        Raises:
            ValueError: an unknown layout, a bad ``groups``, or a layer not defined in ``layout``.
        """
        check_layout(layout)
        if not isinstance(groups, int) or isinstance(groups, bool) or groups < 1:
            raise ValueError(f"expected `groups` to be a positive int, got {groups!r}")
        fn = getattr(self, layout)
        if fn is None:
            raise self._undefined(layout)
        return fn(ndim, groups, last)

    def torch_equivalent(self, x: Tensor, layout: str = "nchw", groups: int = 2, eps: float = 1e-5):
        """``(y, what)``: the same normalization of ``x`` by ``torch.nn.functional`` (no affine), and which call
        computed it. torch's own errors (e.g. one value per channel in training) propagate."""
        check_layout(layout)
        fn = getattr(self, f"torch_{layout}")
        if fn is None:
            raise self._undefined(layout)
        return fn(x, groups, eps)

    def _undefined(self, layout: str) -> ValueError:
        return ValueError(f"layer {self.name!r} is not defined in layout {layout!r}: expected one of {names(layout)}")


def check_layout(layout: str) -> str:
    """``layout`` itself, or ValueError naming the valid layouts."""
    if layout not in LAYOUTS:
        raise ValueError(f"expected `layout` to be one of {list(LAYOUTS)}, got {layout!r}")
    return layout


def _trailing(default: Callable[[int], int]) -> Callable[[int, int | None], int]:
    return lambda ndim, last: default(ndim) if last is None else last


_all_but_batch = _trailing(lambda ndim: ndim - 1)  # LayerNorm over (C, *): one scope per sample
_features = _trailing(lambda ndim: 1)  # LayerNorm over D: one scope per token


def _batch_bsd(x: Tensor, g: int, eps: float):
    b, s, d = x.shape
    y = F.batch_norm(x.reshape(b * s, d), None, None, training=True, eps=eps).reshape(b, s, d)
    return y, "torch.nn.functional.batch_norm on (B·S, D)"


def _layer2d_nchw(x: Tensor, g: int, eps: float):
    y = F.layer_norm(x.movedim(1, -1), (x.shape[1],), eps=eps).movedim(-1, 1)
    return y, "torch.nn.functional.layer_norm over C (channels moved last)"


def _qk_bsd(x: Tensor, g: int, eps: float):
    b, s, d = x.shape
    y = F.rms_norm(x.reshape(b, s, g, d // g), (d // g,), eps=eps).reshape(b, s, d)
    return y, f"torch.nn.functional.rms_norm over head_dim of each of {g} heads"


_TABLE = (
    NamedLayer(
        name="batch",
        title="BatchNorm",
        note="one mean/var per channel, over the batch and every position (in (B,S,D): per feature, "
        "over every token of every sequence -- padding included unless masked)",
        torch_class="BatchNorm",
        per_rank=True,
        aliases=("bn",),
        module_types=(nn.modules.batchnorm._BatchNorm,),
        nchw=lambda ndim, g, last: Scope.batch(),
        bsd=lambda ndim, g, last: Scope.batch(channel_dim=-1),
        torch_nchw=lambda x, g, eps: (
            F.batch_norm(x, None, None, training=True, eps=eps),
            "torch.nn.functional.batch_norm",
        ),
        torch_bsd=_batch_bsd,
    ),
    NamedLayer(
        name="layer",
        title="LayerNorm",
        note="one mean/var per sample over (C, H·W); in (B,S,D) one per token, a strip over D",
        torch_class="LayerNorm",
        per_rank=False,
        aliases=("ln",),
        module_types=(nn.LayerNorm,),
        nchw=lambda ndim, g, last: Scope.layer(_all_but_batch(ndim, last)),
        bsd=lambda ndim, g, last: Scope.layer(_features(ndim, last)),
        torch_nchw=lambda x, g, eps: (F.layer_norm(x, x.shape[1:], eps=eps), "torch.nn.functional.layer_norm"),
        torch_bsd=lambda x, g, eps: (F.layer_norm(x, x.shape[-1:], eps=eps), "torch.nn.functional.layer_norm"),
    ),
    NamedLayer(
        name="instance",
        title="InstanceNorm",
        note="one mean/var per (sample, channel), over the positions",
        torch_class="InstanceNorm",
        per_rank=True,
        aliases=("in",),
        module_types=(nn.modules.instancenorm._InstanceNorm,),
        nchw=lambda ndim, g, last: Scope.instance(),
        bsd=lambda ndim, g, last: Scope(keep=(0, 2), affine=(2,)),
        torch_nchw=lambda x, g, eps: (F.instance_norm(x, eps=eps), "torch.nn.functional.instance_norm"),
        torch_bsd=lambda x, g, eps: (
            F.instance_norm(x.transpose(1, 2), eps=eps).transpose(1, 2),
            "torch.nn.functional.instance_norm on (B, D, S)",
        ),
    ),
    NamedLayer(
        name="group",
        title="GroupNorm",
        note="one mean/var per (sample, group of C/G channels), over the positions",
        torch_class="GroupNorm",
        per_rank=False,
        aliases=("gn",),
        module_types=(nn.GroupNorm,),
        nchw=lambda ndim, g, last: Scope.group(g),
        bsd=lambda ndim, g, last: Scope(keep=(0,), groups=g, group_dim=2, affine=(2,)),
        torch_nchw=lambda x, g, eps: (F.group_norm(x, g, eps=eps), "torch.nn.functional.group_norm"),
        torch_bsd=lambda x, g, eps: (
            F.group_norm(x.transpose(1, 2), g, eps=eps).transpose(1, 2),
            "torch.nn.functional.group_norm on (B, D, S)",
        ),
    ),
    NamedLayer(
        name="rms",
        title="RMSNorm",
        note="LayerNorm's scope without the mean: one mean square per sample (per token in (B,S,D))",
        torch_class="RMSNorm",
        per_rank=False,
        aliases=(),
        module_types=(nn.RMSNorm,),
        nchw=lambda ndim, g, last: Scope.rms(_all_but_batch(ndim, last)),
        bsd=lambda ndim, g, last: Scope.rms(_features(ndim, last)),
        torch_nchw=lambda x, g, eps: (F.rms_norm(x, x.shape[1:], eps=eps), "torch.nn.functional.rms_norm"),
        torch_bsd=lambda x, g, eps: (F.rms_norm(x, x.shape[-1:], eps=eps), "torch.nn.functional.rms_norm"),
    ),
    NamedLayer(
        name="layer2d",
        title="LayerNorm2d (channels)",
        note="channels-first LayerNorm (ConvNeXt): one mean/var per (sample, position), over C",
        torch_class=None,
        per_rank=False,
        aliases=(),
        module_types=(LayerNorm2d,),  # an nn.LayerNorm subclass: the most specific class decides (module_scope)
        nchw=lambda ndim, g, last: Scope.channels(),
        bsd=None,
        torch_nchw=_layer2d_nchw,
        torch_bsd=None,
    ),
    NamedLayer(
        name="qknorm",
        title="QK-norm (per head)",
        note="RMSNorm of queries/keys per head (Qwen3, Gemma 3): each token's D features split into G heads "
        "of D/G, one mean square per (token, head) -- GroupNorm's grouping along the feature axis; OLMo 2 "
        "takes the whole D (the rms layer)",
        torch_class=None,
        per_rank=False,
        aliases=("qk",),
        module_types=(),  # QKNorm takes q and k (B, S, H, D): no single-tensor picture of a module
        nchw=None,
        bsd=lambda ndim, g, last: Scope(reduce=(2,), centered=False, groups=g, group_dim=2, affine=(2,)),
        torch_nchw=None,
        torch_bsd=_qk_bsd,
    ),
    NamedLayer(
        name="adaln",
        title="AdaLN (DiT)",
        note="LayerNorm's scope, one mean/var per token over D; the affine is not a parameter: shift and "
        "(1 + scale) come from a conditioning tensor, one per sample (or per token), as AdaIN's come from a style",
        torch_class=None,
        per_rank=False,
        aliases=("adaln_zero",),
        module_types=(),  # AdaLayerNorm takes (x, cond)
        nchw=None,
        bsd=lambda ndim, g, last: Scope.layer(_features(ndim, last)),
        torch_nchw=None,
        torch_bsd=lambda x, g, eps: (
            F.layer_norm(x, x.shape[-1:], eps=eps),
            "torch.nn.functional.layer_norm (the modulation from the condition comes after)",
        ),
    ),
)

#: the named layers by name, in the order the tools list them
NAMED: dict[str, NamedLayer] = {entry.name: entry for entry in _TABLE}
#: every alias, and the long forms of the modern norms' names, -> the table's key
_ALIASES = {alias.replace("_", ""): e.name for e in _TABLE for alias in e.aliases}
_ALIASES.update({"adalnzero": "adaln", "adalayer": "adaln", "adaptivelayer": "adaln"})
_ALIASES.update({"layer2d": "layer2d", "layernorm2d": "layer2d"})


def names(layout: str | None = None) -> list[str]:
    """The names of the table, optionally only those defined in ``layout``."""
    if layout is not None:
        check_layout(layout)
    return [n for n, e in NAMED.items() if layout is None or getattr(e, layout) is not None]


#: the masked norms of the tools: ``masked_<name>`` is the named layer whose statistics count only the valid
#: elements of a padding mask (``normscope explain masked_batch``, ``normscope draw masked_layer --layout bsd``)
MASKED: tuple[str, ...] = ("batch", "instance", "group", "layer")


class ParsedName(NamedTuple):
    """A name as a user types it, read against the table: ``"MaskedBatchNorm2d"`` -> ``("batch", 2, True)``."""

    name: str  #: the table's key
    spatial: int | None  #: the spatial rank a torch class name implies (``2`` for ``BatchNorm2d``), else None
    masked: bool  #: asked for by a ``masked_`` name


def spellings() -> list[str]:
    """Every name the tools accept, for help texts: the table's keys, then the masked ones."""
    return [*NAMED, *(f"masked_{n}" for n in MASKED)]


def parse(text: str) -> ParsedName:
    """Read a layer name as ``explain`` and ``draw`` accept it: a key of the table (``"group"``), an alias
    (``"gn"``), a torch class name (``"GroupNorm"``, ``"BatchNorm2d"``) or any of them with a ``masked``
    prefix (``"masked_batch"``). Case, ``_`` and ``-`` do not matter.

    Raises:
        ValueError: an unknown name, listing the accepted ones.
    """
    key = str(text).strip().lower().replace("_", "").replace("-", "")
    masked = key.startswith("masked") and key != "masked"
    if masked:
        key = key[len("masked") :]
    spatial = None
    if key in _ALIASES:  # whole names first: "layernorm2d" is LayerNorm2d, not LayerNorm in 2-D
        key = _ALIASES[key]
    elif key[-2:] in ("1d", "2d", "3d"):
        spatial, key = int(key[-2]), key[:-2]
    for suffix in ("normalization", "norm"):
        if key.endswith(suffix) and key != suffix:
            key = key[: -len(suffix)]
            break
    key = _ALIASES.get(key, key)
    entry = NAMED.get(key)
    if entry is None or (spatial is not None and not entry.per_rank) or (masked and key not in MASKED):
        torch_names = ", ".join(
            f"{e.torch_class}1d/2d/3d" if e.per_rank else e.torch_class for e in _TABLE if e.torch_class
        )
        raise ValueError(
            f"unknown layer {text!r}; expected one of {', '.join(spellings())} (or torch names: {torch_names})"
        )
    return ParsedName(key, spatial, masked)


def get(name: str) -> NamedLayer:
    """The entry of ``name``; ValueError listing the valid names for an unknown one."""
    if name not in NAMED:
        raise ValueError(f"expected `layer` to be one of {list(NAMED)}, got {name!r}")
    return NAMED[name]


def module_scope(m: nn.Module, layout: str = "nchw", ndim: int = 3) -> tuple[str, Scope]:
    """``(name, scope)`` of a torch or normscope norm layer instance, by its type.

    The most specific matching class decides (normscope's LayerNorm2d is an ``nn.LayerNorm`` that normalizes
    over C). LayerNorm/RMSNorm use the layer's own ``normalized_shape``: it decides how many trailing axes
    share statistics. TypeError for a module that is none of the table's layers.
    """
    best: tuple[int, str] | None = None
    mro = type(m).__mro__
    for entry in NAMED.values():
        for cls in entry.module_types:
            if isinstance(m, cls) and (best is None or mro.index(cls) < best[0]):
                best = (mro.index(cls), entry.name)
    if best is None:
        raise TypeError(f"expected a norm layer among {list(NAMED)}, got {type(m).__name__}")
    name = best[1]
    if name == "group":
        return name, NAMED[name].scope(layout, ndim, m.num_groups)
    if name in ("layer", "rms"):
        return name, NAMED[name].scope(layout, ndim, last=len(m.normalized_shape))
    return name, NAMED[name].scope(layout, ndim)


def scope_ids(scope: Scope | Resolved, shape: Sequence[int] | None = None, mask: Tensor | None = None) -> Tensor:
    """For every element of a tensor of ``shape``, the id of the scope it belongs to.

    Elements with the same id share one mean and variance. The id is the flat index into the
    engine's statistics tensor (shape ``resolved.stat_shape``, as returned by
    :func:`normscope.reference.moments`), so ``moments(x, r).mean.flatten()[ids]`` is each
    element's mean. Elements excluded by ``mask`` (False) get -1.

    Derived only from the resolved scope: a non-reduced axis indexes the statistics, a reduced axis
    does not, and a grouped axis indexes them by ``channel // (C / groups)``.

    Args:
        scope: a :class:`Scope` (resolved against ``shape``) or an already resolved scope.
        shape: the tensor shape. Default: the resolved scope's (required for a :class:`Scope`).
        mask: optional bool tensor broadcastable to ``shape``; True = valid. Default: None.

    Shape:
        returns a LongTensor of ``shape``.

    Example::

        >>> scope_ids(Scope.group(2), (1, 4, 2))[0]
        tensor([[0, 0], [0, 0], [1, 1], [1, 1]])
    """
    if shape is None:
        if not isinstance(scope, Resolved):
            raise TypeError(f"expected `shape` with a Scope (or a Resolved scope without it), got {scope!r}")
        shape = scope.shape
    shape = tuple(int(s) for s in shape)
    r = scope if isinstance(scope, Resolved) else scope.resolve(shape)
    if tuple(r.shape) != shape:
        raise ValueError(f"expected a scope resolved for shape {shape}, got one resolved for {tuple(r.shape)}")
    stat = r.stat_shape
    ids = torch.arange(math.prod(stat)).reshape(stat)
    if r.groups > 1:
        # each group's statistic covers C/G consecutive channels of the grouped axis
        ids = ids.repeat_interleave(shape[r.group_dim] // r.groups, dim=r.group_dim)
    ids = ids.expand(shape).clone()
    if mask is not None:
        if not isinstance(mask, Tensor) or mask.dtype != torch.bool:
            raise TypeError(f"expected `mask` to be a bool tensor, got {getattr(mask, 'dtype', type(mask).__name__)}")
        ids[~mask.expand(shape)] = -1
    return ids
