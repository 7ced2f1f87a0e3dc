r"""PowerNorm: BatchNorm for Transformers -- quadratic mean, running statistics in the forward
pass, and an approximate backward with its own running state.

Paper: Shen, Yao, Gholami, Mahoney & Keutzer 2020, "PowerNorm: Rethinking Batch Normalization in
Transformers" (ICML). Reference code: github.com/sIncerass/powernorm,
``fairseq/modules/norms/mask_powernorm.py`` (MaskPowerNorm). This is our own implementation on
the engine: the statistics are :func:`normscope.reference.moments` over an *uncentered* batch
scope (valid tokens only), the normalization is the engine's ``apply``.

Where the paper and the reference code differ, and what we do (see also ``docs/beyond.md``):

* **Group scaling.** The reference first divides every token by the root mean square of each of
  ``group_num`` groups of its features (``GroupScaling1D``: an RMSNorm without weight, eps 1e-5;
  ``group_num`` defaults to 1, and the authors' transformer passes the number of attention heads);
  the paper does not mention it. ``group_scaling=None`` (default) follows the paper;
  ``group_scaling=G`` reproduces the reference's ``group_num=G``, computed as an engine RMS scope
  over channel groups.
* **Which quadratic mean divides the gradient.** After warm-up the reference's forward divides
  by the running ``running_phi`` but its backward still divides by the *batch* quadratic mean;
  the paper's Algorithm 1, as we read it, uses the running :math:`\psi` in both passes. We follow
  the reference, the code behind the paper's numbers: forward ``x / sqrt(running_phi + eps)`` after
  warm-up, backward always ``/ sqrt(phi_B + eps)``.
* **Backward running state** (:math:`\nu`, ``ema_gz``): exactly the reference's update,
  ``g' = g - (1 - alpha_bkw) * ema_gz * z``, ``ema_gz += mean(g' * z)``, ``dx = g' / sqrt(phi_B + eps)``,
  with ``g = dL/dz`` (z: the normalized input before the affine). It is an accumulation rather
  than an exponential average in the usual ``alpha * old + (1 - alpha) * new`` form.
* **Gradient into padding.** The reference's backward sends ``-(1 - alpha_bkw) * ema_gz * z``
  into *padded* positions too (even where their ``g`` is 0, their ``z`` is not), and from there into
  whatever produced them (a shared pad embedding, the previous layers' weights). A padded
  position took no part in the statistic, so its exact gradient through the normalization is
  zero: we send exactly zero there, at every step.
* **Which tokens the ``ema_gz`` mean runs over** (``ema_gz_over``). The reference's forward
  statistic counts valid tokens only but its ``ema_gz`` update averages over *every* position,
  padding included -- an artifact of where it keeps the mask, which scales the state by the
  batch's valid fraction (and adds the padded ``-(1-alpha_bkw) ema_gz z^2`` terms), so the
  same tokens padded more give a different state. ``"valid"`` (default) averages over the tokens
  the statistic counted, as the forward does: the state then depends only on the valid tokens.
  ``"all"`` is the reference's average, for reproducing it. Evidence, the lab's ``padding``
  experiment (a 2-layer transformer on length-bucketed batches, pad fraction up to 0.97 per batch,
  3 seeds, group scaling over the heads, ``docs/lab/padding/result.json``): test accuracy 99.8 %
  with ``"valid"`` and 99.6 % with ``"all"`` (LN 100.0 %) -- training does not tell them apart at
  this scale, so the default is the one that keeps padding out of the state by construction
  (tested: more padding, same state). Before padded positions got zero gradient, the previous
  version of that experiment (same sizes, no group scaling) gave PowerNorm 52.4 %.
* **Warm-up.** As the reference: for steps ``1..warmup_iters`` the forward uses the batch
  statistic; during steps ``1..warmup_iters-1`` ``running_phi`` is first replaced by the
  cumulative average of the batch statistics and then, like every step, EMA-updated with
  ``alpha_fwd``.
"""

from __future__ import annotations

import numbers

import torch
from torch import Tensor, nn

from .. import _checks as check
from .. import engine
from .. import reference as ref
from ..scope import Resolved, Scope


def _valid_mean(t: Tensor, scope: Resolved, mask: Tensor | None) -> Tensor:
    """Per-channel mean of ``t`` over the reduced axes, valid positions only."""
    if mask is None:
        return t.mean(scope.reduce, keepdim=True)
    # where, not a product: a non-finite padded value times 0 would be NaN
    t = torch.where(mask, t, torch.zeros((), dtype=t.dtype, device=t.device))
    count = mask.expand_as(t).sum(scope.reduce, keepdim=True).clamp_min(1).to(t.dtype)
    return t.sum(scope.reduce, keepdim=True) / count


class _PowerFunction(torch.autograd.Function):
    """``z = x * rstd_fwd`` with PowerNorm's approximate backward (updates ``ema_gz`` in place)."""

    @staticmethod
    def forward(ctx, x, rstd_fwd, rstd_bwd, ema_gz, scope, mask, alpha_bkw, over_all):
        z = ref.apply(x, torch.zeros_like(rstd_fwd), rstd_fwd, scope, mask=mask)
        ctx.save_for_backward(z, rstd_bwd, mask)
        ctx.ema_gz, ctx.scope, ctx.alpha_bkw, ctx.over_all = ema_gz, scope, alpha_bkw, over_all
        return z

    @staticmethod
    def backward(ctx, g):
        z, rstd_bwd, mask = ctx.saved_tensors
        ema = ctx.ema_gz.reshape(rstd_bwd.shape).to(rstd_bwd.dtype)
        zf = z.to(rstd_bwd.dtype)
        if mask is not None:  # a non-finite padded value is a constant: it enters no state, no gradient
            zf = torch.where(~torch.isfinite(zf) & ~mask, torch.zeros((), dtype=zf.dtype, device=zf.device), zf)
        approx = g.to(zf.dtype) - (1 - ctx.alpha_bkw) * ema * zf
        with torch.no_grad():
            step = _valid_mean(approx * zf, ctx.scope, None if ctx.over_all else mask)
            ctx.ema_gz.add_(step.reshape(ctx.ema_gz.shape).to(ctx.ema_gz.dtype))
        gx = approx * rstd_bwd
        if mask is not None:  # a padded position took no part in the statistic: exactly zero
            gx = torch.where(mask, gx, torch.zeros((), dtype=gx.dtype, device=gx.device))
        return gx.to(g.dtype), None, None, None, None, None, None, None


class PowerNorm(nn.Module):
    r"""Power Normalization: per-feature quadratic mean over batch and sequence (no centering),
    with running statistics in the forward pass and an approximate backward.

    .. math::
        \psi_B^2 = \frac{1}{|\text{valid}|}\sum_{\text{valid}} x^2, \qquad
        y = \gamma \frac{x}{\sqrt{\psi^2 + \epsilon}} + \beta, \qquad
        \psi^2 \leftarrow \alpha_{fwd}\,\psi^2 + (1 - \alpha_{fwd})\,\psi_B^2

    with :math:`\psi^2 = \psi_B^2` during the first ``warmup_iters`` training steps and the
    running ``running_phi`` afterwards and in evaluation. The backward is the paper's
    approximation with running state ``ema_gz``; every choice where the paper and the reference
    code differ is listed in this module's docstring.

    Args:
        num_features: size of the feature axis.
        eps: added to the quadratic mean. Default: 1e-5.
        alpha_fwd: EMA factor of ``running_phi``. Default: 0.9.
        alpha_bkw: factor of the backward correction ``ema_gz``. Default: 0.9.
        affine: learnable per-feature ``weight`` (ones) and ``bias`` (zeros). Default: True.
        warmup_iters: training steps that use the batch statistic in the forward pass.
            Default: 10000 (the reference's).
        group_scaling: ``None`` (the paper), or G to first divide each token by the RMS of each
            of G groups of its features, as the reference's ``GroupScaling1D`` (its ``group_num``;
            the authors' transformer passes the number of attention heads). Default: None.
        ema_gz_over: the positions the backward state ``ema_gz`` averages over: ``"valid"``
            (the tokens the statistic counts) or ``"all"`` (every position, padding included,
            as the reference). Padded positions get zero input gradient either way.
            Default: ``"valid"``.
        channel_dim: the feature axis; -1 for (B, S, D) / (T, B, C), 1 for (N, C, *). Default: -1.

    ``forward(input, mask=None)``: ``mask`` is bool, the input's shape without the feature axis,
    True = valid token; only valid tokens enter ``running_phi`` (and ``ema_gz`` unless
    ``ema_gz_over="all"``), and padded positions get exactly zero input gradient.

    Shape:
        - Input: any shape with ``num_features`` at ``channel_dim``. Output: same shape.

    Example::

        >>> pn = normscope.PowerNorm(512, warmup_iters=4000)
        >>> x, mask = torch.randn(8, 30, 512), torch.rand(8, 30) > 0.2
        >>> y = pn(x, mask)
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        alpha_fwd: float = 0.9,
        alpha_bkw: float = 0.9,
        affine: bool = True,
        warmup_iters: int = 10000,
        group_scaling: int | None = None,
        channel_dim: int = -1,
        ema_gz_over: str = "valid",
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        _int = lambda v: isinstance(v, numbers.Integral) and not isinstance(v, bool)  # noqa: E731
        num_features = check.size(num_features, "num_features", "PowerNorm")  # a Python int, from NumPy's too
        warmup_iters = check.size(warmup_iters, "warmup_iters", "PowerNorm", low=0)
        if not isinstance(eps, numbers.Real) or isinstance(eps, bool) or not eps > 0:  # NumPy's floats too
            # eps is all that keeps an all-zero feature (padding, a dead unit) from dividing by 0
            raise ValueError(f"PowerNorm: expected `eps` to be a positive number, got {eps!r}")
        for n, v in (("alpha_fwd", alpha_fwd), ("alpha_bkw", alpha_bkw)):
            if not isinstance(v, numbers.Real) or isinstance(v, bool) or not 0 <= v <= 1:
                raise ValueError(f"PowerNorm: expected `{n}` in [0, 1], got {v!r}")
        if group_scaling is not None and (not _int(group_scaling) or group_scaling < 1 or num_features % group_scaling):
            raise ValueError(
                f"PowerNorm: expected `group_scaling` to be None or a positive int dividing num_features="
                f"{num_features}, got {group_scaling!r}"
            )
        group_scaling = None if group_scaling is None else int(group_scaling)
        channel_dim = check.channel_dim(channel_dim, "PowerNorm")
        if ema_gz_over not in ("valid", "all"):
            raise ValueError(f"PowerNorm: expected `ema_gz_over` to be 'valid' or 'all', got {ema_gz_over!r}")
        kw = {"device": device, "dtype": dtype}
        self.num_features, self.eps = num_features, eps
        self.alpha_fwd, self.alpha_bkw = float(alpha_fwd), float(alpha_bkw)
        self.affine, self.warmup_iters = affine, warmup_iters
        self.group_scaling, self.channel_dim = group_scaling, channel_dim
        self.ema_gz_over = ema_gz_over
        if affine:
            self.weight = nn.Parameter(torch.ones(num_features, **kw))
            self.bias = nn.Parameter(torch.zeros(num_features, **kw))
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)
        self.register_buffer("running_phi", torch.ones(num_features, **kw))
        self.register_buffer("ema_gz", torch.zeros(num_features, **kw))
        self.register_buffer("num_batches_tracked", torch.tensor(0, dtype=torch.long, device=device))
        self._scope = Scope(keep=(channel_dim,), centered=False, affine=(channel_dim,))
        if group_scaling is not None:
            self._gs_scope = Scope(reduce=(channel_dim,), centered=False, groups=group_scaling, group_dim=channel_dim)

    def reset_running_stats(self) -> None:
        self.running_phi.fill_(1.0)
        self.ema_gz.zero_()
        self.num_batches_tracked.zero_()

    def reset_parameters(self) -> None:
        """The state of a new layer, as torch's norms' ``reset_parameters``: what initializes a layer made on
        ``device="meta"`` and moved with ``to_empty`` (whose memory is uninitialized)."""
        self.reset_running_stats()
        if self.affine:
            nn.init.ones_(self.weight)
            nn.init.zeros_(self.bias)

    def extra_repr(self) -> str:
        return (
            f"{self.num_features}, eps={self.eps}, alpha_fwd={self.alpha_fwd}, alpha_bkw={self.alpha_bkw}, "
            f"affine={self.affine}, warmup_iters={self.warmup_iters}, group_scaling={self.group_scaling}, "
            f"channel_dim={self.channel_dim}, ema_gz_over={self.ema_gz_over!r}"
        )

    def _eval(self, x: Tensor, scope: Resolved, mask: Tensor | None) -> Tensor:
        """The running quadratic mean, as a constant statistic. ``mask``: as in training, a non-finite
        padded value passes no gradient (without it the weight's gradient was ``0 * inf = NaN``)."""
        rstd = ref.rstd(self.running_phi.reshape(scope.stat_shape).to(ref.acc_dtype(x.dtype)), self.eps)
        return engine.apply(x, torch.zeros_like(rstd), rstd, scope, self.weight, self.bias, mask)

    def forward(self, input: Tensor, mask: Tensor | None = None) -> Tensor:
        name, c, cd = "PowerNorm", self.num_features, self.channel_dim
        check.tensor(input, "input", name)
        if input.dim() < 2 or input.shape[cd] != c:
            raise ValueError(
                f"{name}({c}): expected input with at least 2 dims and {c} features at dim {cd}, "
                f"got shape {tuple(input.shape)}"
            )
        mask = check.mask(mask, input, cd, name)
        # before any state moves (the batch count, running_phi): parameters and buffers of the feature
        # count and on the input's device -- else the tensor ops below raise a RuntimeError after the
        # state has changed -- and an eps that keeps an all-zero feature finite (as the constructor's)
        for pname in ("weight", "bias"):
            check.param(getattr(self, pname), pname, (c,), input, name, any_dtype=True)
        for pname in ("running_phi", "ema_gz"):  # any shape of c values: the reference keeps ema_gz (1, 1, C)
            buf = getattr(self, pname)
            if buf is None:  # set to None after construction: refused by name, not an AttributeError below
                raise ValueError(f"{name}: expected `{pname}`, a buffer of {c} values, got None")
            if buf.numel() != c or buf.device != input.device:
                raise ValueError(
                    f"{name}: expected `{pname}` of {c} values on the input's device {input.device}, got shape "
                    f"{tuple(buf.shape)} on {buf.device}"
                )
        if self.training and self.num_batches_tracked is None:  # the step counter of the warm-up and the average
            raise ValueError(f"{name}: expected `num_batches_tracked` in training (the step count), got None")
        if isinstance(self.eps, bool) or not isinstance(self.eps, numbers.Real) or not self.eps > 0:
            raise ValueError(f"{name}: expected `eps` to be a positive number, got {self.eps!r}")
        x = input
        if self.group_scaling is not None:  # the reference's GroupScaling1D, eps fixed at 1e-5 as there
            if mask is not None:
                # a padded token passes no gradient (see _PowerFunction), and none through its own RMS: the
                # backward of a non-finite or overflowing one (inf, NaN, finfo.max) turns that zero into NaN
                x = torch.where(mask, x, x.detach())
            x = engine.norm(x, self._gs_scope, eps=1e-5)
        scope = self._scope.resolve(tuple(x.shape))
        if not self.training:
            return self._eval(x, scope, mask)
        if x.numel() == 0:
            # no token, no statistic: the state stays as it was (a zero quadratic mean would enter
            # running_phi), and the output is empty anyway
            return self._eval(x, scope, mask)
        if check.all_masked(mask):  # not asked on meta tensors or while tracing
            raise ValueError(f"{name}: expected at least one valid (True) element in `mask` when training, got none")
        self.num_batches_tracked.add_(1)
        # the step as a tensor: int() of a buffer would break a torch.compile graph, and on a
        # meta tensor has no value at all
        it = self.num_batches_tracked.to(torch.float64)
        # the statistic is a constant for autograd: the approximate backward replaces its gradient
        with torch.no_grad():
            phi_b = ref.moments(x.detach(), scope, mask).var
            phi_run = self.running_phi.reshape(scope.stat_shape).to(phi_b.dtype)
            rstd_bwd = ref.rstd(phi_b, self.eps)
            rstd_fwd = torch.where(it <= self.warmup_iters, rstd_bwd, ref.rstd(phi_run, self.eps))
            new = phi_b.reshape(self.running_phi.shape).to(self.running_phi.dtype)
            # during warm-up (it < warmup_iters) running_phi is first the cumulative average
            cum = self.running_phi * ((it - 1) / it).to(new.dtype) + new / it.to(new.dtype)
            phi = torch.where(it < self.warmup_iters, cum, self.running_phi)
            self.running_phi.copy_(phi * self.alpha_fwd + (1 - self.alpha_fwd) * new)
        z = _PowerFunction.apply(
            x, rstd_fwd, rstd_bwd, self.ema_gz, scope, mask, self.alpha_bkw, self.ema_gz_over == "all"
        )
        if self.weight is None:
            return z
        ones = torch.ones_like(rstd_fwd)
        return engine.apply(z, torch.zeros_like(rstd_fwd), ones, scope, self.weight, self.bias, mask)
