"""Lower every Triton kernel specialisation to an sm_90 cubin with Triton's own compiler -- no GPU needed.

The CPU tests run the kernels in Triton's interpreter, which is more lenient than the compiler
(loop-carried types, scalar stores, constexpr branches); this catches what only compiling would.

    PYTHONPATH=src python benchmarks/compile_check.py          # about a minute or two
"""

import itertools
import sys
import time

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from normscope.kernels import channels as CH
from normscope.kernels import config as KC
from normscope.kernels import groups as G
from normscope.kernels import modern as MK
from normscope.kernels import rows as R

TARGET = GPUTarget("cuda", 90, 32)
#: the BatchNorm kernels' tile as launched (kernels/config.py) for C >= CHANNELS_MAX_BLOCK_C channels
BP, BC = KC.CHANNELS_BLOCK_P, KC.CHANNELS_MAX_BLOCK_C
failures = 0
#: ``--only WORD[,WORD...]``: compile only the specialisations whose label holds one of the words
#: (e.g. ``--only split,onchip``: the candidate kernels)
ONLY = sys.argv[sys.argv.index("--only") + 1].split(",") if "--only" in sys.argv else None


def check(fn, sig, consts, label, warps=4, registers=False):
    """Compile one specialisation; ``registers``: also print ptxas's registers and spills for it."""
    global failures
    if ONLY is not None and not any(w in label for w in ONLY):
        return
    t = time.time()
    try:
        compiled = triton.compile(ASTSource(fn, sig, consts), target=TARGET, options={"num_warps": warps})
        usage = f" {_ptxas_usage(compiled.asm['ptx'])}" if registers else ""
        print(f"ok   {label} ({time.time() - t:.1f}s){usage}")
    except Exception as exc:  # noqa: BLE001
        failures += 1
        print(f"FAIL {label}: {type(exc).__name__}: {str(exc)[:2000]}")


def _ptxas_usage(ptx: str) -> str:
    """``ptxas -v``'s registers and spill bytes of a kernel (Triton's own ptxas), or why not."""
    import os
    import re
    import subprocess
    import tempfile

    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        try:
            out = subprocess.run(
                [ptxas, "-arch=sm_90a", "-v", src, "-o", os.path.join(d, "k.cubin")],
                capture_output=True, text=True, timeout=120,
            ).stderr  # fmt: skip
        except (OSError, subprocess.SubprocessError) as exc:
            return f"[ptxas: {type(exc).__name__}]"
    regs = re.search(r"Used (\d+) registers", out)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", out)
    return f"[{regs.group(1) if regs else '?'} registers, spills {spill.group(1) if spill else '?'} B stored]"


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
    csig, cval = const(("BLOCK_P", "BLOCK_C"), (BP, BC))
    sig = {"DY": p, "X": p, "MEAN": "*fp32", "RSTD": "*fp32", "PSDY": "*fp32", "PSDYX": "*fp32",
           "C": "i32", "inner": "i32", "P": "i32", "chunk": "i32", **csig}
    check(CH._bwd_sums_kernel, sig, cval, f"channels bwd sums {dt}")
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
                check(kern[0], sig, cval, f"split {view} stats {dt} {cval}", SW, real)
                sig = {"DY": p, "X": p, "MASK": "*u8", "MEAN": "*fp32", "RSTD": "*fp32", "PSDY": "*fp32",
                       "PSDYX": "*fp32", **dims, **csig}
                check(kern[2], sig, cval, f"split {view} bwd sums {dt} {cval}", SW, real)
            for has_w, has_b, stats in itertools.product([False, True], repeat=3):
                if not real and not (has_w and has_b):
                    continue
                names = (*blocks, "BLOCK_S", "HAS_WEIGHT", "HAS_BIAS", "STATS")
                csig, cval = const(names, (*tile, bs, has_w, has_b, stats))
                sig = {"X": p, "Y": p, "PK": "*fp32", "PMEAN": "*fp32", "PM2": "*fp32", "PCNT": "*fp32", "W": p, "B": p,
                       "MEAN": "*fp32", "VAR": "*fp32", "RSTD": "*fp32", "COUNT": "*fp32", **dims, "splits": "i32",
                       "eps": "fp32", **csig}
                check(kern[1], sig, cval, f"split {view} apply {dt} {cval}", SW, real and has_w and has_b)
            for has_w, training, has_m in itertools.product([False, True], repeat=3):
                if not real and not (has_w and training):
                    continue
                names = (*blocks, "BLOCK_S", "HAS_WEIGHT", "TRAINING", "HAS_MASK")
                csig, cval = const(names, (*tile, bs, has_w, training, has_m))
                sig = {"DY": p, "X": p, "MASK": "*u8", "MEAN": "*fp32", "RSTD": "*fp32", "W": p, "PSDY": "*fp32",
                       "PSDYX": "*fp32", "DX": p, "DW": "*fp32", "DB": "*fp32", "COUNT": "*fp32", **dims,
                       "splits": "i32", **csig}
                check(kern[3], sig, cval, f"split {view} bwd dx {dt} {cval}", SW, real and has_w and training)
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
                check(fwd, sig, cval, f"{label} fwd {cval}", warps, show)
                sig = {"DY": p, "X": p, "W": p, "MEAN": "*fp32", "RSTD": "*fp32", "DX": p, "DWP": "*fp32",
                       "DBP": "*fp32", **dims, **csig}
                check(bwd, sig, cval, f"{label} bwd {cval}", warps, show)
# fmt: on

print(f"triton {triton.__version__}: {failures} failures")
sys.exit(1 if failures else 0)
