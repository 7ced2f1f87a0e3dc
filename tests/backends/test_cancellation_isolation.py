"""Scope isolation under the ATen backend's cancellation guard: when one scope of an fp32 CPU call
cancels (``|mean| * rstd`` past 1024: torch's one multiply-add loses the output), only that scope is
recomputed in float64; every other scope keeps torch's bits, output and input gradient, whatever it
is batched with. Before, the whole call was recomputed, so a sample's bits depended on its batch
(timm's resnest14d showed it: one channel of (2, 256, 1, 1) changed 247 others).

Oracles: torch.nn.functional on the ordinary scopes alone (bitwise), float64 on the cancelling one."""

import pytest
import torch
import torch.nn.functional as tF

import normscope
from normscope import functional as F


def _cancelling(shape, g):
    """Values of one scope with mean 1e4 and spread 1e-2: |mean| * rstd ~ 1e6."""
    return 1e4 + 1e-2 * torch.randn(shape, generator=g)


def _grads(y, inputs, dy):
    return torch.autograd.grad(y, inputs, dy)


@pytest.mark.parametrize("op", ["layer_norm", "group_norm", "instance_norm", "batch_norm", "batch_norm_eval"])
def test_only_the_cancelling_scope_is_recomputed(op):
    g = torch.Generator().manual_seed(0)
    if op == "layer_norm":
        x = torch.randn(5, 64, generator=g)
        x[2] = _cancelling(64, g)
        w, b = torch.randn(64, generator=g), torch.randn(64, generator=g)

        def ours(x):
            return F.layer_norm(x, (64,), w, b)

        def theirs(x):
            return tF.layer_norm(x, (64,), w, b)

        ordinary, bad = [0, 1, 3, 4], 2
    elif op in ("group_norm", "instance_norm"):
        x = torch.randn(3, 8, 4, 4, generator=g)
        if op == "group_norm":
            x[1, 2:4] = _cancelling((2, 4, 4), g)  # sample 1, group 1 (channels 2 and 3)
        else:
            x[1, 5] = _cancelling((4, 4), g)
        w, b = torch.randn(8, generator=g), torch.randn(8, generator=g)
        if op == "group_norm":

            def ours(x):
                return F.group_norm(x, 4, w, b)

            def theirs(x):
                return tF.group_norm(x, 4, w, b)

        else:

            def ours(x):
                return F.instance_norm(x, weight=w, bias=b)

            def theirs(x):
                return tF.instance_norm(x, weight=w, bias=b)

        ordinary, bad = [0, 2], 1  # whole samples: their scopes never meet the cancelling one
    else:
        x = torch.randn(6, 5, 3, generator=g)
        x[:, 3] = _cancelling((6, 3), g)
        w, b = torch.randn(5, generator=g), torch.randn(5, generator=g)
        training = op == "batch_norm"
        rm = torch.zeros(5) if training else torch.tensor([0.1, -0.2, 0.3, 1e4, 0.0])
        rv = torch.ones(5) if training else torch.tensor([1.0, 2.0, 0.5, 1e-4, 1.0])

        def ours(x):
            return F.batch_norm(x, rm.clone(), rv.clone(), w, b, training)

        def theirs(x):
            return tF.batch_norm(x, rm.clone(), rv.clone(), w, b, training)

        ordinary, bad = [0, 1, 2, 4], 3  # channels
    x = x.requires_grad_()
    dy = torch.randn(x.shape, generator=g)
    y = ours(x)
    assert normscope.last_backend() == "reference"  # part of the call was recomputed, and says so
    (gx,) = _grads(y, (x,), dy)
    yt = theirs(x)
    (gt,) = _grads(yt, (x,), dy)
    pick = (lambda t, i: t[:, i]) if op.startswith("batch_norm") else (lambda t, i: t[i])
    for i in ordinary:
        assert torch.equal(pick(y, i), pick(yt, i)), f"{op}: scope {i} lost torch's bits beside a cancelling one"
        assert torch.equal(pick(gx, i), pick(gt, i)), f"{op}: scope {i}'s input gradient lost torch's bits"
    # the cancelling scope against float64: torch's op on float64 input and parameters
    x64, wd, bd = x.detach().double(), w.double(), b.double()
    if op == "layer_norm":
        y64 = tF.layer_norm(x64, (64,), wd, bd)
    elif op == "group_norm":
        y64 = tF.group_norm(x64, 4, wd, bd)
    elif op == "instance_norm":
        y64 = tF.instance_norm(x64, weight=wd, bias=bd)
    else:
        y64 = tF.batch_norm(x64, rm.double(), rv.double(), wd, bd, op == "batch_norm")
    err = (pick(y, bad).double() - pick(y64, bad)).abs().max().item()
    err_torch = (pick(yt, bad).double() - pick(y64, bad)).abs().max().item()
    assert err <= max(1e-5, err_torch / 10), (
        f"{op}: the cancelling scope is {err:.2e} off float64 (torch {err_torch:.2e})"
    )
