"""The kernels' ops in eager mode: the same forward, setup and backward functions as their
``torch.library`` custom ops, through a plain :class:`torch.autograd.Function`.

Why: a custom op with ``register_autograd`` runs hundreds of microseconds of Python per forward +
backward in eager mode (the op's own dispatch, then the autograd wrapper torch.library generates,
for the forward and again for the backward op) -- more than the GPU needs for a 256 MB LayerNorm
forward + backward on an H100, which then waited on the CPU (benchmarks/results/bench-cuda*.json).
Under ``torch.compile`` the custom ops stay what the compiler sees: opaque, with fake shapes.

Both paths call the same launch functions, so they compute the same bits; what differs is only the
Python around the launch. ``tests/test_kernels_eager.py`` holds them bitwise equal.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def compiling() -> bool:
    """Whether this call is being traced by torch.compile (then the custom op must be what it sees)."""
    return torch.compiler.is_compiling()


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
    if compiling():
        return op(*args)
    if torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
        return fn.apply(*args)
    return forward(*args)
