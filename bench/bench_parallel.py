#!/usr/bin/python3
"""bench_parallel: each parallel plan at 4 ranks on the cpu backend, against one process.

    MESHRUN_BIN=$PWD/bin /usr/bin/python3 bench/bench_parallel.py [--steps N] [--warmup N] [--ranks N]

Every plan trains the same model on the same global batch (Llama dim 128, 4 layers, 4 heads / 2 kv
heads, vocab 256, global batch 16 x seq 64 = 1024 tokens per step, micro-batch 4 per rank) under
bin/meshrun with OMP_NUM_THREADS=1 per rank; the serial row is one process, also one thread.
Step times come from rank 0's metrics file (step_ms of each optimizer step; the first --warmup
steps excluded, median of the rest); tokens/s is global tokens per step over that time; "vs
serial" is serial ms / plan ms (> 1: faster). The byte columns are what rank 0 sent per step
(median), from the trainer's per-step "comm" record (comm_get_stats deltas): the strategy's
all_reduce / all_gather / reduce_scatter / broadcast, and everything on the tp group. On a
machine with fewer cores than ranks the ranks share cores, so times measure overhead, not
scaling. Tensor-parallel rows are marked "n/a" while the model refuses them.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEXT = os.path.join(REPO, "data", "tinyshakespeare.txt")
MODEL = {"dim": 128, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 256, "max_seq_len": 64,
         "multiple_of": 32}
G, B, T = 16, 4, 64

# name: (mesh (dp_replicate, dp_shard, tp) for --ranks 4, extra --set)
PLANS = [
    ("serial", None, []),
    ("ddp", (4, 1, 1), []),
    ("ddp+zero1", (4, 1, 1), ["parallel.zero=1"]),
    ("ddp+zero2", (4, 1, 1), ["parallel.zero=2"]),
    ("fsdp", (1, 4, 1), []),
    ("fsdp no-reshard", (1, 4, 1), ["parallel.reshard_after_forward=false"]),
    ("hsdp 2x2", (2, 2, 1), []),
    ("tp2 x dp2", (2, 1, 2), ["parallel.sequence_parallel=false", "parallel.loss_parallel=false"]),
    ("tp2+sp+loss x dp2", (2, 1, 2), []),
    ("fsdp2 x tp2", (1, 2, 2), []),
]


def run(bindir, d, mesh, extra, steps):
    plan = {"device": "cpu", "seed": 1, "model": MODEL,
            "train": {"steps": steps, "seq_len": T, "micro_batch_size": B, "global_batch_size": G,
                      "lr": 1e-3, "warmup_steps": 2},
            "data": {"train": TEXT, "format": "text"}, "eval": {"interval": 0}, "log": {"interval": 1000},
            "sample": {"tokens": 0}}
    path = os.path.join(d, "plan.json")
    with open(path, "w") as f:
        json.dump(plan, f)
    metrics = os.path.join(d, "metrics.jsonl")
    sets = ["--set", "log.metrics_file=" + metrics, "--set", "checkpoint.dir=" + os.path.join(d, "ck")]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MESHRUN_STORE"):
        env.pop(k, None)
    if mesh is None:
        cmd = [os.path.join(bindir, "trainer"), path] + sets
    else:
        r, s, t = mesh
        sets += ["--set", "mesh.dp_replicate=%d" % r, "--set", "mesh.dp_shard=%d" % s, "--set", "mesh.tp=%d" % t]
        for e in extra:
            sets += ["--set", e]
        cmd = [os.path.join(bindir, "meshrun"), "--nproc_per_node=%d" % (r * s * t),
               "--rdzv_conf=last_call_timeout=0.5,heartbeat_interval=0.1", os.path.join(bindir, "trainer"),
               path] + sets
    p = subprocess.run(cmd, cwd=d, env=env, capture_output=True, text=True, timeout=600)
    if p.returncode != 0:
        lines = [l for l in p.stderr.splitlines() if "trainer:" in l] or p.stderr.splitlines()[-1:]
        return None, lines[0] if lines else "rc %d" % p.returncode
    with open(metrics) as f:
        recs = [json.loads(l) for l in f if l.strip()]
    return [r for r in recs if "step_ms" in r], None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args()
    bindir = os.environ.get("MESHRUN_BIN", os.path.join(REPO, "bin"))
    cols = ["all_reduce", "all_gather", "reduce_scatter", "broadcast", "tp"]
    print("model dim %d, %d layers, global batch %d x %d tokens, micro-batch %d, cpu backend, 1 thread per rank, "
          "%d cores" % (MODEL["dim"], MODEL["n_layers"], G, T, B, os.cpu_count()))
    print("bytes: sent by rank 0 per optimizer step (median)")
    hdr = "%-20s %5s %9s %10s %7s" % ("plan", "ranks", "ms/step", "tokens/s", "vs ser") + \
        "".join(" %14s" % c for c in cols)
    print(hdr)
    print("-" * len(hdr))
    serial_ms = None
    failed = 0
    for name, mesh, extra in PLANS:
        with tempfile.TemporaryDirectory() as d:
            recs, why = run(bindir, d, mesh, extra, args.warmup + args.steps)
        ranks = 1 if mesh is None else mesh[0] * mesh[1] * mesh[2]
        if recs is None:
            if mesh and mesh[2] > 1 and ("not" in why and ("tp" in why or "tensor" in why)):
                print("%-20s %5d %9s  (%s)" % (name, ranks, "n/a", why.strip()[:90]))
            else:
                print("%-20s %5d %9s  FAILED: %s" % (name, ranks, "-", why.strip()[:90]))
                failed += 1
            continue
        timed = recs[args.warmup:] or recs
        ms = statistics.median(r["step_ms"] for r in timed)
        if serial_ms is None:
            serial_ms = ms
        comm = [statistics.median(r.get("comm", {}).get(c, 0) for r in timed) for c in cols]
        print("%-20s %5d %9.2f %10.0f %7.2f" % (name, ranks, ms, G * T / (ms / 1e3), serial_ms / ms) +
              "".join(" %14.0f" % c for c in comm))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
