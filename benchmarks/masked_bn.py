"""Masked BatchNorm1d vs unmasked BatchNorm1d, forward + backward (a benchmark, not a test).

    PYTHONPATH=src python benchmarks/masked_bn.py [--shape 64 512 128] [--pad 0.3] [--reps 20] [--json out.json]

The masked call runs on the engine's reference backend (ATen has no masked normalization); the
unmasked one on ATen's fused batch_norm. Both in training mode with running statistics. Prints
and saves medians (ms) and the ratio masked / unmasked.
"""

from __future__ import annotations

import argparse
import json
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


def _time_pair(a, b, reps: int, warmup: int = 3) -> tuple[list[float], list[float]]:
    """Alternate the two so that load from other processes hits both alike."""
    for _ in range(warmup):
        a(), b()
    ta, tb = [], []
    for _ in range(reps):
        ta.append(_once(a) * 1e3)
        tb.append(_once(b) * 1e3)
    return ta, tb


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", type=int, nargs=3, default=[64, 512, 128], metavar=("N", "C", "L"))
    ap.add_argument("--pad", type=float, default=0.3, help="fraction of padded positions")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", default="masked_bn.json")
    args = ap.parse_args()
    n, c, length = args.shape
    dev = torch.device(args.device)
    torch.manual_seed(0)
    x = torch.randn(n, c, length, device=dev, requires_grad=True)
    # padding at the end of each sequence, lengths uniform around (1 - pad) * L
    lengths = ((1 - args.pad) * length * (0.5 + torch.rand(n))).clamp(1, length).long()
    mask = (torch.arange(length)[None, :] < lengths[:, None]).to(dev)
    grad = torch.randn_like(x)
    bn = normscope.BatchNorm1d(c).to(dev)

    def step(m):
        def run():
            x.grad = None
            y = bn(x, m) if m is not None else bn(x)
            y.backward(grad)
        return run

    step(None)()
    backend_unmasked = normscope.last_backend()
    step(mask)()
    backend_masked = normscope.last_backend()
    tu, tm = _time_pair(step(None), step(mask), args.reps)
    unmasked, masked = statistics.median(tu), statistics.median(tm)
    result = {
        "shape": [n, c, length],
        "padded_fraction": round(1 - mask.float().mean().item(), 4),
        "device": str(dev) if dev.type == "cpu" else torch.cuda.get_device_name(dev),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "unmasked_ms": round(unmasked, 3),
        "masked_ms": round(masked, 3),
        "ratio": round(masked / unmasked, 3),
        "ratio_of_minima": round(min(tm) / min(tu), 3),
        "backends": {"unmasked": backend_unmasked, "masked": backend_masked},
        "reps": args.reps,
    }
    print(json.dumps(result, indent=2))
    with open(args.json, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
