"""Adversarial findings (probe 9): each test failed before its fix.

Training steps of the layers that update their own state outside the hot path (BatchRenorm,
PowerNorm) must refuse a bad call before any state moves, with a ValueError/TypeError that names the
argument -- as BatchNorm's training call does (``functional.checked_batch_norm``)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import normscope


def _state(m: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


def _swap(name: str, value: object):
    def mutate(m: nn.Module) -> None:
        if isinstance(value, torch.Tensor):
            setattr(m, name, nn.Parameter(value))
        else:
            setattr(m, name, value)

    return mutate


# (id, mutation of a warm layer, the input, exception type, fragments of the message)
_RENORM_CASES = [
    ("weight_size", _swap("weight", torch.ones(5)), None, ValueError, ["weight", "(6,)", "(5,)"]),
    ("weight_device", _swap("weight", torch.ones(6, device="meta")), None, ValueError, ["weight", "meta"]),
    ("weight_dtype", _swap("weight", torch.ones(6, dtype=torch.float64)), None, TypeError, ["weight", "float64"]),
    ("bias_size", _swap("bias", torch.zeros(7)), None, ValueError, ["bias", "(7,)"]),
    ("eps_negative", _swap("eps", -1.0), None, ValueError, ["eps", "-1.0"]),
    ("eps_zero", _swap("eps", 0.0), None, ValueError, ["eps", "0.0"]),
    ("eps_nan", _swap("eps", math.nan), None, ValueError, ["eps", "nan"]),
    # float64 input, float32 buffers: refused in evaluation (BatchNorm's path), so in training too
    ("input_dtype", lambda m: None, torch.randn(4, 6, 5, dtype=torch.float64), TypeError, ["running_mean", "float64"]),
    ("input_device", lambda m: None, torch.randn(4, 6, 5, device="meta"), ValueError, ["meta"]),
]


def _refused_with_state_kept(m, mutate, x, exc, fragments) -> None:
    """``mutate(m)``, then ``m(x)`` raises ``exc`` naming every fragment, and no tensor of ``m``'s state
    moved (a meta tensor, or one moved to another device by ``mutate``, has no values to compare)."""
    mutate(m)
    before = _state(m)
    with pytest.raises(exc) as info:
        m(x)
    for fragment in fragments:
        assert fragment in str(info.value), (fragment, str(info.value))
    after = _state(m)
    for k, v in before.items():
        if v.device.type != "meta" and after[k].device == v.device:
            assert torch.equal(v, after[k]), f"{k} changed by a refused call"


@pytest.mark.parametrize(
    "mutate, x, exc, fragments", [c[1:] for c in _RENORM_CASES], ids=[c[0] for c in _RENORM_CASES]
)
def test_batch_renorm_training_refuses_before_its_state_moves(mutate, x, exc, fragments):
    torch.manual_seed(0)
    m = normscope.BatchRenorm1d(6)
    good = torch.randn(4, 6, 5)
    m(good)  # warm, state moved once
    _refused_with_state_kept(m, mutate, good if x is None else x, exc, fragments)


def test_batch_renorm_training_takes_half_input_with_float_parameters_as_batchnorm():
    # the mixed-precision case BatchNorm takes (fp16 input, fp32 parameters and buffers) stays accepted
    m = normscope.BatchRenorm1d(6)
    y = m(torch.randn(4, 6, 5).half())
    assert y.dtype == torch.float16


_POWER_CASES = [
    ("weight_size", _swap("weight", torch.ones(5)), None, ValueError, ["weight", "(6,)", "(5,)"]),
    ("weight_device", _swap("weight", torch.ones(6, device="meta")), None, ValueError, ["weight", "meta"]),
    ("eps_negative", _swap("eps", -1.0), None, ValueError, ["eps", "-1.0"]),
    ("eps_nan", _swap("eps", math.nan), None, ValueError, ["eps", "nan"]),
    ("input_device", lambda m: None, torch.randn(4, 5, 6, device="meta"), ValueError, ["meta"]),
    ("running_phi_size", lambda m: setattr(m, "running_phi", torch.ones(5)), None, ValueError, ["running_phi", "(5,)"]),
]


@pytest.mark.parametrize("mutate, x, exc, fragments", [c[1:] for c in _POWER_CASES], ids=[c[0] for c in _POWER_CASES])
def test_power_norm_training_refuses_before_its_state_moves(mutate, x, exc, fragments):
    torch.manual_seed(0)
    m = normscope.PowerNorm(6, warmup_iters=2)
    good = torch.randn(4, 5, 6)
    m(good)
    _refused_with_state_kept(m, mutate, good if x is None else x, exc, fragments)


def test_sync_batch_norm_outside_a_group_refuses_an_all_false_mask_in_training_as_batchnorm():
    # one process is the whole group: its all-False mask has no valid value to take statistics from,
    # which BatchNorm (and every rank of a group, together) refuses -- the running variance must not
    # be pulled towards 0 by an empty batch
    torch.manual_seed(0)
    x, mask = torch.randn(4, 6, 5), torch.zeros(4, 5, dtype=torch.bool)
    with pytest.raises(ValueError, match="at least one valid"):
        normscope.BatchNorm1d(6)(x, mask)
    sbn = normscope.SyncBatchNorm(6)
    before = _state(sbn)
    with pytest.raises(ValueError, match="at least one valid"):
        sbn(x, mask)
    for k, v in _state(sbn).items():
        assert torch.equal(v, before[k]), f"{k} changed by a refused call"


def test_sync_batch_norm_outside_a_group_checks_a_masked_calls_parameter_dtypes():
    sbn = normscope.SyncBatchNorm(6)
    sbn.weight = nn.Parameter(torch.ones(6, dtype=torch.float64))
    x, mask = torch.randn(4, 6, 5), torch.rand(4, 5) > 0.3
    with pytest.raises(TypeError, match="weight"):
        sbn(x, mask)


@pytest.mark.parametrize(
    "call",
    [
        lambda: normscope.functional.normalize(torch.randn(2, 3, 8), 2, eps=math.nan),
        lambda: normscope.functional.adain(torch.randn(2, 3, 8), torch.randn(2, 3, 8), eps=math.nan),
        lambda: normscope.AdaIN(eps=math.nan)(torch.randn(2, 3, 8), torch.randn(2, 3, 8)),
    ],
    ids=["normalize", "adain", "AdaIN"],
)
def test_a_nan_eps_is_refused_by_normalize_and_adain_as_by_every_other_op(call):
    # layer_norm, group_norm, instance_norm... refuse eps=NaN (every output would be NaN); these two
    # checked eps < 0 only, which NaN passes
    with pytest.raises(ValueError, match="eps"):
        normscope.functional.layer_norm(torch.randn(2, 8), (8,), eps=math.nan)
    with pytest.raises(ValueError, match="eps"):
        call()


def test_dyt_refuses_integer_input_as_derf_and_poly_norm_do():
    x = torch.arange(16).reshape(2, 8)
    with pytest.raises(TypeError, match="floating-point"):
        normscope.Derf(8)(x)
    with pytest.raises(TypeError, match=r"DyT.*floating-point.*int64"):
        normscope.DyT(8)(x)


def test_folded_frozen_batch_norm_refuses_an_input_on_another_device_with_a_value_error():
    # the unfolded path (F.batch_norm) says so; the folded one raised torch's RuntimeError from an op
    x = torch.randn(2, 3, 4, 4, device="meta")
    with pytest.raises(ValueError, match="meta"):
        normscope.FrozenBatchNorm2d(3)(x)
    with pytest.raises(ValueError, match="meta"):
        normscope.FrozenBatchNorm2d(3, fold=True)(x)



def test_a_forced_backend_that_cannot_run_a_compiled_call_raises_its_value_error():
    # eagerly use_backend("rows") on a LayerNorm raises ValueError ("cannot run"); compiled, the choice
    # made on stand-ins raised it from inside a function dynamo runs as a constant, and the caller got
    # dynamo's InternalTorchDynamoError -- as the checks' errors, the refusal is now traced and raised
    torch._dynamo.reset()
    x = torch.randn(4, 8)
    with normscope.use_backend("rows"), pytest.raises(ValueError, match="cannot run"):
        normscope.LayerNorm(8)(x)
    compiled = torch.compile(normscope.LayerNorm(8), backend="eager")
    torch.testing.assert_close(compiled(x), nn.functional.layer_norm(x, (8,)))
    with normscope.use_backend("rows"), pytest.raises(ValueError, match="backend 'rows' cannot run"):
        compiled(x)
    fresh = torch.compile(normscope.LayerNorm(8), backend="eager")
    with normscope.use_backend("rows"), pytest.raises(ValueError, match="backend 'rows' cannot run"):
        fresh(x)
    torch.testing.assert_close(compiled(x), nn.functional.layer_norm(x, (8,)))  # the automatic graph still runs


def test_a_traced_plan_is_made_for_the_request_its_memo_is_keyed_by():
    # The traced plans are memoized by the request as the graph reads it (the thread's view of the forced
    # backend), but the plan was made for this context's FORCED: traced in a copied context (FORCED
    # 'reference', the thread's view unset), the memo for "nothing forced" held a 'reference' plan, which
    # every later trace of the same signature, in any thread, then took
    import contextvars

    graphs = []

    def keep(gm, example_inputs):
        graphs.append(str(gm.graph))
        return gm.forward

    x = torch.randn(5, 13)  # a signature no other test compiles: the memo is shared by the process
    with normscope.use_backend("reference"):
        ctx = contextvars.copy_context()
    torch._dynamo.reset()
    ctx.run(torch.compile(normscope.LayerNorm(13), fullgraph=True, backend=keep), x)
    torch._dynamo.reset()  # a fresh trace in this context, where nothing is forced
    plain = torch.compile(normscope.LayerNorm(13), fullgraph=True, backend=keep)
    torch.testing.assert_close(plain(x), nn.functional.layer_norm(x, (13,)))
    normscope.LayerNorm(13)(x)
    assert normscope.last_backend() == "aten"  # what an eager call with nothing forced runs: ATen's op
    assert "layer_norm" in graphs[-1], graphs[-1]


def test_a_use_backend_block_left_in_another_thread_does_not_raise_from_its_exit():
    # a generator holding the block, started in one thread and finished in another: ContextVar.reset()
    # refuses a token of another context, and the exit raised that ValueError into the consumer. Now, as
    # torch.no_grad() in the same generator, the exit sets back there the value found on entry
    import threading

    def gen():
        with normscope.use_backend("reference"):
            yield
            yield

    def finish(g, out):
        try:
            for _ in g:
                pass
            out["forced"] = normscope.engine._FORCED.get()
        except Exception as e:  # noqa: BLE001 - recorded for the assertion
            out["error"] = repr(e)

    def torch_gen():
        with torch.no_grad():
            yield
            yield

    results = []
    for make in (torch_gen, gen):
        g, out = make(), {}
        next(g)
        t = threading.Thread(target=finish, args=(g, out))
        t.start()
        t.join()
        results.append(out)
    torch.set_grad_enabled(True)  # what the torch generator left on this thread
    normscope.engine._FORCED.set(None)  # and ours: the block was entered here, and never left here
    normscope.engine._TRACED_VIEW.forced = None
    assert "error" not in results[0]  # torch's block
    assert results[1] == {"forced": None}, results[1]

# -- not fixed: the forced backend as a compiled graph reads it is per thread, not per context ------------
#
# ``use_backend`` keeps ``_state.TRACED_VIEW`` (a ``threading.local``, what dynamo can read and guard on)
# equal to the ``FORCED`` context variable on entry and exit of its block. A context switch that runs no
# ``use_backend`` code -- ``contextvars.copy_context().run``, an asyncio task resumed while another task's
# block is open -- leaves the two apart, and a compiled graph then follows the thread's view, not the
# context's forced backend that an eager call of the same context obeys. Dynamo cannot trace a
# ``ContextVar.get`` (nor guard on one), so the fix is not local: see the report of probe 9.


@pytest.mark.xfail(strict=True, reason="TRACED_VIEW is per thread: a copied context's forced backend is not seen")
def test_a_compiled_call_in_a_copied_context_obeys_its_forced_backend():
    import contextvars

    # observable: the 'rows' backend cannot run a LayerNorm, so a call that obeys use_backend("rows")
    # raises ValueError (last_backend() is no witness: a compiled graph reports only when traced)
    torch._dynamo.reset()
    x = torch.randn(4, 8)
    compiled = torch.compile(normscope.LayerNorm(8), backend="eager")
    compiled(x)  # traced for the automatic choice
    with normscope.use_backend("rows"):
        ctx = contextvars.copy_context()
    with pytest.raises(ValueError, match="cannot run"):
        ctx.run(normscope.LayerNorm(8), x)  # eager: the context's forced backend
    with pytest.raises(ValueError, match="cannot run"):
        ctx.run(compiled, x)  # compiled: runs the automatic graph


@pytest.mark.xfail(strict=True, reason="TRACED_VIEW is per thread: another task's open use_backend leaks into it")
def test_a_compiled_call_in_an_asyncio_task_ignores_another_tasks_forced_backend():
    import asyncio

    torch._dynamo.reset()
    x = torch.randn(4, 8)
    compiled = torch.compile(normscope.LayerNorm(8), fullgraph=True, backend="eager")

    async def forcing(entered: asyncio.Event, done: asyncio.Event) -> None:
        with normscope.use_backend("reference"):
            entered.set()
            await done.wait()

    async def automatic(entered: asyncio.Event, done: asyncio.Event) -> str | None:
        await entered.wait()
        try:
            compiled(x)  # traced here, in a task that forces nothing; a trace reports its backend
            return normscope.last_backend()
        finally:
            done.set()

    async def main() -> str | None:
        entered, done = asyncio.Event(), asyncio.Event()
        return (await asyncio.gather(forcing(entered, done), automatic(entered, done)))[1]

    assert asyncio.run(main()) == "aten"


@pytest.mark.parametrize("name", ["BatchNorm1d", "InstanceNorm1d", "SyncBatchNorm", "BatchRenorm1d"])
def test_a_layer_momentum_torch_refuses_is_refused_before_the_state_moves(name):
    # torch.nn's layers pass momentum to batch_norm/instance_norm, which raise TypeError for a str; ours
    # took float("0.1") silently. What torch takes (a bool, a 0-dim tensor) stays accepted
    x = torch.randn(4, 6, 5)
    kw = {"track_running_stats": True} if name.startswith("Instance") else {}
    if hasattr(nn, name):
        theirs = getattr(nn, name)(6, **kw)
        theirs.momentum = "0.1"
        with pytest.raises(TypeError):
            theirs(x)
    ours = getattr(normscope, name)(6, **kw)
    ours.momentum = "0.1"
    before = _state(ours)
    with pytest.raises(TypeError, match="momentum"):
        ours(x)
    for k, v in _state(ours).items():
        assert torch.equal(v, before[k]), f"{k} changed by a refused call"
    ours.momentum = torch.tensor(0.5)
    ours(x)
