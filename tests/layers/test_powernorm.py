"""PowerNorm against the authors' published algorithm (Shen et al. 2020; sIncerass/powernorm,
``fairseq/modules/norms/mask_powernorm.py``: ``MaskPowerNorm``, ``PowerFunction``,
``GroupScaling1D``), written out here as an oracle in float64, step by step over many training
steps with padding masks.

The oracle keeps the authors' layout -- input (T, B, C), ``pad_mask`` (B, T) with True = padding --
and computes their forward and backward as explicit formulas (autograd only carries the gradient
back through the group scaling, which the authors leave to autograd too).

Where normscope means to agree with them: forward, ``running_phi`` (warm-up included), eval, weight
and bias gradients, ``ema_gz`` and the input gradient at valid positions with
``ema_gz_over="all"``. Where it means to differ: padded positions get zero input gradient (the
authors send ``-(1 - alpha_bkw) * ema_gz * z`` there), and with ``ema_gz_over="valid"`` (default)
the state is the authors' algorithm run on the valid tokens alone.

Also: a step-by-step port of the reference code (with and without group scaling), a mask equal to
the valid tokens alone, channels-first input, the warm-up against the loop formula, an empty batch
that leaves the state alone, and errors that name the argument."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import normscope
from conftest import refused_with_state_kept, swap

F64 = {"atol": 1e-12, "rtol": 1e-12}


class AuthorsPowerNorm:
    """The authors' MaskPowerNorm in float64, as explicit formulas (training and eval)."""

    def __init__(self, c, alpha_fwd=0.9, alpha_bkw=0.9, warmup_iters=10000, group_num=1, eps=1e-5):
        self.c, self.afwd, self.abkw, self.eps = c, alpha_fwd, alpha_bkw, eps
        self.warmup, self.gn = warmup_iters, group_num
        self.weight = torch.ones(c, dtype=torch.float64, requires_grad=True)
        self.bias = torch.zeros(c, dtype=torch.float64, requires_grad=True)
        self.running_phi = torch.ones(c, dtype=torch.float64)
        self.ema_gz = torch.zeros(c, dtype=torch.float64)
        self.iters = 0

    def _group_scaling(self, x):  # GroupScaling1D: each token / RMS of each of group_num groups, eps 1e-5
        t, b, c = x.shape
        cg = c // self.gn
        m2 = (x.reshape(t, b, self.gn, cg) ** 2).mean(-1, keepdim=True)
        return x / torch.sqrt(m2.repeat_interleave(cg, dim=-1).reshape(t, b, c) + 1e-5)

    def train_step(self, x, pad_mask, g):
        """One training step on x (T, B, C) with upstream gradient g (T, B, C): returns the output
        and the gradients of x, weight, bias; updates running_phi, ema_gz, iters."""
        self.iters += 1
        x = x.detach().requires_grad_()
        u = self._group_scaling(x)
        valid = ~pad_mask.transpose(0, 1)  # (T, B)
        var = (u.detach()[valid] ** 2).mean(0)  # quadratic mean over valid tokens, per channel
        if self.iters <= self.warmup:
            z = u.detach() / (var + self.eps).sqrt()
        else:
            z = u.detach() / (self.running_phi + self.eps).sqrt()
        if self.iters < self.warmup:
            self.running_phi = self.running_phi * (self.iters - 1) / self.iters + var / self.iters
        self.running_phi = self.afwd * self.running_phi + (1 - self.afwd) * var
        y = self.weight.detach() * z + self.bias.detach()
        # backward, as PowerFunction.backward: every position (padding included) enters the mean
        gz = g * self.weight.detach()
        approx = gz - (1 - self.abkw) * self.ema_gz * z
        self.ema_gz = self.ema_gz + (approx * z).mean((0, 1))
        gu = approx / torch.sqrt(var + self.eps)
        (gx,) = torch.autograd.grad(u, x, gu)
        return y, gx, (g * z).sum((0, 1)), g.sum((0, 1))

    def eval(self, x):
        z = self._group_scaling(x) / (self.running_phi + self.eps).sqrt()
        return self.weight.detach() * z + self.bias.detach()

    def sgd(self, dw, db, lr):
        with torch.no_grad():
            self.weight -= lr * dw
            self.bias -= lr * db


def _ours_step(pn, x_tbc, pad_mask, g):
    """normscope's PowerNorm on the same step, (B, S, C) with mask True = valid."""
    x = x_tbc.transpose(0, 1).detach().clone().requires_grad_()
    y = pn(x, ~pad_mask)
    y.backward(g.transpose(0, 1))
    return y.transpose(0, 1), x.grad.transpose(0, 1)


def _sgd(pn, lr):
    with torch.no_grad():
        for p in (pn.weight, pn.bias):
            p -= lr * p.grad
            p.grad = None


def _batch(gen, t, b, c, step):
    x = torch.randn(t, b, c, generator=gen, dtype=torch.float64) * (1 + 0.1 * step) + 0.3
    lengths = torch.randint(1, t + 1, (b,), generator=gen)
    lengths[0] = t
    pad = torch.arange(t)[None, :] >= lengths[:, None]  # (B, T), True = padding
    g = torch.randn(t, b, c, generator=gen, dtype=torch.float64)  # nonzero at padded positions too
    return x, pad, g


@pytest.mark.parametrize("group_num", [None, 1, 2])
def test_powernorm_all_positions_agrees_with_authors_over_many_steps(group_num):
    gen = torch.Generator().manual_seed(10 + (group_num or 0))
    t, b, c, warm, steps, lr = 7, 5, 4, 6, 40, 0.05
    kw = {"alpha_fwd": 0.8, "alpha_bkw": 0.7, "warmup_iters": warm}
    ours = normscope.PowerNorm(c, **kw, group_scaling=group_num, ema_gz_over="all", dtype=torch.float64)
    auth = AuthorsPowerNorm(c, 0.8, 0.7, warm, group_num or 1)
    if group_num is None:  # the authors always scale; without it, compare against unscaled input
        auth._group_scaling = lambda x: x
    for step in range(steps):  # warm-up (1..6) and running statistics (7..40)
        x, pad, g = _batch(gen, t, b, c, step)
        y1, gx1 = _ours_step(ours, x, pad, g)
        y2, gx2, dw, db = auth.train_step(x, pad, g)
        valid = ~pad.T
        torch.testing.assert_close(y1, y2, **F64)
        torch.testing.assert_close(ours.running_phi, auth.running_phi, **F64)
        torch.testing.assert_close(ours.ema_gz, auth.ema_gz, **F64)
        torch.testing.assert_close(ours.weight.grad, dw, **F64)
        torch.testing.assert_close(ours.bias.grad, db, **F64)
        torch.testing.assert_close(gx1[valid], gx2[valid], **F64)
        assert torch.equal(gx1[~valid], torch.zeros_like(gx1[~valid]))  # where we mean to differ
        if step > 1 and (~valid).any():
            assert gx2[~valid].abs().max() > 1e-6  # ... and the authors do send gradient there
        _sgd(ours, lr), auth.sgd(dw, db, lr)
    ours.eval()
    x = torch.randn(t, b, c, generator=gen, dtype=torch.float64)
    torch.testing.assert_close(ours(x.transpose(0, 1)).transpose(0, 1), auth.eval(x), **F64)


@pytest.mark.parametrize("group_num", [None, 2])
def test_powernorm_valid_tokens_is_the_authors_algorithm_on_the_valid_tokens_alone(group_num):
    """Default ``ema_gz_over="valid"``: the padded batch gives what the authors' algorithm gives
    on the same tokens with the padding removed (one sequence of the K valid tokens)."""
    gen = torch.Generator().manual_seed(3)
    t, b, c, warm, steps, lr = 6, 4, 4, 5, 30, 0.05
    ours = normscope.PowerNorm(c, warmup_iters=warm, group_scaling=group_num, dtype=torch.float64)
    auth = AuthorsPowerNorm(c, 0.9, 0.9, warm, group_num or 1)
    if group_num is None:
        auth._group_scaling = lambda x: x
    for step in range(steps):
        x, pad, g = _batch(gen, t, b, c, step)
        valid = ~pad.T
        g = g * valid[..., None]  # the padded outputs feed no loss here, so the affine grads compare
        y1, gx1 = _ours_step(ours, x, pad, g)
        xv, gv = x[valid][:, None, :], g[valid][:, None, :]  # (K, 1, C), no padding
        y2, gx2, dw, db = auth.train_step(xv, torch.zeros(1, xv.shape[0], dtype=torch.bool), gv)
        torch.testing.assert_close(y1[valid], y2[:, 0], **F64)
        torch.testing.assert_close(gx1[valid], gx2[:, 0], **F64)
        torch.testing.assert_close(ours.running_phi, auth.running_phi, **F64)
        torch.testing.assert_close(ours.ema_gz, auth.ema_gz, **F64)
        torch.testing.assert_close(ours.weight.grad, dw, **F64)
        torch.testing.assert_close(ours.bias.grad, db, **F64)
        assert torch.equal(gx1[~valid], torch.zeros_like(gx1[~valid]))
        _sgd(ours, lr), auth.sgd(dw, db, lr)


@pytest.mark.parametrize("over", ["valid", "all"])
def test_powernorm_padded_positions_get_exactly_zero_gradient_every_step(over):
    """Over many steps in fp64: x.grad at padding is exactly 0 each step,
    even when the loss reads the padded outputs (upstream gradient nonzero there)."""
    torch.manual_seed(0)
    pn = normscope.PowerNorm(4, warmup_iters=10, ema_gz_over=over, dtype=torch.float64)
    for step in range(60):  # warm-up, then running statistics
        x = torch.randn(3, 5, 4, dtype=torch.float64, requires_grad=True)
        mask = torch.rand(3, 5) > 0.4
        mask[:, 0] = True
        y = pn(x, mask)
        (y.sum() if step % 2 else y[mask].sum()).backward()
        assert torch.equal(x.grad[~mask], torch.zeros_like(x.grad[~mask])), step
        assert x.grad[mask].abs().sum() > 0
    assert pn.ema_gz.abs().max() > 0  # the correction term was live


def test_powernorm_padded_positions_get_no_gradient_on_the_second_step():
    """The backward state from the first step must not leak gradient into the second step's padding."""
    pn = normscope.PowerNorm(4, warmup_iters=10)
    mask = torch.tensor([[True, True, False, False]])
    for _ in range(2):
        x = torch.randn(1, 4, 4, requires_grad=True)
        pn(x, mask)[mask].sum().backward()
        assert torch.equal(x.grad[~mask], torch.zeros(2, 4))


def test_powernorm_valid_state_does_not_depend_on_the_amount_of_padding():
    """Why "valid" is the default: the same tokens padded more leave every state and every valid
    gradient unchanged; the authors' all-position mean shrinks ema_gz by the valid fraction."""
    torch.manual_seed(4)
    states = {}
    for over in ("valid", "all"):
        for extra in (0, 9):
            pn = normscope.PowerNorm(3, warmup_iters=3, ema_gz_over=over, dtype=torch.float64)
            gen = torch.Generator().manual_seed(5)
            for _ in range(8):
                x = torch.randn(2, 4, 3, generator=gen, dtype=torch.float64)
                g = torch.randn(2, 4, 3, generator=gen, dtype=torch.float64)
                xp = torch.cat([x, torch.randn(2, extra, 3, dtype=torch.float64)], 1).requires_grad_()
                mask = torch.arange(4 + extra)[None, :].expand(2, -1) < 4
                pn(xp, mask).backward(torch.cat([g, torch.zeros(2, extra, 3, dtype=torch.float64)], 1))
            states[over, extra] = (pn.ema_gz.clone(), pn.running_phi.clone(), xp.grad[:, :4].clone())
    for a, b in zip(states["valid", 0], states["valid", 9]):
        torch.testing.assert_close(a, b, **F64)
    assert not torch.allclose(states["all", 0][0], states["all", 9][0])


def test_powernorm_inf_padding_stays_out_with_valid_average():
    pn = normscope.PowerNorm(3, warmup_iters=2)
    for _ in range(4):
        x = torch.randn(2, 4, 3)
        x[:, 3] = float("inf")
        x.requires_grad_()
        mask = torch.tensor([[True, True, True, False]] * 2)
        pn(x, mask)[mask].sum().backward()
        assert torch.isfinite(pn.ema_gz).all() and torch.isfinite(x.grad).all()
        assert torch.equal(x.grad[~mask], torch.zeros(2, 3))



@pytest.mark.parametrize("fill", [float("inf"), float("nan"), torch.finfo(torch.float32).max])
def test_powernorm_group_scaling_keeps_non_finite_padding_out_of_the_gradient(fill):
    # with group scaling the padded token's own RMS (GroupScaling1D) was differentiated: its backward turned
    # the zero gradient PowerNorm sends to padding into NaN there (a finite finfo.max fill included), and
    # from there into whatever produced the padding. Independent computation: the same valid tokens with
    # zeros as padding, whose gradient there is exactly 0 (as the test above without group scaling)
    gen = torch.Generator().manual_seed(0)
    mask = torch.tensor([[True, True, True, False]] * 2)
    layers = [normscope.PowerNorm(4, warmup_iters=2, group_scaling=2) for _ in range(2)]
    for _ in range(3):
        x = torch.randn(2, 4, 4, generator=gen)
        grads = []
        for layer, pad in zip(layers, (0.0, fill)):
            xp = x.clone()
            xp[~mask] = pad
            xp.requires_grad_()
            layer(xp, mask)[mask].sum().backward()
            grads.append(xp.grad)
        assert torch.equal(grads[1][~mask], torch.zeros(2, 4))
        torch.testing.assert_close(grads[1], grads[0])


def test_powernorm_ema_gz_over_is_checked():
    with pytest.raises(ValueError, match="ema_gz_over"):
        normscope.PowerNorm(4, ema_gz_over="pads")
    assert "ema_gz_over='all'" in repr(normscope.PowerNorm(4, ema_gz_over="all"))


TOL = dict(atol=2e-5, rtol=1e-5)


# -- PowerNorm: a step-by-step port of the reference code (sIncerass/powernorm, mask_powernorm.py) --


class _PortFunction(torch.autograd.Function):
    """The reference's PowerFunction, written out: x is (B, C, T, 1), mask_x the valid tokens (K, C)."""

    @staticmethod
    def forward(ctx, x, weight, bias, running_phi, eps, afwd, abkw, ema_gz, warmup_iters, current_iter, mask_x):
        c = x.shape[1]
        var = (mask_x * mask_x).mean(dim=0).reshape(1, c, 1, 1)
        if current_iter <= warmup_iters:
            z = x / (var + eps).sqrt()
        else:
            z = x / (running_phi + eps).sqrt()
        ctx.save_for_backward(z, var, weight)
        ctx.eps, ctx.abkw, ctx.ema_gz = eps, abkw, ema_gz
        if current_iter < warmup_iters:
            running_phi.copy_(running_phi * (current_iter - 1) / current_iter + var / current_iter)
        running_phi.copy_(afwd * running_phi + (1 - afwd) * var)
        return weight.reshape(1, c, 1, 1) * z + bias.reshape(1, c, 1, 1)

    @staticmethod
    def backward(ctx, grad_output):
        z, var, weight = ctx.saved_tensors
        c = z.shape[1]
        g = grad_output * weight.reshape(1, c, 1, 1)
        approx = g - (1 - ctx.abkw) * ctx.ema_gz * z
        ctx.ema_gz.add_((approx * z).mean(dim=3, keepdim=True).mean(dim=2, keepdim=True).mean(dim=0, keepdim=True))
        gx = approx / torch.sqrt(var + ctx.eps)
        return gx, (grad_output * z).sum((0, 2, 3)), grad_output.sum((0, 2, 3)), *([None] * 8)


class _PortPowerNorm(nn.Module):
    """The reference's MaskPowerNorm: input (T, B, C), pad_mask (B, T) with True = padding."""

    def __init__(self, c, alpha_fwd, alpha_bkw, warmup_iters, group_num, eps=1e-5):
        super().__init__()
        self.weight, self.bias = nn.Parameter(torch.ones(c)), nn.Parameter(torch.zeros(c))
        self.running_phi = torch.ones(1, c, 1, 1)
        self.ema_gz = torch.zeros(1, c, 1, 1)
        self.iters = 0
        self.c, self.eps, self.afwd, self.abkw = c, eps, alpha_fwd, alpha_bkw
        self.warmup_iters, self.group_num = warmup_iters, group_num

    def forward(self, x, pad_mask=None):
        t, b, c = x.shape
        if self.group_num:  # GroupScaling1D
            cg = c // self.group_num
            m2 = (x.reshape(t, b, self.group_num, cg) ** 2).mean(3, keepdim=True)
            x = x / torch.sqrt(m2.repeat_interleave(cg, dim=-1).reshape(t, b, c) + 1e-5)
        mask_input = x.clone() if pad_mask is None else x[~pad_mask.transpose(0, 1), :]
        mask_input = mask_input.reshape(-1, c)
        inp = x.permute(1, 2, 0).reshape(b, c, -1).unsqueeze(-1)
        if self.training:
            self.iters += 1
            out = _PortFunction.apply(
                inp, self.weight, self.bias, self.running_phi, self.eps, self.afwd, self.abkw, self.ema_gz,
                self.warmup_iters, self.iters, mask_input,
            )
        else:
            out = inp / (self.running_phi + self.eps).sqrt()
            out = self.weight.reshape(1, c, 1, 1) * out + self.bias.reshape(1, c, 1, 1)
        return out.reshape(b, c, t).permute(2, 0, 1)


def _sgd_step(module, lr=0.1):
    with torch.no_grad():
        for p in module.parameters():
            p -= lr * p.grad
            p.grad = None


@pytest.mark.parametrize("group_scaling", [None, 1, 2])
def test_powernorm_matches_reference_port(group_scaling):
    torch.manual_seed(1)
    c, steps = 6, 5
    ours = normscope.PowerNorm(c, alpha_fwd=0.8, alpha_bkw=0.7, warmup_iters=2, group_scaling=group_scaling)
    port = _PortPowerNorm(c, 0.8, 0.7, 2, group_scaling)
    for step in range(steps):  # covers warm-up (steps 1-2) and running statistics (3-5)
        x = torch.randn(7, 3, c) * (1 + step) + 0.5
        x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
        y1, y2 = ours(x1), port(x2)
        torch.testing.assert_close(y1, y2, **TOL)
        g = torch.randn_like(y1)
        y1.backward(g), y2.backward(g)
        torch.testing.assert_close(x1.grad, x2.grad, **TOL)
        torch.testing.assert_close(ours.weight.grad, port.weight.grad, **TOL)
        torch.testing.assert_close(ours.bias.grad, port.bias.grad, **TOL)
        torch.testing.assert_close(ours.running_phi, port.running_phi.flatten(), **TOL)
        torch.testing.assert_close(ours.ema_gz, port.ema_gz.flatten(), **TOL)
        _sgd_step(ours), _sgd_step(port)
    ours.eval(), port.eval()
    x = torch.randn(4, 2, c)
    torch.testing.assert_close(ours(x), port(x), **TOL)


def test_powernorm_mask_equals_valid_tokens_alone():
    torch.manual_seed(2)
    c = 5
    ours = normscope.PowerNorm(c, warmup_iters=1, channel_dim=-1)
    port = _PortPowerNorm(c, 0.9, 0.9, 1, None)
    for _ in range(3):
        x = torch.randn(4, 6, c)  # (B, S, C)
        mask = torch.rand(4, 6) > 0.4
        mask[0, 0] = True
        x1 = x.clone().requires_grad_()
        y1 = ours(x1, mask)
        xv = x[mask].clone().requires_grad_()  # (K, C): valid tokens, as (T=K, B=1, C) for the port
        yv = port(xv.unsqueeze(1)).squeeze(1)
        torch.testing.assert_close(y1[mask], yv, **TOL)
        g = torch.randn_like(yv)
        y1[mask].backward(g), yv.backward(g)
        torch.testing.assert_close(x1.grad[mask], xv.grad, **TOL)
        torch.testing.assert_close(ours.weight.grad, port.weight.grad, **TOL)
        torch.testing.assert_close(ours.running_phi, port.running_phi.flatten(), **TOL)
        torch.testing.assert_close(ours.ema_gz, port.ema_gz.flatten(), **TOL)
        _sgd_step(ours), _sgd_step(port)


def test_powernorm_channels_first_and_errors():
    pn = normscope.PowerNorm(4, channel_dim=1, warmup_iters=0)
    pn.running_phi.copy_(torch.tensor([1.0, 4.0, 9.0, 0.25]))
    x = torch.randn(3, 4, 5)
    pn.eval()
    torch.testing.assert_close(pn(x), x / torch.sqrt(pn.running_phi + 1e-5)[:, None], **TOL)
    with pytest.raises(ValueError, match="4 features at dim 1"):
        pn(torch.randn(3, 5, 4))
    with pytest.raises(ValueError, match="group_scaling"):
        normscope.PowerNorm(6, group_scaling=4)


@pytest.mark.parametrize("name", ["num_batches_tracked", "running_phi"])
def test_powernorm_buffer_set_to_none_after_a_call_is_refused_by_name(name):
    """A training step reads the step count and running_phi: either set to None after a call is a
    ValueError naming it, with the state as it was (an AttributeError from ``.add_``/``.numel`` before);
    the layer with the buffer back evaluates as the formula x / sqrt(running_phi + eps)."""
    torch.manual_seed(0)
    pn = normscope.PowerNorm(4, warmup_iters=0)
    x = torch.randn(3, 5, 4)
    pn(x)
    kept = getattr(pn, name)
    refused_with_state_kept(pn, swap(name, None), x, ValueError, [f"`{name}`", "got None"])
    setattr(pn, name, kept)
    pn.eval()
    torch.testing.assert_close(pn(x), x / torch.sqrt(pn.running_phi + 1e-5), **TOL)


def test_powernorm_empty_batch_leaves_state():
    """An empty batch set running_phi to 0 (eval outputs 316x too large afterwards)."""
    torch.manual_seed(0)
    p = normscope.PowerNorm(4, warmup_iters=0)
    p(torch.randn(8, 5, 4) * 2)
    state = {k: v.clone() for k, v in p.state_dict().items()}
    y = p(torch.randn(0, 5, 4))
    assert y.shape == (0, 5, 4)
    y = p(torch.randn(3, 0, 4), torch.zeros(3, 0, dtype=torch.bool))
    assert y.shape == (3, 0, 4)
    for k, v in p.state_dict().items():
        torch.testing.assert_close(v, state[k], msg=k)


def test_powernorm_warmup_matches_loop_formula():
    """The tensor-valued step counter gives the reference's warm-up rule, step by step."""
    torch.manual_seed(0)
    p = normscope.PowerNorm(3, warmup_iters=3, alpha_fwd=0.8)
    phi = torch.ones(3, dtype=torch.float64)
    for it in range(1, 6):
        x = torch.randn(4, 5, 3) * it
        y = p(x)
        phi_b = x.double().square().mean((0, 1))
        used = phi_b if it <= 3 else phi
        torch.testing.assert_close(y.double(), x.double() / torch.sqrt(used + 1e-5), atol=1e-5, rtol=1e-5)
        if it < 3:
            phi = phi * (it - 1) / it + phi_b / it
        phi = 0.8 * phi + 0.2 * phi_b
        torch.testing.assert_close(p.running_phi.double(), phi, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"warmup_iters": -5}, ValueError, r"`warmup_iters` to be a non-negative int, got -5"),
        ({"warmup_iters": "a"}, TypeError, r"`warmup_iters` to be a non-negative int, got str 'a'"),
        ({"warmup_iters": 2.5}, TypeError, r"`warmup_iters` to be a non-negative int, got float 2.5"),
        (
            {"group_scaling": True},
            ValueError,
            r"`group_scaling` to be None or a positive int dividing num_features=6, got True",
        ),
        ({"group_scaling": 4}, ValueError, r"`group_scaling` .* got 4"),
        ({"eps": -1.0}, ValueError, r"`eps` to be a positive number, got -1.0"),
    ],
)
def test_powernorm_errors_name_the_argument(kwargs, error, match):
    """warm-up errors showed warmup_iters + 1 (or a str concatenation error); group_scaling=True
    fell through to the engine's 'Scope `groups`' message. A value of the wrong type is a TypeError."""
    with pytest.raises(error, match=match):
        normscope.PowerNorm(6, **kwargs)


_POWER_CASES = [
    ("weight_size", swap("weight", torch.ones(5)), None, ValueError, ["weight", "(6,)", "(5,)"]),
    ("weight_device", swap("weight", torch.ones(6, device="meta")), None, ValueError, ["weight", "meta"]),
    ("eps_negative", swap("eps", -1.0), None, ValueError, ["eps", "-1.0"]),
    ("eps_nan", swap("eps", math.nan), None, ValueError, ["eps", "nan"]),
    ("input_device", lambda m: None, torch.randn(4, 5, 6, device="meta"), ValueError, ["meta"]),
    ("running_phi_size", lambda m: setattr(m, "running_phi", torch.ones(5)), None, ValueError, ["running_phi", "(5,)"]),
]


@pytest.mark.parametrize("mutate, x, exc, fragments", [c[1:] for c in _POWER_CASES], ids=[c[0] for c in _POWER_CASES])
def test_power_norm_training_refuses_before_its_state_moves(mutate, x, exc, fragments):
    torch.manual_seed(0)
    m = normscope.PowerNorm(6, warmup_iters=2)
    good = torch.randn(4, 5, 6)
    m(good)
    refused_with_state_kept(m, mutate, good if x is None else x, exc, fragments)


@pytest.mark.parametrize("affine", [True, False])
def test_powernorm_made_on_meta_is_initialized_by_reset_parameters(affine):
    # construction on device="meta", to_empty, reset_parameters: torch's way to build a large model without
    # allocating it twice. PowerNorm had no reset_parameters: its weight and bias stayed uninitialized memory
    pn = normscope.PowerNorm(4, affine=affine, device="meta").to_empty(device="cpu")
    with torch.no_grad():
        for t in pn.state_dict().values():
            t.fill_(7)  # what uninitialized memory may hold
    pn.reset_parameters()
    want = {"running_phi": torch.ones(4), "ema_gz": torch.zeros(4), "num_batches_tracked": torch.tensor(0)}
    if affine:
        want.update(weight=torch.ones(4), bias=torch.zeros(4))
    got = pn.state_dict()
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        assert torch.equal(got[k], v), k
