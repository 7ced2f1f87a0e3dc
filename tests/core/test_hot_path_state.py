"""The hot path (normscope.hot) is correct by construction: after warm calls, every tensor a layer
reads may change in every way torch allows -- data swapped for a shorter, longer or other-dtype
tensor, resized in place, replaced, set to None, loaded, moved -- and the next call gives exactly what
torch.nn gives on the same state: the same output, gradients and buffers, or an error where torch
raises (never a result read from past a tensor's end, never a buffer written past its end).

And the layers work under activation checkpointing as torch.nn's do: both implementations of
``torch.utils.checkpoint``, early stop on and off, pre-norm and post-norm blocks (where the norm is
the last tensor-saving op of the region, which checkpointing stops at by raising an exception).
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

import normscope
import normscope.functional as NF

# (name, constructor arguments, input shape): torch.nn and normscope take the same arguments
LAYERS = [
    ("LayerNorm", (8,), {}, (3, 5, 8)),
    ("RMSNorm", (8,), {}, (3, 5, 8)),
    ("GroupNorm", (2, 4), {}, (3, 4, 5)),
    ("BatchNorm1d", (4,), {}, (6, 4)),
    ("BatchNorm2d", (4,), {}, (2, 4, 3, 3)),
    ("BatchNorm2d", (4,), {"momentum": None}, (2, 4, 3, 3)),
    ("BatchNorm3d", (4,), {}, (2, 4, 2, 2, 2)),
    ("InstanceNorm1d", (4,), {"affine": True}, (3, 4, 6)),
    ("InstanceNorm2d", (4,), {"affine": True, "track_running_stats": True}, (2, 4, 3, 5)),
]
IDS = [f"{n}{'-' + '-'.join(f'{k}={v}' for k, v in kw.items()) if kw else ''}" for n, _, kw, _ in LAYERS]
NAMES = ("weight", "bias", "running_mean", "running_var", "num_batches_tracked")


def _pair(name, args, kw):
    torch.manual_seed(0)
    theirs = getattr(nn, name)(*args, **kw)
    ours = getattr(normscope, name)(*args, **kw)
    with torch.no_grad():  # non-trivial affine, so that a wrong weight or bias shows
        for p in theirs.parameters():
            p.copy_(torch.randn_like(p))
    ours.load_state_dict(theirs.state_dict())
    return ours, theirs


def _mutations(t: torch.Tensor):
    """``(label, mutate)``: each changes one tensor of a layer in place of its object or its data."""
    n = t.numel()
    return [
        ("data-shorter", lambda m, k: setattr(getattr(m, k), "data", getattr(m, k).data[:1].clone())),
        ("data-longer", lambda m, k: setattr(getattr(m, k), "data", torch.cat([getattr(m, k).data] * 3))),
        ("data-float64", lambda m, k: setattr(getattr(m, k), "data", getattr(m, k).data.double())),
        ("data-bfloat16", lambda m, k: setattr(getattr(m, k), "data", getattr(m, k).data.bfloat16())),
        ("data-2d", lambda m, k: setattr(getattr(m, k), "data", getattr(m, k).data.reshape(1, n).clone())),
        ("resize-shorter", lambda m, k: getattr(m, k).data.resize_(max(n // 2, 1))),
        ("resize-longer", lambda m, k: getattr(m, k).data.resize_(2 * n)),
        ("replaced-shorter", lambda m, k: _replace(m, k, getattr(m, k).data[:1].clone())),
        ("replaced-same", lambda m, k: _replace(m, k, getattr(m, k).data.clone() * 2)),
        ("set-none", lambda m, k: setattr(m, k, None)),
        ("data-values", lambda m, k: setattr(getattr(m, k), "data", getattr(m, k).data.clone() + 1)),
    ]


def _replace(m, k, value):
    if k in m._parameters:
        setattr(m, k, nn.Parameter(value))
    else:
        setattr(m, k, value)


def _run(m, x, gy):
    """(output, input gradient, parameter gradients) of one call, or the exception it raised."""
    x = x.detach().clone().requires_grad_()
    try:
        y = m(x)
        y.backward(gy)
    except Exception as err:  # the test compares what torch does with what we do, errors included
        return err
    return y.detach(), x.grad, [None if p.grad is None else p.grad.clone() for p in m.parameters()]


def _state(m):
    return {k: v.detach().clone() for k, v in m.state_dict().items() if v is not None}


def _compare(ours, theirs, x, gy, where):
    before = _state(ours)
    got, want = _run(ours, x, gy), _run(theirs, x, gy)
    if isinstance(want, RuntimeError) and "does not have a device" in str(want) and theirs.weight is None:
        # torch's group_norm backward with a bias and no weight raises (a torch bug normscope does not
        # share): torch's output and input gradient are those of the same call with a weight of ones
        # (the bias gradient, against dy's sum: tests/core/test_torch_parity_edges.py)
        ones = copy.deepcopy(theirs)
        ones.weight = nn.Parameter(torch.ones_like(theirs.bias))
        want = _run(ones, x, gy)
        if not isinstance(want, Exception):
            want, got = (want[0], want[1], []), got if isinstance(got, Exception) else (*got[:2], [])
    if isinstance(want, Exception):
        # ours refuses in its own terms before any work, or fails exactly as torch does
        same = type(got) is type(want) and str(got) == str(want)
        assert same or isinstance(got, (ValueError, TypeError)), (
            f"{where}: torch raised {want!r}; normscope gave {got!r}"
        )
        # a refused call changes no state (no buffer written past its end, or at all)
        after = _state(ours)
        assert before.keys() == after.keys(), where
        for k in before:
            if k != "num_batches_tracked":  # torch counts the batch before it checks, and so do we
                torch.testing.assert_close(after[k], before[k], msg=lambda m, k=k: f"{where}: {k}: {m}")
        return
    assert not isinstance(got, Exception), f"{where}: torch ran; normscope raised {got!r}"
    torch.testing.assert_close(got[0], want[0], msg=lambda m, where=where: f"{where}: output: {m}")
    torch.testing.assert_close(got[1], want[1], msg=lambda m, where=where: f"{where}: input grad: {m}")
    for a, b in zip(got[2], want[2]):
        if a is None or b is None:
            assert a is b, where
        else:
            torch.testing.assert_close(a, b, msg=lambda m, where=where: f"{where}: parameter grad: {m}")
    sa, sb = _state(ours), _state(theirs)
    assert sa.keys() == sb.keys(), where
    for k in sa:
        torch.testing.assert_close(sa[k], sb[k], msg=lambda m, k=k: f"{where}: {k}: {m}")


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("spec", LAYERS, ids=IDS)
def test_every_tensor_mutated_after_warm_calls_matches_torch(spec, train):
    name, args, kw, shape = spec
    g = torch.Generator().manual_seed(1)
    x, gy = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    base_ours, base_theirs = _pair(name, args, kw)
    base_ours.train(train), base_theirs.train(train)
    for k in NAMES:
        t = getattr(base_theirs, k, None)
        if t is None:
            continue
        for label, mutate in _mutations(t):
            ours, theirs = copy.deepcopy(base_ours), copy.deepcopy(base_theirs)
            for _ in range(3):  # warm: the signature is planned and its plan run
                _compare(ours, theirs, x, gy, f"{name} {k} warm")
            try:
                mutate(theirs, k)
            except (RuntimeError, TypeError, AttributeError, KeyError, IndexError):
                continue  # torch does not allow this change of this tensor
            mutate(ours, k)
            for i in range(2):  # the first call after the change and the one after it
                _compare(
                    ours, theirs, x, gy, f"{name}({args}, {kw}) {'train' if train else 'eval'}: {k} {label}, call {i}"
                )


@pytest.mark.parametrize("spec", LAYERS, ids=IDS)
def test_load_state_dict_and_to_after_warm_calls_match_torch(spec):
    name, args, kw, shape = spec
    g = torch.Generator().manual_seed(2)
    x, gy = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    ours, theirs = _pair(name, args, kw)
    for _ in range(2):
        _compare(ours, theirs, x, gy, f"{name} warm")
    other = {k: (v.clone() + 0.5 if v.is_floating_point() else v.clone()) for k, v in theirs.state_dict().items()}
    ours.load_state_dict(other), theirs.load_state_dict(other)
    _compare(ours, theirs, x, gy, f"{name} after load_state_dict")
    ours.double(), theirs.double()
    _compare(ours, theirs, x.double(), gy.double(), f"{name} after .double()")
    ours.eval(), theirs.eval()
    _compare(ours, theirs, x.double(), gy.double(), f"{name} after .eval()")
    # an input of another dtype than the (now float64) parameters: refused as torch refuses it
    _compare(ours, theirs, x, gy, f"{name} float32 input, float64 parameters")


def test_batchnorm_weight_data_swapped_for_a_wrong_shape_raises_and_writes_nothing():
    bn = normscope.BatchNorm2d(4)
    x = torch.randn(2, 4, 3, 3)
    bn(x), bn(x)
    bn.weight.data = torch.arange(1.0)
    with pytest.raises(ValueError, match="weight"):
        bn(x)
    bn = normscope.BatchNorm2d(4)
    bn(x), bn(x)
    bn.running_mean.data = torch.zeros(1)
    with pytest.raises(ValueError, match="running_mean"):
        bn(x)
    assert bn.running_mean.shape == (1,) and bn.running_mean.item() == 0.0


# ---------------------------------------------------------------------------------------------
# activation checkpointing


class _Block(nn.Module):
    """``x + f(norm(x))`` (pre-norm) or ``norm(x + f(x))`` (post-norm: the norm is the region's last
    tensor-saving op); ``f`` saves its input (sin), so the recomputation has something to stop at."""

    def __init__(self, norm: nn.Module, post: bool) -> None:
        super().__init__()
        self.norm, self.post = norm, post

    def forward(self, x):
        if self.post:
            return self.norm(x + torch.sin(x))
        return x + torch.sin(self.norm(x))


def _checkpointed(block, x, reentrant):
    if reentrant:
        return checkpoint(block, x, use_reentrant=True)
    return checkpoint(block, x, use_reentrant=False)


@pytest.mark.parametrize("early_stop", [True, False], ids=["early-stop", "no-early-stop"])
@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize("post", [True, False], ids=["post-norm", "pre-norm"])
@pytest.mark.parametrize("spec", LAYERS, ids=IDS)
def test_layers_under_activation_checkpointing_match_torch(spec, post, reentrant, early_stop):
    name, args, kw, shape = spec
    ours, theirs = _pair(name, args, kw)
    blocks = _Block(ours, post), _Block(theirs, post)
    g = torch.Generator().manual_seed(3)
    ctx = contextlib.nullcontext() if early_stop else set_checkpoint_early_stop(False)
    with ctx:
        for step in range(3):
            x = torch.randn(shape, generator=g)
            gy = torch.randn(shape, generator=g)
            results = []
            for block in blocks:
                xi = x.clone().requires_grad_()
                y = _checkpointed(block, xi, reentrant)
                y.backward(gy)
                results.append((y.detach(), xi.grad, [p.grad.clone() for p in block.parameters()]))
            (y0, g0, p0), (y1, g1, p1) = results
            where = f"{name} {'post' if post else 'pre'}-norm step {step}"
            torch.testing.assert_close(y0, y1, msg=lambda m, where=where: f"{where}: output: {m}")
            torch.testing.assert_close(g0, g1, msg=lambda m, where=where: f"{where}: input grad: {m}")
            for a, b in zip(p0, p1):
                torch.testing.assert_close(a, b, msg=lambda m, where=where: f"{where}: parameter grad: {m}")
    sa, sb = _state(ours), _state(theirs)
    for k in sb:
        torch.testing.assert_close(sa[k], sb[k], msg=lambda m, k=k: f"{name}: {k} after checkpointed steps: {m}")


def test_layer_norm_under_non_reentrant_checkpoint_matches_torchs_gradient():
    x = torch.randn(4, 8, requires_grad=True)
    ln = normscope.LayerNorm(8)
    checkpoint(ln, x, use_reentrant=False).sum().backward()
    x2 = x.detach().clone().requires_grad_()
    torch.nn.functional.layer_norm(x2, (8,), ln.weight, ln.bias).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad)


def test_torch_jit_script_of_any_layer_is_a_typeerror_naming_compile_and_export():
    """torch.jit.script of a normscope layer -- alone or inside a model -- raises a normscope TypeError
    that names what works (torch.compile, torch.export), not TorchScript's error from inside the hot
    path; the model's own modules are left as they were."""
    import normscope.modules as M

    layers = [
        getattr(M, name)
        for name in M.__all__
        if isinstance(getattr(M, name), type) and issubclass(getattr(M, name), nn.Module)
    ]
    assert len(layers) >= 20
    for cls in layers:
        model = nn.Sequential(nn.Linear(4, 4), nn.Identity())
        model[1] = cls.__new__(cls)  # the refusal comes before TorchScript reads anything of the layer
        nn.Module.__init__(model[1])
        with pytest.raises(
            TypeError, match=rf"torch\.jit\.script: normscope's {cls.__name__} .*torch\.compile.*torch\.export"
        ):
            torch.jit.script(model)
    scripted = torch.jit.script(nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4)))  # torch.nn's still script
    assert scripted(torch.randn(2, 4)).shape == (2, 4)


class _CallsFunctionalLayerNorm(nn.Module):
    """A user's module whose forward calls a normscope function (scripted from this file's source)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return NF.layer_norm(x, (4,))


def test_torch_jit_script_of_any_function_is_a_typeerror_naming_compile_and_export():
    """torch.jit.script of a normscope.functional function -- given to it, or called by a scripted
    module's forward -- raises a normscope TypeError naming the function and what works, not
    TorchScript's NotSupportedError from inside the function; the functions still run eagerly."""
    functions = [
        getattr(NF, n) for n in NF.__all__ if callable(getattr(NF, n)) and not isinstance(getattr(NF, n), type)
    ]
    assert len(functions) >= 12
    for fn in functions:
        with pytest.raises(
            TypeError, match=rf"torch\.jit\.script: normscope\.functional\.{fn.__name__} .*torch\.compile"
        ):
            torch.jit.script(fn)
    with pytest.raises(TypeError, match=r"normscope\.functional\.layer_norm .*torch\.export"):
        torch.jit.script(_CallsFunctionalLayerNorm())
    assert NF.layer_norm(torch.randn(2, 4), (4,)).shape == (2, 4)
