#!/usr/bin/python3
"""bench_pipeline: the pipeline's bubble and memory per stage, measured beside the theory.

    MESHRUN_BIN=$PWD/bin MESHRUN_BUILD=$PWD/build /usr/bin/python3 bench/bench_pipeline.py
        [--pp 2,4] [--micro 8,16] [--schedules gpipe,1f1b,interleaved_1f1b] [--steps 6]
        [--rate 1gbit] [--delay 200us] [--cpu auto] [--loopback]

One row per (pp, micro-batches, schedule): bin/trainer with mesh.pp = pp, one rank per emulated
host (test/support/netcluster.py: network namespaces on one switch, links at --rate with --delay one
way, a cgroup CPU budget per host, as bench_overlap), or with --loopback (or where namespaces
cannot be made) pp ranks of one meshrun on this machine's loopback, sharing its cores. The model:
Llama dim 256, 8 layers, 4 heads, hidden 768, vocab 256, seq 64; every pipeline micro-batch is
one sequence (train.micro_batch_size 1, global batch = micro-batches), synthetic data, OMP 1.

From rank 0's metrics file, the pipeline records (one per step, every pp rank's numbers): the
bubble of each rank, 1 - (time in its forwards and backwards) / (its step's span, first action to
last transfer), the median over the counted steps (the first is warm-up); "bubble" is their mean
over ranks, beside the theory for equal stages and free transfers, (p-1)/(m+p-1) for GPipe and
1F1B and (p-1)/(v*m+p-1) interleaved (v = 2 here); "in flight" the most micro-batches any rank
held between forward and backward (per rank: 1F1B p-r, GPipe m; interleaved counts each virtual
stage's); "act MB" each rank's activation arena (its slots: what the schedule makes it keep).
"step/1f1b": the step time over 1F1B's at the same (pp, m), beside the theory's
(1 - bubble_1f1b) / (1 - bubble): the same work takes 1/(1 - bubble) of it.

Two things keep the idle fraction from being the whole story. The stages are not equal (the last
holds the output layer and the loss, the first the embedding) and transfers take time. And under a
CPU budget (a cgroup quota per period) a rank that idled part of a period computes at full speed
until the period's quota is spent, so its forwards and backwards take less wall time than a
busier rank's: the idle fraction of a schedule with more, shorter gaps (interleaving) understates
what it saved, which the step time shows.
"""
import argparse
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "test", "support"))
import netcluster  # noqa: E402  (test/support/netcluster.py, the emulated network's one module)

MODEL = ["model.dim=256", "model.n_layers=8", "model.n_heads=4", "model.n_kv_heads=4", "model.hidden_dim=768",
         "model.vocab_size=256", "model.max_seq_len=64"]
TRAIN = ["train.seq_len=64", "train.micro_batch_size=1", "train.warmup_steps=1", "data.format=synthetic",
         "eval.interval=0", "sample.tokens=0", "log.interval=1000", "mesh.dp_shard=1"]
CONF = "last_call_timeout=0.5,heartbeat_interval=0.1,join_timeout=60"


def theory(sched, p, m, v=2):
    return (p - 1) / (v * m + p - 1) if sched == "interleaved_1f1b" else (p - 1) / (m + p - 1)


def run(cluster, meshrun, trainer, p, m, sched, steps, d):
    """One job; returns (pipeline records of the counted steps, None) or (None, why)."""
    metrics = os.path.join(d, "metrics.jsonl")
    sets = MODEL + TRAIN + ["train.steps=%d" % steps, "train.global_batch_size=%d" % m, "mesh.pp=%d" % p,
                            "parallel.pp_schedule=" + sched, "log.metrics_file=" + metrics]
    log = os.path.join(d, "job.log")
    with open(log, "wb") as out:  # a file, not a pipe: a rank never stalls on a full pipe
        if cluster:
            args = ["--nproc_per_node=1", "--rdzv_conf=" + CONF, "--max_restarts=0", trainer]
            for s in sets:
                args += ["--set", s]
            procs = netcluster.start_meshrun(cluster, args, meshrun=meshrun, env={"OMP_NUM_THREADS": "1"}, cwd=d,
                                             stdout=out, stderr=subprocess.STDOUT)
            codes = netcluster.wait_all(procs, 600)
        else:
            args = [meshrun, "--nproc_per_node=%d" % p, "--rdzv_conf=" + CONF, "--max_restarts=0", trainer]
            for s in sets:
                args += ["--set", s]
            codes = [subprocess.run(args, cwd=d, stdout=out, stderr=subprocess.STDOUT, timeout=600,
                                    env=dict(os.environ, OMP_NUM_THREADS="1")).returncode]
    if any(codes):
        with open(log, errors="replace") as fh:
            text = fh.read().splitlines()
        lines = [l for l in text if "error" in l.lower()] or text[-1:]
        return None, "exit %s: %s" % (codes, lines[0].strip() if lines else "")
    recs = [r for r in netcluster.read_metrics(metrics) if "pp_bubble" in r]
    steps_ms = [r["step_ms"] for r in netcluster.read_metrics(metrics) if "step_ms" in r][1:]
    return (recs[1:], statistics.median(steps_ms) if steps_ms else None), None


def rows_for(a, cluster, meshrun, trainer, p):
    out, base = [], {}  # base[m]: 1F1B's ms/step
    for m in [int(x) for x in a.micro.split(",") if x]:
        for sched in [s for s in a.schedules.split(",") if s]:
            if sched == "1f1b" and m < p or sched == "interleaved_1f1b" and (m % p or 2 * p > 8):
                continue
            with tempfile.TemporaryDirectory(prefix="bench_pipeline.") as d:
                res, why = run(cluster, meshrun, trainer, p, m, sched, a.steps, d)
            if why:
                out.append("%3d %4d %-17s failed: %s" % (p, m, sched, why))
                print(out[-1], file=sys.stderr, flush=True)
                continue
            recs, step_ms = res
            per_rank = [statistics.median(r["pp_bubble"][q] for r in recs) for q in range(p)]
            bubble = sum(per_rank) / p
            inflight = recs[-1]["pp_peak_inflight"]
            act = [b / 1e6 for b in recs[-1]["pp_act_bytes"]]
            if sched == "1f1b":
                base[m] = step_ms
            ratio = "%.2f" % (step_ms / base[m]) if step_ms and base.get(m) else "n/a"
            want = (1 - theory("1f1b", p, m)) / (1 - theory(sched, p, m))
            out.append("%3d %4d %-17s %8.1f %7.1f%% %7.1f%% %9s %7.2f %-26s %-18s %s" % (
                p, m, sched, step_ms or 0.0, 100 * bubble, 100 * theory(sched, p, m), ratio, want,
                ",".join("%.0f%%" % (100 * x) for x in per_rank), ",".join("%d" % x for x in inflight),
                ",".join("%.1f" % x for x in act)))
            print(out[-1], file=sys.stderr, flush=True)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pp", default="2,4")
    ap.add_argument("--micro", default="8,16", help="micro-batches per step (pp_microbatches)")
    ap.add_argument("--schedules", default="1f1b,gpipe,interleaved_1f1b", help="1f1b first: the others' step/1f1b")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--rate", default="1gbit")
    ap.add_argument("--delay", default="200us", help="one way, tc units; 0 for none")
    ap.add_argument("--cpu", default="auto", help="cores per emulated host: auto, a number, or none")
    ap.add_argument("--loopback", action="store_true", help="one meshrun on loopback, no emulated hosts")
    a = ap.parse_args()
    bindir = os.path.abspath(os.environ.get("MESHRUN_BIN") or os.path.join(netcluster.REPO, "bin"))
    meshrun, trainer = os.path.join(bindir, "meshrun"), os.path.join(bindir, "trainer")
    ok, why = (False, "--loopback") if a.loopback else netcluster.can_create()
    where = "loopback, one meshrun, the ranks sharing %d cores (%s)" % (os.cpu_count(), why)
    rows = []
    for p in [int(x) for x in a.pp.split(",") if x]:
        if ok:
            with netcluster.Cluster(p, rate=a.rate, delay=a.delay, cpu=a.cpu) as c:
                where = "%s, %s, %s one way, CPU per host %s" % (
                    c.shaping, a.rate, a.delay, "unlimited" if c.cpu is None else "%.2g cores" % c.cpu)
                rows += rows_for(a, c, meshrun, trainer, p)
        else:
            rows += rows_for(a, None, meshrun, trainer, p)
    print("pipeline: %s; model dim 256 x 8 layers, micro-batch 1 x seq 64, %d steps, first not counted" % (
        where, a.steps))
    print("%3s %4s %-17s %8s %8s %8s %9s %7s %-26s %-18s %s" % (
        "pp", "m", "schedule", "ms/step", "bubble", "theory", "step/1f1b", "theory", "bubble per rank",
        "in flight/rank", "act MB/rank"))
    for r in rows:
        print(r)
    return 1 if any("failed" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
