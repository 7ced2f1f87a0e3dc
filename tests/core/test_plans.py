"""Plans made in one global state serve calls in another: the hot path keys a plan by the call's
signature (normscope.hot), never by grad mode, autocast, the default dtype, deterministic algorithms
or the intra-op thread count -- so whatever a plan's runner decides from these it must decide per
call. After warm calls in one state, the next call in another gives torch.nn's output and gradients
in that state, bit for bit (for a single sample of the batch-invariant paths: the bits torch.nn gives
that sample inside a batch). Tensor mutations after warm calls: tests/core/test_hot_path_state.py."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

import normscope

# (name, constructor arguments, input shape)
LAYERS = [
    ("LayerNorm", (8,), (3, 5, 8)),
    ("GroupNorm", (2, 4), (3, 4, 5)),
    ("BatchNorm2d", (4,), (2, 4, 3, 3)),
    ("InstanceNorm2d", (4,), (2, 4, 3, 5)),
]


@contextlib.contextmanager
def _setting(get, set_, value):
    """A global torch setting at ``value`` inside the block, as it was after it."""
    before = get()
    set_(value)
    try:
        yield
    finally:
        set_(before)


def _threads(n: int):
    return _setting(torch.get_num_threads, torch.set_num_threads, n)


STATES = {
    "grad": contextlib.nullcontext,
    "no_grad": torch.no_grad,
    "inference_mode": torch.inference_mode,
    "autocast-bf16": lambda: torch.autocast("cpu", dtype=torch.bfloat16),
    "default-float64": lambda: _setting(torch.get_default_dtype, torch.set_default_dtype, torch.float64),
    "deterministic": lambda: _setting(
        torch.are_deterministic_algorithms_enabled, torch.use_deterministic_algorithms, True
    ),
    "one-thread": lambda: _threads(1),
}
# a plan made in each state serves a plain call (autograd recording), and a plain call's plan serves each
TRANSITIONS = [(a, "grad") for a in STATES if a != "grad"] + [("grad", b) for b in STATES if b != "grad"]


def _pair(name: str, args: tuple) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    kw = {"affine": True} if name.startswith("Instance") else {}
    theirs, ours = getattr(nn, name)(*args, **kw), getattr(normscope, name)(*args, **kw)
    with torch.no_grad():
        for p in theirs.parameters():
            p.copy_(torch.randn_like(p))
    ours.load_state_dict(theirs.state_dict())
    return ours, theirs


def _run(m: nn.Module, x: torch.Tensor, state: str):
    """Output and input gradient (None where the state records none) of one call in ``state``."""
    x = x.detach().clone().requires_grad_()
    with STATES[state]():
        y = m(x)
    if not y.requires_grad:
        return y.detach(), None
    (g,) = torch.autograd.grad(y.float().sin().sum(), x)
    return y.detach(), g


@pytest.mark.parametrize("name, args, shape", LAYERS, ids=[n for n, _, _ in LAYERS])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_plan_made_in_one_global_state_serves_a_call_in_another_as_torch(name, args, shape, dtype):
    ours, theirs = _pair(name, args)
    torch.manual_seed(1)
    x = torch.randn(shape).to(dtype)
    for first, then in TRANSITIONS:
        for state in (first, first, then):  # two warm calls in the first state, then the call that reuses them
            got, want = _run(ours, x, state), _run(theirs, x, state)
            where = f"{first} -> {then}, call in {state}"
            assert got[0].dtype == want[0].dtype and torch.equal(got[0], want[0]), f"{where}: output"
            assert (got[1] is None) == (want[1] is None), f"{where}: gradient recorded"
            if want[1] is not None:
                torch.testing.assert_close(got[1], want[1], msg=lambda m, w=where: f"{w}: input gradient: {m}")
        for (k, a), b in zip(ours.state_dict().items(), theirs.state_dict().values()):
            assert torch.equal(a, b), f"{first} -> {then}: {k}"


@pytest.mark.parametrize(
    "make, shape",
    [
        # one group of several channels alone (ATen's lone-group order: normscope pairs the sample), and
        # one scope of >= 32768 elements (split across intra-op threads alone): see normscope._registry
        (lambda: normscope.GroupNorm(1, 4), (5, 4, 30)),
        (lambda: normscope.RMSNorm(40000), (3, 40000)),
    ],
    ids=["GroupNorm-lone-group", "RMSNorm-large-row"],
)
def test_a_single_samples_plan_keeps_its_batch_bits_as_grad_mode_and_threads_change(make, shape):
    """A batch of one's plan decides per call whether to pair the sample (two intra-op threads and
    more, an input gradient recorded): made in one state, it keeps the bits torch.nn gives the sample
    inside a batch in every other."""
    torch.manual_seed(0)
    layer = make()
    theirs = (nn.GroupNorm(1, 4) if isinstance(layer, nn.GroupNorm) else nn.RMSNorm(shape[1:])).requires_grad_(False)
    xb = torch.randn(shape)
    # planned with one thread first (where the sample runs alone), then served with two
    steps = [(1, "grad"), (2, "grad"), (2, "inference_mode"), (1, "no_grad"), (2, "no_grad"), (2, "grad")]
    for threads, state in steps * 2:
        with _threads(threads):
            xs = xb[2:3].clone().requires_grad_(state == "grad")
            xa = xb.clone().requires_grad_(state == "grad")
            with STATES[state]():
                got, want = layer(xs), theirs(xa)
            where = f"{threads} threads, {state}"
            assert torch.equal(got, want[2:3]), f"{where}: output"
            if state == "grad":
                gy = torch.randn_like(want)
                (g_got,) = torch.autograd.grad(got, xs, gy[2:3])
                (g_want,) = torch.autograd.grad(want, xa, gy)
                assert torch.equal(g_got, g_want[2:3]), f"{where}: input gradient"
