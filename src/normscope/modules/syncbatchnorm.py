"""SyncBatchNorm: BatchNorm whose statistics are those of the *global* batch across processes.

Paper: Ioffe & Szegedy 2015 (BatchNorm); synchronized statistics as in Peng et al. 2018,
"MegDet: A Large Mini-Batch Object Detector". Scope: :meth:`normscope.Scope.batch`, with the
reduction extended over every rank of a ``torch.distributed`` process group.

It is the engine's two steps with a collective in between: :func:`normscope.reference.moments`
gives each rank its local per-channel ``(count, mean, M2)``, one ``all_gather`` exchanges them,
Chan et al.'s parallel formula combines them, and :func:`normscope.reference.apply` normalizes.
The backward needs two global per-channel sums (``sum dy`` and ``sum dy * x_hat``), exchanged in
one ``all_reduce``. So: one collective per forward (two on a layer's first step, which also
checks that every rank has the same channel count) and one per backward, on any backend
(gloo on CPU, NCCL on GPU). Unmasked fp32/fp64 inputs run the same steps on ATen's fused
BatchNorm kernels instead of the reference (see :class:`_SyncBatchNormFn`).

Why gather ``(count, mean, M2)`` instead of all-reducing ``(count, sum x, sum x^2)`` as torch's
CUDA kernels do: ``E[x^2] - E[x]^2`` cancels catastrophically when ``|mean| >> std`` (an input with
mean 1e4 and std 1e-2 loses every digit of its variance in fp32). Each rank's ``M2`` is a two-pass
sum of squared deviations from its *own* mean, and Chan's combination

    n = sum n_r,   mean = sum n_r mean_r / n,   M2 = sum M2_r + sum n_r (mean_r - mean)^2

adds only non-negative terms. The payload is ``world * 4 * C`` numbers (with a has-mask flag), exchanged in fp64 so that
counts above 2^24 stay exact -- smaller than one activation row.

Limits: every rank of the group must call ``forward`` (and ``backward``) the same number of times,
as with any collective; ranks with different channel counts all raise ValueError on the first
step. A rank that fails or never arrives makes the others raise once the process group's
``timeout`` expires (or at once when its connection drops); the error says which collective of
which layer failed.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from .. import _checks as check
from .. import hot
from .. import reference as ref
from ..engine import Call, Running, update_running
from ..scope import Resolved, Scope
from .batchnorm import LAYER_OP, momentum_factor

__all__ = ["SyncBatchNorm"]

_BATCH = Scope.batch(1)


def _group_size(group) -> int:
    """World size of ``group`` when synchronization applies, else 1."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def _collective_failed(what: str, group, err: Exception) -> RuntimeError:
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    return RuntimeError(
        f"SyncBatchNorm: the {what} across the process group failed on rank {rank} of {world} "
        f"(another rank probably raised, exited, or skipped this layer's forward/backward; every rank "
        f"must call it the same number of times): {type(err).__name__}: {err}"
    )


def _channels(t: Tensor, c: int) -> Tensor:
    return t.reshape(c) if t.numel() == c else t.expand(1, c).reshape(c)


def _local_moments(x: Tensor, s: Resolved, mask: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """Per-channel local (count, mean, M2) in fp64, each of shape (C,)."""
    c = x.shape[1]
    if x.numel() == 0:  # an empty local batch contributes nothing (var_mean of nothing is NaN)
        z = torch.zeros(c, dtype=torch.float64, device=x.device)
        return z, z.clone(), z.clone()
    m = ref.moments(x, s, mask)
    count = m.count if isinstance(m.count, Tensor) else torch.full_like(m.mean, float(m.count))
    count, mean, var = (_channels(t, c).double() for t in (count, m.mean, m.var))
    return count, mean, var * count


def _local_sums(x: Tensor, dims: tuple[int, ...]) -> tuple[Tensor, Tensor]:
    """Unmasked per-channel local (mean, M2) in fp64: corrected two-pass from ``sum``, each (C,).

    Three cascade-summed reductions and one centred temporary: on a CPU about twice as fast as
    ``batch_norm_update_stats`` (benchmarks/syncbn.py), and as exact (Chan-Golub-LeVeque: the
    deviations' own mean corrects the rounding of the first).
    """
    c = x.shape[1]
    if x.numel() == 0:  # an empty local batch contributes nothing
        z = torch.zeros(c, dtype=torch.float64, device=x.device)
        return z, z.clone()
    n = x.numel() // c
    mean0 = x.sum(dims, keepdim=True) / n
    d = x - mean0  # the one full-size temporary, squared in place below (a second one: 1.2 ms, not 0.7)
    shift = d.sum(dims) / n
    m2 = d.square_().sum(dims).double() - n * shift.double().square()
    return mean0.reshape(c).double() + shift.double(), m2.clamp_min(0)


def _gather_combine(local: Tensor, world: int, group, name: str, x: Tensor, masked: bool) -> tuple[Tensor, ...]:
    """All-gather every rank's (count, mean, M2, has-mask) and combine them (Chan et al.): global
    n, mean, var (fp64, (C,))."""
    c = local.shape[1]
    flag = torch.full((1, c), float(masked), dtype=local.dtype, device=local.device)
    local = torch.cat((local, flag))  # (4, C): count, mean, M2, and whether this rank has a mask
    gathered = torch.empty((world, 4, c), dtype=local.dtype, device=local.device)
    try:
        dist.all_gather(list(gathered.unbind(0)), local, group=group)
    except RuntimeError as err:  # a backend error (DistBackendError is one) means a peer is gone
        raise _collective_failed(f"all_gather of batch statistics in {name}.forward", group, err) from err
    n_r, mean_r, m2_r, masked_r = gathered.unbind(1)  # (world, C) each
    n = n_r.sum(0)
    # every rank decides from the same gathered numbers, so every rank raises (or none does): a
    # rank's own mask must not change the rule, or a rank with an empty masked batch would wait
    # in the backward for a peer that raised
    if bool(masked_r.any()):
        if bool((n == 0).any()):
            raise ValueError(
                f"{name}: expected at least one valid (True) element in `mask` in the global batch when "
                f"training, got none (local input shape {tuple(x.shape)}, world size {world})"
            )
    elif bool((n <= 1).any()):
        raise ValueError(
            f"{name}: expected more than 1 value per channel in the global batch when training, got "
            f"{int(n.min())} (local input shape {tuple(x.shape)}, world size {world})"
        )
    mean = (n_r * mean_r).sum(0) / n.clamp_min(1)
    m2 = m2_r.sum(0) + (n_r * (mean_r - mean).square()).sum(0)
    return n, mean, m2 / n.clamp_min(1)


def _check_peers(c: int, group, world: int, name: str, device: torch.device) -> None:
    """Exchange a fixed-size header (the channel count) before the first payload of a layer.

    The payloads are ``C`` wide; ranks that disagree on ``C`` would all_gather buffers of
    different sizes, which gloo answers with an abort on one rank and garbage on another. A header
    of one number per rank has the same size everywhere, so every rank sees every channel count
    and raises the same ValueError. ``C`` is a layer's constant (``num_features``), so one exchange
    per layer suffices; dtypes may differ between ranks (payloads are exchanged in fp64).
    """
    header = torch.tensor([c], dtype=torch.int64, device=device)
    gathered = torch.empty((world, 1), dtype=torch.int64, device=device)
    try:
        dist.all_gather(list(gathered.unbind(0)), header, group=group)
    except RuntimeError as err:  # as above
        raise _collective_failed(f"all_gather of channel counts in {name}.forward", group, err) from err
    counts = gathered[:, 0].tolist()
    if len(set(counts)) > 1:
        raise ValueError(
            f"{name}: expected the same number of channels on every rank of the process group, got "
            f"{', '.join(f'rank {r}: {n}' for r, n in enumerate(counts))} (this is rank {dist.get_rank(group)})"
        )


def _all_reduce(sums: Tensor, group, name: str) -> None:
    try:
        dist.all_reduce(sums, group=group)
    except RuntimeError as err:  # as above
        raise _collective_failed(f"all_reduce of gradient sums in {name}.backward", group, err) from err


def _fast(x: Tensor, mask: Tensor | None, weight: Tensor | None) -> bool:
    """The common case runs on ATen's fused BatchNorm kernels (see _SyncBatchNormFn)."""
    return mask is None and x.dtype in (torch.float32, torch.float64) and (weight is None or weight.dtype == x.dtype)


class _SyncBatchNormFn(torch.autograd.Function):
    """BatchNorm over the union of every rank's batch: forward and its exact backward.

    Two implementations of the same math. The readable one (masks, half precision) is the
    reference's ``moments`` and ``apply`` with the global statistics in between. The fast one
    (no mask, fp32/fp64) uses ATen's fused kernels the same way: three ``sum`` reductions for
    the local moments (:func:`_local_sums`), and BatchNorm in *evaluation* mode, whose "running"
    statistics are the global ones, for the apply; in the backward, ``native_batch_norm_backward``
    gives the two local sums only (one read of dy and x), the global-statistics correction
    ``c1 * x_hat + c2`` is one eval-mode BatchNorm (it subtracts the mean before scaling, so it keeps
    the reference's robustness to a large mean), and ``dy * w * rstd`` is added to it in place.
    """

    @staticmethod
    def forward(ctx, x, mask, weight, bias, eps, group, world, running, name, start):
        s = _BATCH.resolve(tuple(x.shape))
        c, shape = x.shape[1], s.stat_shape
        fast = _fast(x, mask, weight)
        if fast:
            count = torch.full((c,), float(x.numel() // max(c, 1)), dtype=torch.float64, device=x.device)
            local = torch.stack((count, *_local_sums(x, s.reduce)))
        else:
            local = torch.stack(_local_moments(x, s, mask))  # (3, C): the one payload of the forward
        n, gmean, gvar = _gather_combine(local, world, group, name, x, mask is not None)
        if start is not None:  # the layer's batch count: once the collective succeeded, before the state moves
            start()

        acc = x.dtype if fast else ref.acc_dtype(x.dtype)
        n_b, mean_b, var_b = (t.to(acc).reshape(shape) for t in (n, gmean, gvar))
        if running is not None:
            update_running(Call(x, s, None, None, eps, mask, running), ref.Moments(mean_b, var_b, n_b))
        ctx.group, ctx.name, ctx.has_bias, ctx.fast, ctx.eps = group, name, bias is not None, fast, eps
        if fast:
            mean, var = mean_b.reshape(c), var_b.reshape(c)
            y = torch.batch_norm(x, weight, bias, mean, var, False, 0.0, eps, _cudnn()) if x.numel() else x.clone()
            ctx.save_for_backward(x, weight, mean, var, n_b.reshape(c))
            return y
        rstd = ref.rstd(var_b, eps, n_b)
        # weight folded into rstd: one multiply fewer on the big tensor, same affine map
        scale = rstd if weight is None else rstd * weight.to(acc).reshape(shape)
        y = ref.apply(x, mean_b, scale, s, None, bias)
        ctx.save_for_backward(x, mask, weight, mean_b, rstd, n_b)
        return y

    @staticmethod
    def backward(ctx, dy):
        # y = x_hat * w + b with x_hat = (x - mean) * rstd at *every* position, while mean and rstd
        # come from the valid positions of every rank. Differentiating through mean and rstd:
        #   dx = rstd * w * (dy - valid / n * (sum dy + x_hat * sum dy * x_hat))
        # where both sums run over all positions of all ranks: the backward's one all_reduce.
        # The local sums are this rank's bias/weight gradients; DDP then averages them across
        # ranks as for every other parameter (torch.nn.SyncBatchNorm does the same).
        if ctx.fast:
            return _SyncBatchNormFn._backward_fast(ctx, dy)
        x, mask, weight, mean, rstd, n = ctx.saved_tensors
        s = _BATCH.resolve(tuple(x.shape))
        c, dims, shape = x.shape[1], s.reduce, s.stat_shape
        acc = mean.dtype
        dyf, xhat = dy.to(acc), (x.to(acc) - mean) * rstd
        sum_dy = dyf.sum(dims)
        sum_dy_xhat = (dyf * xhat).sum(dims)
        sums = torch.cat((sum_dy, sum_dy_xhat)).double()  # fp64 on every rank and path: one layout
        grad_weight = sum_dy_xhat.to(weight.dtype) if weight is not None and ctx.needs_input_grad[2] else None
        grad_bias = sum_dy.to(dy.dtype) if ctx.has_bias and ctx.needs_input_grad[3] else None
        _all_reduce(sums, ctx.group, ctx.name)
        sums = sums.to(acc)
        g_dy, g_dyx = sums[:c].reshape(shape), sums[c:].reshape(shape)
        valid = 1.0 if mask is None else mask.to(acc)
        scale = rstd if weight is None else rstd * weight.to(acc).reshape(shape)
        dx = scale * (dyf - valid / n.clamp_min(1) * (g_dy + xhat * g_dyx))
        return dx.to(x.dtype), None, grad_weight, grad_bias, None, None, None, None, None, None

    @staticmethod
    def _backward_fast(ctx, dy):
        x, weight, mean, var, n = ctx.saved_tensors
        c, eps = x.shape[1], ctx.eps
        if x.numel():
            # the two local sums only (no dx yet): one read of dy and x
            _, sum_dy_xhat, sum_dy = torch.ops.aten.native_batch_norm_backward(
                dy, x, weight, mean, var, None, None, False, eps, [False, True, True]
            )
        else:  # ATen's kernel does not accept an empty batch; this rank still joins the all_reduce
            sum_dy = sum_dy_xhat = torch.zeros(c, dtype=x.dtype, device=x.device)
        # fp64 whatever the input dtype: ranks may run different paths (a mask, bf16 on one rank),
        # and an all_reduce whose ranks disagree on the dtype corrupts memory in gloo
        sums = torch.cat((sum_dy, sum_dy_xhat)).double()
        grad_weight = sum_dy_xhat.clone() if weight is not None and ctx.needs_input_grad[2] else None
        grad_bias = sum_dy.clone() if ctx.has_bias and ctx.needs_input_grad[3] else None
        _all_reduce(sums, ctx.group, ctx.name)
        sums = sums.to(x.dtype)
        if not x.numel():
            return torch.zeros_like(x), None, grad_weight, grad_bias, None, None, None, None, None, None
        # dx = w * rstd * dy + c1 * x_hat + c2 with the global sums: the x_hat part is an
        # evaluation-mode BatchNorm (it centres x before scaling), then dy is added in place
        w_rstd = torch.rsqrt(var + eps) if weight is None else weight * torch.rsqrt(var + eps)
        c1, c2 = -w_rstd * sums[c:] / n, -w_rstd * sums[:c] / n
        dx = torch.batch_norm(x, c1, c2, mean, var, False, 0.0, eps, _cudnn())
        view = [1] * x.dim()
        view[1] = c
        return dx.addcmul_(dy, w_rstd.view(view)), None, grad_weight, grad_bias, None, None, None, None, None, None


def _cudnn() -> bool:
    return torch.backends.cudnn.enabled


class SyncBatchNorm(_BatchNorm):
    r"""Batch Normalization with statistics over the batch of every process in a group.

    .. math:: y = \frac{x - \mathrm{E}[x]}{\sqrt{\mathrm{Var}[x] + \epsilon}} \gamma + \beta

    with mean and biased variance per channel over the *concatenation* of every rank's batch (and
    positions). Same arguments, buffers and state_dict as :class:`torch.nn.SyncBatchNorm`, and like
    it a subclass of torch's ``_BatchNorm`` (so ``isinstance`` checks for BatchNorm layers, torch's
    ``convert_sync_batchnorm`` and :func:`normscope.freeze_batchnorm` see it) but deliberately *not*
    of ``torch.nn.SyncBatchNorm``: ``DistributedDataParallel`` refuses every instance of that class
    on CPU ("SyncBatchNorm layers only work with GPU modules", a limit of torch's CUDA-only
    kernels, not of this layer). Unlike torch's it runs on CPU (gloo) as well as GPU (NCCL), inside
    DDP or not, and is exact when ranks hold different batch sizes, masks, or an empty batch: output,
    input gradient and running statistics (unbiased with the global count) equal BatchNorm on the
    concatenated batch, and the per-rank weight/bias gradients sum to BatchNorm's (DDP averages
    them as usual). One ``all_gather`` of ``4 * C`` numbers per forward, one ``all_reduce`` of
    ``2 * C`` per backward; see the module docstring for the numerics.

    Outside an initialized process group, or with world size 1, it is :class:`normscope.BatchNorm2d`
    (any rank). In evaluation it uses the running statistics and communicates nothing; without
    running statistics it then uses the local batch's, as torch does.

    Args:
        num_features: number of channels C (dim 1 of the input).
        eps: added to the variance. Default: 1e-5.
        momentum: running-statistics update factor; None for a cumulative average. Default: 0.1.
        affine: learnable per-channel ``weight`` and ``bias``. Default: True.
        track_running_stats: keep ``running_mean``/``running_var``. Default: True.
        process_group: the group to synchronize over; None for the default (world). Default: None.

    Shape:
        - Input: (N, C, *), N may differ between ranks and may be 0. Output: same shape.
        - mask (optional): bool, the input's shape without dim 1; True marks valid positions, the
          only ones counted in the statistics (all positions are still normalized).

    Example::

        >>> model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8))
        >>> model = normscope.SyncBatchNorm.convert_sync_batchnorm(model)
        >>> type(model[1]).__name__
        'SyncBatchNorm'
        >>> # then, in each process after dist.init_process_group("gloo" or "nccl", ...): y = model(x)
    """

    # whether this layer's ranks have confirmed they agree on the channel count (_check_peers);
    # a class attribute: not state, not in __dict__ until the first synchronized step
    _peers_checked: bool = False

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        process_group: Any | None = None,
        device=None,
        dtype=None,
        **kw,
    ) -> None:
        # **kw: torch's keyword-only arguments of the running version (``bias=`` since 2.13)
        num_features = check.num_features(num_features, "SyncBatchNorm", affine or track_running_stats)
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device, dtype, **kw)
        self.process_group = process_group

    def _check_input_dim(self, input: Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"{type(self).__name__}: expected at least 2D input (N, C, *), got {input.dim()}D input")

    def forward(self, input: Tensor, mask: Tensor | None = None) -> Tensor:
        name = type(self).__name__
        check.tensor(input, "input", name)
        check.channels_first(input, 2, name)
        if input.shape[1] != self.num_features:
            raise ValueError(
                f"{name}({self.num_features}): expected input with {self.num_features} channels at dim 1, "
                f"got {input.shape[1]} (input shape {tuple(input.shape)})"
            )
        m = check.mask(mask, input, 1, name)
        if type(self.eps) is not float:  # the common case asks no more: a str or None eps set after construction
            check.eps(self.eps, name)  # is refused by name here, not by the comparison below ('>' not supported)
        if self.training and not self.eps > 0:  # F.batch_norm's check, for the synchronized path too
            raise ValueError(f"{name}: expected `eps` > 0 when training (batch statistics normalize), got {self.eps!r}")

        factor = momentum_factor(self)
        use_batch_stats = self.training or (self.running_mean is None and self.running_var is None)
        keep_running = not self.training or self.track_running_stats
        rm = self.running_mean if keep_running else None
        rv = self.running_var if keep_running else None

        group = self.process_group or (dist.group.WORLD if dist.is_available() and dist.is_initialized() else None)
        world = _group_size(group) if self.training else 1
        if world > 1:
            if not self._peers_checked:
                _check_peers(self.num_features, group, world, name, input.device)
                self._peers_checked = True
            running = Running(rm, rv, float(factor), True) if rm is not None and rv is not None else None
            # counted inside the step, once its collective succeeded: counted after the step, a recomputation
            # that activation checkpointing stops early (see below) was not counted
            nbt = self.num_batches_tracked
            start = functools.partial(nbt.add_, 1) if self.track_running_stats and nbt is not None else None
            w, b = self.weight, self.bias
            return _SyncBatchNormFn.apply(input, m, w, b, self.eps, group, world, running, name, start)
        # exactly normscope.BatchNorm*d, masked or not: F.batch_norm's checks too (an all-False mask in
        # training, the parameters' dtypes), before the running statistics move -- the one process is the
        # whole group, so its mask decides alone, as every rank's masks do together above. float(): as the
        # BatchNorm layers pass it (a 0-dim tensor momentum, which torch takes, included)
        running = None
        if rm is not None or rv is not None or not use_batch_stats:  # as F.batch_norm
            running = hot.running((rm, rv, float(factor), use_batch_stats))
        # the batch counts once the call is checked, before it runs, as BatchNorm's (see hot.call): counted
        # after it, a recomputation that activation checkpointing stops early (it raises from a saved-tensor
        # hook, after the running statistics moved) left the count one short of torch's -- and momentum=None's
        # next factor wrong
        nbt = self.num_batches_tracked
        counts = self.training and self.track_running_stats and nbt is not None
        start = functools.partial(nbt.add_, 1) if counts else None
        return hot.call(LAYER_OP, (1,), input, self.weight, self.bias, self.eps, running, mask, start)

    @classmethod
    def convert_sync_batchnorm(cls, module: nn.Module, process_group=None) -> nn.Module:
        """Replace every BatchNorm*d (torch's, normscope's, or torch's SyncBatchNorm) inside
        ``module`` by a :class:`normscope.SyncBatchNorm`, carrying parameters, buffers, the
        training flag and ``requires_grad``. Returns the converted module (``module`` itself is
        returned, modified, unless it is a BatchNorm layer).

        Args:
            module: the model (or a single BatchNorm layer).
            process_group: the group to synchronize over; None for the default. Default: None.
        """
        out = module
        if isinstance(module, _BatchNorm) and type(module) is not cls:
            out = cls(
                module.num_features,
                module.eps,
                module.momentum,
                module.affine,
                module.track_running_stats,
                process_group,
            )
            if module.affine:
                with torch.no_grad():
                    out.weight = module.weight
                    out.bias = module.bias
            out.running_mean = module.running_mean
            out.running_var = module.running_var
            out.num_batches_tracked = module.num_batches_tracked
            out.training = module.training
            if hasattr(module, "qconfig"):
                out.qconfig = module.qconfig
        for child_name, child in module.named_children():
            out.add_module(child_name, cls.convert_sync_batchnorm(child, process_group))
        del module
        return out
