#!/usr/bin/python3
"""bench_cp: context parallelism across emulated hosts, the ring's overlap off and on.

    MESHRUN_BIN=$PWD/bin MESHRUN_BUILD=$PWD/build /usr/bin/python3 bench/bench_cp.py
        [--cp 2,4] [--rotate ring,allgather] [--seq 2048] [--steps 6] [--rate 1gbit] [--delay 200us]
        [--cpu auto]

Each row runs bin/trainer under one bin/meshrun per emulated host (test/support/netcluster.py, as
bench/bench_overlap.py, whose job runner and medians it uses), one rank per host, mesh.cp = the
hosts: every sequence of SEQ tokens is cut into 2 cp chunks and the K/V blocks travel between
hosts (rotate ring: around the ring, each transfer behind the blocks in hand; allgather: one
all-gather and one reduce-scatter per layer and pass, nothing hidden). The model: Llama dim 128,
2 layers, 4 heads (2 kv heads), hidden 384, vocab 256, micro-batch 1 of SEQ tokens, synthetic
data, --steps steps of which the first is warm-up. Parameters shard over the cp ranks (FSDP over
dp_shard x cp) with the overlap setting of the row, so "exposed" holds their gathers too.

Columns (medians of rank 0's counted steps): ms/step with parallel.overlap=false and true;
exposed communication ms (comm_wait_ms) off and on; the share of the off step that was exposed;
on/off; "removed", the share of the exposed time overlap took away; "bound", the most any overlap
could remove, min(1, compute / exposed) with overlap off (transfers can hide behind compute at
most; the ring's behind its attention blocks alone, so this is generous); "ring MB", what rank 0
sent per step on the cp ring and group (the "cp" entry of the step's comm record), and "wire ms",
the time those bytes need on one link at the rate (a floor for the step's K/V traffic).
Prints one line and exits 0 where network namespaces cannot be made (the reason named).
"""
import argparse
import os
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "test", "support"))
import bench_overlap  # noqa: E402  (its job runner and medians)
import netcluster  # noqa: E402

COLS = "%4s %-9s %9s %9s %8s %8s %6s %7s %8s %6s %8s %7s"


def cp_sets(cp, rotate, seq):
    return ["model.dim=128", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.hidden_dim=384",
            "model.max_seq_len=%d" % seq, "train.seq_len=%d" % seq, "train.micro_batch_size=1",
            "mesh.cp=%d" % cp, "parallel.cp_rotate=%s" % rotate]


def ring_mb(recs):
    v = [r["comm"].get("cp", 0) / 1e6 for r in recs if isinstance(r.get("comm"), dict)]
    return statistics.median(v) if v else None


def row(c, a, cp, rotate, meshrun, trainer, rate_bps):
    res = {}
    for mode in ("false", "true"):
        with tempfile.TemporaryDirectory(prefix="bench_cp.") as d:
            res[mode] = bench_overlap.run(c, meshrun, trainer, 1, (1, 1),
                                          cp_sets(cp, rotate, a.seq) + ["parallel.overlap=" + mode], a.steps, d)
    errs = ["overlap %s: %s" % (m, res[m][1]) for m in res if res[m][1]]
    if errs:
        return "%4d %-9s  failed: %s" % (cp, rotate, "; ".join(errs))
    off, on = res["false"][0], res["true"][0]
    f = bench_overlap.f
    x = bench_overlap.derived(off, on, ring_mb(off), rate_bps)
    pct = lambda v: f(None if v is None else 100 * v, "%.0f%%")
    return COLS % (cp, rotate, f(x["s_off"]), f(x["s_on"]), f(x["e_off"]), f(x["e_on"]), pct(x["share"]),
                   f(x["ratio"], "%.2f"), pct(x["removed"]), pct(x["bound"]), f(x["mb"]), f(x["wire"], "%.0f"))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cp", default="2,4")
    ap.add_argument("--rotate", default="ring,allgather")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--rate", default="1gbit")
    ap.add_argument("--delay", default="200us")
    ap.add_argument("--cpu", default="auto")
    a = ap.parse_args()
    ok, why = netcluster.can_create()
    if not ok:
        print("bench_cp: skipped: %s" % why)
        return 0
    bindir = os.path.abspath(os.environ.get("MESHRUN_BIN") or os.path.join(netcluster.REPO, "bin"))
    meshrun, trainer = os.path.join(bindir, "meshrun"), os.path.join(bindir, "trainer")
    rate_bps = netcluster.parse_rate(a.rate)
    rows, shaping = [], None
    for cp in [int(x) for x in a.cp.split(",") if x]:
        if a.seq % (2 * cp):
            ap.error("--seq %d is not divisible by 2 * %d" % (a.seq, cp))
        with netcluster.Cluster(cp, rate=a.rate, delay=a.delay, cpu=a.cpu) as c:
            shaping = c.shaping
            for rotate in [r for r in a.rotate.split(",") if r]:
                rows.append(row(c, a, cp, rotate, meshrun, trainer, rate_bps))
                print(rows[-1], file=sys.stderr, flush=True)
    print("emulated hosts, one rank each: %s; model dim 128 x 2 layers, micro-batch 1 x seq %d, %d steps, first not "
          "counted, medians of rank 0" % (shaping, a.seq, a.steps))
    print(COLS % ("cp", "rotate", "ms/step", "ms/step", "exposed", "exposed", "comm", "exposed", "removed", "bound",
                  "ring MB", "wire"))
    print(COLS % ("", "", "off", "on", "ms off", "ms on", "share", "on/off", "share", "", "/step", "ms"))
    for r in rows:
        print(r)
    return 1 if any("failed" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
