"""``normscope bench``: normscope against PyTorch eager, torch.compile and Liger-Kernel, in one run.

On CUDA every case is timed with ``triton.testing.do_bench`` (median), on CPU with repeated
wall-clock medians. Each result reports the time, the achieved bandwidth for an *assumed* byte
count (the minimum traffic of an ideal fused kernel, below), its ratio to every peer measured in
the same run, its ratio to the device's copy bandwidth (a large ``dst.copy_(src)`` measured in the
same run: the practical ceiling), and the peak memory (CUDA).

Bytes assumed (``e`` = bytes per element of the input dtype, ``numel`` = elements of x):

=====================  ==============  ===============================================
case                   forward         forward + backward
=====================  ==============  ===============================================
layer_norm, rms_norm   2 numel e       5 numel e  (fwd: read x, write y; bwd: read x, dy, write dx)
add_rms_norm           4 numel e       8 numel e  (fwd: read x, r, write y, h; bwd: read h, dy, dh, write dx)
group_norm[_cl]        2 numel e       5 numel e
batch_norm             2 numel e       5 numel e
masked_batch_norm      2 numel e       5 numel e  (the (B, S) mask is not counted)
=====================  ==============  ===============================================

Weights, statistics and the second read of long rows are not counted: an implementation that
needs them shows up as lower GB/s. ``normscope`` is the public API (``normscope.functional``),
so it runs whatever the engine picks: on CUDA the Triton kernels for LayerNorm, RMSNorm,
add_rms_norm, GroupNorm, BatchNorm and masked BatchNorm. The JSON
records which (``normscope_impl``).

Usage::

    python -m normscope.bench                     # full run on the GPU, writes benchmarks/results/
    python -m normscope.bench --quick             # small sizes (CPU: about a minute)
    python -m normscope.bench --cases layer_norm,rms_norm --dtypes bf16 --out /tmp/b
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

import normscope
from normscope import functional as nf

ROW_CASES = ("layer_norm", "rms_norm", "add_rms_norm")
CASES = (*ROW_CASES, "group_norm", "group_norm_cl", "batch_norm", "masked_batch_norm")
NS_FULL = (256, 1024, 4096, 8192, 16384, 32768, 65536, 131072, 262144)
NS_QUICK = (256, 4096)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
EPS = 1e-5
#: bytes of x per row case: >= 256 MB on the GPU (past every cache), 1 MB in --quick mode
FULL_BYTES, QUICK_BYTES = 256 << 20, 1 << 20


# ----------------------------------------------------------------------------------------------
# timing


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn: Callable[[], object], device: torch.device, quick: bool) -> float:
    """Median milliseconds of one call of ``fn``."""
    if device.type == "cuda":
        import triton.testing

        return float(
            triton.testing.do_bench(fn, warmup=10 if quick else 25, rep=30 if quick else 100, return_mode="median")
        )
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


def copy_bandwidth(device: torch.device, quick: bool) -> float:
    """GB/s of ``dst.copy_(src)`` (read + write) on a large buffer."""
    nbytes = (16 << 20) if device.type == "cpu" or quick else (1 << 30)
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).normal_()
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), device, quick)
    return 2 * nbytes / (ms * 1e-3) / 1e9


# ----------------------------------------------------------------------------------------------
# cases: each returns (inputs, grad_inputs, impls, bytes_fwd, bytes_fwdbwd, shape)


def _triton_ok(device: torch.device) -> bool:
    return device.type == "cuda" and normscope.kernels.AVAILABLE


def _liger():
    try:
        from liger_kernel.transformers import LigerLayerNorm, LigerRMSNorm

        return LigerLayerNorm, LigerRMSNorm
    except Exception:  # noqa: BLE001 - any failure to import means "not measured"
        return None


def _rows_case(case: str, m: int, n: int, dtype, device, compile_ok: bool):
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(m, n, generator=g).to(device, dtype)
    w = (torch.rand(n, generator=g) + 0.5).to(device, dtype)
    b = torch.randn(n, generator=g).to(device, dtype)
    e = x.element_size()
    impls: dict[str, Callable] = {}
    ns_label = None  # the engine's choice, read after the first call
    if case == "layer_norm":
        inputs = [x, w, b]
        eager = lambda x, w, b: F.layer_norm(x, (n,), w, b, EPS)  # noqa: E731
        impls["normscope"] = lambda x, w, b: nf.layer_norm(x, (n,), w, b, EPS)
        nbytes = (2 * m * n * e, 5 * m * n * e)
    elif case == "rms_norm":
        inputs = [x, w]
        eager = lambda x, w: F.rms_norm(x, (n,), w, EPS)  # noqa: E731
        impls["normscope"] = lambda x, w: nf.rms_norm(x, (n,), w, EPS)
        nbytes = (2 * m * n * e, 5 * m * n * e)
    else:  # add_rms_norm: the unfused peer is "h = x + r; rms_norm(h)"
        r = torch.randn(m, n, generator=g).to(device, dtype)
        inputs = [x, r, w]

        def eager(x, r, w):
            h = x + r
            return F.rms_norm(h, (n,), w, EPS), h

        impls["normscope"] = lambda x, r, w: nf.fused_add_rms_norm(x, r, w, EPS)
        ns_label = "normscope (triton)" if _triton_ok(device) else "normscope (reference)"
        nbytes = (4 * m * n * e, 8 * m * n * e)
    impls["torch"] = eager
    if compile_ok:
        impls["compile"] = torch.compile(eager, dynamic=False)
    liger = _liger() if device.type == "cuda" else None
    if liger is not None and case != "add_rms_norm":
        LigerLayerNorm, LigerRMSNorm = liger
        if case == "layer_norm":
            mod = LigerLayerNorm(n, eps=EPS)
        else:
            try:  # in-place backward would overwrite our reused cotangent between timed calls
                mod = LigerRMSNorm(n, eps=EPS, in_place=False)
            except TypeError:  # older Liger: no in_place argument (and not in place)
                mod = LigerRMSNorm(n, eps=EPS)
        mod = mod.to(device, dtype)
        with torch.no_grad():
            mod.weight.copy_(w)
            if case == "layer_norm" and getattr(mod, "bias", None) is not None:
                mod.bias.copy_(b)
        impls["liger"] = lambda x, *params: mod(x)
    return inputs, impls, nbytes, (m, n), ns_label


def _spatial_case(case: str, quick: bool, dtype, device, compile_ok: bool):
    g = torch.Generator(device="cpu").manual_seed(0)
    shape = (2, 64, 16, 16) if quick else (32, 256, 56, 56)
    c = shape[1]
    w = (torch.rand(c, generator=g) + 0.5).to(device, dtype)
    b = torch.randn(c, generator=g).to(device, dtype)
    impls: dict[str, Callable] = {}
    if case.startswith("group_norm"):
        x = torch.randn(shape, generator=g).to(device, dtype)
        if case == "group_norm_cl":
            x = x.contiguous(memory_format=torch.channels_last)
        inputs = [x, w, b]
        eager = lambda x, w, b: F.group_norm(x, 32, w, b, EPS)  # noqa: E731
        impls["normscope"] = lambda x, w, b: nf.group_norm(x, 32, w, b, EPS)
        label = None
    elif case == "batch_norm":
        x = torch.randn(shape, generator=g).to(device, dtype)
        inputs = [x, w, b]
        w32, b32 = w.float(), b.float()  # cuDNN batch norm wants fp32 parameters with half input
        inputs = [x, w32, b32]
        eager = lambda x, w, b: F.batch_norm(x, None, None, w, b, True, 0.1, EPS)  # noqa: E731
        if _triton_ok(device):  # the automatic order keeps unmasked BatchNorm on cuDNN: force the kernel

            def ns_bn(x, w, b):
                with normscope.use_backend("triton"):
                    return nf.batch_norm(x, None, None, w, b, True, 0.1, EPS)

            impls["normscope"] = ns_bn
        else:
            impls["normscope"] = lambda x, w, b: nf.batch_norm(x, None, None, w, b, True, 0.1, EPS)
        label = None
    else:  # masked BatchNorm1d on (B, S, D): statistics per feature over the valid tokens
        bsz, s, d = (4, 64, 128) if quick else (64, 1024, 1024)
        x = torch.randn(bsz, s, d, generator=g).to(device, dtype)
        lengths = torch.randint(s // 4, s + 1, (bsz,), generator=g)
        mask = (torch.arange(s)[None, :] < lengths[:, None]).to(device)[..., None]
        w = (torch.rand(d, generator=g) + 0.5).to(device, dtype)
        b = torch.randn(d, generator=g).to(device, dtype)
        inputs = [x, w, b]

        def eager(x, w, b):
            mf = mask.to(torch.float32)
            xf = x.float()
            cnt = mf.sum((0, 1))
            mean = (xf * mf).sum((0, 1)) / cnt
            var = ((xf - mean).square() * mf).sum((0, 1)) / cnt
            return ((xf - mean) * torch.rsqrt(var + EPS) * w.float() + b.float()).to(x.dtype)

        impls["normscope"] = lambda x, w, b: nf.normalize(
            x, keep=-1, weight=w, bias=b, affine_dims=-1, eps=EPS, mask=mask
        )
        label = None
        shape = (bsz, s, d)
    impls["torch"] = eager
    if compile_ok:
        impls["compile"] = torch.compile(eager, dynamic=False)
    numel, e = math.prod(shape), inputs[0].element_size()
    return inputs, impls, (2 * numel * e, 5 * numel * e), shape, label


# ----------------------------------------------------------------------------------------------
# running


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


def _measure(fn: Callable[[], object], device, quick: bool) -> tuple[float | None, float | None, str | None]:
    try:
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
        return time_ms(fn, device, quick), peak, None
    except Exception as exc:  # noqa: BLE001 - a failing peer is reported, not fatal
        return None, None, f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"


def run(cases, dtypes, quick: bool, device: torch.device, log=print, compile_peers: bool | None = None) -> dict:
    # inductor on CPU needs a C++ toolchain and minutes: by default the compile peer runs on GPU only
    compile_ok = device.type == "cuda" if compile_peers is None else compile_peers
    if compile_ok:
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
    copy_gbs = copy_bandwidth(device, quick)
    log(f"device: {_device_name(device)}   copy bandwidth: {copy_gbs:.1f} GB/s")
    results = []
    ns = NS_QUICK if quick else NS_FULL
    target = QUICK_BYTES if quick else FULL_BYTES
    for case in cases:
        for dname in dtypes:
            dtype = DTYPES[dname]
            configs = []
            if case in ROW_CASES:
                for n in ns:
                    m = max(1, math.ceil(target / (n * torch.empty((), dtype=dtype).element_size())))
                    configs.append(lambda n=n, m=m, c=case, d=dtype: _rows_case(c, m, n, d, device, compile_ok))
            else:
                configs.append(lambda c=case, d=dtype: _spatial_case(c, quick, d, device, compile_ok))
            for make in configs:
                inputs, impls, nbytes, shape, ns_label = make()
                for mode, nb in zip(("fwd", "fwd+bwd"), nbytes):
                    row = {
                        "case": case,
                        "dtype": dname,
                        "mode": mode,
                        "shape": list(shape),
                        "bytes": nb,
                        "normscope_impl": ns_label,
                        "impls": {},
                    }
                    for name, fn in impls.items():
                        ms, peak, err = _measure(_closure(fn, inputs, mode, device), device, quick)
                        if name == "normscope" and row["normscope_impl"] is None:
                            row["normscope_impl"] = f"normscope ({normscope.last_backend()})"
                        entry = {"ms": ms, "peak_mib": peak, "error": err}
                        if ms is not None:
                            gbs = nb / (ms * 1e-3) / 1e9
                            entry.update(gbs=gbs, frac_of_copy=gbs / copy_gbs)
                        row["impls"][name] = entry
                    ref = row["impls"].get("normscope", {}).get("ms")
                    for entry in row["impls"].values():
                        if ref and entry.get("ms"):
                            entry["normscope_speedup"] = entry["ms"] / ref  # >1: normscope is faster
                    results.append(row)
                    log(_format_row(row))
                del inputs, impls
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    return {
        "device": _device_name(device),
        "device_type": device.type,
        "torch": torch.__version__,
        "triton": _triton_version(),
        "normscope": normscope.__version__,
        "python": platform.python_version(),
        "quick": quick,
        "copy_gbs": copy_gbs,
        "bytes_formula": {
            "layer_norm/rms_norm": "fwd 2*numel*e, fwd+bwd 5*numel*e",
            "add_rms_norm": "fwd 4*numel*e, fwd+bwd 8*numel*e",
            "group_norm/batch_norm/masked_batch_norm": "fwd 2*numel*e, fwd+bwd 5*numel*e (mask not counted)",
        },
        "results": results,
    }


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
            if name != "normscope" and e.get("normscope_speedup"):
                s += f" x{e['normscope_speedup']:.2f}"
            parts.append(s)
    shape = "x".join(map(str, row["shape"]))
    return f"{row['case']:<18} {row['dtype']:<4} {row['mode']:<7} {shape:<16} | " + " | ".join(parts)


def plot(report: dict, path: Path) -> bool:
    """GB/s against N per implementation, one panel per (row case, dtype, mode). False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = [r for r in report["results"] if r["case"] in ROW_CASES]
    panels = sorted({(r["case"], r["dtype"], r["mode"]) for r in rows})
    if not panels:
        return False
    cols = 2
    fig, axes = plt.subplots(
        math.ceil(len(panels) / cols), cols, figsize=(11, 3.2 * math.ceil(len(panels) / cols)), squeeze=False
    )
    for ax, key in zip(axes.flat, panels):
        sel = [r for r in rows if (r["case"], r["dtype"], r["mode"]) == key]
        names = sorted({n for r in sel for n in r["impls"]})
        for name in names:
            pts = [(r["shape"][1], r["impls"][name]["gbs"]) for r in sel if r["impls"].get(name, {}).get("gbs")]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=name)
        ax.axhline(report["copy_gbs"], color="gray", ls="--", lw=1, label="copy")
        ax.set_xscale("log", base=2)
        ax.set_title(" ".join(key), fontsize=9)
        ax.set_xlabel("N (row length)")
        ax.set_ylabel("GB/s")
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    fig.suptitle(f"normscope bench -- {report['device']}", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.97))  # room for the suptitle
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="normscope bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="benchmarks/results", help="directory for bench.json and bench.png")
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated subset of: {', '.join(CASES)}")
    p.add_argument("--dtypes", default="fp32,bf16", help=f"comma-separated subset of: {', '.join(DTYPES)}")
    p.add_argument("--quick", action="store_true", help="small sizes (the default on CPU)")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    a = p.parse_args(argv)
    cases = [c.strip() for c in a.cases.split(",") if c.strip()]
    dtypes = [d.strip() for d in a.dtypes.split(",") if d.strip()]
    bad = [c for c in cases if c not in CASES] + [d for d in dtypes if d not in DTYPES]
    if bad:
        p.error(f"unknown case/dtype {bad}; cases: {', '.join(CASES)}; dtypes: {', '.join(DTYPES)}")
    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    quick = a.quick or device.type == "cpu"
    report = run(cases, dtypes, quick, device)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"bench-{'quick-' if quick else ''}{device.type}"
    (out / f"{stem}.json").write_text(json.dumps(report, indent=1))
    wrote = [str(out / f"{stem}.json")]
    if plot(report, out / f"{stem}.png"):
        wrote.append(str(out / f"{stem}.png"))
    print("wrote " + ", ".join(wrote))
    return 0


if __name__ == "__main__":
    sys.exit(main())
