"""What the model-library integrations share: reading a layer's epsilon, the probe inputs and random
weights a candidate configuration is checked on, and the lossless swap of ``torch.nn.LayerNorm`` /
``RMSNorm`` for normscope's subclasses, verified bit for bit before it is made.

A layer is patched only after normscope reproduces it **bit for bit** on these probes; the probes
are deterministic (fixed generators), so a class is judged the same way on every run.
"""

from __future__ import annotations

import importlib
import sys

import torch
from torch import Tensor, nn

from ..modules import LayerNorm, RMSNorm

EPS_NAMES = ("variance_epsilon", "eps", "epsilon")


def eps_of(m: nn.Module) -> float | None:
    """The layer's epsilon under any of the names the libraries use, or None."""
    for attr in EPS_NAMES:
        v = getattr(m, attr, None)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return float(v)
    return None


def probe_input(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, seed: int = 0) -> Tensor:
    """(3, 5, *shape), off-centre and wider than unit variance: a mean and a scale to get wrong."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn((3, 5, *shape), generator=g) * 3 + 0.5).to(device=device, dtype=dtype)


def randomized(m: nn.Module, wdtype: torch.dtype, recurse: bool = False) -> nn.Module:
    """``m`` with random parameters, in ``wdtype``: Gemma's zero and Llama's unit initial weights
    (and adaLN-Zero's zero projection) would hide ``1 + w`` versus ``w``, or the whole modulation."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in m.named_parameters(recurse=recurse):
            p.copy_(torch.randn(p.shape, generator=g) * 0.5 + (1.0 if name == "weight" else 0.0))
    return m.to(wdtype)


def torch_replacement(m: nn.Module) -> nn.Module:
    """normscope's LayerNorm / RMSNorm for a ``torch.nn`` one, sharing its very Parameters."""
    if type(m) is nn.LayerNorm:
        new = LayerNorm(m.normalized_shape, m.eps, m.elementwise_affine, m.bias is not None, device="meta")
    else:
        new = RMSNorm(m.normalized_shape, m.eps, m.elementwise_affine, device="meta")
    # share the very Parameter objects (ties, optimizer state); built on "meta" so nothing is allocated
    for p in ("weight", "bias"):
        if getattr(new, p, None) is not None:
            setattr(new, p, getattr(m, p))
    new.train(m.training)
    return new


def probe_dtypes(dtype: torch.dtype) -> tuple[torch.dtype, ...]:
    """The input dtypes a layer with weights in ``dtype`` is probed on: that dtype, and bf16 where the
    weights are fp32 (a norm kept in fp32 in a bf16 model) or bf16. Not bf16 on fp16 or fp64 weights:
    no model runs them so, and torch's CPU LayerNorm refuses the pair ("mixed dtype")."""
    return tuple(dict.fromkeys((dtype, torch.bfloat16))) if dtype in (torch.float32, torch.bfloat16) else (dtype,)


def torch_agree(old: nn.Module, new: nn.Module) -> str | None:
    """None if ``new`` gives ``old``'s bits on the probe input in the weights' dtype and in bf16
    (:func:`probe_dtypes`)."""
    w = old.weight if getattr(old, "weight", None) is not None else None
    device = w.device if w is not None else torch.device("cpu")
    dtype = w.dtype if w is not None else torch.float32
    with torch.no_grad():
        for dt in probe_dtypes(dtype):
            x = probe_input(tuple(new.normalized_shape), dt, device)
            # forward, not __call__: a user's hook on the layer must not run on probe input
            a, b = type(old).forward(old, x), new.forward(x)
            if a.dtype != b.dtype or not torch.equal(a, b):
                return f"outputs differ for {dt} input"
    return None


def restore_classes(originals: dict[tuple[str, str], type]) -> list[str]:
    """Put the classes a ``patch_classes`` replaced back into their modules (``originals``: (module
    name, class name) -> the original class, emptied as it goes); returns their names, once each.

    A module of the same library imported while the classes were patched took the patched class
    into its own namespace (``from ..normalization import AdaLayerNormZero``): every loaded module of
    those libraries is searched for the patched classes too, so a model built afterwards is the
    library's own again."""
    swaps: dict[type, type] = {}
    for (module_name, name), original in originals.items():
        current = getattr(importlib.import_module(module_name), name, original)
        if current is not original:
            swaps[current] = original
    packages = {module_name.partition(".")[0] for module_name, _ in originals}
    for module_name, module in list(sys.modules.items()):
        if module is None or module_name.partition(".")[0] not in packages:
            continue
        for attr, value in list(vars(module).items()):
            if isinstance(value, type) and value in swaps:
                setattr(module, attr, swaps[value])
    restored = []
    for (module_name, name), original in list(originals.items()):
        setattr(importlib.import_module(module_name), name, original)
        if name not in restored:
            restored.append(name)
        del originals[(module_name, name)]
    return restored
