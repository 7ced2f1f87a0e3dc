#!/usr/bin/env bash
# The first command of a GPU session: versions, the kernel tests on CUDA, compile_check, then the
# benchmark, each step's log teed into one output folder. Run from the repository root:
#
#   benchmarks/gpu_check.sh MODE [OUTDIR] [PREVIOUS]
#
# MODE
#   env     nvidia-smi, python, torch, triton, liger-kernel versions                        ~15 s
#   tests   env + tests/kernels/ on CUDA (NORMSCOPE_TEST_DEVICE=cuda, 8 pytest-xdist workers)
#           + compute-sanitizer memcheck of benchmarks/sanitize_kernels.py
#           + benchmarks/compile_check.py (GPU_CHECK_COMPILE=0: left to the CPU, where it runs too) ~3-5 min
#   bench   env + `python -m normscope.tools.bench --resume --budget-s B`: bf16 first, then fp32,
#           B = what is left of the call's limit less a margin; complete run ~12-20 min, so it
#           takes two or three calls (each resumes the JSON; nothing measured is redone).
#           Each pass also writes the measured-choice table of everything measured so far
#           (--write-choice): OUTDIR/measured/<device class>.json, copied to
#           src/normscope/backends/measured/ -- commit that copy (from OUTDIR when the run was on
#           a device machine whose working tree does not come back) to make the choice automatic
#   all     tests, then bench with whatever time the call has left
# OUTDIR    where logs and results go (default: $OUT when set, else benchmarks/results/gpu)
# PREVIOUS  a folder with an earlier call's bench-cuda.json to continue (copied into OUTDIR first)
#
# Environment
#   GPU_CALL_LIMIT_S  the device call's time limit (default 600); the script plans to end
#                     GPU_CHECK_MARGIN_S (default 150) before it
#   GPU_CHECK_DRY=1   rehearse on a machine without a GPU: kernel tests on the CPU interpreter,
#                     the bench with --interpret (tiny sizes); nvidia-smi may be missing
#   GPU_CHECK_DTYPES  the bench's passes, in order (default "bf16 fp32")
#   GPU_CHECK_CASES   the bench's cases (default: the core cases, then the group "modern")
#   GPU_CHECK_TESTS_S, GPU_CHECK_SANITIZE_S  time limits of the tests and of the sanitizer run
#                     (default 420 and 240)
#   GPU_CHECK_TESTS   the test files or folders the tests step runs (default tests/kernels/), e.g.
#                     "tests/kernels/test_kernels_rows_once.py tests/kernels/test_kernels.py"
#   GPU_CHECK_K       a pytest -k expression ANDed to that selection (default: none), e.g. the
#                     group/channel kernels' tests: "group or batch_norm or channels or instance or variant"
#   GPU_CHECK_SANITIZE_ONLY  comma-separated words: sanitize only the cases whose label holds one
#                     (default: every case); the candidates' labels start with their variant's name,
#                     e.g. rows_once, or split,onchip
#   GPU_CHECK_WORKERS pytest-xdist processes of the CUDA tests (default 8; 0: one process)
#   GPU_CHECK_PEERS   the bench's peers (default torch,compile,liger; e.g. torch,liger when device
#                     time is short: torch.compile's compiling is most of the bench's time)
#
# Liger-Kernel: if .whl/liger_kernel-*.whl is present (carry .whl), it is installed with
# `pip install --no-deps --target` into a throwaway folder and put on PYTHONPATH; torch stays as is.
# Get the wheel, here, before the GPU call:
#   python3 -m pip download --no-deps -d .whl liger-kernel==0.8.5
#
# Files in OUTDIR (at most 8 come back from a device call): env.txt, tests.log, sanitize.log,
# compile_check.log, bench.log, bench-cuda.json, bench-cuda.png (if matplotlib), summary.txt,
# measured/<device class>.json (not in a dry run: the table is measured on CUDA only).
# Exit status: 0 when every step that ran passed; the bench's PROBLEM lines are in summary.txt.

set -uo pipefail

mode="${1:-}"
case "$mode" in
  env | tests | bench | all) ;;
  *)
    echo "usage: benchmarks/gpu_check.sh env|tests|bench|all [OUTDIR] [PREVIOUS]; got MODE '${mode}'" >&2
    exit 2
    ;;
esac
outdir="${2:-${OUT:-benchmarks/results/gpu}}"
previous="${3:-}"
limit="${GPU_CALL_LIMIT_S:-600}"
margin="${GPU_CHECK_MARGIN_S:-150}"
dry="${GPU_CHECK_DRY:-0}"
cd "$(dirname "$0")/.." || exit 2
mkdir -p "$outdir" || exit 2
outdir="$(cd "$outdir" && pwd)"
summary="$outdir/summary.txt"
: >"$summary"
export PYTHONUNBUFFERED=1
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}"
status=0

say() { echo "[gpu_check ${SECONDS}s] $*" | tee -a "$summary"; }

# --- Liger-Kernel from a carried wheel -------------------------------------------------------
shopt -s nullglob
wheels=(.whl/liger_kernel-*.whl)
if ((${#wheels[@]})); then
  site="${TMPDIR:-/tmp}/normscope-liger-site"
  if python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
    "${wheels[@]}" >/dev/null 2>&1 || python3 -m zipfile -e "${wheels[0]}" "$site"; then
    export PYTHONPATH="$site:$PYTHONPATH"
  else
    say "could not unpack ${wheels[*]}: the bench runs without Liger"
  fi
fi

# --- env -------------------------------------------------------------------------------------
{
  echo "mode=$mode dry=$dry limit=${limit}s margin=${margin}s outdir=$outdir"
  echo "git: $(git rev-parse --short HEAD 2>/dev/null || echo '?') $(git status --porcelain 2>/dev/null | wc -l) changed files"
  nvidia-smi || echo "nvidia-smi: not available"
  python3 - <<'EOF'
import platform, sys
import torch
print("python", platform.python_version(), sys.executable)
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("device", p.name, f"sm_{p.major}{p.minor}", f"{p.total_memory / 2**30:.1f} GiB", p.multi_processor_count, "SMs")
try:
    import triton
    print("triton", triton.__version__)
except ImportError as exc:
    print("triton: not importable:", exc)
try:
    import numpy
    print("numpy", numpy.__version__)
except ImportError:
    print("numpy: not importable")
try:
    import matplotlib
    print("matplotlib", matplotlib.__version__)
except ImportError:
    print("matplotlib: not importable (the bench writes no PNG; redraw later with --plot-only)")
import normscope
print("normscope", normscope.__version__, normscope.__file__, "backends", normscope.backends())
from normscope.tools import bench
peers, version, absent = bench.peers._liger_peers()
print("liger-kernel", version if peers else f"absent: {absent}", f"(adapter checked against {bench.LIGER_CHECKED})")
EOF
} 2>&1 | tee "$outdir/env.txt"
rc=$?
if ((rc)); then
  say "env: FAILED (rc=$rc): see env.txt"
  status=1
else
  say "env: ok ($(grep -m1 '^device' "$outdir/env.txt" || echo 'no CUDA device'))"
fi

# --- tests -----------------------------------------------------------------------------------
if [[ "$mode" == tests || "$mode" == all ]]; then
  if [[ "$dry" == 1 ]]; then
    test_env=(env NORMSCOPE_TEST_DEVICE=cpu TRITON_INTERPRET=1)
  else
    test_env=(env -u TRITON_INTERPRET NORMSCOPE_TEST_DEVICE=cuda)
  fi
  # tests/kernels/: every kernel test file; on the GPU host in
  # GPU_CHECK_WORKERS processes (pytest-xdist: most of the time is Triton compiling, one CPU core each)
  # (-p no:xdist: one process, where tests/conftest.py would otherwise start one worker per core)
  workers=(-p no:xdist)
  if [[ "$dry" != 1 && "${GPU_CHECK_WORKERS:-8}" != 0 ]] && python3 -c "import xdist" 2>/dev/null; then
    workers=(-n "${GPU_CHECK_WORKERS:-8}")
  fi
  # the > 2**31-element tests (4-17 GB each) after the others, one at a time: side by side in several
  # workers they ran the GPU out of memory. GPU_CHECK_TESTS / GPU_CHECK_K select a part of the suite
  read -r -a test_paths <<<"${GPU_CHECK_TESTS:-tests/kernels/}"
  narrow="${GPU_CHECK_K:+ and (${GPU_CHECK_K})}"
  timeout "${GPU_CHECK_TESTS_S:-420}" "${test_env[@]}" python3 -m pytest "${test_paths[@]}" \
    -q -rfEs --durations=15 -p no:cacheprovider -k "not 2_31 and not 2_pow_31${narrow}" ${workers[@]+"${workers[@]}"} 2>&1 | tee "$outdir/tests.log"
  rc=$?
  timeout "${GPU_CHECK_TESTS_S:-420}" "${test_env[@]}" python3 -m pytest "${test_paths[@]}" \
    -q -rfEs -p no:cacheprovider -p no:xdist -k "(2_31 or 2_pow_31)${narrow}" 2>&1 | tee -a "$outdir/tests.log"
  rc2=${PIPESTATUS[0]}
  if ((rc2 == 5)); then rc2=0; fi # pytest's "no tests collected": the selection has none of these
  rc=$((rc | rc2))
  if ((rc)); then status=1; fi
  # both pytest runs' closing lines (the second: the > 2**31-element tests)
  said=$(grep -E '^[0-9]+ (passed|failed|skipped|deselected|error)|no tests ran' "$outdir/tests.log" | paste -sd ';' -)
  say "tests: $( ((rc)) && echo "FAILED (rc=$rc)" || echo ok): ${said:-$(tail -n 1 "$outdir/tests.log")}"

  # compute-sanitizer memcheck on one small case of every kernel (PYTORCH_NO_CUDA_MEMORY_CACHING: see
  # benchmarks/sanitize_kernels.py); the dry run rehearses the cases in the interpreter
  if [[ "$dry" == 1 ]]; then
    sanitize=(env TRITON_INTERPRET=1)
  else
    sanitize=(env -u TRITON_INTERPRET PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck --error-exitcode 9)
  fi
  SANITIZE_ONLY="${GPU_CHECK_SANITIZE_ONLY:-}" timeout "${GPU_CHECK_SANITIZE_S:-240}" "${sanitize[@]}" \
    python3 benchmarks/sanitize_kernels.py 2>&1 | tee "$outdir/sanitize.log"
  rc=$?
  if ((rc)); then status=1; fi
  say "sanitize: $( ((rc)) && echo "FAILED (rc=$rc)" || echo ok): $(grep -m1 'ERROR SUMMARY' "$outdir/sanitize.log" || tail -n 1 "$outdir/sanitize.log")"

  # compile_check needs no GPU (it lowers to sm_90 on any machine): GPU_CHECK_COMPILE=0 leaves it to the CPU
  if [[ "${GPU_CHECK_COMPILE:-1}" != 0 ]]; then
    timeout 240 python3 benchmarks/compile_check.py 2>&1 | tee "$outdir/compile_check.log"
    rc=$?
    if ((rc)); then status=1; fi
    say "compile_check: $( ((rc)) && echo "FAILED (rc=$rc)" || echo ok): $(tail -n 1 "$outdir/compile_check.log")"
  fi
fi

# --- bench -----------------------------------------------------------------------------------
if [[ "$mode" == bench || "$mode" == all ]]; then
  if [[ -n "$previous" ]]; then
    for f in "$previous"/bench-*.json; do
      [[ -e "$f" ]] && { cp "$f" "$outdir/" && say "resuming from $f"; }
    done
  fi
  # the core cases first (the measured-choice table is built from them), the modern norms' rows after
  cases=${GPU_CHECK_CASES:-rms_norm,layer_norm,add_rms_norm,group_norm,group_norm_cl,batch_norm,masked_batch_norm,modern}
  if [[ "$dry" == 1 ]]; then
    extra=(--interpret)
    export TRITON_INTERPRET=1
    say "bench: dry run: no measured-choice table (interpreted times mean nothing)"
  elif grep -q '^device' "$outdir/env.txt"; then # env found a CUDA device: the table is measured there only
    extra=(--write-choice "$outdir/measured/")
  else
    extra=()
    say "bench: no CUDA device: no measured-choice table"
  fi
  for dtypes in ${GPU_CHECK_DTYPES:-bf16 fp32}; do # the dtype that matters most for transformer norms first
    budget=$((limit - margin - SECONDS))
    if ((budget < 30)); then
      say "bench $dtypes: not started, ${budget}s left before the margin: run 'bench' again with PREVIOUS"
      continue
    fi
    say "bench $dtypes: budget ${budget}s"
    # the bench stops starting configurations after the budget; timeout is the backstop
    timeout $((budget + margin - 20)) python3 -m normscope.tools.bench ${extra[@]+"${extra[@]}"} --cases "$cases" \
      --dtypes "$dtypes" --peers "${GPU_CHECK_PEERS:-torch,compile,liger}" --resume --budget-s "$budget" \
      --out "$outdir" 2>&1 | tee -a "$outdir/bench.log"
    rc=$?
    if ((rc)); then
      status=1
      say "bench $dtypes: FAILED (rc=$rc): see bench.log"
    fi
  done
  tables=("$outdir"/measured/cuda-*.json)
  if ((${#tables[@]})); then
    mkdir -p src/normscope/backends/measured &&
      cp "${tables[@]}" src/normscope/backends/measured/ &&
      say "measured-choice table: ${tables[*]} (copied to src/normscope/backends/measured/)"
  fi
  json=("$outdir"/bench-*.json)
  if ((${#json[@]})); then
    python3 - "${json[0]}" "$cases" "${GPU_CHECK_DTYPES:-bf16 fp32}" <<'EOF' 2>&1 | tee -a "$summary"
import json, sys
from normscope.tools import bench
r = json.load(open(sys.argv[1]))
found = bench.problems(r)
cases = list(dict.fromkeys(c for name in sys.argv[2].split(",") for c in bench.CASE_GROUPS.get(name, (name,))))
want = bench.plan(cases, sys.argv[3].split(), r["level"])  # what this gpu_check bench runs, all of it
have = {(x["case"], x["dtype"], tuple(x["shape"])) for x in r["results"] if x["mode"] == "fwd+bwd"}
left = [c for c in want if c not in have]
print(f"bench: {len(want) - len(left)} of {len(want)} configurations in {sys.argv[1]}, "
      f"{len(r.get('failed', []))} failed in the last pass, {len(found)} problems")
if left:
    print(f"bench: not yet measured: {', '.join(f'{c} {d} {chr(120).join(map(str, s))}' for c, d, s in left)}")
    print("bench: run `benchmarks/gpu_check.sh bench OUTDIR PREVIOUS` with this bench-*.json in PREVIOUS")
# the candidate kernels against the default kernel, the default's time over the candidate's (above 1: the
# candidate is faster), fwd and fwd+bwd: the row cases' columns (bench.VARIANTS, e.g. rows_once) and the
# spatial cases' case@variant rows beside their plain case (same dtype and shape)
def ms(x, impl="normscope"):
    return (x["impls"].get(impl) or {}).get("ms")
plain = {(x["case"], x["dtype"], tuple(x["shape"]), x["mode"]): ms(x) for x in r["results"]}
speedups = {}
for x in r["results"]:
    base, _, variant = x["case"].partition("@")
    if variant:  # (candidate, default ms, candidate ms)
        timed = [(variant, plain.get((base, x["dtype"], tuple(x["shape"]), x["mode"])), ms(x))]
    else:
        timed = [(v, ms(x), ms(x, v)) for v in bench.VARIANTS]
    for v, default, candidate in timed:
        if default and candidate:
            speedups.setdefault(v, {}).setdefault((base, x["dtype"], x.get("n")), {})[x["mode"]] = default / candidate
for v, pairs in speedups.items():
    cells = [f"{c} {d} {n}: {m.get('fwd', 0):.2f}/{m.get('fwd+bwd', 0):.2f}" for (c, d, n), m in sorted(pairs.items())]
    print(f"bench: {v} speedup over the default kernel (fwd/fwd+bwd, above 1 faster): " + "; ".join(cells))
for line in found:
    print("PROBLEM", line)
EOF
  fi
fi

say "done in ${SECONDS}s, status $status"
exit $status
