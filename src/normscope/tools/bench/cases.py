"""The bench's cases: sizes per level, the inputs and implementations of each case, and the
forward check of every implementation against torch eager.

Each case builder returns ``(inputs, impls, (bytes_fwd, bytes_fwdbwd), shape, normscope label or None, eager,
n)``, where ``n`` is the number of elements in one normalized scope (what the measured-choice table is keyed by:
the row length for LayerNorm/RMSNorm and the modern norms -- head_dim for qk_norm --, C/G x H x W for GroupNorm,
N x H x W -- valid positions only when masked -- for BatchNorm).

The shape of a modern case's configuration is x's: (B, S, D) for the modulated (AdaLN) cases, q's (B, S, H, D)
for qk_norm (k has ``QK_KV_HEADS`` heads), (M, N) for the others.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

import normscope
from normscope import functional as nf
from normscope import functional_modern as fm
from normscope.kernels.variants import FAMILIES, default, use_variant

ROW_CASES = ("layer_norm", "rms_norm", "add_rms_norm")
#: the row cases' candidate kernels (``--variants``): each timed in a column of its own beside the default
#: kernel (the ``normscope`` column, the rows kernels forced so whatever a pin or a measured-choice table says)
#: wherever it runs other kernels than the default -- the read-once rows kernels, kernels/rows_once.py, for
#: rows past the single block. The row cases sweep the row length in one case, so a candidate is a column;
#: the spatial cases' candidates are cases of their own (``case@variant``, CANDIDATE_CASES)
VARIANTS = FAMILIES["rows"][1:]
CASES = (*ROW_CASES, "group_norm", "group_norm_cl", "batch_norm", "masked_batch_norm")
#: the modern norms (normscope.functional_modern), a group of their own (``--cases modern``): not in the
#: default selection, which measures the ops the engine chooses automatically (and feeds the choice table)
MODERN_CASES = ("modulated_rms_norm", "modulated_layer_norm", "qk_norm", "gemma_rms_norm", "poly_norm", "derf")
#: the spatial cases' candidate kernels (normscope.kernels.variants), each beside the case that measures the
#: default kernel on the same input: ``case@variant`` runs that kernel variant, a plain case the default
#: ("tiled"), so that a row measures the kernel its name says whatever a pin or the measured-choice table
#: names. InstanceNorm, channels_last BatchNorm and GroupNorm at 28 x 28 (``group_norm_small``: a group of
#: 8 x 784 fits the on-chip tile, the bench's 8 x 3136 does not) are measured here. A group of their own,
#: ``--cases candidates`` (gpu_check.sh's GPU_CHECK_CASES): not in the default selection
CANDIDATE_CASES = (
    "instance_norm", "instance_norm@onchip", "instance_norm_cl", "instance_norm_cl@onchip",
    "group_norm_small", "group_norm_small@onchip", "group_norm_small_cl", "group_norm_small_cl@onchip",
    "batch_norm", "batch_norm@split", "batch_norm_cl", "batch_norm_cl@split",
    "masked_batch_norm", "masked_batch_norm@split",
)  # fmt: skip
#: the names ``--cases`` accepts besides single cases
CASE_GROUPS = {
    "default": CASES,
    "modern": MODERN_CASES,
    "all": (*CASES, *MODERN_CASES),
    "candidates": CANDIDATE_CASES,
}
#: every case a run may name (the groups' union, in order)
KNOWN_CASES = tuple(dict.fromkeys(c for group in CASE_GROUPS.values() for c in group))
#: the kernel family of each spatial case, whose variant the case names (normscope.kernels.variants)
VARIANT_FAMILY = {
    "group_norm": "groups", "group_norm_cl": "groups", "group_norm_small": "groups", "group_norm_small_cl": "groups",
    "instance_norm": "groups", "instance_norm_cl": "groups",
    "batch_norm": "channels", "batch_norm_cl": "channels", "masked_batch_norm": "channels",
}  # fmt: skip
NS_FULL = (256, 1024, 4096, 8192, 16384, 32768, 65536, 131072, 262144)
NS_QUICK = (256, 4096)
#: --interpret: 20000 > normscope's ROWS_MAX_FUSED_N (its looped path), 70000 > Liger's 65536 limit (its error path)
NS_INTERPRET = (64, 20000, 70000)
#: row widths of the modern cases: their fused kernels keep a row in registers and decline rows past
#: ``kernels.config.ROWS_MAX_FUSED_N`` (16384), so no level asks for more; 1536 is not a power of two
#: (masked lanes: Liger #518). qk_norm's width is head_dim: QK_HEAD_DIMS
NS_MODERN = {"full": (256, 1024, 4096, 8192, 16384), "quick": (256, 4096), "interpret": (64, 1536)}
QK_HEAD_DIMS = {"full": (64, 128, 256), "quick": (128,), "interpret": (64,)}
#: heads of q and of k (grouped-query attention: k has a quarter of q's), and the batch of the
#: per-sample modulation of the AdaLN cases (x is (B, S, D), scale and shift (B, D))
QK_HEADS, QK_KV_HEADS, MOD_BATCH = 16, 4, 4
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
EPS = 1e-5
GROUPS = 32
#: bytes of x per row case: >= 256 MB on the GPU (past every cache), 1 MB in --quick mode, 16 KB interpreted
FULL_BYTES, QUICK_BYTES, INTERPRET_BYTES = 256 << 20, 1 << 20, 16 << 10
#: (N, C, H, W) of the GroupNorm / BatchNorm cases and (B, S, D) of masked BatchNorm, per level
SPATIAL = {"full": (32, 256, 56, 56), "quick": (2, 64, 16, 16), "interpret": (2, 64, 4, 4)}
#: (N, C, H, W) of ``group_norm_small``: a GroupNorm(32) group the on-chip kernels hold (8 x 784 at "full")
SPATIAL_SMALL = {"full": (32, 256, 28, 28), "quick": (2, 64, 8, 8), "interpret": (2, 64, 2, 2)}
MASKED = {"full": (64, 1024, 1024), "quick": (4, 64, 128), "interpret": (2, 8, 16)}
#: forward output vs torch in fp32: allowed error is 2 x torch's own (same dtype) + ATOL x (1 + max |y|)
CHECK_ATOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 4e-3}


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
            elif case in MODERN_CASES:
                e = torch.empty((), dtype=DTYPES[dname]).element_size()
                out += [(case, dname, _modern_shape(case, n, target // e)) for n in _modern_ns(case, level)]
            else:
                base = split_case(case)[0]
                shape = SPATIAL_SMALL if base.startswith("group_norm_small") else SPATIAL
                out.append((case, dname, MASKED[level] if base == "masked_batch_norm" else shape[level]))
    return out


def split_case(case: str) -> tuple[str, str | None]:
    """``("batch_norm", "split")`` for ``"batch_norm@split"``; ``(case, None)`` for a case without a variant."""
    base, _, variant = case.partition("@")
    return base, variant or None


def variant_runs(case: str, inputs: list) -> bool:
    """Whether the kernel variant a case names runs on its input: the on-chip groups kernels only where a
    group fits their tile (elsewhere the default kernels run, and the row must not count for the variant)."""
    base, variant = split_case(case)
    if variant != "onchip":
        return True
    from normscope.kernels.variants import onchip_takes

    x = inputs[0]
    return onchip_takes(x, x.shape[1] if base.startswith("instance_norm") else GROUPS)


def _modern_ns(case: str, level: str) -> tuple[int, ...]:
    return QK_HEAD_DIMS[level] if case == "qk_norm" else NS_MODERN[level]


def _modern_shape(case: str, n: int, numel: int) -> tuple[int, ...]:
    """The shape of x (of q for qk_norm) with rows of ``n`` and about ``numel`` elements (of q and k together)."""
    if case == "qk_norm":  # (B, S, H, D): B = 2
        return (2, max(1, math.ceil(numel / (2 * (QK_HEADS + QK_KV_HEADS) * n))), QK_HEADS, n)
    if case.startswith("modulated"):  # (B, S, D)
        return (MOD_BATCH, max(1, math.ceil(numel / (MOD_BATCH * n))), n)
    return (max(1, math.ceil(numel / n)), n)


def _randn(shape, g: torch.Generator, device, dtype) -> torch.Tensor:
    return torch.randn(shape, generator=g, device=device).to(dtype)


def _ns(fn: Callable, kernels: bool, variant: tuple[str, str] | None = None) -> Callable:
    """normscope as called in the run: forced onto the Triton backend where its kernels can run (CUDA, or
    ``--interpret``): the run measures the kernels against ATen, so it must not depend on the automatic
    choice that its own measurements decide. Elsewhere (plain CPU) the automatic choice. ``variant``: a kernel
    family and the variant it runs (:func:`normscope.kernels.variants.use_variant`) -- the default or a
    candidate, never a pin's or the measured-choice table's, for the same reason."""
    if not kernels:
        return fn

    def forced(*args):
        with normscope.use_backend("triton"), use_variant(*variant) if variant else contextlib.nullcontext():
            return fn(*args)

    return forced


def _variant_differs(name: str, n: int, device) -> bool:
    """Whether candidate ``name`` runs other kernels than the default for rows of ``n`` on ``device`` (where
    it does not, it would time the default kernel twice)."""
    if name == "rows_once":
        from normscope.kernels import rows_once

        probe = torch.empty(0, device=device)
        return rows_once.fwd_plan(n, probe) is not None or rows_once.bwd_plan(n, probe) is not None
    raise ValueError(f"unknown variant {name!r}; expected one of {VARIANTS}")


def _rows_case(case: str, m: int, n: int, dtype, device, peers: dict, kernels: bool, variants=()):
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
        ours = lambda x, w, b: nf.layer_norm(x, (n,), w, b, EPS)  # noqa: E731
        nbytes = (2 * m * n * e, 5 * m * n * e)
    elif case == "rms_norm":
        inputs = [x, w]
        eager = lambda x, w: F.rms_norm(x, (n,), w, EPS)  # noqa: E731
        ours = lambda x, w: nf.rms_norm(x, (n,), w, EPS)  # noqa: E731
        nbytes = (2 * m * n * e, 5 * m * n * e)
    else:  # add_rms_norm: the unfused peer is "h = x + r; rms_norm(h)"
        r = _randn((m, n), g, device, dtype)
        inputs = [x, r, w]

        def eager(x, r, w):
            h = x + r
            return F.rms_norm(h, (n,), w, EPS), h

        # name the backend: the call fails rather than quietly running something else than the label says
        backend = "triton" if kernels else "reference"
        ours = lambda x, r, w: nf.fused_add_rms_norm(x, r, w, EPS, backend=backend)  # noqa: E731
        ns_label = f"normscope ({backend})"
        nbytes = (4 * m * n * e, 8 * m * n * e)
    impls["normscope"] = _ns(ours, kernels, ("rows", "rows"))  # the default, whatever a pin or a table says
    for name in variants if kernels else ():
        if _variant_differs(name, n, device):
            impls[name] = _ns(ours, kernels, ("rows", name))
    _add_peers(impls, eager, case, peers)
    return inputs, impls, nbytes, (m, n), ns_label, eager, n


def _spatial_case(case: str, shape, dtype, device, peers: dict, kernels: bool):
    g = torch.Generator(device=device).manual_seed(0)
    case, variant = split_case(case)  # the plain case's inputs, eager peer and byte count; the kernel it names
    family = VARIANT_FAMILY[case]
    kernel = (family, variant or default(family))
    c = shape[1] if case != "masked_batch_norm" else shape[-1]
    w = (torch.rand(c, generator=g, device=device) + 0.5).to(dtype)
    b = _randn(c, g, device, dtype)
    impls: dict[str, Callable] = {}
    if case.startswith("group_norm"):
        x = _randn(shape, g, device, dtype)
        if case.endswith("_cl"):
            x = x.contiguous(memory_format=torch.channels_last)
        inputs = [x, w, b]
        eager = lambda x, w, b: F.group_norm(x, GROUPS, w, b, EPS)  # noqa: E731
        impls["normscope"] = _ns(lambda x, w, b: nf.group_norm(x, GROUPS, w, b, EPS), kernels, kernel)
    elif case.startswith("instance_norm"):  # InstanceNorm2d(affine=True): GroupNorm(C, C), one channel a group
        x = _randn(shape, g, device, dtype)
        if case.endswith("_cl"):
            x = x.contiguous(memory_format=torch.channels_last)
        inputs = [x, w, b]
        eager = lambda x, w, b: F.instance_norm(x, weight=w, bias=b, eps=EPS)  # noqa: E731
        impls["normscope"] = _ns(lambda x, w, b: nf.instance_norm(x, weight=w, bias=b, eps=EPS), kernels, kernel)
    elif case.startswith("batch_norm"):
        x = _randn(shape, g, device, dtype)
        if case.endswith("_cl"):
            x = x.contiguous(memory_format=torch.channels_last)
        inputs = [x, w.float(), b.float()]  # cuDNN batch norm wants fp32 parameters with half input
        eager = lambda x, w, b: F.batch_norm(x, None, None, w, b, True, 0.1, EPS)  # noqa: E731
        impls["normscope"] = _ns(lambda x, w, b: nf.batch_norm(x, None, None, w, b, True, 0.1, EPS), kernels, kernel)
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
            lambda x, w, b: nf.normalize(x, keep=-1, weight=w, bias=b, affine_dims=-1, eps=EPS, mask=mask),
            kernels,
            kernel,
        )
    # Liger's GroupNorm runs every GroupNorm(32) case (group_norm_small too); it has no InstanceNorm or BatchNorm
    _add_peers(impls, eager, "group_norm" if case.startswith("group_norm") else case, peers)
    numel, e = math.prod(shape), inputs[0].element_size()
    if case.startswith("group_norm"):
        n = shape[1] // GROUPS * math.prod(shape[2:])
    elif case.startswith("instance_norm"):
        n = math.prod(shape[2:])
    elif case.startswith("batch_norm"):
        n = shape[0] * math.prod(shape[2:])
    else:
        n = int(lengths.sum())  # the valid tokens: the masked positions are not in any scope
    return inputs, impls, (2 * numel * e, 5 * numel * e), tuple(shape), None, eager, n


def _rms(u: torch.Tensor) -> torch.Tensor:
    """RMSNorm without weight as the eager reference codes write it (PolyCom, transformers' Gemma)."""
    return u * torch.rsqrt(u.pow(2).mean(-1, keepdim=True) + EPS)


def _modern_case(case: str, shape: tuple[int, ...], dtype, device, peers: dict, kernels: bool):
    """The modern norms (:mod:`normscope.functional_modern`); torch eager is each one as the models'
    own eager code writes it, in the input dtype. Bytes: x read and y written once (q and k for
    qk_norm) forward, x, dy read and dx written again backward -- the (B, D) modulations, like weights,
    are not counted."""
    g = torch.Generator(device=device).manual_seed(0)
    n = shape[-1]
    x = _randn(shape, g, device, dtype)
    impls: dict[str, Callable] = {}
    numel = x.numel()
    if case.startswith("modulated"):  # AdaLN as DiT writes it: norm without affine, then (1 + scale), shift
        centered = case == "modulated_layer_norm"
        shift, scale = (0.5 * _randn((shape[0], n), g, device, dtype) for _ in range(2))
        inputs = [x, shift, scale]

        def eager(x, shift, scale):
            y = F.layer_norm(x, (n,), None, None, EPS) if centered else F.rms_norm(x, (n,), None, EPS)
            return y * (1 + scale[:, None]) + shift[:, None]

        kind = "layer" if centered else "rms"
        impls["normscope"] = _ns(
            lambda x, shift, scale: fm.modulated_norm(x, shift, scale, eps=EPS, norm=kind), kernels
        )
    elif case == "qk_norm":  # two RMSNorms over head_dim, Qwen3's and Gemma 3's q_norm / k_norm
        k = _randn((*shape[:2], QK_KV_HEADS, n), g, device, dtype)
        wq, wk = ((torch.rand(n, generator=g, device=device) + 0.5).to(dtype) for _ in range(2))
        inputs = [x, k, wq, wk]
        numel += k.numel()
        eager = lambda q, k, wq, wk: (F.rms_norm(q, (n,), wq, EPS), F.rms_norm(k, (n,), wk, EPS))  # noqa: E731
        impls["normscope"] = _ns(lambda q, k, wq, wk: fm.qk_norm(q, k, wq, wk, EPS), kernels)
    elif case == "gemma_rms_norm":  # zero-centred weight: scale 1 + w, everything in fp32, one rounding
        w = (0.1 * torch.randn(n, generator=g, device=device)).to(dtype)
        inputs = [x, w]
        eager = lambda x, w: (_rms(x.float()) * (1.0 + w.float())).type_as(x)  # noqa: E731 - GemmaRMSNorm
        impls["normscope"] = _ns(lambda x, w: fm.rms_norm(x, (n,), w, EPS, weight_offset=1.0, casting="gemma"), kernels)
    elif case == "poly_norm":
        w = (torch.tensor([0.3, 0.5, 0.2], device=device) + 0.1 * torch.rand(3, generator=g, device=device)).to(dtype)
        b = (0.5 * torch.randn(1, generator=g, device=device)).to(dtype)
        inputs = [x, w, b]
        eager = lambda x, w, b: w[0] * _rms(x**3) + w[1] * _rms(x**2) + w[2] * _rms(x) + b  # noqa: E731 - PolyCom's
        impls["normscope"] = _ns(lambda x, w, b: fm.poly_norm(x, w, b, EPS), kernels)
    else:  # derf: gamma * erf(alpha x + s) + beta
        alpha = torch.tensor([0.7], device=device).to(dtype)
        s = torch.tensor([0.1], device=device).to(dtype)
        w = (torch.rand(n, generator=g, device=device) + 0.5).to(dtype)
        b = _randn(n, g, device, dtype)
        inputs = [x, alpha, s, w, b]
        eager = lambda x, a, s, w, b: w * torch.erf(a * x + s) + b  # noqa: E731
        impls["normscope"] = _ns(lambda x, a, s, w, b: fm.derf(x, a, s, w, b), kernels)
    _add_peers(impls, eager, case, peers)
    e = x.element_size()
    return inputs, impls, (2 * numel * e, 5 * numel * e), tuple(shape), None, eager, n


def _add_peers(impls: dict, eager: Callable, case: str, peers: dict) -> None:
    if "torch" in peers:
        impls["torch"] = eager
    if "compile" in peers:
        impls["compile"] = torch.compile(eager, dynamic=False)
    liger = peers.get("liger")
    if liger is not None and case in liger:
        impls["liger"] = liger[case]


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
