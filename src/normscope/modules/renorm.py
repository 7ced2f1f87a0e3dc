"""BatchRenorm1d/2d/3d: Batch Renormalization.

Paper: Ioffe 2017, "Batch Renormalization: Towards Reducing Minibatch Dependence in
Batch-Normalized Models". Scope: :meth:`normscope.Scope.batch`; the correction is a change of the
statistics handed to the engine's ``apply``, not a new normalization.
"""

from __future__ import annotations

import collections
import numbers
import threading

import torch
from torch import Tensor, nn

from .. import _checks as check
from .. import _state, engine
from .. import reference as ref
from ..scope import Scope
from .batchnorm import BatchNorm1d, BatchNormMixin, count_batch, momentum_factor


@torch.library.custom_op("normscope::batch_renorm_correction", mutates_args=())
def _correction(
    mean_b: Tensor, sigma_b: Tensor, running_mean: Tensor, running_var: Tensor, eps: float, rmax: Tensor, dmax: Tensor
) -> tuple[Tensor, Tensor]:
    """Batch Renorm's ``(r, d)`` from the batch and running statistics (constants for autograd).

    An opaque op so that torch.compile saves r and d instead of recomputing them: from plain ops,
    AOTAutograd may recompute them in the backward from ``running_mean``/``running_var`` (it treats a
    buffer input as free to re-read), which this step's update has overwritten by then -- gradients
    0.4-4% off eager's. The partitioner does not recompute a custom op; it saves its outputs.
    """
    sigma = (running_var.to(sigma_b.dtype) + eps).sqrt()
    r = (sigma_b / sigma).clamp(1.0 / rmax, rmax)
    d = ((mean_b - running_mean.to(mean_b.dtype)) / sigma).clamp(-dmax, dmax)
    return r, d


@_correction.register_fake
def _(mean_b, sigma_b, running_mean, running_var, eps, rmax, dmax):
    return torch.empty_like(sigma_b), torch.empty_like(mean_b)


class _BatchRenormMixin(BatchNormMixin):
    r"""BatchNorm's state and evaluation; in training, batch statistics corrected towards the
    running ones by ``r`` and ``d`` (stop-gradient):

    .. math::
        r = \mathrm{clip}_{[1/r_{max}, r_{max}]}\left(\frac{\sigma_B}{\sigma}\right), \quad
        d = \mathrm{clip}_{[-d_{max}, d_{max}]}\left(\frac{\mu_B - \mu}{\sigma}\right), \quad
        y = \left(\frac{x - \mu_B}{\sigma_B} r + d\right)\gamma + \beta

    which is ``apply(x, mu_B, rstd', weight, bias')`` with :math:`\text{rstd}' = r / \sigma_B` and
    :math:`\text{bias}' = \beta + \gamma d` (:math:`\sigma = \sqrt{\text{var} + \epsilon}`).
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        device=None,
        dtype=None,
        *,
        rmax: float = 3.0,
        dmax: float = 5.0,
        warmup_iters: int = 0,
        **kw,
    ) -> None:
        name = type(self).__name__
        if not track_running_stats:
            raise ValueError(
                f"{name}: expected track_running_stats=True (the correction needs running statistics), got False"
            )
        # ``not >=``: a NaN limit compares False both ways and made every training output NaN (r or d NaN);
        # NumPy's floats are numbers too, a bool is not
        if isinstance(rmax, bool) or not isinstance(rmax, numbers.Real) or not rmax >= 1:
            raise ValueError(f"{name}: expected `rmax` to be a number >= 1, got {rmax!r}")
        if isinstance(dmax, bool) or not isinstance(dmax, numbers.Real) or not dmax >= 0:
            raise ValueError(f"{name}: expected `dmax` to be a number >= 0, got {dmax!r}")
        warmup_iters = check.size(warmup_iters, "warmup_iters", name, low=0)  # a Python int, from NumPy's too
        super().__init__(num_features, eps, momentum, affine, True, device, dtype, **kw)
        self.rmax, self.dmax, self.warmup_iters = float(rmax), float(dmax), warmup_iters

    #: how many training calls' (r, d) a layer keeps for their recomputation (see _given_correction)
    KEPT_CORRECTIONS = 64

    def _remember_correction(self, mean: Tensor, sigma: Tensor, r: Tensor, d: Tensor) -> None:
        """Keep this training call's ``(r, d)``, with the batch statistics they were computed from, for a
        recomputation of it (activation checkpointing; the reentrant kind runs the forward without grad);
        eagerly only (a compiled graph saves r and d itself)."""
        if _state.compiling() or _state.tracing() or _in_backward():
            return
        kept = self.__dict__.get("_corrections")
        if kept is None:
            kept = self.__dict__["_corrections"] = collections.deque(maxlen=self.KEPT_CORRECTIONS)
        kept.append((mean, sigma, r, d))

    def _given_correction(self, mean: Tensor, sigma: Tensor) -> tuple[Tensor, Tensor] | None:
        """A recomputation's ``(r, d)``: the forward's, not new ones. Activation checkpointing runs the
        forward again during the backward, after this forward's update moved the running statistics (and
        the warm-up's step count): r and d from them were another correction than the one the forward
        applied, and the gradients those of another function (2.5 % off at the defaults). A training call
        during a backward is a recomputation. Which call it recomputes is told by its batch statistics: the
        recomputation runs the same ops on the same input, so they are the forward's bit for bit. Not by
        order alone: a layer called inside a checkpointed segment and again after it has the later call
        kept after the one recomputed. Of calls with equal statistics, the latest.

        Never while traced: a compiled graph saves its own r and d (and keeps none here), and the
        question itself cannot be traced -- dynamo refuses ``_current_graph_task_id`` (a torch op that
        returns an int) under ``fullgraph=True``, which a layer's eager calls before its compile used to
        reach through the corrections they kept."""
        if _state.tracing():
            return None
        kept = self.__dict__.get("_corrections")
        if not kept or not _in_backward() or not torch.is_grad_enabled():
            return None
        with _KEPT_LOCK:  # another thread's recomputation may take an entry between the search and the removal
            for entry in reversed(kept):
                m, s = entry[0], entry[1]
                if _same(m, mean) and _same(s, sigma):
                    kept.remove(entry)
                    return entry[2], entry[3]
        return None  # not a call kept here: computed anew

    def extra_repr(self) -> str:
        s = f"{super().extra_repr()}, rmax={self.rmax}, dmax={self.dmax}"
        return s + (f", warmup_iters={self.warmup_iters}" if self.warmup_iters else "")

    def limits(self, step: int) -> tuple[float, float]:
        """``(rmax, dmax)`` at training step ``step`` (0 = the first): ramped linearly from
        ``(1, 0)`` -- plain BatchNorm -- to ``(rmax, dmax)`` over ``warmup_iters`` steps."""
        if self.warmup_iters <= 0:
            return self.rmax, self.dmax
        frac = min(step / self.warmup_iters, 1.0)
        return 1.0 + (self.rmax - 1.0) * frac, self.dmax * frac

    def _limits(self, dtype: torch.dtype) -> tuple[Tensor, Tensor] | tuple[float, float]:
        """:meth:`limits` at this step, read from ``num_batches_tracked`` (the steps before this
        one): as tensors, since a meta tensor (and torch.export's fake one) has no value to read,
        ``int()`` would make torch.compile guard on every step, and eager needs no device sync."""
        if self.warmup_iters <= 0:
            return self.rmax, self.dmax
        frac = (self.num_batches_tracked.to(dtype) / self.warmup_iters).clamp(max=1.0)
        return 1.0 + (self.rmax - 1.0) * frac, self.dmax * frac

    def forward(self, input: Tensor, mask: Tensor | None = None) -> Tensor:
        if not self.training:  # inference is BatchNorm's: the running statistics
            return super().forward(input, mask)
        name = type(self).__name__
        self._check_input_dim(input)
        check.tensor(input, "input", name)  # an int/bool input would come back as int
        mask = check.mask(mask, input, self.channel_dim, name)
        if check.all_masked(mask):  # not asked on meta tensors or while tracing
            raise ValueError(f"{name}: expected at least one valid (True) element in `mask` when training, got none")
        if input.numel() // self.num_features == 1:
            # torch's BatchNorm rule: one value has no variance to estimate (r and d would be 0/0); with a
            # mask too, which only takes values away
            raise ValueError(
                f"{name}: expected more than 1 value per channel when training, got input of shape "
                f"{tuple(input.shape)} (1 value per channel)"
            )
        # the checks BatchNorm's training call makes (functional.checked_batch_norm), before the running
        # statistics move: a parameter or buffer of another size, device or dtype, or an eps that divides
        # a constant channel by 0 (or NaN), is refused here -- not found by the update's or the affine's
        # tensor ops after the state has changed, as a RuntimeError
        tensors = {"running_mean": self.running_mean, "running_var": self.running_var}
        for pname, buf in tensors.items():
            # the correction reads both (and the warm-up its step from the count): a buffer set to None after
            # construction is refused by name, not found by the correction's reshape as an AttributeError
            if buf is None:
                raise ValueError(
                    f"{name}: expected `{pname}` in training (the correction r, d needs the running statistics), "
                    "got None"
                )
        if self.warmup_iters > 0 and self.num_batches_tracked is None:
            raise ValueError(
                f"{name}: expected `num_batches_tracked` in training with warmup_iters={self.warmup_iters} (the "
                "ramp of rmax and dmax reads the step from it), got None"
            )
        tensors.update(weight=self.weight, bias=self.bias)
        for pname, p in tensors.items():
            check.param(p, pname, (self.num_features,), input, name)
        check.one_dtype(input, name, **tensors)
        check.eps(self.eps, name)
        if not self.eps > 0:
            raise ValueError(f"{name}: expected `eps` > 0 when training (batch statistics normalize), got {self.eps!r}")
        requested = engine.requested_backend()
        if requested not in ("auto", "reference"):
            raise ValueError(
                f"{name}: backend {requested!r} cannot run a training step: its batch statistics and "
                f"correction (r, d) are computed by the 'reference' backend only; expected "
                f"use_backend('reference') or no forced backend (evaluation runs on any backend)"
            )
        rmax, dmax = self._limits(ref.acc_dtype(input.dtype))
        factor = momentum_factor(self)
        # counted once checked, before the state moves, as BatchNorm's hot path counts (and torch.nn's layer):
        # counted after the step, a recomputation that non-reentrant activation checkpointing stops early (it
        # raises from a saved-tensor hook, after the running statistics moved) was not counted -- and
        # momentum=None's next factor, 1 / count, was not torch's
        count_batch(self)
        scope = Scope.batch(self.channel_dim).resolve(tuple(input.shape))
        m = ref.moments(input, scope, mask)
        sigma_b = (m.var + self.eps).sqrt()
        shape = scope.stat_shape
        given = self._given_correction(m.mean.detach(), sigma_b.detach())
        with torch.no_grad():  # r and d are constants for the gradient (the paper's stop_gradient)
            lim = [
                torch.full((), v, dtype=sigma_b.dtype, device=sigma_b.device)
                if isinstance(v, float)
                else v.to(sigma_b.dtype)
                for v in (rmax, dmax)
            ]
            r, d = given or _correction(
                m.mean.detach(),
                sigma_b.detach(),
                self.running_mean.reshape(shape),
                self.running_var.reshape(shape),
                self.eps,
                *lim,
            )
        self._remember_correction(m.mean.detach(), sigma_b.detach(), r, d)
        running = engine.Running(self.running_mean, self.running_var, factor, True)
        engine.update_running(engine.Call(input, scope, None, None, self.eps, mask, running), m)
        # d joins the bias (beta + gamma d, per channel), not the mean: folded into the mean as
        # mu_B - d sigma_B / r, the offset is rounded at mu_B's magnitude and then multiplied by r / sigma_B
        # -- a constant channel at 1e4 in fp16 gave d +- 0.04 where the formula gives d exactly
        shift = d.reshape(-1) if self.weight is None else d.reshape(-1) * self.weight.to(d.dtype)
        bias = shift if self.bias is None else shift + self.bias.to(d.dtype)
        y = engine.apply(input, m.mean, r / sigma_b, scope, self.weight, bias, mask)
        engine.report_backend("reference")
        return y


_KEPT_LOCK = threading.Lock()


def _same(kept: Tensor, now: Tensor) -> bool:
    """Whether a kept batch statistic is this call's: same shape, dtype, device and bits."""
    return kept.shape == now.shape and kept.dtype == now.dtype and kept.device == now.device and torch.equal(kept, now)


def _in_backward() -> bool:
    """Whether autograd's engine is running a backward on this thread (where activation checkpointing
    recomputes a forward)."""
    return torch._C._current_graph_task_id() != -1


_DOC = r"""Batch Renormalization over {shape}.

    Paper: Ioffe 2017, "Batch Renormalization: Towards Reducing Minibatch Dependence in
    Batch-Normalized Models".

    .. math::
        r = \mathrm{{clip}}_{{[1/r_{{max}}, r_{{max}}]}}(\sigma_B / \sigma), \quad
        d = \mathrm{{clip}}_{{[-d_{{max}}, d_{{max}}]}}((\mu_B - \mu) / \sigma), \quad
        y = \left(\frac{{x - \mu_B}}{{\sigma_B}} r + d\right) \gamma + \beta

    in training, with ``r`` and ``d`` treated as constants by autograd and
    :math:`\sigma = \sqrt{{\text{{running\_var}} + \epsilon}}`, :math:`\sigma_B = \sqrt{{\text{{Var}}_B + \epsilon}}`
    (the paper leaves eps out of :math:`\sigma`). Evaluation is BatchNorm's. The running
    statistics update exactly like BatchNorm's (mean and unbiased variance, ``momentum``), so the
    state_dict *is* a BatchNorm's and loads both ways (the paper updates :math:`\sigma` itself).
    ``forward(input, mask=None)`` takes a mask as BatchNorm does.

    Args:
        num_features: channels C.
        eps: added to the variance, as :class:`torch.nn.BatchNorm{d}`'s. Default: 1e-5.
        momentum: the running statistics' update factor, as :class:`torch.nn.BatchNorm{d}`'s (None: a
            cumulative average). Default: 0.1.
        affine: learnable per-channel ``weight`` and ``bias``. Default: True.
        track_running_stats: must be True: the running statistics are part of the formula. Default: True.
        device: where the parameters and buffers are created. Default: None.
        dtype: their dtype. Default: None.
        rmax: upper clip of ``r`` (lower: ``1/rmax``). Default: 3.
        dmax: clip of ``|d|``. Default: 5.
        warmup_iters: ramp ``rmax`` from 1 and ``dmax`` from 0 linearly over this many training
            steps (the paper relaxes them gradually; 0 = the full limits from the first step,
            1 = plain BatchNorm on the first step only). Default: 0.{extra}

    Shape:
        - Input: {shape}. Output: same shape.

    Example::

        >>> brn = normscope.BatchRenorm{d}(16, rmax=3.0, dmax=5.0, warmup_iters=5000)
"""


class BatchRenorm1d(_BatchRenormMixin, BatchNorm1d):
    __doc__ = _DOC.format(
        shape="(N, C) or (N, C, L)",
        d="1d",
        extra="\n        channel_dim: 1, or -1 for channels-last (B, S, D). Default: 1.",
    )


class BatchRenorm2d(_BatchRenormMixin, nn.BatchNorm2d):
    __doc__ = _DOC.format(shape="(N, C, H, W)", d="2d", extra="")
    _dims = (4,)


class BatchRenorm3d(_BatchRenormMixin, nn.BatchNorm3d):
    __doc__ = _DOC.format(shape="(N, C, D, H, W)", d="3d", extra="")
    _dims = (5,)
