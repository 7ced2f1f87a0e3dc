"""Timing: medians per call (``triton.testing.do_bench`` on CUDA, wall-clock medians on CPU),
the copy-bandwidth ceiling, and :func:`run`, which measures every configuration of a plan."""

from __future__ import annotations

import contextlib
import functools
import platform
import statistics
import time
from collections.abc import Callable

import torch

import normscope

from .cases import (
    DTYPES,
    MODERN_CASES,
    ROW_CASES,
    VARIANTS,
    _check,
    _error,
    _modern_case,
    _rows_case,
    _spatial_case,
    plan,
    split_case,
    variant_runs,
)
from .peers import DECLINED, NOTES, PEERS, _interpreter_shims, _liger_peers
from .report import RATIO_RULE, _device_name, _format_row, _triton_version, device_class


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn: Callable[[], object], device: torch.device, level: str) -> float:
    """Median milliseconds of one call of ``fn`` (``level``: "full", "quick" or "interpret")."""
    quick = level != "full"
    if device.type == "cuda":
        import triton.testing

        return float(
            triton.testing.do_bench(fn, warmup=10 if quick else 25, rep=30 if quick else 100, return_mode="median")
        )
    if level == "interpret":  # the interpreter: one call, the number means nothing
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    fn()  # warm-up
    t0 = time.perf_counter()
    fn()
    once = max(time.perf_counter() - t0, 1e-6)
    inner = max(1, min(50, int((0.005 if quick else 0.02) / once)))  # 5-20 ms per sample
    samples = []
    for _ in range(3 if quick else 15):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        samples.append((time.perf_counter() - t0) / inner)
    return statistics.median(samples) * 1e3


def copy_bandwidth(device: torch.device, level: str) -> float:
    """GB/s of ``dst.copy_(src)`` (read + write) on a large buffer."""
    if level == "interpret":
        nbytes = 1 << 20
    else:
        nbytes = (16 << 20) if device.type == "cpu" or level == "quick" else (1 << 30)
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).normal_()
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), device, level)
    return 2 * nbytes / (ms * 1e-3) / 1e9


def _closure(fn: Callable, inputs: list, mode: str, device) -> Callable[[], object]:
    if mode == "fwd":

        def run():
            with torch.no_grad():
                return fn(*inputs)

        return run
    leaves = [t.detach().requires_grad_() for t in inputs]
    out = fn(*leaves)
    outs = out if isinstance(out, tuple) else (out,)
    cots = [torch.randn_like(o) for o in outs]

    def run():
        o = fn(*leaves)
        o = o if isinstance(o, tuple) else (o,)
        return torch.autograd.grad(o, leaves, cots, allow_unused=True)

    return run


def _measure(
    make: Callable[[], Callable[[], object]], device, level: str
) -> tuple[float | None, float | None, str | None]:
    """(ms, peak MiB, None) of the closure ``make()`` builds, or (None, None, error): building the
    closure runs the implementation once (fwd+bwd: for the cotangents), so that is inside too."""
    try:
        fn = make()
        fn()  # compile / autotune outside the timing
        if device.type == "cuda":
            _sync(device)
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
            fn()
            _sync(device)
            peak = (torch.cuda.max_memory_allocated(device) - base) / 2**20
        else:
            peak = None
        return time_ms(fn, device, level), peak, None
    except Exception as exc:  # noqa: BLE001 - a failing peer is reported, not fatal
        return None, None, _error(exc)


def run(
    cases,
    dtypes,
    level: str,
    device: torch.device,
    log=print,
    peers=PEERS,
    previous: dict | None = None,
    budget_s: float | None = None,
    on_config: Callable[[dict], None] | None = None,
    variants=VARIANTS,
) -> dict:
    """Measure every (case, dtype, shape) of :func:`plan` not already in ``previous["results"]``.

    ``level``: "full", "quick" or "interpret" (tiny sizes; the kernels run in Triton's interpreter:
    normscope is forced onto them). ``peers``: a subset of :data:`PEERS`. ``budget_s``: start no
    new configuration after that many seconds (the report then lists the rest under
    ``remaining`` and has ``complete: false``). ``on_config(report)`` runs after every configuration.
    ``variants``: the row cases' candidate kernels (:data:`VARIANTS`) timed beside the default where the
    kernels run and the candidate differs from the default kernel -- each a column of its own, whose
    ``ratio`` is the default's time over its time.
    """
    interpret = level == "interpret"
    kernels = (device.type == "cuda" and normscope.kernels.AVAILABLE) or interpret
    peer_fns: dict = {p: True for p in peers if p in ("torch", "compile")}
    liger, liger_version, liger_absent = (None, None, "not requested") if "liger" not in peers else _liger_peers()
    if liger is not None:
        peer_fns["liger"] = liger
    if "compile" in peer_fns:
        # every (case, N, dtype) recompiles the same lambdas' code objects: past dynamo's default
        # limit of 8 it would silently run them eagerly and the "compile" column would lie
        from torch._dynamo import config as dynamo_config

        for knob in (
            "cache_size_limit",
            "recompile_limit",
            "accumulated_cache_size_limit",
            "accumulated_recompile_limit",
        ):
            if hasattr(dynamo_config, knob):
                setattr(dynamo_config, knob, 4096)
    report = {
        "device": _device_name(device),
        "device_type": device.type,
        "device_class": device_class(device) if device.type == "cuda" else None,
        "level": level,
        "quick": level != "full",
        "interpret": interpret,
        "torch": torch.__version__,
        "triton": _triton_version(),
        "liger": liger_version,
        "liger_absent": liger_absent,
        "normscope": normscope.__version__,
        "python": platform.python_version(),
        "peers": list(peers),
        "variants": list(variants) if kernels else [],
        "bytes_formula": {
            "layer_norm/rms_norm": "fwd 2*numel*e, fwd+bwd 5*numel*e",
            "add_rms_norm": "fwd 4*numel*e, fwd+bwd 8*numel*e",
            "group_norm/batch_norm/masked_batch_norm": "fwd 2*numel*e, fwd+bwd 5*numel*e (mask not counted)",
            "modulated_*/gemma_rms_norm/poly_norm/derf": "fwd 2*numel*e, fwd+bwd 5*numel*e (modulations not counted)",
            "qk_norm": "fwd 2*(numel q + numel k)*e, fwd+bwd 5*(numel q + numel k)*e",
        },
        "ratio_rule": RATIO_RULE,
        "check_rule": "forward outputs vs torch on fp32 inputs: max_err <= 2 x torch's own + CHECK_ATOL x (1 + max|y|)",
        "results": [],
    }
    if previous is not None:
        for key in ("device", "level"):
            if previous.get(key) != report[key]:
                raise ValueError(
                    f"resume: the previous report's {key} is {previous.get(key)!r}, this run's is {report[key]!r}"
                )
        report["results"] = list(previous.get("results", []))
        report["copy_gbs"] = previous["copy_gbs"]  # one ceiling for every row of the report
        log(f"resume: {len(report['results'])} rows already measured")
    else:
        report["copy_gbs"] = copy_bandwidth(device, level)
    liger_said = liger_version or liger_absent
    log(f"device: {report['device']}   copy bandwidth: {report['copy_gbs']:.1f} GB/s   liger: {liger_said}")
    log(f"each row: implementation, median ms, GB/s, % of copy bandwidth, ratio = {RATIO_RULE}")
    # a requested peer that is not measured at all: the reason goes into every row
    absent = {"liger": liger_absent} if "liger" in peers and liger is None else {}
    with _interpreter_shims() if interpret else contextlib.nullcontext():
        _measure_all(
            report, plan(cases, dtypes, level), device, level, peer_fns, kernels, budget_s, on_config, log, absent,
            variants=tuple(variants),
        )  # fmt: skip
    report["complete"] = "remaining" not in report and "failed" not in report
    return report


def _measure_all(
    report, configs, device, level, peer_fns, kernels, budget_s, on_config, log, absent=None, variants=()
) -> None:
    """The loop of :func:`run`: appends to ``report["results"]`` (and ``remaining``, ``failed``)."""
    done = {(r["case"], r["dtype"], tuple(r["shape"]), r["mode"]) for r in report["results"]}
    todo = [c for c in configs if any((*c, m) not in done for m in ("fwd", "fwd+bwd"))]
    report.pop("remaining", None)
    report.pop("failed", None)
    t0 = time.monotonic()
    for i, (case, dname, shape) in enumerate(todo):
        if budget_s is not None and i > 0 and time.monotonic() - t0 > budget_s:  # one at least: progress
            report["remaining"] = [{"case": c, "dtype": d, "shape": list(s)} for c, d, s in todo[i:]]
            log(f"budget of {budget_s:.0f} s spent: {len(todo) - i} configurations left for a --resume run")
            break
        t1 = time.monotonic()
        try:
            rows = _one_config(
                case, dname, shape, device, level, peer_fns, kernels, done, report["copy_gbs"], log, absent or {},
                variants,
            )  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - e.g. out of memory building the inputs: the others still run
            err = _error(exc)
            report.setdefault("failed", []).append({"case": case, "dtype": dname, "shape": list(shape), "error": err})
            log(f"{case} {dname} {'x'.join(map(str, shape))}: failed: {err}")
            rows = []
        for row in rows:
            row["config_s"] = round(time.monotonic() - t1, 2)  # building, checking, compiling and timing it
        report["results"] += rows
        log(
            f"[{time.monotonic() - t0:.0f} s] {case} {dname} {'x'.join(map(str, shape))}: {time.monotonic() - t1:.1f} s"
        )
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if on_config is not None:
            on_config(report)


def _one_config(
    case, dname, shape, device, level, peer_fns, kernels, done, copy_gbs, log, absent=None, variants=()
) -> list[dict]:
    """The rows (fwd, fwd+bwd) of one (case, dtype, shape), but those already ``done``. Each row
    names the requested peers it has no entry for, and why (``declined``)."""
    dtype = DTYPES[dname]
    if case in ROW_CASES:
        made = _rows_case(case, shape[0], shape[1], dtype, device, peer_fns, kernels, variants)
    elif case in MODERN_CASES:
        made = _modern_case(case, tuple(shape), dtype, device, peer_fns, kernels)
    else:
        made = _spatial_case(case, shape, dtype, device, peer_fns, kernels)
    inputs, impls, nbytes, shape, ns_label, eager, n = made
    checks = _check(impls, inputs, eager, dtype)
    if ns_label is None:  # what the engine ran for the check's call (normscope runs first)
        ns_label = "normscope (failed)" if checks["normscope"].get("check_error") else None
        ns_label = ns_label or f"normscope ({normscope.last_backend()})"
    declined = dict(absent or {})
    base, variant = split_case(case)
    for peer in peer_fns:
        if peer not in impls:
            declined[peer] = DECLINED.get(peer, {}).get(base, f"no {peer} counterpart of {case} adapted")
    rows = []
    for mode, nb in zip(("fwd", "fwd+bwd"), nbytes):
        if (case, dname, tuple(shape), mode) in done:
            continue
        row = {
            "case": case,
            "dtype": dname,
            "mode": mode,
            "shape": list(shape),
            "n": n,
            "bytes": nb,
            "normscope_impl": ns_label,
            "impls": {},
        }
        if declined:
            row["declined"] = declined
        if variant is not None:  # a candidate kernel (normscope.kernels.variants) named by this case
            row["variant"] = variant
            row["variant_ran"] = variant_runs(case, inputs)
        for name, fn in impls.items():
            ms, peak, err = _measure(functools.partial(_closure, fn, inputs, mode, device), device, level)
            entry = {"ms": ms, "peak_mib": peak, "error": err, **checks.get(name, {})}
            if NOTES.get(name, {}).get(case):
                entry["note"] = NOTES[name][case]
            if ms is not None:
                gbs = nb / (ms * 1e-3) / 1e9
                entry.update(gbs=gbs, frac_of_copy=gbs / copy_gbs)
            row["impls"][name] = entry
        ref = row["impls"].get("normscope", {}).get("ms")
        for name, entry in row["impls"].items():
            if name != "normscope" and ref and entry.get("ms"):
                entry["ratio"] = ref / entry["ms"]  # RATIO_RULE: below 1, normscope is faster
        rows.append(row)
        log(_format_row(row))
    return rows
