"""Padding masks as the ecosystem passes them, read as one form: (batch, positions) bool, True = a real
position.

A model rarely hands its norms the mask it was given: an audio encoder turns a mask over raw samples
into one over frames and passes that to its encoder; a transformer turns a (batch, positions) mask into
the 4-D form its attention takes. The doctor's recorder watches what every module receives by name
(keyword arguments, and positional ones named by the module's ``forward`` signature) and reads each
mask it recognises here:

========================================  ====================================================
argument                                  convention
========================================  ====================================================
``attention_mask``, 2-D                   1 / True = real token (Hugging Face); a float mask
                                          with negative entries is additive (0 = real)
``attention_mask``, 3-D or 4-D            (batch, [heads,] queries, keys): bool True = attend
                                          (torch's SDPA, transformers' ``sdpa_mask``), float
                                          additive (0 = attend, a large negative = masked); a
                                          key no query attends to is padding
``*padding_mask`` (``key_padding_mask``,  True = padding (torch's ``nn.MultiheadAttention``,
``src_key_padding_mask``, ...), 2-D       ``nn.TransformerEncoder``); float: additive
========================================  ====================================================

Anything else (``BlockMask``, an attention mask without a batch axis, causal-only masks that hide
no key from every query) is not a padding mask and is ignored.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["named_inputs", "padding_mask"]

#: an additive mask's entries at or below this are masked: the ecosystem writes -10000 (BERT's
#: ``(1 - mask) * -10000.0``), ``finfo(dtype).min`` or ``-inf`` there, and 0 (or a small position bias)
#: where it attends
_MASKED = -1e3

_SIGNATURES: dict[type, list[str] | None] = {}


def _positional_names(m: nn.Module) -> list[str] | None:
    """The names of ``m.forward``'s positional parameters (None where it takes ``*args`` first)."""
    cls = type(m)
    if cls not in _SIGNATURES:
        names: list[str] | None = []
        try:
            params = inspect.signature(m.forward).parameters.values()
        except (TypeError, ValueError):  # a builtin or a forward without a readable signature
            params = []
            names = None
        for p in params:
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
                names.append(p.name)
            elif p.kind == p.VAR_POSITIONAL:
                break
        _SIGNATURES[cls] = names
    return _SIGNATURES[cls]


def named_inputs(m: nn.Module, args: tuple, kwargs: dict) -> list[tuple[str, Any]]:
    """The inputs of one call of ``m`` with their parameter names: the keyword arguments, and the
    positional ones named by ``m.forward``'s signature."""
    out = list(kwargs.items())
    names = _positional_names(m) if args else None
    if names:
        out.extend(zip(names, args))
    return out


def _is_mask_name(name: str) -> str | None:
    """'real' for names whose mask marks real positions, 'pad' for those marking padding, else None."""
    if name == "attention_mask":
        return "real"
    if name.endswith("padding_mask"):
        return "pad"
    return None


def padding_mask(name: str, value: Any) -> tuple[Tensor, str] | None:
    """``value`` passed as ``name`` read as ((batch, positions) bool, True = real; its form), or None
    where it is not a padding mask by the conventions above."""
    kind = _is_mask_name(name)
    if kind is None or not isinstance(value, Tensor) or value.dim() not in (2, 3, 4) or not value.numel():
        return None
    v = value.detach()
    additive = v.is_floating_point() and bool((v < 0).any())
    if v.dim() == 2:
        if additive:  # whatever the name: 0 keeps a position, a large negative number removes it
            return v > _MASKED, "2-D additive"
        marks = v != 0
        return (marks if kind == "real" else ~marks), "2-D"
    if kind == "pad":
        return None  # a padding mask is (batch, positions); 3-D/4-D ones are attention masks
    if additive:
        attend = v > _MASKED
        form = f"{v.dim()}-D additive"
    elif v.dtype == torch.bool:
        attend = v
        form = f"{v.dim()}-D bool"
    else:
        attend = v != 0
        form = f"{v.dim()}-D"
    # (batch, [heads,] queries, keys): a key that no query of any head attends to is padding
    return attend.flatten(1, -2).any(1), form
