"""SyncBatchNorm cost against its floor: local BatchNorm plus the communication it must do.

Spawns ``--world`` gloo ranks on this host. Each rank times, forward+backward, medians over
``--iters`` (a barrier before every timed iteration so that ranks start together):

* ``local``  -- normscope.BatchNorm2d on the rank's own batch (no communication);
* ``comm``   -- the same payload SyncBatchNorm sends: one all_gather of 3*C fp64 numbers and one
  all_reduce of 2*C numbers in the input's accumulation dtype;
* ``sync``   -- normscope.SyncBatchNorm on the rank's batch;
* ``compute only`` -- the same autograd function on a one-rank group: its computation and
  collective calls, without waiting for the other rank (separates cost from rank skew).

Target: ``sync <= 1.5 * (local + comm)``. Prints a table per run and writes JSON (``--out``)::

    PYTHONPATH=src python benchmarks/syncbn.py --iters 60 --runs 4 --out benchmarks/results/syncbn.json

On a 2-core machine the two single-threaded ranks have no spare core: any other process skews them,
which is why several short runs are reported rather than one long one.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
import normscope  # noqa: E402
from normscope.engine import Running  # noqa: E402
from normscope.modules.syncbatchnorm import _SyncBatchNormFn  # noqa: E402


def _time(fns: list, iters: int, warmup: int = 3) -> list[float]:
    """Median seconds of each function; interleaved per iteration so load drift hits all alike."""
    for _ in range(warmup):
        for fn in fns:
            dist.barrier()
            fn()
    out: list[list[float]] = [[] for _ in fns]
    for _ in range(iters):
        for fn, times in zip(fns, out):
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return [statistics.median(t) for t in out]


def _worker(rank: int, world: int, store: str, shapes: list, iters: int, threads: int, out: str) -> None:
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    # a one-rank group per rank: SyncBatchNorm's compute and collective calls without any waiting
    solo = [dist.new_group([r]) for r in range(world)][rank]
    rows = []
    for shape in shapes:
        torch.manual_seed(rank)
        c = shape[1]
        x = torch.randn(shape, requires_grad=True)
        dy = torch.randn(shape)
        local, sync = normscope.BatchNorm2d(c), normscope.SyncBatchNorm(c)
        gathered = [torch.empty(3 * c, dtype=torch.float64) for _ in range(world)]
        stats, sums = torch.randn(3 * c, dtype=torch.float64), torch.randn(2 * c)

        def run(layer, x=x, dy=dy):
            def step():
                x.grad = None
                layer(x).backward(dy)
            return step

        def solo_step(x=x, dy=dy, layer=sync):
            x.grad = None
            running = Running(layer.running_mean, layer.running_var, 0.1, True)
            y = _SyncBatchNormFn.apply(x, None, layer.weight, layer.bias, 1e-5, solo, 1, running, "SyncBatchNorm")
            y.backward(dy)

        def comm(gathered=gathered, stats=stats, sums=sums):
            dist.all_gather(gathered, stats)
            dist.all_reduce(sums)

        t_local, t_comm, t_sync, t_solo = _time([run(local), comm, run(sync), solo_step], iters)
        # a collective waits for the slowest rank: the floor is the slowest rank's local BatchNorm
        slowest = torch.tensor([t_local])
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        t_max = float(slowest)
        rows.append({"shape": list(shape), "local_ms": t_local * 1e3, "local_slowest_rank_ms": t_max * 1e3,
                     "comm_ms": t_comm * 1e3, "sync_ms": t_sync * 1e3, "ratio": t_sync / (t_local + t_comm),
                     "ratio_vs_slowest": t_sync / (t_max + t_comm), "sync_compute_only_ms": t_solo * 1e3,
                     "compute_ratio": t_solo / t_local})
    if rank == 0:
        with open(out, "w") as f:
            json.dump(rows, f)
    dist.destroy_process_group()


def _run_once(world: int, shapes: list, iters: int, threads: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        res = os.path.join(tmp, "rows.json")
        store = os.path.join(tmp, "store")
        mp.start_processes(_worker, args=(world, store, shapes, iters, threads, res), nprocs=world,
                           start_method="spawn")
        with open(res) as f:
            return json.load(f)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--runs", type=int, default=1, help="independent runs (fresh process groups), each reported")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args()
    shapes = [(8, 16, 16, 16), (16, 64, 32, 32), (32, 256, 14, 14)]
    runs = []
    for k in range(args.runs):
        rows = _run_once(args.world, shapes, args.iters, args.threads)
        runs.append(rows)
        print(f"run {k + 1}/{args.runs}: SyncBatchNorm, {args.world} gloo ranks on one host, {args.threads} "
              f"thread(s) each, fp32, forward+backward, median of {args.iters}")
        print(f"{'shape per rank':>20} {'local BN ms':>12} {'slowest rank':>12} {'comm ms':>9} {'sync ms':>9} "
              f"{'sync/(local+comm)':>18} {'vs slowest':>10} {'compute only/local':>18}")
        for r in rows:
            print(f"{str(tuple(r['shape'])):>20} {r['local_ms']:12.3f} {r['local_slowest_rank_ms']:12.3f} "
                  f"{r['comm_ms']:9.3f} {r['sync_ms']:9.3f} {r['ratio']:18.2f} {r['ratio_vs_slowest']:10.2f} "
                  f"{r['compute_ratio']:18.2f}")
    summary = [{"shape": list(shape),
                "ratio_per_run": [round(rows[i]["ratio"], 2) for rows in runs],
                "ratio_median": round(statistics.median(rows[i]["ratio"] for rows in runs), 2),
                "compute_only_over_local_per_run": [round(rows[i]["compute_ratio"], 2) for rows in runs]}
               for i, shape in enumerate(shapes)]
    if args.runs > 1:
        print("sync/(local+comm) per run: " + "; ".join(
            f"{tuple(s['shape'])}: {', '.join(map(str, s['ratio_per_run']))} (median {s['ratio_median']})"
            for s in summary))
    report = {"benchmark": "syncbn", "world": args.world, "threads_per_rank": args.threads, "iters": args.iters,
              "torch": torch.__version__, "device": "cpu", "machine": f"{platform.machine()}, "
              f"{os.cpu_count()} logical cores", "dtype": "float32", "target_ratio": 1.5,
              "command": "PYTHONPATH=src python " + " ".join(sys.argv), "summary": summary, "runs": runs}
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
