#!/usr/bin/env bash
# bench: every benchmark of the project, one section each, tables on stdout (`make bench`).
#
# Environment: MESHRUN_BIN (dir with meshrun and trainer) and MESHRUN_BUILD (build dir), set by
# the Makefile; BENCH_THREADS (default: OMP_NUM_THREADS, else all CPUs); BENCH_ONLY=name to run
# one section. Each section is a function named bench_<name>, listed in SECTIONS; add new
# sections the same way. A failing section is reported and the others still run; the exit
# status is non-zero if any failed.
set -u
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-/usr/bin/python3}
export MESHRUN_BIN=${MESHRUN_BIN:-$PWD/bin}
export MESHRUN_BUILD=${MESHRUN_BUILD:-$PWD/build}
THREADS=${BENCH_THREADS:-${OMP_NUM_THREADS:-$(nproc)}}

# --- section: trainer. Full training steps (forward, backward, clip, AdamW) of bin/trainer on
# the cpu backend against PyTorch eager on CPU, same model, batch and threads.
# PyTorch's matmuls run in OpenBLAS, which ignores torch.set_num_threads: pin its pool too, so
# both sides really use THREADS threads.
bench_trainer() {
  OPENBLAS_NUM_THREADS="$THREADS" "$PYTHON" bench/bench_trainer.py --threads "$THREADS"
}

# --- section: parallel. Each data/tensor-parallel plan at 4 ranks under bin/meshrun on the cpu
# backend against one process: ms/step, tokens/s, ratio, and bytes each collective moves per step.
bench_parallel() {
  "$PYTHON" bench/bench_parallel.py
}

# --- section: mixed. bf16 mixed precision against fp32: training throughput of bin/trainer and
# of PyTorch (eager, and autocast to bfloat16) at THREADS threads; the bytes each collective moves
# per step under FSDP and DDP at 4 ranks; per-rank memory by class and peak RSS with activation
# checkpointing off, full and selective. OpenBLAS pinned as in bench_trainer, for PyTorch's side.
bench_mixed() {
  OPENBLAS_NUM_THREADS="$THREADS" "$PYTHON" bench/bench_mixed.py --threads "$THREADS"
}

# --- section: launcher. meshrun's start-to-exit, failure-to-restart and 64-node rendezvous
# times, beside torchrun's when one is installed.
bench_launcher() {
  bench/bench_launcher.sh
}

# --- section: overlap. FSDP, HSDP and DDP with parallel.overlap off and on, one meshrun per
# emulated host (test/support/netcluster.py: network namespaces, links of 0.5, 1 and 2 Gbit/s with
# 200 us one way, a cgroup CPU budget per host): ms/step and the exposed communication
# (comm_wait_ms) off and on, against the issue's 60% target. Needs root (ip netns); says so and
# passes where namespaces cannot be made.
bench_overlap() {
  "$PYTHON" bench/bench_overlap.py
}

# --- section: pipeline. mesh.pp 2 and 4 with GPipe, 1F1B and interleaved 1F1B, one rank per
# emulated host (as overlap; on loopback where namespaces cannot be made): each rank's bubble
# (idle share of its step, from the runner's timestamps) beside (p-1)/(m+p-1) and its 1/v under
# interleaving, micro-batches in flight and the activation arena per rank.
bench_pipeline() {
  "$PYTHON" bench/bench_pipeline.py
}

# --- section: flight. The comm flight recorder's cost: small all_reduces with it off and on, side
# by side (comm_bench -R: medians, ratio, ns per call), and that cost times a tiny tp2 step's calls
# over the step's time, against the goal of under 1%.
bench_flight() {
  "$PYTHON" bench/bench_flight.py
}

# --- section: cp. Context parallelism at cp 2 and 4, one rank per emulated host (as overlap), K/V
# around the ring or all-gathered, parallel.overlap off and on: ms/step, exposed communication,
# the share overlap removed against the most it could, and the K/V bytes per step against the
# link's time for them.
bench_cp() {
  "$PYTHON" bench/bench_cp.py
}

SECTIONS="launcher trainer parallel mixed overlap pipeline flight cp"

failed=()
for s in $SECTIONS; do
  [ -n "${BENCH_ONLY:-}" ] && [ "$BENCH_ONLY" != "$s" ] && continue
  echo "== $s =="
  if ! "bench_$s"; then failed+=("$s"); echo "bench: section $s failed"; fi
  echo
done
[ ${#failed[@]} -eq 0 ] || { echo "bench: failed sections: ${failed[*]}"; exit 1; }
