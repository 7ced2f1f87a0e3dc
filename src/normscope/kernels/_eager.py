"""The kernels' ops in eager mode: the same forward, setup and backward functions as their
``torch.library`` custom ops, through a plain :class:`torch.autograd.Function`.

Why: a custom op with ``register_autograd`` runs hundreds of microseconds of Python per forward +
backward in eager mode (the op's own dispatch, then the autograd wrapper torch.library generates,
for the forward and again for the backward op) -- more than the GPU needs for a 256 MB LayerNorm
forward + backward on an H100, which then waited on the CPU (benchmarks/results/bench-cuda*.json).
Under ``torch.compile`` the custom ops stay what the compiler sees: opaque, with fake shapes.

Both paths call the same launch functions, so they compute the same bits; what differs is only the
Python around the launch. ``tests/kernels/test_kernels_eager.py`` holds them bitwise equal.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

#: the tensor types eager mode hands the kernels (anything else -- FakeTensor, FunctionalTensor, a
#: tracer's proxy -- is a trace, which must record the custom op)
_PLAIN = (torch.Tensor, torch.nn.Parameter)
#: how many torch dispatch modes (FakeTensorMode, a tracer's proxy mode, ...) are active: torch's own
#: helper, private but present in every torch this package supports (2.4 on)
_modes = torch._C._len_torch_dispatch_stack


def traced(args) -> bool:
    """Whether a call with these arguments is being traced (torch.compile, AOTAutograd, make_fx,
    export), so that the custom op, not the launch, must run. ``torch.compiler.is_compiling()``
    alone does not tell: AOTAutograd traces a custom op's registered backward with functional fake
    tensors outside dynamo, where it is False (seen on torch 2.11, CUDA)."""
    if torch.compiler.is_compiling() or _modes():
        return True
    return any(isinstance(a, torch.Tensor) and type(a) not in _PLAIN for a in args)


def pick(op: Callable, launch: Callable, *args):
    """``op(*args)`` when traced, else ``launch(*args)``: a custom op's backward calls its backward op
    through this (the same launch either way)."""
    return op(*args) if traced(args) else launch(*args)


def function(forward: Callable, setup_context: Callable, backward: Callable) -> type[torch.autograd.Function]:
    """A :class:`torch.autograd.Function` with a custom op's implementation (``forward``), its
    ``setup_context`` and its backward: what ``op.register_autograd(backward, setup_context=...)``
    registers, without the op's dispatch. Gradients of outputs that do not reach the loss arrive as
    None, as they do to a custom op's backward. (The ``forward(ctx, ...)`` form: the separate
    ``setup_context`` form binds the arguments with :mod:`inspect` on every call.)"""

    class _Eager(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *args):
            output = forward(*args)
            ctx.set_materialize_grads(False)
            setup_context(ctx, args, output)
            return output

        @staticmethod
        def backward(ctx, *grads):
            return backward(ctx, *grads)

    _Eager.__name__ = _Eager.__qualname__ = f"{getattr(forward, '__name__', 'op').strip('_')}_eager"
    return _Eager


def call(op: Callable, fn: type[torch.autograd.Function], forward: Callable, *args):
    """``op(*args)`` when traced by torch.compile; in eager mode ``fn.apply(*args)`` when autograd
    records the call, else ``forward(*args)`` (the launch itself: nothing to record)."""
    if traced(args):
        return op(*args)
    if torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
        return fn.apply(*args)
    return forward(*args)
