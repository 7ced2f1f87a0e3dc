"""The scope: which elements of a tensor share one mean and one variance.

Every normalization layer in this library is the same four steps -- mean, variance, normalize,
affine -- over a different *scope*. A :class:`Scope` is a small frozen description of that scope;
named layers only build one, and the engine (:mod:`normscope.engine`) does the rest.

A scope is written independently of the input's rank (BatchNorm1d/2d/3d share one scope) and is
*resolved* against a concrete shape into a :class:`Resolved` scope: non-negative, sorted axes, with
the degenerate groupings canonicalised so that equal scopes compare equal::

    GroupNorm(1, C)  ->  the LayerNorm-over-(C, *) scope      (one group holds every channel)
    GroupNorm(C, C)  ->  the InstanceNorm scope               (each group is one channel)
"""

from __future__ import annotations

import math
import numbers
import operator
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

__all__ = ["Scope", "Resolved", "Form"]


@dataclass(frozen=True)
class Scope:
    """Which axes share statistics, and how the result is scaled.

    Exactly one of ``reduce`` and ``keep`` describes the reduced axes: ``reduce`` names them,
    ``keep`` names the axes that are *not* reduced (so one scope serves inputs of any rank, as
    BatchNorm's "everything but the channel axis" does). Negative axes count from the end.

    Attributes:
        reduce: axes whose elements share one mean and variance.
        keep: alternatively, the axes that keep their own statistics; every other axis is reduced.
        centered: subtract the mean (LayerNorm, BatchNorm...) or not (RMSNorm, PowerNorm), in which
            case the "variance" is the uncentered second moment, the mean square.
        groups: split ``group_dim`` into this many contiguous groups; the channels of one group are
            reduced together (GroupNorm). ``group_dim`` must then be a reduced axis.
        group_dim: the axis split by ``groups`` (the channel axis).
        affine: axes spanned by the weight and bias (``()`` when the scope has none).
    """

    reduce: tuple[int, ...] | None = None
    keep: tuple[int, ...] | None = None
    centered: bool = True
    groups: int = 1
    group_dim: int = 1
    affine: tuple[int, ...] = field(default=())

    def __post_init__(self) -> None:
        if (self.reduce is None) == (self.keep is None):
            raise ValueError(
                f"Scope needs exactly one of `reduce` and `keep`, got reduce={self.reduce!r}, keep={self.keep!r}"
            )
        # axes as Python ints: a float or bool axis compares and hashes equal to the int one, so the
        # resolution cache (keyed on the scope) would hand its resolution to the int scope, and back
        for name in ("reduce", "keep", "affine"):
            value = getattr(self, name)
            if value is not None and not all(type(a) is int for a in value):
                object.__setattr__(self, name, tuple(_axis(a, name) for a in value))
        if type(self.group_dim) is not int:
            object.__setattr__(self, "group_dim", _axis(self.group_dim, "group_dim"))
        axes = self.reduce if self.reduce is not None else self.keep
        if len(set(axes)) != len(axes):
            raise ValueError(f"Scope axes must be distinct, got {axes!r}")
        g = self.groups
        if type(g) is not int and isinstance(g, numbers.Integral) and not isinstance(g, bool):
            object.__setattr__(self, "groups", int(g))  # NumPy's, as the axes (a plain int keys the caches)
        if not isinstance(self.groups, int) or isinstance(self.groups, bool) or self.groups < 1:
            raise ValueError(f"Scope `groups` must be a positive int, got {self.groups!r}")
        # scopes key the resolution and plan caches on every call: hash once
        fields = (self.reduce, self.keep, self.centered, self.groups, self.group_dim, self.affine)
        object.__setattr__(self, "_hash", hash(fields))

    def __hash__(self) -> int:
        return self._hash

    # -- named scopes: the table of DESIGN.md, one constructor a row ---------------------------

    @classmethod
    def layer(cls, ndims: int = 1) -> Scope:
        """LayerNorm: the last ``ndims`` axes of each sample; affine over the same axes."""
        _check_ndims(ndims, "Scope.layer")
        axes = tuple(range(-ndims, 0))
        return cls(reduce=axes, affine=axes)

    @classmethod
    def rms(cls, ndims: int = 1) -> Scope:
        """RMSNorm: as LayerNorm, without the mean."""
        _check_ndims(ndims, "Scope.rms")
        axes = tuple(range(-ndims, 0))
        return cls(reduce=axes, centered=False, affine=axes)

    @classmethod
    def batch(cls, channel_dim: int = 1) -> Scope:
        """BatchNorm: every axis but the channel axis; affine per channel."""
        return cls(keep=(channel_dim,), affine=(channel_dim,))

    @classmethod
    def instance(cls) -> Scope:
        """InstanceNorm: the spatial axes of each (sample, channel); affine per channel."""
        return cls(keep=(0, 1), affine=(1,))

    @classmethod
    def group(cls, num_groups: int) -> Scope:
        """GroupNorm: the channels of one group and all positions, per sample; affine per channel."""
        return cls(keep=(0,), groups=num_groups, group_dim=1, affine=(1,))

    @classmethod
    def channels(cls, centered: bool = True) -> Scope:
        """Channels-first LayerNorm (LayerNorm2d): the channel axis at each sample and position."""
        return cls(reduce=(1,), centered=centered, affine=(1,))

    # -- resolution -----------------------------------------------------------------------------

    def resolve(self, shape: tuple[int, ...]) -> Resolved:
        """This scope on a tensor of ``shape``: concrete, sorted, canonical axes.

        Raises ValueError (naming the axis and the rank) when an axis does not exist, or when the
        grouped axis does not split evenly.
        """
        if torch.compiler.is_compiling():
            # traced once per graph, so a cache buys nothing; and dynamo would guard on the cache
            # dict (and warns on an lru_cache); symbolic sizes are unhashable anyway
            return _resolve(self, shape)
        key = (self, tuple(shape))
        try:
            hit = _RESOLVED.get(key)
        except TypeError:  # symbolic sizes outside dynamo (make_fx tracing): unhashable, uncached
            return _resolve(self, shape)
        if hit is None:
            if len(_RESOLVED) >= _CACHE_SIZE:  # bounded: cleared whole when full, no per-hit LRU bookkeeping
                _RESOLVED.clear()
            hit = _RESOLVED[key] = _resolve(self, shape)
        return hit


class Form(NamedTuple):
    """Which canonical views a resolved scope maps onto: the one classification every backend reads
    (``Resolved.form``). A scope may have several (LayerNorm over (N, C) with a per-channel
    affine is rows and per-sample groups at once); each backend picks among them in its own order.
    Sizes are not part of it: it depends on the rank and the axes only, so a symbolic size never
    reaches it.

    * ``rows``: one statistic per index of the kept axes, over the reduced axes, an affine over the
      reduced axes or none, no grouping (LayerNorm, RMSNorm over any axes); ``trailing``: the reduced
      axes are the last ones (no move needed).
    * ``channel``: the one kept axis ``d`` when the statistics are per index of ``d`` over every
      other axis, with an affine over ``d`` or none and no grouping (BatchNorm's scope); else None.
    * ``sample_groups``: per sample (axis 0) over every other axis, the channels (axis 1) split in
      groups or not, an affine over axis 1 or none (GroupNorm; one group: LayerNorm over (C, *)).
    * ``instance``: per sample and channel over the axes from 2 on, an affine over axis 1 or none,
      rank 3 or more, no grouping (InstanceNorm).
    """

    rows: bool
    trailing: bool
    channel: int | None
    sample_groups: bool
    instance: bool


def classify(shape: tuple, reduce: tuple[int, ...], groups: int, group_dim: int, affine: tuple[int, ...]) -> Form:
    """The :class:`Form` of a resolved scope (its rank, sorted reduced axes, grouping and affine)."""
    ndim, k = len(shape), len(reduce)
    kept = [d for d in range(ndim) if d not in reduce]  # a list: dynamo cannot trace a generator here
    rows = groups == 1 and k > 0 and affine in ((), reduce)
    trailing = reduce == tuple(range(ndim - k, ndim))
    channel = None
    if ndim >= 2 and groups == 1 and len(kept) == 1 and affine in ((), (kept[0],)):
        channel = kept[0]
    per_channel = ndim >= 2 and affine in ((), (1,))
    sample_groups = per_channel and kept == [0] and (groups == 1 or group_dim == 1)
    instance = per_channel and ndim >= 3 and groups == 1 and kept == [0, 1]
    return Form(rows, trailing, channel, sample_groups, instance)


@dataclass(frozen=True)
class Resolved:
    """A scope on a concrete shape. ``reduce`` is sorted and non-negative; ``groups`` is 1 unless
    a grouped axis really is split into several groups of several channels.

    ``form``: which canonical views the scope maps onto (:class:`Form`), classified once, when the
    scope is resolved (resolutions are cached per scope and shape), for every backend to read."""

    shape: tuple[int, ...]
    reduce: tuple[int, ...]
    centered: bool
    groups: int
    group_dim: int
    affine: tuple[int, ...]
    form: Form = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        form = classify(self.shape, self.reduce, self.groups, self.group_dim, self.affine)
        object.__setattr__(self, "form", form)

    @property
    def count(self) -> int:
        """Elements in one scope (without a mask)."""
        if self.groups > 1:
            # the grouped axis is in `reduce`, but one scope holds only C/G of its channels
            return math.prod(
                [self.shape[d] // self.groups if d == self.group_dim else self.shape[d] for d in self.reduce]
            )
        return math.prod([self.shape[d] for d in self.reduce])  # lists: dynamo cannot trace a generator here

    @property
    def stat_shape(self) -> tuple[int, ...]:
        """The statistics' shape, broadcastable against the input (grouped axis: one per group)."""
        out = [1 if d in self.reduce else s for d, s in enumerate(self.shape)]
        if self.groups > 1:
            out[self.group_dim] = self.groups
        return tuple(out)

    def grouped_shape(self) -> tuple[int, ...]:
        """The input's shape with the grouped axis split into (groups, channels per group)."""
        g, d = self.groups, self.group_dim
        return self.shape[:d] + (g, self.shape[d] // g) + self.shape[d + 1 :]

    def grouped_reduce(self) -> tuple[int, ...]:
        """Reduced axes in :meth:`grouped_shape` coordinates (the group index is kept)."""
        d = self.group_dim
        return tuple(a if a < d else a + 1 for a in self.reduce if a != d) + (d + 1,)


def _axis(a: object, name: str) -> int:
    """``a`` as a Python int (NumPy integers too), or a TypeError naming the field."""
    if isinstance(a, bool) or not hasattr(type(a), "__index__"):
        raise TypeError(f"Scope: expected `{name}` to hold an int axis, got {a!r} ({type(a).__name__})")
    return operator.index(a)


def _check_ndims(ndims: object, where: str) -> None:
    # 0 would reduce nothing (every element its own scope: all-zero output) and -k would silently
    # mean "the last k" through range(); neither is a normalization
    if not isinstance(ndims, int) or isinstance(ndims, bool) or ndims < 1:
        raise ValueError(f"{where}: expected `ndims` to be a positive int (how many trailing axes), got {ndims!r}")


def _norm_axis(axis: int, ndim: int, what: str) -> int:
    if not -ndim <= axis < ndim:
        raise ValueError(
            f"scope axis {axis} ({what}) does not exist for an input of rank {ndim}: expected an "
            f"axis in [{-ndim}, {ndim - 1}]"
        )
    return axis % ndim


# resolve() runs on every call of every layer: eager calls share resolutions through this dict
_RESOLVED: dict[tuple[Scope, tuple[int, ...]], Resolved] = {}
_CACHE_SIZE = 4096


def _resolve(scope: Scope, shape: tuple[int, ...]) -> Resolved:
    shape = tuple(shape)  # a torch.Size hashes like the tuple; store the plain tuple
    ndim = len(shape)
    if scope.reduce is not None:
        reduce = {_norm_axis(a, ndim, "reduce") for a in scope.reduce}
    else:
        keep = {_norm_axis(a, ndim, "keep") for a in scope.keep}
        reduce = set(range(ndim)) - keep
    affine = tuple(sorted(_norm_axis(a, ndim, "affine") for a in scope.affine))
    groups, gdim = scope.groups, scope.group_dim
    if groups > 1:
        gdim = _norm_axis(gdim, ndim, "group_dim")
        if gdim not in reduce:
            raise ValueError(f"scope groups split axis {gdim}, which is not a reduced axis {sorted(reduce)}")
        channels = shape[gdim]
        if channels % groups:
            raise ValueError(
                f"expected the number of channels (axis {gdim}, got {channels}) to be divisible by groups={groups}"
            )
        if groups == channels:  # one channel a group: the channel axis simply is not reduced
            reduce.discard(gdim)
            groups = 1
    if groups == 1:
        gdim = -1
    return Resolved(shape, tuple(sorted(reduce)), scope.centered, groups, gdim, affine)
