"""What ``normscope.watch`` adds to a training step on this CPU (a benchmark, not a test).

    PYTHONPATH=src python3 benchmarks/watch_overhead.py [--rounds 15] [--block 50] [--threads 1]
                                                        [--json benchmarks/results/watch_overhead.json]

Three small models, each trained with SGD on random batches: a small CNN, He et al. 2016's CIFAR ResNet
with one basic block per stage (ResNet-8: 8 BatchNorm2d, 32 x 3 x 32 x 32 per step); a Pre-LN transformer
(4 layers, d = 128, 4 heads, 16 x 64 tokens, 9 LayerNorms); and a CNN whose every conv is cheap next to
the BatchNorm after it (one 3 x 3 conv per stage, 32-256 channels: the watch's per-step reductions, which
read each norm's input twice, weigh most there). Three copies of each model, with identical weights,
train side by side: unwatched, watched at the default ``every=50`` and at ``every=1``. A sample is the
time of a block of ``--block`` steps (one block holds exactly one watched step at ``every=50``); the blocks
of the three copies are interleaved round by round (ABC, then BCA, CAB: no copy always runs first), after
one untimed warm-up block each -- which holds the first watched step, where the doctor's one-batch checks
run once (timed apart, ``first_step_s``). Prints, per model, the median block time of each copy and the
median of the per-round ratios watched / unwatched -- in this process's CPU time, which other tenants of a
shared machine disturb less than the wall time (also saved) -- against the goals (<= 1.03 at ``every=50``,
<= 1.25 at ``every=1``). Then, per model and ``every``, the CPU time spent inside the watch's own hooks over
two blocks, as a fraction of the steps' (``inside_watch``): a direct measure without the two runs' noise.
Saves the samples, the machine and the command as JSON.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import sys
import time

import torch
from torch import nn

import normscope

GOALS = {50: 1.03, 1: 1.25}


class CNN(nn.Module):
    def __init__(self, widths=(32, 64, 128, 256), classes: int = 10) -> None:
        super().__init__()
        layers, cin = [], 3
        for i, c in enumerate(widths):
            layers += [nn.Conv2d(cin, c, 3, 1 if i == 0 else 2, 1, bias=False), nn.BatchNorm2d(c), nn.ReLU()]
            cin = c
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).mean((2, 3)))


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x)))))
        return torch.relu(y + (x if self.down is None else self.down(x)))


class ResNet8(nn.Module):
    """He et al. 2016's CIFAR ResNet with one basic block per stage (16, 32, 64 channels): 8 BatchNorms."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 16, 3, 1, 1, bias=False)
        self.bn = nn.BatchNorm2d(16)
        self.stages = nn.Sequential(BasicBlock(16, 16, 1), BasicBlock(16, 32, 2), BasicBlock(32, 64, 2))
        self.head = nn.Linear(64, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.stages(torch.relu(self.bn(self.conv(x)))).mean((2, 3)))


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class Transformer(nn.Module):
    def __init__(self, vocab: int = 256, d: int = 128, heads: int = 4, layers: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm(x))


def cases():
    g = torch.Generator().manual_seed(0)
    images = [torch.randn(32, 3, 32, 32, generator=g) for _ in range(4)]
    labels = [torch.randint(0, 10, (32,), generator=g) for _ in range(4)]
    tokens = [torch.randint(0, 256, (16, 64), generator=g) for _ in range(4)]
    return {
        "resnet8": (ResNet8, images, labels, lambda y, t: nn.functional.cross_entropy(y, t)),
        "bn-heavy-cnn": (CNN, images, labels, lambda y, t: nn.functional.cross_entropy(y, t)),
        "transformer": (
            Transformer,
            tokens,
            tokens,
            lambda y, t: nn.functional.cross_entropy(y.flatten(0, 1), t.flatten()),
        ),
    }


def run_block(model, opt, loss_fn, xs, ts, steps: int, start: int) -> tuple[float, float]:
    """(wall seconds, this process's CPU seconds) of ``steps`` training steps."""
    t0, c0 = time.perf_counter(), time.process_time()
    for i in range(start, start + steps):
        loss = loss_fn(model(xs[i % len(xs)]), ts[i % len(ts)])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return time.perf_counter() - t0, time.process_time() - c0


def measure(name: str, rounds: int, block: int) -> dict:
    build, xs, ts, loss_fn = cases()[name]
    torch.manual_seed(0)
    base = build()
    variants = {"unwatched": None, "every=50": 50, "every=1": 1}
    runs = {}
    for label, every in variants.items():
        model = copy.deepcopy(base).train()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        w = normscope.watch(model, every=every).start() if every else None
        runs[label] = [model, opt, w, 0]
    first = {}
    for label, r in runs.items():  # warm-up block: holds step 0, the first watched step
        t0 = time.perf_counter()
        run_block(r[0], r[1], loss_fn, xs, ts, 1, 0)
        first[label] = time.perf_counter() - t0
        run_block(r[0], r[1], loss_fn, xs, ts, block - 1, 1)
        r[3] = block
    wall = {label: [] for label in runs}
    cpu = {label: [] for label in runs}
    order = list(runs)
    for k in range(rounds):
        for label in order[k % 3 :] + order[: k % 3]:
            r = runs[label]
            w_s, c_s = run_block(r[0], r[1], loss_fn, xs, ts, block, r[3])
            wall[label].append(w_s)
            cpu[label].append(c_s)
            r[3] += block
    reports = {label: r[2].report() for label, r in runs.items() if r[2] is not None}
    for r in runs.values():
        if r[2] is not None:
            r[2].close()
    out = {"block_steps": block, "first_step_s": first, "median_block_s": {}, "ratio": {}, "ratio_wall": {}}
    out["samples_cpu_s"], out["samples_wall_s"] = cpu, wall
    for label in runs:
        out["median_block_s"][label] = {"cpu": statistics.median(cpu[label]), "wall": statistics.median(wall[label])}
    for label, every in variants.items():
        if every:
            for key, samples in (("ratio", cpu), ("ratio_wall", wall)):
                ratios = [a / b for a, b in zip(samples[label], samples["unwatched"])]
                out[key][label] = {"median": statistics.median(ratios), "goal": GOALS[every], "per_round": ratios}
    out["findings"] = {label: [(f.severity, f.check, f.module) for f in rep.findings] for label, rep in reports.items()}
    return out


def inside_watch(name: str, every: int, steps: int) -> dict:
    """The CPU time spent inside the watch's own hooks (its reductions, its bookkeeping, its checks), per step,
    against the whole step's: the watch's cost without the noise of a comparison between two runs (it leaves
    out what the hooks cost torch's module call and the caches)."""
    from normscope.doctor import Watch

    build, xs, ts, loss_fn = cases()[name]
    torch.manual_seed(0)
    model = build().train()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    spent = [0.0]

    def timed(f):
        def g(*a, **k):
            c0 = time.process_time()
            try:
                return f(*a, **k)
            finally:
                spent[0] += time.process_time() - c0

        return g

    names = ("_root_before", "_root_after", "_first_after")
    saved = {n: getattr(Watch, n) for n in (*names, "_norm_hook", "_bn_before")}
    try:
        for n in names:
            setattr(Watch, n, timed(saved[n]))
        Watch._norm_hook = lambda self, path: timed(saved["_norm_hook"](self, path))
        Watch._bn_before = lambda self, path: timed(saved["_bn_before"](self, path))
        w = normscope.watch(model, every=every).start()
        run_block(model, opt, loss_fn, xs, ts, every, 0)  # the first watched step and a full cycle after it
        spent[0] = 0.0
        _, total = run_block(model, opt, loss_fn, xs, ts, steps, every)
        w.close()
    finally:
        for n, f in saved.items():
            setattr(Watch, n, f)
    return {"steps": steps, "watch_cpu_s": spent[0], "step_cpu_s": total, "fraction": spent[0] / total}


def cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--block", type=int, default=50)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--models", default="resnet8,transformer,bn-heavy-cnn")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    result = {
        "command": "PYTHONPATH=src python3 " + " ".join(sys.argv),
        "machine": {
            "cpu": cpu_model(),
            "cores": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "python": platform.python_version(),
            "platform": platform.platform(),
            "load_average_at_start": os.getloadavg(),
        },
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "models": {},
    }
    for name in args.models.split(","):
        got = measure(name, args.rounds, args.block)
        result["models"][name] = got
        med = got["median_block_s"]
        print(f"{name}: unwatched {1e3 * med['unwatched']['cpu'] / args.block:.2f} ms/step (CPU time)")
        for label, r in got["ratio"].items():
            ok = "ok" if r["median"] <= r["goal"] else "NOT MET"
            wall = got["ratio_wall"][label]["median"]
            print(f"  {label:>9}: {r['median']:.3f} x unwatched, CPU time (goal <= {r['goal']}) {ok}; wall {wall:.3f}")
        print(f"  first watched step: {got['first_step_s']['every=50']:.3f} s (unwatched step 0: "
              f"{got['first_step_s']['unwatched']:.3f} s)")  # fmt: skip
        got["inside_watch"] = {f"every={k}": inside_watch(name, k, 2 * args.block) for k in (50, 1)}
        for label, r in got["inside_watch"].items():
            print(f"  {label:>9}: {100 * r['fraction']:.2f}% of the step's CPU time inside the watch's hooks")
    result["machine"]["load_average_at_end"] = os.getloadavg()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        print(f"saved {args.json}")


if __name__ == "__main__":
    main()
