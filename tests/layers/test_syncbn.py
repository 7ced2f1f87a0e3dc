"""SyncBatchNorm against BatchNorm on the concatenated global batch, with real gloo process groups.

Process start-up dominates (each rank imports torch), so every spawned group runs many checks:
one 3-rank group (unequal batches, an empty rank, masks, two steps, eval, large offset) and one
2-rank group (a basic step, then a rank that raises: the other must fail fast, not hang).
The references are computed in the parent: torch.nn.BatchNorm2d on the concatenation, and for
masks a direct float64 formula differentiated by autograd.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import time
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import normscope
from conftest import state_of

if not dist.is_available():  # pragma: no cover
    pytest.skip("torch.distributed is not available in this torch build", allow_module_level=True)

C, H, W = 3, 4, 5
MOMENTUM = 0.3


def _count_collectives() -> dict[str, int]:
    counts = {"all_gather": 0, "all_reduce": 0}
    for name in counts:
        orig = getattr(dist, name)

        def wrapped(*a, _orig=orig, _name=name, **k):
            counts[_name] += 1
            return _orig(*a, **k)

        setattr(dist, name, wrapped)
    return counts


def _worker(rank: int, world: int, store: str, cases: dict, out_dir: str, fail_rank: int | None) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=15)
    )
    results: dict = {}
    try:
        counts = _count_collectives()
        for name, case in cases.items():
            bn = normscope.SyncBatchNorm(C, momentum=MOMENTUM, dtype=case.get("param_dtype", case["dtype"]))
            with torch.no_grad():
                bn.weight.copy_(case["weight"])
                bn.bias.copy_(case["bias"])
            steps = []
            for x, mask, dy in case["steps"][rank]:
                x = x.clone().requires_grad_()
                before = dict(counts)
                y = bn(x, mask)
                fwd = {k: counts[k] - before[k] for k in counts}
                (y * dy).sum().backward()
                bwd = {k: counts[k] - before[k] - fwd[k] for k in counts}
                steps.append(
                    {
                        "y": y.detach(),
                        "dx": x.grad,
                        "dw": bn.weight.grad.clone(),
                        "db": bn.bias.grad.clone(),
                        "fwd": fwd,
                        "bwd": bwd,
                    }
                )
                bn.zero_grad()
            bn.eval()
            before = sum(counts.values())
            ev = bn(case["eval_x"][rank])
            results[name] = {
                "steps": steps,
                "rm": bn.running_mean.clone(),
                "rv": bn.running_var.clone(),
                "nbt": int(bn.num_batches_tracked),
                "eval": ev,
                "eval_comm": sum(counts.values()) - before,
            }
        if fail_rank is not None:
            if rank == fail_rank:
                torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
                raise RuntimeError(f"deliberate failure on rank {rank}")
            bn = normscope.SyncBatchNorm(C)
            t0 = time.perf_counter()
            try:
                bn(torch.randn(4, C, H, W))
                results["failure"] = {"error": None}
            except Exception as err:  # noqa: BLE001 - recorded for the parent to inspect
                results["failure"] = {"error": f"{type(err).__name__}: {err}", "seconds": time.perf_counter() - t0}
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    except BaseException:
        with open(os.path.join(out_dir, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise
    finally:
        if not (fail_rank is not None and rank != fail_rank):  # a failed group cannot be torn down cleanly
            dist.destroy_process_group()


def _run_group(tmp_path, world: int, cases: dict, fail_rank: int | None = None, timeout: float = 90.0) -> list:
    return _spawn(_worker, tmp_path, world, (cases, str(tmp_path), fail_rank), fail_rank, timeout)


def _spawn(target, tmp_path, world: int, args: tuple, fail_rank: int | None, timeout: float) -> list:
    """Run ``target(rank, world, store, *args)`` in ``world`` processes, bounded by ``timeout``;
    return each rank's saved results."""
    ctx = mp.get_context("spawn")
    store = str(tmp_path / "store")
    procs = [ctx.Process(target=target, args=(r, world, store, *args)) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    assert not hung, f"ranks {hung} still running after {timeout} s (a collective hung)"
    out = []
    for r in range(world):
        path, err = tmp_path / f"rank{r}.pt", tmp_path / f"rank{r}.err"
        if r == fail_rank:
            assert "deliberate failure" in err.read_text()
        assert path.exists(), f"rank {r} failed:\n{err.read_text() if err.exists() else 'no traceback'}"
        out.append(torch.load(path))
    return out


def _data(sizes, dtype, masked: bool, steps: int = 2, offset: float = 0.0, scale: float = 1.0, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    per_rank: list[list] = [[] for _ in sizes]
    for _ in range(steps):
        for r, n in enumerate(sizes):
            x = (torch.randn(n, C, H, W, generator=g, dtype=torch.float64) * scale + offset).to(dtype)
            dy = torch.randn(n, C, H, W, generator=g, dtype=torch.float64).to(dtype)
            mask = torch.rand(n, H, W, generator=g) < 0.7 if masked else None
            per_rank[r].append((x, mask, dy))
    return {
        "dtype": dtype,
        "weight": torch.rand(C, generator=g, dtype=torch.float64).to(dtype) + 0.5,
        "bias": torch.randn(C, generator=g, dtype=torch.float64).to(dtype),
        "steps": per_rank,
        "eval_x": [torch.randn(max(n, 1), C, H, W, generator=g, dtype=torch.float64).to(dtype) for n in sizes],
    }


def _masked_bn64(x, mask, w, b, eps=1e-5):
    """BatchNorm over the valid positions only, written directly (float64)."""
    m = mask.unsqueeze(1).to(torch.float64)
    n = m.sum((0, 2, 3), keepdim=True)
    mean = (x * m).sum((0, 2, 3), keepdim=True) / n
    var = ((x - mean).square() * m).sum((0, 2, 3), keepdim=True) / n
    y = (x - mean) / torch.sqrt(var + eps) * w.view(1, -1, 1, 1) + b.view(1, -1, 1, 1)
    return y, mean.flatten(), (var * n / (n - 1)).flatten()


def _reference(case: dict, masked: bool) -> dict:
    """Global-batch BatchNorm on the concatenation of every rank's inputs, two steps then eval."""
    world = len(case["steps"])
    w = case["weight"].double().clone().requires_grad_()
    b = case["bias"].double().clone().requires_grad_()
    bn = torch.nn.BatchNorm2d(C, momentum=MOMENTUM, dtype=torch.float64)
    rm, rv = bn.running_mean.clone(), bn.running_var.clone()
    steps = []
    for s in range(len(case["steps"][0])):
        xs = [case["steps"][r][s][0].double() for r in range(world)]
        dys = [case["steps"][r][s][2].double() for r in range(world)]
        x = torch.cat(xs).requires_grad_()
        if masked:
            mask = torch.cat([case["steps"][r][s][1] for r in range(world)])
            y, mean, uvar = _masked_bn64(x, mask, w, b)
            rm = (1 - MOMENTUM) * rm + MOMENTUM * mean.detach()
            rv = (1 - MOMENTUM) * rv + MOMENTUM * uvar.detach()
        else:
            with torch.no_grad():
                bn.weight.copy_(w)
                bn.bias.copy_(b)
            bn.weight.grad = bn.bias.grad = None
            y = bn(x)
        (y * torch.cat(dys)).sum().backward()
        gw, gb = (bn.weight.grad, bn.bias.grad) if not masked else (w.grad.clone(), b.grad.clone())
        w.grad = b.grad = None
        sizes = [t.shape[0] for t in xs]
        steps.append({"y": y.detach().split(sizes), "dx": x.grad.split(sizes), "dw": gw, "db": gb})
    if not masked:
        rm, rv = bn.running_mean, bn.running_var
    bn.eval()
    with torch.no_grad():
        bn.running_mean.copy_(rm)
        bn.running_var.copy_(rv)
        bn.weight.copy_(w)
        bn.bias.copy_(b)
        ev = [bn(t.double()) for t in case["eval_x"]]
    return {"steps": steps, "rm": rm, "rv": rv, "eval": ev}


def _compare(name: str, got: list, ref: dict, atol: float) -> None:
    close = lambda a, b, what: torch.testing.assert_close(  # noqa: E731
        a.double(), b.double(), atol=atol, rtol=atol, msg=lambda m: f"{name}: {what}: {m}"
    )
    world = len(got)
    for s, rs in enumerate(ref["steps"]):
        for r in range(world):
            st = got[r][name]["steps"][s]
            close(st["y"], rs["y"][r], f"output, step {s}, rank {r}")
            close(st["dx"], rs["dx"][r], f"input gradient, step {s}, rank {r}")
            # the first synchronized step of a layer also exchanges the channel counts (a header)
            want = 2 if s == 0 else 1
            assert st["fwd"] == {"all_gather": want, "all_reduce": 0}, f"{name}: forward collectives {st['fwd']}"
            assert st["bwd"] == {"all_gather": 0, "all_reduce": 1}, f"{name}: backward collectives {st['bwd']}"
        # per-rank parameter gradients are local; their sum is the global-batch gradient
        close(sum(got[r][name]["steps"][s]["dw"] for r in range(world)), rs["dw"], f"weight gradient, step {s}")
        close(sum(got[r][name]["steps"][s]["db"] for r in range(world)), rs["db"], f"bias gradient, step {s}")
    for r in range(world):
        close(got[r][name]["rm"], ref["rm"], f"running_mean, rank {r}")
        close(got[r][name]["rv"], ref["rv"], f"running_var, rank {r}")
        assert got[r][name]["nbt"] == len(ref["steps"])
        close(got[r][name]["eval"], ref["eval"][r], f"eval output, rank {r}")
        assert got[r][name]["eval_comm"] == 0, f"{name}: evaluation communicated"


def test_three_ranks_unequal_empty_masked(tmp_path):
    sizes = [3, 5, 0]  # unequal batches, and rank 2 holds none
    cases = {
        "fp64": _data(sizes, torch.float64, masked=False, seed=1),
        "fp32": _data(sizes, torch.float32, masked=False, seed=2),
        "masked": _data([2, 4, 0], torch.float64, masked=True, seed=3),
        "masked_all_ranks": _data([2, 1, 3], torch.float64, masked=True, seed=4),
        # bf16 activations with fp32 parameters (autocast-style): the reference path, fp32 statistics
        "bf16": {**_data([3, 2, 0], torch.bfloat16, masked=False, seed=7), "param_dtype": torch.float32},
        # mean 1e4, std 0.1: E[x^2] - E[x]^2 in fp32 would lose the whole variance (ulp(1e8) = 8)
        "offset": _data([4, 2, 3], torch.float32, masked=False, steps=1, offset=1e4, scale=1e-1, seed=5),
    }
    got = _run_group(tmp_path, 3, cases)
    _compare("fp64", got, _reference(cases["fp64"], masked=False), atol=1e-10)
    _compare("fp32", got, _reference(cases["fp32"], masked=False), atol=2e-5)
    _compare("masked", got, _reference(cases["masked"], masked=True), atol=1e-10)
    _compare("masked_all_ranks", got, _reference(cases["masked_all_ranks"], masked=True), atol=1e-10)
    # bf16 output: one rounding of values of magnitude ~3 is ~1.6e-2
    _compare("bf16", got, _reference(cases["bf16"], masked=False), atol=3e-2)
    # the offset case: the output's global per-channel variance is var / (var + eps), var being
    # the float64 variance of the fp32 inputs. Compare the statistic: fp32 statistics at 1e4 carry
    # ~ulp(1e4) = 1e-3 of rounding against a std of 0.1 (measured error ~1e-3), whereas the
    # one-pass formula would return noise of the order of ulp(1e8) = 8 for a variance of 0.01
    case = cases["offset"]
    x = torch.cat([case["steps"][r][0][0] for r in range(3)]).double()
    v = x.var((0, 2, 3), correction=0)
    y = torch.cat([got[r]["offset"]["steps"][0]["y"] for r in range(3)]).double()
    yhat = (y - case["bias"].double().view(1, -1, 1, 1)) / case["weight"].double().view(1, -1, 1, 1)
    torch.testing.assert_close(yhat.var((0, 2, 3), correction=0), v / (v + 1e-5), atol=5e-3, rtol=0)


def test_two_ranks_then_a_rank_raises(tmp_path):
    cases = {"fp64": _data([2, 6], torch.float64, masked=False, seed=6)}
    t0 = time.monotonic()
    got = _run_group(tmp_path, 2, cases, fail_rank=1, timeout=60.0)
    elapsed = time.monotonic() - t0
    _compare("fp64", got, _reference(cases["fp64"], masked=False), atol=1e-10)
    failure = got[0]["failure"]
    assert failure["error"] is not None, "rank 0 completed a collective its peer never joined"
    assert "SyncBatchNorm" in failure["error"] and "all_gather" in failure["error"], failure["error"]
    assert failure["seconds"] < 30 and elapsed < 60


def test_outside_a_process_group_is_batchnorm():
    assert not dist.is_initialized()
    torch.manual_seed(0)
    x = torch.randn(6, C, H, W)
    ours, theirs = normscope.SyncBatchNorm(C), torch.nn.BatchNorm2d(C)
    # a BatchNorm for isinstance checks, but not a torch.nn.SyncBatchNorm: DistributedDataParallel
    # refuses every instance of that class on CPU
    assert isinstance(ours, torch.nn.modules.batchnorm._BatchNorm)
    assert not isinstance(ours, torch.nn.SyncBatchNorm)
    assert ours.state_dict().keys() == theirs.state_dict().keys()
    for _ in range(2):
        torch.testing.assert_close(ours(x), theirs(x))
    torch.testing.assert_close(ours.running_var, theirs.running_var)
    # a mask without a group: BatchNorm over the valid positions
    mask = torch.rand(6, H, W) < 0.6
    y = normscope.SyncBatchNorm(C, dtype=torch.float64)(x.double(), mask)
    ref, _, _ = _masked_bn64(x.double(), mask, torch.ones(C, dtype=torch.float64), torch.zeros(C, dtype=torch.float64))
    torch.testing.assert_close(y, ref)


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_outside_a_process_group_counts_a_checkpointed_recomputation_as_torch(use_reentrant):
    # non-reentrant checkpointing stops the recomputation early by raising from a saved-tensor hook,
    # after the running statistics moved: counted after its call, the batch was then not counted,
    # and momentum=None's next factor (1 / count) was not torch's
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    ours, theirs = normscope.SyncBatchNorm(C, momentum=None), torch.nn.SyncBatchNorm(C, momentum=None)
    for _ in range(2):
        x = torch.randn(4, C, H, W) * 2 + 1
        for layer in (ours, theirs):
            checkpoint(layer, x.clone().requires_grad_(), use_reentrant=use_reentrant).square().sum().backward()
    assert int(ours.num_batches_tracked) == int(theirs.num_batches_tracked) == 4
    torch.testing.assert_close(ours.running_mean, theirs.running_mean, rtol=0, atol=1e-6)
    torch.testing.assert_close(ours.running_var, theirs.running_var, rtol=0, atol=1e-6)


@contextlib.contextmanager
def _rank_group(rank: int, world: int, store: str, out_dir: str, timeout_s: float = 15.0):
    """A spawned rank's gloo group around its body: one thread, the group set up and torn down, and a
    failure's traceback written to ``rank<r>.err`` for the parent to show."""
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world, timeout=timeout)
    try:
        yield
    except BaseException:
        with open(os.path.join(out_dir, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()


def _checkpoint_worker(rank: int, world: int, store: str, xs: list, out_dir: str) -> None:
    from torch.utils.checkpoint import checkpoint

    with _rank_group(rank, world, store, out_dir):
        bn = normscope.SyncBatchNorm(C, momentum=None, dtype=torch.float64)
        for x in xs:
            checkpoint(bn, x[rank].clone().requires_grad_(), use_reentrant=False).square().sum().backward()
        out = {"nbt": int(bn.num_batches_tracked), "rm": bn.running_mean.clone(), "rv": bn.running_var.clone()}
        torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))


def test_two_ranks_count_a_checkpointed_recomputation_as_torch(tmp_path):
    # the synchronized step counted its batch after the step: a recomputation that non-reentrant
    # checkpointing stops early (raising from a saved-tensor hook, after the running statistics
    # moved) was not counted, and momentum=None's next factor was not torch's. The reference:
    # torch.nn.BatchNorm2d on the concatenated batch, checkpointed the same way
    from torch.utils.checkpoint import checkpoint

    g = torch.Generator().manual_seed(3)
    xs = [[torch.randn(2, C, H, W, generator=g, dtype=torch.float64) * 2 + 1 for _ in range(2)] for _ in range(2)]
    got = _spawn(_checkpoint_worker, tmp_path, 2, (xs, str(tmp_path)), None, 90.0)
    ref = torch.nn.BatchNorm2d(C, momentum=None, dtype=torch.float64)
    for x in xs:
        checkpoint(ref, torch.cat(x).requires_grad_(), use_reentrant=False).square().sum().backward()
    for r in got:
        assert r["nbt"] == int(ref.num_batches_tracked) == 4
        torch.testing.assert_close(r["rm"], ref.running_mean)
        torch.testing.assert_close(r["rv"], ref.running_var)


def test_convert_sync_batchnorm_carries_state():
    torch.manual_seed(0)
    inner = torch.nn.Sequential(normscope.BatchNorm1d(5))
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 1), torch.nn.BatchNorm2d(4), inner)
    model[1](torch.randn(8, 4, 2, 2))  # non-trivial running statistics
    model.eval()
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    conv = normscope.SyncBatchNorm.convert_sync_batchnorm(model)
    assert type(conv[1]) is normscope.SyncBatchNorm and type(conv[2][0]) is normscope.SyncBatchNorm
    assert not conv[1].training
    for k, v in conv.state_dict().items():
        torch.testing.assert_close(v, sd[k])
    single = normscope.SyncBatchNorm.convert_sync_batchnorm(torch.nn.BatchNorm2d(2))
    assert type(single) is normscope.SyncBatchNorm


def test_bad_input_errors():
    with pytest.raises(ValueError, match=r"expected `eps` > 0 when training"):
        normscope.SyncBatchNorm(3, eps=0.0)(torch.randn(2, 3, 5))
    bn = normscope.SyncBatchNorm(3)
    with pytest.raises(ValueError, match="expected input with 3 channels"):
        bn(torch.randn(2, 4, 5))
    with pytest.raises(TypeError, match="mask"):
        bn(torch.randn(2, 3, 5), torch.ones(2, 5))
    with pytest.raises(ValueError, match="mask"):
        bn(torch.randn(2, 3, 5), torch.ones(2, 3, 5, dtype=torch.bool))


def _ddp_worker(rank: int, world: int, store: str, data: dict, out_dir: str) -> None:
    """DDP on CPU with a training step; mismatched channel counts; masks deciding the rule together."""
    results: dict = {}
    with _rank_group(rank, world, store, out_dir, timeout_s=20.0):
        # 1. the docs/sync.md example: convert, wrap in DDP (CPU), one SGD step
        torch.manual_seed(0)  # the same initial model on every rank
        model = torch.nn.Sequential(torch.nn.Conv2d(2, C, 1), torch.nn.BatchNorm2d(C), torch.nn.ReLU())
        model = normscope.SyncBatchNorm.convert_sync_batchnorm(model).double()
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        x, dy = data["x"][rank], data["dy"][rank]
        y = ddp(x)
        (y * dy).sum().backward()
        opt.step()
        results["ddp"] = {
            "y": y.detach(),
            "params": {k: v.detach().clone() for k, v in model.state_dict().items()},
        }
        # 2. different channel counts on the two ranks: a clear ValueError on both, in bounded time
        bn = normscope.SyncBatchNorm(C + rank, dtype=torch.float64)
        t0 = time.perf_counter()
        try:
            bn(torch.randn(4, C + rank, 2, dtype=torch.float64))
            results["mismatch"] = {"error": None}
        except Exception as err:  # noqa: BLE001 - recorded for the parent to inspect
            results["mismatch"] = {"error": f"{type(err).__name__}: {err}", "seconds": time.perf_counter() - t0}
        # 3. rank 0 holds an empty masked batch, rank 1 one unmasked value per channel: with a mask on
        # any rank the rule is "at least one valid value" on every rank (no one raises, as one
        # process with that mask); then every mask all-False: every rank raises
        for case, (x, mask) in data["masked"].items():
            bn = normscope.SyncBatchNorm(C, dtype=torch.float64)
            try:
                y = bn(x[rank], mask[rank])
                y.sum().backward()
                results[case] = {"error": None, "rm": bn.running_mean.clone()}
            except ValueError as err:
                results[case] = {"error": str(err)}
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


def test_ddp_on_cpu_training_step_mismatch_and_mask_rule(tmp_path):
    g = torch.Generator().manual_seed(11)
    sizes = [3, 5]
    xs = [torch.randn(n, 2, H, W, generator=g, dtype=torch.float64) for n in sizes]
    dys = [torch.randn(n, C, H, W, generator=g, dtype=torch.float64) for n in sizes]
    empty_mask = torch.zeros(0, 2, dtype=torch.bool)
    data = {
        "x": xs,
        "dy": dys,
        "masked": {
            "one_value": (
                [torch.randn(0, C, 2, dtype=torch.float64), torch.randn(1, C, 1, dtype=torch.float64)],
                [empty_mask, None],
            ),
            "no_valid": (
                [torch.randn(0, C, 2, dtype=torch.float64), torch.randn(2, C, 2, dtype=torch.float64)],
                [empty_mask, torch.zeros(2, 2, dtype=torch.bool)],
            ),
        },
    }
    got = _spawn(_ddp_worker, tmp_path, 2, (data, str(tmp_path)), None, 120.0)

    # reference: one process, torch.nn BatchNorm2d on the concatenated batch, the summed loss, and
    # DDP's gradient averaging (the mean over ranks of each rank's local gradient)
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Conv2d(2, C, 1), torch.nn.BatchNorm2d(C), torch.nn.ReLU()).double()
    y = ref(torch.cat(xs))
    (y * torch.cat(dys)).sum().backward()
    with torch.no_grad():
        for p in ref.parameters():
            p -= 0.1 * p.grad / 2  # each rank's loss is its share; DDP averages over 2 ranks
    for r in range(2):
        torch.testing.assert_close(got[r]["ddp"]["y"], y.detach().split(sizes)[r])
        for k, v in ref.state_dict().items():
            torch.testing.assert_close(got[r]["ddp"]["params"][k], v, msg=lambda m, k=k, r=r: f"rank {r}, {k}: {m}")

    for r in range(2):
        e = got[r]["mismatch"]["error"]
        assert e is not None and e.startswith("ValueError") and "rank 0: 3, rank 1: 4" in e, e
        assert got[r]["mismatch"]["seconds"] < 15
        assert got[r]["one_value"]["error"] is None, got[r]["one_value"]["error"]
        assert "at least one valid" in (got[r]["no_valid"]["error"] or ""), got[r]["no_valid"]
    # one valid value per channel over the group: its mean enters running_mean on both ranks
    x1 = data["masked"]["one_value"][0][1]
    torch.testing.assert_close(got[0]["one_value"]["rm"], 0.1 * x1.reshape(C))
    torch.testing.assert_close(got[1]["one_value"]["rm"], 0.1 * x1.reshape(C))


def test_sync_batch_norm_outside_a_group_refuses_an_all_false_mask_in_training_as_batchnorm():
    # one process is the whole group: its all-False mask has no valid value to take statistics from,
    # which BatchNorm (and every rank of a group, together) refuses -- the running variance must not
    # be pulled towards 0 by an empty batch
    torch.manual_seed(0)
    x, mask = torch.randn(4, 6, 5), torch.zeros(4, 5, dtype=torch.bool)
    with pytest.raises(ValueError, match="at least one valid"):
        normscope.BatchNorm1d(6)(x, mask)
    sbn = normscope.SyncBatchNorm(6)
    before = state_of(sbn)
    with pytest.raises(ValueError, match="at least one valid"):
        sbn(x, mask)
    for k, v in state_of(sbn).items():
        assert torch.equal(v, before[k]), f"{k} changed by a refused call"


def test_sync_batch_norm_outside_a_group_checks_a_masked_calls_parameter_dtypes():
    sbn = normscope.SyncBatchNorm(6)
    sbn.weight = nn.Parameter(torch.ones(6, dtype=torch.float64))
    x, mask = torch.randn(4, 6, 5), torch.rand(4, 5) > 0.3
    with pytest.raises(TypeError, match="weight"):
        sbn(x, mask)


@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("eps", ["1e-5", None])
def test_syncbn_eps_set_to_a_non_number_after_a_call_is_refused_by_name(training, eps):
    """An eps set to a str or None after a call: torch.nn's SyncBatchNorm raises a TypeError from its own
    comparison ("'<=' not supported between instances of 'str' and 'float'"); ours names `eps` (it
    raised the comparison's TypeError too). A float set back gives torch.nn's layer's numbers."""
    ours, theirs = normscope.SyncBatchNorm(4), torch.nn.SyncBatchNorm(4)
    x = torch.randn(3, 4, 5)
    for m in (ours, theirs):
        m.train(training)
        m(x)  # outside a process group: as a BatchNorm, planned
        m.eps = eps
    with pytest.raises(TypeError):
        theirs(x)
    with pytest.raises(TypeError, match=r"SyncBatchNorm: expected `eps` to be a float, got"):
        ours(x)
    ours.eps = theirs.eps = 1e-3
    ours.eval(), theirs.eval()
    theirs.load_state_dict(ours.state_dict())
    torch.testing.assert_close(ours(x), theirs(x))
