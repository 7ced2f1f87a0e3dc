"""Kernel variants: candidate kernels beside the default, run only where a measurement or a pin says so.

A kernel family may have several implementations of the same op with the same contract (the same
custom-op outputs, the same numbers to the tests' tolerances): the default, ``"tiled"``, and candidates
written to be measured against it:

============  ==========  =========================================================================
family        variant     kernels
============  ==========  =========================================================================
``channels``  ``tiled``   :mod:`.channels` (the default BatchNorm kernels)
``channels``  ``split``   :mod:`.channels_split`: a per-channel split reduction over N x HW,
                          partials combined in a fixed order inside the apply; channels_last read in
                          place; a mask read straight from its bool memory
``groups``    ``tiled``   :mod:`.groups` (the default GroupNorm / InstanceNorm kernels)
``groups``    ``onchip``  :mod:`.groups_onchip`: the whole group in one program's registers, x read once
                          forward, x and dy once backward, both layouts (where the group fits)
============  ==========  =========================================================================

Which one runs (:func:`resolve`): the family's pin in :mod:`.config` (``CHANNELS_VARIANT``,
``GROUPS_VARIANT``) when set, else the variant the measured-choice table names for the call
(:func:`normscope.backends.measured.variant`: on CUDA, from a committed ``normscope bench`` run), else
``"tiled"``. No table row names a candidate until a GPU has measured it, so they are off by default:
the automatic choice and a forced ``use_backend("triton")`` both run the default kernels.

:func:`batch_norm` and :func:`group_norm` are the families' entry points that choose (the Triton backend
calls them); each kernel module's own entry point runs its kernels only. This module sits above the
kernel modules (it imports them when called, and they never import it) and imports nothing heavy (no
Triton) itself: the backend asks it while planning.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

from . import config

if TYPE_CHECKING:
    from torch import Tensor

__all__ = ["FAMILIES", "KNOBS", "DEFAULT", "resolve", "pinned", "batch_norm", "group_norm"]

#: each family's variants; the first is the default kernel
FAMILIES: dict[str, tuple[str, ...]] = {"channels": ("tiled", "split"), "groups": ("tiled", "onchip")}
#: the setting of :mod:`.config` that pins each family
KNOBS: dict[str, str] = {"channels": "CHANNELS_VARIANT", "groups": "GROUPS_VARIANT"}
DEFAULT = "tiled"


def resolve(family: str, measured: str | None = None) -> str:
    """The variant of ``family`` a call runs: the pin in :mod:`.config`, else ``measured`` (the
    measured-choice table's, None when it names none), else ``"tiled"``.

    Raises:
        ValueError: a pin or a table entry that is not a variant of the family.
    """
    pin = getattr(config, KNOBS[family])
    name = pin if pin is not None else measured if measured is not None else DEFAULT
    if name not in FAMILIES[family]:
        where = f"normscope.kernels.config.{KNOBS[family]}" if pin is not None else "the measured-choice table"
        raise ValueError(f"{where}: expected one of {FAMILIES[family]} (or None), got {name!r}")
    return name


@contextlib.contextmanager
def pinned(family: str, name: str | None) -> Iterator[None]:
    """Pin ``family``'s variant to ``name`` (None: the table decides) inside the block, for the
    process (the settings of :mod:`.config` are process-wide). The bench and the tests use it."""
    if name is not None and name not in FAMILIES[family]:
        raise ValueError(f"pinned({family!r}, ...): expected one of {FAMILIES[family]} or None, got {name!r}")
    knob = KNOBS[family]
    before = getattr(config, knob)
    setattr(config, knob, name)
    try:
        yield
    finally:
        setattr(config, knob, before)


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
