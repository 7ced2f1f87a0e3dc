"""SyncBatchNorm: BatchNorm whose statistics are those of the *global* batch across processes.

Paper: Ioffe & Szegedy 2015 (BatchNorm); synchronized statistics as in Peng et al. 2018,
"MegDet: A Large Mini-Batch Object Detector". Scope: :meth:`normscope.Scope.batch`, with the
reduction extended over every rank of a ``torch.distributed`` process group.

It is the engine's two steps with a collective in between: :func:`normscope.reference.moments`
gives each rank its local per-channel ``(count, mean, M2)``, one ``all_gather`` exchanges them,
Chan et al.'s parallel formula combines them, and :func:`normscope.reference.apply` normalizes.
The backward needs two global per-channel sums (``sum dy`` and ``sum dy * x_hat``), exchanged in
one ``all_reduce``. So: exactly one collective per forward and one per backward, on any backend
(gloo on CPU, NCCL on GPU). Unmasked fp32/fp64 inputs run the same steps on ATen's fused
BatchNorm kernels instead of the reference (see :class:`_SyncBatchNormFn`).

Why gather ``(count, mean, M2)`` instead of all-reducing ``(count, sum x, sum x^2)`` as torch's
CUDA kernels do: ``E[x^2] - E[x]^2`` cancels catastrophically when ``|mean| >> std`` (an input with
mean 1e4 and std 1e-2 loses every digit of its variance in fp32). Each rank's ``M2`` is a two-pass
sum of squared deviations from its *own* mean, and Chan's combination

    n = sum n_r,   mean = sum n_r mean_r / n,   M2 = sum M2_r + sum n_r (mean_r - mean)^2

adds only non-negative terms. The payload is ``world * 3 * C`` numbers, exchanged in fp64 so that
counts above 2^24 stay exact -- smaller than one activation row.

Limits: every rank of the group must call ``forward`` (and ``backward``) the same number of times
with the same number of channels, as with any collective. A rank that fails or never arrives makes
the others raise once the process group's ``timeout`` expires (or at once when its connection
drops); the error says which collective of which layer failed.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from .. import _checks as check
from .. import functional as F
from .. import reference as ref
from ..engine import Call, Running, norm, update_running
from ..scope import Resolved, Scope
from .batchnorm import count_batch, momentum_factor

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
    """All-gather every rank's (count, mean, M2) and combine them (Chan et al.): global n, mean, var (fp64, (C,))."""
    c = local.shape[1]
    gathered = torch.empty((world, 3, c), dtype=local.dtype, device=local.device)
    try:
        dist.all_gather(list(gathered.unbind(0)), local, group=group)
    except Exception as err:  # noqa: BLE001 - any backend error means a peer is gone
        raise _collective_failed(f"all_gather of batch statistics in {name}.forward", group, err) from err
    n_r, mean_r, m2_r = gathered.unbind(1)  # (world, C) each
    n = n_r.sum(0)
    if not masked and bool((n <= 1).any()):
        # the same global count on every rank, so every rank raises here: no one is left waiting
        raise ValueError(
            f"{name}: expected more than 1 value per channel in the global batch when training, got "
            f"{int(n.min())} (local input shape {tuple(x.shape)}, world size {world})"
        )
    mean = (n_r * mean_r).sum(0) / n.clamp_min(1)
    m2 = m2_r.sum(0) + (n_r * (mean_r - mean).square()).sum(0)
    return n, mean, m2 / n.clamp_min(1)


def _all_reduce(sums: Tensor, group, name: str) -> None:
    try:
        dist.all_reduce(sums, group=group)
    except Exception as err:  # noqa: BLE001
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
    def forward(ctx, x, mask, weight, bias, eps, group, world, running, name):
        s = _BATCH.resolve(tuple(x.shape))
        c, shape = x.shape[1], s.stat_shape
        fast = _fast(x, mask, weight)
        if fast:
            count = torch.full((c,), float(x.numel() // max(c, 1)), dtype=torch.float64, device=x.device)
            local = torch.stack((count, *_local_sums(x, s.reduce)))
        else:
            local = torch.stack(_local_moments(x, s, mask))  # (3, C): the one payload of the forward
        n, gmean, gvar = _gather_combine(local, world, group, name, x, mask is not None)

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
        sums = torch.cat((sum_dy, sum_dy_xhat))
        grad_weight = sum_dy_xhat.to(weight.dtype) if weight is not None and ctx.needs_input_grad[2] else None
        grad_bias = sum_dy.to(dy.dtype) if ctx.has_bias and ctx.needs_input_grad[3] else None
        _all_reduce(sums, ctx.group, ctx.name)
        g_dy, g_dyx = sums[:c].reshape(shape), sums[c:].reshape(shape)
        valid = 1.0 if mask is None else mask.to(acc)
        scale = rstd if weight is None else rstd * weight.to(acc).reshape(shape)
        dx = scale * (dyf - valid / n.clamp_min(1) * (g_dy + xhat * g_dyx))
        return dx.to(x.dtype), None, grad_weight, grad_bias, None, None, None, None, None

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
        sums = torch.cat((sum_dy, sum_dy_xhat))
        grad_weight = sum_dy_xhat.clone() if weight is not None and ctx.needs_input_grad[2] else None
        grad_bias = sum_dy.clone() if ctx.has_bias and ctx.needs_input_grad[3] else None
        _all_reduce(sums, ctx.group, ctx.name)
        if not x.numel():
            return torch.zeros_like(x), None, grad_weight, grad_bias, None, None, None, None, None
        # dx = w * rstd * dy + c1 * x_hat + c2 with the global sums: the x_hat part is an
        # evaluation-mode BatchNorm (it centres x before scaling), then dy is added in place
        w_rstd = torch.rsqrt(var + eps) if weight is None else weight * torch.rsqrt(var + eps)
        c1, c2 = -w_rstd * sums[c:] / n, -w_rstd * sums[:c] / n
        dx = torch.batch_norm(x, c1, c2, mean, var, False, 0.0, eps, _cudnn())
        view = [1] * x.dim()
        view[1] = c
        return dx.addcmul_(dy, w_rstd.view(view)), None, grad_weight, grad_bias, None, None, None, None, None


def _cudnn() -> bool:
    return torch.backends.cudnn.enabled


class SyncBatchNorm(nn.SyncBatchNorm):
    r"""Batch Normalization with statistics over the batch of every process in a group.

    .. math:: y = \frac{x - \mathrm{E}[x]}{\sqrt{\mathrm{Var}[x] + \epsilon}} \gamma + \beta

    with mean and biased variance per channel over the *concatenation* of every rank's batch (and
    positions). Subclasses :class:`torch.nn.SyncBatchNorm` (same arguments, buffers, state_dict,
    ``isinstance``) and replaces ``forward``; unlike torch's it runs on CPU (gloo) as well as GPU
    (NCCL) and is exact when ranks hold different batch sizes, masks, or an empty batch: output,
    input gradient and running statistics (unbiased with the global count) equal BatchNorm on the
    concatenated batch, and the per-rank weight/bias gradients sum to BatchNorm's (DDP averages
    them as usual). One ``all_gather`` of ``3 * C`` numbers per forward, one ``all_reduce`` of
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

        >>> # in each process, after dist.init_process_group("gloo" or "nccl", ...)
        >>> model = normscope.SyncBatchNorm.convert_sync_batchnorm(model)
        >>> y = model(x)
    """

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

        factor = momentum_factor(self)
        use_batch_stats = self.training or (self.running_mean is None and self.running_var is None)
        keep_running = not self.training or self.track_running_stats
        rm = self.running_mean if keep_running else None
        rv = self.running_var if keep_running else None

        group = self.process_group or (dist.group.WORLD if dist.is_available() and dist.is_initialized() else None)
        world = _group_size(group) if self.training else 1
        if world > 1:
            running = Running(rm, rv, float(factor), True) if rm is not None and rv is not None else None
            y = _SyncBatchNormFn.apply(input, m, self.weight, self.bias, self.eps, group, world, running, name)
        elif m is None:  # exactly normscope.BatchNorm*d
            y = F.batch_norm(input, rm, rv, self.weight, self.bias, use_batch_stats, factor, self.eps)
        else:
            running = None
            if rm is not None or rv is not None or not use_batch_stats:
                running = Running(rm, rv, float(factor), use_batch_stats)
            y = norm(input, _BATCH, self.weight, self.bias, self.eps, mask=m, running=running)
        count_batch(self)  # after the step (and its collective) succeeded
        return y

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
