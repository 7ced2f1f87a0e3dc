"""The doctor's checks: each a small function of what one diagnosed forward recorded
(:class:`Context`) that returns its :class:`~normscope.doctor.Finding` list.

Every check states what it measures (per module, by path), its threshold and where the threshold
comes from (a paper's figure, a published error bound, or this repository's lab: docs/lab.md), the
severity, and a fix as one line of Python for a model named ``model``.
"""

from __future__ import annotations

import copy
import importlib.util
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from ._finding import Finding, Series
from ._observe import Call, NormScope, SeenMask, call_stats, channel_rows, probe, scope_rows, scope_stats, tensors_in

__all__ = ["CHECKS", "Context"]


@dataclass
class Context:
    """What one diagnosis recorded, shared by the checks (see :func:`normscope.doctor`)."""

    model: nn.Module
    batch: int | None  # the samples in the forward (dim 0 of the first tensor input)
    norms: list[Call]  # each norm's first call, in forward order, with extra["scope"]
    running_before: dict[str, tuple[Tensor | None, Tensor | None, Tensor | None]]
    running_after: dict[str, tuple[Tensor | None, Tensor | None, Tensor | None]]
    mask: Tensor | None  # mask= given to the doctor: (B, S) bool, True = a real position
    world_size: int | None
    # the model's output with its BatchNorms in train mode, then in eval mode (None: none to switch);
    # forwards run on first use only, as only a drifting model reports them
    mode_outputs: Callable[[], tuple[Tensor, Tensor] | None]
    grad_graph: bool  # whether the forward recorded autograd's graph (post-ln reads it)
    probes: dict = field(default_factory=dict)  # class -> its probed configuration (see _observe.probe)
    # (the forward's output, the output with the named parameters/buffers replaced); None where the
    # model's output is not one floating tensor
    output_with: Callable[[dict[str, Tensor]], tuple[Tensor, Tensor] | None] = lambda tensors: None
    # every padding mask a module of the forward received (see normscope.doctor._masks)
    masks: list[SeenMask] = field(default_factory=list)
    # (each call's first sample in a forward on the batch, the same on the first sample alone), or why not;
    # runs on first use (see normscope.doctor._run._sample_pair)
    sample_pair: Callable[[], tuple[list[Call], list[Call]] | str] = lambda: "not recorded"
    # a call's module run again on the first sample's inputs it received in the batch
    call_alone: Callable[[Call], Any] = lambda call: None
    notes: dict[str, str] = field(default_factory=dict)
    # the per-layer quantities the checks measured, for the report's pictures
    series: list[Series] = field(default_factory=list)

    def note(self, check: str, text: str) -> None:
        self.notes[check] = text

    def plot(
        self,
        check: str,
        title: str,
        y: str,
        lines: dict[str, list[tuple[str, float]]],
        thresholds: dict[str, float] | None = None,
        log: bool = False,
    ) -> None:
        """Keep a picture for the report: each line's (layer path, value) against the norm layers in
        forward order; nothing when no layer was measured."""
        labels = [c.path for c in self.norms]
        index = {p: i for i, p in enumerate(labels)}
        points = {k: [(index[p], float(v)) for p, v in pts if p in index] for k, pts in lines.items()}
        if any(points.values()):
            self.series.append(Series(check, title, y, "layer", points, labels, dict(thresholds or {}), log))


def _is_sync(m: nn.Module) -> bool:
    from ..modules import SyncBatchNorm

    return isinstance(m, (nn.SyncBatchNorm, SyncBatchNorm))


def _where(path: str) -> str:
    return f"lambda name, m: name == {path!r}"


def _fmt(v: float) -> str:
    return f"{v:.3g}"


# -------------------------------------------------------------------------------------- bn-elements

# Wu & He 2018 ("Group Normalization"), Table 2 / Fig. 1, ResNet-50 on ImageNet: BN's top-1 error
# by images per GPU is 23.6 (32), 23.7 (16), 24.8 (8), 27.3 (4), 34.7 (2). Its last stage is 7x7,
# so a statistic there covers 49 x batch elements: 784 at batch 16 (no loss), 392 at 8 (+1.2
# points), 196 at 4 (+3.7), 98 at 2 (+11.1). The lab's batch-size run (docs/lab.md) did not see the
# loss at batch 2 on its small task (128 elements per statistic): the size of the loss depends on
# the task, which is why the band between the two bounds is a warning, not an error.
BN_ELEMENTS_WARNING = 784
BN_ELEMENTS_ERROR = 100
_BN_SOURCE = (
    "Wu & He 2018 (Group Normalization), Table 2: ResNet-50/ImageNet BN error 23.7 at 16 images per GPU "
    "(784 elements per statistic in its 7x7 last stage), 24.8 at 8 (392), 27.3 at 4 (196), 34.7 at 2 (98) vs "
    "23.6 at 32; normscope lab batch-size (docs/lab.md): no loss measured at 128 elements on cluttered digits"
)


def _split(n: int, world: int) -> list[int]:
    """Per-rank batch sizes of ``n`` samples over ``world`` ranks, as ``torch.tensor_split`` cuts."""
    return [n // world + (1 if r < n % world else 0) for r in range(world)]


def bn_elements(ctx: Context) -> list[Finding]:
    """Elements per statistic of each BatchNorm that normalizes with batch statistics in this forward
    (N x spatial per channel; per device under ``world_size``: a plain BatchNorm sees one rank's
    share, a SyncBatchNorm all of them)."""
    out, measured = [], []
    world = ctx.world_size or 1
    seen = False
    for call in ctx.norms:
        s: NormScope = call.extra["scope"]
        m = call.module
        if s.kind != "batch" or not (call.training or getattr(m, "running_mean", None) is None):
            continue
        seen = True
        x = call.args[0]
        spatial = x.numel() // (x.shape[0] * x.shape[s.channel])
        sync = _is_sync(m)
        per_rank = min(_split(x.shape[0], world)) if world > 1 else x.shape[0]
        n = x.shape[0] if sync or world == 1 else per_rank
        elements = n * spatial
        measured.append((call.path, elements))
        if elements >= BN_ELEMENTS_WARNING:
            continue
        severity = "error" if elements < BN_ELEMENTS_ERROR else "warning"
        c = x.shape[s.channel]
        if world > 1 and not sync:
            fix = f"model, _ = normscope.convert(model, to='sync', where={_where(call.path)})"
            why = f"statistics over all {world} ranks ({x.shape[0] * spatial} elements)"
        else:
            # 'group': GroupNorm with the largest divisor of the channel count up to 32 groups (the registry's rule)
            fix = f"model, _ = normscope.convert(model, to='group', where={_where(call.path)})"
            why = "GroupNorm's statistics do not depend on the batch (or freeze_batchnorm(model) when fine-tuning)"
        out.append(
            Finding(
                "bn-elements",
                call.path,
                severity,
                {
                    "elements": elements,
                    "samples": n,
                    "spatial": spatial,
                    "channels": c,
                    "world_size": world,
                    "sync": sync,
                },
                {"warning_below": BN_ELEMENTS_WARNING, "error_below": BN_ELEMENTS_ERROR, "source": _BN_SOURCE},
                f"each statistic is estimated from {elements} elements ({n} sample(s) x {spatial} positions); "
                f"BatchNorm's error grows as that shrinks. The fix: {why}",
                fix,
            )
        )
    if not seen:
        ctx.note("bn-elements", "no BatchNorm normalizes with batch statistics in this forward")
    ctx.plot(
        "bn-elements",
        "values per BatchNorm statistic (samples x positions per channel), each BatchNorm using batch statistics",
        "values per statistic",
        {"values per statistic": measured},
        {"error below": BN_ELEMENTS_ERROR, "warning below": BN_ELEMENTS_WARNING},
        log=True,
    )
    return out


# -------------------------------------------------------------------------------------- train-eval-drift

# The lab's padding experiment measured this very distance on the first BatchNorm during training
# (Shen et al. 2020's Fig. 2 metric, docs/lab.md): 0.045 on images, where BN trains well, and 0.133
# on padded text, where BN lost 4 points of accuracy to masked BN.
DRIFT_WARNING = 0.133
# The distance a batch gives even when the running statistics are exactly the data's grows as the batch
# shrinks (8 values per channel at batch 2 in a 2x2 last stage: ~1.4 on a random-weight EfficientNet-B0).
# A layer warns when its distance exceeds that sampling noise by the threshold and by twice the noise.
# benchmarks/doctor_drift_noise.py (timm's resnet18 and efficientnet_b0, random weights, statistics fitted on
# 256 images, 10 batches each): a healthy layer warned at 0.4% at batch 2 and never at 4, 16 and 32 (the
# threshold alone: up to 8.4%), and statistics the inputs no longer fit (x 1.3 + 0.3) were found on 34-74% of
# the layers at batch 2-4 and 94-100% at 16-32.
NOISE_MARGIN = 2.0
_DRIFT_SOURCE = (
    "normscope lab padding (docs/lab.md), Shen et al. 2020 Fig. 2 metric mean_c |mu_B - mu|/sigma + "
    "mean_c |var_B/var - 1|: 0.045 for BN on images (trains well), 0.133 on padded text (4 points below masked BN)"
)


def _distance(call: Call, rm: Tensor, rv: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """Per channel: |mu_B - mu| / sigma and |var_B / var - 1| (the lab's terms, before the means), with eps on
    both variances as the layer adds it: the ratio of the squared scales it divides by in training and in
    evaluation. (Without eps on var_B, a channel whose variance is far below eps -- torchvision's MobileNetV3
    depthwise BatchNorms, eps 1e-3 -- read as a variance term of 1 although both scales are eps's.)"""
    mu, var, _ = call_stats(call)  # a BatchNorm's scopes are its channels
    sd = (rv.double() + eps).sqrt()
    return (mu - rm.double()).abs() / sd, ((var + eps) / (rv.double() + eps) - 1).abs()


def _c4(n: int) -> float:
    """E[s] / sigma for the sample standard deviation of ``n`` normal draws (the usual unbiasing constant)."""
    return math.sqrt(2 / (n - 1)) * math.exp(math.lgamma(n / 2) - math.lgamma((n - 1) / 2))


def sampling_noise(call: Call, rv: Tensor, eps: float, batch: int | None = None) -> tuple[float, float]:
    """The two distance terms that this batch's size alone gives, for running statistics that are exactly
    the data's: per channel, the standard errors of the batch mean and variance, estimated from the spread
    of per-sample statistics (one sample: of 8 contiguous blocks of its positions) -- so that neighbouring
    positions that move together count as what they are -- times E|Z| = sqrt(2/pi), plus the variance's
    small-batch bias; averaged over channels like the distance itself.

    ``batch`` is the model's batch size: a norm whose rows are a multiple of it received the samples with
    other axes folded into its batch axis (timm's LeViT runs BatchNorm1d on ``x.flatten(0, 1)``: 196 tokens
    per image as rows), and rows of one sample are not independent draws -- taken as 1,568 samples, eight
    images' noise read as a twentieth of itself and healthy layers warned. Such rows are grouped into
    ``batch`` contiguous blocks (a flatten keeps a sample's rows together), the batch-means estimate of a
    correlated series' standard error."""
    nm, nv = _noise_terms(call.args[0], call.extra["scope"], rv, eps, batch)
    return float(nm), float(nv)


def _noise_terms(x: Tensor, s: NormScope, rv: Tensor, eps: float, batch: int | None = None) -> tuple[Tensor, Tensor]:
    """:func:`sampling_noise`'s two terms as 0-d tensors on ``x``'s device (no synchronization: the training
    watch reads them with the step's other figures)."""
    units = _sample_units(x.detach().double(), s.channel, batch)
    if units.shape[0] < 2:  # one sample: blocks of its positions stand in for samples
        length = units.shape[3]
        k = min(8, length)
        if k < 2:
            zero = x.new_zeros((), dtype=torch.float64)
            return zero, zero
        blocks = units[0, :, :, : length // k * k].reshape(units.shape[1], units.shape[2], k, length // k)
        units = blocks.permute(2, 0, 1, 3)
    m, sq, _ = _unit_moments(units)
    return _noise_from_units(m, sq, rv, eps)


def _sample_units(x: Tensor, channel: int, batch: int | None) -> Tensor:
    """A BatchNorm's input as ``(units, rows per unit, channels, positions)``, a view where the layout allows:
    a unit is a sample -- or, where the model folded other axes into the norm's batch axis, one block of
    contiguous rows per sample of the model's ``batch`` (see :func:`sampling_noise`)."""
    rows, channels = x.shape[0 if channel else 1], x.shape[channel]
    if channel == 1:
        v = x.reshape(rows, channels, -1)
    elif channel == x.dim() - 1:
        v = x.reshape(rows, -1, channels).transpose(1, 2)
    else:
        v = x.movedim(channel, 1).reshape(rows, channels, -1)
    units = batch if batch is not None and 1 < batch < rows and rows % batch == 0 else rows
    return v.reshape(units, rows // units, channels, v.shape[-1])


def _unit_moments(units: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Of :func:`_sample_units`'s view: each unit's mean per channel, its mean squared deviation from the
    channel's mean, ``(units, channels)`` each, and the channel's mean -- the biased variance is the second's
    mean over units."""
    m = units.mean((1, 3))
    mean = m.mean(0)
    return m, (units - mean[None, None, :, None]).square().mean((1, 3)), mean


def _noise_from_units(m: Tensor, sq: Tensor, rv: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """The two noise terms from per-unit statistics, ``(units, channels)`` each: ``m`` a unit's mean, ``sq`` its
    mean squared deviation from the channel's mean (over every unit). Standard errors from their spread."""
    n = m.shape[0]
    m, sq = m.double(), sq.double()
    se_mean = m.std(0) / (_c4(n) * math.sqrt(n))
    se_var = sq.std(0) / (_c4(n) * math.sqrt(n))
    k = math.sqrt(2 / math.pi)
    var = rv.double().to(m.device) + eps
    return (k * se_mean / var.sqrt()).mean(), ((k * se_var + se_mean.square()) / var).mean()


def _compact(t: Tensor) -> list[float]:
    """Per-channel figures for the report's plots: 4 significant digits."""
    return [float(f"{v:.4g}") for v in t.tolist()]


def train_eval_drift(ctx: Context) -> list[Finding]:
    """Each BatchNorm's running statistics against this batch's, and the model's output with its
    norms in eval mode against train mode."""
    out, distances, bounds = [], [], []
    for call in ctx.norms:
        s = call.extra["scope"]
        before = ctx.running_before.get(call.path)
        if s.kind != "batch" or before is None or before[0] is None or before[1] is None:
            continue
        rm, rv, nbt = before
        mean_z, var_z = _distance(call, rm, rv, s.eps)
        dm, dv = float(mean_z.mean()), float(var_z.mean())
        total = dm + dv
        nm, nv = sampling_noise(call, rv, s.eps, ctx.batch)
        bound = nm + nv + max(DRIFT_WARNING, NOISE_MARGIN * (nm + nv))
        distances.append((call.path, total))
        bounds.append((call.path, bound))
        if total <= bound:
            continue
        out.append(
            Finding(
                "train-eval-drift",
                call.path,
                "warning",
                {
                    "distance": total,
                    "mean_term": dm,
                    "var_term": dv,
                    "sampling_noise": nm + nv,
                    "beyond_noise": total - nm - nv,
                    "batches_tracked": None if nbt is None else int(nbt),
                    "per_channel_mean_shift": _compact(mean_z),
                    "per_channel_var_change": _compact(var_z),
                },
                {
                    "warning_above": DRIFT_WARNING,
                    "beyond": f"the sampling noise, by the threshold and by {NOISE_MARGIN}x the noise",
                    "source": _DRIFT_SOURCE,
                },
                f"the running statistics are {_fmt(total)} away from this batch's (mean term {_fmt(dm)}, "
                f"variance term {_fmt(dv)}; this batch's size alone explains {_fmt(nm + nv)}): eval() normalizes "
                "with other numbers than training did",
                "model = normscope.recalibrate(model, batches)  # a few training batches",
            )
        )
    modes = ctx.mode_outputs() if out else None
    if modes is not None:
        yt, ye = modes
        rel = float((yt.double() - ye.double()).norm() / ye.double().norm().clamp_min(1e-30))
        out.append(
            Finding(
                "train-eval-drift",
                "",
                "info",
                {"output_relative_difference": rel, "layers": len(out)},
                {"reported_with": "a BatchNorm above the threshold", "source": _DRIFT_SOURCE},
                f"the model's output in eval mode differs from train mode by {_fmt(rel)} (relative L2)",
                "model = normscope.recalibrate(model, batches)  # a few training batches",
            )
        )
    if not any(c.extra["scope"].kind == "batch" for c in ctx.norms):
        ctx.note("train-eval-drift", "no BatchNorm with running statistics")
    ctx.plot(
        "train-eval-drift",
        "distance of each BatchNorm's running statistics from this batch's (mean_c |mu_B - mu|/sigma + "
        "mean_c |var_B/var - 1|), and where it warns: the batch's sampling noise plus max(0.133, twice the noise)",
        "distance",
        {"distance": distances, "warns above": bounds},
    )
    return out


# -------------------------------------------------------------------------------------- padding

_PADDING_SOURCE = (
    "normscope lab padding (docs/lab.md): with pads inside BatchNorm's statistics a transformer reached "
    "90.9% test accuracy, with masked BatchNorm 94.9% (Shen et al. 2020, Sec. 3); any pad in a scope counts"
)


def _mask_axes(shape: torch.Size, mask: Tensor, channel: int | None = None) -> tuple[int, ...] | None:
    """The axes of a tensor of ``shape`` that a (B, S) mask indexes: (0, 1) for (B, S, D), (0, 2)
    for (B, D, S), (1, 0) for (S, B, D); (0,) after flattening to (B*S, D); None if none fits.
    Where D == S, a per-channel norm's ``channel`` axis is not the positions' (BatchNorm1d on (B, D, S))."""
    b, s = mask.shape
    fits = [
        (a0, a1)
        for a0, a1 in ((0, 1), (0, 2), (1, 0))
        if len(shape) > max(a0, a1) and shape[a0] == b and shape[a1] == s
    ]
    if fits:
        return next((a for a in fits if a[1] != channel), fits[0])
    if len(shape) >= 2 and shape[0] == b * s:
        return (0,)
    return None


def _broadcast_mask(x: Tensor, mask: Tensor, axes: tuple[int, ...]) -> Tensor:
    """``mask`` shaped to broadcast against ``x``."""
    if axes == (0,):
        m = mask.reshape(-1)
        return m.reshape(m.shape[0], *([1] * (x.dim() - 1)))
    shape = [1] * x.dim()
    shape[axes[0]], shape[axes[1]] = mask.shape
    m = mask if axes[0] < axes[1] else mask.t()
    return m.reshape(shape)


def _masked_arg(call: Call) -> bool:
    if call.kwargs.get("mask") is not None:
        return True
    return len(call.args) > 1 and isinstance(call.args[1], Tensor) and call.args[1].dtype == torch.bool


def _masks_for(ctx: Context, call: Call) -> list[SeenMask]:
    """The masks that may describe a norm call's positions, most likely first: ``mask=`` given to the
    doctor; then those passed to the norm's parents (the innermost parent first: an encoder given the
    frame-level mask its model derived, before the model given the sample-level one), received before the
    norm ran; then any other, the most recent before it first."""
    seen = list(ctx.masks)
    if ctx.mask is not None:
        seen.insert(0, SeenMask(ctx.mask, "mask=", "2-D, True = real", [], -1))

    def rank(m: SeenMask) -> tuple:
        if not m.paths:  # mask= given to the doctor
            return (3, 0, 0)
        depth = max((len(p) for p in m.paths if p == "" or _inside(call.path, p)), default=-1)
        before = m.order < call.order
        return (2 if depth >= 0 and before else 1 if before else 0, depth, m.order if before else -m.order)

    return sorted(seen, key=rank, reverse=True)


def _position_axes(x: Tensor, s: NormScope) -> list[int]:
    """The axes of a norm's statistics that hold positions (time, space): reduced, and neither the batch
    axis nor a channel axis; none for token norms (LayerNorm/RMSNorm reduce features)."""
    if s.kind not in ("batch", "instance", "group", "power"):
        return []
    skip = {0, 1} if s.kind == "group" else {0, s.channel}
    return [a for a in s.reduce if a not in skip and x.shape[a] > 1]


def padding(ctx: Context) -> list[Finding]:
    """The fraction of padded positions inside each statistic's scope, and the shift in the statistics
    that the pads cause (with them against without them), with the mask that matches the norm's
    positions among those the model's modules received; where a norm's statistics span positions, the
    input is padded and no mask matches them, information saying so."""
    padded = [m for m in ([] if ctx.mask is None else [ctx.mask]) + [m.valid for m in ctx.masks] if not m.all()]
    if not padded:
        ctx.note(
            "padding",
            "no padded position: no mask= and no padding mask with a pad among the inputs of any module"
            if ctx.mask is None and not ctx.masks
            else "the masks the model received mark no position as padding",
        )
        return []
    out, fractions = [], []
    for call in ctx.norms:
        s: NormScope = call.extra["scope"]
        if s.kind == "frozen" or _masked_arg(call):
            continue
        x = call.args[0]
        chosen = None
        for m in _masks_for(ctx, call):
            axes = _mask_axes(x.shape, m.valid, s.channel)
            if axes is not None:
                chosen = (m, axes)
                break
        if chosen is None:
            out.extend(_unmatched(call, x, s, ctx))
            continue
        m, axes = chosen
        if not set(axes) & set(s.reduce):
            continue  # the pads are not inside any statistic (LayerNorm per token, ...)
        valid = _broadcast_mask(x, m.valid.to(x.device), axes).expand_as(x)
        all_mean, all_var, _ = scope_stats(x, s)
        rows_valid = scope_stats_masked(x, valid, s)
        if rows_valid is None:
            continue
        v_mean, v_var, v_count, count = rows_valid
        frac = 1.0 - v_count.double() / count
        fractions.append((call.path, float(frac.max())))
        if float(frac.max()) <= 0:
            continue
        ok = v_count > 1
        sd = (v_var + (s.eps or 0.0)).sqrt().clamp_min(1e-30)
        shift_mean = float(((all_mean - v_mean).abs() / sd)[ok].max()) if ok.any() else float("nan")
        ratio = (all_var + (s.eps or 0.0)) / (v_var + (s.eps or 0.0))
        shift_var = float((ratio[ok].log().abs()).max().exp()) if ok.any() else float("nan")
        kind = {"batch": "masked BatchNorm", "power": "PowerNorm with mask="}.get(s.kind, f"masked {s.kind} norm")
        out.append(
            Finding(
                "padding",
                call.path,
                "warning",
                {
                    "pad_fraction_max": float(frac.max()),
                    "pad_fraction_mean": float(frac.mean()),
                    "mean_shift_in_std": shift_mean,
                    "variance_ratio": shift_var,
                    "mask": m.name,
                    "mask_form": m.form,
                    "mask_passed_to": [p or "<model>" for p in m.paths[:4]],
                },
                {"warning_above": 0.0, "source": _PADDING_SOURCE},
                f"up to {100 * float(frac.max()):.1f}% of the positions in a statistic are padding: they move its "
                f"mean by {_fmt(shift_mean)} std and scale its variance by {_fmt(shift_var)}",
                f"model, _ = normscope.convert(model, where={_where(call.path)})  # then pass mask= to it: {kind}",
            )
        )
    ctx.plot(
        "padding",
        "largest fraction of padded positions in a statistic, each norm whose statistics a mask describes",
        "padded fraction",
        {"padded fraction": fractions},
        {"warning above": 0.0},
    )
    return out


def _unmatched(call: Call, x: Tensor, s: NormScope, ctx: Context) -> list[Finding]:
    """Information for a norm whose statistics span positions that no mask the model passed around fits."""
    axes = _position_axes(x, s)
    if not axes:
        return []
    lengths = sorted(
        {int(m.valid.shape[1]) for m in ctx.masks} | ({int(ctx.mask.shape[1])} if ctx.mask is not None else set())
    )
    axis = axes[-1]
    return [
        Finding(
            "padding",
            call.path,
            "info",
            {"axis": axis, "length": int(x.shape[axis]), "input_shape": list(x.shape), "mask_lengths_seen": lengths},
            {
                "info": "padded input, and a norm whose statistics span positions no mask describes",
                "source": _PADDING_SOURCE,
            },
            f"this {s.kind} norm's statistics span axis {axis} (length {x.shape[axis]}) and the model's input is "
            f"padded, but no padding mask of that length reached it (masks seen: lengths {lengths}): padded positions "
            "may be inside its statistics, and the doctor cannot tell how many",
            f"normscope.doctor(model, ..., mask=valid)  # valid: (batch, {x.shape[axis]}) bool, True = real, for "
            f"{call.path!r}'s axis {axis}",
        )
    ]


def scope_stats_masked(x: Tensor, valid: Tensor, s: NormScope):
    """Per statistic: mean and biased variance over the valid elements, their count and the total."""
    rows = scope_rows(x, s)
    keep = scope_rows(valid.to(x.dtype), s) > 0.5
    n = keep.sum(1)
    mean = (rows * keep).sum(1) / n.clamp_min(1)
    var = (((rows - mean[:, None]) * keep) ** 2).sum(1) / n.clamp_min(1)
    return mean, var, n, rows.shape[1]


# -------------------------------------------------------------------------------------- frozen-bn-updating

_FROZEN_SOURCE = (
    "torch semantics: a BatchNorm in training mode updates its running statistics whatever requires_grad says"
)


def frozen_bn_updating(ctx: Context) -> list[Finding]:
    """BatchNorms whose affine parameters are frozen (``requires_grad=False``) while their running
    statistics still move, because they are in training mode; the movement in this one forward."""
    out, moves = [], []
    trainable = any(p.requires_grad for p in ctx.model.parameters())
    for call in ctx.norms:
        m = call.module
        if call.extra["scope"].kind != "batch" or not call.training or call.path not in ctx.running_before:
            continue
        params = [p for p in (getattr(m, "weight", None), getattr(m, "bias", None)) if isinstance(p, Tensor)]
        frozen = all(not p.requires_grad for p in params) if params else not trainable
        rm0, rv0, n0 = ctx.running_before[call.path]
        rm1, rv1, n1 = ctx.running_after[call.path]
        if not frozen or rm0 is None or rm1 is None:
            continue
        moved = float(((rm1.double() - rm0.double()).abs() / (rv0.double() + m.eps).sqrt()).max())
        var_moved = float(((rv1.double() / rv0.double().clamp_min(1e-30)).log().abs()).max().exp())
        moves.append((call.path, moved))
        if moved == 0 and var_moved == 1:
            continue
        out.append(
            Finding(
                "frozen-bn-updating",
                call.path,
                "warning",
                {
                    "running_mean_moved_in_std": moved,
                    "running_var_ratio": var_moved,
                    "momentum": m.momentum,
                    "batches_tracked_added": None if n0 is None else int(n1) - int(n0),
                },
                {"warning_above": 0.0, "source": _FROZEN_SOURCE},
                f"weight and bias are frozen but the layer is in training mode: one forward moved its running mean "
                f"by {_fmt(moved)} std",
                "model = normscope.freeze_batchnorm(model)",
            )
        )
    ctx.plot(
        "frozen-bn-updating",
        "how far one forward moved the running mean (in running std), each frozen BatchNorm in training mode",
        "running mean moved (std)",
        {"moved": moves},
        {"warning above": 0.0},
    )
    return out


# -------------------------------------------------------------------------------------- half-overflow, eps-underflow

_HALF = (torch.float16, torch.bfloat16)
_F16_MAX = torch.finfo(torch.float16).max
_OVERFLOW_SOURCE = (
    "torch.finfo(dtype).max (65504 for float16); T5 in float16 overflows to inf in its feed-forward output before "
    "the LayerNorm (huggingface/transformers#9295), and squaring in float16 overflows for |x| > 255.9"
)


def _computes_in_fp32(m: nn.Module) -> bool:
    """torch's and normscope's layers accumulate statistics in float32 whatever the input dtype."""
    return type(m).__module__.split(".")[0] in ("torch", "normscope")


def _lost_in_half(call: Call) -> float | None:
    """How far the layer's half-precision output is from the same layer run in float32 on the same
    input (a copy), relative to the largest float32 output; None if within 1% (its own rounding)."""
    y = call.output
    if not isinstance(y, Tensor) or not y.is_floating_point():
        return None
    y = y.detach()
    m = copy.deepcopy(call.module).float()
    m.train(call.training)
    try:
        with torch.no_grad():
            y32 = m(call.args[0].float())
    except (RuntimeError, ValueError, TypeError):
        return None
    if not isinstance(y32, Tensor) or y32.shape != y.shape:
        return None
    if not bool(torch.isfinite(y).all()):
        return 1.0
    rel = float((y.double() - y32.double()).abs().max() / y32.double().abs().max().clamp_min(1e-30))
    return min(rel, 1.0) if rel > 0.01 else None


def half_overflow(ctx: Context) -> list[Finding]:
    """The largest |x| and the largest sum of squares each norm sees, against the dtype's range: an
    input that already overflowed; where x^2 or a sum of squares exceeds the range, whether the layer
    loses its result (its output against a float32 copy's: a layer that squares in the input dtype
    does); |x| within 2x of the largest value; float32 input beyond float16's range."""
    out, ranges = [], []
    for call in ctx.norms:
        x = call.args[0]
        s = call.extra["scope"]
        if not x.is_floating_point():
            continue
        big = torch.finfo(x.dtype).max
        x = x.detach()
        if not x.numel():
            continue
        xmax = float(x.abs().amax())  # exact in x's own dtype; inf and NaN propagate: one pass
        finite = math.isfinite(xmax)
        if math.isnan(xmax):
            xmax = float(x.abs().nan_to_num(nan=0.0).amax())
        # against the half-precision maximum: its own dtype's, float16's for wider input (would it fit there?)
        ranges.append((call.path, xmax / (big if x.dtype in _HALF else _F16_MAX) if finite else math.inf))
        if finite and x.dtype not in _HALF and xmax < torch.finfo(torch.float16).max:
            continue  # nothing below can be found: skip the float64 pass over a large activation
        if s.reduce:
            mean_sq, _, count = scope_stats(x.double().nan_to_num(nan=0.0).square(), s)
            ssq = float(mean_sq.max()) * count
        else:
            ssq = xmax * xmax
        measured = {
            "dtype": str(x.dtype).replace("torch.", ""),
            "max_abs": xmax,
            "max_sum_of_squares": ssq,
            "dtype_max": big,
            "headroom": big / xmax if xmax else math.inf,
        }
        threshold = {
            "error": "non-finite input, or output 1% off the float32 layer's",
            "warning_above": big / 2,
            "source": _OVERFLOW_SOURCE,
        }
        fix = "model = model.to(torch.bfloat16)  # float32's range with 8 bits of mantissa"
        if not finite:
            out.append(
                Finding(
                    "half-overflow",
                    call.path,
                    "error",
                    measured,
                    threshold,
                    "the norm's input already holds inf or NaN: something before it overflowed",
                    fix,
                )
            )
        elif x.dtype in _HALF and 2 * xmax >= big:
            out.append(
                Finding(
                    "half-overflow",
                    call.path,
                    "warning",
                    measured,
                    threshold,
                    f"|x| reaches {_fmt(xmax)}, within 2x of {x.dtype}'s largest value: one more residual "
                    "add of that size overflows",
                    fix,
                )
            )
        elif x.dtype in _HALF and max(xmax * xmax, ssq) >= big and (lost := _lost_in_half(call)) is not None:
            measured["output_vs_float32"] = lost
            out.append(
                Finding(
                    "half-overflow",
                    call.path,
                    "error",
                    measured,
                    threshold,
                    f"the layer overflows inside: x^2 reaches {_fmt(xmax * xmax)} and a sum of squares {_fmt(ssq)}, "
                    f"beyond {x.dtype}'s {_fmt(big)}, and its output differs from the same layer in float32 by "
                    f"{_fmt(lost)} (relative; inf/NaN count as 1)",
                    f"model.get_submodule({call.path!r}).float()  # or normscope.RMSNorm/LayerNorm: statistics in "
                    "float32",
                )
            )
        elif x.dtype == torch.float32 and xmax >= torch.finfo(torch.float16).max:
            out.append(
                Finding(
                    "half-overflow",
                    call.path,
                    "info",
                    measured,
                    {**threshold, "info_above": torch.finfo(torch.float16).max},
                    f"|x| reaches {_fmt(xmax)}: this norm's input overflows if the model runs in float16 "
                    "(bfloat16 keeps float32's range)",
                    fix,
                )
            )
    ctx.plot(
        "half-overflow",
        "largest |x| each norm receives, as a fraction of the half-precision maximum: its own dtype's for "
        "float16/bfloat16 input, float16's (65504) for wider input",
        "max |x| / half max",
        {"max |x| / half max": ranges},
        {"warning above": 0.5, "error above": 1.0},
        log=True,
    )
    return out


_EPS_SOURCE = (
    "torch.finfo(dtype).tiny (smallest normal number: 6.1e-05 for float16): a near-constant scope (variance ~ eps) "
    "run through the layer and through a float32 copy; > 5% apart is a warning, inf/NaN an error"
)


def _near_constant(call: Call, eps: float) -> tuple[float, bool] | None:
    """The layer's output on its own first sample rescaled so that each scope's mean square is eps
    -- where eps decides the result -- against a float32 copy's: (relative difference, finite)."""
    x = call.args[0].detach()[:1].float()
    rms = x.square().mean(dim=call.extra["scope"].reduce, keepdim=True).sqrt().clamp_min(1e-30)
    probe_x = (x / rms * math.sqrt(eps)).to(call.args[0].dtype)
    m16, m32 = copy.deepcopy(call.module), copy.deepcopy(call.module).float()
    m16.train(call.training)
    m32.train(call.training)
    try:
        with torch.no_grad():
            y, y32 = m16(probe_x), m32(probe_x.float())
    except (RuntimeError, ValueError, TypeError):
        return None
    if not isinstance(y, Tensor) or not isinstance(y32, Tensor) or y.shape != y32.shape:
        return None
    if not bool(torch.isfinite(y).all()):
        return math.inf, False
    return float((y.double() - y32.double()).abs().max() / y32.double().abs().max().clamp_min(1e-30)), True


def eps_underflow(ctx: Context) -> list[Finding]:
    """eps against the resolution of a half-precision input's dtype, for layers that may add it in
    that dtype (torch's and normscope's add it in float32 and are skipped): where eps is subnormal
    or rounds to 0 there, the layer runs on a near-constant probe (each scope's mean square = eps)
    beside a float32 copy of itself -- a layer that adds eps in float32 agrees, one that adds it in
    the input dtype does not."""
    out, probes = [], []
    for call in ctx.norms:
        x, eps = call.args[0], call.extra["scope"].eps
        if eps is None or x.dtype not in _HALF or _computes_in_fp32(call.module) or eps <= 0:
            continue
        info = torch.finfo(x.dtype)
        stored = float(torch.tensor(eps, dtype=x.dtype))
        if eps >= info.tiny:
            continue
        probed = _near_constant(call, eps)
        if probed is not None:
            probes.append((call.path, probed[0]))
        if probed is None or probed[0] <= 0.05:
            continue  # the layer adds eps where it is representable
        rel, finite = probed
        measured = {
            "eps": eps,
            "dtype": str(x.dtype).replace("torch.", ""),
            "eps_in_dtype": stored,
            "tiny": info.tiny,
            "near_constant_vs_float32": rel if finite else "inf/nan",
        }
        threshold = {"error": "inf/NaN on near-constant scopes", "warning_above": 0.05, "source": _EPS_SOURCE}
        fix = f"model.get_submodule({call.path!r}).float()  # statistics and eps in float32"
        where = "rounds to 0" if stored == 0 else f"is subnormal (stored as {stored:g})"
        if not finite:
            out.append(
                Finding(
                    "eps-underflow",
                    call.path,
                    "error",
                    measured,
                    threshold,
                    f"eps={eps:g} {where} in {x.dtype}, and this layer adds it there: a near-constant "
                    "scope gives inf/NaN",
                    fix,
                )
            )
        else:
            out.append(
                Finding(
                    "eps-underflow",
                    call.path,
                    "warning",
                    measured,
                    threshold,
                    f"eps={eps:g} {where} in {x.dtype}, and this layer computes its statistics there: "
                    f"near-constant scopes come out {100 * rel:.0f}% off the float32 layer",
                    fix,
                )
            )
    ctx.plot(
        "eps-underflow",
        "a near-constant probe through each half-precision layer that may add eps in its dtype, against a float32 copy",
        "relative difference",
        {"relative difference": probes},
        {"warning above": 0.05},
    )
    return out


# -------------------------------------------------------------------------------------- cancellation

# Chan, Golub & LeVeque 1983 ("Algorithms for computing the sample variance"): the textbook one-pass
# formula E[x^2] - E[x]^2 has a relative error of about u * kappa^2, kappa^2 = 1 + (mean/std)^2,
# u the unit roundoff of the accumulation; two-pass and Welford are about u * kappa.
# The layer divides by sqrt(var + eps), so the error that matters is the one-pass error's absolute size,
# u (mean^2 + var), against var + eps: the same u kappa^2 where var >> eps, and nothing where eps dominates
# (a channel nearly constant over a batch of two -- ResNeSt's split attention on pooled features at batch 2 --
# has |mean|/std ~ 1.6e3 but a variance a thousandth of eps; against the variance alone it warned, 15% "off").
CANCEL_WARNING = 1e-3
CANCEL_ERROR = 1.0
_CANCEL_SOURCE = (
    "Chan, Golub & LeVeque 1983: one-pass variance relative error ~ u (1 + (mean/std)^2), i.e. an absolute error "
    "~ u (mean^2 + var), here against the var + eps the layer divides by"
)
_PROBE_OFFSET = 1e4


def _one_pass(call: Call) -> bool | None:
    """Whether the module computes the variance in one pass, by probe: on a copy, the same input
    shifted by 1e4 must give the same output (a two-pass variance does; E[x^2] - E[x]^2 in float32
    loses every digit). None where it cannot be probed (not float32/float64, other arguments)."""
    x = call.args[0]
    if x.dtype not in (torch.float32, torch.float64):
        return None
    g = torch.Generator(device="cpu").manual_seed(0)
    z = torch.randn(x.shape, generator=g, dtype=torch.float64).to(device=x.device, dtype=x.dtype)
    m = copy.deepcopy(call.module)
    m.train(call.training)
    try:
        with torch.no_grad():
            base, shifted = m(z), m(z + _PROBE_OFFSET)
    except (RuntimeError, ValueError, TypeError):
        return None
    if not isinstance(base, Tensor) or not isinstance(shifted, Tensor):
        return None
    rel = float((shifted.double() - base.double()).abs().max() / base.double().abs().max().clamp_min(1e-30))
    return rel > 0.05


def cancellation(ctx: Context) -> list[Finding]:
    """|mean| / std per statistic of each centered norm, and whether the implementation in use
    computes the variance in one pass (probed)."""
    out, errors = [], []
    for call in ctx.norms:
        s: NormScope = call.extra["scope"]
        if not s.centered or s.kind == "frozen" or not s.reduce:
            continue
        if s.kind == "batch" and not call.training and getattr(call.module, "running_var", None) is not None:
            continue  # eval: the variance comes from the running statistics, not from this input
        mean, var, _ = call_stats(call)
        ok = var > 0
        if not ok.any():
            continue
        ratio = float((mean.abs()[ok] / var[ok].sqrt()).max())
        acc = torch.float64 if call.args[0].dtype == torch.float64 else torch.float32
        u = torch.finfo(acc).eps / 2
        err = float((u * (mean.square() + var) / (var + (s.eps or 0.0)))[ok].max())
        errors.append((call.path, err))
        if err < CANCEL_WARNING:
            continue
        one_pass = _one_pass(call)
        measured = {"max_mean_over_std": ratio, "one_pass_relative_error": err, "one_pass_in_use": one_pass}
        threshold = {"warning_above": CANCEL_WARNING, "error_above": CANCEL_ERROR, "source": _CANCEL_SOURCE}
        fix = f"model, _ = normscope.convert(model, where={_where(call.path)})  # two-pass statistics"
        if one_pass:
            sev = "error" if err >= CANCEL_ERROR else "warning"
            reason = (
                f"|mean|/std reaches {_fmt(ratio)} and this layer computes E[x^2] - E[x]^2 (probed): the variance "
                f"plus eps it divides by is off by about {_fmt(err)} relative"
                + (" -- negative variances, NaN" if sev == "error" else "")
            )
        else:
            sev = "info"
            what = "two-pass (probed)" if one_pass is False else "not probed"
            reason = (
                f"|mean|/std reaches {_fmt(ratio)}; this implementation is {what}, but a one-pass "
                f"kernel (an exporter's or a runtime's) would be off by about {_fmt(err)} of the variance plus eps"
            )
            fix = f"# keep a two-pass implementation for {call.path!r} when exporting or swapping kernels"
        out.append(Finding("cancellation", call.path, sev, measured, threshold, reason, fix))
    ctx.plot(
        "cancellation",
        "relative error a one-pass variance (E[x^2] - E[x]^2) would give what each norm divides by: "
        "u (mean^2 + var) / (var + eps)",
        "one-pass relative error",
        {"one-pass relative error": errors},
        {"warning above": CANCEL_WARNING, "error above": CANCEL_ERROR},
        log=True,
    )
    return out


# -------------------------------------------------------------------------------------- dead-channels

_DEAD_SOURCE = (
    "the layer's own eps: below it, eps and not the data sets the channel's scale; a channel is dead where it is "
    "also below 1% of the layer's median channel variance (constant among active peers) or exactly constant"
)
# a channel below eps is dead only where its peers are not: random or small-scale layers whose every channel sits
# below eps (torchvision's MobileNetV3 depthwise BatchNorms: eps 1e-3, variances ~1e-4 at random weights) are a
# matter of scale, said as information about the layer
DEAD_AMONG_PEERS = 0.01
# Dead channels are information, never a warning, in a one-batch diagnosis: one batch cannot tell a dead channel
# from a sparse one it did not excite, and the cause sits before the norm (a ReLU that never fires), which the norm
# neither makes nor can mend. On zoo models the doctor was not written for (timm's repvgg_a0, fastvit_t8;
# torchvision's efficientnet_v2_s, random weights, calibrated statistics, eval) it warned on 4-15 layers a run, on
# channels the statistics had seen vary. In eval a channel counts only where the running statistics say it is dead
# too. Channels that die during training are normscope.watch's warning: the first watched step is the baseline.


def _dead(var: Tensor, typical: float | Tensor, eps: float) -> Tensor:
    """Which channels (scopes) of these variances are dead: below eps and far below their peers', or exactly 0."""
    return (var < eps) & ((var <= DEAD_AMONG_PEERS * typical) | (var == 0))


def _padded_rows(ctx: Context, call: Call, x: Tensor, s: NormScope) -> Tensor | None:
    """For a per-position norm (its positions are not reduced), which of its statistics (rows, in the
    order of :func:`scope_rows`) sit at padded positions, by the mask that fits its axes; None if none fits."""
    for m in _masks_for(ctx, call):
        axes = _mask_axes(x.shape, m.valid, s.channel)
        if axes is None:
            continue
        if set(axes) & set(s.reduce):
            return None
        valid = _broadcast_mask(x, m.valid.to(x.device), axes).expand_as(x)
        return scope_rows(valid.to(torch.float64), s).min(1).values < 0.5
    return None


def dead_channels(ctx: Context) -> list[Finding]:
    """Channels (of per-channel norms) whose variance over this batch is below eps -- constant or
    dead -- and constant scopes of per-sample norms (padded positions, where a mask says so, left out);
    what eps then does to them: with batch statistics it sets their scale, with running statistics
    (BatchNorm in eval) they carry nothing to the layers after."""
    out, fractions, scale = [], [], []
    for call in ctx.norms:
        s: NormScope = call.extra["scope"]
        if s.eps is None or s.kind == "frozen":
            continue
        x = call.args[0]
        running = None
        if s.kind == "batch":
            var = call_stats(call)[1]
            unit = "channels"
            if not call.training and ctx.running_before.get(call.path, (None, None))[1] is not None:
                running = ctx.running_before[call.path][1].double()
        elif s.channel is not None and s.kind in ("instance", "power"):
            rows = channel_rows(x, s.channel)
            var = rows.var(1, unbiased=False) if s.centered else rows.square().mean(1)
            unit = "channels"
        elif s.kind == "group":
            rows = channel_rows(x, 1)
            var = rows.var(1, unbiased=False)
            unit = "channels"
        else:
            var = call_stats(call)[1] if s.centered else scope_stats(x.square(), s)[0]
            unit = "scopes"
        padded = _padded_rows(ctx, call, x, s) if unit == "scopes" else None
        keep = torch.ones_like(var, dtype=torch.bool)
        if padded is not None and padded.shape == var.shape:
            keep = ~padded
        typical = float(var[keep].median()) if bool(keep.any()) else 0.0
        if typical < s.eps and bool(keep.any()):
            scale.append((call, typical, unit, var))
        low = _dead(var, typical, s.eps) & keep
        if running is not None:  # in eval: dead in the data its statistics came from too, not only in this batch
            low = low & _dead(running, float(running.median()), s.eps)
        considered = int(keep.sum())
        dead = low.nonzero().flatten()
        fractions.append((call.path, dead.numel() / max(considered, 1)))
        if dead.numel() == 0:
            continue
        denom = (running[dead] if running is not None else var[dead]) + s.eps
        gain = float(denom.rsqrt().max())
        idx = [int(i) for i in dead[:16]]
        if running is None:
            why = (
                f"nearly constant, so eps sets their scale -- deviations are multiplied by up to {_fmt(gain)} "
                "instead of normalized"
            )
        else:
            why = "nearly constant over this batch and in the running statistics: the layer before gives them no signal"
        out.append(
            Finding(
                "dead-channels",
                call.path,
                "info",
                {
                    unit: int(dead.numel()),
                    "of": considered,
                    "indices": idx,
                    "max_variance": float(var[dead].max()),
                    "eps": s.eps,
                    "gain": gain,
                    **({} if padded is None else {"padded_left_out": int(padded.sum())}),
                },
                {"warning_below": s.eps, "and_below_median_times": DEAD_AMONG_PEERS, "source": _DEAD_SOURCE},
                f"{dead.numel()} of {considered} {unit} have variance below eps={s.eps:g} (and far below the "
                f"layer's other {unit}): {why}",
                f"print(model.get_submodule({call.path!r}))  # {unit} {idx[:8]}: check the layer before (dead ReLU, "
                "zero weights)",
            )
        )
    for call, typical, unit, var in scale:
        s = call.extra["scope"]
        out.append(
            Finding(
                "dead-channels",
                call.path,
                "info",
                {
                    "median_variance": typical,
                    "eps": s.eps,
                    unit: int(var.numel()),
                    "scale_kept": typical / (typical + s.eps),
                },
                {"info_below": s.eps, "source": _DEAD_SOURCE},
                f"the layer's typical {unit[:-1]} variance ({_fmt(typical)}, the median) is below eps={s.eps:g}: eps, "
                f"not the data, sets its scale -- its outputs keep {100 * typical / (typical + s.eps):.0f}% of a unit "
                "variance",
                f"print(model.get_submodule({call.path!r}).eps)  # the activations' scale is below it: a smaller eps, "
                "or look at the layers before",
            )
        )
    ctx.plot(
        "dead-channels",
        "fraction of each norm's channels (per-sample norms: scopes) with variance below eps on this batch",
        "fraction below eps",
        {"fraction below eps": fractions},
        {"info above": 0.0},
    )
    return out


# -------------------------------------------------------------------------------------- bias-before-norm

_BIAS_SOURCE = "AllenNLP NormalizationBiasVerification: a bias directly before a norm that subtracts its mean"
# Information, not a warning: the bias changes nothing the model computes (checked below), it only costs its
# parameters -- and published architectures keep it (timm's resnest14d split attention, hrnet_w18_small's
# downsampling, efficientformer_l1's MLP), where a warning on a healthy model would be a false alarm.


def bias_before_norm(ctx: Context) -> list[Finding]:
    """A Linear/Conv bias feeding a norm that subtracts a per-channel mean over every axis the bias
    is constant along (BatchNorm, InstanceNorm -- GroupNorm(C, C) included, the same scope -- on the bias's
    channel axis): the norm removes it."""
    found = []
    for call in ctx.norms:
        s: NormScope = call.extra["scope"]
        per_channel = s.kind in ("batch", "instance") or (
            s.kind == "group" and s.channel is not None and s.groups == call.args[0].shape[s.channel]
        )
        if call.producer is None or not s.centered or s.channel is None or not per_channel:
            continue
        prod = ctx.model.get_submodule(call.producer)
        bias = getattr(prod, "bias", None)
        if not isinstance(bias, Tensor):
            continue
        x = call.args[0]
        bias_axis = 1 if isinstance(prod, nn.modules.conv._ConvNd) else x.dim() - 1
        if s.channel == bias_axis:
            found.append((call, bias))
    # the norm removes the bias from its own input only: where the producer's output also goes elsewhere
    # (a residual `bn(y) + y`, the producer called again) the bias counts. Measured: the model's output
    # without these biases (the fix, running_mean shifted) must be the diagnosed one, to rounding
    if found and not _bias_removable(ctx, found):
        found = [f for f in found if _bias_removable(ctx, [f])]
    out = []
    for call, bias in found:
        fix = (
            f"conv, norm = model.get_submodule({call.producer!r}), model.get_submodule({call.path!r}); "
            "norm.running_mean.sub_(conv.bias.detach()) if getattr(norm, 'running_mean', None) is not None else None; "
            "conv.bias = None"
        )
        out.append(
            Finding(
                "bias-before-norm",
                call.path,
                "info",
                {
                    "producer": call.producer,
                    "bias_max_abs": float(bias.detach().abs().max()),
                    "bias_numel": bias.numel(),
                },
                {"info": "any bias directly before a mean-subtracting per-channel norm", "source": _BIAS_SOURCE},
                f"{call.producer}'s bias is subtracted again by this norm's per-channel mean: {bias.numel()} "
                "parameters that cannot change the output (and take weight decay)",
                fix,
            )
        )
    ctx.plot(
        "bias-before-norm",
        "largest |bias| of the Linear/Conv before each norm that subtracts it again",
        "max |bias|",
        {"max |bias|": [(call.path, float(bias.detach().abs().max())) for call, bias in found]},
        {"info above": 0.0},
    )
    return out


def _bias_removable(ctx: Context, found: list[tuple[Call, Tensor]]) -> bool:
    """Whether the model's output stays the diagnosed one, to its dtype's rounding, with each found bias
    zeroed and its norm's running mean shifted by it (what the fix does)."""
    tensors = {}
    for call, bias in found:
        tensors[f"{call.producer}.bias".lstrip(".")] = torch.zeros_like(bias)
        mean = getattr(call.module, "running_mean", None)
        if isinstance(mean, Tensor):
            tensors[f"{call.path}.running_mean".lstrip(".")] = mean.detach() - bias.detach().to(mean.dtype)
    outputs = ctx.output_with(tensors)
    if outputs is None:
        return True  # nothing to compare: the structure alone (the producer feeds the norm) speaks
    y, other = outputs
    scale = y.detach().abs().max().double().item()
    tol = 64 * torch.finfo(y.dtype).eps * max(scale, 1.0)
    return bool((other.double() - y.double()).abs().max().item() <= tol)


# -------------------------------------------------------------------------------------- post-ln

_POST_LN_SOURCE = (
    "Xiong et al. 2020 (On Layer Normalization in the Transformer Architecture): Post-LN needs learning-rate "
    "warm-up; normscope lab prenorm (docs/lab.md): at lr 1e-2 Post-LN failed in every seed, Pre-LN in none"
)


# the most autograd nodes post-ln walks (a large model's forward has a few hundred per layer)
_GRAPH_NODES = 500_000


def _post_ln_from_graph(token: list[Call]) -> dict[str, str]:
    """{norm: the norm before it on the stream} for the Post-LN norms among ``token``, from autograd's graph.

    A norm N is Post-LN where its input is an addition ``a + b`` whose skip ``a`` is another norm M's output,
    the branch ``b`` is computed from M's output with no norm in between (``b = f(M(...))``: BERT's
    ``LayerNorm(M + sublayer(M))``), and the sum goes nowhere but into N -- the stream passes through N. Not
    Post-LN, though a norm's output is an operand of the add: a norm at the end of a branch (Gemma 2's
    ``x + post_attention_layernorm(attn(x))``: the skip is the stream), a branch that starts with its own norm
    (BLOOM's first layer, ``h + attn(input_layernorm(h))`` after the embeddings' norm), and a sum that the next
    add also takes (ModernBERT's first layer, whose attention takes the embeddings' norm directly: the stream
    continues past ``mlp_norm``). Each of these read as Post-LN when any operand of the add was a norm's output.
    """
    # the grad_fns as the hooks saw them: an in-place write after the norm (x += ...) gives the tensor another one
    produced = {id(c.extra["output_fn"]): c.path for c in token if c.extra.get("output_fn") is not None}
    # every node behind the norms, and who takes each (a node's consumers are the nodes listing it as an input)
    takers: dict[int, set[int]] = {}
    stack = [f for c in token for f in (c.extra.get("input_fn"), c.extra.get("output_fn")) if f is not None]
    seen: set[int] = set()
    while stack and len(seen) < _GRAPH_NODES:
        fn = stack.pop()
        if id(fn) in seen:
            continue
        seen.add(id(fn))
        for nxt, _ in fn.next_functions:
            if nxt is not None:
                takers.setdefault(id(nxt), set()).add(id(fn))
                stack.append(nxt)

    def inside(out_fn, stop) -> set[int]:
        """The nodes of a norm's own computation: from its output back to its input ``stop``."""
        own, todo = set(), [out_fn]
        while todo and len(own) < _GRAPH_NODES:
            fn = todo.pop()
            if fn is stop or id(fn) in own:
                continue
            own.add(id(fn))
            todo.extend(n for n, _ in fn.next_functions if n is not None)
        return own

    outputs = frozenset(produced)  # a branch that meets another norm's output first starts at that norm
    found = {}
    for c in token:
        fn, out_fn = c.extra.get("input_fn"), c.extra.get("output_fn")
        if fn is None or out_fn is None or not type(fn).__name__.startswith("AddBackward"):
            continue
        if takers.get(id(fn), set()) - inside(out_fn, fn):
            continue  # the sum goes on past this norm too: the stream does not pass through it
        operands = [n for n, _ in fn.next_functions if n is not None]
        for skip in operands:
            source = produced.get(id(skip))
            if source is None or source == c.path:
                continue
            if any(_computed_from(other, id(skip), outputs) for other in operands if other is not skip):
                found[c.path] = source
    return found


def _computed_from(fn, target: int, stop: frozenset[int] = frozenset()) -> bool:
    """Whether autograd node ``fn`` is computed from the node whose id is ``target`` (along a path through no
    node in ``stop`` but ``fn`` itself)."""
    todo, visited = [fn], set()
    while todo and len(visited) < _GRAPH_NODES:
        f = todo.pop()
        if id(f) == target:
            return True
        if id(f) in visited or (id(f) in stop and f is not fn):
            continue
        visited.add(id(f))
        todo.extend(n for n, _ in f.next_functions if n is not None)
    return False


def post_ln(ctx: Context) -> list[Finding]:
    """A norm after a residual add whose other branch starts from a norm's output -- the residual
    stream passes through the norm (Post-LN) -- read from autograd's graph of the forward; torch's
    TransformerEncoder/DecoderLayer with ``norm_first=False`` when there is no graph."""
    out = []
    token = [c for c in ctx.norms if c.extra["scope"].kind in ("layer", "rms")]
    if not token:
        ctx.note("post-ln", "no LayerNorm or RMSNorm")
        return []
    found: dict[str, str] = {}
    if ctx.grad_graph:
        found = _post_ln_from_graph(token)
    else:
        ctx.note("post-ln", "no autograd graph (no parameter requires grad): read from torch's transformer layers")
        for path, m in ctx.model.named_modules():
            if isinstance(m, (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)) and not m.norm_first:
                for name, _ in m.named_children():
                    if name.startswith("norm"):
                        found[f"{path}.{name}" if path else name] = "(norm_first=False)"
    for path, source in sorted(found.items()):
        out.append(
            Finding(
                "post-ln",
                path,
                "info",
                {"residual_from": source},
                {"info": "a norm on the residual stream", "source": _POST_LN_SOURCE},
                f"Post-LN: this norm sits on the residual stream (after the add whose branch starts at {source}); "
                "train it with learning-rate warm-up, or move the norms before the sublayers (Pre-LN)",
                "scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.01, total_iters=4000)",
            )
        )
    ctx.plot(
        "post-ln",
        "each LayerNorm/RMSNorm: on the residual stream (1, Post-LN) or on a branch (0)",
        "on the residual stream",
        {"on the residual stream": [(c.path, float(c.path in found)) for c in token]},
        {"info above": 0.5},
    )
    return out


# -------------------------------------------------------------------------------------- casting-order

_CASTING_SOURCE = (
    "bit-for-bit probes against normscope's casting orders (normscope.functional_modern.rms_norm / layer_norm), "
    "as normscope.integrations.transformers does"
)
# the casting order other installed kernels use by default, as we read their source: Liger-Kernel's
# LigerRMSNorm(casting_mode="llama"); Apex's fused kernels normalize in float32 and cast before the
# weight (Llama's order); Transformer Engine multiplies in float32 and casts once (Gemma's order)
_PEERS = (
    ("liger_kernel", "Liger-Kernel", "llama"),
    ("apex", "Apex", "llama"),
    ("transformer_engine", "Transformer Engine", "gemma"),
)


def _implements(m: nn.Module, cache: dict) -> tuple[bool, str, float] | None:
    """(centered, casting, weight_offset) of an RMSNorm/LayerNorm, None if unknown."""
    from .. import modules as M

    if isinstance(m, (M.LayerNorm, M.RMSNorm)):
        return isinstance(m, nn.LayerNorm), m.casting, m.weight_offset
    if type(m) in (nn.LayerNorm, nn.RMSNorm):
        return type(m) is nn.LayerNorm, "torch", 0.0
    exact = probe(type(m), cache)
    return None if exact is None else (exact.centered, exact.casting, exact.weight_offset)


def casting_order(ctx: Context) -> list[Finding]:
    """For RMSNorm/LayerNorm modules on half-precision input: which casting order the module
    implements (probed bit for bit), and how far the other orders -- and the installed peers'
    defaults -- round from it on this very input."""
    from .. import functional_modern as FM

    out, fractions = [], []
    for call in ctx.norms:
        s = call.extra["scope"]
        x = call.args[0]
        if s.kind not in ("layer", "rms") or x.dtype not in _HALF or not isinstance(call.output, Tensor):
            continue
        how = _implements(call.module, ctx.probes)
        if how is None:
            continue
        centered, casting, offset = how
        m = call.module
        w = getattr(m, "weight", None)
        b = getattr(m, "bias", None) if centered else None
        shape = tuple(x.shape[i] for i in s.reduce)
        diffs = {}
        with torch.no_grad():
            for other in FM.CASTINGS:
                if centered:
                    y = FM.layer_norm(x, shape, w, b, s.eps, weight_offset=offset, casting=other)
                else:
                    y = FM.rms_norm(x, shape, w, s.eps, weight_offset=offset, casting=other)
                if y.shape != call.output.shape:
                    continue
                d = (y.double() - call.output.double()).abs()
                diffs[other] = {"max_abs": float(d.max()), "fraction_different": float((d > 0).double().mean())}
        peers = {label: casting != order for mod, label, order in _PEERS if importlib.util.find_spec(mod) is not None}
        kind = "layer_norm" if centered else "rms_norm"
        layer = "LayerNorm" if centered else "RMSNorm"
        others = [c for c in diffs if c != casting and diffs[c]["fraction_different"] > 0]
        fractions.append((call.path, max((diffs[c]["fraction_different"] for c in diffs if c != casting), default=0.0)))
        out.append(
            Finding(
                "casting-order",
                call.path,
                "info",
                {
                    "implements": f"{kind}(casting={casting!r}, weight_offset={offset:g})",
                    "dtype": str(x.dtype).replace("torch.", ""),
                    "other_orders": diffs,
                    "installed_peers_differ": peers,
                },
                {"info": "any bit of difference", "source": _CASTING_SOURCE},
                f"{type(m).__name__} rounds as casting={casting!r}; on this input "
                + (
                    ", ".join(
                        f"casting={c!r} changes {100 * diffs[c]['fraction_different']:.1f}% of the outputs"
                        for c in others
                    )
                    if others
                    else "every other order gives the same bits"
                ),
                f"normscope.{layer}({shape[-1] if len(shape) == 1 else shape}, eps={s.eps}, weight_offset={offset:g}, "
                f"casting={casting!r})  # the same bits",
            )
        )
    ctx.plot(
        "casting-order",
        "fraction of each half-precision RMS/LayerNorm's outputs that another casting order rounds differently "
        "(the most different order)",
        "fraction of outputs",
        {"fraction of outputs": fractions},
    )
    return out


# -------------------------------------------------------------------------------------- batch-invariance

_INVARIANCE_SOURCE = (
    "a per-sample module gives a sample the same result alone as in a batch up to rounding: relative difference "
    "1e-5 in float32 (about 84 ulp of the largest output), 8 ulp in float16/bfloat16; BLAS picks kernels by batch "
    "size, so torch's nn.Linear differs in the last bits"
)


def _tolerance(dtype: torch.dtype) -> float:
    if dtype == torch.float64:
        return 1e-12
    if dtype in _HALF:
        return 8 * torch.finfo(dtype).eps
    return 1e-5


def _difference(a: Any, b: Any) -> float | None:
    """The largest relative difference of the tensors of ``b`` from those of ``a`` (max |a - b| over max |a|,
    per tensor; NaN and inf equal where both hold the same); None where they do not pair up (another
    number of tensors, shapes or dtypes); inf where an integer tensor differs or a NaN stands alone."""
    ta, tb = tensors_in(a), tensors_in(b)
    if len(ta) != len(tb):
        return None
    worst = 0.0
    for x, y in zip(ta, tb):
        if x.shape != y.shape or x.dtype != y.dtype:
            return None
        if torch.equal(x, y):
            continue
        if not x.is_floating_point():
            return math.inf
        xd, yd = x.double(), y.double()
        same = (xd == yd) | (xd.isnan() & yd.isnan())
        d = (xd - yd).abs().masked_fill(same, 0.0)
        if bool(d.isnan().any()):
            return math.inf
        scale = float(xd.abs().masked_fill(~xd.isfinite(), 0.0).max())
        worst = max(worst, float(d.max()) / max(scale, 1e-30))
    return worst


def _float_dtype(v: Any) -> torch.dtype | None:
    return next((t.dtype for t in tensors_in(v) if t.is_floating_point()), None)


def _mixes_by_design(m: nn.Module, training: bool) -> bool:
    """A norm whose statistics span the batch in this mode: BatchNorm-type in training, or without running
    statistics; PowerNorm in training."""
    from ..modules import PowerNorm

    if isinstance(m, nn.modules.batchnorm._BatchNorm):
        return training or m.running_mean is None
    return isinstance(m, PowerNorm) and training


def _inside(path: str, parent: str) -> bool:
    return path != parent and (parent == "" or path.startswith(parent + "."))


def batch_invariance(ctx: Context) -> list[Finding]:
    """The model on its first sample alone against the same sample inside the batch: a forward of each
    (every module in eval mode but the norms, BatchNorm-type norms with running statistics in eval too:
    dropout draws nothing, and each sample should stand alone), every module call's first sample recorded
    in both. A module mixes the batch where its inputs agreed and its output did not; the finding goes to
    the innermost such module (its parents' outputs differ because of it), after running it once more on
    the exact inputs it received in the batch (a difference that was only its input's rounding,
    amplified, is not its own). BatchNorm-type norms in training mix the batch by design: information."""
    if not ctx.batch or ctx.batch < 2:
        ctx.note("batch-invariance", "the batch has one sample")
        return []
    out, rounding = [], []
    by_design = [c.path for c in ctx.norms if _mixes_by_design(c.module, c.training)]
    pair = ctx.sample_pair()
    if isinstance(pair, str):
        ctx.note("batch-invariance", pair)
        pair = ([], [])
    in_batch, alone = pair
    alone_at = {(c.path, c.index): c for c in alone}
    candidates, norm_diffs, norm_paths = [], [], {c.path for c in ctx.norms}
    for call in in_batch:
        other = alone_at.get((call.path, call.index))
        if other is None or call.sample is None or other.sample is None:
            continue
        d_in = _difference(call.sample[:2], other.sample[:2])
        d_out = _difference(call.sample[2], other.sample[2])
        dtype = _float_dtype(call.sample[2])
        if call.path in norm_paths and call.index == 0 and d_out is not None:
            norm_diffs.append((call.path, d_out))
        if d_in is None or d_out is None or dtype is None or d_out == 0:
            continue
        tol = _tolerance(dtype)
        if d_in > _tolerance(_float_dtype(call.sample[:2]) or dtype):
            continue  # its input already differs: the cause is before it
        if d_out <= tol:
            if d_in == 0:
                rounding.append((call.path, d_out))
            continue
        candidates.append((call, d_in, d_out, tol))
    paths = [c.path for c, *_ in candidates]
    for call, d_in, d_out, tol in candidates:
        if any(_inside(p, call.path) for p in paths):
            continue  # a module inside it is the cause
        if _mixes_by_design(call.module, call.training):
            if call.path not in by_design:
                by_design.append(call.path)
            continue
        if d_in > 0:
            again = _difference(call.sample[2], ctx.call_alone(call))
            if again is not None and again <= tol:
                continue  # on the very inputs it had in the batch it agrees: its input's rounding, amplified
        out.append(
            Finding(
                "batch-invariance",
                call.path,
                "warning",
                {
                    "relative_difference": d_out,
                    "input_relative_difference": d_in,
                    "batch": ctx.batch,
                    "module_type": type(call.module).__name__,
                },
                {"warning_above": tol, "source": _INVARIANCE_SOURCE},
                f"the first sample's output alone differs from the same sample in the batch by {_fmt(d_out)} relative, "
                f"while its input agreed{'' if d_in == 0 else f' (to {_fmt(d_in)})'}: this module's own computation "
                "mixes data across the batch dimension",
                f"print(type(model.get_submodule({call.path!r})))  # statistics over samples where each sample "
                "should stand alone",
            )
        )
    if by_design:
        out.append(
            Finding(
                "batch-invariance",
                "",
                "info",
                {"kind": "by design", "modules": len(by_design), "paths": by_design[:16]},
                {"info": "statistics over the batch, by design", "source": _INVARIANCE_SOURCE},
                f"{len(by_design)} BatchNorm-type layer(s) normalize each sample with the batch's statistics in this "
                "mode: by design, a sample's output depends on the others (in eval mode with running statistics it "
                "does not)",
                "model.eval()  # inference: running statistics, each sample on its own",
            )
        )
    rounding = [(p, r) for p, r in rounding if not any(_inside(q, p) for q, _ in rounding)]  # innermost, as above
    if rounding:
        worst = max(r for _, r in rounding)
        out.append(
            Finding(
                "batch-invariance",
                "",
                "info",
                {
                    "kind": "rounding",
                    "modules": len(rounding),
                    "paths": [p for p, _ in rounding[:16]],
                    "max_relative_difference": worst,
                },
                {"rounding_up_to": "per dtype, see source", "source": _INVARIANCE_SOURCE},
                f"{len(rounding)} module(s) give a sample other last bits alone than in the batch from the same input "
                f"(up to {_fmt(worst)} relative): rounding, from kernels chosen by batch size",
                "torch.use_deterministic_algorithms(True)  # fixes run-to-run, not batch-size, differences",
            )
        )
    dtypes = [c.args[0].dtype for c in ctx.norms if c.args and isinstance(c.args[0], Tensor)]
    ctx.plot(
        "batch-invariance",
        "each norm's output for the first sample alone against the same sample in the batch (relative "
        "difference; 0 not drawn on the log scale): where in the depth the samples start to mix",
        "relative difference",
        {"relative difference": norm_diffs},
        {"warning above": _tolerance(dtypes[0])} if dtypes else {},
        log=True,
    )
    return out


# -------------------------------------------------------------------------------------- syncbn

_SYNC_SOURCE = (
    "torch.distributed semantics: SyncBatchNorm all-gathers per-rank statistics every forward, so every rank must run "
    "every step; ranks with uneven shards that run out at different steps hang (pytorch/pytorch#38174)"
)


def syncbn(ctx: Context) -> list[Finding]:
    """SyncBatchNorm hazards: a process group of one, uneven per-rank batches, a rank with none."""
    out = []
    syncs = [c for c in ctx.norms if _is_sync(c.module)]
    if not syncs:
        ctx.note("syncbn", "no SyncBatchNorm")
        return []
    world = ctx.world_size
    ranks = world or 1
    ctx.plot(
        "syncbn",
        f"samples on the rank with the fewest, each SyncBatchNorm, the batch split over {ranks} rank(s)"
        + ("" if world else " (pass world_size= for the real split)"),
        "samples on the smallest rank",
        {"smallest rank": [(c.path, min(_split(c.args[0].shape[0], ranks))) for c in syncs]},
        {"warning below": 1},
    )
    for call in syncs:
        n = call.args[0].shape[0]
        fix_one = f"model, _ = normscope.convert(model, to='batch', where={_where(call.path)})"
        if world is None or world == 1:
            sev = "info" if world is None else "warning"
            out.append(
                Finding(
                    "syncbn",
                    call.path,
                    sev,
                    {"world_size": world},
                    {"warning": "a process group of one", "source": _SYNC_SOURCE},
                    "SyncBatchNorm over a single process is BatchNorm plus a collective per forward"
                    + ("" if world else " (pass world_size= to check the per-rank batches)"),
                    fix_one,
                )
            )
            continue
        sizes = _split(n, world)
        measured = {"world_size": world, "batch": n, "per_rank": sizes}
        threshold = {"warning": "unequal per-rank batches, or a rank with none", "source": _SYNC_SOURCE}
        loader = "sampler = torch.utils.data.DistributedSampler(dataset, drop_last=True)  # equal shards, full batches"
        if min(sizes) == 0:
            reason = (
                f"a batch of {n} over {world} ranks leaves {sizes.count(0)} rank(s) without samples: each still joins "
                "every all-gather (torch's and normscope's SyncBatchNorm accept an empty batch), so a rank that "
                "skips the step instead leaves the others waiting"
            )
        elif len(set(sizes)) > 1:
            reason = (
                f"per-rank batches {sizes} differ: uneven shards are where ranks end up running different numbers of "
                "steps, and a rank waiting in SyncBatchNorm's all-gather for one that finished hangs"
            )
        else:
            continue
        out.append(Finding("syncbn", call.path, "warning", measured, threshold, reason, loader))
    return out


#: every check, by its stable identifier, in the order they run
CHECKS: dict[str, Callable[[Context], list[Finding]]] = {
    "bn-elements": bn_elements,
    "train-eval-drift": train_eval_drift,
    "padding": padding,
    "frozen-bn-updating": frozen_bn_updating,
    "half-overflow": half_overflow,
    "eps-underflow": eps_underflow,
    "cancellation": cancellation,
    "dead-channels": dead_channels,
    "bias-before-norm": bias_before_norm,
    "post-ln": post_ln,
    "casting-order": casting_order,
    "batch-invariance": batch_invariance,
    "syncbn": syncbn,
}
