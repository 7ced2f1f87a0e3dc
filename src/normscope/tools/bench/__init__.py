"""``normscope bench``: normscope against PyTorch eager, torch.compile and Liger-Kernel, in one run.

On CUDA every case is timed with ``triton.testing.do_bench`` (median), on CPU with repeated
wall-clock medians. Each result reports the time, the achieved bandwidth for an *assumed* byte
count (the minimum traffic of an ideal fused kernel, below), its time ratio to every peer measured in
the same run (``ratio``: normscope time / peer time, below 1 normscope is faster), its ratio to the
device's copy bandwidth (a large ``dst.copy_(src)`` measured in the
same run: the practical ceiling), the peak memory (CUDA), and the forward output's error against
torch in fp32 (a peer that computes something else is flagged, not silently timed).

Bytes assumed (``e`` = bytes per element of the input dtype, ``numel`` = elements of x):

=====================  ==============  ===============================================
case                   forward         forward + backward
=====================  ==============  ===============================================
layer_norm, rms_norm   2 numel e       5 numel e  (fwd: read x, write y; bwd: read x, dy, write dx)
add_rms_norm           4 numel e       8 numel e  (fwd: read x, r, write y, h; bwd: read h, dy, dh, write dx)
group_norm[_cl]        2 numel e       5 numel e
batch_norm             2 numel e       5 numel e
masked_batch_norm      2 numel e       5 numel e  (the (B, S) mask is not counted)
modulated_rms_norm,    2 numel e       5 numel e  (x (B, S, D); the (B, D) scale and shift, like
modulated_layer_norm                               weights, are not counted)
qk_norm                2 numel e       5 numel e  (numel: of q and k together)
gemma_rms_norm,        2 numel e       5 numel e
poly_norm, derf
=====================  ==============  ===============================================

Weights, statistics and the second read of long rows are not counted: an implementation that
needs them shows up as lower GB/s. ``normscope`` is the public API (``normscope.functional``),
forced onto its Triton kernels wherever they can run (CUDA, ``--interpret``): the bench measures
the kernels against ATen, and must not depend on the automatic choice its measurements decide.
Without CUDA the kernels cannot run: the first line of the output says so, and normscope runs its
CPU paths (what its automatic choice picks there) against PyTorch eager.
The JSON records what ran (``normscope_impl``) and, per row, ``n``: the elements of one
normalized scope.

``--write-choice PATH`` writes the measured-choice table (:func:`choice_table`) of a CUDA run:
per op and dtype, the size ranges where the Triton kernels passed the check and beat torch eager
in both forward and forward+backward. The engine chooses Triton automatically only there
(``benchmarks/gpu_check.sh bench`` writes ``src/normscope/backends/measured/<device class>.json``).

Candidate kernels (:mod:`normscope.kernels.variants`), unmeasured and off by default, are timed beside the
default kernel on the same input in one of two ways. The row cases sweep the row length in one case, so the
read-once rows candidates (``--variants``, default ``rows_once``; ``none`` for none) are a column of their own
in each row where they run other kernels than the default; the ``normscope`` column is the default kernel,
forced so. The spatial cases have one shape each, so their candidates are cases of their own, a group
``--cases candidates``: ``case@variant`` (``batch_norm@split``, ``instance_norm@onchip``, ...) runs that
variant, the plain case beside it the default kernel. ``--write-choice`` names a candidate (``"variant"``)
only where it beat both torch eager and the default kernel.

The modern norms (:mod:`normscope.functional_modern`) are a group of their own, ``--cases modern``
(or each by name): ``modulated_rms_norm`` / ``modulated_layer_norm`` (AdaLN, scale and shift per
sample), ``qk_norm`` (q and k, (B, S, H, D), RMSNorm over head_dim, one launch; k has a quarter of
q's heads), ``gemma_rms_norm`` (zero-centred weight, ``weight_offset=1.0, casting="gemma"``),
``poly_norm`` and ``derf``. They are not in the default selection, which measures the ops the
engine chooses automatically (the measured-choice table); their fused kernels decline rows past
16384 elements, so their widths stop there. torch eager is each one as the models' eager code
writes it. A row names the requested peers it has no entry for and why (``declined``), and a peer
that computes the same formula with other roundings carries a ``note``.

Peers: ``torch`` (eager), ``compile`` (``torch.compile`` of the same eager function; GPU, or
``--interpret``), ``liger`` (Liger-Kernel's Triton autograd Functions, when ``liger_kernel`` is
importable; see :func:`normscope.tools.bench.peers._liger_peers` for the like-for-like choices).

Modules: :mod:`~normscope.tools.bench.cases` (sizes, inputs, the output check), :mod:`~normscope.tools.bench.peers`
(Liger-Kernel, the interpreter shims), :mod:`~normscope.tools.bench.timing` (medians, :func:`run`),
:mod:`~normscope.tools.bench.report` (:func:`problems`, the plot, :func:`choice_table`).

Usage::

    python -m normscope.tools.bench                     # GPU: full run; CPU: small sizes (13-21 s on 2 cores)
    python -m normscope.tools.bench --quick             # small sizes on the GPU too
    python -m normscope.tools.bench --cases layer_norm,rms_norm --dtypes bf16 --out /tmp/b
    python -m normscope.tools.bench --cases modern      # the modern norms (AdaLN, QK-norm, Gemma, PolyNorm, Derf)
    python -m normscope.tools.bench --cases candidates  # batch_norm@split beside batch_norm, instance_norm@onchip, ...
    python -m normscope.tools.bench --resume --budget-s 480 --out DIR   # continue DIR's JSON for 8 minutes
    python -m normscope.tools.bench --plot-only --out DIR               # redraw DIR's PNG from its JSON
    TRITON_INTERPRET=1 python -m normscope.tools.bench --interpret --out /tmp/dry

``--interpret`` is the GPU run's dry run on a CPU: the same code paths at tiny sizes -- normscope
forced onto its Triton kernels and Liger's kernels both in Triton's interpreter, torch.compile
through inductor's CPU backend, every case selected (``--cases all`` for the modern ones too), the JSON
and the PNG. Its times mean nothing.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys
from pathlib import Path

import torch

import normscope.kernels

from .cases import (
    CANDIDATE_CASES,
    CASE_GROUPS,
    CASES,
    DTYPES,
    EPS,
    GROUPS,
    KNOWN_CASES,
    MODERN_CASES,
    ROW_CASES,
    VARIANTS,
    plan,
)
from .peers import LIGER_CHECKED, PEER_NAMES, PEERS
from .report import choice_table, device_class, plot, problems, write_choice, write_json
from .timing import copy_bandwidth, run, time_ms

__all__ = [
    "CANDIDATE_CASES",
    "CASE_GROUPS",
    "CASES",
    "DTYPES",
    "EPS",
    "GROUPS",
    "LIGER_CHECKED",
    "MODERN_CASES",
    "PEERS",
    "ROW_CASES",
    "VARIANTS",
    "choice_table",
    "copy_bandwidth",
    "device_class",
    "load_status",
    "main",
    "plan",
    "plot",
    "problems",
    "run",
    "scope_line",
    "time_ms",
    "write_choice",
    "write_json",
]


def _use_interpreter(p: argparse.ArgumentParser) -> None:
    """--interpret: Triton must be imported (its kernels decorated) after TRITON_INTERPRET=1 is set."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return
    if any(m == "triton" or m.startswith("triton.") for m in sys.modules):
        p.error(
            "--interpret: Triton was imported before TRITON_INTERPRET=1 was set, so its kernels are compiled, "
            "not interpreted; run: TRITON_INTERPRET=1 python -m normscope.tools.bench --interpret ..."
        )
    os.environ["TRITON_INTERPRET"] = "1"


#: ``normscope bench --help``: plain text (the module docstring is reStructuredText for the docs)
_DESCRIPTION = "Benchmark normscope's kernels against PyTorch eager, torch.compile and Liger-Kernel, in one run."
_EPILOG = """examples:
  normscope bench                        GPU: full run (12-20 min); no GPU: small sizes, CPU paths only
                                         (13-21 s on 2 cores); writes ./bench-*.json and ./bench-*.png
  normscope bench --threads 1            the same on a shared machine
  normscope bench --quick                small sizes on the GPU too
  normscope bench --cases layer_norm,rms_norm --dtypes bf16 --out /tmp/b
  normscope bench --cases modern         the modern norms: AdaLN, QK-norm, Gemma RMSNorm, PolyNorm, Derf
  normscope bench --cases layer_norm --variants rows_once
                                         the read-once rows candidates in a column beside the default kernel
  normscope bench --cases candidates     the split BatchNorm and on-chip GroupNorm candidates: batch_norm
                                         beside batch_norm@split, instance_norm beside instance_norm@onchip, ...
  normscope bench --resume --budget-s 480 --out DIR     continue DIR's JSON for 8 minutes
  normscope bench --plot-only --out DIR                 redraw DIR's PNG from its JSON
  normscope bench --write-choice src/normscope/backends/measured/
                                         also write the measured-choice table (CUDA runs)
  TRITON_INTERPRET=1 normscope bench --interpret --out /tmp/dry
                                         CPU dry run of the GPU code paths (times mean nothing)

Without a CUDA device the Triton kernels are not measured: normscope runs its CPU paths against
PyTorch eager, and the first line of the output says so. Times are medians (triton.testing.do_bench
on CUDA). The run prints the load average first and warns when other work competes for the cores
(recorded in the JSON as "load"). Each row reports GB/s for the minimum traffic of an ideal fused
kernel, its fraction of the device's copy bandwidth, the forward output's error against torch in
fp32, and each peer's ratio = normscope time / peer time (below 1: normscope is faster)."""


def scope_line(device: torch.device, level: str, peers: list[str]) -> str:
    """The run's first line: what it measures and, as plainly, what it cannot measure here."""
    against = ", ".join(PEER_NAMES.get(q, q) for q in peers) or "no peer"
    if level == "interpret":
        return (
            "Triton interpreter dry run on the CPU: the GPU code paths at tiny sizes, normscope's Triton kernels "
            f"against {against}; the times mean nothing"
        )
    if device.type == "cuda":
        if normscope.kernels.AVAILABLE:
            return f"measuring normscope's Triton kernels on {device} against {against}"
        return (
            f"Triton is not installed: the Triton kernels are not measured; normscope runs its ATen paths on "
            f"{device} against {against}"
        )
    why = "no CUDA device" if not torch.cuda.is_available() else f"--device {device.type}"
    return (
        f"{why}: the Triton kernels are not measured; normscope runs its CPU paths (the ones its automatic "
        f"choice picks) against {against}"
    )


def load_status(threads: int) -> dict:
    """The machine's load when a run starts: ``load_average`` (1, 5 and 15 minutes; None where the
    system has no ``getloadavg``), ``cpus``, this run's ``threads`` and ``loaded``.

    Other work competes for the cores and the memory bus: on a 2-core machine at load 6 the copy
    bandwidth read 2.1 GB/s against 115 GB/s idle, so every figure of such a run is meaningless. A
    machine counts as ``loaded`` when the last minute's average of runnable processes plus this
    run's threads exceeds its cores: some thread of the run would then wait for a core.
    """
    try:
        load = [round(v, 2) for v in os.getloadavg()]
    except (AttributeError, OSError):  # Windows; a system that cannot say
        load = None
    cpus = os.cpu_count() or 1
    return {
        "load_average": load,
        "cpus": cpus,
        "threads": threads,
        "loaded": load is not None and load[0] + threads > cpus,
    }


def _threads(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive number of threads, got {text!r}")
    return n


def _budget(text: str) -> float:
    try:
        s = float(text)
    except ValueError:
        s = -1.0
    if not (s >= 0 and math.isfinite(s)):  # nan compares false
        raise argparse.ArgumentTypeError(f"expected a non-negative number of seconds, got {text!r}")
    return s


def _read_report(path: Path, p: argparse.ArgumentParser) -> dict:
    """A bench JSON from ``--out`` for --resume / --plot-only, or exit 2 saying what is wrong with it."""
    try:
        report = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        p.error(f"argument --out: cannot read {path} as a bench JSON: {e}")
    if not isinstance(report, dict) or not isinstance(report.get("results"), list):
        p.error(f'argument --out: {path} is not a bench JSON (no list of "results")')
    return report


def main(argv: list[str] | None = None) -> int:
    """Run ``normscope bench`` with ``argv``; returns the exit status. torch's thread count is restored
    afterwards (``--threads`` changes it for the run only)."""
    threads = torch.get_num_threads()
    try:
        return _main(sys.argv[1:] if argv is None else list(argv))
    finally:
        torch.set_num_threads(threads)


def _main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="normscope bench",
        description=_DESCRIPTION,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--out",
        metavar="DIR",
        default=".",
        help="directory for bench-*.json and bench-*.png, created if missing (default: the current directory)",
    )
    p.add_argument(
        "--cases",
        default="default",
        help=f"comma-separated cases or groups. default: {', '.join(CASES)}; modern: {', '.join(MODERN_CASES)} "
        "(the modern norms' fused kernels: not in the default selection); all: both; candidates: the spatial "
        "cases' candidate kernels, each case beside case@variant (e.g. batch_norm@split), which runs that "
        "kernel variant (default: default)",
    )
    p.add_argument("--dtypes", default="fp32,bf16", help=f"comma-separated subset of: {', '.join(DTYPES)}")
    p.add_argument(
        "--peers",
        default=None,
        help=f"comma-separated subset of: {', '.join(PEERS)} (default: all on CUDA and with --interpret; torch on "
        "plain CPU, where inductor needs a C++ toolchain and minutes, and Liger's kernels cannot run)",
    )
    p.add_argument(
        "--variants",
        default=",".join(VARIANTS),
        help=f"the row cases' candidate kernels to time beside the default kernel where they differ from it, "
        f"comma-separated subset of: {', '.join(VARIANTS)}; 'none' for none (default: all). Each is a column of "
        "its own; the measured-choice table names one where it beats the default kernel and torch eager in both "
        "modes. The spatial cases' candidates are cases of their own (--cases candidates, case@variant)",
    )
    p.add_argument("--quick", action="store_true", help="small sizes (the default on CPU)")
    p.add_argument(
        "--interpret",
        action="store_true",
        help="CPU dry run of the GPU code paths at tiny sizes: normscope's and Liger's kernels in Triton's "
        "interpreter, torch.compile on inductor's CPU backend (times mean nothing)",
    )
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available; cpu with --interpret)")
    p.add_argument("--resume", action="store_true", help="keep the rows of the JSON already in --out, run the rest")
    p.add_argument("--budget-s", type=_budget, default=None, help="start no new configuration after this many seconds")
    p.add_argument("--plot-only", action="store_true", help="redraw the PNG from the JSON in --out, measure nothing")
    p.add_argument(
        "--threads",
        type=_threads,
        default=None,
        help="torch CPU threads for the run (default: torch's, one per core). On a shared machine use 1: a "
        "neighbouring job stalls every multi-threaded op",
    )
    p.add_argument("--strict", action="store_true", help="exit 1 when problems() finds any (see the log's end)")
    p.add_argument(
        "--write-choice",
        metavar="PATH",
        default=None,
        help="also write the measured-choice table of a CUDA run (with --plot-only: of the JSON in --out) to PATH; "
        "a directory gets <device class>.json, e.g. cuda-sm90.json",
    )
    a = p.parse_args(argv)
    cases = []
    for c in (c.strip() for c in a.cases.split(",")):
        for case in CASE_GROUPS.get(c, (c,) if c else ()):
            if case not in cases:
                cases.append(case)
    dtypes = [d.strip() for d in a.dtypes.split(",") if d.strip()]
    peers = [q.strip() for q in (a.peers or ",".join(PEERS)).split(",") if q.strip()]
    known = KNOWN_CASES
    bad = [c for c in cases if c not in known] + [d for d in dtypes if d not in DTYPES]
    if not cases or not dtypes:
        what = "case" if not cases else "dtype"
        p.error(f"expected at least one {what}, got --cases {a.cases!r} --dtypes {a.dtypes!r}")
    if bad:
        p.error(
            f"unknown case/dtype {bad}; cases: {', '.join(known)}; groups: {', '.join(CASE_GROUPS)}; "
            f"dtypes: {', '.join(DTYPES)}"
        )
    if [q for q in peers if q not in PEERS]:
        p.error(f"unknown peer {[q for q in peers if q not in PEERS]}; expected a subset of: {', '.join(PEERS)}")
    variants = [v.strip() for v in a.variants.split(",") if v.strip() and v.strip() != "none"]
    if unknown := [v for v in variants if v not in VARIANTS]:
        p.error(
            f"unknown variant {unknown}; expected a subset of: {', '.join(VARIANTS)}, or none (the spatial cases' "
            "candidates are cases: --cases candidates, or case@variant such as batch_norm@split)"
        )
    if a.interpret and a.device not in (None, "cpu"):
        p.error(f"--interpret runs on the CPU; got --device {a.device}")
    if a.interpret:
        _use_interpreter(p)
    try:
        device = torch.device(a.device or ("cpu" if a.interpret else "cuda" if torch.cuda.is_available() else "cpu"))
    except RuntimeError:  # torch's "Expected one of cpu, cuda, ... device type at start of device string"
        p.error(f"argument --device: expected cuda or cpu, got {a.device!r}")
    if device.type not in ("cuda", "cpu"):
        p.error(f"argument --device: expected cuda or cpu, got {a.device!r}")
    if device.type == "cuda" and not torch.cuda.is_available() and not a.plot_only:  # redrawing measures nothing
        p.error(f"argument --device: {a.device!r} asked for, but this torch sees no CUDA device")
    level = "interpret" if a.interpret else "quick" if a.quick or device.type == "cpu" else "full"
    if a.peers is None and device.type == "cpu" and not a.interpret:
        peers = ["torch"]
    out = Path(a.out).resolve()  # said on screen: the user sees where the files went
    stem = f"bench-{'' if level == 'full' else level + '-'}{device.type}"
    path = out / f"{stem}.json"
    if a.plot_only and not path.exists() and len(found := sorted(out.glob("bench-*.json"))) == 1:
        path, stem = found[0], found[0].stem  # redrawn on another machine than the one that measured it
    previous = None
    if a.plot_only or a.resume:
        if path.exists():
            previous = _read_report(path, p)
        elif a.plot_only:
            p.error(f"--plot-only: no {path} to plot")
    if a.write_choice and not a.plot_only and (device.type != "cuda" or a.interpret):
        where = "cpu (interpreted)" if a.interpret else device.type
        p.error(f"--write-choice: the table is measured on CUDA; got device {where}")
    if not a.plot_only:
        try:  # before any measurement: a run that cannot write its results is not started
            out.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            p.error(f"argument --out: cannot create the directory {a.out!r}: {e.strerror or e}")
        if not os.access(out, os.W_OK | os.X_OK):
            p.error(f"argument --out: cannot write into {a.out!r}: permission denied")
    command = shlex.join(["normscope", "bench", *argv])
    if not a.plot_only:
        print(scope_line(device, level, peers))
        print(f"results: {path.resolve()}")
    if a.plot_only:
        wrote = plot(previous, out / f"{stem}.png")
        print(f"wrote {out / f'{stem}.png'}" if wrote else "no plot: matplotlib missing or no row cases")
        if a.write_choice:
            try:
                print(f"wrote {write_choice(previous, a.write_choice, command)}")
            except ValueError as e:
                p.error(f"--write-choice: {e}")
        return 0
    if a.threads is not None:
        torch.set_num_threads(a.threads)
    load = load_status(torch.get_num_threads())
    avg = "unknown" if load["load_average"] is None else " / ".join(f"{v:g}" for v in load["load_average"])
    print(f"load average {avg} (1 / 5 / 15 min) on {load['cpus']} CPUs; {load['threads']} torch threads")
    if load["loaded"]:
        print(
            f"WARNING: the machine is loaded (load {load['load_average'][0]:g} + {load['threads']} threads > "
            f"{load['cpus']} CPUs): other work shares the cores and memory bandwidth, so times and GB/s will be "
            "low and noisy. Measure on an idle machine, or with --threads 1 beside other jobs."
        )
    report = run(
        cases, dtypes, level, device, peers=peers, previous=previous, budget_s=a.budget_s,
        on_config=lambda rep: write_json(path, dict(rep, load=load)), variants=variants,
    )  # fmt: skip
    report["load"] = load  # the conditions of the measurement travel with its numbers
    write_json(path, report)
    wrote = [str(path)]
    if plot(report, out / f"{stem}.png"):
        wrote.append(str(out / f"{stem}.png"))
    if a.write_choice:
        wrote.append(str(write_choice(report, a.write_choice, command)))
    print("wrote " + ", ".join(wrote))
    found = problems(report)
    for line in found:
        print(f"PROBLEM {line}")
    print(f"{len(report['results'])} rows, {len(found)} problems, complete: {report['complete']}")
    return 1 if a.strict and found else 0
