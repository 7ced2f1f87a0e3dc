"""One small case of every Triton kernel, forward and backward, for compute-sanitizer's memcheck.

    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck --error-exitcode 9 \
        python3 benchmarks/sanitize_kernels.py

PyTorch's caching allocator hands out slices of larger blocks, where an out-of-bounds access lands in
memory the allocator owns and memcheck sees nothing: ``PYTORCH_NO_CUDA_MEMORY_CACHING=1`` gives every
tensor its own allocation. Sizes are odd (masked lanes, partial tiles), small (the sanitizer slows
every access a hundredfold) and still take each kernel's multi-program paths: the looped rows path
(rows longer than ``kernels.config.ROWS_MAX_FUSED_N``), the channels_last GroupNorm split, BatchNorm's
two-stage reduction. ``TRITON_INTERPRET=1`` (no GPU) runs the same cases in the interpreter, a rehearsal.

The candidate kernels (kernels/variants.py, off by default) are forced here, each case's label starting
with the variant's name: ``rows_once`` (one row a program, and rows split over programs that synchronise),
``split`` (the split BatchNorm: NCHW, channels_last, masked, evaluation), ``onchip`` (GroupNorm /
InstanceNorm with the group on chip, both layouts). ``SANITIZE_ONLY=rows_once`` or
``SANITIZE_ONLY=split,onchip`` (comma-separated substrings of the labels) runs only the matching cases.
"""

import os
import sys
import time

import torch

import normscope
from normscope import functional as nf
from normscope import functional_modern as fm

DEV = torch.device("cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu")
INTERPRETED = DEV.type == "cpu"
g = torch.Generator().manual_seed(0)


def rand(*shape, dtype=torch.float32, grad=True):
    return torch.randn(shape, generator=g).to(DEV, dtype).requires_grad_(grad)


#: ``SANITIZE_ONLY=rows_once`` or ``SANITIZE_ONLY=split,onchip``: run only the cases whose label holds one of
#: the words (a device call's time is short: benchmarks/gpu_check.sh passes GPU_CHECK_SANITIZE_ONLY)
ONLY = [w for w in os.environ.get("SANITIZE_ONLY", "").split(",") if w]


def case(label, fn, *inputs):
    if ONLY and not any(w in label for w in ONLY):
        return
    t = time.time()
    with normscope.use_backend("triton"):
        out = fn(*inputs)
        backend = normscope.last_backend()
    outs = out if isinstance(out, tuple) else (out,)
    loss = sum((o.float() * torch.randn(o.shape, generator=g).to(DEV)).sum() for o in outs)
    grads = torch.autograd.grad(loss, [i for i in inputs if isinstance(i, torch.Tensor) and i.requires_grad])
    if DEV.type == "cuda":
        torch.cuda.synchronize()
    finite = all(torch.isfinite(t_).all() for t_ in (*outs, *grads))
    print(f"{label:44s} backend={backend:8s} finite={finite} {time.time() - t:.1f}s", flush=True)
    if backend != "triton" or not finite:
        sys.exit(f"{label}: expected the Triton backend and finite outputs")


n_long = 20000 if not INTERPRETED else 40  # past ROWS_MAX_FUSED_N on the GPU; the interpreter shrinks it
from normscope.kernels import config as KC  # noqa: E402

fused_n = KC.ROWS_MAX_FUSED_N
for dt in (torch.float32, torch.bfloat16):
    d = str(dt).split(".")[-1]
    for n in (300, n_long):
        KC.ROWS_MAX_FUSED_N = 32 if INTERPRETED and n == n_long else fused_n
        case(
            f"layer_norm {d} 37x{n}",
            lambda x, w, b, n=n: nf.layer_norm(x, (n,), w, b),
            rand(37, n, dtype=dt),
            rand(n, dtype=dt),
            rand(n, dtype=dt),
        )
        case(
            f"rms_norm {d} 37x{n}", lambda x, w, n=n: nf.rms_norm(x, (n,), w), rand(37, n, dtype=dt), rand(n, dtype=dt)
        )
    KC.ROWS_MAX_FUSED_N = fused_n
    case(
        f"fused_add_rms_norm {d} 37x300",
        lambda x, r, w: nf.fused_add_rms_norm(x, r, w),
        rand(37, 300, dtype=dt),
        rand(37, 300, dtype=dt),
        rand(300, dtype=dt),
    )
    x = rand(3, 24, 9, 7, dtype=dt)
    case(
        f"group_norm {d} NCHW 3x24x9x7 G=6",
        lambda x, w, b: nf.group_norm(x, 6, w, b),
        x,
        rand(24, dtype=dt),
        rand(24, dtype=dt),
    )
    hw = 64 if not INTERPRETED else 8
    xc = rand(2, 64, hw, hw + 3, dtype=dt, grad=False).contiguous(memory_format=torch.channels_last).requires_grad_()
    case(
        f"group_norm {d} channels_last 2x64x{hw}x{hw + 3} G=32",
        lambda x, w, b: nf.group_norm(x, 32, w, b),
        xc,
        rand(64, dtype=dt),
        rand(64, dtype=dt),
    )
    case(
        f"instance_norm {d} 3x24x9x7",
        lambda x, w, b: nf.instance_norm(x, weight=w, bias=b),
        rand(3, 24, 9, 7, dtype=dt),
        rand(24, dtype=dt),
        rand(24, dtype=dt),
    )
    rm, rv = torch.zeros(24, device=DEV), torch.ones(24, device=DEV)
    case(
        f"batch_norm train {d} 5x24x9x7",
        lambda x, w, b, rm=rm, rv=rv: nf.batch_norm(x, rm, rv, w, b, True),
        rand(5, 24, 9, 7, dtype=dt),
        rand(24),
        rand(24),
    )
    case(
        f"batch_norm eval {d} 5x24x9x7",
        lambda x, w, b, rm=rm, rv=rv: nf.batch_norm(x, rm, rv, w, b, False),
        rand(5, 24, 9, 7, dtype=dt),
        rand(24),
        rand(24),
    )
    mask = (torch.arange(33)[None, :] < torch.tensor([[33], [20], [1]]))[..., None].to(DEV)
    case(
        f"masked batch_norm {d} 3x33x40",
        lambda x, w, b, m=mask: nf.normalize(x, keep=-1, weight=w, bias=b, affine_dims=-1, mask=m),
        rand(3, 33, 40, dtype=dt),
        rand(40, dtype=dt),
        rand(40, dtype=dt),
    )
    case(
        f"modulated_norm {d} 3x17x300",
        lambda x, sh, sc, w, b: fm.modulated_norm(x, sh, sc, w, b, norm="layer"),
        rand(3, 17, 300, dtype=dt),
        rand(3, 300, dtype=dt),
        rand(3, 300, dtype=dt),
        rand(300, dtype=dt),
        rand(300, dtype=dt),
    )
    case(
        f"qk_norm {d} q 2x9x8x128 k 2x9x2x128",
        lambda q, k, w: fm.qk_norm(q, k, w),
        rand(2, 9, 8, 128, dtype=dt),
        rand(2, 9, 2, 128, dtype=dt),
        rand(128, dtype=dt),
    )
    case(
        f"gemma rms_norm {d} 37x300",
        lambda x, w: fm.rms_norm(x, (300,), w, 1e-6, weight_offset=1.0, casting="gemma"),
        rand(37, 300, dtype=dt),
        rand(300, dtype=dt),
    )
    case(
        f"poly_norm {d} 37x300",
        lambda x, w, b: fm.poly_norm(x, w, b),
        rand(37, 300, dtype=dt),
        rand(3, dtype=dt),
        rand(1, dtype=dt),
    )
    case(
        f"derf {d} 37x300",
        lambda x, a, s, w, b: fm.derf(x, a, s, w, b),
        rand(37, 300, dtype=dt),
        rand(1, dtype=dt),
        rand(1, dtype=dt),
        rand(300, dtype=dt),
        rand(300, dtype=dt),
    )

# the candidate kernels (normscope.kernels.variants), forced with use_variant; their labels start with the
# variant's name (rows_once, split, onchip: GPU_CHECK_SANITIZE_ONLY selects them). The read-once rows kernels:
# a row read whole by one program (20000: past ROWS_MAX_FUSED_N), and rows split over programs that meet on
# their partial sums (40000: 5 forward chunks, 10 backward)
from normscope.kernels import variants  # noqa: E402

if INTERPRETED:  # shrink the settings so that tiny rows take the same paths
    KC.ROWS_MAX_FUSED_N, KC.ROWS_ONCE_MAX_N, KC.ROWS_ONCE_FWD_CHUNK, KC.ROWS_ONCE_BWD_CHUNK = 8, 16, 16, 8
for dt in (torch.float32, torch.bfloat16):
    d = str(dt).split(".")[-1]
    for n in (20000, 40000) if not INTERPRETED else (13, 40):
        with variants.use_variant("rows", "rows_once"):
            case(
                f"rows_once layer_norm {d} 37x{n}",
                lambda x, w, b, n=n: nf.layer_norm(x, (n,), w, b),
                rand(37, n, dtype=dt),
                rand(n, dtype=dt),
                rand(n, dtype=dt),
            )
            case(
                f"rows_once fused_add_rms_norm {d} 37x{n}",
                lambda x, r, w: nf.fused_add_rms_norm(x, r, w),
                rand(37, n, dtype=dt),
                rand(37, n, dtype=dt),
                rand(n, dtype=dt),
            )
if INTERPRETED:
    KC.ROWS_MAX_FUSED_N = fused_n


# the split BatchNorm on NCHW (several splits of partial tiles), on channels_last read in place (channels
# fewer than a tile row), masked and in evaluation; the on-chip GroupNorm / InstanceNorm in both layouts
def _cl(*shape, dtype):
    return rand(*shape, dtype=dtype, grad=False).contiguous(memory_format=torch.channels_last).requires_grad_()


for dt in (torch.float32, torch.bfloat16):
    d = str(dt).split(".")[-1]
    with variants.use_variant("channels", "split"):
        rm, rv = torch.zeros(24, device=DEV), torch.ones(24, device=DEV)
        shape = (3, 24, 9, 13) if INTERPRETED else (8, 24, 33, 65)
        name = "x".join(map(str, shape))
        for training in (True, False):
            case(
                f"split batch_norm {'train' if training else 'eval'} {d} NCHW {name}",
                lambda x, w, b, rm=rm, rv=rv, t=training: nf.batch_norm(x, rm, rv, w, b, t),
                rand(*shape, dtype=dt),
                rand(24),
                rand(24),
            )
        shape = (2, 24, 5, 7) if INTERPRETED else (4, 24, 17, 19)
        case(
            f"split batch_norm train {d} channels_last {'x'.join(map(str, shape))}",
            lambda x, w, b: nf.batch_norm(x, None, None, w, b, True),
            _cl(*shape, dtype=dt),
            rand(24),
            rand(24),
        )
        s_ = 33 if INTERPRETED else 300
        mask = (torch.arange(s_)[None, :] < torch.tensor([[s_], [s_ // 2], [1]]))[..., None].to(DEV)
        case(
            f"split masked batch_norm {d} 3x{s_}x40",
            lambda x, w, b, m=mask: nf.normalize(x, keep=-1, weight=w, bias=b, affine_dims=-1, mask=m),
            rand(3, s_, 40, dtype=dt),
            rand(40, dtype=dt),
            rand(40, dtype=dt),
        )
    with variants.use_variant("groups", "onchip"):
        case(
            f"onchip group_norm {d} NCHW 3x24x9x7 G=6",
            lambda x, w, b: nf.group_norm(x, 6, w, b),
            rand(3, 24, 9, 7, dtype=dt),
            rand(24, dtype=dt),
            rand(24, dtype=dt),
        )
        hw = 11 if not INTERPRETED else 5
        case(
            f"onchip group_norm {d} channels_last 2x64x{hw}x{hw + 3} G=32",
            lambda x, w, b: nf.group_norm(x, 32, w, b),
            _cl(2, 64, hw, hw + 3, dtype=dt),
            rand(64, dtype=dt),
            rand(64, dtype=dt),
        )
        case(
            f"onchip instance_norm {d} channels_last 3x24x9x7",
            lambda x, w, b: nf.instance_norm(x, weight=w, bias=b),
            _cl(3, 24, 9, 7, dtype=dt),
            rand(24, dtype=dt),
            rand(24, dtype=dt),
        )
if DEV.type == "cuda":
    from normscope.kernels import rows_once  # noqa: E402

    if rows_once.timeouts(DEV):
        sys.exit(f"rows_once: {rows_once.timeouts(DEV)} programs gave up waiting for the others of their row")
print("sanitize_kernels: every case ran" + (f" (matching {','.join(ONLY)!r})" if ONLY else ""))
