"""Masked BatchNorm1d vs unmasked BatchNorm1d, forward + backward (a benchmark, not a test).

    PYTHONPATH=src python benchmarks/masked_bn.py [--shape 64 512 128] [--pad 0.3] [--reps 20]
                                                  [--layout ncl|bsd] [--json out.json]

Three implementations, interleaved round by round so that load from other processes hits them
alike: the unmasked layer (ATen's fused batch_norm), the masked layer with the automatic backend
choice (``composite`` on a CPU: bmm statistics and a closed-form backward), and the masked layer
forced onto the ``reference`` backend (plain autograd ops, the previous path). All in training
mode with running statistics. Prints and saves medians (ms) and the ratios to the unmasked layer.
``--layout bsd`` runs (B, S, D) = (N, L, C) with ``channel_dim=-1``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch

import normscope


def _once(fn) -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def _time_rounds(fns: dict, reps: int, warmup: int = 3) -> dict[str, list[float]]:
    """Run every function once a round, in a rotating order, ``reps`` rounds; times in ms."""
    names = list(fns)
    for _ in range(warmup):
        for name in names:
            fns[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(reps):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            times[name].append(_once(fns[name]) * 1e3)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", type=int, nargs=3, default=[64, 512, 128], metavar=("N", "C", "L"))
    ap.add_argument("--pad", type=float, default=0.3, help="fraction of padded positions")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument(
        "--layout", choices=("ncl", "bsd"), default="ncl", help="(N, C, L), or (B, S, D) with channel_dim=-1"
    )
    ap.add_argument("--json", default="masked_bn.json")
    args = ap.parse_args()
    n, c, length = args.shape
    dev = torch.device(args.device)
    torch.manual_seed(0)
    bsd = args.layout == "bsd"
    x = torch.randn(*((n, length, c) if bsd else (n, c, length)), device=dev, requires_grad=True)
    # padding at the end of each sequence, lengths uniform around (1 - pad) * L
    lengths = ((1 - args.pad) * length * (0.5 + torch.rand(n))).clamp(1, length).long()
    mask = (torch.arange(length)[None, :] < lengths[:, None]).to(dev)
    grad = torch.randn_like(x)
    bn = normscope.BatchNorm1d(c, channel_dim=-1 if bsd else 1).to(dev)

    def step(m, backend=None):
        def run():
            x.grad = None
            with normscope.use_backend(backend):
                y = bn(x, m) if m is not None else bn(x)
            y.backward(grad)

        return run

    fns = {"unmasked": step(None), "masked": step(mask), "masked_reference": step(mask, "reference")}
    backends = {}
    for name, fn in fns.items():
        fn()
        backends[name] = normscope.last_backend()
    times = _time_rounds(fns, args.reps)
    med = {name: statistics.median(t) for name, t in times.items()}
    # per-round ratios: both sides of a ratio ran back to back, under the same load
    ratio = lambda a: statistics.median(ta / tu for ta, tu in zip(times[a], times["unmasked"]))  # noqa: E731
    result = {
        "shape": list(x.shape),
        "layout": args.layout,
        "padded_fraction": round(1 - mask.float().mean().item(), 4),
        "device": str(dev) if dev.type == "cpu" else torch.cuda.get_device_name(dev),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "processor": platform.processor() or None,
        "cpu_count": os.cpu_count(),
        "load_avg_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "unmasked_ms": round(med["unmasked"], 3),
        "masked_ms": round(med["masked"], 3),
        "masked_reference_ms": round(med["masked_reference"], 3),
        "ratio": round(ratio("masked"), 3),
        "ratio_reference": round(ratio("masked_reference"), 3),
        "backends": backends,
        "reps": args.reps,
        "samples_ms": {name: [round(t, 3) for t in ts] for name, ts in times.items()},
    }
    print(json.dumps({k: v for k, v in result.items() if k != "samples_ms"}, indent=2))
    with open(args.json, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
