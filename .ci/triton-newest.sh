#!/usr/bin/env bash
# The kernel tests under the newest Triton release (constraints-triton-newest.txt). The README's test
# command runs every test under the pinned Triton (constraints.txt); pyproject admits a range, so CI
# tests its newest end too. The newest release goes into its own --target directory, put first on
# PYTHONPATH for this run only: the pinned installation is not touched. Kernel tests only, in the CPU
# interpreter -- the part of the suite that depends on Triton. Any failure fails CI (set -e).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

pin=$(grep -E '^triton==[0-9.]+$' constraints-triton-newest.txt)
version=${pin#triton==}
dir="build/ci-triton-$version"

# the kernel tests' own needs (torch, pytest, ...); the README command after this finds them installed
python3 -m pip install -c constraints.txt -e ".[dev]"
if [ ! -f "$dir/triton/__init__.py" ]; then  # kept between runs of one machine; the check below guards it
    rm -rf "$dir"
    python3 -m pip install --no-deps --target "$dir" "$pin"
fi
export PYTHONPATH="$PWD/$dir" TRITON_INTERPRET=1
python3 -c "import sys, triton; v = triton.__version__; print('triton', v, triton.__file__); sys.exit(v != '$version')"
# -m "smoke or not smoke": the bench's dry runs on the kernels too, which the README command leaves out
python3 -m pytest -q -m "smoke or not smoke" tests/kernels/test_kernels.py tests/kernels/test_kernels_groups_cl.py tests/kernels/test_kernels_edges.py tests/kernels/test_kernels_batch_invariance.py tests/kernels/test_modern_kernels.py tests/kernels/test_modern_kernels_compile.py tests/kernels/test_kernels_torch_edges.py tests/backends/test_backends.py tests/tools/test_bench_interpret.py
# the candidate kernels (kernels/variants.py: rows_once, split, onchip) and the bench cases that time them
python3 -m pytest -q -m "smoke or not smoke" tests/kernels/test_kernels_rows_once.py tests/kernels/test_kernels_variants.py tests/tools/test_bench_variants.py tests/tools/test_bench_candidates.py
