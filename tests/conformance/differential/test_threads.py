"""(e) Two threads at once: what a call reads besides its arguments -- the forced backend, what the
planner captures while tracing -- is per thread, so that one thread's ``use_backend`` or
``torch.compile`` never changes another thread's eager call. One or two examples, not a sweep: a
compile costs seconds."""

from __future__ import annotations

import threading

import torch

import normscope
from normscope import functional as NF

from .harness import assert_bitwise

ROUNDS = 200  # eager calls the other thread makes at least (and until the first thread is done)


def _masked_group_norm_inputs():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 8, 6, generator=g)
    mask = torch.rand(4, 6, generator=g) < 0.7
    mask[:, 0] = True
    return x, torch.randn(8, generator=g), torch.randn(8, generator=g), mask


def _eager_loop(fn, want, done: threading.Event, errors: list, backend_wanted: str) -> None:
    """Call ``fn`` until ``done`` (at least ROUNDS times); record every call that does not give
    ``want``'s bits or does not run on ``backend_wanted``."""
    n = 0
    while n < ROUNDS or not done.is_set():
        n += 1
        try:
            got = fn()
            ran = normscope.last_backend()
            if ran != backend_wanted:
                errors.append(f"call {n}: last_backend() {ran!r}, expected {backend_wanted!r}")
            elif not torch.equal(got, want):
                errors.append(f"call {n}: output differs from the single-threaded one by {(got - want).abs().max()}")
        except Exception as e:  # noqa: BLE001 - any failure of the other thread's call is the finding
            errors.append(f"call {n}: {type(e).__name__}: {e}")
        if len(errors) > 5 or n > 50 * ROUNDS:
            break


def test_a_forced_backend_in_one_thread_is_not_seen_by_another():
    x, w, b, mask = _masked_group_norm_inputs()

    def masked():
        return NF.group_norm(x, 2, w, b, mask=mask)

    want = masked()
    assert normscope.last_backend() == "composite"
    done, errors = threading.Event(), []

    def forcing():
        y = torch.randn(16, 32)
        try:
            for _ in range(ROUNDS):
                with normscope.use_backend("aten"):
                    NF.layer_norm(y, (32,))
        finally:
            done.set()

    other = threading.Thread(target=forcing)
    other.start()
    _eager_loop(masked, want, done, errors, "composite")
    other.join()
    assert not errors, "masked group_norm while another thread forces 'aten':\n" + "\n".join(errors[:5])


def test_compiling_in_one_thread_changes_no_eager_call_in_another():
    """One thread compiles (aot_eager: no codegen, quick) while the other calls the same op eagerly:
    every eager call gives the single-threaded bits and gradients, on the backend it chose alone."""
    x, w, b, mask = _masked_group_norm_inputs()
    xr = x.clone().requires_grad_(True)

    def masked():
        return NF.group_norm(x, 2, w, b, mask=mask)

    want = masked()
    (want_dx,) = torch.autograd.grad(NF.group_norm(xr, 2, w, b, mask=mask).sum(), [xr])
    done, errors, compiled_out = threading.Event(), [], []

    def compiling():
        try:
            for shape in ((4, 8, 6), (3, 8, 5)):  # two graphs: the planner traces twice
                xs = torch.randn(shape)
                ms = torch.ones(shape[0], shape[2], dtype=torch.bool)
                fn = torch.compile(lambda t, m: NF.group_norm(t, 2, w, b, mask=m), backend="aot_eager")
                compiled_out.append((fn(xs, ms), NF.group_norm(xs, 2, w, b, mask=ms)))
        finally:
            done.set()

    other = threading.Thread(target=compiling)
    other.start()
    _eager_loop(masked, want, done, errors, "composite")
    other.join()
    assert not errors, "eager masked group_norm while another thread compiles:\n" + "\n".join(errors[:5])
    (dx,) = torch.autograd.grad(NF.group_norm(xr, 2, w, b, mask=mask).sum(), [xr])
    assert_bitwise("eager input gradient after the compile", dx, want_dx)
    for k, (c, e) in enumerate(compiled_out):
        torch.testing.assert_close(c, e, msg=lambda m, k=k: f"compiled graph {k} vs eager: {m}")
