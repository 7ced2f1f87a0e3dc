"""Swap the normalization layers of Hugging Face ``transformers`` models for normscope's.

``patch(model)`` walks the model and replaces, in place:

* the Llama-family RMSNorm (Llama, Mistral, Mixtral, Qwen2, Qwen2-MoE, Qwen3, Phi-3) by
  :class:`LlamaRMSNorm`, and the Gemma-family RMSNorm (Gemma, Gemma2, Gemma3) by
  :class:`GemmaRMSNorm`;
* every ``torch.nn.LayerNorm`` (BERT, RoBERTa, GPT-2, ...) by :class:`normscope.LayerNorm`, and
  every ``torch.nn.RMSNorm`` by :class:`normscope.RMSNorm`.

The new layers keep the *same* ``weight``/``bias`` Parameter objects (tied weights, optimizer
state and ``state_dict`` keys are untouched) and the same outputs. The families differ in *where*
they round, and that is kept exactly (from the installed ``transformers`` source):

    Llama:  y = weight * (x32 * rsqrt(mean(x32^2) + eps)).to(x.dtype)     # cast, then scale
    Gemma:  y = (x32 * rsqrt(mean(x32^2) + eps) * (1 + weight32)).to(x.dtype)  # scale in fp32

where ``x32 = x.float()``. In both, the normalization (mean square, rsqrt, multiply) is the
engine's RMSNorm scope run on ``x32`` without affine (:func:`normscope.functional.rms_norm`); only
the affine, whose rounding differs between families, stays in these classes. The engine's fp32
normalization may differ from the family's ``pow(2).mean(-1)`` by fp32 round-off in the
reduction order; see docs/integrations.md for what that means for fp32 and bf16 logits.

Each patched class is checked on a random probe (fp32 and bf16) against the module it replaces
before any swap (``verify=True``); a class whose outputs differ is left alone and reported.

``patch_classes("llama", ...)`` does the same at class level, before a model exists (like
Liger-Kernel's ``apply_liger_kernel_to_llama()``): it replaces the family's RMSNorm class in its
``transformers.models.<family>.modeling_<family>`` module, so every model built afterwards --
``from_pretrained`` included -- is built with normscope's layers. Same probe, same report;
``unpatch_classes()`` restores the originals.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from .. import functional as F
from ..modules import LayerNorm, RMSNorm

__all__ = [
    "LlamaRMSNorm",
    "GemmaRMSNorm",
    "PatchReport",
    "patch",
    "patch_classes",
    "unpatch_classes",
    "FAMILIES",
    "LLAMA_FAMILY",
    "GEMMA_FAMILY",
]

# class names whose forward was read in transformers 4.4x-5.x and matches the formula above
LLAMA_FAMILY = frozenset(
    {
        "LlamaRMSNorm",
        "MistralRMSNorm",
        "MixtralRMSNorm",
        "Qwen2RMSNorm",
        "Qwen2MoeRMSNorm",
        "Qwen3RMSNorm",
        "Phi3RMSNorm",
    }
)
GEMMA_FAMILY = frozenset({"GemmaRMSNorm", "Gemma2RMSNorm", "Gemma3RMSNorm"})

#: model type (``config.model_type``, the ``transformers.models.<type>`` package) -> its RMSNorm class name
FAMILIES = {
    "llama": "LlamaRMSNorm",
    "mistral": "MistralRMSNorm",
    "mixtral": "MixtralRMSNorm",
    "qwen2": "Qwen2RMSNorm",
    "qwen2_moe": "Qwen2MoeRMSNorm",
    "qwen3": "Qwen3RMSNorm",
    "phi3": "Phi3RMSNorm",
    "gemma": "GemmaRMSNorm",
    "gemma2": "Gemma2RMSNorm",
    "gemma3": "Gemma3RMSNorm",
}
# (module, class name) -> the original class, for unpatch_classes
_ORIGINAL_CLASSES: dict[tuple[str, str], type] = {}


class LlamaRMSNorm(RMSNorm):
    r"""RMSNorm with Llama's rounding: normalize in fp32, cast to the input dtype, then scale.

    Paper: Zhang & Sennrich 2019, "Root Mean Square Layer Normalization".

    .. math:: y = \gamma \cdot \mathrm{cast}_{x}\!\left(\frac{x}{\sqrt{\mathrm{E}[x^2] + \epsilon}}\right)

    A :class:`normscope.RMSNorm` (so ``isinstance(m, torch.nn.RMSNorm)``; ``weight`` means the
    same) whose only difference is where it rounds: torch's RMSNorm scales before casting, Llama
    after. The product ``weight * y`` follows type promotion, as in ``transformers`` (an fp32
    weight with bf16 activations gives fp32 output).

    Args:
        hidden_size: size of the last dimension.
        eps: added to the mean square. Default: 1e-6 (``transformers``' default).

    Shape:
        - Input: (*, hidden_size). Output: same shape.

    Example::

        >>> norm = LlamaRMSNorm(4096, eps=1e-5)
        >>> y = norm(torch.randn(2, 7, 4096, dtype=torch.bfloat16))
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, device=None, dtype=None) -> None:
        super().__init__(hidden_size, eps, True, device, dtype)

    @property
    def variance_epsilon(self) -> float:  # the attribute name transformers' code reads
        return self.eps

    def forward(self, x: Tensor) -> Tensor:
        y = F.rms_norm(x.float(), self.normalized_shape, None, self.eps).to(x.dtype)
        return self.weight * y


class GemmaRMSNorm(nn.Module):
    r"""RMSNorm with Gemma's parametrization and rounding: scale by ``1 + weight`` in fp32, then cast.

    .. math:: y = \mathrm{cast}_{x}\!\left(\frac{x}{\sqrt{\mathrm{E}[x^2] + \epsilon}} (1 + w)\right)

    Not a ``torch.nn.RMSNorm``: its ``weight`` is an offset (initialized to zeros), and treating it
    as a scale (weight decay towards 0, conversion to another RMSNorm) would be wrong.

    Args:
        dim: size of the last dimension.
        eps: added to the mean square. Default: 1e-6.

    Shape:
        - Input: (*, dim). Output: same shape and dtype.

    Example::

        >>> norm = GemmaRMSNorm(2048)
        >>> y = norm(torch.randn(2, 7, 2048, dtype=torch.bfloat16))
    """

    def __init__(self, dim: int, eps: float = 1e-6, device=None, dtype=None) -> None:
        super().__init__()
        self.normalized_shape = (dim,)
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim, device=device, dtype=dtype))

    def forward(self, x: Tensor) -> Tensor:
        y = F.rms_norm(x.float(), self.normalized_shape, None, self.eps)
        return (y * (1.0 + self.weight.float())).type_as(x)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


@dataclass
class PatchReport:
    """What :func:`patch` did: ``replaced[class name] = count`` and ``skipped[class name] = reason``."""

    replaced: dict[str, int] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.replaced.values())

    def __str__(self) -> str:
        lines = [f"normscope patched {self.total} normalization layer(s)"]
        lines += [f"  {name}: {n} replaced" for name, n in sorted(self.replaced.items())]
        lines += [f"  {name}: skipped ({why})" for name, why in sorted(self.skipped.items())]
        return "\n".join(lines)


def _eps(m: nn.Module) -> float:
    for attr in ("variance_epsilon", "eps"):
        v = getattr(m, attr, None)
        if isinstance(v, (int, float)):
            return float(v)
    raise ValueError(f"patch: cannot find the epsilon of {type(m).__name__} (no `variance_epsilon` or `eps`)")


def _replacement(m: nn.Module) -> nn.Module | None:
    """The normscope layer computing what ``m`` computes, sharing its parameters; None if none."""
    name = type(m).__name__
    if isinstance(m, (LayerNorm, RMSNorm, GemmaRMSNorm)):
        return None  # already ours
    if type(m) is nn.LayerNorm:
        new = LayerNorm(m.normalized_shape, m.eps, m.elementwise_affine, m.bias is not None, device="meta")
    elif type(m) is nn.RMSNorm:
        new = RMSNorm(m.normalized_shape, m.eps, m.elementwise_affine, device="meta")
    elif name in LLAMA_FAMILY:
        new = LlamaRMSNorm(m.weight.shape[-1], _eps(m), device="meta")
    elif name in GEMMA_FAMILY:
        new = GemmaRMSNorm(m.weight.shape[-1], _eps(m), device="meta")
    else:
        return None
    # share the very Parameter objects (ties, optimizer state); built on "meta" so nothing is allocated
    for p in ("weight", "bias"):
        if getattr(new, p, None) is not None:
            setattr(new, p, getattr(m, p))
    new.train(m.training)
    return new


def _verify(old: nn.Module, new: nn.Module) -> str | None:
    """Compare ``new`` with ``old`` on a random probe in fp32 and bf16; None if they agree."""
    w = old.weight if getattr(old, "weight", None) is not None else None
    shape = tuple(new.normalized_shape)
    device = w.device if w is not None else torch.device("cpu")
    gen = torch.Generator(device="cpu").manual_seed(0)
    probe = torch.randn((3, *shape), generator=gen).to(device) * 3 + 0.5
    with torch.no_grad():
        for dt in (w.dtype if w is not None else torch.float32, torch.bfloat16):
            x = probe.to(dt)
            a, b = old(x), new(x)
            if a.dtype != b.dtype:
                return f"output dtype {b.dtype} instead of {a.dtype} for {dt} input"
            # one rounding step of the output dtype: the engine's fp32 reduction order may differ
            tol = torch.finfo(a.dtype).eps * 4
            if not torch.allclose(a.float(), b.float(), rtol=tol, atol=tol):
                err = (a.float() - b.float()).abs().max().item()
                return f"outputs differ by {err:.3g} for {dt} input"
    return None


def patch(model: nn.Module, *, verify: bool = True) -> PatchReport:
    """Replace the RMSNorm/LayerNorm layers of a ``transformers`` model by normscope layers, in place.

    Args:
        model: any ``torch.nn.Module`` (a ``PreTrainedModel`` or a part of one).
        verify: check each class once, on a random probe in the weight's dtype and bf16, against
            the module it replaces; a class that differs is skipped and reported. Default: True.

    Returns:
        A :class:`PatchReport` (printable) of what was replaced and what was skipped and why.

    Example::

        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> model = LlamaForCausalLM(LlamaConfig(hidden_size=32, num_hidden_layers=2,
        ...     num_attention_heads=4, intermediate_size=64, vocab_size=100))
        >>> print(normscope.integrations.transformers.patch(model))
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"patch: expected `model` to be a torch.nn.Module, got {type(model).__name__}")
    report = PatchReport()
    checked: dict[type, str | None] = {}
    for parent in list(model.modules()):
        for child_name, child in list(parent.named_children()):
            cls = type(child)
            if cls.__name__.endswith("RMSNorm") and cls.__name__ not in LLAMA_FAMILY | GEMMA_FAMILY:
                if not isinstance(child, (RMSNorm, GemmaRMSNorm)) and cls is not nn.RMSNorm:
                    report.skipped[cls.__name__] = "casting order not verified for this family"
                    continue
            new = _replacement(child)
            if new is None:
                continue
            if verify:
                if cls not in checked:
                    checked[cls] = _verify(child, new)
                if checked[cls] is not None:
                    report.skipped[cls.__name__] = checked[cls]
                    continue
            setattr(parent, child_name, new)
            report.replaced[cls.__name__] = report.replaced.get(cls.__name__, 0) + 1
    return report


def patch_classes(*model_types: str, verify: bool = True) -> PatchReport:
    """Make ``transformers`` build normscope's RMSNorm for these model families, before any model exists.

    Replaces ``transformers.models.<type>.modeling_<type>.<Family>RMSNorm`` by :class:`LlamaRMSNorm`
    or :class:`GemmaRMSNorm`, so models built afterwards (``Model(config)``, ``from_pretrained``) hold
    normscope layers; models built before are untouched (use :func:`patch` for those). Each class
    is first checked with the same probe as :func:`patch`, on a small instance with random weights.

    Args:
        *model_types: keys of :data:`FAMILIES` (``"llama"``, ``"qwen2"``, ``"gemma"``, ...). Default: all.
        verify: probe each class against the original first; a class that differs is left alone
            and reported. Default: True.

    Returns:
        A :class:`PatchReport`: ``replaced[class name] = 1`` per class replaced, ``skipped`` with why.

    Example::

        >>> from normscope.integrations.transformers import patch_classes
        >>> print(patch_classes("llama"))
        >>> model = LlamaForCausalLM.from_pretrained(path)   # built with normscope's LlamaRMSNorm
    """
    unknown = [t for t in model_types if t not in FAMILIES]
    if unknown:
        raise ValueError(f"patch_classes: unknown model type(s) {unknown}; expected some of {sorted(FAMILIES)}")
    report = PatchReport()
    for model_type in model_types or tuple(FAMILIES):
        name = FAMILIES[model_type]
        module_name = f"transformers.models.{model_type}.modeling_{model_type}"
        try:
            module = importlib.import_module(module_name)
        except ImportError as e:
            report.skipped[name] = f"{module_name} is not importable ({e})"
            continue
        original = getattr(module, name, None)
        if original is None:
            report.skipped[name] = f"{module_name} has no {name}"
            continue
        if original in (LlamaRMSNorm, GemmaRMSNorm):  # patched already
            report.replaced[name] = 1
            continue
        new_cls = GemmaRMSNorm if name in GEMMA_FAMILY else LlamaRMSNorm
        if verify:
            why = _verify_class(original)
            if why is not None:
                report.skipped[name] = why
                continue
        _ORIGINAL_CLASSES.setdefault((module_name, name), original)
        setattr(module, name, new_cls)
        report.replaced[name] = 1
    return report


def unpatch_classes() -> list[str]:
    """Undo :func:`patch_classes`: put the original classes back; returns their names."""
    restored = []
    for (module_name, name), original in list(_ORIGINAL_CLASSES.items()):
        setattr(importlib.import_module(module_name), name, original)
        restored.append(name)
        del _ORIGINAL_CLASSES[(module_name, name)]
    return restored


def _verify_class(original: type) -> str | None:
    # a small instance with random weights (Gemma's zero-initialized offsets would hide a wrong 1 + w)
    try:
        old = original(64, eps=1e-6)
    except TypeError as e:
        return f"constructor differs from (hidden_size, eps=...): {e}"
    with torch.no_grad():
        old.weight.copy_(torch.randn(old.weight.shape, generator=torch.Generator().manual_seed(1)))
    new = _replacement(old)
    if new is None:
        return "no normscope equivalent"
    return _verify(old, new)
