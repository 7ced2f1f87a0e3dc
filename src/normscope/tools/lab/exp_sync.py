"""sync: BatchNorm vs SyncBatchNorm vs GroupNorm with 4 gloo ranks holding 2 samples each.

Real ``torch.distributed`` processes (gloo backend, CPU) train the digits CNN data-parallel:
every step each rank takes 2 images of a global batch of 8 and gradients are averaged across
ranks. With per-rank BatchNorm each rank normalizes over its own 2 images; SyncBatchNorm
(normscope's, when the installed normscope has one) over all 8; GroupNorm needs no batch.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
from pathlib import Path

import torch

from .core import Context, pyplot
from .norms import available
from .verdicts import SYNC_CLAIM, SYNC_PUBLISHED, skipped, sync_rule

NAME = "sync"
TITLE = "SyncBatchNorm across 4 ranks x 2 samples"
WORLD = 4
PER_RANK = 2
# fork reuses the parent's imports (torch, sklearn): seconds instead of a minute on a busy 2-core box;
# spawn where fork does not exist
_START = "fork" if "fork" in __import__("multiprocessing").get_all_start_methods() else "spawn"
VARIANTS = {"batch": "BN (per rank)", "sync": "SyncBN", "group:8": "GN (G=8)"}


def config(mode: str) -> dict:
    if mode == "smoke":
        return {"epochs": 1, "n_train": 64, "width": 8, "seeds": 1}
    if mode == "quick":
        return {"epochs": 3, "n_train": None, "width": 32, "seeds": 3}
    return {"epochs": 10, "n_train": None, "width": 32, "seeds": 3}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, port: int, cfg: dict, variants: list[str], seed: int, out: str) -> None:
    import torch.distributed as dist
    import torch.nn.functional as F

    from .core import deterministic, seed_all
    from .data import digits
    from .models import SmallCNN, error_rate, norm_sources

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    results = {}
    with deterministic(threads=1):
        xtr, ytr, xte, yte = digits()
        if cfg["n_train"]:
            xtr, ytr = xtr[: cfg["n_train"]], ytr[: cfg["n_train"]]
        for variant in variants:
            g = seed_all(seed)  # same init and data order on every rank
            model = SmallCNN(variant, cfg["width"])
            opt = torch.optim.SGD(model.parameters(), lr=0.1 * WORLD * PER_RANK / 32, momentum=0.9,
                                  weight_decay=5e-4)
            gb = WORLD * PER_RANK
            for _ in range(cfg["epochs"]):
                model.train()
                perm = torch.randperm(len(xtr), generator=g)
                for i in range(len(xtr) // gb):
                    idx = perm[i * gb:(i + 1) * gb][rank * PER_RANK:(rank + 1) * PER_RANK]
                    loss = F.cross_entropy(model(xtr[idx]), ytr[idx])
                    opt.zero_grad(set_to_none=True)
                    loss.backward()
                    for p in model.parameters():
                        dist.all_reduce(p.grad)
                        p.grad /= WORLD
                    opt.step()
            results[variant] = {"err": error_rate(model, xte, yte), "source": norm_sources(model)}
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    dist.destroy_process_group()


def _rank(rank: int, parent: int, *args) -> None:
    """A rank: :func:`_worker` (looked up when the rank starts), in a process that dies with its parent.

    torch's start_processes asks the kernel for SIGINT when the parent dies, which a rank ignores where it
    was started with SIGINT ignored -- the shell's way of starting a background job (``normscope lab &`` in a
    script, ``nohup``), which the lab keeps: SIGINT is for the foreground. Stopped as a background job is
    (SIGTERM, or killed), the parent died and its ranks went on training, orphaned, for minutes. SIGKILL
    cannot be ignored; a rank whose parent is gone has nothing left to finish."""
    import signal

    import torch.multiprocessing as mp

    mp._prctl_pr_set_pdeathsig(signal.SIGKILL)  # Linux's prctl; nothing elsewhere (as torch's own call)
    if os.getppid() != parent:  # the parent died before the request: nothing will send it
        os._exit(1)
    _worker(rank, *args)


def _launch(cfg: dict, variants: list[str], seed: int) -> dict:
    import torch.multiprocessing as mp

    from .core import InterruptedWithResult

    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "rank0.json")
        args = (os.getpid(), _free_port(), cfg, variants, seed, out)
        ctx = mp.start_processes(_rank, args=args, nprocs=WORLD, join=False, start_method=_START)
        try:
            while not ctx.join():
                pass
        except KeyboardInterrupt:
            # the ranks are our children, not torch's: without this they train on (and the parent
            # waits for them at exit) for minutes after Ctrl-C
            _stop(ctx.processes)
            try:  # rank 0 had written the finished run: keep it (a half-written file is no result)
                result = json.loads(Path(out).read_text())
            except (OSError, ValueError):
                raise KeyboardInterrupt from None
            raise InterruptedWithResult(result) from None
        except BaseException:
            _stop(ctx.processes)
            raise
        return json.loads(Path(out).read_text())


def _stop(processes: list, grace: float = 5.0) -> None:
    """Terminate (SIGTERM), then kill what is still alive after ``grace`` seconds."""
    for p in processes:
        if p.is_alive():
            p.terminate()
    for p in processes:
        p.join(grace)
        if p.is_alive():
            p.kill()
            p.join()


def execute(ctx: Context, cfg: dict) -> dict:
    variants = []
    for v in VARIANTS:
        why = available(v, 8, "channels")
        if why:
            ctx.skipped[v] = why
        else:
            variants.append(v)
    runs = []
    for seed in ctx.seeds:
        key = {"seed": seed, "variants": variants, **{k: cfg[k] for k in ("epochs", "n_train", "width")}}
        ctx.progress(f"{WORLD} gloo ranks, seed {seed}", 0, 1, ", ".join(variants), force=True)
        r = ctx.cached(key, lambda seed=seed: _launch(cfg, variants, seed))
        ctx.progress(f"{WORLD} gloo ranks, seed {seed}", 1, 1, "done", force=True)
        for v, m in r.items():
            ctx.sources[v] = m["source"]
            runs.append({"variant": v, "seed": seed, **m})
    err = {v: sum(r["err"] for r in runs if r["variant"] == v) / len(ctx.seeds) for v in variants}
    return {"runs": runs, "err": err, "world_size": WORLD, "per_rank": PER_RANK}


def plot(ctx: Context, cfg: dict, metrics: dict) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    names = [v for v in VARIANTS if v in metrics["err"]]
    ax.bar([VARIANTS[v] for v in names], [metrics["err"][v] for v in names],
           color=["tab:red", "tab:purple", "tab:green"][: len(names)])
    for v in VARIANTS:
        if v not in metrics["err"]:
            ax.text(0.98, 0.95, f"{VARIANTS[v]}: skipped", transform=ax.transAxes, ha="right", va="top", fontsize=8)
    ax.set_ylabel("test error (%)")
    ax.set_title(f"{WORLD} ranks x {PER_RANK} images, gradients all-reduced (n={len(ctx.seeds)} seeds)")
    ctx.savefig(fig, "sync")


def verdicts(metrics: dict) -> list:
    e = metrics["err"]
    if "sync" not in e:
        return [skipped(SYNC_CLAIM, SYNC_PUBLISHED, available("sync", 8, "channels") or "no runs")]
    return [sync_rule(e["batch"], e["sync"], e.get("group:8", float("nan")))]
