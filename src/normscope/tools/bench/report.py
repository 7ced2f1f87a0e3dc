"""Reading a bench report: what should not be trusted (:func:`problems`), the log line of a row,
the plot, the JSON file, and the measured-choice table the engine's automatic choice reads
(:func:`choice_table`)."""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
from collections import defaultdict
from pathlib import Path

import torch

from normscope.kernels.variants import FAMILIES

from .cases import DTYPES, GROUPS, MODERN_CASES, ROW_CASES, VARIANTS, split_case

#: the one ratio convention of the log, the JSON (each peer's ``ratio``) and benchmarks/README.md. A time
#: ratio rather than a speedup so that it reads like the CPU overhead tables: smaller is better for normscope.
RATIO_RULE = "normscope time / peer time (below 1: normscope is faster)"

#: colours per implementation, the same in every panel of the plot
COLORS = {
    "normscope": "tab:green",
    "torch": "tab:red",
    "compile": "tab:blue",
    "liger": "tab:orange",
    "rows_once": "tab:olive",
}


def problems(report: dict) -> list[str]:
    """What should stop a reader trusting the report: normscope failing or not on its kernels where
    they should run, and any implementation whose forward output fails the check."""
    out = [
        f"{f['case']} {f['dtype']} {'x'.join(map(str, f['shape']))}: failed: {f['error']}"
        for f in report.get("failed", [])
    ]
    for r in report["results"]:
        where = f"{r['case']} {r['dtype']} {r['mode']} {'x'.join(map(str, r['shape']))}"
        for name, e in r["impls"].items():
            if name == "normscope" and (e.get("error") or e.get("check_error")):
                out.append(f"{where}: normscope failed: {e.get('error') or e.get('check_error')}")
            if name in VARIANTS and (e.get("error") or e.get("check_error")):  # a candidate of ours
                out.append(f"{where}: normscope's {name} kernels failed: {e.get('error') or e.get('check_error')}")
            if e.get("ok") is False:
                if report.get("interpret") and name == "liger" and r["dtype"] != "fp32":
                    continue  # known: the interpreter's half-precision arithmetic (see _interpreter_shims)
                detail = e.get("check_error") or f"max error {e.get('max_err'):.3g}"
                out.append(f"{where}: {name} output does not match torch ({detail})")
        wants_kernel = report["device_type"] == "cuda" or report.get("interpret")
        if wants_kernel and r.get("normscope_impl") != "normscope (triton)":
            out.append(f"{where}: normscope ran {r.get('normscope_impl')!r}, not its Triton kernels")
        if wants_kernel and r.get("variant_ran") is False:
            out.append(f"{where}: the {r['variant']!r} kernel variant does not take this input: the default kernel ran")
    return out


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def _triton_version() -> str | None:
    try:
        import triton

        return triton.__version__
    except ImportError:
        return None


def _format_row(row: dict) -> str:
    parts = []
    for name, e in row["impls"].items():
        if e.get("ms") is None:
            parts.append(f"{name}: failed ({e['error']})")
        else:
            s = f"{name} {e['ms']:.3g} ms {e['gbs']:.3g} GB/s ({e['frac_of_copy']:.0%} copy)"
            if e.get("ratio"):
                s += f" ratio {e['ratio']:.2f}"
            if e.get("ok") is False:
                s += " MISMATCH"
            if e.get("note") and row["dtype"] != "fp32":  # the notes are about half-precision rounding
                s += " (rounds differently: see its note)"
            parts.append(s)
    shape = "x".join(map(str, row["shape"]))
    return f"{row['case']:<18} {row['dtype']:<4} {row['mode']:<7} {shape:<16} | " + " | ".join(parts)


def plot(report: dict, path: Path) -> bool:
    """GB/s against N (the row length; head_dim for qk_norm) per implementation, one panel per (row or
    modern case, dtype, mode). False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = [r for r in report["results"] if r["case"] in ROW_CASES or r["case"] in MODERN_CASES]
    panels = sorted({(r["case"], r["dtype"], r["mode"]) for r in rows})
    if not panels:
        return False
    cols = 2
    fig, axes = plt.subplots(
        math.ceil(len(panels) / cols), cols, figsize=(11, 3.2 * math.ceil(len(panels) / cols)), squeeze=False
    )
    for ax, key in zip(axes.flat, panels):
        sel = sorted(
            (r for r in rows if (r["case"], r["dtype"], r["mode"]) == key), key=lambda r: r.get("n", r["shape"][-1])
        )
        names = sorted({n for r in sel for n in r["impls"]})
        for name in names:
            pts = [
                (r.get("n", r["shape"][-1]), r["impls"][name]["gbs"])
                for r in sel
                if r["impls"].get(name, {}).get("gbs")
            ]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=name, color=COLORS.get(name))
        ax.axhline(report["copy_gbs"], color="gray", ls="--", lw=1, label="copy")
        ax.set_xscale("log", base=2)
        ax.set_title(" ".join(key), fontsize=9)
        ax.set_xlabel("head_dim" if key[0] == "qk_norm" else "N (row length)")
        ax.set_ylabel("GB/s (higher is faster)")
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    title = f"normscope bench -- {report['device']}"
    if report.get("interpret"):
        title += " (Triton interpreter dry run: times mean nothing)"
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.97))  # room for the suptitle
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write_json(path: Path, report: dict) -> None:
    """Atomically: a run killed mid-write (a device's time limit) leaves the previous complete file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=1))
    os.replace(tmp, path)


# ----------------------------------------------------------------------------------------------
# the measured-choice table: where Triton is measured correct and faster than ATen on a device class

#: bench case -> the op name of the choice table (both GroupNorm memory formats are one op: an entry
#: covers a size range only where every format measured there qualifies)
CHOICE_OPS = {
    "layer_norm": "layer_norm",
    "rms_norm": "rms_norm",
    "add_rms_norm": "fused_add_rms_norm",
    "group_norm": "group_norm",
    "group_norm_cl": "group_norm",
    "batch_norm": "batch_norm",
    "masked_batch_norm": "masked_batch_norm",
    # the candidates' cases (bench.cases.CANDIDATE_CASES): InstanceNorm is the groups kernel, as in the engine
    "group_norm_small": "group_norm",
    "group_norm_small_cl": "group_norm",
    "instance_norm": "group_norm",
    "instance_norm_cl": "group_norm",
    "batch_norm_cl": "batch_norm",
}
CHOICE_SCHEMA = 1


def device_class(device: torch.device | None = None) -> str:
    """``"cuda-sm90"`` for a compute capability 9.0 GPU: the key of the measured-choice tables."""
    major, minor = torch.cuda.get_device_capability(device)
    return f"cuda-sm{major}{minor}"


def _scope_n(row: dict) -> int | None:
    """Elements in one normalized scope of a row (``row["n"]``; derived from the shape for reports
    written before rows carried it, except masked BatchNorm, whose valid count only the run knew)."""
    if "n" in row:
        return int(row["n"])
    shape, case = row["shape"], split_case(row["case"])[0]
    if case in ROW_CASES:
        return shape[-1]
    if case.startswith("group_norm"):
        return shape[1] // GROUPS * math.prod(shape[2:])
    if case.startswith("instance_norm"):
        return math.prod(shape[2:])
    if case.startswith("batch_norm"):
        return shape[0] * math.prod(shape[2:])
    return None


#: the families' default kernels ("rows", "tiled"): a row that names one measured the default
_DEFAULTS = {names[0] for names in FAMILIES.values()}


def _row_variant(row: dict) -> str | None:
    """The kernel variant a row's ``normscope`` column measured: the case's (``case@variant``), None for the
    default kernel."""
    v = row.get("variant") or split_case(row["case"])[1]
    return None if v is None or v in _DEFAULTS else v


def _speedups(rows: list[dict], impl: str = "normscope") -> tuple[float, float] | None:
    """(torch ms / triton ms) for fwd and fwd+bwd when every row of one (op, dtype, n) qualifies, else None.

    A row qualifies when normscope ran its Triton kernels, ``impl``'s forward output (normscope's, or a
    candidate kernel's: :data:`VARIANTS`) passed the check, and both it and torch eager have a time; the
    speedup must be > 1 in both modes."""
    best: dict[str, float] = {}
    for row in rows:
        ns, eager = row["impls"].get(impl, {}), row["impls"].get("torch", {})
        if row.get("normscope_impl") != "normscope (triton)" or ns.get("ok") is not True:
            return None
        if row.get("variant_ran") is False:  # the candidate did not take the input: the default kernel ran
            return None
        if not ns.get("ms") or not eager.get("ms") or ns.get("error") or eager.get("error"):
            return None
        speedup = eager["ms"] / ns["ms"]
        if not speedup > 1:
            return None
        best[row["mode"]] = min(speedup, best.get(row["mode"], math.inf))
    if set(best) != {"fwd", "fwd+bwd"}:
        return None  # a mode not measured (a budget cut it short): not shown faster in both
    return best["fwd"], best["fwd+bwd"]


def _options(slot: dict[str | None, list[dict] | None]) -> dict[str | None, tuple[float, float] | None]:
    """The kernels measured at one (op, dtype, n) and their speedups (:func:`_speedups`; None where they do
    not qualify): the default kernel (key None) and each candidate -- a ``case@variant``'s rows, or a column
    of the default's rows (the row cases' :data:`VARIANTS`)."""
    out: dict[str | None, tuple[float, float] | None] = {}
    for variant, rows in slot.items():
        out[variant] = _speedups(rows) if rows is not None else None
        if variant is None and rows is not None:
            for name in VARIANTS:
                if all(name in row["impls"] for row in rows):
                    out[name] = _speedups(rows, name)
    return out


def _pick(options: dict[str | None, tuple[float, float] | None]) -> tuple[str | None, tuple[float, float]] | None:
    """(variant, speedups) chosen at one (op, dtype, n): the default kernel (variant None) where it qualifies,
    unless a candidate qualifies and beats it in both forward and forward+backward (or qualifies where the
    default does not); among such candidates the largest forward+backward speedup. None where none qualifies."""
    default = options.get(None)
    best = (None, default) if default is not None else None
    for variant in sorted(v for v in options if v is not None):
        sp = options[variant]
        if sp is None or default is not None and not (sp[0] > default[0] and sp[1] > default[1]):
            continue
        if best is None or best[0] is None or sp[1] > best[1][1]:
            best = (variant, sp)
    return best


def choice_table(report: dict, *, device_class: str | None = None, command: str = "", date: str | None = None) -> dict:
    """The measured-choice table of a CUDA bench report: per (op, dtype), the size ranges where
    normscope's Triton kernels are correct and faster than torch eager in both forward and forward+backward.

    For each (op, dtype) the measured scope sizes ``n`` are sorted; an ``n`` qualifies when every row
    measured at it (fwd and fwd+bwd, every memory format of GroupNorm) ran the Triton kernels, passed the
    output check and beat torch eager's median. Each maximal run of consecutive qualifying measured ``n``
    becomes one entry, ``n_min``/``n_max`` its measured end points (nothing is extrapolated), its speedups
    (torch ms / triton ms) the minimum over the run. A configuration listed under ``failed`` counts as a
    measured ``n`` that does not qualify (it splits a run).

    Kernel variants (:mod:`normscope.kernels.variants`): a candidate is measured either in a column of the
    row cases (:data:`VARIANTS`, e.g. ``rows_once``) or as a case of its own (``batch_norm@split``). At each
    ``n`` every kernel measured there -- the default and each candidate, each with all of its rows --
    qualifies or not by the rule above; a candidate takes the ``n`` if it qualifies and beats the default
    kernel's speedups in both modes (or qualifies where the default does not), the one with the largest
    forward+backward speedup among several. A run is consecutive ``n`` with the same choice (a change of
    kernel splits it), and an entry of a candidate names it (``"variant"``), which the engine then runs
    there. A candidate that did not take the input (``variant_ran`` false) never qualifies.

    Args:
        report: what :func:`normscope.tools.bench.run` returns (or its JSON).
        device_class: e.g. ``"cuda-sm90"``. Default: ``report["device_class"]``.
        command: the bench command line that measured the report. Default: "".
        date: ``YYYY-MM-DD``. Default: today (UTC).

    Raises:
        ValueError: a report not measured on CUDA, or one with no device class to name the table by.
    """
    if report.get("device_type") != "cuda" or report.get("interpret"):
        raise ValueError(
            "choice_table: expected a report measured on CUDA (device_type 'cuda', not interpreted), got device_type "
            f"{report.get('device_type')!r}, interpret {report.get('interpret')!r}"
        )
    device_class = device_class or report.get("device_class")
    if not device_class:
        raise ValueError("choice_table: expected `device_class` such as 'cuda-sm90' (the report has none), got None")
    # (op, dtype) -> n -> kernel variant (None: the default) -> its rows, or None when a configuration failed
    by_key: dict[tuple[str, str], dict[int, dict[str | None, list[dict] | None]]] = defaultdict(dict)
    for row in report["results"]:
        n = _scope_n(row)
        base = split_case(row["case"])[0]
        if base not in CHOICE_OPS or n is None:
            continue
        slot = by_key[(CHOICE_OPS[base], row["dtype"])].setdefault(n, {})
        variant = _row_variant(row)
        if slot.get(variant, []) is not None:
            slot.setdefault(variant, []).append(row)
    for f in report.get("failed", []):
        n = _scope_n({"case": f["case"], "shape": f["shape"]})
        base = split_case(f["case"])[0]
        if base in CHOICE_OPS and n is not None:  # measured, failed: that kernel never qualifies there
            by_key[(CHOICE_OPS[base], f["dtype"])].setdefault(n, {})[_row_variant(f)] = None
    choices = []
    for (op, dname), sizes in sorted(by_key.items()):
        run: list[tuple[int, tuple[float, float]]] = []
        run_variant: str | None = None
        for n in [*sorted(sizes), None]:  # None: the end, closes the last run
            best = _pick(_options(sizes[n])) if n is not None else None
            if best is not None and (not run or best[0] == run_variant):
                run.append((n, best[1]))
                run_variant = best[0]
                continue
            if run:
                entry = {
                    "op": op,
                    "dtype": str(DTYPES[dname]).removeprefix("torch."),
                    "n_min": run[0][0],
                    "n_max": run[-1][0],
                    "speedup_fwd": round(min(s[0] for _, s in run), 3),
                    "speedup_fwdbwd": round(min(s[1] for _, s in run), 3),
                }
                if run_variant is not None:
                    entry["variant"] = run_variant
                choices.append(entry)
            run, run_variant = ([(n, best[1])], best[0]) if best is not None else ([], None)
    return {
        "schema": CHOICE_SCHEMA,
        "device_class": device_class,
        "device_name": report["device"],
        "torch": report["torch"],
        "triton": report["triton"],
        "command": command,
        "date": date or datetime.datetime.now(datetime.timezone.utc).date().isoformat(),
        "choices": choices,
    }


def write_choice(report: dict, path: str | os.PathLike, command: str) -> Path:
    """Write :func:`choice_table` to ``path``; a directory (existing, or given with a trailing ``/``)
    gets ``<device_class>.json``. Returns the file written."""
    table = choice_table(report, command=command)
    target = Path(path)
    if target.is_dir() or str(path).endswith(("/", os.sep)):
        target = target / f"{table['device_class']}.json"
    target.parent.mkdir(parents=True, exist_ok=True)
    write_json(target, table)
    return target
