"""CPU speed of normscope's layers against their ``torch.nn`` namesakes: forward, and forward + backward.

normscope routes every layer through one engine (checks -> scope -> backend plan -> ATen op), so on
CPU, where the same ATen kernels do the work, the only possible cost is Python overhead. It matters
at small shapes (tens of microseconds a call) and should vanish at large ones. RMSNorm is the
exception: torch's CPU ``rms_norm`` is a chain of ops, normscope's one reduction each way
(``normscope.backends.rms``). Goals, median time ratio normscope / torch:

    small shapes   forward <= 1.25, forward + backward <= 1.15   (per-call cost)
    functional     normscope.functional's forward <= 1.6 x torch.nn.functional's at small shapes (the
                   numerics check included): LayerNorm/RMSNorm 32x64, GroupNorm, BatchNorm train and
                   eval, InstanceNorm on 8x16x4x4, one thread
    import         ``import normscope`` adds <= 0.25 s to ``import torch`` (every extra installed)
    large shapes   <= 1.05 both ways; RMSNorm <= 0.5 both ways (at least 2x faster), fp32 and bf16
    compiled       a small normscope model under torch.compile <= 1.05 x the same torch.nn model compiled
                   ("no slower": 1.05 is the noise allowance of one such measurement)
    rows           RMSNorm at 16..2048 x 1024, around the fast path's threshold: <= 1.05 where the fast
                   path runs, the small-shape goals below it (torch's op runs; the per-call cost is left)
    rows-forced    the rows path forced at row lengths 256, 1024, 4096 and 65K..4M elements: where it
                   beats torch's op (informational: what ``rms.MIN_AUTO_ELEMENTS`` is derived from)
    memory         peak memory (max RSS growth, fresh process) of one forward + backward of
                   RMSNorm(4096) on 8192 rows, fp32 and bf16, and LayerNorm(4096): <= torch's

Method: for each case both layers run the same forward + backward on the same tensors; the two are
*interleaved* (ABAB... with the order swapped every round, so drift and neighbours' load hit both
alike; ABBA pairs also cancel position effects), each measurement is a block of calls lasting at
least ``--min-block-ms``, and the ratio reported is the median over round pairs of the per-pair
ratio (with the medians of each side).
Also recorded: the same ratio on process CPU time, and the ratio of the fastest blocks -- on a
busy machine the least disturbed estimate.

    PYTHONPATH=src python3 benchmarks/cpu_overhead.py                  # full run, ~1-3 min
    PYTHONPATH=src python3 benchmarks/cpu_overhead.py --cases LayerNorm:small --rounds 50
    PYTHONPATH=src python3 benchmarks/cpu_overhead.py --quick          # smoke test, seconds
    PYTHONPATH=src python3 benchmarks/cpu_overhead.py --compile        # also the torch.compile case

Writes JSON (machine, torch version, threads, every sample) to ``--out``, by default a new
``results/cpu_speed-<UTC time>.json`` beside the committed ``results/cpu_speed.json`` (the README's
figures; replace it deliberately with ``--out results/cpu_speed.json``).
``results/cpu_overhead*.json`` measure a slower state of the code (fewer cases, torch's default
threads): a baseline to compare against, not the README's figures.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime as dt
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

import normscope
from normscope.backends.rms import MIN_AUTO_ELEMENTS

RESULTS = Path(__file__).resolve().parent / "results"
COMMITTED = RESULTS / "cpu_speed.json"  # the measurement the README and the automatic choices cite


def default_out() -> Path:
    """A new file beside the committed results, never over them: ``cpu_speed-<UTC time>.json``
    (to replace the committed measurement, pass ``--out`` explicitly)."""
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    return RESULTS / f"cpu_speed-{stamp}.json"


@dataclass(frozen=True)
class Case:
    layer: str
    size: str  # "small", "large", "rows" (RMSNorm sizes between: where the fast path starts) or "compiled"
    shape: tuple[int, ...]
    make: Callable[[type[nn.Module] | object], nn.Module]  # given the module namespace (nn or normscope)
    dtype: torch.dtype = torch.float32
    # "layer": make() is given torch.nn / normscope; "functional": torch.nn.functional /
    # normscope.functional, and returns a function of the input (forward only)
    kind: str = "layer"

    @property
    def name(self) -> str:
        return f"{self.layer}:{self.size}"


MODES = ("fwd", "fwdbwd")
# goal per (size, mode); RMSNorm at large shapes has its own (at least 2x faster than torch's)
TARGETS = {("small", "fwd"): 1.25, ("small", "fwdbwd"): 1.15, ("large", "fwd"): 1.05, ("large", "fwdbwd"): 1.05}
RMS_LARGE_TARGET = 0.5
COMPILED_TARGET = 1.05
FUNCTIONAL_TARGET = 1.6
IMPORT_TARGET_S = 0.25


def target(case: Case, mode: str) -> float:
    if case.layer.startswith("RMSNorm") and case.size == "large":
        return RMS_LARGE_TARGET
    if case.size == "compiled":
        return COMPILED_TARGET
    if case.size == "rows-forced":  # informational: where the rows path is faster than torch's op
        return 1.0
    if case.kind == "functional":
        return FUNCTIONAL_TARGET
    if case.size == "rows":
        # around the RMS fast path's threshold: where the automatic order picks it (from
        # MIN_AUTO_ELEMENTS), it must not be slower than torch; below, torch's own op runs and what
        # is left is the per-call cost, whose goal is the small shapes'
        if math.prod(case.shape) >= MIN_AUTO_ELEMENTS:
            return 1.05
        return TARGETS[("small", mode)]
    return TARGETS[(case.size, mode)]


def _cases() -> list[Case]:
    tokens = {"small": (32, 512), "large": (8192, 1024)}
    images = {"small": (8, 32, 8, 8), "large": (32, 64, 56, 56)}
    out = []
    for size in ("small", "large"):
        d = tokens[size][-1]
        c = images[size][1]
        out += [
            Case("LayerNorm", size, tokens[size], lambda m, d=d: m.LayerNorm(d)),
            Case("RMSNorm", size, tokens[size], lambda m, d=d: m.RMSNorm(d)),
            Case("GroupNorm", size, images[size], lambda m, c=c: m.GroupNorm(8, c)),
            Case("BatchNorm2d", size, images[size], lambda m, c=c: m.BatchNorm2d(c)),
            Case("InstanceNorm2d", size, images[size], lambda m, c=c: m.InstanceNorm2d(c, affine=True)),
        ]
    # the per-call shapes that matter most, and RMSNorm in bf16 and at the sizes around the fast path's threshold
    out += [
        Case("LayerNorm(64)", "small", (32, 64), lambda m: m.LayerNorm(64)),
        Case("GroupNorm(4,16)", "small", (8, 16, 4, 4), lambda m: m.GroupNorm(4, 16)),
        Case("BatchNorm2d(16)", "small", (8, 16, 4, 4), lambda m: m.BatchNorm2d(16)),
        Case("RMSNorm(64)", "small", (32, 64), lambda m: m.RMSNorm(64)),
        Case("RMSNorm-bf16", "large", (8192, 1024), lambda m: m.RMSNorm(1024, dtype=torch.bfloat16), torch.bfloat16),
    ]
    for rows in (16, 64, 256, 1024, 2048):
        out.append(Case(f"RMSNorm({rows}x1024)", "rows", (rows, 1024), lambda m: m.RMSNorm(1024)))
    # the rows path forced, over row lengths and counts around MIN_AUTO_ELEMENTS: where it beats
    # torch's op, which is what the threshold is derived from (the two give the same bits per row)
    for n, counts in ((256, (256, 1024, 4096, 16384)), (1024, (64, 256, 1024, 4096)), (4096, (16, 64, 256, 1024))):
        for rows in counts:
            out.append(Case(f"RMSNorm-rows({rows}x{n})", "rows-forced", (rows, n), lambda m, n=n: _rows_forced(m, n)))
    return out


class _RowsForced(nn.Module):
    """normscope's RMSNorm with the CPU rows path forced (the rows backend)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n = n
        self.weight = nn.Parameter(torch.ones(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return normscope.functional.rms_norm(x, (self.n,), self.weight, None, backend="rows")


def _rows_forced(m, n: int) -> nn.Module:
    return m.RMSNorm(n) if m is nn else _RowsForced(n)


def _functional_cases() -> list[Case]:
    """The functional API at the small shapes, forward only: what a call costs beside torch's."""
    w64, b64 = torch.randn(64), torch.randn(64)
    w16, b16 = torch.randn(16), torch.randn(16)
    rm, rv = torch.zeros(16), torch.ones(16)

    def case(name, shape, call):
        return Case(f"F.{name}", "small", shape, call, kind="functional")

    return [
        case("layer_norm", (32, 64), lambda F: lambda x: F.layer_norm(x, (64,), w64, b64)),
        case("rms_norm", (32, 64), lambda F: lambda x: F.rms_norm(x, (64,), w64)),
        case("group_norm", (8, 16, 4, 4), lambda F: lambda x: F.group_norm(x, 4, w16, b16)),
        case("batch_norm-train", (8, 16, 4, 4), lambda F: lambda x: F.batch_norm(x, rm, rv, w16, b16, True)),
        case("batch_norm-eval", (8, 16, 4, 4), lambda F: lambda x: F.batch_norm(x, rm, rv, w16, b16, False)),
        case("instance_norm", (8, 16, 4, 4), lambda F: lambda x: F.instance_norm(x, weight=w16, bias=b16)),
    ]


def import_cost(pairs: int = 10) -> dict:
    """Seconds that ``import normscope`` adds to ``import torch``: fresh interpreters, the two
    commands interleaved (ABBA), median of per-pair differences; and ``normscope --version``."""
    env = {**os.environ, "PYTHONPATH": str(Path(normscope.__file__).resolve().parents[1])}
    commands = {
        "torch": [sys.executable, "-c", "import torch"],
        "normscope": [sys.executable, "-c", "import torch, normscope"],
        "cli_version": [sys.executable, "-m", "normscope", "--version"],
    }

    def once(name: str) -> float:
        t0 = time.perf_counter()
        subprocess.run(commands[name], env=env, check=True, capture_output=True)
        return time.perf_counter() - t0

    once("torch"), once("normscope")  # page cache
    diffs, times = [], {k: [] for k in commands}
    for i in range(pairs):
        order = ("torch", "normscope") if i % 2 == 0 else ("normscope", "torch")
        t = {name: once(name) for name in order}
        for k, v in t.items():
            times[k].append(v)
        diffs.append(t["normscope"] - t["torch"])
        times["cli_version"].append(once("cli_version"))
    added = statistics.median(diffs)
    return {
        "pairs": pairs,
        "import_torch_median_s": statistics.median(times["torch"]),
        "import_torch_and_normscope_median_s": statistics.median(times["normscope"]),
        "normscope_version_cli_median_s": statistics.median(times["cli_version"]),
        "added_s": added,
        "added_q1_q3_s": statistics.quantiles(diffs, n=4)[::2] if len(diffs) >= 2 else [added, added],
        "target_s": IMPORT_TARGET_S,
        "meets_target": added <= IMPORT_TARGET_S,
    }


#: peak memory: forward + backward of (layer, rows, width, dtype), each in a fresh process, one thread
MEMORY_CASES = (
    ("RMSNorm", 8192, 4096, "float32"),
    ("RMSNorm", 8192, 4096, "bfloat16"),
    ("LayerNorm", 8192, 4096, "float32"),
)

_MEMORY_SCRIPT = """
import json, resource, sys, torch
torch.set_num_threads(1)
import normscope

def peak_kib():
    # this process's own peak: /proc's VmHWM, of its address space alone. ru_maxrss is not that on
    # Linux: exec keeps the larger of the parent's peak at the fork, so a child of a large benchmark
    # process would start "above" its own allocations and report less growth than it had
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

impl, layer, rows, n, dtype = sys.argv[1:]
dt = getattr(torch, dtype)
g = torch.Generator().manual_seed(0)
x = torch.randn(int(rows), int(n), generator=g, dtype=dt).requires_grad_()  # no fp32 copy: the baseline
dy = torch.randn(int(rows), int(n), generator=g, dtype=dt)  # peak must be the inputs' own
m = getattr(torch.nn if impl == "torch" else normscope, layer)(int(n), dtype=dt)
before = peak_kib()
m(x).backward(dy)
after = peak_kib()
print(json.dumps({"growth_mib": (after - before) / 1024}))
"""


def peak_memory() -> list[dict]:
    """Max RSS growth (MiB) of one forward + backward, torch.nn's layer and normscope's, each in a fresh
    interpreter (the input and output gradient allocated before the baseline): what a call costs in
    memory beyond its inputs, temporaries and saved tensors included. Goal: normscope <= torch (4 MiB
    of noise allowed: the same ATen ops differ by a page or so from process to process)."""
    env = {**os.environ, "PYTHONPATH": str(Path(normscope.__file__).resolve().parents[1])}
    out = []
    for layer, rows, n, dtype in MEMORY_CASES:
        growth = {}
        for impl in ("torch", "normscope"):
            cmd = [sys.executable, "-c", _MEMORY_SCRIPT, impl, layer, str(rows), str(n), dtype]
            done = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
            growth[impl] = json.loads(done.stdout.strip().splitlines()[-1])["growth_mib"]
        out.append({
            "case": f"{layer}({n}) {rows}x{n} {dtype} fwd+bwd",
            "torch_peak_growth_mib": round(growth["torch"], 1),
            "normscope_peak_growth_mib": round(growth["normscope"], 1),
            # RMSNorm: well under torch (its own rows); the others run torch's ops: as torch, to noise
            "meets_target": growth["normscope"] <= growth["torch"] + 4.0,
        })
    return out


def _compiled_cases() -> list[Case]:
    def block(m):  # a pre-norm MLP block's norms around two linear layers
        return nn.Sequential(
            m.LayerNorm(256), nn.Linear(256, 256), m.RMSNorm(256), nn.Linear(256, 256), m.LayerNorm(256)
        )

    return [Case("compiled-block", "compiled", (64, 256), block)]


def _step_fn(layer: nn.Module, x: torch.Tensor, grad: torch.Tensor, mode: str) -> Callable[[], None]:
    if mode == "fwd":  # a training forward: autograd records the graph, as it does before a backward
        return lambda: layer(x)
    params = list(layer.parameters())

    def step() -> None:
        x.grad = None
        for p in params:
            p.grad = None
        layer(x).backward(grad)

    return step


def _block(step: Callable[[], None], inner: int) -> tuple[float, float]:
    """Seconds per call: (wall clock, process CPU time). CPU time is less sensitive to this process
    being descheduled on a shared machine; wall clock is what a user waits for. Both are kept."""
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(inner):
        step()
    return (time.perf_counter() - t0) / inner, (time.process_time() - c0) / inner


def run_case(case: Case, mode: str, rounds: int, min_block_s: float, warmup_s: float) -> dict:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(case.shape, generator=g).to(case.dtype).requires_grad_()
    grad = torch.randn(case.shape, generator=g).to(case.dtype)
    if case.kind == "functional":
        layers = {"torch": case.make(torch.nn.functional), "normscope": case.make(normscope.functional)}
    else:
        layers = {"torch": case.make(nn).train(), "normscope": case.make(normscope).train()}
    if case.size == "compiled":
        layers["normscope"].load_state_dict(layers["torch"].state_dict())
        layers = {k: torch.compile(v) for k, v in layers.items()}
    steps = {k: _step_fn(v, x, grad, mode) for k, v in layers.items()}
    # warm up both (allocator, plan cache) and calibrate the block length on torch
    per_call = min(_block(steps["torch"], 1)[0] for _ in range(3))
    _block(steps["normscope"], 3)
    inner = max(1, min(1000, int(min_block_s / max(per_call, 1e-7))))
    t_end = time.perf_counter() + warmup_s
    while time.perf_counter() < t_end:
        _block(steps["torch"], inner)
        _block(steps["normscope"], inner)

    # Rounds come in ABBA pairs (torch, normscope | normscope, torch) and each ratio is taken over a
    # pair: a block's time can depend on its position (large shapes: the block that follows one of
    # its own kind was ~1.6x slower here, probably allocator reuse), and ABBA cancels that.
    samples: dict[str, list[float]] = {"torch": [], "normscope": []}
    cpu: dict[str, list[float]] = {"torch": [], "normscope": []}
    ratios, cpu_ratios = [], []
    for _ in range(max(1, rounds // 2)):
        pair = {"torch": [0.0, 0.0], "normscope": [0.0, 0.0]}
        for order in (("torch", "normscope"), ("normscope", "torch")):
            for name in order:
                t, c = _block(steps[name], inner)
                samples[name].append(t)
                cpu[name].append(c)
                pair[name][0] += t
                pair[name][1] += c
        ratios.append(pair["normscope"][0] / pair["torch"][0])
        cpu_ratios.append(pair["normscope"][1] / max(pair["torch"][1], 1e-12))
    rounds = 2 * len(ratios)
    med = {k: statistics.median(v) for k, v in samples.items()}
    q = statistics.quantiles(ratios, n=4) if len(ratios) >= 2 else [ratios[0]] * 3
    ratio = statistics.median(ratios)
    layers["normscope"](x)
    backend = normscope.last_backend()
    return {
        "case": case.name,
        "mode": mode,
        "layer": case.layer,
        "size": case.size,
        "shape": list(case.shape),
        "dtype": str(case.dtype).removeprefix("torch."),
        "normscope_backend": backend if case.size != "compiled" else "compiled",
        "calls_per_block": inner,
        "rounds": rounds,
        "torch_median_us": med["torch"] * 1e6,
        "normscope_median_us": med["normscope"] * 1e6,
        "ratio": ratio,  # median over ABBA round pairs of normscope / torch
        "ratio_of_medians": med["normscope"] / med["torch"],
        "ratio_q1_q3": [q[0], q[2]],
        # fastest block of each: the least disturbed by neighbours, an estimate of the intrinsic cost
        "ratio_of_mins": min(samples["normscope"]) / min(samples["torch"]),
        "overhead_us": (med["normscope"] - med["torch"]) * 1e6,
        # the same on process CPU time (less sensitive to neighbours on a shared machine)
        "cpu_ratio": statistics.median(cpu_ratios),
        "cpu_torch_median_us": statistics.median(cpu["torch"]) * 1e6,
        "cpu_normscope_median_us": statistics.median(cpu["normscope"]) * 1e6,
        "target": target(case, mode),
        "meets_target": ratio <= target(case, mode),
        "samples_us": {k: [round(t * 1e6, 3) for t in v] for k, v in samples.items()},
    }


def machine() -> dict:
    info = {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": platform.processor(),
        "python": sys.version.split()[0],
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "normscope": normscope.__version__,
    }
    try:
        info["loadavg_at_start"] = list(os.getloadavg())
    except OSError:
        pass
    try:
        with open("/proc/cpuinfo") as f:
            info["cpu_model"] = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return info


def print_table(results: list[dict]) -> None:
    head = (
        f"{'case':<26} {'mode':<6} {'backend':<9} {'shape':<16} {'torch µs':>11} {'normscope µs':>13} "
        f"{'ratio':>6} {'q1-q3':>11} "
        f"{'cpu ratio':>9} {'min ratio':>9} {'target':>7}  ok"
    )
    print(head)
    print("-" * len(head))
    for r in results:
        shape = "x".join(map(str, r["shape"]))
        q = f"{r['ratio_q1_q3'][0]:.2f}-{r['ratio_q1_q3'][1]:.2f}"
        print(
            f"{r['case']:<26} {r['mode']:<6} {r['normscope_backend']:<9} {shape:<16} "
            f"{r['torch_median_us']:>11.1f} {r['normscope_median_us']:>13.1f} "
            f"{r['ratio']:>6.3f} {q:>11} {r['cpu_ratio']:>9.3f} {r['ratio_of_mins']:>9.3f} "
            f"{'≤' + format(r['target'], '.2f'):>7}  "
            f"{'yes' if r['meets_target'] else 'NO'}"
        )


def keep_freed_memory() -> str:
    """Ask glibc's malloc to keep freed memory for reuse (no mmap per large block, no trimming back
    to the system), as a caching allocator (jemalloc, tcmalloc) would; what was done, for the JSON.

    By default glibc serves every block over its mmap threshold (at most 32 MiB) with fresh pages
    from the system and returns them on free, so each large call page-faults all of its tensors
    again: on this VM that is most of a large call's time (LayerNorm 8192 x 1024 forward ~28 ms,
    ~7 ms with memory kept), and bimodal (the same call ~1.0x or ~1.3x; a large forward + backward
    had per-pair quartiles of 0.85-1.51). Where both layers make the same allocations (the same ATen
    ops and autograd nodes) keeping memory removes noise common to both: the medians of BatchNorm2d
    and InstanceNorm2d agreed with and without (1.004 / 0.998, 1.002 / 1.005) while the quartiles
    shrank to +-0.02. Where they do not -- torch's CPU rms_norm is a chain of ops, each a full-size
    temporary -- it changes the comparison, so both are reported (README). Opt-in: the default
    measures what a user gets."""
    if not sys.platform.startswith("linux"):
        return "not glibc: left as it is"
    try:
        libc = ctypes.CDLL("libc.so.6")
        big = 1 << 30  # M_MMAP_THRESHOLD = -3, M_TRIM_THRESHOLD = -1 (malloc.h)
        if libc.mallopt(-3, big) == 1 and libc.mallopt(-1, big) == 1:
            return "glibc keeps freed memory (mallopt M_MMAP_THRESHOLD and M_TRIM_THRESHOLD 1 GiB)"
    except (OSError, AttributeError):
        pass
    return "glibc default (mallopt unavailable)"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help=f"JSON output path. Default: a new results/cpu_speed-<UTC time>.json beside {COMMITTED.name}",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="interleaved rounds per case (even: ABBA pairs). Default: 40 small, 100 large "
        "(a large block is one call: more pairs for a stable median)",
    )
    p.add_argument("--min-block-ms", type=float, default=20.0, help="minimum duration of one timed block. Default: 20")
    p.add_argument("--warmup-s", type=float, default=0.3, help="warm-up time per case. Default: 0.3")
    p.add_argument("--cases", default="", help="comma-separated case names (e.g. LayerNorm:small,GroupNorm:large)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads. Default: torch's")
    p.add_argument("--quick", action="store_true", help="a few rounds of the small cases (smoke test)")
    p.add_argument("--modes", default="fwd,fwdbwd", help="comma-separated: fwd, fwdbwd. Default: both")
    p.add_argument("--compile", action="store_true", help="also time a compiled normscope block vs torch.nn's")
    p.add_argument("--no-import", action="store_true", help="skip the import-cost measurement")
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory measurement")
    p.add_argument("--note", default="", help="free text stored in the JSON (e.g. 'shared machine, noisy')")
    p.add_argument(
        "--keep-freed-memory",
        action="store_true",
        help="ask glibc's malloc to keep freed memory for reuse instead of returning large blocks to the system "
        "(see keep_freed_memory). Default: glibc's defaults, what a user gets",
    )
    args = p.parse_args(argv)
    if args.out is None:
        args.out = default_out()
    if args.threads:
        torch.set_num_threads(args.threads)
    malloc = keep_freed_memory() if args.keep_freed_memory else "default"

    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if set(modes) - set(MODES):
        p.error(f"argument --modes: unknown {sorted(set(modes) - set(MODES))}; expected from {list(MODES)}")
    cases = _cases() + _functional_cases()
    compiled = _compiled_cases()
    if args.cases:
        # commas inside parentheses belong to a name ("GroupNorm(4,16):small")
        wanted = {w.strip() for w in re.split(r",(?![^()]*\))", args.cases) if w.strip()}
        known = {c.name for c in cases + compiled}
        if wanted - known:
            p.error(f"argument --cases: unknown {sorted(wanted - known)}; expected names from {sorted(known)}")
        cases = [c for c in cases if c.name in wanted]
        # a compiled case runs when named, or with --compile (which is never ignored)
        compiled = [c for c in compiled if c.name in wanted or args.compile]
    elif args.quick:
        cases = [c for c in cases if c.size == "small"]
    if args.cases or args.compile:
        cases += compiled

    info = machine()
    print(
        f"torch {info['torch']}, {info['torch_threads']} threads, {info['cpu_count']} CPUs "
        f"({info.get('cpu_model', info['processor'])}), load {info.get('loadavg_at_start')}, malloc: {malloc}"
    )
    info["malloc"] = malloc
    results = []
    t0 = time.perf_counter()
    for case in cases:
        for mode in modes if case.kind == "layer" else [m for m in modes if m == "fwd"]:
            rounds = args.rounds or (2 if args.quick else 40 if case.size in ("small", "rows") else 100)
            min_block = (2.0 if args.quick else args.min_block_ms) / 1e3
            r = run_case(case, mode, rounds, min_block, 0.0 if args.quick else args.warmup_s)
            results.append(r)
            print(
                f"  {r['case']:<26} {mode:<6} ratio {r['ratio']:.3f} (goal <= {r['target']:.2f}: "
                f"{'met' if r['meets_target'] else 'NOT met'})  "
                f"({r['torch_median_us']:.1f} vs {r['normscope_median_us']:.1f} µs, {r['normscope_backend']})",
                flush=True,
            )
    print()
    print_table(results)
    imports = None
    if not args.no_import:
        imports = import_cost(3 if args.quick else 10)
        print(
            f"\nimport normscope adds {imports['added_s']:.3f} s to import torch "
            f"({imports['import_torch_median_s']:.3f} s); "
            f"goal <= {IMPORT_TARGET_S} s: {'met' if imports['meets_target'] else 'NOT met'}; "
            f"normscope --version {imports['normscope_version_cli_median_s']:.3f} s"
        )
    memory = None
    if not args.no_memory and not args.quick:
        memory = peak_memory()
        print("\npeak memory, max RSS growth of one forward + backward (fresh process, one thread):")
        for m in memory:
            print(
                f"  {m['case']:<40} torch +{m['torch_peak_growth_mib']:.0f} MiB, normscope "
                f"+{m['normscope_peak_growth_mib']:.0f} MiB: {'<= torch' if m['meets_target'] else 'MORE than torch'}"
            )
    try:
        info["loadavg_at_end"] = list(os.getloadavg())
    except OSError:
        pass
    doc = {
        "benchmark": "cpu_overhead",
        "what": "forward (autograd on) and forward+backward, normscope vs torch.nn layer, interleaved ABBA, "
        "median of per-pair ratios",
        "when": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.argv[0]).name, *(sys.argv[1:] if argv is None else argv)]),
        "note": args.note,
        "seconds": round(time.perf_counter() - t0, 1),
        "machine": info,
        "targets": {
            **{f"{size}:{mode}": t for (size, mode), t in TARGETS.items()},
            "RMSNorm:large": RMS_LARGE_TARGET,
            "compiled": COMPILED_TARGET,
            "functional:fwd": FUNCTIONAL_TARGET,
            "import_added_s": IMPORT_TARGET_S,
        },
        "results": results,
        "import": imports,
        "memory": memory,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1))
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
