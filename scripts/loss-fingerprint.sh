#!/usr/bin/env bash
# loss-fingerprint: the fp32 losses of the reference plans, one line per plan, for checking that
# a change which must not change a bit (a restructuring, overlapped communication) does not.
#
#   scripts/loss-fingerprint.sh BIN OUT.txt        # BIN holds meshrun and trainer
#   diff before.txt after.txt                      # empty: bit-identical
#
# Plans (one thread per rank, 10 steps of the tiny Llama of test_parallel.py, global batch 16):
# serial, ddp2+zero1, fsdp4, hsdp 2x2, tp2 (sequence and loss parallel), fsdp2 x tp2. Each line
# is "plan: loss loss ..." with the losses as the metrics file records them (every bit: %.9g).
set -euo pipefail
bin=${1:?usage: loss-fingerprint.sh BIN OUT.txt}
out=${2:?usage: loss-fingerprint.sh BIN OUT.txt}
root=$(cd "$(dirname "$0")/.." && pwd)
bin=$(cd "$bin" && pwd)
work=$(mktemp -d /tmp/fingerprint.XXXXXX)
trap 'rm -rf "$work"' EXIT
cat >"$work/plan.json" <<EOF
{"device": "cpu", "seed": 1337,
 "model": {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 256, "max_seq_len": 32, "multiple_of": 32},
 "mesh": {"dp_replicate": 1, "dp_shard": 1, "tp": 1},
 "train": {"steps": 10, "seq_len": 32, "micro_batch_size": 2, "global_batch_size": 16, "lr": 3e-3, "warmup_steps": 2, "decay": "cosine"},
 "data": {"train": "$root/data/tinyshakespeare.txt", "format": "text"},
 "eval": {"interval": 0}, "log": {"interval": 10}, "sample": {"tokens": 0}}
EOF
export OMP_NUM_THREADS=1
conf="join_timeout=30,last_call_timeout=0.2,heartbeat_interval=0.2,heartbeat_timeout=5"
: >"$out"
run() { # name ranks dp_replicate dp_shard tp [--set ...]
  local name=$1 n=$2 r=$3 s=$4 t=$5; shift 5
  local sets=(--set mesh.dp_replicate="$r" --set mesh.dp_shard="$s" --set mesh.tp="$t"
              --set log.metrics_file="$work/$name.jsonl" --set checkpoint.dir="$work/$name.ckpt" "$@")
  if [ "$n" -eq 1 ]; then
    "$bin/trainer" "$work/plan.json" "${sets[@]}" >"$work/$name.log" 2>&1
  else
    "$bin/meshrun" --standalone --nproc_per_node="$n" --rdzv_conf="$conf" "$bin/trainer" "$work/plan.json" \
      "${sets[@]}" >"$work/$name.log" 2>&1
  fi || { echo "loss-fingerprint: $name failed:" >&2; tail -5 "$work/$name.log" >&2; exit 1; }
  /usr/bin/python3 - "$name" "$work/$name.jsonl" >>"$out" <<'PY'
import json, sys
losses = [r["loss"] for r in map(json.loads, open(sys.argv[2])) if "loss" in r and "step" in r and r.get("kind", "step") == "step"]
print(sys.argv[1] + ": " + " ".join("%.9g" % x for x in losses))
PY
}
run serial 1 1 1 1
run ddp2_zero1 2 2 1 1 --set parallel.zero=1
run fsdp4 4 1 4 1
run hsdp2x2 4 2 2 1
run tp2 2 1 1 2 --set parallel.sequence_parallel=true --set parallel.loss_parallel=true
run fsdp2_tp2 4 1 2 2
cat "$out"
