#!/usr/bin/python3
"""bench_mixed: bf16 mixed precision against fp32: throughput, collective bytes, per-rank memory.

    MESHRUN_BIN=$PWD/bin /usr/bin/python3 bench/bench_mixed.py [--threads N] [--steps N] [--warmup N]
                                                                 [--comm-steps N] [--mem-steps N]

Three tables, every ratio against the fp32 run of the same table, measured in this one run:
  1. throughput, cpu backend: bench_trainer.py's model and batch (Llama dim 384, 6 layers, batch
     8 x 256) at --threads threads: bin/trainer with parallel.mixed_precision.param_dtype fp32 and
     bf16 (step_ms from its metrics file), PyTorch eager fp32 and PyTorch with
     torch.autocast("cpu", dtype=torch.bfloat16) around forward and loss (fp32 master parameters,
     AdamW and clipping as in bench_trainer; perf_counter). The first --warmup steps of each are
     excluded; median step time, tokens/s, bf16 vs fp32 of the same implementation, and each
     against PyTorch at the same dtype. OPENBLAS_NUM_THREADS must be pinned by the caller
     (bench.sh does) for PyTorch's matmuls to use --threads threads.
  2. bytes per optimizer step of each collective: the integration tests' tiny plan
     (test/integration/conftest.py tiny_plan) under bin/meshrun at 4 ranks, FSDP (dp_shard=4) and
     DDP (dp_replicate=4), fp32, bf16, bf16 + reduce_dtype bf16; the mean over --comm-steps steps of
     what rank 0 sent (the per-step "comm" record), and the ratio to fp32. FSDP gathers bf16
     compute copies of fp32 shards, so its bf16 all_gather must be exactly half of fp32's.
  3. per-rank memory where activations dominate: Llama dim 256, 8 layers, 4 heads, vocab 256,
     micro batch 4 x seq 512, one process, --mem-steps steps: fp32, bf16, bf16 + activation
     checkpointing full and selective. The byte classes are the trainer's own accounting (first
     metrics record); peak RSS is the trainer process's ru_maxrss, read with
     getrusage(RUSAGE_CHILDREN) by a fresh small python that started it (RSS_WRAPPER).
A failed run is reported with the trainer's last stderr lines; the other tables still run, and
the exit status is 1 if any table failed.
"""
import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(REPO, "test", "integration"))

import bench_trainer  # noqa: E402  (MODEL, B, T, TEXT: table 1's model and batch)
from conftest import FAST_CONF, tiny_plan  # noqa: E402  (table 2's plan, meshrun's fast rendezvous)

MIB = 1048576.0
COLLECTIVES = ["all_gather", "reduce_scatter", "all_reduce"]

# table 2: name: mesh (dp_replicate, dp_shard, tp); configurations: label: extra --set
COMM_PLANS = [("fsdp", (1, 4, 1)), ("ddp", (4, 1, 1))]
PRECISIONS = [
    ("fp32", ["parallel.mixed_precision.param_dtype=fp32", "parallel.mixed_precision.reduce_dtype=fp32"]),
    ("bf16", ["parallel.mixed_precision.param_dtype=bf16", "parallel.mixed_precision.reduce_dtype=fp32"]),
    ("bf16 + reduce bf16", ["parallel.mixed_precision.param_dtype=bf16",
                            "parallel.mixed_precision.reduce_dtype=bf16"]),
]

# table 3
MEM_MODEL = {"dim": 256, "n_layers": 8, "n_heads": 4, "n_kv_heads": 4, "vocab_size": 256, "max_seq_len": 512}
MEM_B, MEM_T = 4, 512
MEM_RUNS = [
    ("fp32", ["parallel.mixed_precision.param_dtype=fp32"]),
    ("bf16", ["parallel.mixed_precision.param_dtype=bf16"]),
    ("bf16 + ckpt full", ["parallel.mixed_precision.param_dtype=bf16", "parallel.activation_checkpoint=full"]),
    ("bf16 + ckpt selective", ["parallel.mixed_precision.param_dtype=bf16",
                               "parallel.activation_checkpoint=selective"]),
]


class BenchError(Exception):
    pass


# Runs argv[2:] and writes its peak RSS (KiB) to argv[1]. A child's ru_maxrss also counts what it
# held between fork and exec, a copy of its parent's page tables: forked from this script once
# torch is loaded, every trainer would report this script's ~1.4 GiB. So a fresh, small python
# (-S: no site packages) starts the trainer and reads RUSAGE_CHILDREN after it exits.
RSS_WRAPPER = ("import resource, subprocess, sys\n"
               "rc = subprocess.call(sys.argv[2:])\n"
               "open(sys.argv[1], 'w').write(str(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss))\n"
               "sys.exit(rc if rc >= 0 else 128 - rc)\n")


def run_plan(bindir, d, plan, sets, nproc, threads, timeout=600):
    """Runs plan (a dict) in directory d: bin/trainer alone when nproc is 0, else under bin/meshrun
    with --nproc_per_node=nproc (one node: meshrun hosts its store on a free port of 127.0.0.1).
    Returns (metrics records of rank 0, peak RSS in KiB of the process RSS_WRAPPER started). Output
    goes to a file, not a pipe, so that a chatty trainer cannot block; the run is killed with its
    session when it outlives timeout seconds."""
    path = os.path.join(d, "plan.json")
    with open(path, "w") as f:
        json.dump(plan, f)
    metrics = os.path.join(d, "metrics.jsonl")
    args = [path]
    for kv in ["log.metrics_file=" + metrics, "checkpoint.dir=" + os.path.join(d, "ck")] + list(sets):
        args += ["--set", kv]
    trainer = os.path.join(bindir, "trainer")
    if nproc:
        cmd = [os.path.join(bindir, "meshrun"), "--nproc_per_node=%d" % nproc, "--rdzv_conf=" + FAST_CONF,
               trainer] + args
    else:
        cmd = [trainer] + args
    rss_file = os.path.join(d, "maxrss")
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MESHRUN_STORE"):
        env.pop(k, None)
    log = os.path.join(d, "output.log")
    with open(log, "wb") as out:
        try:
            p = subprocess.Popen([sys.executable, "-S", "-c", RSS_WRAPPER, rss_file] + cmd, cwd=d, env=env,
                                 stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        except OSError as e:
            raise BenchError("cannot start %s: %s" % (sys.executable, e))
    timer = threading.Timer(timeout, os.killpg, (p.pid, signal.SIGKILL))
    timer.start()
    try:
        rc = p.wait()
    finally:
        timer.cancel()
    if rc != 0:
        with open(log, errors="replace") as f:
            tail = f.read().splitlines()[-6:]
        why = "killed after %ds" % timeout if rc == -signal.SIGKILL else "exit status %d" % rc
        if rc > 128:
            why += " (signal %d)" % (rc - 128)
        raise BenchError("%s failed (%s): %s\n    %s" % (os.path.basename(cmd[0]), why, " ".join(sets),
                                                         "\n    ".join(tail)))
    try:
        with open(metrics) as f:
            recs = [json.loads(line) for line in f if line.strip()]
        with open(rss_file) as f:
            maxrss = int(f.read())
    except (OSError, ValueError) as e:
        raise BenchError("cannot read the results of %s: %s" % (" ".join(sets), e))
    if not recs or "num_params" not in recs[0]:
        raise BenchError("the metrics file of %s has no first record" % " ".join(sets))
    return recs, maxrss


def expect_dtypes(first, param, reduce, what):
    """The first record must show the precision asked for: a key the trainer ignored would
    otherwise make bf16 rows silently measure fp32."""
    got = (first.get("param_dtype"), first.get("reduce_dtype"))
    if got != (param, reduce):
        raise BenchError("%s: asked for param_dtype %s, reduce_dtype %s; the trainer reports %s, %s" %
                         (what, param, reduce, got[0], got[1]))


# ---- table 1: throughput ------------------------------------------------------------------------

def ours_throughput(bindir, threads, steps, warmup, dtype):
    plan = {"device": "cpu", "seed": 1, "model": bench_trainer.MODEL,
            "train": {"steps": warmup + steps, "seq_len": bench_trainer.T, "micro_batch_size": bench_trainer.B,
                      "lr": 1e-3, "warmup_steps": 2, "grad_clip": 1.0},
            "data": {"train": bench_trainer.TEXT, "format": "text", "val_fraction": 0.1},
            "eval": {"interval": 0}, "sample": {"tokens": 0}, "log": {"interval": 1000000}}
    with tempfile.TemporaryDirectory() as d:
        recs, _ = run_plan(bindir, d, plan, ["parallel.mixed_precision.param_dtype=" + dtype], 0, threads)
    expect_dtypes(recs[0], dtype, "fp32", "trainer " + dtype)
    ms = [r["step_ms"] for r in recs if "step_ms" in r][warmup:]
    if len(ms) != steps:
        raise BenchError("trainer %s logged %d timed steps, expected %d" % (dtype, len(ms), steps))
    return recs[0]["num_params"], ms


def torch_throughput(threads, steps, warmup, bf16):
    """bench_trainer's PyTorch step; with bf16 under CPU autocast to bfloat16."""
    try:
        return bench_trainer.bench_torch(threads, steps, warmup, autocast_bf16=bf16)
    except RuntimeError as e:
        raise BenchError("%s (%s)" % (e, "bf16" if bf16 else "fp32"))


def table_throughput(bindir, args):
    B, T, m = bench_trainer.B, bench_trainer.T, bench_trainer.MODEL
    rows = {}
    for dtype in ("fp32", "bf16"):
        n, rows[("ours", dtype)] = ours_throughput(bindir, args.threads, args.steps, args.warmup, dtype)
    for dtype in ("fp32", "bf16"):
        nt, rows[("torch", dtype)], tv = torch_throughput(args.threads, args.steps, args.warmup, dtype == "bf16")
    if n != nt:
        raise BenchError("parameter counts differ: ours %d, pytorch %d" % (n, nt))
    print("1. throughput, cpu backend: Llama dim %d, %d layers, %d heads / %d kv, vocab %d, %.2fM params; "
          "batch %d x %d = %d tokens per step" % (m["dim"], m["n_layers"], m["n_heads"], m["n_kv_heads"],
                                                  m["vocab_size"], n / 1e6, B, T, B * T))
    print("   %d threads (OMP_NUM_THREADS, torch.set_num_threads, OPENBLAS_NUM_THREADS=%s), %d cores; "
          "%d timed steps after %d warmup per row" % (args.threads, os.environ.get("OPENBLAS_NUM_THREADS", "unset"),
                                                      os.cpu_count(), args.steps, args.warmup))
    names = {("ours", "fp32"): "meshrun trainer", ("ours", "bf16"): "meshrun trainer",
             ("torch", "fp32"): "pytorch %s eager" % tv, ("torch", "bf16"): "pytorch %s autocast" % tv}
    hdr = "%-28s %5s %10s %9s %9s %10s %8s %11s" % ("implementation", "dtype", "median ms", "min ms", "max ms",
                                                    "tokens/s", "vs fp32", "vs pytorch")
    print(hdr)
    print("-" * len(hdr))
    med = {k: statistics.median(v) for k, v in rows.items()}
    for impl in ("ours", "torch"):
        for dtype in ("fp32", "bf16"):
            ms = rows[(impl, dtype)]
            k = (impl, dtype)
            print("%-28s %5s %10.1f %9.1f %9.1f %10.0f %8.2f %11.2f" % (
                names[k], dtype, med[k], min(ms), max(ms), B * T / med[k] * 1e3,
                med[(impl, "fp32")] / med[k], med[("torch", dtype)] / med[k]))
    print("vs fp32: the same implementation's fp32 median / this row's (> 1.00: bf16 faster)")
    print("vs pytorch: pytorch's median at the same dtype / this row's (> 1.00: faster than pytorch)")


# ---- table 2: bytes per collective --------------------------------------------------------------

def table_comm(bindir, args):
    plan = tiny_plan(eval={"interval": 0}, log={"interval": 1000})
    plan["train"]["steps"] = args.comm_steps
    m, t = plan["model"], plan["train"]
    print("2. bytes per optimizer step sent by rank 0 (mean over %d steps), per collective: tiny plan (Llama dim %d, "
          "%d layers, %d heads / %d kv, vocab %d; global batch %d x %d, micro-batch %d)" % (
              args.comm_steps, m["dim"], m["n_layers"], m["n_heads"], m["n_kv_heads"], m["vocab_size"],
              t["global_batch_size"], t["seq_len"], t["micro_batch_size"]))
    print("   bin/meshrun, 4 ranks on one node, cpu backend, OMP_NUM_THREADS=1 per rank, %d cores" % os.cpu_count())
    hdr = "%-5s %-19s" % ("plan", "precision") + "".join(" %14s %7s" % (c, "ratio") for c in COLLECTIVES) + \
        "  all_gather check"
    print(hdr)
    print("-" * len(hdr))
    problems = []
    for name, mesh in COMM_PLANS:
        base = None
        for label, sets in PRECISIONS:
            r, s, tp = mesh
            what = "%s %s" % (name, label)
            with tempfile.TemporaryDirectory() as d:
                recs, _ = run_plan(bindir, d, plan, ["mesh.dp_replicate=%d" % r, "mesh.dp_shard=%d" % s,
                                                     "mesh.tp=%d" % tp] + sets, r * s * tp, 1)
            first = recs[0]
            expect_dtypes(first, sets[0].split("=")[1], sets[1].split("=")[1], what)
            if first.get("strategy") != name or first.get("mesh") != list(mesh):
                raise BenchError("%s: the trainer ran strategy %s on mesh %s" % (what, first.get("strategy"),
                                                                               first.get("mesh")))
            steps = [rec for rec in recs if "step_ms" in rec]
            if len(steps) != args.comm_steps or any("comm" not in rec for rec in steps):
                raise BenchError("%s: %d step records with \"comm\", expected %d" % (
                    what, sum("comm" in rec for rec in steps), args.comm_steps))
            # integer totals over the same number of steps: "exactly half" is an exact comparison
            total = {c: sum(int(rec["comm"].get(c, 0)) for rec in steps) for c in COLLECTIVES}
            if base is None:
                base = total
            line = "%-5s %-19s" % (name, label)
            for c in COLLECTIVES:
                ratio = "%7.3f" % (total[c] / base[c]) if base[c] else "%7s" % "-"
                line += " %14.0f %s" % (total[c] / len(steps), ratio)
            if label == "fp32" or not base["all_gather"]:
                check = "" if label == "fp32" else "n/a (no all_gather)"
            elif 2 * total["all_gather"] == base["all_gather"]:
                check = "exactly half"
            else:
                check = "NOT half"
                problems.append("%s: all_gather %d bytes over %d steps, fp32 %d (want exactly half)" % (
                    what, total["all_gather"], len(steps), base["all_gather"]))
            print(line + "  " + check)
    print("ratio: bytes / the same plan's fp32 bytes")
    if problems:
        raise BenchError("; ".join(problems))


# ---- table 3: memory ------------------------------------------------------------------------------

def table_memory(bindir, args):
    plan = {"device": "cpu", "seed": 1, "model": MEM_MODEL,
            "train": {"steps": args.mem_steps, "seq_len": MEM_T, "micro_batch_size": MEM_B,
                      "global_batch_size": MEM_B, "lr": 1e-3, "warmup_steps": 1},
            "data": {"format": "synthetic"}, "eval": {"interval": 0}, "log": {"interval": 1000},
            "sample": {"tokens": 0}}
    rows = []
    for label, sets in MEM_RUNS:
        with tempfile.TemporaryDirectory() as d:
            recs, rss_kib = run_plan(bindir, d, plan, sets, 0, args.threads)
        first = recs[0]
        expect_dtypes(first, sets[0].split("=")[1], "fp32", label)
        cls = [first[k] / MIB for k in ("param_bytes", "grad_bytes", "optim_bytes", "work_bytes", "act_bytes")]
        rows.append((label, cls, sum(cls), rss_kib / 1024.0, first["num_params"]))
    m = MEM_MODEL
    print("3. per-rank memory (MiB): Llama dim %d, %d layers, %d heads, vocab %d, %.2fM params; micro batch %d x "
          "seq %d; one process, cpu backend, %d threads, %d steps" % (
              m["dim"], m["n_layers"], m["n_heads"], m["vocab_size"], rows[0][4] / 1e6, MEM_B, MEM_T,
              args.threads, args.mem_steps))
    print("   classes: the trainer's first metrics record; peak RSS: ru_maxrss of the trainer process "
          "(RUSAGE_CHILDREN of a fresh python that ran it)")
    hdr = "%-22s %8s %8s %8s %8s %8s %9s %9s %7s %7s %7s" % (
        "run", "param", "grad", "optim", "working", "activ", "total", "peak RSS", "act x", "total x", "RSS x")
    print(hdr)
    print("-" * len(hdr))
    ref = rows[0]
    for label, cls, total, rss, _ in rows:
        print("%-22s" % label + "".join(" %8.1f" % v for v in cls) +
              " %9.1f %9.1f %7.3f %7.3f %7.3f" % (total, rss, cls[4] / ref[1][4], total / ref[2], rss / ref[3]))
    print("total: param + grad + optim + working + activ; x: this run / fp32")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS") or os.cpu_count()),
                    help="threads of tables 1 and 3 (default: OMP_NUM_THREADS, else all CPUs)")
    ap.add_argument("--steps", type=int, default=5, help="table 1: timed steps per row (default 5)")
    ap.add_argument("--warmup", type=int, default=2, help="table 1: untimed steps first (default 2)")
    ap.add_argument("--comm-steps", type=int, default=4, help="table 2: steps per run (default 4)")
    ap.add_argument("--mem-steps", type=int, default=2, help="table 3: steps per run (default 2)")
    args = ap.parse_args()
    bindir = os.environ.get("MESHRUN_BIN", os.path.join(REPO, "bin"))
    for b in ("trainer", "meshrun"):
        if not os.access(os.path.join(bindir, b), os.X_OK):
            print("bench_mixed: %s/%s is missing or not executable (build it, or set MESHRUN_BIN)" % (bindir, b),
                  file=sys.stderr)
            return 1
    failed = []
    for i, table in enumerate((table_throughput, table_comm, table_memory), 1):
        try:
            table(bindir, args)
        except BenchError as e:
            print("bench_mixed: table %d failed: %s" % (i, e))
            failed.append(str(i))
        except Exception as e:  # torch or the file system: still a message, and the other tables
            print("bench_mixed: table %d failed: %s: %s" % (i, type(e).__name__, e))
            failed.append(str(i))
        sys.stdout.flush()
        if i < 3:
            print()
    if failed:
        print("bench_mixed: failed tables: %s" % " ".join(failed))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
