#!/usr/bin/env bash
# test-gpu: the checks that need a GPU (make test-gpu). Runs each GPU test binary given as an
# argument in its own process (CUDA kernels against the cpu backend, determinism), then the
# training-equivalence check (cuda vs cpu losses), and prints one closing line:
# "test-gpu: N passed, N failed". Exits non-zero on any failure, when no GPU is visible, or when
# there is nothing to run (a build without nvcc has no GPU tests).
# Environment (set by the Makefile): MESHRUN_BIN (programs), MESHRUN_BUILD (objects).
set -u
pass=0; fail=0; failed=()

if [ $# -eq 0 ]; then
  echo "test-gpu: no GPU test binaries given (was this built without nvcc? the cuda backend builds only where nvcc exists)"
  echo "test-gpu: 0 passed, 1 failed"
  exit 1
fi

# A visible GPU, by nvidia-smi where it exists; without it the binaries' own message says why
# (the cuda backend reports "cuda: no GPU visible (cudaGetDeviceCount: ...)").
if command -v nvidia-smi >/dev/null 2>&1; then
  if ! nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
    echo "test-gpu: no GPU visible (nvidia-smi -L lists none; CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES-unset})"
    echo "test-gpu: 0 passed, 1 failed"
    exit 1
  fi
  nvidia-smi -L
fi

for t in "$@"; do
  echo "== $(basename "$t")"
  if "$t"; then pass=$((pass+1)); else fail=$((fail+1)); failed+=("$(basename "$t")"); fi
done

# --- training equivalence: NOT YET WRITTEN (issue 5) -------------------------------------------
# To come: a 20-step fp32 run of the same plan (parallel.param_dtype=fp32, a small model) on
# device cpu and on device cuda, their metrics files' losses compared step by step (tolerance
# stated and printed; TF32 off), and the cuda run twice for the same loss bits. Until it exists
# this section says so and counts as neither passed nor failed.
echo "== training equivalence (20 steps, fp32, cuda vs cpu losses): not yet"
notyet=1

[ $fail -eq 0 ] || echo "failed GPU tests: ${failed[*]}"
echo "test-gpu: $pass passed, $fail failed ($notyet not yet: training equivalence)"
[ $fail -eq 0 ]
