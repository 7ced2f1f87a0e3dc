"""torch.compile(fullgraph=True) traces through the engine (dispatch, plan, layers) on CPU.

Slow (a compile takes ~15-40 s on 2 shared cores): marked ``slow``; deselect with ``-m "not slow"``.
"""

from __future__ import annotations

import copy
import time
import warnings

import pytest
import torch

import normscope
from conftest import direct


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3),
        normscope.BatchNorm2d(8),
        normscope.GroupNorm(2, 8),
        normscope.InstanceNorm2d(8, affine=True, track_running_stats=True),
        torch.nn.Flatten(2),  # (N, 8, 36)
        normscope.LayerNorm(36),
        normscope.RMSNorm(36),
    ).double()  # float64: eager and compiled agree to ~1e-12, so any real difference shows


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compile_fullgraph_matches_eager_in_train_and_eval(backend):
    """``aot_eager`` checks dynamo's trace and AOT autograd; ``inductor`` adds code generation."""
    torch._dynamo.reset()
    eager = _model()
    compiled_mod = copy.deepcopy(eager)
    compiled = torch.compile(compiled_mod, fullgraph=True, backend=backend)  # a graph break raises
    g = torch.Generator().manual_seed(1)
    t0 = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            x = torch.randn(4, 3, 8, 8, generator=g, dtype=torch.float64)
            ye = eager(x)
            yc = compiled(x)
            torch.testing.assert_close(yc, ye, rtol=1e-9, atol=1e-9)
            ye.square().sum().backward()
            yc.square().sum().backward()
        for (k, pe), (_, pc) in zip(eager.named_parameters(), compiled_mod.named_parameters()):
            torch.testing.assert_close(pc.grad, pe.grad, rtol=1e-9, atol=1e-9, msg=lambda m, k=k: f"{k}: {m}")
        for (k, be), (_, bc) in zip(eager.named_buffers(), compiled_mod.named_buffers()):
            torch.testing.assert_close(bc, be, rtol=1e-9, atol=1e-9, msg=lambda m, k=k: f"{k}: {m}")
        assert int(compiled_mod[1].num_batches_tracked) == 2
        eager.eval()
        compiled_mod.eval()
        x = torch.randn(4, 3, 8, 8, generator=g, dtype=torch.float64)
        torch.testing.assert_close(compiled(x), eager(x), rtol=1e-9, atol=1e-9)
    # no notice about normscope's own code (the lru_cache wrappers dynamo warned about are gone)
    ours = [str(w.message) for w in caught if "lru_cache" in str(w.message) or "normscope" in str(w.filename)]
    assert not ours, ours
    print(f"torch.compile(fullgraph=True, backend={backend!r}) train+eval: {time.perf_counter() - t0:.1f} s")


@pytest.mark.slow
def test_compile_fullgraph_reference_backend_and_masks(monkeypatch):
    """The reference path (forced through NORMSCOPE_BACKEND) and a masked normalize trace too."""
    torch._dynamo.reset()
    monkeypatch.setenv("NORMSCOPE_BACKEND", "reference")
    torch.manual_seed(0)
    eager = torch.nn.Sequential(normscope.BatchNorm1d(4), normscope.LayerNorm(6), normscope.GroupNorm(2, 4)).double()
    compiled_mod = copy.deepcopy(eager)
    compiled = torch.compile(compiled_mod, fullgraph=True, backend="aot_eager")
    x = torch.randn(3, 4, 6, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.testing.assert_close(compiled(x), eager(x), rtol=1e-9, atol=1e-9)
        assert normscope.last_backend() == "reference"
        for (k, be), (_, bc) in zip(eager.named_buffers(), compiled_mod.named_buffers()):
            torch.testing.assert_close(bc, be, rtol=1e-9, atol=1e-9, msg=lambda m, k=k: f"{k}: {m}")

        def masked(x, mask):
            return normscope.normalize(x, keep=1, mask=mask)

        mask = torch.rand(3, 1, 6) < 0.6
        y = torch.compile(masked, fullgraph=True, backend="aot_eager")(x, mask)
        torch.testing.assert_close(y, direct(x, (0, 2), mask=mask))


@pytest.mark.slow
def test_environment_is_read_when_traced_not_guarded(monkeypatch):
    """NORMSCOPE_BACKEND (and TRITON_INTERPRET) are read once while tracing: an environment variable
    set afterwards -- any, or ours -- neither recompiles the graph nor changes its backend. Traced as
    a read of os.environ, dynamo guarded on every key of the environment (a retrace on any change)
    and evaluated that guard on every call (engine.constant_when_compiled)."""
    torch._dynamo.reset()
    frames = []

    def counting(gm, example_inputs):
        frames.append(gm)
        return gm.forward

    ln = normscope.LayerNorm(8).double()
    x = torch.randn(4, 8, dtype=torch.float64)
    compiled = torch.compile(ln, backend=counting)
    y = compiled(x)
    monkeypatch.setenv("NORMSCOPE_SOME_UNRELATED_VARIABLE", "1")
    monkeypatch.setenv("NORMSCOPE_BACKEND", "reference")
    torch.testing.assert_close(compiled(x), y)
    assert len(frames) == 1, f"recompiled {len(frames) - 1} time(s) after an environment change"
    # eagerly the variable is read per call, as documented
    ln(x)
    assert normscope.last_backend() == "reference"
