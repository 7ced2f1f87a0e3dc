"""Launch settings of the Triton kernels (rows, groups, channels), in one place.

Every value here is a heuristic -- a guess from the kernels' shape and the usual Triton rules of
thumb -- except the two tables of the rows kernels marked "measured", which a sweep on an H100
chose (``benchmarks/rows_sweep.py``; results in ``benchmarks/results/rows_sweep-cuda-h100.json``).
Each comment says what the setting trades; ``normscope bench`` on a GPU host is how they should be
chosen, and a value changed after such a measurement says so (device, command) next to it.

The kernels read these names at launch time (``config.ROWS_TILE``, never a copy taken at import),
so a test or an experiment can set one for a single call::

    monkeypatch.setattr(config, "ROWS_MAX_FUSED_N", 8)   # force the looped path on tiny rows

Sizes in elements are powers of two (``tl.arange`` needs them).
"""

# ---- rows: LayerNorm / RMSNorm over the last axis (kernels/rows.py)

#: Longest row (rounded up to a power of two) one program keeps in registers: one read of x. Longer
#: rows take the looped path (x read twice) but a larger value spills registers. Unmeasured.
ROWS_MAX_FUSED_N = 16384
#: Chunk length of the looped path: larger chunks mean fewer loop trips, but more registers per
#: program. Unmeasured.
ROWS_LOOP_BLOCK = 4096
#: Elements per program on the single-block path: short rows are packed ``TILE // next_pow2(N)`` to a
#: program, so that a program has enough work (fewer, fuller programs vs. fewer programs to spread
#: over the SMs). Unmeasured.
ROWS_TILE = 4096
#: Most short rows per program (caps ``ROWS_TILE // BLOCK_N`` for very short rows). Unmeasured.
ROWS_MAX_BLOCK_M = 64
#: Elements per warp on the single-block path (``num_warps = tile elements / this``, a power of two):
#: more warps hide latency, fewer leave more registers per thread. Unmeasured.
ROWS_WARP_ELEMS = 1024
#: The same for one chunk of the looped path. Unmeasured.
ROWS_LOOP_WARP_ELEMS = 512
#: Most warps of a rows program. Unmeasured.
ROWS_MAX_WARPS = 16
#: Backward programs per SM, single-block path: every program writes one fp32 partial row of dW/dB,
#: so more programs mean more parallelism but a larger partial buffer to sum. Unmeasured.
ROWS_BWD_PROGRAMS_PER_SM = 4
#: Backward programs per SM, looped path (each keeps its partial dW/dB row in global memory).
#: Unmeasured.
ROWS_LOOP_BWD_PROGRAMS_PER_SM = 2

#: Measured launch settings by row block (``next_pow2(N)``), which replace the rules above for the
#: blocks they list; ``benchmarks/rows_sweep.py`` measures them on a GPU and writes these two tables (the
#: comment above each says where and when). Keyed by the row length alone, as every setting here: a
#: row's reduction order must not depend on how many rows a call holds.
#: Single-block path, backward: block -> (BLOCK_M, num_warps, programs per SM).
#: measured: NVIDIA H100 80GB HBM3, torch 2.11.0+cu130, triton 3.6.0, 2026-11-26, benchmarks/rows_sweep.py
ROWS_BWD_LAUNCH: dict[int, tuple[int, int, int]] = {
    256: (32, 4, 2),
    1024: (8, 4, 2),
    4096: (4, 16, 2),
    8192: (2, 16, 2),
    16384: (1, 8, 2),
}
#: Looped path: block -> (forward chunk, forward num_warps, backward chunk, backward num_warps,
#: backward programs per SM).
#: measured: NVIDIA H100 80GB HBM3, torch 2.11.0+cu130, triton 3.6.0, 2026-11-26, benchmarks/rows_sweep.py
ROWS_LOOP_LAUNCH: dict[int, tuple[int, int, int, int, int]] = {
    32768: (16384, 16, 8192, 16, 1),
    65536: (16384, 32, 8192, 8, 2),
    131072: (16384, 16, 4096, 8, 2),
    262144: (16384, 16, 8192, 8, 1),
}

# ---- rows read once (kernels/rows_once.py): candidates, off until a measurement picks them
# (kernels/variants.py). They take over only rows longer than ROWS_MAX_FUSED_N, which the default kernels
# walk twice. None is measured: each was chosen by lowering the kernels for sm_90 with Triton 3.6 and
# reading ptxas's register and spill counts (benchmarks/compile_check.py prints them), 2026-11-28.

#: Longest row (``next_pow2(N)``) the read-once forward reads whole, one row a program (no second pass
#: at all); longer rows are split over several programs. At 32768 with 32 warps (32 fp32 values a
#: thread, 64 registers at most) ptxas spills 68-124 bytes a thread (to L1); 16384 spills nothing but
#: sends 32K rows to the split path. Unmeasured.
ROWS_ONCE_MAX_N = 32768
#: Warps of that one-row program.
ROWS_ONCE_WARPS = 32
#: Elements of a row one program of the split forward holds (a power of two): a row of N takes
#: ``cdiv(N, chunk)`` programs that meet once per row on their partial sums. 8192 at 32 warps: 52-64
#: registers, no spill, with the next row's chunk in flight beside this one's (16384: 4-20 bytes
#: spilled). Unmeasured.
ROWS_ONCE_FWD_CHUNK = 8192
#: The same for the backward, which holds x, dy, the weight and the dW/dB partials of its columns, and
#: the next row's x and dy: 4096 at 32 warps, 55-64 registers, no spill (8192: 56-124 bytes). Unmeasured.
ROWS_ONCE_BWD_CHUNK = 4096
#: Warps of a split forward program and of a backward program.
ROWS_ONCE_SPLIT_WARPS = 32
ROWS_ONCE_BWD_WARPS = 32
#: Split programs resident per SM: the launch is one cooperative grid of at most ``SMs x this``
#: programs (all resident at once: a program waits for the others of its row). Above 1 the kernels are
#: compiled with at most ``65536 / (this x 32 x warps)`` registers a thread so that they fit -- at 16
#: warps and 64 registers ptxas spills 228-524 bytes, hence 1. Unmeasured.
ROWS_ONCE_BLOCKS_PER_SM = 1
#: Run the split kernels as two launches (partial sums, then the rest, reading the row again) instead
#: of one synchronised launch: what the CPU interpreter always does (it runs programs one at a time, so
#: no program can wait for another); on a GPU only for tests, which hold the two bitwise equal.
ROWS_ONCE_TWO_PHASE = False

# ---- groups: GroupNorm / InstanceNorm on (N, C, *) (kernels/groups.py)

#: Elements per tile of the contiguous (NCHW) kernels: one program walks its whole group in tiles of
#: this size (larger: fewer loop trips, more registers). Unmeasured.
GROUPS_TILE = 2048
#: Elements per warp of every groups kernel (``num_warps = tile elements / this``). Unmeasured.
GROUPS_WARP_ELEMS = 256
#: Most warps of a groups program. Unmeasured.
GROUPS_MAX_WARPS = 8
#: channels_last kernels: elements per (positions, groups, channels) tile. Unmeasured.
GROUPS_CL_TILE = 2048
#: channels_last kernels: most channels in one tile row, whole groups side by side, so that a row is
#: one contiguous run of memory (InstanceNorm's one-channel groups still load coalesced rows); wider
#: rows mean fewer, longer memory transactions but fewer positions per tile. Unmeasured.
GROUPS_CL_WIDTH = 64
#: channels_last kernels: programs to aim for *per sample* when the positions are split (``G`` alone
#: is 32 programs at G = 32): more splits fill the GPU but add partials every program re-reads. Per
#: sample, never per batch: the splits are a group's reduction order, which must not depend on the
#: batch size (scope isolation, see normscope.engine). Unmeasured.
GROUPS_CL_PROGRAMS = 1024
#: channels_last kernels: fewest elements one split of a group block holds, so that a split's work
#: outweighs its share of the second (combining) stage. Unmeasured.
GROUPS_CL_MIN_SPLIT = 8192

# ---- channels: BatchNorm, statistics per channel (kernels/channels.py)

#: Positions per tile (times up to ``CHANNELS_MAX_BLOCK_C`` channels); also the granularity of the
#: position chunks of the two-stage reduction. Unmeasured.
CHANNELS_BLOCK_P = 256
#: Most channels per tile: wider tiles read more channels per position (NCHW: strided), narrower ones
#: make more channel blocks. Unmeasured.
CHANNELS_MAX_BLOCK_C = 32
#: Warps of every channels program. Unmeasured.
CHANNELS_WARPS = 4
#: Reduction programs per SM (position chunks x channel blocks): more chunks fill the GPU but make
#: the ``(chunks, C)`` partial buffers the second stage sums larger. Unmeasured.
CHANNELS_PROGRAMS_PER_SM = 2

# ---- the CPU interpreter (TRITON_INTERPRET=1)

#: Programs the backward and BatchNorm reductions use in the interpreter, which runs programs one
#: after the other: a few, so that tests still exercise the multi-program (partial-sum) paths.
INTERPRETER_PROGRAMS = 4

# ---- kernel variants: candidates beside the default kernels, unmeasured, off by default

# Which kernel a family runs (normscope.kernels.variants). None (the default): the measured-choice table
# decides (normscope.backends.measured: a committed row may name a variant for an op, dtype and scope size;
# with no such row the default kernel runs, a forced use_backend("triton") included). A name pins one kernel
# for every call of the process -- read at every call, process-wide like every setting here: a knob for
# tests (NORMSCOPE_TEST_KERNEL_VARIANTS sets them for a whole test session, monkeypatch for one test) and
# experiments, not a user API. A block's own choice, per thread, is variants.use_variant, which comes before
# these (``normscope bench`` names each column's kernel with it, whatever a pin or the table says).

#: LayerNorm / RMSNorm / fused residual add: "rows" (kernels/rows.py, the default) or "rows_once"
#: (kernels/rows_once.py, for rows past ROWS_MAX_FUSED_N; shorter rows run the single-block kernel either way).
ROWS_VARIANT: str | None = None
#: BatchNorm: "tiled" (kernels/channels.py, the default) or "split" (kernels/channels_split.py).
CHANNELS_VARIANT: str | None = None
#: GroupNorm / InstanceNorm: "tiled" (kernels/groups.py, the default) or "onchip" (kernels/groups_onchip.py,
#: for groups that fit GROUPS_ONCHIP_MAX; larger ones run the default kernels).
GROUPS_VARIANT: str | None = None

# ---- split BatchNorm (kernels/channels_split.py): unmeasured

#: Elements per tile of the split BatchNorm kernels (positions x channels, or rows x columns of NCHW); with
#: CHANNELS_SPLIT_WARPS this sets the registers a program holds (three fp32 accumulators a tile). Unmeasured.
CHANNELS_SPLIT_TILE = 2048
#: Channels per tile when channels are innermost in memory ((B, S, D), (N, C), channels_last): a tile row is
#: this many adjacent channels, one contiguous run. A constant, never the channel count: a channel's
#: reduction order must not depend on how many channels the call holds. Unmeasured.
CHANNELS_SPLIT_BLOCK_C = 64
#: Longest run of one channel's positions per tile row on NCHW memory (``inner = H * W`` contiguous
#: values); shorter runs leave fewer masked lanes at the end of a row. Unmeasured.
CHANNELS_SPLIT_BLOCK_I = 512
#: Fewest tiles one split (program) of a channel reduces: more tiles per split mean fewer partials to
#: combine, fewer splits mean fewer programs. Unmeasured.
CHANNELS_SPLIT_MIN_TILES = 4
#: Most splits of one channel's positions: every apply program combines all of its channel's splits, so
#: this bounds that work (and the BLOCK_S of the combine). With channels innermost the programs are splits x
#: cdiv(C, CHANNELS_SPLIT_BLOCK_C): 256 for the bench's channels_last BatchNorm (C = 256), few for 132 SMs --
#: with this and CHANNELS_SPLIT_BLOCK_C the first settings to sweep there. Unmeasured.
CHANNELS_SPLIT_MAX = 64
#: Warps of every split BatchNorm program. Unmeasured.
CHANNELS_SPLIT_WARPS = 8

# ---- GroupNorm / InstanceNorm with the group on chip (kernels/groups_onchip.py): unmeasured

#: Most elements of one program's register tile (``next_pow2(C/G) x next_pow2(H*W)``, times the groups a
#: channels_last program holds side by side): a group that fits is read once forward (x) and once backward
#: (x and dy); a larger one runs the default kernels. The backward holds x and dy: ptxas (sm_90, Triton 3.6,
#: ``benchmarks/compile_check.py --only onchip``) spills nothing at 8192, ~100 B a thread at 16384 and
#: 1.6-3.2 KB at 32768 (the bench's GroupNorm(32) on 256 x 56 x 56, which therefore stays on the default
#: kernels). Unmeasured on a GPU.
GROUPS_ONCHIP_MAX = 16384
#: channels_last: most channels side by side in a tile row (whole groups), one contiguous run. Unmeasured.
GROUPS_ONCHIP_WIDTH = 16
#: Elements per warp of the on-chip programs (``num_warps = tile / this``, at most GROUPS_ONCHIP_MAX_WARPS).
#: Unmeasured.
GROUPS_ONCHIP_WARP_ELEMS = 512
#: Most warps of an on-chip program. Unmeasured.
GROUPS_ONCHIP_MAX_WARPS = 16
