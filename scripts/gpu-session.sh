#!/usr/bin/env bash
# gpu-session: everything a GPU window checks and measures, as ONE command bounded in time, that
# writes what it finds as it goes into OUTDIR:
#   OUTDIR/results.jsonl  one JSON object per check or figure, appended the moment it ends
#                         ({"check": ..., "result": "pass"|"fail"|"skipped", "seconds": ...};
#                         benchmark rows with tokens_per_s, mfu, peak memory)
#   OUTDIR/session.log    everything printed, with the tail of each failing step's own log
# Nothing else is written there (the device tool brings back at most 8 files), and checkpoints and
# scratch go to a temporary folder.
#
#   scripts/gpu-session.sh [--dry-run] [--budget SECONDS] OUTDIR
#
# It runs the kit made here by scripts/make-kit.sh (carried to the GPU machine as build/kit),
# since that machine has no network and no libuv/cJSON/OpenBLAS/cmocka/Nettle. The stages, most
# valuable first, each with a cap and all inside the budget (default 540 s; a stage starts only
# with at least 20 s left, and is cut to end by the budget):
#   1. versions: GPU, driver, CUDA runtime, cuBLASLt, cuDNN, NCCL, PyTorch (one JSON object), the
#      libraries the trainer resolves, and where CUDA's libraries are on that machine
#   2. smoke: two cuda training steps of configs/tiny.json (again under CUDA_LAUNCH_BLOCKING=1
#      when it fails, for the failing call's own line)
#   3. kernels: the kit's GPU test binaries (every kernel against the cpu backend in fp32 and
#      bf16, NCCL bootstrap, the staged comm), through scripts/test-gpu.sh
#   4. bench 1b: ours in bf16 with the kernel-by-kernel profile of one step, then torch.compile
#      and torch eager, Llama 3.2 1B's shape at seq 2048 (bench/bench_gpu.py)
#   5. training: 20 steps cuda vs cpu in fp32 and bf16, determinism, the GPU defaults, and the
#      staged multi-rank plans on the one GPU (scripts/test-gpu.sh train,parallel)
#   6. attention: PyTorch's SDPA backends (flash, cuDNN) forward + backward at the 1b shape, the
#      yardstick for our attention kernels
#   7. bench 125m: ours, torch.compile, torch eager, ours with train.cuda_graphs off
#   8. sanitizer: compute-sanitizer memcheck over two cuda steps
# --dry-run runs the same logic here without a GPU: device cpu throughout, a tiny benchmark size,
# no PyTorch runs and no GPU test binaries, so a broken stage shows before device time is spent.
# KIT (default build/kit) names another kit; a dry run without one runs the programs in
# MESHRUN_BIN (test_gpu_session_dry.py, in make test). Exits non-zero when a stage failed.
set -u
dry=0; budget=540; out=""
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) dry=1 ;;
    --budget) budget=${2:?--budget needs seconds}; shift ;;
    -*) echo "gpu-session: unknown option $1" >&2; exit 2 ;;
    *) out=$1 ;;
  esac
  shift
done
[ -n "$out" ] || { echo "usage: scripts/gpu-session.sh [--dry-run] [--budget SECONDS] OUTDIR" >&2; exit 2; }
case "$budget" in ''|*[!0-9]*) echo "gpu-session: --budget $budget: expected whole seconds" >&2; exit 2 ;; esac
root=$(cd "$(dirname "$0")/.." && pwd)
kit=${KIT:-$root/build/kit}
mkdir -p "$out"
out=$(cd "$out" && pwd)
results=$out/results.jsonl
log=$out/session.log
: >"$results"
exec > >(tee -a "$log") 2>&1
t_start=$(date +%s)
deadline=$((t_start + budget))
work=$(mktemp -d /tmp/gpu-session.XXXXXX)
trap 'rm -rf "$work"' EXIT
export PYTHONUNBUFFERED=1
cd "$root"

if [ $dry = 1 ] && [ ! -f "$kit/env.sh" ] && [ -n "${MESHRUN_BIN:-}" ]; then
  # A dry run needs no kit: it runs the binaries this checkout built (make test runs it so).
  echo "gpu-session: dry run without a kit: the programs in $MESHRUN_BIN"
  kit=${MESHRUN_BUILD:-$MESHRUN_BIN}
else
  [ -f "$kit/env.sh" ] || { echo "gpu-session: no kit at $kit (scripts/make-kit.sh makes one; carry build/kit)"; exit 1; }
  # shellcheck disable=SC1091
  . "$kit/env.sh"
fi
BIN=$MESHRUN_BIN
DEV=cuda; [ $dry = 1 ] && DEV=cpu

json_str() { local s=${1//\\/\\\\}; s=${s//\"/\\\"}; printf '"%s"' "${s//$'\n'/ }"; }
# note STAGE RESULT SECONDS [DETAIL]: one line of results.jsonl
note() {
  printf '{"check":%s,"result":"%s","seconds":%s%s}\n' "$(json_str "$1")" "$2" "$3" \
    "${4:+,\"detail\":$(json_str "$4")}" >>"$results"
}
failed=()
# stage NAME CAP COMMAND...: runs COMMAND under timeout min(CAP, what the budget leaves), logs
# its output, notes pass/fail/skipped with its seconds.
stage() {
  local name=$1 cap=$2; shift 2
  local left=$((deadline - $(date +%s)))
  echo
  echo "=== $name (cap ${cap} s, ${left} s of the budget left) $(date -u +%H:%M:%S)"
  if [ "$left" -lt 20 ]; then
    echo "gpu-session: $name skipped: the budget is spent"
    note "$name" skipped 0 "budget spent"
    return 0
  fi
  [ "$cap" -gt "$left" ] && cap=$left
  local t0 rc
  t0=$(date +%s)
  timeout -k 5 "$cap" bash -c '"$@"' stage "$@"
  rc=$?
  local dt=$(($(date +%s) - t0))
  if [ $rc -eq 0 ]; then
    note "$name" pass "$dt"
  else
    local why="exit $rc"
    [ $rc -eq 124 ] && why="timed out after $cap s"
    echo "gpu-session: $name FAILED ($why)"
    note "$name" fail "$dt" "$why"
    failed+=("$name")
  fi
  return 0
}

# --- the stages ---------------------------------------------------------------------------------
versions() {
  nvidia-smi || echo "nvidia-smi: not found or failed"
  command -v nvcc && nvcc --version | tail -2
  echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
  ldd "$BIN/trainer"
  "$BIN/trainer" --version
  echo "-- CUDA's libraries on this machine:"
  find /usr/local /usr/lib /opt -maxdepth 10 \( -name 'libcublasLt.so*' -o -name 'libnccl.so*' -o -name 'libcudart.so*' -o -name 'libcudnn.so*' \) \
    2>/dev/null | grep -v "^$work" | head -20
  ldconfig -p 2>/dev/null | grep libcudnn.so.9 || true
  # One JSON object: each version read from the library itself (the runtime's own answer).
  python3 - "$results" <<'EOF' || true
import ctypes, json, subprocess, sys
v = {"check": "versions", "result": "pass"}
def smi(q):
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=" + q, "--format=csv,noheader"], capture_output=True,
                              text=True, timeout=30).stdout.strip().splitlines()[0]
    except Exception as e:
        return "n/a (%s)" % e
v["gpu"], v["driver"], v["gpu_memory"] = smi("name"), smi("driver_version"), smi("memory.total")
def lib_version(names, fn, fmt):
    for n in names:
        try:
            lib = ctypes.CDLL(n)
        except OSError:
            continue
        x = ctypes.c_int(0)
        f = getattr(lib, fn)
        if fn in ("cublasLtGetVersion", "cudnnGetVersion"):
            f.restype = ctypes.c_size_t
            return fmt(int(f()))
        f(ctypes.byref(x))
        return fmt(x.value)
    return "not found"
v["cuda_runtime"] = lib_version(["libcudart.so.13", "libcudart.so.12"], "cudaRuntimeGetVersion",
                                lambda x: "%d.%d" % (x // 1000, x % 1000 // 10))
v["cuda_driver_api"] = lib_version(["libcudart.so.13", "libcudart.so.12"], "cudaDriverGetVersion",
                                   lambda x: "%d.%d" % (x // 1000, x % 1000 // 10))
v["cublaslt"] = lib_version(["libcublasLt.so.13", "libcublasLt.so.12"], "cublasLtGetVersion",
                            lambda x: "%d.%d.%d" % (x // 10000, x % 10000 // 100, x % 100))
v["nccl"] = lib_version(["libnccl.so.2"], "ncclGetVersion",
                        lambda x: "%d.%d.%d" % (x // 10000, x % 10000 // 100, x % 100))
try:
    import torch
    v["torch"] = torch.__version__
    v["torch_cuda"] = torch.version.cuda
    v["cudnn"] = str(torch.backends.cudnn.version())
    v["torch_nccl"] = ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else "-"
except Exception as e:
    v["torch"] = "unavailable (%s)" % e
# What the trainer's dlopen of libcudnn.so.9 finds, asked in a process of its own (torch, above,
# has loaded the cuDNN of its wheel into this one; loading another here broke its import once).
probe = ("import ctypes\ntry:\n    f = ctypes.CDLL('libcudnn.so.9').cudnnGetVersion\n    f.restype = ctypes.c_size_t\n"
         "    x = int(f()); print('%d.%d.%d' % (x // 10000, x % 10000 // 100, x % 100))\n"
         "except OSError:\n    print('not found')")
try:
    v["cudnn_ours"] = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                                     timeout=30).stdout.strip()
except Exception as e:
    v["cudnn_ours"] = "n/a (%s)" % e
print(json.dumps(v))
with open(sys.argv[1], "a") as f:
    f.write(json.dumps(v) + "\n")
EOF
}

smoke() {
  local sets=(configs/tiny.json --set "device=$DEV" --set train.steps=2 --set log.interval=1 --set eval.interval=0
              --set sample.tokens=0 --set checkpoint.dir="$work/smoke-ckpt" --set overwrite=true)
  if "$BIN/trainer" "${sets[@]}" 2>&1 | tee "$work/smoke.log" && [ "${PIPESTATUS[0]}" -eq 0 ]; then
    return 0
  fi
  echo "gpu-session: the smoke test failed; again with CUDA_LAUNCH_BLOCKING=1 (the failing call's own line)"
  CUDA_LAUNCH_BLOCKING=1 "$BIN/trainer" "${sets[@]}" 2>&1 | tail -20
  return 1
}

# test_gpu SECTIONS [BINARIES...]: scripts/test-gpu.sh, its checks into results.jsonl
test_gpu() {
  local sections=$1; shift
  TEST_GPU_SECTIONS=$sections TEST_GPU_RESULTS=$results TEST_GPU_DEVICE=$DEV MESHRUN_BIN=$BIN MESHRUN_BUILD=$kit \
    TEST_GPU_TIMEOUT=$(( deadline - $(date +%s) )) scripts/test-gpu.sh "$@"
}

bench() { # bench SIZES [more bench_gpu.py arguments]
  local sizes=$1; shift
  local extra=()
  [ $dry = 1 ] && extra=(--no-torch --device cpu)
  python3 bench/bench_gpu.py --bin "$BIN" --sizes "$sizes" --results "$results" --deadline "$deadline" \
    "${extra[@]}" "$@"
}

attention() {
  [ $dry = 1 ] && { echo "dry run: no PyTorch GPU attention"; return 0; }
  python3 bench/bench_gpu.py --attention --sizes 1b | tee -a "$work/attention.jsonl"
  sed 's/^{/{"check":"attention",/' "$work/attention.jsonl" >>"$results"
}

# The stages run in a child bash under timeout: it sees these functions and variables.
export -f versions smoke test_gpu bench attention
export BIN DEV dry work results deadline kit

echo "gpu-session: $(date -u +%Y-%m-%dT%H:%M:%SZ), budget $budget s, kit $kit$([ $dry = 1 ] && echo ', DRY RUN (device cpu)')"
head -2 "$kit/MANIFEST" 2>/dev/null
stage versions 60 versions
stage smoke 90 smoke
if [ $dry = 1 ]; then
  stage kernels 60 test_gpu binaries /bin/true
else
  for t in test_backend_cuda test_nccl test_backend_cuda_tp; do
    [ -x "$kit/test-gpu/$t" ] && stage "kernels $t" "$([ $t = test_backend_cuda ] && echo 120 || echo 60)" test_gpu binaries "$kit/test-gpu/$t"
  done
fi
if [ $dry = 1 ]; then
  stage "bench tiny" 120 bench tiny --profile --steps 4 --warmup 2 --graphs-row
else
  stage "bench 1b" 330 bench 1b --profile
fi
stage training 180 test_gpu train,parallel
stage attention 60 attention
[ $dry = 1 ] || stage "bench 125m" 200 bench 125m --graphs-row
stage sanitizer 240 test_gpu sanitizer

echo
echo "=== results ($(($(date +%s) - t_start)) s of a $budget s budget)"
cat "$results"
if [ ${#failed[@]} -gt 0 ]; then
  echo "gpu-session: FAILED: ${failed[*]}"
  exit 1
fi
echo "gpu-session: every stage passed"
