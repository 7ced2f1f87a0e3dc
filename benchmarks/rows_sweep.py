"""Measure the rows kernels' launch settings on a GPU and write the winners into kernels/config.py.

    PYTHONPATH=src python3 benchmarks/rows_sweep.py --out DIR [--apply src/normscope/kernels/config.py]

Three sweeps, each per row block (``next_pow2(N)``) at the bench's sizes (256 MB of x), LayerNorm and
RMSNorm together, every candidate timed against the current rule in the same process:

1. the single-block backward (N <= ``ROWS_MAX_FUSED_N``): BLOCK_M x num_warps x programs per SM, bf16
   and fp32 (``config.ROWS_BWD_LAUNCH``);
2. the looped forward (longer rows): chunk x num_warps, bf16 (``config.ROWS_LOOP_LAUNCH``'s first two);
3. the looped backward: chunk x num_warps x programs per SM, bf16 (its last three).

A candidate's score is the geometric mean, over ops and dtypes, of its time over the current rule's; a
block gets an entry only where the best candidate is at least ``--min-gain`` faster (default 3%), else
it keeps the rule. Every setting is keyed by the row length alone (scope isolation).

Candidates are compiled first by ``--workers`` processes (Triton's compiler is most of a sweep's time
and uses one core) running each one once at the timed size, so the timing process loads them from
Triton's on-disk cache with the same specializations. Times: ``triton.testing.do_bench``, median.
``--interpret`` rehearses the whole script in Triton's interpreter on a CPU at tiny sizes (times mean
nothing, nothing is applied).

Writes DIR/rows_sweep.json (every time measured, the choices, device, versions) and, with ``--apply``,
rewrites the two table lines of the given config.py (with a comment saying where they were measured).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import multiprocessing as mp
import os
import platform
import re
import sys
import time

import torch

INTERPRET = "--interpret" in sys.argv
if INTERPRET:
    os.environ["TRITON_INTERPRET"] = "1"

import triton  # noqa: E402

from normscope.kernels import config as KC  # noqa: E402
from normscope.kernels import rows as R  # noqa: E402

EPS = 1e-5
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def sizes():
    """(single-block blocks, looped blocks, bytes of x)."""
    if INTERPRET:
        KC.ROWS_MAX_FUSED_N = 64
        return (32, 64), (128, 256), 16 << 10
    return (256, 1024, 4096, 8192, 16384), (32768, 65536, 131072, 262144), 256 << 20


def candidates(phase: str, block: int):
    """The settings a sweep tries for one block (None: the current rule)."""
    out = [None]
    if phase == "bwd":
        bms = [bm for bm in (1, 2, 4, 8, 16, 32) if 1024 <= bm * block <= 16384] or [1]
        warps = (4, 8, 16, 32)
        for bm, w, p in itertools.product(bms, warps, (1, 2, 4)):
            per_thread = bm * block / (32 * w)
            if 2 <= per_thread <= 64:
                out.append((bm, w, p))
    elif phase == "loop_fwd":
        for chunk, w in itertools.product((2048, 4096, 8192, 16384), (4, 8, 16, 32)):
            if 4 <= chunk / (32 * w) <= 64:
                out.append((chunk, w))
    else:
        for chunk, w, p in itertools.product((2048, 4096, 8192), (4, 8, 16), (1, 2, 4)):
            if 4 <= chunk / (32 * w) <= 64:
                out.append((chunk, w, p))
    if INTERPRET:
        out = out[:3]
    return out


def apply(phase: str, block: int, cand, loop_fwd_choice=None) -> None:
    """Set ``config`` so that rows of ``block`` run with ``cand`` (None: the rule)."""
    KC.ROWS_BWD_LAUNCH.pop(block, None)
    KC.ROWS_LOOP_LAUNCH.pop(block, None)
    if cand is None:
        if phase == "loop_bwd" and loop_fwd_choice is not None:  # the rule's backward, the chosen forward
            rule = R._config(block)
            KC.ROWS_LOOP_LAUNCH[block] = (*loop_fwd_choice, rule[1], rule[3], KC.ROWS_LOOP_BWD_PROGRAMS_PER_SM)
        return
    if phase == "bwd":
        KC.ROWS_BWD_LAUNCH[block] = cand
    elif phase == "loop_fwd":
        rule = R._bwd_config(block)
        KC.ROWS_LOOP_LAUNCH[block] = (*cand, rule[1], rule[3], rule[4])
    else:
        fwd = loop_fwd_choice or R._config(block)[1:4:2]
        KC.ROWS_LOOP_LAUNCH[block] = (*fwd, *cand)


def inputs(op: str, dname: str, block: int, nbytes: int, device):
    dtype = DTYPES[dname]
    n = block
    m = max(1, nbytes // (n * torch.empty((), dtype=dtype).element_size()))
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn((m, n), generator=g, device=device).to(dtype)
    w = (torch.rand(n, generator=g, device=device) + 0.5).to(dtype)
    b = torch.randn(n, generator=g, device=device).to(dtype) if op == "layer_norm" else None
    dy = torch.randn((m, n), generator=g, device=device).to(dtype)
    centered = op == "layer_norm"
    _, _, mean, rstd = R._rows_fwd_impl(x, w, b, None, EPS, centered, 0.0, False)
    return x, w, b, dy, mean, rstd, centered


def call(phase: str, t):
    x, w, b, dy, mean, rstd, centered = t
    if phase == "loop_fwd":
        return lambda: R._rows_fwd_impl(x, w, b, None, EPS, centered, 0.0, False)
    return lambda: R._rows_bwd_impl(dy, None, x, w, mean, rstd, centered, b is not None, 0.0)


def groups(blocks_single, blocks_looped, loop_fwd_choices=None):
    """(phase, op, dtype, block) of every sweep, in order."""
    out = [("bwd", op, d, blk) for blk in blocks_single for op in ("rms_norm", "layer_norm") for d in ("bf16", "fp32")]
    out += [("loop_fwd", op, "bf16", blk) for blk in blocks_looped for op in ("rms_norm", "layer_norm")]
    out += [("loop_bwd", op, "bf16", blk) for blk in blocks_looped for op in ("rms_norm", "layer_norm")]
    return out


def _warm(task):
    """A compile worker: run each candidate of one group once (fills Triton's on-disk cache)."""
    phase, op, dname, block, nbytes, loop_fwd = task
    device = "cpu" if INTERPRET else "cuda"
    sizes()  # the interpreter's shrunken limit, in this process too
    t = inputs(op, dname, block, nbytes, device)
    for cand in candidates(phase, block):
        apply(phase, block, cand, loop_fwd)
        call(phase, t)()
    if device == "cuda":
        torch.cuda.synchronize()
    return task[:4]


def timed(fn, device) -> float:
    if device == "cpu":
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    return triton.testing.do_bench(fn, warmup=5, rep=25, return_mode="median")


def warm_all(blocks_single, blocks_looped, nbytes, workers, log) -> None:
    """Compile every candidate of every sweep in ``workers`` processes (Triton's on-disk cache keeps them)."""
    tasks = [(*g, nbytes, None) for g in groups(blocks_single, blocks_looped)]
    t0 = time.time()
    if workers > 1:
        with mp.get_context("spawn").Pool(workers) as pool:
            for _ in pool.imap_unordered(_warm, tasks):
                pass
    log(f"compiled the candidates of {len(tasks)} groups in {time.time() - t0:.0f}s ({workers} processes)")


def sweep(phase, blocks, nbytes, device, results, choices, min_gain, loop_fwd=None, log=print):
    todo = [g for g in groups(blocks if phase == "bwd" else (), blocks if phase != "bwd" else ()) if g[0] == phase]
    for block in blocks:
        ratios: dict = {}
        for _, op, dname, _ in [g for g in todo if g[3] == block]:
            t = inputs(op, dname, block, nbytes, device)
            base = None
            for cand in candidates(phase, block):
                apply(phase, block, cand, (loop_fwd or {}).get(block))
                ms = timed(call(phase, t), device)
                results.append({"phase": phase, "op": op, "dtype": dname, "block": block, "cand": cand, "ms": ms})
                if cand is None:
                    base = ms
                ratios.setdefault(cand, []).append(ms / base)
            del t
        score = {c: math.exp(sum(map(math.log, r)) / len(r)) for c, r in ratios.items()}
        best = min(score, key=score.get)
        keep = best is not None and score[best] <= 1 - min_gain
        choices[phase][block] = {"choice": best if keep else None, "score": score[best], "candidates": len(score)}
        chosen = best if keep else "the rule"
        log(f"[{phase}] block {block}: best {best} at {score[best]:.3f} of the rule's time -> {chosen}")
        apply(phase, block, None)


def write_config(path: str, choices: dict, note: str) -> None:
    bwd = {b: tuple(c["choice"]) for b, c in choices["bwd"].items() if c["choice"]}
    loop = {}
    for block, c in choices["loop_bwd"].items():
        fwd = choices["loop_fwd"].get(block, {}).get("choice")
        back = c["choice"]
        if fwd is None and back is None:
            continue
        KC.ROWS_LOOP_LAUNCH.pop(block, None)
        rule_fwd = R._config(block)
        rule_bwd = R._bwd_config(block)
        loop[block] = (*(fwd or (rule_fwd[1], rule_fwd[3])), *(back or (rule_bwd[1], rule_bwd[3], rule_bwd[4])))
    src = open(path).read()
    src, n1 = re.subn(
        r"(#: measured: [^\n]*\n)?ROWS_BWD_LAUNCH: [^=]*= \{.*?\}\n",
        f"#: measured: {note}\nROWS_BWD_LAUNCH: dict[int, tuple[int, int, int]] = {bwd!r}\n",
        src,
        flags=re.S,
    )
    src, n2 = re.subn(
        r"(#: measured: [^\n]*\n)?ROWS_LOOP_LAUNCH: [^=]*= \{.*?\}\n",
        f"#: measured: {note}\nROWS_LOOP_LAUNCH: dict[int, tuple[int, int, int, int, int]] = {loop!r}\n",
        src,
        flags=re.S,
    )
    if n1 != 1 or n2 != 1:
        sys.exit(f"{path}: expected one ROWS_BWD_LAUNCH and one ROWS_LOOP_LAUNCH line, found {n1} and {n2}")
    open(path, "w").write(src)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--apply", help="config.py to rewrite with the choices (CUDA only)")
    ap.add_argument("--workers", type=int, default=14)
    ap.add_argument("--min-gain", type=float, default=0.03)
    ap.add_argument("--interpret", action="store_true")
    args = ap.parse_args(argv)
    device = "cpu" if INTERPRET else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        sys.exit("rows_sweep: no CUDA device (use --interpret to rehearse)")
    os.makedirs(args.out, exist_ok=True)
    blocks_single, blocks_looped, nbytes = sizes()
    KC.ROWS_BWD_LAUNCH.clear()
    KC.ROWS_LOOP_LAUNCH.clear()
    results: list = []
    choices: dict = {"bwd": {}, "loop_fwd": {}, "loop_bwd": {}}
    t0 = time.time()

    def log(msg):
        print(f"[{time.time() - t0:5.0f}s] {msg}", flush=True)

    warm_all(blocks_single, blocks_looped, nbytes, 1 if INTERPRET else args.workers, log)
    sweep("bwd", blocks_single, nbytes, device, results, choices, args.min_gain, log=log)
    sweep("loop_fwd", blocks_looped, nbytes, device, results, choices, args.min_gain, log=log)
    loop_fwd = {b: c["choice"] for b, c in choices["loop_fwd"].items() if c["choice"]}
    sweep("loop_bwd", blocks_looped, nbytes, device, results, choices, args.min_gain, loop_fwd, log=log)
    name = torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu"
    note = (
        f"{name}, torch {torch.__version__}, triton {triton.__version__}, {time.strftime('%Y-%m-%d')}, "
        "benchmarks/rows_sweep.py"
    )
    report = {
        "device": name,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "interpret": INTERPRET,
        "bytes": nbytes,
        "min_gain": args.min_gain,
        "choices": {p: {str(b): c for b, c in cs.items()} for p, cs in choices.items()},
        "results": results,
    }
    with open(os.path.join(args.out, "rows_sweep.json"), "w") as f:
        json.dump(report, f, indent=1)
    if args.apply and not INTERPRET:
        write_config(args.apply, choices, note)
        log(f"wrote the choices into {args.apply}")
    log("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
