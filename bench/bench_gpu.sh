#!/usr/bin/env bash
# bench-gpu: tokens/s, MFU and peak memory of bin/trainer on one GPU beside PyTorch (eager and
# torch.compile) on the same GPU, for a ~125M and a ~0.85B Llama (make bench-gpu). The work is in
# bench/bench_gpu.py; this wrapper checks for a GPU and finds the programs. Arguments pass
# through (e.g. --sizes 125m --steps 20). Environment: MESHRUN_BIN (default: bin/ of the
# repository), PYTHON (default python3). Exits non-zero when no GPU is visible or the trainer is
# missing; a missing PyTorch is reported in the output, not an error.
set -u
root=$(cd "$(dirname "$0")/.." && pwd)
export MESHRUN_BIN=${MESHRUN_BIN:-$root/bin}
PY=${PYTHON:-python3}
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
  echo "bench-gpu: no GPU visible (nvidia-smi missing or lists none)"
  exit 1
fi
if [ ! -x "$MESHRUN_BIN/trainer" ]; then
  echo "bench-gpu: $MESHRUN_BIN/trainer not found (make first, or set MESHRUN_BIN)"
  exit 1
fi
exec "$PY" "$root/bench/bench_gpu.py" "$@"
