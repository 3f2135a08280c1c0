#!/usr/bin/env bash
# test-gpu: the checks that need a GPU (make test-gpu), designed to finish within 10 minutes on
# one GPU. In order:
#   1. each GPU test binary given as an argument, in its own process: CUDA kernels against the cpu
#      backend in fp32 and bf16, determinism, NCCL bootstrap in a group of one through the store
#      and the staged comm over the cuda backend (test_nccl);
#   2. training equivalence: 20 steps of a small plan in fp32 (TF32 off:
#      parallel.mixed_precision.allow_tf32=false) on device cuda vs device cpu, every step's loss
#      within 1e-4 (max difference printed), and the cuda run twice for the same loss bits;
#   3. bf16 mixed precision: 20 steps on cuda against the cpu backend's bf16 losses (the same
#      arithmetic up to summation order) and the cpu fp32 ones, each within 2e-2 relative; FSDP
#      over 2 ranks in bf16 (staged comm, bf16 all-gathers) against the serial cuda bf16 losses
#      within 2e-2; and the defaults of a GPU machine: device auto picks cuda, and param_dtype
#      left at its default trains in bf16 with one log line saying so; the cuda bf16 run recorded
#      steps 3 and 4 (train.cuda_graphs auto) and replayed them, with the loss bits of the same
#      run unrecorded; meshrun's health check measures the GPUs: `trainer --health-gemm` names
#      cuda and bf16 above 200 TFLOP/s, and meshrun --health_check's line says cuda;
#   4. multi-rank plans on the one GPU through the staged comm under bin/meshrun (ddp2, fsdp2,
#      tp2, pp2: the pipeline's sends and receives; cp2: ring attention's blocks and sends, in bf16
#      on cuDNN's kernels where the serial run's attention is cuDNN's;
#      MESHRUN_COMM_BACKEND=staged), each against the serial cuda losses within 1e-4 relative
#      (the parallel plans' tolerance on cpu), TF32 off; then, with 2 or more GPUs, the same plans
#      with the comm backend the trainer picks there (nccl: one GPU per rank), within 1e-4 of the
#      serial cuda losses too (skipped on one GPU);
#   5. compute-sanitizer memcheck on a 2-step cuda run (when compute-sanitizer exists).
# Closing line: "test-gpu: N passed, N failed (N not yet: ...)". Exits non-zero on any failure,
# when no GPU is visible, or when there is nothing to run (a build without nvcc has no GPU tests).
# Environment (set by the Makefile): MESHRUN_BIN (programs), MESHRUN_BUILD (objects).
# TEST_GPU_SECTIONS picks sections, a comma list of binaries (1), train (2, 3), parallel (4: needs
# train's serial runs, in the same invocation) and sanitizer (5); all by default. Without
# binaries no test binary need be given. TEST_GPU_RESULTS=FILE appends one JSON object per check
# to FILE as it ends ({"check": "test-gpu", "name": ..., "result": "pass"|"fail"}), so a run cut
# short keeps what it found. TEST_GPU_TIMEOUT: seconds for each test binary (default 300).
# TEST_GPU_DEVICE=cpu dry-runs the script's own logic on a machine without a GPU: every "cuda"
# run becomes a cpu run (then the comparisons must pass trivially, and nothing about CUDA is shown;
# the device-auto check and the nccl plans are skipped).
#
# In a GPU session. The GPU machine has no network and no libuv/cJSON/OpenBLAS/cmocka/Nettle, so
# the programs travel as a kit built here (nvcc 13 and NCCL exist here; scripts/make-kit.sh says
# what it holds, scripts/test-kit.sh proves it runs with the system's copies hidden):
#   here:   scripts/make-kit.sh && scripts/test-kit.sh     # build/kit, ~54 MiB (carry limit 64)
#   there, with the device tool, carry ["build/kit"], one command writing into $OUT:
#     scripts/gpu-session.sh $OUT     # versions, smoke test, this script's sections, the benchmark
#                                     # and kernel profile, in a time budget (--dry-run here first)
# To build there instead (a newer host compiler: WERROR defaults to 0 off gcc 12; NCCL from
# PyTorch's wheel): carry the -dev .debs (scripts/test-deps-prefix.sh downloads them into
# build/debs and proves such a build here with the system's headers hidden), unpack each with
# dpkg -x into a prefix, and
#   make DEPS_PREFIX=/tmp/deps NCCL_HOME=$(python3 -c 'import nvidia.nccl as n; print(n.__path__[0])') all
# Where the dependencies are installed (nvcc and NCCL present, one GPU is enough):
#   make BUILD=build/gpu BIN=build/gpu/bin all            # builds the cuda backend and GPU tests
#   make BUILD=build/gpu BIN=build/gpu/bin test-gpu       # runs this script with the GPU tests
# or, the script alone on an existing build:
#   MESHRUN_BIN=build/gpu/bin MESHRUN_BUILD=build/gpu scripts/test-gpu.sh build/gpu/test-gpu/test_*
# The dry run of the script's logic, anywhere:
#   TEST_GPU_DEVICE=cpu MESHRUN_BIN=build/gpu/bin scripts/test-gpu.sh /bin/true
# One staged plan by hand (2 ranks sharing the GPU):
#   MESHRUN_COMM_BACKEND=staged build/gpu/bin/meshrun --standalone --nproc_per_node=2 \
#     build/gpu/bin/trainer configs/tiny.json --set device=cuda --set mesh.dp_shard=2
set -u
DEV=${TEST_GPU_DEVICE:-cuda}
pass=0; fail=0; failed=(); notyet=(); skipped=()
SECTIONS=${TEST_GPU_SECTIONS:-binaries,train,parallel,sanitizer}
RESULTS=${TEST_GPU_RESULTS:-}
has() { case ",$SECTIONS," in *",$1,"*) return 0 ;; esac; return 1; }
# record NAME pass|fail: one JSON line in $RESULTS (quotes and backslashes escaped)
record() {
  [ -n "$RESULTS" ] || return 0
  local n=${1//\\/\\\\}
  n=${n//\"/\\\"}
  printf '{"check":"test-gpu","name":"%s","result":"%s"}\n' "$n" "$2" >>"$RESULTS"
}
BIN=${MESHRUN_BIN:-$(cd "$(dirname "$0")/.." && pwd)/bin}
TRAINER=$BIN/trainer
MESHRUN=$BIN/meshrun

ok()  { echo "   PASS: $1"; pass=$((pass+1)); record "$1" pass; }
bad() { echo "   FAIL: $1"; fail=$((fail+1)); failed+=("$1"); record "$1" fail; }

if [ $# -eq 0 ] && has binaries; then
  echo "test-gpu: no GPU test binaries given (was this built without nvcc? the cuda backend builds only where nvcc exists)"
  echo "test-gpu: 0 passed, 1 failed"
  exit 1
fi

# A visible GPU, by nvidia-smi where it exists; without it the binaries' own message says why
# (the cuda backend reports "cuda: no GPU visible (cudaGetDeviceCount: ...)").
if [ "$DEV" = cuda ] && command -v nvidia-smi >/dev/null 2>&1; then
  if ! nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
    echo "test-gpu: no GPU visible (nvidia-smi -L lists none; CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES-unset})"
    echo "test-gpu: 0 passed, 1 failed"
    exit 1
  fi
  nvidia-smi -L
fi

# --- 1. GPU test binaries ------------------------------------------------------------------------
for t in "$@"; do
  has binaries || break
  echo "== $(basename "$t")"
  if timeout "${TEST_GPU_TIMEOUT:-300}" "$t"; then ok "$(basename "$t")"; else bad "$(basename "$t")"; fi
done

# --- the plan of the training checks -------------------------------------------------------------
# A small Llama where every sharded size divides by 2 (dim 128, 4 heads, 2 kv heads, hidden 352,
# vocab 256), synthetic tokens, a global batch of 8 sequences of 64 (micro-batch 4, so the serial
# run accumulates 2 micro-steps and ddp2/fsdp2 one each), no eval, no sampling.
work=$(mktemp -d /tmp/test-gpu.XXXXXX)
trap 'rm -rf "$work"' EXIT
cat >"$work/plan.json" <<'EOF'
{
  "device": "cpu",
  "seed": 1337,
  "overwrite": true,
  "model": {"dim": 128, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 256,
            "max_seq_len": 64, "multiple_of": 32},
  "mesh": {"dp_replicate": 1, "dp_shard": 1, "tp": 1},
  "train": {"steps": 20, "seq_len": 64, "micro_batch_size": 4, "global_batch_size": 8,
            "lr": 3e-3, "warmup_steps": 2, "decay": "cosine"},
  "data": {"train": "", "format": "synthetic"},
  "eval": {"interval": 0, "batches": 1},
  "log": {"interval": 5},
  "sample": {"tokens": 0}
}
EOF

# run NAME DEVICE DTYPE [more --set values]: one process, metrics in $work/NAME.jsonl, output in
# $work/NAME.log. Returns the trainer's status.
run() {
  local name=$1 dev=$2 dtype=$3; shift 3
  local sets=(--set "device=$dev" --set "parallel.mixed_precision.param_dtype=$dtype"
              --set parallel.mixed_precision.allow_tf32=false --set "log.metrics_file=$work/$name.jsonl")
  for kv in "$@"; do sets+=(--set "$kv"); done
  (unset RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE MESHRUN_STORE
   OMP_NUM_THREADS=${OMP_NUM_THREADS:-4} timeout 300 "$TRAINER" "$work/plan.json" "${sets[@]}") \
    >"$work/$name.log" 2>&1
}

# compare A B TOL MODE: losses of every step of two metrics files; MODE abs|rel|bits. Prints the
# max difference; returns 0 when within TOL and both have the same steps.
compare() {
  awk -v tol="$3" -v mode="$4" -v na="$1" -v nb="$2" '
    function loss(line) { if (match(line, /"loss":[-+0-9.eEnaif]+/)) return substr(line, RSTART + 7, RLENGTH - 7); return "" }
    function step(line) { if (match(line, /"step":[0-9]+/)) return substr(line, RSTART + 7, RLENGTH - 7); return "" }
    FNR == NR { l = loss($0); if (l != "") { a[step($0)] = l; n++ } next }
    { l = loss($0); if (l != "") { s = step($0); m++
        if (!(s in a)) { missing++; next }
        if (mode == "bits") { if (a[s] != l) diffs++; next }
        d = a[s] - l; if (d < 0) d = -d
        if (mode == "rel") { r = a[s] < 0 ? -a[s] : a[s]; d = r > 0 ? d / r : d }
        if (d > max || d != d) max = d } }
    END {
      if (n == 0 || m != n || missing) { printf "   %s has %d steps, %s has %d\n", na, n, nb, m; exit 1 }
      if (mode == "bits") { printf "   %d steps, %d with different loss bits\n", n, diffs; exit diffs > 0 }
      printf "   %d steps, max %s loss difference %.3g (tolerance %g)\n", n, mode == "rel" ? "relative" : "absolute", max, tol
      exit !(max <= tol) }' "$1" "$2"
}

tail_log() { sed -n '$p' "$work/$1.log" | sed 's/^/   /'; }

# --- 2. training equivalence, fp32 -----------------------------------------------------------------
if has train; then
echo "== training equivalence (20 steps, fp32, TF32 off): cuda vs cpu losses"
if ! run cpu cpu fp32; then bad "cpu reference run"; tail_log cpu
elif ! run cuda "$DEV" fp32; then bad "cuda fp32 run"; tail_log cuda
else
  if compare "$work/cpu.jsonl" "$work/cuda.jsonl" 1e-4 abs; then ok "cuda fp32 losses = cpu within 1e-4"
  else bad "cuda fp32 losses vs cpu"; fi
  if run cuda_again "$DEV" fp32 && compare "$work/cuda.jsonl" "$work/cuda_again.jsonl" 0 bits; then
    ok "cuda run twice: same loss bits"
  else bad "cuda determinism (two runs)"; tail_log cuda_again; fi
fi

# --- 3. bf16 ------------------------------------------------------------------------------------
echo "== bf16 mixed precision (20 steps): cuda bf16 vs cpu bf16 and cpu fp32 losses"
if ! run cpu_bf16 cpu bf16; then bad "cpu bf16 reference run"; tail_log cpu_bf16
elif run cuda_bf16 "$DEV" bf16; then
  if compare "$work/cpu_bf16.jsonl" "$work/cuda_bf16.jsonl" 2e-2 rel; then ok "cuda bf16 losses = cpu bf16 within 2e-2"
  else bad "cuda bf16 losses vs cpu bf16"; fi
  if compare "$work/cpu.jsonl" "$work/cuda_bf16.jsonl" 2e-2 rel; then ok "cuda bf16 losses = cpu fp32 within 2e-2"
  else bad "cuda bf16 losses vs cpu fp32"; fi
  if run cuda_bf16_again "$DEV" bf16 && compare "$work/cuda_bf16.jsonl" "$work/cuda_bf16_again.jsonl" 0 bits; then
    ok "cuda bf16 run twice: same loss bits"
  else bad "cuda bf16 determinism (two runs)"; tail_log cuda_bf16_again; fi
else bad "cuda bf16 run"; tail_log cuda_bf16; fi

echo "== recorded steps (train.cuda_graphs auto): the cuda bf16 run recorded steps 3 and 4; unrecorded, the same bits"
if [ "$DEV" = cuda ]; then
  if ! grep -q "train.cuda_graphs: step 4 recorded" "$work/cuda_bf16.log"; then
    bad "the cuda bf16 run recorded no steps 3 and 4"; grep -m3 "cuda_graphs" "$work/cuda_bf16.log" | sed 's/^/   /'
  elif run cuda_bf16_unrecorded "$DEV" bf16 train.cuda_graphs=off &&
       compare "$work/cuda_bf16.jsonl" "$work/cuda_bf16_unrecorded.jsonl" 0 bits; then
    ok "cuda bf16 replayed steps = unrecorded steps, same loss bits"
  else bad "cuda bf16 replayed vs unrecorded steps"; tail_log cuda_bf16_unrecorded; fi
else
  echo "   skipped: TEST_GPU_DEVICE=$DEV (records nothing)"; skipped+=("graphs")
fi

echo "== the defaults on a GPU machine: device auto, param_dtype unset"
if [ "$DEV" = cuda ]; then
  (unset RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE MESHRUN_STORE
   timeout 300 "$TRAINER" "$work/plan.json" --set device=auto --set train.steps=2) >"$work/defaults.log" 2>&1
  rc=$?
  if [ $rc -ne 0 ]; then bad "device auto, default param_dtype (status $rc)"; tail_log defaults
  elif ! grep -q "device auto: cuda" "$work/defaults.log"; then
    bad "device auto did not pick cuda"; grep -m1 "device auto" "$work/defaults.log" | sed 's/^/   /'
  elif ! grep -q "param_dtype bf16, reduce_dtype fp32 (param_dtype: the device's default)" "$work/defaults.log"; then
    bad "default param_dtype on cuda: no line saying it trains in bf16"
  else ok "device auto picks cuda; default param_dtype trains in bf16 with a log line"; fi
else
  echo "   skipped: TEST_GPU_DEVICE=$DEV"; skipped+=("defaults")
fi

# meshrun --health_check measures the GPUs through the trainer's probe (launcher/health_probe.h):
# one line of JSON naming cuda and bf16, at more than 200 TFLOP/s (an H100's or H200's dense bf16
# peak is ~990, cuBLASLt reaches 600-750 at 4096^3; fp32 products, or a GPU at a fraction of its
# clocks, fall below), then meshrun's line saying so. Under TEST_GPU_DEVICE=cpu: cpu, fp32, > 0.
echo "== the health check's GEMM: trainer --health-gemm, then meshrun --health_check's line"
if [ "$DEV" = cuda ]; then hide=(); want=bf16; min=200000; nproc=gpu
else hide=(CUDA_VISIBLE_DEVICES=); want=fp32; min=0; nproc=1; fi
t0=$(date +%s.%N)
probe=$( (unset RANK WORLD_SIZE LOCAL_RANK MESHRUN_STORE
          env "${hide[@]}" LOCAL_WORLD_SIZE=1 timeout 60 "$TRAINER" --health-gemm) 2>"$work/probe.log")
rc=$?
took=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.2f", b - a }')
if [ $rc -ne 0 ]; then bad "trainer --health-gemm (status $rc)"; tail -3 "$work/probe.log" | sed 's/^/   /'
elif python3 -c '
import json, sys
p = json.loads(sys.argv[1])
print("   %s: %.1f TFLOP/s (devices %s) on %s in %s, %ss in all (bound: > %g TFLOP/s)" % (
    sys.argv[1], p["gflops"] / 1000, p["devices"], p["device"], p["dtype"], sys.argv[5], float(sys.argv[4]) / 1000))
sys.exit(not (p["device"] == sys.argv[2] and p["dtype"] == sys.argv[3] and p["gflops"] > float(sys.argv[4])))
' "$probe" "$DEV" "$want" "$min" "$took"; then ok "trainer --health-gemm: $DEV, $want, above the bound"
else bad "trainer --health-gemm: not $DEV in $want above $min GFLOP/s"; fi
(unset RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE MESHRUN_STORE
 env "${hide[@]}" timeout 120 "$MESHRUN" --standalone --nproc_per_node=$nproc --health_check --no_python /bin/true) \
  >"$work/health.log" 2>&1
rc=$?
line=$(grep -m1 "health check: this node's GEMM" "$work/health.log")
echo "   ${line:-no line}"
if [ $rc -eq 0 ] && echo "$line" | grep -Eq "GEMM [0-9.]+ [TG]FLOP/s on $DEV( x[0-9]+)? in $want \\("; then
  ok "meshrun --health_check: the GEMM measured on $DEV"
else bad "meshrun --health_check on $DEV (status $rc)"; tail -3 "$work/health.log" | sed 's/^/   /'; fi
fi # train

# --- 4. multi-rank plans on one GPU (staged comm), then on several GPUs (nccl) -----------------
FAST_CONF="join_timeout=20,last_call_timeout=0.5,heartbeat_interval=0.1,heartbeat_timeout=1"
declare -A MESH=([ddp2]="2 1 1 1 1" [fsdp2]="1 2 1 1 1" [tp2]="1 1 2 1 1" [pp2]="1 1 1 2 1" [cp2]="1 1 1 1 2")
# parallel_plan PLAN COMM WANT [DTYPE]: 2 ranks under meshrun with MESHRUN_COMM_BACKEND=COMM (""
# = the trainer's choice), losses against the serial cuda run of DTYPE (fp32: within 1e-4; bf16:
# within 2e-2); the comm backend rank 0 logged must be WANT. A cp plan prints the line that says
# which kernel ran its attention blocks; in bf16 on cuda, where the serial run's attention was
# cuDNN's (model.attention auto), the ring's blocks must have run on it too.
parallel_plan() {
  local plan=$1 comm=$2 want=$3 dtype=${4:-fp32} r s t q c rc
  local name="$1_${3}_$dtype" ref="$work/cuda.jsonl" tol=1e-4
  [ "$dtype" = bf16 ] && ref="$work/cuda_bf16.jsonl" tol=2e-2
  read -r r s t q c <<<"${MESH[$plan]}"
  if [ ! -s "$ref" ]; then bad "$name (no serial cuda $dtype losses to compare with)"; return; fi
  (unset RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE MESHRUN_STORE
   MESHRUN_COMM_BACKEND=$comm OMP_NUM_THREADS=2 timeout 300 "$MESHRUN" --standalone --nproc_per_node=2 \
     --rdzv_conf="$FAST_CONF" "$TRAINER" "$work/plan.json" --set "device=$DEV" \
     --set parallel.mixed_precision.param_dtype=$dtype --set parallel.mixed_precision.allow_tf32=false \
     --set "log.metrics_file=$work/$name.jsonl" \
     --set mesh.dp_replicate=$r --set mesh.dp_shard=$s --set mesh.tp=$t --set mesh.pp=$q --set mesh.cp=$c) \
     >"$work/$name.log" 2>&1
  rc=$?
  if [ $rc -ne 0 ]; then
    bad "$name run, status $rc"; grep -m3 -i "error\|trainer:" "$work/$name.log" | sed 's/^/   /'
  elif ! grep -q "comm backend $want " "$work/$name.log"; then
    bad "$name: rank 0 did not log comm backend $want"; grep -m1 "comm backend" "$work/$name.log" | sed 's/^/   /'
  elif [ "$c" -gt 1 ] && ! grep -m1 "context parallel over" "$work/$name.log" | sed 's/^/   /' | grep .; then
    bad "$name: no log line saying which kernel ran the attention blocks"
  elif [ "$c" -gt 1 ] && [ "$DEV" = cuda ] && [ "$dtype" = bf16 ] && grep -q "attention: cuDNN" "$work/cuda_bf16.log" &&
       ! grep -q "blocks on the fused kernel" "$work/$name.log"; then
    bad "$name: the serial run's attention was cuDNN's, the ring's blocks were not"
  elif compare "$ref" "$work/$name.jsonl" $tol rel; then ok "$name losses = serial cuda $dtype within $tol"
  else bad "$name losses vs serial cuda $dtype"; fi
}
if has parallel; then
echo "== parallel plans on one GPU through the staged comm (meshrun, 2 ranks each) vs serial cuda"
for plan in ddp2 fsdp2 tp2 pp2 cp2; do parallel_plan $plan staged staged; done
parallel_plan fsdp2 staged staged bf16
parallel_plan pp2 staged staged bf16
parallel_plan cp2 staged staged bf16

echo "== parallel plans on 2 GPUs through nccl (the trainer's choice with one GPU per rank)"
ngpu=0
[ "$DEV" = cuda ] && command -v nvidia-smi >/dev/null 2>&1 && ngpu=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')
if [ "$ngpu" -ge 2 ]; then
  for plan in ddp2 fsdp2 tp2 pp2 cp2; do parallel_plan $plan "" nccl; done
  parallel_plan fsdp2 "" nccl bf16
else
  echo "   skipped: $ngpu GPU(s) visible, nccl needs one per rank"; skipped+=("nccl plans")
fi
fi # parallel

# --- 5. compute-sanitizer -----------------------------------------------------------------------
if has sanitizer; then
echo "== compute-sanitizer memcheck (2 cuda steps, fp32 then bf16)"
SAN=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null)
if [ -n "$SAN" ]; then
  for dtype in fp32 bf16; do
    (unset RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE MESHRUN_STORE
     timeout 240 "$SAN" --tool memcheck --error-exitcode 99 --print-limit 20 "$TRAINER" "$work/plan.json" \
       --set device=cuda --set parallel.mixed_precision.param_dtype=$dtype --set train.steps=2 \
       --set train.global_batch_size=4) >"$work/sanitizer_$dtype.log" 2>&1
    rc=$?
    grep -m1 "ERROR SUMMARY" "$work/sanitizer_$dtype.log" | sed 's/^/   /'
    if [ $rc -eq 0 ]; then ok "compute-sanitizer memcheck ($dtype)"
    else bad "compute-sanitizer memcheck $dtype (status $rc)"; grep -m10 "=========" "$work/sanitizer_$dtype.log" | sed 's/^/   /'; fi
  done
else
  echo "   skipped: compute-sanitizer not found"; skipped+=("compute-sanitizer")
fi
fi # sanitizer

[ $fail -eq 0 ] || echo "failed: ${failed[*]}"
extra=""
[ ${#notyet[@]} -eq 0 ] || extra=" (${#notyet[@]} not yet: ${notyet[*]})"
[ ${#skipped[@]} -eq 0 ] || extra="$extra (skipped: ${skipped[*]})"
echo "test-gpu: $pass passed, $fail failed$extra"
[ $fail -eq 0 ]
