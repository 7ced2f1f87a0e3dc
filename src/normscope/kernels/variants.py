"""Kernel variants: which of a kernel family's implementations the ``"triton"`` backend runs.

A kernel family may have several implementations of the same ops with the same contract (the same
custom-op outputs, the same numbers to the tests' tolerances): the default, which runs unless told
otherwise, and candidates written to be measured against it on a GPU:

============  =============  ======================================================================
family        variant        kernels
============  =============  ======================================================================
``rows``      ``rows``       :mod:`.rows` (the default LayerNorm / RMSNorm / fused residual add kernels)
``rows``      ``rows_once``  :mod:`.rows_once`: rows past the single block read once -- one program per
                             row up to 32K, longer rows split over programs that meet on their partial sums
``channels``  ``tiled``      :mod:`.channels` (the default BatchNorm kernels)
``channels``  ``split``      :mod:`.channels_split`: a per-channel split reduction over N x HW,
                             partials combined in a fixed order inside the apply; channels_last read in
                             place; a mask read straight from its bool memory
``groups``    ``tiled``      :mod:`.groups` (the default GroupNorm / InstanceNorm kernels)
``groups``    ``onchip``     :mod:`.groups_onchip`: the whole group in one program's registers, x read once
                             forward, x and dy once backward, both layouts (where the group fits)
============  =============  ======================================================================

Which one runs (:func:`resolve`), first match wins:

1. :func:`use_variant` -- a block's override, per thread and asyncio task (a context variable, as
   :func:`normscope.use_backend` is): what ``normscope bench`` does to time each kernel by name;
2. the family's pin in :mod:`.config` (``ROWS_VARIANT``, ``CHANNELS_VARIANT``, ``GROUPS_VARIANT``) --
   process-wide, like every launch setting there: what the tests set (``NORMSCOPE_TEST_KERNEL_VARIANTS``
   runs a whole test session on candidates; ``monkeypatch.setattr``);
3. the variant a row of the device class's measured-choice table names for the call's op, dtype and
   scope size (its ``"variant"`` field, :func:`normscope.backends.measured.variant`), from a committed
   ``normscope bench`` run;
4. the family's default (the first of :data:`FAMILIES`).

No committed table row names a candidate until a GPU has measured it, so they are off by default: the
automatic choice and a forced ``use_backend("triton")`` both run the default kernels. A variant is a
choice among the Triton kernels only: the backend is still chosen (or forced) as always, and
``last_backend()`` says ``"triton"`` whichever variant ran. Every level is read when a call runs, so it
reaches plans made before it; under ``torch.compile`` the variant chosen while tracing is the one the
graph keeps.

:func:`rows_norm`, :func:`batch_norm` and :func:`group_norm` are the families' entry points that choose
(the Triton backend calls them); each kernel module's own entry point runs its kernels only. This module
sits above the kernel modules (it imports them when called, and they never import it) and imports
nothing heavy (no Triton) itself: the backend asks it while planning.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import TYPE_CHECKING

from . import config

if TYPE_CHECKING:
    from torch import Tensor

__all__ = [
    "FAMILIES",
    "KNOBS",
    "OPS",
    "default",
    "forced",
    "use_variant",
    "resolve",
    "rows_norm",
    "batch_norm",
    "group_norm",
    "onchip_takes",
]

#: each family's variants; the first is the default kernel, the others are candidates
FAMILIES: dict[str, tuple[str, ...]] = {
    "rows": ("rows", "rows_once"),
    "channels": ("tiled", "split"),
    "groups": ("tiled", "onchip"),
}
#: the setting of :mod:`.config` that pins each family for the process
KNOBS: dict[str, str] = {"rows": "ROWS_VARIANT", "channels": "CHANNELS_VARIANT", "groups": "GROUPS_VARIANT"}
#: the family of each op of the measured-choice table (``normscope.backends.measured.OPS``)
OPS: dict[str, str] = {
    "layer_norm": "rows",
    "rms_norm": "rows",
    "fused_add_rms_norm": "rows",
    "group_norm": "groups",
    "batch_norm": "channels",
    "masked_batch_norm": "channels",
}

_FORCED: dict[str, contextvars.ContextVar[str | None]] = {
    family: contextvars.ContextVar(f"normscope_variant_{family}", default=None) for family in FAMILIES
}


def default(family: str) -> str:
    """The variant of ``family`` that runs where nothing names one (``"rows"``, ``"tiled"``)."""
    return FAMILIES[family][0]


def _check(family: str, name: str | None, where: str) -> None:
    if family not in FAMILIES:
        raise ValueError(f"{where}: expected a kernel family, one of {tuple(FAMILIES)}, got {family!r}")
    if name is not None and name not in FAMILIES[family]:
        raise ValueError(f"{where}: expected one of {FAMILIES[family]} or None for {family!r}, got {name!r}")


def forced(family: str) -> str | None:
    """The variant :func:`use_variant` forces on ``family`` in this thread / task, or None."""
    return _FORCED[family].get()


# torch.compile: dynamo cannot trace ContextVar.get; it calls this once while tracing (the family is a
# constant) and keeps the answer (the mark torch.compiler.assume_constant_result sets, set directly as
# normscope._state's constant_when_compiled does -- kernels/ imports nothing of the engine): a graph
# keeps the variant chosen when it was traced
forced._dynamo_marked_constant = True  # type: ignore[attr-defined]


@contextlib.contextmanager
def use_variant(family: str, name: str | None) -> Iterator[None]:
    """Run ``family``'s calls of the ``"triton"`` backend on variant ``name`` (one of
    ``FAMILIES[family]``) inside the block, whatever the pin in :mod:`.config` and the measured-choice
    table say; ``None`` lifts the override (the pin, else the table, decides). Per thread and asyncio
    task; read when a call runs, so it holds for plans made before the block too."""
    _check(family, name, "use_variant")
    token = _FORCED[family].set(name)
    try:
        yield
    finally:
        _FORCED[family].reset(token)


def resolve(family: str, measured: str | None = None) -> str:
    """The variant of ``family`` a call runs: :func:`use_variant`'s override, else the pin in
    :mod:`.config`, else ``measured`` (the measured-choice table's, None when it names none), else the
    family's default.

    Raises:
        ValueError: a pin or a table entry that is not a variant of the family.
    """
    name = forced(family)
    if name is not None:
        return name
    pin = getattr(config, KNOBS[family])
    name = pin if pin is not None else measured if measured is not None else default(family)
    if name not in FAMILIES[family]:
        where = f"normscope.kernels.config.{KNOBS[family]}" if pin is not None else "the measured-choice table"
        raise ValueError(f"{where}: expected one of {FAMILIES[family]} (or None), got {name!r}")
    return name


def rows_norm(x: Tensor, *args, variant: str | None = None, **kwargs):
    """:func:`normscope.kernels.rows.rows_norm` (same arguments and returns) on the variant :func:`resolve`
    picks: ``variant`` is the measured-choice table's for the call (None: none). ``"rows_once"`` takes over
    only rows past the single block (:func:`normscope.kernels.rows_once.fwd_plan`); shorter rows run the
    single-block kernel either way."""
    if resolve("rows", variant) == "rows_once":
        from . import rows_once as kernels
    else:
        from . import rows as kernels
    return kernels.rows_norm(x, *args, **kwargs)


def batch_norm(
    x: Tensor,
    channel_dim: int,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float = 1e-5,
    running_mean: Tensor | None = None,
    running_var: Tensor | None = None,
    mask: Tensor | None = None,
    variant: str | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """:func:`normscope.kernels.channels.batch_norm_channels` (same arguments and returns) on the variant
    :func:`resolve` picks: ``variant`` is the measured-choice table's for the call (None: none)."""
    if resolve("channels", variant) == "split":
        from .channels_split import batch_norm_split

        return batch_norm_split(x, channel_dim, weight, bias, eps, running_mean, running_var, mask)
    from .channels import batch_norm_channels

    return batch_norm_channels(x, channel_dim, weight, bias, eps, running_mean, running_var, mask)


def group_norm(
    x: Tensor,
    groups: int,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float = 1e-5,
    centered: bool = True,
    variant: str | None = None,
) -> Tensor:
    """:func:`normscope.kernels.groups.group_norm` (same arguments and output) on the variant
    :func:`resolve` picks (``variant``: the table's, None: none); ``"onchip"`` only where a group fits
    its tile (:func:`normscope.kernels.groups_onchip.fits`), the default kernels elsewhere."""
    from . import groups as tiled

    if resolve("groups", variant) == "onchip":
        from . import groups_onchip

        laid = tiled._laid_out(x)
        if groups_onchip.fits(laid, int(groups)):
            return groups_onchip.group_norm_onchip(laid, groups, weight, bias, eps, centered)
    return tiled.group_norm(x, groups, weight, bias, eps, centered)


def onchip_takes(x: Tensor, groups: int) -> bool:
    """Whether the ``"onchip"`` variant runs a GroupNorm of ``x`` in ``groups`` groups (its group fits the
    tile, in the layout the kernels read ``x`` in); where not, :func:`group_norm` runs the default kernels."""
    from . import groups as tiled
    from . import groups_onchip

    return groups_onchip.fits(tiled._laid_out(x), int(groups))
