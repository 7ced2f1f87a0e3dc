"""Measured choice: where a fast path may be picked automatically, as committed measurements say.

A fast path that no GPU has measured is not a default. ``normscope bench`` run on a GPU writes
``measured/<device class>.json`` (``--write-choice``): for each op and dtype, the ranges of
scope sizes where the Triton kernel's output matched torch's and it beat torch eager (ATen/cuDNN)
in both the forward and the forward+backward timing. The automatic order picks the Triton
backend only inside those ranges; everywhere else -- and on a device class with no table -- it
picks ATen, and the kernels are opt-in (``use_backend("triton")``).

Schema (version 1)::

    {"schema": 1, "device_class": "cuda-sm90", "device_name": "...", "torch": "...", "triton": "...",
     "command": "...", "date": "YYYY-MM-DD",
     "choices": [{"op": "layer_norm", "dtype": "bfloat16", "n_min": 4096, "n_max": 262144,
                  "speedup_fwd": 1.31, "speedup_fwdbwd": 1.2, "variant": "rows_once"}]}

``op`` is one of :data:`OPS`; ``n`` counts the elements of one normalized scope (the row length
for LayerNorm/RMSNorm, C/G * H * W for GroupNorm, N * H * W for BatchNorm); the range is closed and
holds only measured end points (no extrapolation).

``variant`` (optional) names the kernel variant of the op's family (:mod:`normscope.kernels.variants`) the
range was measured on -- ``"rows_once"`` for the row ops, ``"split"`` for BatchNorm, ``"onchip"`` for
GroupNorm/InstanceNorm (:data:`VARIANTS`); absent, the family's default kernel. In its range the
``"triton"`` backend runs that variant (:func:`variant`), whether the backend was chosen automatically or
forced. ``normscope bench --write-choice`` names a candidate only where it measured correct and faster than
both torch eager and the default kernel; no committed table names one, so a candidate never runs on its own.
"""

from __future__ import annotations

import json
from importlib import resources
from typing import NamedTuple

import torch

from ..kernels import variants as _variants  # names only: imports no Triton

__all__ = ["OPS", "VARIANTS", "Choice", "device_class", "table", "load", "why_not", "variant"]

OPS = ("layer_norm", "rms_norm", "group_norm", "batch_norm", "masked_batch_norm", "fused_add_rms_norm")
#: the kernel variants a choice may name, per op: its family's (normscope.kernels.variants.FAMILIES; the
#: first, the default, is what runs where a choice names none)
VARIANTS = {op: _variants.FAMILIES[_variants.OPS[op]] for op in OPS}


class Choice(NamedTuple):
    op: str
    dtype: str
    n_min: int
    n_max: int
    #: the kernel variant the range was measured on; None: the family's default kernel
    variant: str | None = None


# per device index / per class; filled on first use (a plain dict, not lru_cache: torch.compile
# traces through the engine's planning and warns about lru_cache wrappers)
_CLASS: dict[int, str] = {}
_TABLES: dict[str, tuple[Choice, ...]] = {}


def device_class(device: torch.device) -> str:
    """``"cuda-sm90"`` for an H100/H200: the compute capability, which is what a kernel's
    speed depends on first (the same class shares one table)."""
    if device.type != "cuda":
        return device.type
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _CLASS:
        major, minor = torch.cuda.get_device_capability(index)
        _CLASS[index] = f"cuda-sm{major}{minor}"
    return _CLASS[index]


def table(cls: str) -> tuple[Choice, ...]:
    """The committed choices for a device class (empty when none was measured)."""
    if cls not in _TABLES:
        _TABLES[cls] = _load(cls)
    return _TABLES[cls]


def _load(cls: str) -> tuple[Choice, ...]:
    f = resources.files(__package__).joinpath("measured", f"{cls}.json")
    return load(f) if f.is_file() else ()


def load(path) -> tuple[Choice, ...]:
    """The choices of one table file (``path``: a path or an importlib resource), validated."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"normscope: measured-choice table {path}: cannot read it ({e})") from e
    if not isinstance(data, dict) or data.get("schema") != 1:
        got = data.get("schema") if isinstance(data, dict) else type(data).__name__
        raise ValueError(f"normscope: measured-choice table {path}: expected schema 1, got {got!r}")
    out = []
    for c in data.get("choices", []):
        if c.get("op") not in OPS:
            raise ValueError(
                f"normscope: measured-choice table {path}: unknown op {c.get('op')!r}; expected one of {OPS}"
            )
        try:
            choice = Choice(c["op"], str(c["dtype"]), int(c["n_min"]), int(c["n_max"]), c.get("variant"))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"normscope: measured-choice table {path}: bad entry {c!r} ({e!r})") from e
        if choice.variant is not None and choice.variant not in VARIANTS[choice.op]:
            raise ValueError(
                f"normscope: measured-choice table {path}: unknown variant {choice.variant!r} for {choice.op} in "
                f"{c!r}; expected one of {VARIANTS[choice.op]} (or no 'variant')"
            )
        if choice.n_min > choice.n_max:
            raise ValueError(f"normscope: measured-choice table {path}: n_min > n_max in {c!r}")
        out.append(choice)
    return tuple(out)


def _entry(op: str, dtype: torch.dtype, n: int, device: torch.device) -> Choice | None:
    name = str(dtype).removeprefix("torch.")
    for c in table(device_class(device)):
        if c.op == op and c.dtype == name and c.n_min <= n <= c.n_max:
            return c
    return None


def variant(op: str, dtype: torch.dtype, n: int, device: torch.device) -> str | None:
    """The kernel variant a committed choice names for this op, dtype and scope size on ``device``'s
    class (``"rows_once"``, ``"split"``, ...); None -- the default kernel -- where the choice names none
    and where no choice covers the call (every call of a device class without a table: no table is
    measured off CUDA)."""
    c = _entry(op, dtype, n, device)
    return None if c is None else c.variant


def why_not(op: str, dtype: torch.dtype, n: int, device: torch.device) -> str | None:
    """None when a committed measurement shows the kernel faster for this op, dtype and scope size
    on ``device``'s class, else the reason the automatic order leaves it out."""
    cls = device_class(device)
    name = str(dtype).removeprefix("torch.")
    for c in table(cls):
        if c.op == op and c.dtype == name and c.n_min <= n <= c.n_max:
            return None
    return (
        f"no committed measurement shows the {op} kernel faster than ATen for {name}, n={n} on {cls} "
        "(normscope.backends.measured; force it with use_backend('triton'))"
    )
