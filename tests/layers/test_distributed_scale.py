"""What users run at scale, on CPU over gloo with 2 processes, normscope against torch.nn on the same
model, data and seed:

* FSDP2 (``fully_shard``, bf16 parameters / fp32 gradient reduction) training a small model with
  LayerNorm, RMSNorm and BatchNorm1d: losses and parameters step by step;
* tensor/sequence parallel: ``parallelize_module`` with ``SequenceParallel()`` on a norm layer, so the
  layer sees DTensor input and parameters: forward and backward;
* distributed checkpoint (``torch.distributed.checkpoint``) of the FSDP2-sharded models: saved by the
  torch.nn model, loaded into the normscope one, and the reverse;
* ``torch.compile`` of a DDP model. ``backend="aot_eager"``: dynamo captures the graph (with DDP's
  graph splitting at bucket boundaries) and AOTAutograd traces forward and backward -- the part where
  a norm layer's ops must be traceable -- while the graph then runs eagerly: no inductor code
  generation, whose C++ compilation would take minutes on this 2-core machine and tests the compiler
  rather than the layers.

Process start-up dominates (each rank imports torch), so one 2-rank group runs every scenario, each
recording its results or its error; the tests below read them. The spawning helper is
tests/layers/test_syncbn.py's.
"""

from __future__ import annotations

import copy
import datetime
import os
import traceback

import pytest
import torch
import torch.distributed as dist
from torch import nn

import normscope

if not dist.is_available():  # pragma: no cover
    pytest.skip("torch.distributed is not available in this torch build", allow_module_level=True)

from test_syncbn import _spawn  # noqa: E402 - the project's gloo spawning helper

WORLD = 2
STEPS = 3

# every test reads the one 2-rank run of the module's `ranks` fixture: one worker runs them all (pytest-xdist),
# so that the ranks are spawned once
pytestmark = pytest.mark.xdist_group("distributed_scale")


class _Net(nn.Module):
    """Linear -> LayerNorm -> GELU -> Linear -> RMSNorm (+ residual) -> BatchNorm1d -> Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.ln = nn.LayerNorm(32)
        self.fc2 = nn.Linear(32, 32)
        self.rms = nn.RMSNorm(32)
        self.bn = nn.BatchNorm1d(32)
        self.head = nn.Linear(32, 4)

    def forward(self, x):
        h = nn.functional.gelu(self.ln(self.fc1(x)))
        h = self.rms(self.fc2(h)) + h
        return self.head(self.bn(h))


def _pair(seed: int) -> tuple[nn.Module, nn.Module]:
    """The same initial model twice: torch.nn, and converted to normscope."""
    torch.manual_seed(seed)
    ref = _Net()
    with torch.no_grad():  # norm parameters away from their 1 / 0 init, so they matter
        for m in (ref.ln, ref.rms, ref.bn):
            for p in m.parameters():
                p.add_(torch.randn_like(p) * 0.3)
    ours, report = normscope.convert(copy.deepcopy(ref))
    assert len(report) == 3, str(report)
    return ref, ours


def _data(rank: int, step: int, n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(n, 16, generator=g) * 2 + 1, torch.randn(n, 4, generator=g)


def _full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    out = {}
    for k, v in model.state_dict().items():
        v = v.full_tensor() if isinstance(v, DTensor) else v
        out[k] = v.detach().clone()
    return out


# -- the scenarios, run on every rank ----------------------------------------------------------------


def _shard(model: nn.Module) -> None:
    """FSDP2 with bf16 parameters and fp32 gradient reduction; the norms as units of their own too.

    BatchNorm is its own unit with fp32 parameters (its input cast to fp32), the usual practice:
    torch's CPU batch_norm refuses bf16 weights with the fp32 running statistics FSDP2 leaves
    ("expected scalar type BFloat16 but found Float"), so bf16 BatchNorm parameters are not something
    FSDP2 users can run with torch.nn either."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("cpu", (WORLD,))
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    fp32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    for sub in (model.ln, model.rms, model.fc2, model.head):
        fully_shard(sub, mesh=mesh, mp_policy=bf16)
    fully_shard(model.bn, mesh=mesh, mp_policy=fp32)
    fully_shard(model, mesh=mesh, mp_policy=bf16)


def _fsdp2(rank: int) -> dict:
    out = {}
    for name, model in zip(("torch", "normscope"), _pair(0)):
        _shard(model)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        losses = []
        for step in range(STEPS):
            x, t = _data(rank, step)
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x).float(), t)
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        out[name] = {"losses": torch.stack(losses), "state": _full_state(model), "model": model}
    return out


def _dcp(rank: int, trained: dict, root: str) -> dict:
    """Save each FSDP2 model's sharded state with torch.distributed.checkpoint, load it into a fresh
    model of the other kind (another seed), and return the loaded full states."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    out = {}
    fresh = dict(zip(("torch", "normscope"), _pair(7)))
    for src, dst in (("torch", "normscope"), ("normscope", "torch")):
        path = os.path.join(root, f"ckpt_{src}")
        dcp.save(get_model_state_dict(trained[src]["model"]), checkpoint_id=path)
        model = fresh[dst]
        _shard(model)
        state = get_model_state_dict(model)
        dcp.load(state, checkpoint_id=path)
        set_model_state_dict(model, state)
        out[f"{src}->{dst}"] = _full_state(model)
        out[f"{src}->{dst}:normscope"] = isinstance(model.ln, normscope.LayerNorm)  # FSDP2 subclasses it
    return out


def _sequence_parallel(rank: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import SequenceParallel, parallelize_module

    mesh = init_device_mesh("cpu", (WORLD,))
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 8, 16, generator=g) * 2 + 1  # (B, S, D): S is sharded
    dy = torch.randn(3, 8, 16, generator=g)
    out = {}
    for kind in ("layer", "rms"):
        torch.manual_seed(3)
        ref = nn.ModuleDict({"norm": nn.LayerNorm(16) if kind == "layer" else nn.RMSNorm(16)})
        with torch.no_grad():
            for p in ref.parameters():
                p.add_(torch.randn_like(p) * 0.3)
        ours, _ = normscope.convert(copy.deepcopy(ref))
        for name, model in (("torch", ref), ("normscope", ours)):
            try:
                parallelize_module(model, mesh, {"norm": SequenceParallel()})
                xl = x.chunk(WORLD, dim=1)[rank].clone().requires_grad_()
                y = model["norm"](xl)
                assert isinstance(y, DTensor), type(y)
                (y.to_local() * dy.chunk(WORLD, dim=1)[rank]).sum().backward()
                out[f"{kind}:{name}"] = {
                    "y": y.full_tensor().detach(),
                    "dx": xl.grad,
                    "grads": {k: p.grad.full_tensor() for k, p in model.named_parameters()},
                }
            except Exception as err:  # noqa: BLE001 - recorded for the parent to report
                out[f"{kind}:{name}"] = {"error": f"{type(err).__name__}: {err}", "tb": traceback.format_exc()}
    return out


def _compiled_ddp(rank: int) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch._dynamo.reset()
    out = {}
    for name, model in zip(("torch", "normscope"), _pair(11)):
        try:
            ddp = DDP(model)
            compiled = torch.compile(ddp, backend="aot_eager")
            opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
            ys = []
            for step in range(2):
                x, t = _data(rank, step)
                opt.zero_grad()
                y = compiled(x)
                nn.functional.mse_loss(y, t).backward()
                opt.step()
                ys.append(y.detach())
            out[name] = {"ys": ys, "state": _full_state(model)}
        except Exception as err:  # noqa: BLE001 - recorded for the parent to report
            out[name] = {"error": f"{type(err).__name__}: {err}", "tb": traceback.format_exc()}
    return out


def _worker(rank: int, world: int, store: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=30)
    )
    results: dict = {}

    def scenario(name, fn, *args):
        try:
            results[name] = fn(*args)
        except Exception as err:  # noqa: BLE001 - recorded for the parent to report
            results[name] = {"error": f"{type(err).__name__}: {err}", "tb": traceback.format_exc()}
        return results[name]

    try:
        trained = scenario("fsdp2", _fsdp2, rank)
        if "error" not in trained:
            scenario("dcp", _dcp, rank, trained, out_dir)
        for v in trained.values():
            if isinstance(v, dict):
                v.pop("model", None)  # not picklable across processes
        scenario("sequence_parallel", _sequence_parallel, rank)
        scenario("compiled_ddp", _compiled_ddp, rank)
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    except BaseException:
        with open(os.path.join(out_dir, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()


# -- the tests ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("scale")
    return _spawn(_worker, tmp, WORLD, (str(tmp),), None, 55.0)


def _ok(result: dict, *keys: str) -> dict:
    for k in keys:
        if "error" in result[k]:
            raise AssertionError(f"{k}: {result[k]['error']}\n{result[k].get('tb', '')}")
    return result


def _close_states(a: dict, b: dict, **tol) -> None:
    assert list(a) == list(b)
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        torch.testing.assert_close(a[k], b[k], msg=lambda m, k=k: f"{k}: {m}", **tol)


# bf16 parameters and activations: at most about one bf16 rounding (2**-7 relative) apart. The
# results measure bitwise equal on CPU/gloo, so this only leaves room for a
# backend that rounds differently, not for a wrong result
BF16 = dict(atol=1e-2, rtol=1e-2)


def test_fsdp2_bf16_training(ranks):
    for r in ranks:
        fsdp = _ok({"fsdp2": r["fsdp2"]}, "fsdp2")["fsdp2"]
        torch.testing.assert_close(fsdp["normscope"]["losses"], fsdp["torch"]["losses"], **BF16)
        _close_states(fsdp["normscope"]["state"], fsdp["torch"]["state"], **BF16)
    # data parallel: both ranks end with the same parameters (running statistics are per rank)
    params = [{k: v for k, v in r["fsdp2"]["normscope"]["state"].items() if "running" not in k} for r in ranks]
    _close_states(*params, atol=0, rtol=0)


def test_distributed_checkpoint_between_torch_and_normscope(ranks):
    for r in ranks:
        _ok({"fsdp2": r["fsdp2"]}, "fsdp2")
        _ok({"dcp": r["dcp"]}, "dcp")
    for key, saver in (("torch->normscope", "torch"), ("normscope->torch", "normscope")):
        for rank, r in enumerate(ranks):
            assert r["dcp"][f"{key}:normscope"] == (saver == "torch")
            loaded, saved = r["dcp"][key], r["fsdp2"][saver]["state"]
            assert list(loaded) == list(saved)
            # parameters (sharded DTensors): exactly the saved ones
            params = [k for k in saved if "running" not in k and "num_batches" not in k]
            _close_states({k: loaded[k] for k in params}, {k: saved[k] for k in params}, atol=0, rtol=0)
            # buffers (plain tensors, one per rank): DCP saves them once, as replicated -- every rank
            # loads the same rank's copy, whichever kind saved and loaded it
            for k in set(saved) - set(params):
                assert any(torch.equal(loaded[k], q["fsdp2"][saver]["state"][k]) for q in ranks), (key, rank, k)
                torch.testing.assert_close(loaded[k], ranks[0]["dcp"][key][k], atol=0, rtol=0)


@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_sequence_parallel_dtensor_norm(ranks, kind):
    # the single-process torch.nn result on the full sequence
    torch.manual_seed(3)
    ref = nn.LayerNorm(16) if kind == "layer" else nn.RMSNorm(16)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(3, 8, 16, generator=g) * 2 + 1).requires_grad_()
    dy = torch.randn(3, 8, 16, generator=g)
    y = ref(x)
    y.backward(dy)
    for rank, r in enumerate(ranks):
        sp = _ok(r["sequence_parallel"], f"{kind}:torch", f"{kind}:normscope")
        for name in ("torch", "normscope"):
            got = sp[f"{kind}:{name}"]
            torch.testing.assert_close(got["y"], y.detach(), msg=lambda m, n=name: f"{n}: {m}")
            torch.testing.assert_close(got["dx"], x.grad.chunk(WORLD, dim=1)[rank])
            for k, p in ref.named_parameters():
                torch.testing.assert_close(
                    got["grads"][f"norm.{k}"], p.grad, msg=lambda m, n=name, k=k: f"{n} {k}: {m}"
                )


def test_torch_compile_of_ddp_model(ranks):
    for r in ranks:
        c = _ok(r["compiled_ddp"], "torch", "normscope")
        for a, b in zip(c["normscope"]["ys"], c["torch"]["ys"]):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        _close_states(c["normscope"]["state"], c["torch"]["state"], atol=1e-5, rtol=1e-5)
