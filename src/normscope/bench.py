"""``normscope bench``: normscope against PyTorch eager, torch.compile and Liger-Kernel, in one run.

On CUDA every case is timed with ``triton.testing.do_bench`` (median), on CPU with repeated
wall-clock medians. Each result reports the time, the achieved bandwidth for an *assumed* byte
count (the minimum traffic of an ideal fused kernel, below), its ratio to every peer measured in
the same run, its ratio to the device's copy bandwidth (a large ``dst.copy_(src)`` measured in the
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
=====================  ==============  ===============================================

Weights, statistics and the second read of long rows are not counted: an implementation that
needs them shows up as lower GB/s. ``normscope`` is the public API (``normscope.functional``),
so it runs whatever the engine picks: on CUDA the Triton kernels for LayerNorm, RMSNorm,
add_rms_norm, GroupNorm, BatchNorm and masked BatchNorm. The JSON
records which (``normscope_impl``).

Peers: ``torch`` (eager), ``compile`` (``torch.compile`` of the same eager function; GPU, or
``--interpret``), ``liger`` (Liger-Kernel's Triton autograd Functions, when ``liger_kernel`` is
importable; see :func:`_liger_peers` for the like-for-like choices).

Usage::

    python -m normscope.bench                     # full run on the GPU, writes benchmarks/results/
    python -m normscope.bench --quick             # small sizes (CPU: about a minute)
    python -m normscope.bench --cases layer_norm,rms_norm --dtypes bf16 --out /tmp/b
    python -m normscope.bench --resume --budget-s 480 --out DIR   # continue DIR's JSON for 8 minutes
    python -m normscope.bench --plot-only --out DIR               # redraw DIR's PNG from its JSON
    TRITON_INTERPRET=1 python -m normscope.bench --interpret --out /tmp/dry

``--interpret`` is the GPU run's dry run on a CPU: the same code paths at tiny sizes -- normscope
forced onto its Triton kernels and Liger's kernels both in Triton's interpreter, torch.compile
through inductor's CPU backend, every case, the JSON and the PNG. Its times mean nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.nn.functional as F

import normscope
from normscope import functional as nf

ROW_CASES = ("layer_norm", "rms_norm", "add_rms_norm")
CASES = (*ROW_CASES, "group_norm", "group_norm_cl", "batch_norm", "masked_batch_norm")
PEERS = ("torch", "compile", "liger")
NS_FULL = (256, 1024, 4096, 8192, 16384, 32768, 65536, 131072, 262144)
NS_QUICK = (256, 4096)
#: --interpret: 20000 > normscope's MAX_FUSED_N (its looped path), 70000 > Liger's 65536 limit (its error path)
NS_INTERPRET = (64, 20000, 70000)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
EPS = 1e-5
GROUPS = 32
#: bytes of x per row case: >= 256 MB on the GPU (past every cache), 1 MB in --quick mode, 16 KB interpreted
FULL_BYTES, QUICK_BYTES, INTERPRET_BYTES = 256 << 20, 1 << 20, 16 << 10
#: (N, C, H, W) of the GroupNorm / BatchNorm cases and (B, S, D) of masked BatchNorm, per level
SPATIAL = {"full": (32, 256, 56, 56), "quick": (2, 64, 16, 16), "interpret": (2, 64, 4, 4)}
MASKED = {"full": (64, 1024, 1024), "quick": (4, 64, 128), "interpret": (2, 8, 16)}
#: forward output vs torch in fp32: allowed error is 2 x torch's own (same dtype) + ATOL x (1 + max |y|)
CHECK_ATOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 4e-3}
#: the Liger-Kernel release the adapter (:func:`_liger_peers`) was checked against: API read, and
#: run on CPU in Triton's interpreter (benchmarks/README.md). Carry the same wheel to the GPU host
#: (it is pure Python; its one undeclared need, ``packaging``, is there already):
#:   python3 -m pip download --no-deps -d .whl liger-kernel==0.8.5
LIGER_CHECKED = "0.8.5"
#: colours per implementation, the same in every panel of the plot
COLORS = {"normscope": "tab:green", "torch": "tab:red", "compile": "tab:blue", "liger": "tab:orange"}


# ----------------------------------------------------------------------------------------------
# timing


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


# ----------------------------------------------------------------------------------------------
# peers


def _liger_peers() -> tuple[dict[str, Callable] | None, str | None, str | None]:
    """Liger-Kernel's peers per case, its version, and why it is absent (None when present).

    The adapter calls Liger's Triton ``torch.autograd.Function`` classes directly (the ``nvidia-triton``
    implementation, which ``LigerLayerNorm`` / ``LigerRMSNorm`` / ``LigerGroupNorm`` /
    ``LigerFusedAddRMSNorm`` run on a GPU without the optional CuTe-DSL / cuTile packages) so that
    it gets the bench's own input, weight and bias tensors -- the same values, ``eps = EPS`` (Liger's
    modules default to 1e-6), and gradients for the same leaves. Checked against liger-kernel
    ``LIGER_CHECKED`` (0.8.5); signatures there:

    * ``LigerLayerNormFunction.apply(X, W, B, eps)``
    * ``LigerRMSNormFunction.apply(X, W, eps, offset, casting_mode, in_place, row_mode)``: offset
      0.0; casting_mode ``"gemma"`` -- everything in fp32, one rounding of the output, which is what
      normscope's kernel and ``F.rms_norm`` compute (the default ``"llama"`` rounds ``x * rstd`` to
      the input dtype before the weight multiply); ``in_place=True``, ``LigerRMSNorm``'s default:
      dx overwrites dy (each peer has its own cotangent here, so that is harmless), whereas
      ``in_place=False`` adds a ``zeros_like`` pass that no other peer pays
    * ``LigerFusedAddRMSNormFunction.apply(X, R, W, eps, offset, casting_mode, in_place)`` -> ``(Y, X + R)``:
      offset 0.0, ``"gemma"``, ``in_place=False`` (the module's default; its dx is ``empty_like``)
    * ``LigerGroupNormFunction.apply(X, W, B, num_channels, num_groups, eps)``: makes a
      channels_last input contiguous first and returns NCHW (its cost, measured as such)

    Liger's kernels keep a row in one block: N > 65536 raises ``RuntimeError`` (recorded as that
    peer's error for the row).
    """
    try:
        from liger_kernel.ops import (
            LigerFusedAddRMSNormFunction,
            LigerGroupNormFunction,
            LigerLayerNormFunction,
            LigerRMSNormFunction,
        )
    except Exception as exc:  # noqa: BLE001 - any failure to import means "not measured", with the reason
        return None, None, f"{type(exc).__name__}: {exc}"
    try:
        from importlib.metadata import version

        ver = version("liger-kernel")
    except Exception:  # noqa: BLE001 - a copy without its dist-info
        ver = "unknown"
    peers = {
        "layer_norm": lambda x, w, b: LigerLayerNormFunction.apply(x, w, b, EPS),
        "rms_norm": lambda x, w: LigerRMSNormFunction.apply(x, w, EPS, 0.0, "gemma", True, None),
        "add_rms_norm": lambda x, r, w: LigerFusedAddRMSNormFunction.apply(x, r, w, EPS, 0.0, "gemma", False),
        "group_norm": lambda x, w, b: LigerGroupNormFunction.apply(x, w, b, x.shape[1], GROUPS, EPS),
    }
    peers["group_norm_cl"] = peers["group_norm"]
    return peers, ver, None


@contextlib.contextmanager
def _interpreter_shims() -> Iterator[None]:
    """Make Triton 3.6's CPU interpreter run what the GPU compiler runs (``--interpret`` only; undone on exit).

    1. NumPy >= 2.4 refuses ``int(array_of_shape_(1,))`` in loops with runtime bounds: normscope's
       own fix (``rows._fix_interpreter_index``).
    2. The interpreter passes float kernel arguments as Python floats, where the compiler passes
       fp32 scalars: Liger's ``eps.to(tl.float32)`` fails on them. Wrap them as fp32 scalars.
    3. ``triton.language.extra.libdevice`` functions have no body in the interpreter (they return
       None): Liger imports ``rsqrt`` from there. Point its modules' ``rsqrt`` at ``tl.rsqrt``.

    Left as is: the interpreter does bf16 arithmetic on the raw 16-bit integers, so a kernel that
    computes in bf16 without converting first (Liger's fused add + RMSNorm adds ``X + R``, its
    GroupNorm sums ``X``, in bf16) computes garbage on CPU: the check flags it, :func:`problems`
    leaves it out with ``--interpret``; on a GPU that is real bf16 arithmetic, and checked as such.
    """
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    from normscope.kernels import rows

    rows._fix_interpreter_index()  # normscope's own, applied whenever rows is imported under the interpreter
    cvt = interpreter._implicit_cvt

    def implicit_cvt(arg):
        if isinstance(arg, float):
            return tl.tensor(interpreter.TensorHandle(np.array([arg], dtype=np.float32), tl.float32), tl.float32)
        return cvt(arg)

    def rsqrt(x):  # looked up at call time, inside a kernel, where the interpreter has patched tl
        return tl.rsqrt(x)

    undo = [(interpreter, "_implicit_cvt", cvt)]
    interpreter._implicit_cvt = implicit_cvt
    for name in ("layer_norm", "rms_norm", "fused_add_rms_norm", "group_norm"):
        mod = sys.modules.get(f"liger_kernel.ops.{name}")
        if mod is not None and hasattr(mod, "rsqrt"):
            undo.append((mod, "rsqrt", mod.rsqrt))
            mod.rsqrt = rsqrt
    try:
        yield
    finally:
        for obj, attr, old in reversed(undo):
            setattr(obj, attr, old)


# ----------------------------------------------------------------------------------------------
# cases: each returns (inputs, impls, (bytes_fwd, bytes_fwdbwd), shape, normscope label or None, eager)


def plan(cases, dtypes, level: str) -> list[tuple[str, str, tuple[int, ...]]]:
    """The (case, dtype, shape) configurations of a run, in order."""
    ns = {"full": NS_FULL, "quick": NS_QUICK, "interpret": NS_INTERPRET}[level]
    target = {"full": FULL_BYTES, "quick": QUICK_BYTES, "interpret": INTERPRET_BYTES}[level]
    out = []
    for case in cases:
        for dname in dtypes:
            if case in ROW_CASES:
                e = torch.empty((), dtype=DTYPES[dname]).element_size()
                out += [(case, dname, (max(1, math.ceil(target / (n * e))), n)) for n in ns]
            else:
                out.append((case, dname, MASKED[level] if case == "masked_batch_norm" else SPATIAL[level]))
    return out


def _randn(shape, g: torch.Generator, device, dtype) -> torch.Tensor:
    return torch.randn(shape, generator=g, device=device).to(dtype)


def _ns(fn: Callable, force: bool) -> Callable:
    """normscope as called in the run: forced onto the Triton backend with ``--interpret`` (on CPU
    the automatic choice would never pick it), the automatic choice otherwise."""
    if not force:
        return fn

    def forced(*args):
        with normscope.use_backend("triton"):
            return fn(*args)

    return forced


def _rows_case(case: str, m: int, n: int, dtype, device, peers: dict, kernels: bool, force: bool):
    g = torch.Generator(device=device).manual_seed(0)
    x = _randn((m, n), g, device, dtype)
    w = (torch.rand(n, generator=g, device=device) + 0.5).to(dtype)
    b = _randn(n, g, device, dtype)
    e = x.element_size()
    impls: dict[str, Callable] = {}
    ns_label = None  # the engine's choice, read after the check's call
    if case == "layer_norm":
        inputs = [x, w, b]
        eager = lambda x, w, b: F.layer_norm(x, (n,), w, b, EPS)  # noqa: E731
        impls["normscope"] = _ns(lambda x, w, b: nf.layer_norm(x, (n,), w, b, EPS), force)
        nbytes = (2 * m * n * e, 5 * m * n * e)
    elif case == "rms_norm":
        inputs = [x, w]
        eager = lambda x, w: F.rms_norm(x, (n,), w, EPS)  # noqa: E731
        impls["normscope"] = _ns(lambda x, w: nf.rms_norm(x, (n,), w, EPS), force)
        nbytes = (2 * m * n * e, 5 * m * n * e)
    else:  # add_rms_norm: the unfused peer is "h = x + r; rms_norm(h)"
        r = _randn((m, n), g, device, dtype)
        inputs = [x, r, w]

        def eager(x, r, w):
            h = x + r
            return F.rms_norm(h, (n,), w, EPS), h

        # name the backend: the call fails rather than quietly running something else than the label says
        backend = "triton" if kernels else "reference"
        impls["normscope"] = lambda x, r, w: nf.fused_add_rms_norm(x, r, w, EPS, backend=backend)
        ns_label = f"normscope ({backend})"
        nbytes = (4 * m * n * e, 8 * m * n * e)
    _add_peers(impls, eager, case, peers)
    return inputs, impls, nbytes, (m, n), ns_label, eager


def _spatial_case(case: str, shape, dtype, device, peers: dict, kernels: bool, force: bool):
    g = torch.Generator(device=device).manual_seed(0)
    c = shape[1] if case != "masked_batch_norm" else shape[-1]
    w = (torch.rand(c, generator=g, device=device) + 0.5).to(dtype)
    b = _randn(c, g, device, dtype)
    impls: dict[str, Callable] = {}
    if case.startswith("group_norm"):
        x = _randn(shape, g, device, dtype)
        if case == "group_norm_cl":
            x = x.contiguous(memory_format=torch.channels_last)
        inputs = [x, w, b]
        eager = lambda x, w, b: F.group_norm(x, GROUPS, w, b, EPS)  # noqa: E731
        impls["normscope"] = _ns(lambda x, w, b: nf.group_norm(x, GROUPS, w, b, EPS), force)
    elif case == "batch_norm":
        x = _randn(shape, g, device, dtype)
        inputs = [x, w.float(), b.float()]  # cuDNN batch norm wants fp32 parameters with half input
        eager = lambda x, w, b: F.batch_norm(x, None, None, w, b, True, 0.1, EPS)  # noqa: E731
        # the automatic order keeps unmasked BatchNorm on cuDNN: force the kernel so it is measured
        impls["normscope"] = _ns(lambda x, w, b: nf.batch_norm(x, None, None, w, b, True, 0.1, EPS), force or kernels)
    else:  # masked BatchNorm1d on (B, S, D): statistics per feature over the valid tokens
        bsz, s, _ = shape
        x = _randn(shape, g, device, dtype)
        lengths = torch.randint(s // 4, s + 1, (bsz,), generator=g, device=device)
        mask = (torch.arange(s, device=device)[None, :] < lengths[:, None])[..., None]
        inputs = [x, w, b]

        def eager(x, w, b):
            mf = mask.to(torch.float32)
            xf = x.float()
            cnt = mf.sum((0, 1))
            mean = (xf * mf).sum((0, 1)) / cnt
            var = ((xf - mean).square() * mf).sum((0, 1)) / cnt
            return ((xf - mean) * torch.rsqrt(var + EPS) * w.float() + b.float()).to(x.dtype)

        impls["normscope"] = _ns(
            lambda x, w, b: nf.normalize(x, keep=-1, weight=w, bias=b, affine_dims=-1, eps=EPS, mask=mask), force
        )
    _add_peers(impls, eager, case, peers)
    numel, e = math.prod(shape), inputs[0].element_size()
    return inputs, impls, (2 * numel * e, 5 * numel * e), tuple(shape), None, eager


def _add_peers(impls: dict, eager: Callable, case: str, peers: dict) -> None:
    if "torch" in peers:
        impls["torch"] = eager
    if "compile" in peers:
        impls["compile"] = torch.compile(eager, dynamic=False)
    liger = peers.get("liger")
    if liger is not None and case in liger:
        impls["liger"] = liger[case]


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


def _error(exc: Exception) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"


def _check(impls: dict, inputs: list, eager: Callable, dtype) -> dict[str, dict]:
    """Each implementation's forward outputs against torch eager on fp32 copies of the inputs.

    Returns per implementation ``max_err`` (largest absolute error over the outputs) and ``ok``:
    within twice torch's own error in the same dtype plus ``CHECK_ATOL[dtype] * (1 + max |y|)``.
    An implementation that raises gets ``ok: None`` and ``check_error`` (its timing says the same).
    """
    with torch.no_grad():
        want = eager(*[t.float() for t in inputs])
        want = want if isinstance(want, tuple) else (want,)
        errs: dict[str, float | str] = {}
        for name, fn in impls.items():
            try:
                got = fn(*inputs)
            except Exception as exc:  # noqa: BLE001
                errs[name] = _error(exc)
                continue
            got = got if isinstance(got, tuple) else (got,)
            if len(got) != len(want) or any(a.shape != b.shape for a, b in zip(got, want)):
                errs[name] = (
                    f"outputs of shapes {[tuple(a.shape) for a in got]}, torch: {[tuple(b.shape) for b in want]}"
                )
                continue
            errs[name] = max((a.float() - b).abs().max().item() for a, b in zip(got, want))
    scale = max(b.abs().max().item() for b in want)
    own = errs.get("torch") if isinstance(errs.get("torch"), float) else 0.0
    bound = 2 * own + CHECK_ATOL.get(dtype, 1e-4) * (1 + scale)
    out = {}
    for name, err in errs.items():
        if isinstance(err, str):
            out[name] = {"max_err": None, "ok": None, "check_error": err}  # raised: no output to check
        else:
            out[name] = {"max_err": err, "ok": bool(err <= bound)}  # NaN fails
    return out


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
) -> dict:
    """Measure every (case, dtype, shape) of :func:`plan` not already in ``previous["results"]``.

    ``level``: "full", "quick" or "interpret" (tiny sizes; the kernels run in Triton's interpreter:
    normscope is forced onto them). ``peers``: a subset of :data:`PEERS`. ``budget_s``: start no
    new configuration after that many seconds (the report then lists the rest under
    ``remaining`` and has ``complete: false``). ``on_config(report)`` runs after every configuration.
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
        "bytes_formula": {
            "layer_norm/rms_norm": "fwd 2*numel*e, fwd+bwd 5*numel*e",
            "add_rms_norm": "fwd 4*numel*e, fwd+bwd 8*numel*e",
            "group_norm/batch_norm/masked_batch_norm": "fwd 2*numel*e, fwd+bwd 5*numel*e (mask not counted)",
        },
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
    with _interpreter_shims() if interpret else contextlib.nullcontext():
        _measure_all(report, plan(cases, dtypes, level), device, level, peer_fns, kernels, budget_s, on_config, log)
    report["complete"] = "remaining" not in report and "failed" not in report
    return report


def _measure_all(report, configs, device, level, peer_fns, kernels, budget_s, on_config, log) -> None:
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
            rows = _one_config(case, dname, shape, device, level, peer_fns, kernels, done, report["copy_gbs"], log)
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


def _one_config(case, dname, shape, device, level, peer_fns, kernels, done, copy_gbs, log) -> list[dict]:
    """The rows (fwd, fwd+bwd) of one (case, dtype, shape), but those already ``done``."""
    interpret, dtype = level == "interpret", DTYPES[dname]
    if case in ROW_CASES:
        made = _rows_case(case, shape[0], shape[1], dtype, device, peer_fns, kernels, interpret)
    else:
        made = _spatial_case(case, shape, dtype, device, peer_fns, kernels, interpret)
    inputs, impls, nbytes, shape, ns_label, eager = made
    checks = _check(impls, inputs, eager, dtype)
    if ns_label is None:  # what the engine ran for the check's call (normscope runs first)
        ns_label = "normscope (failed)" if checks["normscope"].get("check_error") else None
        ns_label = ns_label or f"normscope ({normscope.last_backend()})"
    rows = []
    for mode, nb in zip(("fwd", "fwd+bwd"), nbytes):
        if (case, dname, tuple(shape), mode) in done:
            continue
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
            ms, peak, err = _measure(functools.partial(_closure, fn, inputs, mode, device), device, level)
            entry = {"ms": ms, "peak_mib": peak, "error": err, **checks.get(name, {})}
            if ms is not None:
                gbs = nb / (ms * 1e-3) / 1e9
                entry.update(gbs=gbs, frac_of_copy=gbs / copy_gbs)
            row["impls"][name] = entry
        ref = row["impls"].get("normscope", {}).get("ms")
        for entry in row["impls"].values():
            if ref and entry.get("ms"):
                entry["normscope_speedup"] = entry["ms"] / ref  # >1: normscope is faster
        rows.append(row)
        log(_format_row(row))
    return rows


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
            if e.get("ok") is False:
                if report.get("interpret") and name == "liger" and r["dtype"] != "fp32":
                    continue  # known: the interpreter's half-precision arithmetic (see _interpreter_shims)
                detail = e.get("check_error") or f"max error {e.get('max_err'):.3g}"
                out.append(f"{where}: {name} output does not match torch ({detail})")
        wants_kernel = report["device_type"] == "cuda" or report.get("interpret")
        if wants_kernel and r.get("normscope_impl") != "normscope (triton)":
            out.append(f"{where}: normscope ran {r.get('normscope_impl')!r}, not its Triton kernels")
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
            if name != "normscope" and e.get("normscope_speedup"):
                s += f" x{e['normscope_speedup']:.2f}"
            if e.get("ok") is False:
                s += " MISMATCH"
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
        sel = sorted((r for r in rows if (r["case"], r["dtype"], r["mode"]) == key), key=lambda r: r["shape"][1])
        names = sorted({n for r in sel for n in r["impls"]})
        for name in names:
            pts = [(r["shape"][1], r["impls"][name]["gbs"]) for r in sel if r["impls"].get(name, {}).get("gbs")]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=name, color=COLORS.get(name))
        ax.axhline(report["copy_gbs"], color="gray", ls="--", lw=1, label="copy")
        ax.set_xscale("log", base=2)
        ax.set_title(" ".join(key), fontsize=9)
        ax.set_xlabel("N (row length)")
        ax.set_ylabel("GB/s")
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


def _write_json(path: Path, report: dict) -> None:
    """Atomically: a run killed mid-write (a device's time limit) leaves the previous complete file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=1))
    os.replace(tmp, path)


def _use_interpreter(p: argparse.ArgumentParser) -> None:
    """--interpret: Triton must be imported (its kernels decorated) after TRITON_INTERPRET=1 is set."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return
    if any(m == "triton" or m.startswith("triton.") for m in sys.modules):
        p.error(
            "--interpret: Triton was imported before TRITON_INTERPRET=1 was set, so its kernels are compiled, "
            "not interpreted; run: TRITON_INTERPRET=1 python -m normscope.bench --interpret ..."
        )
    os.environ["TRITON_INTERPRET"] = "1"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="normscope bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="benchmarks/results", help="directory for bench-*.json and bench-*.png")
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated subset of: {', '.join(CASES)}")
    p.add_argument("--dtypes", default="fp32,bf16", help=f"comma-separated subset of: {', '.join(DTYPES)}")
    p.add_argument(
        "--peers",
        default=None,
        help=f"comma-separated subset of: {', '.join(PEERS)} (default: all on CUDA and with --interpret; torch on "
        "plain CPU, where inductor needs a C++ toolchain and minutes, and Liger's kernels cannot run)",
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
    p.add_argument("--budget-s", type=float, default=None, help="start no new configuration after this many seconds")
    p.add_argument("--plot-only", action="store_true", help="redraw the PNG from the JSON in --out, measure nothing")
    p.add_argument("--strict", action="store_true", help="exit 1 when problems() finds any (see the log's end)")
    a = p.parse_args(argv)
    cases = [c.strip() for c in a.cases.split(",") if c.strip()]
    dtypes = [d.strip() for d in a.dtypes.split(",") if d.strip()]
    peers = [q.strip() for q in (a.peers or ",".join(PEERS)).split(",") if q.strip()]
    bad = [c for c in cases if c not in CASES] + [d for d in dtypes if d not in DTYPES]
    if bad:
        p.error(f"unknown case/dtype {bad}; cases: {', '.join(CASES)}; dtypes: {', '.join(DTYPES)}")
    if [q for q in peers if q not in PEERS]:
        p.error(f"unknown peer {[q for q in peers if q not in PEERS]}; expected a subset of: {', '.join(PEERS)}")
    if a.interpret and a.device not in (None, "cpu"):
        p.error(f"--interpret runs on the CPU; got --device {a.device}")
    if a.interpret:
        _use_interpreter(p)
    device = torch.device(a.device or ("cpu" if a.interpret else "cuda" if torch.cuda.is_available() else "cpu"))
    level = "interpret" if a.interpret else "quick" if a.quick or device.type == "cpu" else "full"
    if a.peers is None and device.type == "cpu" and not a.interpret:
        peers = ["torch"]
    out = Path(a.out)
    stem = f"bench-{'' if level == 'full' else level + '-'}{device.type}"
    path = out / f"{stem}.json"
    previous = None
    if a.plot_only or a.resume:
        if path.exists():
            previous = json.loads(path.read_text())
        elif a.plot_only:
            p.error(f"--plot-only: no {path} to plot")
    if a.plot_only:
        wrote = plot(previous, out / f"{stem}.png")
        print(f"wrote {out / f'{stem}.png'}" if wrote else "no plot: matplotlib missing or no row cases")
        return 0
    out.mkdir(parents=True, exist_ok=True)
    report = run(
        cases, dtypes, level, device, peers=peers, previous=previous, budget_s=a.budget_s,
        on_config=lambda rep: _write_json(path, rep),
    )  # fmt: skip
    _write_json(path, report)
    wrote = [str(path)]
    if plot(report, out / f"{stem}.png"):
        wrote.append(str(out / f"{stem}.png"))
    print("wrote " + ", ".join(wrote))
    found = problems(report)
    for line in found:
        print(f"PROBLEM {line}")
    print(f"{len(report['results'])} rows, {len(found)} problems, complete: {report['complete']}")
    return 1 if a.strict and found else 0


if __name__ == "__main__":
    sys.exit(main())
