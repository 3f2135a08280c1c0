#!/usr/bin/python3
"""bench_local_norms: the cost of the strategies' local gradient norms (dp.h: the per-tensor sums
of squares of each rank's own gradients before the reduction, which name the rank of a non-finite
gradient), off (MESHRUN_LOCAL_NORMS=0) and on, side by side.

    MESHRUN_BIN=$PWD/bin /usr/bin/python3 bench/bench_local_norms.py [--rounds 3] [--steps 12]

Two ranks on loopback (cpu backend, OMP_NUM_THREADS=1 each) under DDP (dp_replicate 2) and FSDP
(dp_shard 2), 2 micro-steps a step (the norms run on the last); the model: Llama dim 384, 4 layers,
hidden 1024, vocab 256 (7.3M parameters), micro-batch 2 x seq 64. Off and on alternate, --rounds
times each; a row is the median over rounds of rank 0's median step_ms over the steps after the
first. Columns: ms/step off and on, their ratio, and the expected GPU cost: the bytes the norms
read per step (4 per gradient element, this rank's whole local gradient) at 3 TB/s (an H100's HBM3 is 3.35).
"""
import argparse
import json
import os
import statistics
import subprocess
import tempfile

MODEL = ["model.dim=384", "model.n_layers=4", "model.n_heads=6", "model.n_kv_heads=6", "model.hidden_dim=1024",
         "model.vocab_size=256", "model.max_seq_len=64", "model.multiple_of=32"]
TRAIN = ["train.seq_len=64", "train.micro_batch_size=2", "train.global_batch_size=8", "train.warmup_steps=1",
         "data.format=synthetic", "eval.interval=0", "sample.tokens=0", "log.interval=1000", "device=cpu", "overwrite=true"]
PLANS = {"ddp": (["mesh.dp_replicate=2", "mesh.dp_shard=1"], 1), "fsdp": (["mesh.dp_replicate=1", "mesh.dp_shard=2"], 1)}
PARAMS = 7.3e6


def one(bin_dir, d, plan, on, steps):
    metrics = os.path.join(d, "m-%s-%d.jsonl" % (plan, on))
    if os.path.exists(metrics):
        os.unlink(metrics)
    sets = MODEL + TRAIN + PLANS[plan][0] + ["train.steps=%d" % steps, "log.metrics_file=" + metrics]
    env = dict(os.environ, OMP_NUM_THREADS="1", MESHRUN_LOCAL_NORMS="1" if on else "0")
    args = [os.path.join(bin_dir, "meshrun"), "--nproc_per_node=2", "--max_restarts=0",
            os.path.join(bin_dir, "trainer")]
    for s in sets:
        args += ["--set", s]
    subprocess.run(args, env=env, cwd=d, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    recs = [json.loads(l) for l in open(metrics) if '"step_ms"' in l]
    return statistics.median(r["step_ms"] for r in recs[1:])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=12)
    a = ap.parse_args()
    bin_dir = os.environ.get("MESHRUN_BIN", "bin")
    print("%-5s %10s %10s %8s %14s" % ("plan", "off ms", "on ms", "on/off", "GPU est. us"))
    with tempfile.TemporaryDirectory() as d:
        for plan in PLANS:
            t = {0: [], 1: []}
            for _ in range(a.rounds):
                for on in (0, 1):
                    t[on].append(one(bin_dir, d, plan, on, a.steps))
            off, on = statistics.median(t[0]), statistics.median(t[1])
            gpu_us = 4 * PARAMS * PLANS[plan][1] / 3e12 * 1e6
            print("%-5s %10.2f %10.2f %8.4f %14.1f" % (plan, off, on, on / off, gpu_us))


if __name__ == "__main__":
    main()
