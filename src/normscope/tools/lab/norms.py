"""The lab's one door to normscope's layers.

Experiments ask for a norm by registry name (``"batch"``, ``"layer"``, ``"rms"``, ``"group:8"``,
``"power"``, ``"dyt"``, ``"batch-masked"``, ``"none"``...) and a *layout*:

* ``"channels"`` -- (N, C, H, W) feature maps;
* ``"tokens"`` -- (B, S, D) token sequences, with an optional (B, S) bool mask (True = real token).

:func:`make` first asks :func:`normscope.get_norm` (the registry) and otherwise builds the same
norm from what normscope already ships. A norm that neither can provide raises :class:`Missing`
-- the experiment then records that variant as ``"skipped: needs ..."``. It never substitutes a
different norm: "layer" on feature maps is GroupNorm(1, C) and "instance" is GroupNorm(C, C) by
the definitions of Wu & He 2018, which the library makes equal by construction.
"""

from __future__ import annotations

import inspect

from torch import Tensor, nn

import normscope

__all__ = ["Missing", "NormSlot", "make", "available"]


class Missing(RuntimeError):
    """A norm the installed normscope cannot provide; ``str(err)`` says what is needed."""


class NormSlot(nn.Module):
    """One norm in a model, with a uniform ``forward(x, mask=None)`` whatever the layout.

    Attributes:
        name: the registry name asked for. source: where the layer came from (for the record).
    """

    def __init__(self, inner: nn.Module, name: str, layout: str, source: str, channels_first: bool,
                 takes_mask: bool) -> None:
        super().__init__()
        self.inner, self.name, self.layout, self.source = inner, name, layout, source
        self.channels_first, self.takes_mask = channels_first, takes_mask

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        # normscope's masks are "the input's shape without the feature axis": (B, S) for tokens
        # whether the layer sees (B, S, D) or, channels-first, (B, D, S)
        m = mask if self.takes_mask else None
        if self.layout == "tokens" and self.channels_first:
            y = x.transpose(1, 2)  # BatchNorm1d wants (B, D, S): statistics per feature over batch and positions
            out = self.inner(y, mask=m) if m is not None else self.inner(y)
            return out.transpose(1, 2)
        return self.inner(x, mask=m) if m is not None else self.inner(x)


def _forward_takes_mask(module: nn.Module) -> bool:
    try:
        return "mask" in inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return False


class _EngineMaskedBatchNorm(normscope.BatchNorm1d):
    """BatchNorm1d whose statistics (and running estimates) count only valid positions.

    Used only while ``normscope.get_norm("batch")`` does not accept a mask yet: it is the same
    BatchNorm configuration of the engine (:func:`normscope.engine.norm` with ``mask=``), not a
    different norm. Input (B, D, S), mask (B, S) bool, True = counted.
    """

    def forward(self, input: Tensor, mask: Tensor | None = None) -> Tensor:
        if mask is None:
            return super().forward(input)
        from normscope.engine import Running, norm
        from normscope.scope import Scope

        factor = self.momentum if self.training else 0.0
        if self.training and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
        running = Running(self.running_mean, self.running_var, float(factor), self.training)
        return norm(input, Scope.batch(1), self.weight, self.bias, self.eps, mask=mask[:, None, :], running=running)


# registry names whose layers take the features at dim 1 (PowerNorm and DyT default to the last dim)
_CHANNELS_FIRST = ("batch", "batch1d", "sync", "instance")


def _registry(name: str, channels: int, **kwargs) -> nn.Module | None:
    get = getattr(normscope, "get_norm", None)
    if get is None:
        return None
    try:
        return get(name, channels, **kwargs)
    except (ValueError, KeyError, TypeError, NotImplementedError):
        return None


def make(name: str, channels: int, layout: str = "channels", **kwargs) -> NormSlot:
    """Build the norm ``name`` for ``channels`` features in ``layout``; raise :class:`Missing` if
    the installed normscope has no such norm. ``kwargs`` go to the registry's constructor (only
    for norms that exist solely through the registry, e.g. PowerNorm's ``warmup_iters``).

    Example::

        >>> slot = make("group:4", 16)
        >>> y = slot(torch.randn(2, 16, 8, 8))
    """
    if layout not in ("channels", "tokens"):
        raise ValueError(f"make: expected layout 'channels' or 'tokens', got {layout!r}")
    if name == "none":
        return NormSlot(nn.Identity(), name, layout, "identity", False, False)
    if layout == "channels":
        # LN and IN as the GN paper defines them for conv nets
        alias = {"layer": "group:1", "instance": f"group:{channels}"}.get(name, name)
        if alias.startswith("group:"):
            g = int(alias.split(":", 1)[1])
            inner = _registry(alias, channels)
            src = "normscope.get_norm" if inner is not None else "normscope.GroupNorm"
            inner = inner if inner is not None else normscope.GroupNorm(g, channels)
            return NormSlot(inner, name, layout, src, False, False)
        if name == "batch":
            inner = _registry("batch", channels)
            src = "normscope.get_norm" if inner is not None else "normscope.BatchNorm2d"
            return NormSlot(inner if inner is not None else normscope.BatchNorm2d(channels), name, layout, src,
                            False, False)
    else:
        if name in ("layer", "rms"):
            inner = _registry(name, channels)
            cls = normscope.LayerNorm if name == "layer" else normscope.RMSNorm
            src = "normscope.get_norm" if inner is not None else f"normscope.{cls.__name__}"
            return NormSlot(inner if inner is not None else cls(channels), name, layout, src, False, False)
        if name == "batch":  # plain BatchNorm: pads are counted like tokens
            inner = _registry("batch1d", channels)
            src = "normscope.get_norm" if inner is not None else "normscope.BatchNorm1d"
            return NormSlot(inner if inner is not None else normscope.BatchNorm1d(channels), name, layout, src,
                            True, False)
        if name == "batch-masked":
            inner = _registry("batch1d", channels)
            if inner is not None and _forward_takes_mask(inner):
                return NormSlot(inner, name, layout, "normscope.get_norm (mask=)", True, True)
            return NormSlot(_EngineMaskedBatchNorm(channels), name, layout, "normscope.engine.norm(mask=)", True,
                            True)
    # the rest exist only through the registry (PowerNorm, DyT, SyncBatchNorm, ...)
    inner = _registry(name, channels, **kwargs)
    if inner is None:
        raise Missing(f"needs normscope.get_norm({name!r}, C)")
    first = layout == "tokens" and name.split(":")[0] in _CHANNELS_FIRST
    return NormSlot(inner, name, layout, "normscope.get_norm", first, _forward_takes_mask(inner))


def available(name: str, channels: int = 8, layout: str = "channels") -> str | None:
    """None if :func:`make` can build ``name``, else the reason it cannot."""
    try:
        make(name, channels, layout)
    except Missing as err:
        return str(err)
    return None


def adain_fn():
    """normscope's AdaIN (functional or module), or raise :class:`Missing`."""
    fn = getattr(getattr(normscope, "functional", None), "adaptive_instance_norm", None) or getattr(
        getattr(normscope, "functional", None), "adain", None)
    if fn is not None:
        return fn
    mod = getattr(normscope, "AdaIN", None) or getattr(normscope, "AdaptiveInstanceNorm2d", None)
    if mod is not None:
        return lambda content, style: mod()(content, style)
    raise Missing("needs normscope AdaIN (normscope.functional.adain or normscope.AdaIN)")


