"""Running a diagnosis: :func:`doctor`, and the fix for train/eval drift, :func:`recalibrate`."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..modules import PowerNorm
from ._finding import Finding
from ._observe import Call, Recorder, Snapshot, cut_first, is_norm, norm_scope
from ._report import Report
from .checks import CHECKS, Context

__all__ = ["doctor", "recalibrate"]


def _describe(v: Any) -> str:
    if isinstance(v, Tensor):
        return f"{str(v.dtype).replace('torch.', '')}{list(v.shape)}"
    return type(v).__name__


def _first_tensor(inputs: tuple, kwargs: dict) -> Tensor | None:
    for v in (*inputs, *kwargs.values()):
        if isinstance(v, Tensor) and v.dim() > 0:
            return v
    return None


def _running(model: nn.Module) -> dict[str, tuple[Tensor | None, Tensor | None, Tensor | None]]:
    out = {}
    for path, m in model.named_modules():
        if isinstance(m, nn.modules.batchnorm._NormBase):
            out[path] = tuple(
                None if t is None else t.detach().clone()
                for t in (m.running_mean, m.running_var, m.num_batches_tracked)
            )
    return out


def _resolve_mask(mask: Tensor | None) -> Tensor | None:
    """``mask=`` as (B, S) bool, True = a real position (the masks the model's modules receive are found
    by the recorder: see normscope.doctor._masks)."""
    if mask is None:
        return None
    if not isinstance(mask, Tensor) or mask.dim() != 2:
        got = f"{mask.dtype} of shape {tuple(mask.shape)}" if isinstance(mask, Tensor) else type(mask).__name__
        raise ValueError(f"doctor: expected `mask` to be a (batch, positions) tensor, True = real, got {got}")
    return mask.bool()


#: the seed of every forward the doctor runs (dropout gets the same masks in each)
_SEED = 0


def _forward(model: nn.Module, inputs: tuple, kwargs: dict) -> Any:
    return model(*inputs, **kwargs)


def _first_output(y: Any) -> Tensor | None:
    if isinstance(y, Tensor):
        return y
    if isinstance(y, dict):
        y = list(y.values())
    if isinstance(y, (list, tuple)):
        return next((t for t in map(_first_output, y) if t is not None), None)
    return None


def _mode_outputs(model: nn.Module, inputs: tuple, kwargs: dict, main: Any) -> tuple[Tensor, Tensor] | None:
    """The model's output with its running-statistics norms in training mode, then in eval mode;
    every other module keeps its mode, and the same seed as the diagnosed forward gives dropout the
    same masks. Where every such norm already ran in one mode, ``main`` (that forward's output) is
    that mode's output and only the other forward runs."""
    norms = [
        m
        for m in model.modules()
        if isinstance(m, nn.modules.batchnorm._NormBase) and getattr(m, "running_mean", None) is not None
    ]
    if not norms:
        return None
    modes = {m.training for m in norms}
    outs = []
    for training in (True, False):
        if modes == {training}:
            y = _first_output(main)
        else:
            for m in norms:
                m.training = training
            torch.manual_seed(_SEED)
            with torch.no_grad():
                y = _first_output(_forward(model, inputs, kwargs))
        if y is None or not y.is_floating_point():
            return None
        outs.append(y.detach().clone())
    return outs[0], outs[1]


def doctor(
    model: nn.Module,
    *inputs: Any,
    mask: Tensor | None = None,
    world_size: int | None = None,
    checks: Iterable[str] | None = None,
    progress: Callable[[str], None] | None = None,
    **kwargs: Any,
) -> Report:
    """Diagnose ``model``'s normalization layers on a real batch: ``model(*inputs, **kwargs)``.

    One forward in the model's own mode, with hooks on every module, records what each norm sees --
    its inputs copied before it runs and its output when it returns, so in-place code after it cannot
    change them (the memory of one more copy of every norm's input and output) -- and the padding masks
    every module receives; the checks (:data:`normscope.doctor.CHECKS`) measure it. Some checks run
    more: the model with its BatchNorms in train and then eval mode (two forwards,
    ``train-eval-drift``), the model on the batch and on its first sample alone (two forwards,
    ``batch-invariance``), copies of norm layers on probe inputs (``cancellation``), and the model once
    more without the biases a norm would remove (``bias-before-norm``: the output must not change, so
    the bias feeds nothing else). The model's
    parameters and buffers (the same tensor objects, bit for bit), gradients, ``requires_grad`` and
    ``training`` flags, its other plain attributes, and the random number generators (torch, CUDA,
    ``random``, NumPy) are put back afterwards, also when the forward raises.

    Run it in the mode you train in: the batch-size and frozen-statistics checks look at the layers
    that use batch statistics in this forward.

    Args:
        model: any ``nn.Module``.
        *inputs: the positional inputs of one forward (one device's batch unless ``world_size``
            says otherwise).
        mask: (batch, positions) bool, True = a real position, for the padding check. Default: the
            padding masks the model's modules receive (``attention_mask``, 1 = real, in its 2-D form
            and the 3-D/4-D forms transformers builds; ``*_padding_mask``, True = pad), each norm
            using the one that fits its positions.
        world_size: the number of data-parallel processes the batch is split over (as
            ``torch.tensor_split`` cuts it): a BatchNorm then sees one rank's share, a SyncBatchNorm
            all of it. Default: None (one process).
        checks: the identifiers to run. Default: all.
        progress: called with a short line as each stage starts (the CLI prints them).
        **kwargs: keyword inputs of the forward.

    Returns:
        a :class:`~normscope.doctor.Report`.

    Example::

        >>> model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8))
        >>> report = normscope.doctor(model, torch.randn(2, 3, 8, 8))
        >>> [f.check for f in report.findings if f.severity == "error"]
        ['bn-elements']
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"doctor: expected `model` to be a torch.nn.Module, got {type(model).__name__}")
    if world_size is not None and (not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1):
        raise ValueError(f"doctor: expected `world_size` to be a positive int or None, got {world_size!r}")
    if isinstance(checks, str):
        raise TypeError(f"doctor: expected `checks` to be a list of check names, got the string {checks!r}")
    names = list(CHECKS) if checks is None else list(checks)
    unknown = [n for n in names if n not in CHECKS]
    if unknown:
        raise ValueError(f"doctor: expected `checks` from {list(CHECKS)}, got unknown {unknown}")
    mask = _resolve_mask(mask)
    say = progress or (lambda line: None)
    start = time.perf_counter()
    x0 = _first_tensor(inputs, kwargs)
    batch = int(x0.shape[0]) if x0 is not None else None
    snapshot = Snapshot(model)
    recorder = None
    try:
        before = _running(model)
        say(f"forward with hooks on {sum(1 for _ in model.modules())} modules")
        recorder = Recorder(model, batch)
        # autograd's graph shows where residual adds meet norms (post-ln); it needs a parameter
        # that requires grad, and costs the memory of one training forward
        grad_graph = "post-ln" in names and any(p.requires_grad for p in model.parameters())
        torch.manual_seed(_SEED)
        try:
            with torch.set_grad_enabled(grad_graph):
                main = _forward(model, inputs, kwargs)
        except ValueError:
            # torch's "Expected more than 1 value per channel when training" is the bn-elements
            # finding at its extreme: report it rather than the traceback; anything else is the
            # model's own error
            if recorder.single_value is None or "bn-elements" not in names:
                raise
            return _single_value_report(model, recorder.single_value, names, inputs, kwargs, world_size, start)
        recorder.close()
        after = _running(model)
        probes: dict = {}
        norms = _norm_calls(recorder.ordered(), probes)
        # the forward may have moved running statistics; the checks that run modules again start
        # from the state the user had
        snapshot.restore()

        def mode_outputs() -> tuple[Tensor, Tensor] | None:
            say("forward with BatchNorms in train mode and in eval mode")
            try:
                return _mode_outputs(model, inputs, kwargs, main)
            finally:
                snapshot.restore()

        def output_with(tensors: dict[str, Tensor]) -> tuple[Tensor, Tensor] | None:
            # (the diagnosed forward's output, the output with these parameters/buffers replaced), same
            # seed and modes; the model's own tensors are not touched (functional_call) and the state a
            # forward moves is put back
            y = _first_output(main)
            if y is None or not y.is_floating_point():
                return None
            torch.manual_seed(_SEED)
            try:
                with torch.no_grad():
                    other = _first_output(torch.func.functional_call(model, tensors, inputs, kwargs))
            finally:
                snapshot.restore()
            return (y.detach(), other) if other is not None and other.shape == y.shape else None

        def sample_pair() -> tuple[list[Call], list[Call]] | str:
            say("forward on the batch and on its first sample alone")
            try:
                return _sample_pair(model, inputs, kwargs, batch)
            finally:
                snapshot.restore()

        def call_alone(call: Call) -> Any:
            # one module on the first sample's inputs it received in the batch, in the mode of the pair
            try:
                _pair_mode(model)
                call.module.training = call.training
                torch.manual_seed(_SEED)
                with torch.no_grad():
                    return call.module(*call.sample[0], **call.sample[1])
            finally:
                snapshot.restore()

        ctx = Context(
            model,
            batch,
            norms,
            before,
            after,
            mask,
            world_size,
            mode_outputs,
            grad_graph,
            probes,
            masks=recorder.masks,
        )
        ctx.output_with = output_with
        ctx.sample_pair = sample_pair
        ctx.call_alone = call_alone
        findings = []
        for name in names:
            say(f"check {name}")
            findings.extend(CHECKS[name](ctx))
    finally:
        if recorder is not None:
            recorder.close()
        snapshot.restore()
    checks_run = {n: {"ran": n not in ctx.notes, "note": ctx.notes.get(n, "")} for n in names}
    return Report(
        findings,
        checks_run,
        model=type(model).__name__,
        inputs=[_describe(v) for v in inputs] + [f"{k}={_describe(v)}" for k, v in kwargs.items()],
        world_size=world_size,
        seconds=time.perf_counter() - start,
        series=ctx.series,
        layers=[(c.path, type(c.module).__name__) for c in norms],
    )


def _norm_calls(calls: list[Call], probes: dict) -> list[Call]:
    """Each norm's first call (a module called again -- shared, recurrent -- speaks by its first), in
    forward order, with its scope in ``extra["scope"]`` and its normalized input first in ``args``;
    norms whose layout the doctor does not know are left out."""
    norms, seen = [], set()
    for call in calls:
        if call.path in seen or not call.args and not call.kwargs:
            continue
        seen.add(call.path)
        x = next((a for a in call.args if isinstance(a, Tensor)), None)
        scope = None if x is None else norm_scope(call.module, x, probes)
        if scope is None:
            continue
        call.args = (x, *call.args[1:]) if call.args[0] is x else (x,)
        call.extra["scope"] = scope
        norms.append(call)
    return norms


def _pair_mode(model: nn.Module) -> None:
    """The modes of the batch-invariance forwards: every module in eval mode (no dropout, whether a
    module or ``F.dropout(..., training=self.training)`` inside one) but the norms, and of those the
    BatchNorm-type ones with running statistics in eval too -- in training they mix the batch by design
    (the check says so apart), and in eval each sample stands alone, so that a module after them that
    mixes the batch can still be found."""
    for m in model.modules():
        if not is_norm(m):
            m.training = False
        elif isinstance(m, nn.modules.batchnorm._BatchNorm) and m.running_mean is not None or isinstance(m, PowerNorm):
            m.training = False


def _sample_pair(model: nn.Module, inputs: tuple, kwargs: dict, batch: int) -> tuple[list[Call], list[Call]] | str:
    """Every module call's first sample (inputs and output) in a forward on the batch, and in one on the
    first sample alone, both in :func:`_pair_mode` with the same seed; a string saying why where the
    model refuses the sample alone."""
    _pair_mode(model)
    recorded = []
    for n, (args, kw) in ((batch, (inputs, kwargs)), (1, (cut_first(inputs, batch), cut_first(kwargs, batch)))):
        rec = Recorder(model, n, norms=False, samples=True, masks=False)
        torch.manual_seed(_SEED)
        try:
            with torch.no_grad():
                _forward(model, args, kw)
        except (RuntimeError, ValueError) as e:
            if n == batch:
                raise
            return f"the model refused its first sample alone: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
        finally:
            rec.close()
        recorded.append(rec.ordered())
    return recorded[0], recorded[1]


def _single_value_report(model, where, names, inputs, kwargs, world_size, start) -> Report:
    """The report of a forward that stopped at a BatchNorm given one value per channel."""
    from .checks import _BN_SOURCE, BN_ELEMENTS_ERROR, BN_ELEMENTS_WARNING

    path, shape = where
    finding = Finding(
        "bn-elements",
        path,
        "error",
        {"elements": 1, "input_shape": list(shape)},
        {"warning_below": BN_ELEMENTS_WARNING, "error_below": BN_ELEMENTS_ERROR, "source": _BN_SOURCE},
        f'one value per channel (input {list(shape)}): torch refuses to train this BatchNorm ("Expected more than 1 '
        'value per channel when training") and the forward stopped here, so no other check ran',
        f"model, _ = normscope.convert(model, to='group:1', where=lambda name, m: name == {path!r})",
    )
    note = f"the forward stopped at {path}: one value per channel"
    checks = {n: {"ran": n == "bn-elements", "note": "" if n == "bn-elements" else note} for n in names}
    return Report(
        [finding],
        checks,
        model=type(model).__name__,
        inputs=[_describe(v) for v in inputs] + [f"{k}={_describe(v)}" for k, v in kwargs.items()],
        world_size=world_size,
        seconds=time.perf_counter() - start,
    )


def _batchnorms(model: nn.Module) -> list[nn.Module]:
    return [
        m
        for m in model.modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.running_mean is not None and m.running_var is not None
    ]


class _Population:
    """One BatchNorm's population statistics over every call it gets, per channel, in float64: the element
    count, the mean and the sum of squared deviations from it (M2), merged call by call with Chan, Golub &
    LeVeque's pairwise update -- each call weighted by the elements it contributes to each statistic. A
    call's own statistics are over its valid elements (``mask``, as normscope's BatchNorms take it) and, for
    a SyncBatchNorm in a process group, over every rank's (all-reduced)."""

    def __init__(self, m: nn.Module) -> None:
        c = m.num_features
        self.module = m
        self.n = torch.zeros(c, dtype=torch.float64, device=m.running_mean.device)
        self.mean = torch.zeros_like(self.n)
        self.m2 = torch.zeros_like(self.n)

    def __call__(self, m: nn.Module, args: tuple, kwargs: dict) -> None:
        x = args[0].detach().double()
        c = getattr(m, "channel_dim", 1) % x.dim()
        mask = args[1] if len(args) > 1 else kwargs.get("mask")
        rows = x.movedim(c, 0).reshape(x.shape[c], -1)
        valid = None if mask is None else mask.unsqueeze(c).expand_as(x).movedim(c, 0).reshape(x.shape[c], -1)
        weights = torch.ones_like(rows) if valid is None else valid.to(rows.dtype)
        n, total = weights.sum(1), (rows * weights).sum(1)
        group = self._group(m)
        if group is not None:
            both = torch.stack([n, total])
            dist.all_reduce(both, group=group)
            n, total = both.unbind(0)
        mean = total / n.clamp_min(1)
        m2 = ((rows - mean[:, None]).square() * weights).sum(1)
        if group is not None:
            dist.all_reduce(m2, group=group)
        n, mean, m2 = n.to(self.n.device), mean.to(self.n.device), m2.to(self.n.device)
        # Chan et al.: merge (n_a, mean_a, M2_a) and (n_b, mean_b, M2_b) exactly
        total_n = self.n + n
        delta = mean - self.mean
        share = torch.where(total_n > 0, n / total_n.clamp_min(1), torch.zeros_like(n))
        self.m2 += m2 + delta.square() * self.n * share
        self.mean += delta * share
        self.n = total_n

    @staticmethod
    def _group(m: nn.Module):
        from ..modules import SyncBatchNorm

        if not isinstance(m, (nn.SyncBatchNorm, SyncBatchNorm)) or not (dist.is_available() and dist.is_initialized()):
            return None
        group = m.process_group or dist.group.WORLD
        return group if dist.get_world_size(group) > 1 else None


def recalibrate(model: nn.Module, batches: Iterable[Any]) -> nn.Module:
    """Set every BatchNorm's running statistics to the population statistics of ``batches``.

    The mean and the variance of all the batches' elements together, per channel -- each batch weighted
    by the elements it contributes to each statistic (a mask's valid elements, for normscope's masked
    BatchNorms; every rank's, for a SyncBatchNorm in a process group) -- computed in float64 and written
    as torch's running statistics are (the unbiased variance). This is fvcore's ``update_bn_stats``
    (Wu & Johnson 2021, "Rethinking 'Batch' in BatchNorm"): averaging each batch's variance instead, as
    fvcore's first PreciseBN did, misses the spread between the batches' means and under-estimates the
    variance the model meets in evaluation.

    The BatchNorms run in training mode during the passes (each later layer sees what it sees in
    training, as in fvcore), every other module in its own mode (dropout off in an eval model);
    afterwards each BatchNorm's mode, momentum and ``num_batches_tracked`` are as before. A BatchNorm
    that no batch reaches keeps its statistics. Runs without gradients. In place; returns ``model``.

    Args:
        model: the model.
        batches: an iterable of inputs, each a tensor, a tuple/list of positional inputs, or a
            dict of keyword inputs -- a few training batches (fvcore uses 200).

    Example::

        >>> model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8)).eval()
        >>> model = normscope.recalibrate(model, [torch.randn(4, 3, 8, 8) for _ in range(3)])
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"recalibrate: expected `model` to be a torch.nn.Module, got {type(model).__name__}")
    if isinstance(batches, Tensor):
        raise TypeError(
            "recalibrate: expected `batches` to be an iterable of batches (a list of tensors, a "
            f"DataLoader), got one tensor of shape {tuple(batches.shape)}; wrap it: [x]"
        )
    bns = _batchnorms(model)
    if not bns:
        return model
    saved = [
        (m, m.training, m.momentum, None if m.num_batches_tracked is None else m.num_batches_tracked.clone())
        for m in bns
    ]
    populations = [_Population(m) for m in bns]
    handles = [m.register_forward_pre_hook(p, with_kwargs=True) for m, p in zip(bns, populations)]
    n = 0
    try:
        for m in bns:
            m.train()
            m.momentum = 1.0  # the training-mode forward normalizes with this batch's statistics
        with torch.no_grad():
            for batch in batches:
                if isinstance(batch, dict):
                    model(**batch)
                elif isinstance(batch, (tuple, list)):
                    model(*batch)
                else:
                    model(batch)
                n += 1
        if n == 0:
            raise ValueError("recalibrate: expected `batches` to hold at least one batch, got none")
    finally:
        for h in handles:
            h.remove()
        for m, training, momentum, nbt in saved:
            m.train(training)
            m.momentum = momentum
            if nbt is not None:
                m.num_batches_tracked.copy_(nbt)
    with torch.no_grad():
        for m, p in zip(bns, populations):
            if bool((p.n > 0).all()):
                m.running_mean.copy_(p.mean)
                m.running_var.copy_(p.m2 / (p.n - 1).clamp_min(1))  # torch's running variance is unbiased
    return model
