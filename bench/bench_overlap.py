#!/usr/bin/python3
"""bench_overlap: communication overlap off and on, FSDP / HSDP / DDP across emulated hosts.

    MESHRUN_BIN=$PWD/bin MESHRUN_BUILD=$PWD/build /usr/bin/python3 bench/bench_overlap.py
        [--nodes 2,4] [--steps 8] [--rate 500mbit,1gbit,2gbit] [--delay 200us] [--cpu auto]
        [--plans fsdp,hsdp,ddp] [--off SET] [--on SET]

One table per --rate. Each row runs bin/trainer under one bin/meshrun per emulated host
(test/support/netcluster.py: network namespaces on one switch, every link shaped to the rate with
--delay one way, by netem or, on kernels without it, the user-space switch build/tools/netdelay),
one process per host (HSDP at 2 hosts: two per host, so that it has 4 ranks: dp_replicate across
hosts x dp_shard 2 within one), OMP_NUM_THREADS=1 per rank. Each host gets its own CPU budget
(--cpu; auto: 80% of the machine's cores split evenly, in a cgroup), as separate machines would:
without it a rank waiting on the network lends its core to another host's compute, and the
blocking order looks cheaper than it is. The model: Llama dim 384, 4 layers, 6 heads, hidden
1024, vocab 256 (7.3M parameters, 29 MB in fp32), micro-batch 2 x seq 64 per rank, synthetic
data, --steps optimizer steps of which the first is warm-up and not counted.

From rank 0's metrics file (log.metrics_file), the median over the counted steps of step_ms,
compute_ms and comm_wait_ms (the communication the step waited for: exposed, not hidden behind
compute); a field the trainer does not write yet is "n/a". Columns: ms/step with --off (default
parallel.overlap=false) and --on (parallel.overlap=true); exposed communication ms off and on;
"comm share", the exposed share of the step with overlap off; their ratio on/off (< 1: overlap
hides communication) and the share of the exposed time that overlap removed (1 - on/off);
"bound", about the most any overlap could remove, min(1, compute / exposed) with overlap off
(communication hides behind compute at most; DDP, and HSDP whose only cross-host traffic is the
replicate all-reduce, hide behind the backward alone, about 2/3 of that; ranks that wait on one
another make the off row's exposed time larger than the bytes need, so a row can beat it);
"target", the issue's: where the comm share is at least 50%, "met" when overlap removed at
least 60%, "bound" when even the bound is below 60%, else "missed", and "-" outside that domain;
MB rank 0 sent per step (the per-step "comm" record) and the time those bytes need on one link at
the rate ("wire ms", a floor for one step's transfer).
Prints one line and exits 0 where network namespaces cannot be made (the reason named).
"""
import argparse
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "test", "support"))
import netcluster  # noqa: E402  (test/support/netcluster.py, the emulated network's one module)

MODEL = ["model.dim=384", "model.n_layers=4", "model.n_heads=6", "model.n_kv_heads=6", "model.hidden_dim=1024",
         "model.vocab_size=256", "model.max_seq_len=64"]
TRAIN = ["train.seq_len=64", "train.micro_batch_size=2", "train.global_batch_size=0", "train.warmup_steps=1",
         "data.format=synthetic", "eval.interval=0", "sample.tokens=0", "log.interval=1000",
         "parallel.bucket_mb=4"]  # DDP: 8 buckets of the 29 MB of gradients, so the backward has some to hide behind
CONF = "last_call_timeout=0.5,heartbeat_interval=0.1,join_timeout=60"


def layout(plan, nodes):
    """(processes per host, (dp_replicate, dp_shard)) of plan on nodes hosts, or None."""
    if plan == "fsdp":
        return 1, (1, nodes)
    if plan == "ddp":
        return 1, (nodes, 1)
    if plan == "hsdp":
        if nodes >= 4 and nodes % 2 == 0:
            return 1, (2, nodes // 2)
        return 2, (nodes, 2)
    raise SystemExit("unknown plan %r (fsdp, hsdp, ddp)" % plan)


def run(cluster, meshrun, trainer, nproc, mesh, sets, steps, d):
    """One job across the cluster; returns (records of the counted steps, None) or (None, why)."""
    metrics = os.path.join(d, "metrics.jsonl")
    args = ["--nproc_per_node=%d" % nproc, "--rdzv_conf=" + CONF, "--max_restarts=0", trainer]
    for s in MODEL + TRAIN + ["train.steps=%d" % steps, "mesh.dp_replicate=%d" % mesh[0],
                              "mesh.dp_shard=%d" % mesh[1], "mesh.tp=1", "log.metrics_file=" + metrics] + sets:
        args += ["--set", s]
    log = os.path.join(d, "job.log")
    with open(log, "wb") as out:  # a file, not a pipe: a node never stalls on a full pipe
        procs = netcluster.start_meshrun(cluster, args, meshrun=meshrun, env={"OMP_NUM_THREADS": "1"}, cwd=d,
                                         stdout=out, stderr=subprocess.STDOUT)
        codes = netcluster.wait_all(procs, 600)
    if any(codes):
        with open(log, errors="replace") as fh:
            text = fh.read().splitlines()
        lines = [l for l in text if "error" in l.lower()] or text[-1:]
        return None, "exit %s: %s" % (codes, lines[0].strip() if lines else "")
    recs = [r for r in netcluster.read_metrics(metrics) if "step_ms" in r]
    return recs[1:], None  # the first step is warm-up


def med(recs, key):
    v = [r[key] for r in recs if key in r]
    return statistics.median(v) if v and len(v) == len(recs) else None


def sent_mb(recs):
    """Median MB rank 0 sent per step, over every op of the step's comm record."""
    ops = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")
    v = [sum(r["comm"].get(k, 0) for k in ops) / 1e6 for r in recs if isinstance(r.get("comm"), dict)]
    return statistics.median(v) if v else None


def derived(off, on, mb, rate_bps):
    """A row's figures from the records of the run with overlap off and on: medians of the step
    and of the exposed communication, exposed on/off (ratio) and the share it removed, the exposed
    share of the step (off), the bound (below), and the wire time of mb MB a step at rate_bps."""
    x = {"s_off": med(off, "step_ms"), "s_on": med(on, "step_ms"), "e_off": med(off, "comm_wait_ms"),
         "e_on": med(on, "comm_wait_ms"), "mb": mb}
    s_off, e_off, e_on = x["s_off"], x["e_off"], x["e_on"]
    x["ratio"] = e_on / e_off if e_off and e_on is not None else None
    x["removed"] = 1 - x["ratio"] if x["ratio"] is not None else None
    x["share"] = e_off / s_off if e_off is not None and s_off else None
    # The most any overlap could remove: communication can hide behind at most the step's compute
    # (off: step - exposed), so min(1, compute / exposed). DDP and ZeRO hide behind the backward
    # alone, about 2/3 of that.
    x["bound"] = min(1.0, (s_off - e_off) / e_off) if e_off and s_off else None
    x["wire"] = mb * 8e6 / rate_bps * 1e3 if mb is not None else None
    return x


def f(x, fmt="%.1f"):
    return "n/a" if x is None else fmt % x


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", default="2,4")
    ap.add_argument("--plans", default="fsdp,hsdp,ddp")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rate", default="500mbit,1gbit,2gbit", help="link rates, tc units, comma-separated: one table each")
    ap.add_argument("--delay", default="200us", help="one way, tc units; 0 for none")
    ap.add_argument("--cpu", default="auto", help="cores per emulated host: auto (80%% of the machine's split evenly), "
                    "a number, or none (hosts share every core)")
    ap.add_argument("--off", default="parallel.overlap=false", help="--set for the 'off' runs ('' for none)")
    ap.add_argument("--on", default="parallel.overlap=true", help="--set for the 'on' runs ('' for none)")
    a = ap.parse_args()

    ok, why = netcluster.can_create()
    if not ok:
        print("bench_overlap: skipped: %s" % why)
        return 0
    bindir = os.path.abspath(os.environ.get("MESHRUN_BIN") or os.path.join(netcluster.REPO, "bin"))
    meshrun, trainer = os.path.join(bindir, "meshrun"), os.path.join(bindir, "trainer")
    rates = [r for r in a.rate.split(",") if r]
    for r in rates:
        netcluster.parse_rate(r)  # a bad rate fails here, before any cluster is built
    try:
        netcluster.parse_cpu(a.cpu, 1)  # a bad --cpu fails here, before any cluster is built
    except netcluster.NetclusterError as e:
        ap.error("--%s" % e)
    sets_off = [s for s in a.off.split(",") if s]
    sets_on = [s for s in a.on.split(",") if s]
    failed = False
    for rate in rates:
        failed |= table(a, rate, meshrun, trainer, sets_off, sets_on)
    return 1 if failed else 0


COLS = "%5s %5s %-9s %9s %9s %7s %9s %9s %6s %8s %8s %6s %7s %8s %7s"


def table(a, rate, meshrun, trainer, sets_off, sets_on):
    """One table: every node count and plan at one link rate. Returns True if a row failed."""
    rate_bps = netcluster.parse_rate(rate)
    hdr = COLS % ("nodes", "ranks", "plan", "ms/step", "ms/step", "speedup", "exposed", "exposed", "comm", "exposed",
                  "removed", "bound", "target", "MB sent", "wire")
    hdr2 = COLS % ("", "", "", "off", "on", "off/on", "ms off", "ms on", "share", "on/off", "share", "", "", "/step", "ms")
    shaping, cpus = None, []
    rows = []
    for nodes in [int(x) for x in a.nodes.split(",") if x]:
        with netcluster.Cluster(nodes, rate=rate, delay=a.delay, cpu=a.cpu) as c:
            shaping = c.shaping
            cpus.append("%d hosts: %s" % (nodes, "unlimited" if c.cpu is None else "%.2g cores" % c.cpu))
            for plan in [p for p in a.plans.split(",") if p]:
                nproc, mesh = layout(plan, nodes)
                res = {}
                for mode, sets in (("off", sets_off), ("on", sets_on)):
                    with tempfile.TemporaryDirectory(prefix="bench_overlap.") as d:
                        res[mode] = run(c, meshrun, trainer, nproc, mesh, sets, a.steps, d)
                name = plan if plan != "hsdp" else "hsdp %dx%d" % mesh
                errs = ["%s: %s" % (m, res[m][1]) for m in ("off", "on") if res[m][1]]
                if errs:
                    rows.append("%5d %5d %-9s  failed: %s" % (nodes, nodes * nproc, name, "; ".join(errs)))
                    print(rows[-1], file=sys.stderr, flush=True)
                    continue
                off, on = res["off"][0], res["on"][0]
                x = derived(off, on, sent_mb(off), rate_bps)
                s_off, s_on, e_off, e_on = x["s_off"], x["s_on"], x["e_off"], x["e_on"]
                ratio, removed, share, bound, mb, wire = (x[k] for k in ("ratio", "removed", "share", "bound", "mb",
                                                                           "wire"))
                # The target: where communication is at least half the step (off), overlap
                # removes at least 60% of the exposed time. "-": this row is outside its domain;
                # "bound": inside it, but even hiding every compute millisecond removes < 60%.
                target = "-" if share is None or removed is None or share < 0.5 else \
                    "met" if removed >= 0.6 else "bound" if bound < 0.6 else "missed"
                rows.append(COLS % (nodes, nodes * nproc, name, f(s_off), f(s_on),
                                    f(s_off / s_on if s_off and s_on else None, "%.2fx"), f(e_off), f(e_on),
                                    f(None if share is None else 100 * share, "%.0f%%"),
                                    f(ratio, "%.2f"), f(None if removed is None else 100 * removed, "%.0f%%"),
                                    f(None if bound is None else 100 * bound, "%.0f%%"), target, f(mb), f(wire, "%.0f")))
                print(rows[-1], file=sys.stderr, flush=True)
    print("emulated hosts: %s; CPU per host (cgroup) at %s; model dim 384 x 4 layers (7.3M params), micro-batch "
          "2 x seq 64 per rank, %d steps, first not counted, medians of rank 0" % (shaping, ", ".join(cpus), a.steps))
    print("off: %s   on: %s" % (" ".join(sets_off) or "(plan default)", " ".join(sets_on) or "(plan default)"))
    print(hdr)
    print(hdr2)
    for r in rows:
        print(r)
    print()
    return any("failed" in r for r in rows)

if __name__ == "__main__":
    sys.exit(main())
