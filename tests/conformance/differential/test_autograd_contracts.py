"""Autograd's contracts, not only the numbers, on every backend: a fast path behaves as torch.nn's op
does under autograd.

For every op (LayerNorm, RMSNorm with the model families' options, GroupNorm, InstanceNorm, BatchNorm in
training and evaluation, the masked norms, the modern ops of :mod:`normscope.functional_modern`) and
every path the differential table (:mod:`.ops`) lists for it, each backend forced -- the table that
``test_registry`` holds honest (each listed path runs the op, every other backend refuses it), so a new
backend joins by being registered and listed, and no call here is skipped -- checked against torch's own
functional op -- or, where torch has none, the same call on the ``reference`` backend (plain torch ops,
differentiated by autograd itself):

* a tensor modified in place after the forward: the backward raises autograd's error or gives the
  gradient of what the forward saw -- never a gradient of the modified values (the mask included, with
  ``create_graph=True`` too);
* the output modified in place (``y.add_(1)``, ``y.relu_()``) before the backward: raises where torch
  raises, else the oracle's gradient;
* saved-tensor hooks see every tensor the backward reads: an intermediate input is freed once the
  hooks hold copies (torch's op frees it), and the gradients are bitwise those without hooks;
* backward twice without ``retain_graph`` raises; with it, the same gradient twice; fp64
  ``gradgradcheck``; forward-mode AD matches ``torch.func.jvp`` of the reference or raises;
* which of input, weight and bias require grad: the output's ``requires_grad`` and ``grad_fn`` and
  every gradient as the oracle's.
"""

from __future__ import annotations

import weakref

import pytest
import torch
import torch.nn.functional as F

import normscope.functional as NF
import normscope.functional_modern as FM
from normscope import engine

from .ops import OPS as TABLE
from .ops import PATHS

_RM = torch.linspace(-0.5, 0.5, 4, dtype=torch.float64)
_RV = torch.linspace(0.5, 2.0, 4, dtype=torch.float64)


def _mask() -> torch.Tensor:
    m = torch.ones(2, 4, dtype=torch.bool)
    m[0, 3:] = False
    return m


_MASK = _mask()


def _modulation(dtype, seed):
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype) * 0.3


# name: (torch's op or None, normscope's op(x, w, b, backend, mask), x shape, weight shape, bias shape or None)
CASES = {
    "layer_norm": (
        lambda x, w, b: F.layer_norm(x, (8,), w, b, 1e-5),
        lambda x, w, b, be, m: NF.layer_norm(x, (8,), w, b, 1e-5, backend=be),
        (4, 3, 8),
        (8,),
        (8,),
    ),
    "rms_norm": (
        lambda x, w, b: F.rms_norm(x, (8,), w, 1e-5),
        lambda x, w, b, be, m: NF.rms_norm(x, (8,), w, 1e-5, backend=be),
        (4, 3, 8),
        (8,),
        None,
    ),
    "rms_norm_llama": (
        None,
        lambda x, w, b, be, m: FM.rms_norm(x, (8,), w, 1e-5, casting="llama", backend=be),
        (4, 3, 8),
        (8,),
        None,
    ),
    "rms_norm_gemma": (
        None,
        lambda x, w, b, be, m: FM.rms_norm(x, (8,), w, 1e-5, weight_offset=1.0, casting="gemma", backend=be),
        (4, 3, 8),
        (8,),
        None,
    ),
    "group_norm": (
        lambda x, w, b: F.group_norm(x, 2, w, b, 1e-5),
        lambda x, w, b, be, m: NF.group_norm(x, 2, w, b, 1e-5, mask=m, backend=be),
        (2, 4, 4),
        (4,),
        (4,),
    ),
    "instance_norm": (
        lambda x, w, b: F.instance_norm(x, None, None, w, b, True, 0.1, 1e-5),
        lambda x, w, b, be, m: NF.instance_norm(x, None, None, w, b, True, 0.1, 1e-5, mask=m, backend=be),
        (2, 4, 4),
        (4,),
        (4,),
    ),
    "batch_norm_train": (
        lambda x, w, b: F.batch_norm(x, torch.zeros(4, dtype=x.dtype), torch.ones(4, dtype=x.dtype), w, b, True),
        lambda x, w, b, be, m: NF.batch_norm(
            x, torch.zeros(4, dtype=x.dtype), torch.ones(4, dtype=x.dtype), w, b, True, mask=m, backend=be
        ),
        (2, 4, 4),
        (4,),
        (4,),
    ),
    "batch_norm_eval": (
        lambda x, w, b: F.batch_norm(x, _RM.to(x.dtype), _RV.to(x.dtype), w, b, False),
        lambda x, w, b, be, m: NF.batch_norm(x, _RM.to(x.dtype), _RV.to(x.dtype), w, b, False, backend=be),
        (2, 4, 4),
        (4,),
        (4,),
    ),
    "modulated_norm": (
        None,
        lambda x, w, b, be, m: FM.modulated_norm(
            x, _modulation(x.dtype, 5), _modulation(x.dtype, 6), w, b, 1e-6, backend=be
        ),
        (4, 3, 8),
        (8,),
        (8,),
    ),
    "poly_norm": (None, lambda x, w, b, be, m: FM.poly_norm(x, w, b, 1e-6, backend=be), (4, 3, 8), (3,), (1,)),
    "derf": (
        None,
        lambda x, w, b, be, m: FM.derf(
            x, torch.tensor(0.7, dtype=x.dtype), torch.tensor(0.1, dtype=x.dtype), w, b, backend=be
        ),
        (4, 3, 8),
        (8,),
        (8,),
    ),
    "qk_norm": (
        None,
        lambda x, w, b, be, m: torch.cat([t.flatten() for t in FM.qk_norm(x, x * 0.5 + 1, w, w, 1e-6, backend=be)]),
        (2, 3, 2, 8),
        (8,),
        None,
    ),
}
MASKED = ("group_norm", "instance_norm", "batch_norm_train")
#: (case, masked): every op, and the masked forms of the three that take a mask
OPS = [(name, False) for name in CASES] + [(name, True) for name in MASKED]
MODERN = ("modulated_norm", "poly_norm", "derf", "qk_norm")
#: each case's op in the differential table, whose paths are the backends that take it
TABLE_NAME = {
    "rms_norm_llama": "rms_norm_family",
    "rms_norm_gemma": "rms_norm_family",
    "batch_norm_train": "batch_norm",
    "modulated_norm": "modulated_norm_layer",
}


def _backends(name: str, masked: bool) -> list[str]:
    """The forced backends of the table's paths for a case (``auto`` runs one of them)."""
    op = TABLE[TABLE_NAME.get(name, name) + ("_masked" if masked else "")]
    named = [PATHS[p].backend for p in op.paths if PATHS[p].backend is not None]
    return [b for b in named if b in engine.backends()]  # triton: registered where Triton is installed


#: a path of the table's op that declines one of its forms, with the reason: the Triton kernels decline
#: Llama's order (``test_registry.test_triton_declines_llamas_order`` holds them to it)
DECLINED = {("rms_norm_llama", "triton")}


def _pairs(keep=lambda name, backend: True) -> list:
    """(op, backend) for every listed path; the modern ops on their fused kernels (triton) and on aten's
    composition only -- on the other backends they are the same composition of the norms checked above."""
    return [
        pytest.param(op, be, id=f"{'masked_' if op[1] else ''}{op[0]}-{be}")
        for op in OPS
        for be in _backends(*op)
        if (op[0] not in MODERN or be in ("triton", "aten")) and (op[0], be) not in DECLINED and keep(op[0], be)
    ]


PAIRS = _pairs()


def test_every_case_is_an_op_of_the_table_with_a_path():
    for name, masked in OPS:
        assert _backends(name, masked), f"{name} (masked={masked}): no forced path in the differential table"


def _make(shape, dtype, seed, requires_grad=True):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g, dtype=torch.float64) * 1.5 + 0.3).to(dtype).requires_grad_(requires_grad)


def _tensors(name, dtype, rx=True, rw=True, rb=True):
    _, _, xs, ws, bs = CASES[name]
    x = _make(xs, dtype, 0, rx)
    w = _make(ws, dtype, 1, rw)
    b = None if bs is None else _make(bs, dtype, 2, rb)
    return x, w, b


def _ours(name, masked, backend):
    """normscope's op forced on ``backend``."""
    fn = CASES[name][1]

    def run(x, w, b):
        return fn(x, w, b, backend, _MASK if masked else None)

    return run


def _oracle(name, masked):
    """torch's own op, or the reference backend where torch has none (masks, the modern ops)."""
    t = CASES[name][0]
    if t is not None and not masked:
        return t
    fn = CASES[name][1]
    return lambda x, w, b: fn(x, w, b, "reference", _MASK if masked else None)


def _grads(y, inputs, create_graph=False):
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64).to(y.dtype)
    wanted = [t for t in inputs if t is not None and t.requires_grad]
    return torch.autograd.grad(y, wanted, g, create_graph=create_graph)


def _close(a, b, dtype):
    tol = dict(rtol=2e-2, atol=2e-2) if dtype != torch.float32 else dict(rtol=1e-4, atol=1e-4)
    assert len(a) == len(b)
    for p, q in zip(a, b):
        torch.testing.assert_close(p.float(), q.float(), **tol)


INPLACE = "modified by an inplace operation"


@pytest.mark.parametrize(("op", "backend"), PAIRS)
@pytest.mark.parametrize("dtype", [torch.float32], ids=["fp32"])
def test_output_modified_in_place_then_backward(op, backend, dtype):
    """``y.add_(1)`` / ``y.relu_()`` after the forward: the backward raises where torch's op raises, else
    gives its gradient. (The masked composite path's fp32 output was a view made inside its
    autograd.Function: every in-place op on it raised "Output 0 of View is a view ... modified inplace".)"""
    name, masked = op
    ours, oracle = _ours(name, masked, backend), _oracle(name, masked)
    for modify in (lambda y: y.add_(1), lambda y: y.relu_()):
        results = []
        for fn in (oracle, ours):
            x, w, b = _tensors(name, dtype)
            y = fn(x, w, b)
            try:
                modify(y)
                results.append(_grads(y, (x, w, b)))
            except RuntimeError as e:
                results.append(str(e))
        expected, got = results
        if isinstance(expected, str):
            assert isinstance(got, str), f"torch raises ({expected[:80]}), {backend} does not"
        else:
            assert not isinstance(got, str), f"torch's op allows it, {backend} raises: {got[:120]}"
            _close(got, expected, dtype)


@pytest.mark.parametrize(("op", "backend"), PAIRS)
@pytest.mark.parametrize("dtype", [torch.float32], ids=["fp32"])
def test_tensor_modified_in_place_after_forward(op, backend, dtype):
    """Input, weight or bias scaled in place between forward and backward: autograd's error, or the
    gradient of the values the forward saw (the oracle's on unmodified tensors) -- never a silently
    different one."""
    name, masked = op
    ours, oracle = _ours(name, masked, backend), _oracle(name, masked)
    x, w, b = _tensors(name, dtype)
    expected = _grads(oracle(x, w, b), (x, w, b))
    for which in range(3 if CASES[name][4] is not None else 2):
        x, w, b = _tensors(name, dtype)
        y = ours(x, w, b)
        with torch.no_grad():
            (x, w, b)[which].mul_(1.5)
        try:
            got = _grads(y, (x, w, b))
        except RuntimeError as e:
            assert INPLACE in str(e)
            continue
        _close(got, expected, dtype)


@pytest.mark.parametrize(("op", "backend"), [p for p in PAIRS if p.values[0][1]])
@pytest.mark.parametrize("create_graph", [False, True], ids=["grad", "create_graph"])
def test_mask_modified_in_place_after_forward(op, backend, create_graph):
    """The mask changed in place after the forward (a reused padding buffer): the gradient is the one
    of the mask the forward normalized with, as the reference's (plain ops) -- or autograd's error.
    The composite backend kept the call, mask included, on its ctx and, asked for a differentiable
    backward, recomputed with the modified mask: a gradient 57 off (fp64 masked InstanceNorm)."""
    name = op[0]
    dtype = torch.float64 if backend != "triton" else torch.float32  # the kernels take no fp64
    ours = CASES[name][1]
    x, w, b = _tensors(name, dtype)
    expected = _grads(ours(x, w, b, "reference", _mask()), (x, w, b))
    x, w, b = _tensors(name, dtype)
    mask = _mask()
    y = ours(x, w, b, backend, mask)
    mask[1, 2:] = False
    try:
        got = _grads(y, (x, w, b), create_graph=create_graph)
    except RuntimeError as e:
        assert INPLACE in str(e)
        return
    if dtype == torch.float32:  # triton against the fp32 reference: the kernels' tolerance
        _close(got, expected, dtype)
    else:
        for p, q in zip(got, expected):
            torch.testing.assert_close(p, q)


@pytest.mark.parametrize(("op", "backend"), PAIRS)
def test_saved_tensors_hooks_see_every_saved_input(op, backend):
    """With hooks that pack a copy of every saved tensor (activation offloading), an intermediate input
    is freed once the user drops it -- as with torch's op -- and the gradients are bitwise those without
    hooks. A tensor a path keeps on its ctx bypasses the hooks and stays alive (the composite backend kept
    the whole call, input included)."""
    name, masked = op
    ours, oracle = _ours(name, masked, backend), _oracle(name, masked)
    dtype = torch.float32

    def run(fn, hooks):
        leaf, w, b = _tensors(name, dtype)
        x = leaf * 1  # an intermediate: alive only through what the graph keeps of it
        store = []

        def pack(t):
            store.append(t.clone())
            return len(store) - 1

        if hooks:
            with torch.autograd.graph.saved_tensors_hooks(pack, store.__getitem__):
                y = fn(x, w, b)
        else:
            y = fn(x, w, b)
        alive = weakref.ref(x)
        del x  # freed by its reference count where nothing holds it (no gc pass: 50x the test's time)
        return alive() is not None, _grads(y, (leaf, w, b))

    assert not run(oracle, True)[0]
    kept, hooked = run(ours, True)
    assert not kept, f"{backend} keeps its input alive past the saved-tensor hooks"
    _, plain = run(ours, False)
    for p, q in zip(hooked, plain):
        assert torch.equal(p, q)


@pytest.mark.parametrize(("op", "backend"), PAIRS)
def test_backward_twice_and_retain_graph(op, backend):
    """A second backward without ``retain_graph`` raises torch's error; with it, the same gradient twice."""
    name, masked = op
    ours = _ours(name, masked, backend)
    x, w, b = _tensors(name, torch.float32)
    y = ours(x, w, b)
    y.sum().backward()
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        y.sum().backward()
    y = ours(x, w, b)
    first = torch.autograd.grad(y.sum(), [x, w], retain_graph=True)
    second = torch.autograd.grad(y.sum(), [x, w])
    for p, q in zip(first, second):
        assert torch.equal(p, q)


def _jvp(name, masked, ours, x, w, b):
    """Forward-mode AD's tangent of ``ours`` and, the oracle, ``torch.func.jvp`` of the reference's plain ops."""
    xp, wp = x.detach(), w.detach()
    bp = None if b is None else b.detach()
    tangent = torch.randn(xp.shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64).to(x.dtype)
    oracle = _oracle(name, masked) if CASES[name][0] is None or masked else None
    ref = oracle or (lambda x_, w_, b_: CASES[name][1](x_, w_, b_, "reference", None))
    _, expected = torch.func.jvp(lambda t: ref(t, wp, bp), (xp,), (tangent,))
    with torch.autograd.forward_ad.dual_level():
        y = ours(torch.autograd.forward_ad.make_dual(xp, tangent), wp, bp)
        got = torch.autograd.forward_ad.unpack_dual(y).tangent
    return got, expected


@pytest.mark.parametrize(("op", "backend"), _pairs(lambda name, backend: backend != "triton"))
def test_double_backward_and_forward_ad(op, backend):
    """fp64 ``gradgradcheck`` (finite differences, independent of every backward), and forward-mode AD's
    tangent as ``torch.func.jvp`` of the reference's plain ops. (The Triton kernels take no fp64: next test.)"""
    name, masked = op
    ours = _ours(name, masked, backend)
    x, w, b = _tensors(name, torch.float64)
    inputs = tuple(t for t in (x, w, b) if t is not None)

    def f(*args):
        return ours(*args, None) if len(args) == 2 else ours(*args)

    assert torch.autograd.gradgradcheck(f, inputs, atol=1e-5, rtol=1e-4, fast_mode=True)
    torch.testing.assert_close(*_jvp(name, masked, ours, x, w, b))


@pytest.mark.parametrize(("op", "backend"), _pairs(lambda name, backend: backend == "triton"))
def test_triton_double_backward_and_forward_ad_are_the_references(op, backend):
    """fp32, the kernels' dtypes: the gradient of ``sum(u * dy/dinputs)`` (a double backward) and the
    forward-mode tangent as the reference's (plain ops, differentiated by autograd itself)."""
    name, masked = op
    ours, ref = _ours(name, masked, backend), _ours(name, masked, "reference")
    results = []
    for fn in (ours, ref):
        x, w, b = _tensors(name, torch.float32)
        inputs = tuple(t for t in (x, w, b) if t is not None)
        first = _grads(fn(x, w, b), inputs, create_graph=True)
        u = [torch.randn(g.shape, generator=torch.Generator().manual_seed(7 + i)) for i, g in enumerate(first)]
        total = sum((g * v).sum() for g, v in zip(first, u))
        results.append(torch.autograd.grad(total, inputs, allow_unused=True, materialize_grads=True))
    _close(*results, torch.float32)
    x, w, b = _tensors(name, torch.float32)
    _close(*_jvp(name, masked, ours, x, w, b), torch.float32)


@pytest.mark.parametrize(("op", "backend"), PAIRS)
def test_requires_grad_combinations(op, backend):
    """Only the input, only the weight, only the bias, none (grad mode on): the output's requires_grad and
    grad_fn, and every gradient, as the oracle's."""
    name, masked = op
    ours, oracle = _ours(name, masked, backend), _oracle(name, masked)
    n = 3 if CASES[name][4] is not None else 2
    for rg in [*(tuple(i == j for j in range(n)) for i in range(n)), (False,) * n]:
        results = []
        for fn in (oracle, ours):
            x, w, b = _tensors(name, torch.float32, *rg)
            y = fn(x, w, b)
            grads = _grads(y, (x, w, b)) if y.requires_grad else ()
            results.append((y.requires_grad, y.grad_fn is not None, grads))
        (e_rg, e_fn, e_g), (g_rg, g_fn, g_g) = results
        assert (g_rg, g_fn) == (e_rg, e_fn), rg
        _close(g_g, e_g, torch.float32)
