"""Lower every Triton kernel specialisation to an sm_90 cubin with Triton's own compiler -- no GPU needed.

The CPU tests run the kernels in Triton's interpreter, which is more lenient than the compiler
(loop-carried types, scalar stores, constexpr branches); this catches what only compiling would.

    PYTHONPATH=src python benchmarks/compile_check.py          # about a minute or two

    PYTHONPATH=src python benchmarks/compile_check.py --only rows_once,split,onchip   # the candidates only

The candidate kernels (kernels/variants.py) -- the read-once rows kernels (kernels/rows_once.py), the
split BatchNorm (kernels/channels_split.py), the on-chip GroupNorm / InstanceNorm
(kernels/groups_onchip.py) -- are lowered at the settings they launch with (block, tile, warps and launch
options from kernels/config.py, the rows kernels' cooperative launch included), and for each the registers
and spill bytes ptxas reports for sm_90 are printed (``regs=64 spill=0``), with one summary line a family
before the total: what their settings were chosen by, and a check that a changed setting or kernel does
not start spilling. ``--only WORD[,WORD...]`` lowers only the specialisations whose label holds a word.
"""

import itertools
import os
import re
import subprocess
import sys
import tempfile
import time

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from normscope.kernels import channels as CH
from normscope.kernels import config as KC
from normscope.kernels import groups as G
from normscope.kernels import modern as MK
from normscope.kernels import rows as R
from normscope.kernels import rows_once as RO

TARGET = GPUTarget("cuda", 90, 32)
#: the BatchNorm kernels' tile as launched (kernels/config.py) for C >= CHANNELS_MAX_BLOCK_C channels
BP, BC = KC.CHANNELS_BLOCK_P, KC.CHANNELS_MAX_BLOCK_C
failures = 0
#: ``--only WORD[,WORD...]``: compile only the specialisations whose label holds one of the words
#: (e.g. ``--only rows_once,split,onchip``: the candidate kernels)
ONLY = sys.argv[sys.argv.index("--only") + 1].split(",") if "--only" in sys.argv else None
#: (label, registers, spill bytes) of every kernel lowered with stats=True
resources = []


def _ptxas() -> str | None:
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        return get_ptxas(90).path
    except (ImportError, AttributeError, TypeError, RuntimeError):
        path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
        return path if os.path.exists(path) else None


def ptxas_stats(compiled) -> tuple[int, int] | None:
    """(registers a thread, spill-store bytes) ptxas reports for the kernel's PTX on sm_90a, or None."""
    ptxas = _ptxas()
    if ptxas is None:
        return None
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(compiled.asm["ptx"])
    try:
        out = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", f.name, "-o", os.devnull],
                             capture_output=True, text=True, check=False).stderr  # fmt: skip
    finally:
        os.unlink(f.name)
    regs, spill = re.search(r"Used (\d+) registers", out), re.search(r"(\d+) bytes spill stores", out)
    return (int(regs.group(1)), int(spill.group(1))) if regs and spill else None


def check(fn, sig, consts, label, options=None, stats=False):
    """Compile one specialisation (``options``: Triton's, default 4 warps); ``stats``: also print and
    keep the registers and spills ptxas reports for it."""
    global failures
    if ONLY is not None and not any(w in label for w in ONLY):
        return
    t = time.time()
    try:
        compiled = triton.compile(ASTSource(fn, sig, consts), target=TARGET, options=options or {"num_warps": 4})
        extra = ""
        if stats:
            found = ptxas_stats(compiled)
            if found is not None:
                resources.append((label, *found))
                extra = f" regs={found[0]} spill={found[1]}"
        print(f"ok   {label}{extra} ({time.time() - t:.1f}s)")
    except Exception as exc:  # noqa: BLE001
        failures += 1
        print(f"FAIL {label}: {type(exc).__name__}: {str(exc)[:2000]}")


def const(names, values):
    return {n: "constexpr" for n in names}, dict(zip(names, values))


# signatures packed several keys a line, easier to compare with the kernels than one key a line
# fmt: off
for dt in ("fp32", "bf16"):
    p = "*" + dt
    for looped, centered, has_w, has_b, has_r in itertools.product([False, True], repeat=5):
        bm, bn = (1, 1024) if looped else (4, 1024)
        names = ("BLOCK_M", "BLOCK_N", "LOOPED", "CENTERED", "HAS_WEIGHT", "HAS_BIAS", "HAS_RESIDUAL")
        csig, cval = const(names, (bm, bn, looped, centered, has_w, has_b, has_r))
        sig = {"X": p, "R": p, "W": p, "B": p, "Y": p, "RES": p, "MEAN": "*fp32", "RSTD": "*fp32",
               "stride_x": "i32", "stride_r": "i32", "stride_y": "i32", "stride_res": "i32",
               "M": "i32", "N": "i32", "eps": "fp32", "w_offset": "fp32", **csig}
        check(R._rows_fwd_kernel, sig, cval, f"rows fwd {dt} {cval}")
        if has_r:
            continue
        for has_d in (False, True):
            names = ("BLOCK_M", "BLOCK_N", "LOOPED", "CENTERED", "HAS_WEIGHT", "HAS_BIAS", "HAS_DRES")
            csig, cval = const(names, (bm, bn, looped, centered, has_w, has_b, has_d))
            sig = {"DY": p, "DRES": p, "X": p, "W": p, "MEAN": "*fp32", "RSTD": "*fp32", "DX": p,
                   "DW": "*fp32", "DB": "*fp32", "stride_dy": "i32", "stride_dres": "i32", "stride_x": "i32",
                   "stride_dx": "i32", "M": "i32", "N": "i32", "w_offset": "fp32", "rows_per_prog": "i32", **csig}
            check(R._rows_bwd_kernel, sig, cval, f"rows bwd {dt} {cval}")
    for centered, has_w, has_b in itertools.product([False, True], repeat=3):
        names = ("BLOCK_C", "BLOCK_S", "CENTERED", "HAS_WEIGHT", "HAS_BIAS")
        csig, cval = const(names, (4, 256, centered, has_w, has_b))
        sig = {"X": p, "W": p, "B": p, "Y": p, "MEAN": "*fp32", "RSTD": "*fp32",
               "G": "i32", "Cg": "i32", "HW": "i32", "eps": "fp32", **csig}
        check(G._groups_fwd_kernel, sig, cval, f"groups fwd {dt} {cval}")
        sig = {"DY": p, "X": p, "W": p, "MEAN": "*fp32", "RSTD": "*fp32", "DX": p, "DWP": "*fp32", "DBP": "*fp32",
               "G": "i32", "Cg": "i32", "HW": "i32", **csig}
        check(G._groups_bwd_kernel, sig, cval, f"groups bwd {dt} {cval}")
        # channels_last tiles (BLOCK_S, BLOCK_G, BLOCK_C): 4 groups of 16 channels for every flag; the
        # InstanceNorm shape (64 groups of 1) and one wide group (1 of 64) with all flags set and the most
        # splits _cl_config allows them (BLOCK_P: min(GROUPS_CL_PROGRAMS, GROUPS_CL_TILE // BLOCK_G)); and
        # the tiny tiles of tests/kernels/test_kernels_groups_cl.py, which NORMSCOPE_TEST_DEVICE=cuda runs compiled
        dims = {"G": "i32", "C": "i32", "Cg": "i32", "HW": "i32", "chunk": "i32", "splits": "i32"}
        blocks = ("BLOCK_S", "BLOCK_G", "BLOCK_C")
        for tile in ((32, 4, 16), (32, 64, 1), (32, 1, 64), (2, 2, 2), (2, 4, 1), (2, 1, 4)):
            if tile != (32, 4, 16) and not (centered and has_w and has_b):
                continue
            if (not has_w and not has_b) or tile != (32, 4, 16):  # the statistics kernel has no affine flags
                csig, cval = const((*blocks, "CENTERED"), (*tile, centered))
                sig = {"X": p, "PMEAN": "*fp32", "PM2": "*fp32", **dims, **csig}
                check(G._groups_cl_stats_kernel, sig, cval, f"groups cl stats {dt} {cval}")
            names = (*blocks, "BLOCK_P", "CENTERED", "HAS_WEIGHT", "HAS_BIAS")
            bp = 8 if tile == (32, 4, 16) else min(KC.GROUPS_CL_PROGRAMS, KC.GROUPS_CL_TILE // tile[1])
            csig, cval = const(names, (*tile, bp, centered, has_w, has_b))
            sig = {"X": p, "W": p, "B": p, "Y": p, "PMEAN": "*fp32", "PM2": "*fp32", "MEAN": "*fp32", "RSTD": "*fp32",
                   **dims, "eps": "fp32", **csig}
            check(G._groups_cl_apply_kernel, sig, cval, f"groups cl apply {dt} {cval}")
            csig, cval = const((*blocks, "CENTERED", "HAS_WEIGHT", "HAS_BIAS"), (*tile, centered, has_w, has_b))
            sig = {"DY": p, "X": p, "W": p, "MEAN": "*fp32", "RSTD": "*fp32", "PC1": "*fp32", "PC2": "*fp32",
                   "DWP": "*fp32", "DBP": "*fp32", **dims, **csig}
            check(G._groups_cl_bwd_sums_kernel, sig, cval, f"groups cl bwd sums {dt} {cval}")
            if not has_b or tile != (32, 4, 16):  # dx does not depend on the bias
                csig, cval = const((*blocks, "BLOCK_P", "CENTERED", "HAS_WEIGHT"), (*tile, bp, centered, has_w))
                sig = {"DY": p, "X": p, "W": p, "MEAN": "*fp32", "RSTD": "*fp32", "PC1": "*fp32", "PC2": "*fp32",
                       "DX": p, **dims, **csig}
                check(G._groups_cl_bwd_dx_kernel, sig, cval, f"groups cl bwd dx {dt} {cval}")

    for has_m in (False, True):
        csig, cval = const(("BLOCK_P", "BLOCK_C", "HAS_MASK"), (BP, BC, has_m))
        sig = {"X": p, "MASK": "*u8", "FIRST": "*i64", "PMEAN": "*fp32", "PM2": "*fp32", "PCNT": "*fp32",
               "C": "i32", "inner": "i32", "P": "i32", "chunk": "i32", **csig}
        check(CH._stats_kernel, sig, cval, f"channels stats {dt} {cval}")
    for has_m in (False, True):  # MASK and HAS_MASK: Triton 3.9 refuses a signature without them
        csig, cval = const(("BLOCK_P", "BLOCK_C", "HAS_MASK"), (BP, BC, has_m))
        sig = {"DY": p, "X": p, "MASK": "*u8", "MEAN": "*fp32", "RSTD": "*fp32", "PSDY": "*fp32", "PSDYX": "*fp32",
               "C": "i32", "inner": "i32", "P": "i32", "chunk": "i32", **csig}
        check(CH._bwd_sums_kernel, sig, cval, f"channels bwd sums {dt} {cval}")
    for has_w, has_b in itertools.product([False, True], repeat=2):
        csig, cval = const(("BLOCK_P", "BLOCK_C", "HAS_WEIGHT", "HAS_BIAS"), (BP, BC, has_w, has_b))
        sig = {"X": p, "Y": p, "MEAN": "*fp32", "RSTD": "*fp32", "W": "*fp32", "B": "*fp32",
               "C": "i32", "inner": "i32", "P": "i32", **csig}
        check(CH._apply_kernel, sig, cval, f"channels apply {dt} {cval}")
    for has_w, training, has_m in itertools.product([False, True], repeat=3):
        names = ("BLOCK_P", "BLOCK_C", "HAS_WEIGHT", "TRAINING", "HAS_MASK")
        csig, cval = const(names, (BP, BC, has_w, training, has_m))
        sig = {"DY": p, "X": p, "MASK": "*u8", "MEAN": "*fp32", "RSTD": "*fp32", "W": "*fp32", "SDY": "*fp32",
               "SDYX": "*fp32", "DX": p, "COUNT": "*fp32", "C": "i32", "inner": "i32", "P": "i32", **csig}
        check(CH._bwd_dx_kernel, sig, cval, f"channels bwd dx {dt} {cval}")

    # the modern row kernels (kernels/modern.py), built from the rows body of kernels/_rowbody.py
    bm, bn = 4, 1024
    for centered, affine, mod in itertools.product([False, True], repeat=3):
        names = ("BLOCK_M", "BLOCK_N", "CENTERED", "HAS_WEIGHT", "HAS_BIAS", "HAS_SHIFT", "HAS_SCALE")
        csig, cval = const(names, (bm, bn, centered, affine, affine, mod, mod))
        sig = {"X": p, "W": p, "B": p, "SHIFT": p, "SCALE": p, "Y": p, "MEAN": "*fp32", "RSTD": "*fp32",
               "stride_x": "i32", "stride_y": "i32", "stride_shift": "i32", "stride_scale": "i32",
               "M": "i32", "N": "i32", "per_shift": "i32", "per_scale": "i32", "eps": "fp32", **csig}
        check(MK._mod_fwd_kernel, sig, cval, f"modulated fwd {dt} {cval}")
        names = ("BLOCK_M", "BLOCK_N", "CENTERED", "HAS_WEIGHT", "HAS_BIAS", "HAS_SCALE")
        csig, cval = const(names, (bm, bn, centered, affine, affine, mod))
        sig = {"DY": p, "X": p, "W": p, "B": p, "SCALE": p, "MEAN": "*fp32", "RSTD": "*fp32", "DX": p,
               "DW": "*fp32", "DB": "*fp32", "DSC": "*fp32", "stride_dy": "i32", "stride_x": "i32",
               "stride_scale": "i32", "stride_dx": "i32", "M": "i32", "N": "i32", "per_scale": "i32",
               "rows_per_prog": "i32", **csig}
        check(MK._mod_bwd_kernel, sig, cval, f"modulated bwd {dt} {cval}")
        names = ("BLOCK_M", "BLOCK_N", "CENTERED", "HAS_WQ", "HAS_WK", "HAS_BQ", "HAS_BK")
        csig, cval = const(names, (bm, bn, centered, affine, mod, mod, affine))
        sig = {"Q": p, "K": p, "WQ": p, "WK": p, "BQ": p, "BK": p, "YQ": p, "YK": p, "MEANQ": "*fp32",
               "RSTDQ": "*fp32", "MEANK": "*fp32", "RSTDK": "*fp32", "stride_q": "i32", "stride_k": "i32",
               "stride_yq": "i32", "stride_yk": "i32", "Mq": "i32", "Mk": "i32", "N": "i32", "eps": "fp32",
               "w_offset": "fp32", "q_blocks": "i32", **csig}
        check(MK._qk_fwd_kernel, sig, cval, f"qk fwd {dt} {cval}")
    csig, cval = const(("BLOCK_M", "BLOCK_N"), (bm, bn))
    sig = {"X": p, "W": p, "B": p, "Y": p, "RSTD": "*fp32", "stride_x": "i32", "stride_y": "i32", "M": "i32",
           "N": "i32", "eps": "fp32", **csig}
    check(MK._poly_fwd_kernel, sig, cval, f"poly fwd {dt}")
    sig = {"DY": p, "X": p, "W": p, "RSTD": "*fp32", "DX": p, "DWB": "*fp32", "stride_dy": "i32",
           "stride_x": "i32", "stride_dx": "i32", "M": "i32", "N": "i32", "rows_per_prog": "i32", **csig}
    check(MK._poly_bwd_kernel, sig, cval, f"poly bwd {dt}")
    for has_w in (False, True):
        csig, cval = const(("BLOCK_M", "BLOCK_N", "HAS_WEIGHT"), (bm, bn, has_w))
        sig = {"X": p, "A": p, "S": p, "W": p, "B": p, "Y": p, "stride_x": "i32", "stride_y": "i32",
               "M": "i32", "N": "i32", **csig}
        check(MK._derf_fwd_kernel, sig, cval, f"derf fwd {dt} {cval}")
        sig = {"DY": p, "X": p, "A": p, "S": p, "W": p, "DX": p, "DWB": "*fp32", "DAS": "*fp32",
               "stride_dy": "i32", "stride_x": "i32", "stride_dx": "i32", "M": "i32", "N": "i32",
               "rows_per_prog": "i32", **csig}
        check(MK._derf_bwd_kernel, sig, cval, f"derf bwd {dt} {cval}")

    # the read-once rows candidates (kernels/rows_once.py) at the settings they launch with: the one-row
    # forward, the split forward and backward synchronised (every flag; a cooperative launch where this
    # Triton has one), and the two-launch modes of the interpreter and of config.ROWS_ONCE_TWO_PHASE
    fwd_sig = {"X": p, "R": p, "W": p, "B": p, "Y": p, "RES": p, "MEAN": "*fp32", "RSTD": "*fp32", "PART": "*fp32",
               "CNT": "*i32", "ERR": "*i32", "stride_x": "i32", "stride_r": "i32", "stride_y": "i32",
               "stride_res": "i32", "M": "i32", "N": "i32", "S": "i32", "G": "i32", "eps": "fp32",
               "w_offset": "fp32", "max_spins": "i32"}
    bwd_sig = {"DY": p, "DRES": p, "X": p, "W": p, "MEAN": "*fp32", "RSTD": "*fp32", "DX": p, "DW": "*fp32",
               "DB": "*fp32", "PART": "*fp32", "CNT": "*i32", "ERR": "*i32", "stride_dy": "i32",
               "stride_dres": "i32", "stride_x": "i32", "stride_dx": "i32", "M": "i32", "N": "i32", "S": "i32",
               "G": "i32", "w_offset": "fp32", "max_spins": "i32"}
    s_block = 32  # partials of up to 32 chunks (a 256K row: 32 forward chunks of 8K)
    one = (KC.ROWS_ONCE_MAX_N, 1, RO.ONE.value, KC.ROWS_ONCE_WARPS, False)
    modes = {
        "one": one,
        "sync": (KC.ROWS_ONCE_FWD_CHUNK, s_block, RO.SYNC.value, KC.ROWS_ONCE_SPLIT_WARPS, True),
        "partials": (KC.ROWS_ONCE_FWD_CHUNK, s_block, RO.PARTIALS.value, KC.ROWS_ONCE_SPLIT_WARPS, False),
        "finish": (KC.ROWS_ONCE_FWD_CHUNK, s_block, RO.FINISH.value, KC.ROWS_ONCE_SPLIT_WARPS, False),
    }
    for kind, (bn, sb, mode, warps, split) in modes.items():
        for centered, has_w, has_b, has_r in itertools.product([False, True], repeat=4):
            if kind in ("partials", "finish") and not (centered and has_w and has_b):
                continue  # the two-launch modes: tests on a GPU only; every flag of the arithmetic is in "sync"
            names = ("BLOCK_N", "S_BLOCK", "MODE", "CENTERED", "HAS_WEIGHT", "HAS_BIAS", "HAS_RESIDUAL")
            csig, cval = const(names, (bn, sb, mode, centered, has_w, has_b, has_r))
            check(RO._once_fwd_kernel, {**fwd_sig, **csig}, cval, f"rows_once fwd {kind} {dt} {cval} warps={warps}",
                  RO._launch_options(warps, split), stats=True)  # fmt: skip
    bwd_chunk = KC.ROWS_ONCE_BWD_CHUNK
    modes = {
        "one": (bwd_chunk, 1, RO.ONE.value, False),
        "sync": (bwd_chunk, 2 * s_block, RO.SYNC.value, True),  # 64 chunks of 4K: a 256K row
        "partials": (bwd_chunk, 2 * s_block, RO.PARTIALS.value, False),
        "finish": (bwd_chunk, 2 * s_block, RO.FINISH.value, False),
    }
    for kind, (bn, sb, mode, split) in modes.items():
        for centered, has_w, has_b, has_d in itertools.product([False, True], repeat=4):
            if kind != "sync" and not (centered and has_w and has_b):
                continue
            names = ("BLOCK_N", "S_BLOCK", "MODE", "CENTERED", "HAS_WEIGHT", "HAS_BIAS", "HAS_DRES")
            csig, cval = const(names, (bn, sb, mode, centered, has_w, has_b, has_d))
            warps = KC.ROWS_ONCE_BWD_WARPS
            check(RO._once_bwd_kernel, {**bwd_sig, **csig}, cval, f"rows_once bwd {kind} {dt} {cval} warps={warps}",
                  RO._launch_options(warps, split), stats=True)  # fmt: skip
# fmt: on

# the candidate kernels (kernels/variants.py): the split BatchNorm (kernels/channels_split.py) at the tiles
# its defaults launch -- channels innermost: (TILE / BLOCK_C positions, BLOCK_C channels); NCHW: (TILE /
# BLOCK_I rows, BLOCK_I columns) -- with its warps, registers and spills printed; and the tiny tiles of
# tests/kernels/test_kernels_variants.py, which NORMSCOPE_TEST_DEVICE=cuda runs compiled
from normscope.kernels import channels_split as CS  # noqa: E402

SW = KC.CHANNELS_SPLIT_WARPS
split_tiles = {
    "cols": [(KC.CHANNELS_SPLIT_TILE // KC.CHANNELS_SPLIT_BLOCK_C, KC.CHANNELS_SPLIT_BLOCK_C), (2, 4)],
    "rows": [(KC.CHANNELS_SPLIT_TILE // KC.CHANNELS_SPLIT_BLOCK_I, KC.CHANNELS_SPLIT_BLOCK_I), (4, 2)],
}
# fmt: off
for dt in ("fp32", "bf16"):
    p = "*" + dt
    for view, tiles in split_tiles.items():
        kern = [getattr(CS, f"_{view}_{k}_kernel") for k in ("stats", "apply", "bwd_sums", "bwd_dx")]
        blocks = ("BLOCK_P", "BLOCK_C") if view == "cols" else ("BLOCK_O", "BLOCK_I")
        dims = ({"C": "i32", "P": "i32", "chunk": "i32"} if view == "cols" else
                {"C": "i32", "outer": "i32", "inner": "i32", "tiles_i": "i32", "tiles": "i32", "per": "i32"})
        for tile in tiles:
            real = tile == tiles[0]  # the default launch: every flag, registers printed
            bs = KC.CHANNELS_SPLIT_MAX if real else 16
            for has_m in (False, True):
                csig, cval = const((*blocks, "HAS_MASK"), (*tile, has_m))
                sig = {"X": p, "MASK": "*u8", "PK": "*fp32", "PMEAN": "*fp32", "PM2": "*fp32", "PCNT": "*fp32",
                       **dims, **csig}
                check(kern[0], sig, cval, f"split {view} stats {dt} {cval}", {"num_warps": SW}, real)
                sig = {"DY": p, "X": p, "MASK": "*u8", "MEAN": "*fp32", "RSTD": "*fp32", "PSDY": "*fp32",
                       "PSDYX": "*fp32", **dims, **csig}
                check(kern[2], sig, cval, f"split {view} bwd sums {dt} {cval}", {"num_warps": SW}, real)
            for has_w, has_b, stats in itertools.product([False, True], repeat=3):
                if not real and not (has_w and has_b):
                    continue
                names = (*blocks, "BLOCK_S", "HAS_WEIGHT", "HAS_BIAS", "STATS")
                csig, cval = const(names, (*tile, bs, has_w, has_b, stats))
                sig = {"X": p, "Y": p, "PK": "*fp32", "PMEAN": "*fp32", "PM2": "*fp32", "PCNT": "*fp32", "W": p, "B": p,
                       "MEAN": "*fp32", "VAR": "*fp32", "RSTD": "*fp32", "COUNT": "*fp32", **dims, "splits": "i32",
                       "eps": "fp32", **csig}
                check(kern[1], sig, cval, f"split {view} apply {dt} {cval}", {"num_warps": SW},
                      real and has_w and has_b)
            for has_w, training, has_m in itertools.product([False, True], repeat=3):
                if not real and not (has_w and training):
                    continue
                names = (*blocks, "BLOCK_S", "HAS_WEIGHT", "TRAINING", "HAS_MASK")
                csig, cval = const(names, (*tile, bs, has_w, training, has_m))
                sig = {"DY": p, "X": p, "MASK": "*u8", "MEAN": "*fp32", "RSTD": "*fp32", "W": p, "PSDY": "*fp32",
                       "PSDYX": "*fp32", "DX": p, "DW": "*fp32", "DB": "*fp32", "COUNT": "*fp32", **dims,
                       "splits": "i32", **csig}
                check(kern[3], sig, cval, f"split {view} bwd dx {dt} {cval}", {"num_warps": SW},
                      real and has_w and training)
# fmt: on

# the on-chip GroupNorm / InstanceNorm (kernels/groups_onchip.py) at the tiles of the bench's candidate cases
# (GroupNorm(32) on 256 x 28 x 28, InstanceNorm on 256 x 56 x 56, both layouts), registers and spills printed,
# and at tiny tiles (the tests'); the tile and warps as groups_onchip.tiles gives them
from normscope.kernels import groups_onchip as GO  # noqa: E402

onchip_cases = {False: [(32, 8, 784), (256, 1, 3136), (2, 2, 3)], True: [(32, 8, 784), (256, 1, 3136), (3, 2, 5)]}
# fmt: off
for dt in ("fp32", "bf16"):
    p = "*" + dt
    for cl, cases in onchip_cases.items():
        for groups, cg, hw in cases:
            bs, bg, bc, warps = GO.tiles(groups, cg, hw, cl)
            real = hw > 8
            for centered, has_w, has_b in itertools.product([False, True], repeat=3):
                if not real and not (has_w and has_b):
                    continue
                show = real and centered and has_w and has_b
                label = f"onchip {'cl' if cl else 'nchw'} G={groups} Cg={cg} HW={hw} {dt} warps={warps}"
                if cl:
                    names = ("BLOCK_S", "BLOCK_G", "BLOCK_C", "CENTERED", "HAS_WEIGHT", "HAS_BIAS")
                    csig, cval = const(names, (bs, bg, bc, centered, has_w, has_b))
                    dims = {"G": "i32", "C": "i32", "Cg": "i32", "HW": "i32"}
                    fwd, bwd = GO._cl_fwd_kernel, GO._cl_bwd_kernel
                else:
                    names = ("BLOCK_C", "BLOCK_S", "CENTERED", "HAS_WEIGHT", "HAS_BIAS")
                    csig, cval = const(names, (bc, bs, centered, has_w, has_b))
                    dims = {"G": "i32", "Cg": "i32", "HW": "i32"}
                    fwd, bwd = GO._nchw_fwd_kernel, GO._nchw_bwd_kernel
                sig = {"X": p, "W": p, "B": p, "Y": p, "MEAN": "*fp32", "RSTD": "*fp32", **dims, "eps": "fp32", **csig}
                check(fwd, sig, cval, f"{label} fwd {cval}", {"num_warps": warps}, show)
                sig = {"DY": p, "X": p, "W": p, "MEAN": "*fp32", "RSTD": "*fp32", "DX": p, "DWP": "*fp32",
                       "DBP": "*fp32", **dims, **csig}
                check(bwd, sig, cval, f"{label} bwd {cval}", {"num_warps": warps}, show)
# fmt: on

# one line a candidate family: the specialisations lowered at its launch settings, their registers and spills
for family in ("rows_once", "split", "onchip"):
    found = [r for r in resources if r[0].startswith(family)]
    if found:
        worst = max(found, key=lambda r: (r[2], r[1]))
        spilling = sum(1 for r in found if r[2])
        print(
            f"{family} at its launch settings: {len(found)} specialisations, registers "
            f"{min(r[1] for r in found)}-{max(r[1] for r in found)}, {spilling} spill "
            f"(most: {worst[2]} bytes, {worst[0]})"
        )
print(f"triton {triton.__version__}: {failures} failures")
sys.exit(1 if failures else 0)
