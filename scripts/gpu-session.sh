#!/usr/bin/env bash
# gpu-session: the two commands of a GPU session, each one shell command that writes its logs
# into LOGDIR. They run the kit made here by scripts/make-kit.sh (carried to the GPU machine as
# build/kit), since that machine has no network and no libuv/cJSON/OpenBLAS/cmocka/Nettle.
#
#   scripts/gpu-session.sh test  LOGDIR   # (a) versions, smoke test, every GPU test; < 8 min
#   scripts/gpu-session.sh bench LOGDIR   # (b) the benchmark against PyTorch eager and
#                                         #     torch.compile (125m and 1b); < 9 min
#
# (a): prints nvidia-smi, nvcc, the host compiler, PyTorch, NCCL and cuBLAS versions and the
# libraries the trainer resolves (versions.log); a two-step cuda training smoke test (smoke.log,
# again under CUDA_LAUNCH_BLOCKING=1 when it fails, smoke-blocking.log); then scripts/test-gpu.sh
# over the kit's GPU test binaries (test-gpu.log: kernels against the cpu backend, NCCL
# bootstrap, training equivalence, staged multi-rank plans, compute-sanitizer).
# (b): scripts/bench-gpu.sh --sizes 125m,1b (bench.log).
# KIT (default build/kit) names another kit. Exits non-zero when a step fails.
set -u
mode=${1:-}; logs=${2:-}
root=$(cd "$(dirname "$0")/.." && pwd)
kit=${KIT:-$root/build/kit}
if [ -z "$mode" ] || [ -z "$logs" ]; then
  echo "usage: scripts/gpu-session.sh test|bench LOGDIR" >&2; exit 2
fi
[ -f "$kit/env.sh" ] || { echo "gpu-session: no kit at $kit (scripts/make-kit.sh makes one; carry build/kit)" >&2; exit 1; }
mkdir -p "$logs"
# shellcheck disable=SC1091
. "$kit/env.sh" 2>"$logs/env.log"
cd "$root"
export PYTHONUNBUFFERED=1

case "$mode" in
test)
  t0=$(date +%s)
  {
    nvidia-smi || true
    command -v nvcc && nvcc --version | tail -2
    ${CC:-cc} --version | head -1
    python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", torch.cuda.nccl.version() if torch.cuda.is_available() else "-")' 2>&1
    echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
    ldd "$MESHRUN_BIN/trainer"
    "$MESHRUN_BIN/trainer" --version
  } >"$logs/versions.log" 2>&1
  cat "$logs/versions.log"
  rc=0
  smoke=(configs/tiny.json --set device=cuda --set train.steps=2 --set log.interval=1 --set eval.interval=0
         --set sample.tokens=0 --set checkpoint.dir="$logs/smoke-ckpt")
  if timeout 120 "$MESHRUN_BIN/trainer" "${smoke[@]}" 2>&1 | tee "$logs/smoke.log"; [ "${PIPESTATUS[0]}" -eq 0 ]; then
    echo "gpu-session: smoke test passed"
  else
    echo "gpu-session: smoke test FAILED; again with CUDA_LAUNCH_BLOCKING=1"
    CUDA_LAUNCH_BLOCKING=1 timeout 120 "$MESHRUN_BIN/trainer" "${smoke[@]}" >"$logs/smoke-blocking.log" 2>&1
    tail -20 "$logs/smoke-blocking.log"
    rc=1
  fi
  left=$(( 470 - ($(date +%s) - t0) ))
  MESHRUN_BUILD=$kit timeout "$left" scripts/test-gpu.sh "$kit"/test-gpu/test_* 2>&1 | tee "$logs/test-gpu.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
  echo "gpu-session: test took $(( $(date +%s) - t0 )) s"
  exit $rc ;;
bench)
  timeout 530 scripts/bench-gpu.sh --sizes 125m,1b 2>&1 | tee "$logs/bench.log"
  exit "${PIPESTATUS[0]}" ;;
*)
  echo "usage: scripts/gpu-session.sh test|bench LOGDIR" >&2; exit 2 ;;
esac
