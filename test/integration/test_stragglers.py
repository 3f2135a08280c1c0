"""test_stragglers: the spread of the ranks' compute time, the slow rank, and where a nan came from.

Four ranks under meshrun (cpu backend, FSDP over dp_shard 4, one thread each):
  - without a fault, every step record carries compute_ms_min <= compute_ms_median <=
    compute_ms_max and a slowest_rank, rank 0's compute_ms between min and max; in one process
    the spread is the step's own time and the slowest rank 0;
  - MESHRUN_FAULT_SLOW=R:MS (trainer/run/hooks.c) makes rank R sleep MS ms inside every step, MS
    derived from the fault-free run's times (10 x the median over steps of the slowest rank's,
    at least 30 ms): for R
    = 1, 2, 3 the records name R the slowest (at least 90% of the steps: the machine is shared,
    a stray step may go to another rank; observed: all), every console line that names a
    straggler names R and its host, and the window warning names R on this host once, no other
    rank; with log.straggler_pct very high, the console names no one and the records still do;
  - MESHRUN_FAULT_NAN=R:3 makes rank R's own loss of step 3 nan; the console line is every 5 steps,
    so the read that finds it is step 5's (the deferred read): for R = 1, 2, 3 every rank's message
    says step 3 and "first non-finite: rank R (host H), its own loss (micro-batch 1)";
  - the same under pp 2 x dp_shard 2 with R = 3, on the last stage (the only one with losses);
  - MESHRUN_FAULT_NAN_GRAD=R:3:T under DDP, FSDP, HSDP, DDP x TP, PP x FSDP and PP x DDP over 4
    ranks, R not 0: every rank's message names rank R, its host and tensor T, from the ranks' own
    gradients before the reduction (test_nan_gradient_names_the_rank).
Before the change, records had no compute_ms_min and no message named a rank: every case fails
(the gradient's rank: before the local norms, the message named the tensor only, after the
reduction, and under FSDP and HSDP nothing; under pp nothing was named, and neither fault
reached the pipeline's step).
"""
import json
import os
import socket

from conftest import FAST_CONF, Meshrun, bin_dir, tiny_plan

TRAINER = os.path.join(bin_dir(), "trainer")
STEPS = 24
WINDOW = 20  # STRAGGLER_WINDOW (trainer/run/straggler.h)


def plan_file(d, steps=STEPS, interval=4):
    plan = tiny_plan(mesh={"dp_replicate": 1, "dp_shard": 4, "tp": 1},
                     train={"steps": steps, "seq_len": 32, "micro_batch_size": 2, "global_batch_size": 8,
                            "lr": 3e-3, "warmup_steps": 2, "decay": "cosine"},
                     eval={"interval": 0}, log={"interval": interval})
    path = os.path.join(str(d), "plan.json")
    with open(path, "w") as f:
        json.dump(plan, f)
    return path


def run(d, env=None, sets=(), interval=4, nproc=4):
    d.mkdir()
    args = ["--nproc_per_node=%d" % nproc, "--max_restarts=0", "--rdzv_conf=" + FAST_CONF, TRAINER,
            plan_file(d, interval=interval), "--set", "log.metrics_file=%s" % (d / "m.jsonl")]
    if nproc == 1:
        args += ["--set", "mesh.dp_shard=1"]
    for s in sets:
        args += ["--set", s]
    m = Meshrun(args, env=dict({"OMP_NUM_THREADS": "1"}, **(env or {})), cwd=str(d))
    rc = m.wait(180)
    recs = []
    if (d / "m.jsonl").exists():
        recs = [r for r in map(json.loads, open(d / "m.jsonl")) if "loss" in r and "step" in r]
    return rc, m, recs


def check_spread(recs, m):
    assert len(recs) == STEPS, m.describe()
    for r in recs:
        assert r["compute_ms_min"] <= r["compute_ms_median"] <= r["compute_ms_max"], r
        assert r["compute_ms_min"] - 0.002 <= r["compute_ms"] <= r["compute_ms_max"] + 0.002, r
        assert 0 <= r["slowest_rank"] < 4, r
        # the record prints each time to 3 decimals (half a microsecond either way) and the
        # spread to 3 decimals: the spread must lie in what those printed times allow
        mx, md, h = r["compute_ms_max"], r["compute_ms_median"], 5e-4
        if md > h:
            lo, hi = 100 * ((mx - h) / (md + h) - 1), 100 * ((mx + h) / (md - h) - 1)
            assert lo - h <= r["straggler_spread_pct"] <= hi + h, (lo, hi, r)


def test_spread_in_every_record_and_the_slow_rank_named(tmp_path):
    rc, m, recs = run(tmp_path / "one", nproc=1)
    assert rc == 0, m.describe()
    for r in recs:
        assert r["compute_ms_min"] == r["compute_ms_median"] == r["compute_ms_max"] == r["compute_ms"], r
        assert r["slowest_rank"] == 0, r
    rc, m, recs = run(tmp_path / "base")
    assert rc == 0, m.describe()
    check_spread(recs, m)
    typical = sorted(r["compute_ms_max"] for r in recs)[len(recs) // 2]
    delay = max(30, int(10 * typical))
    print("fault-free steps: the slowest rank's median %.1f ms; delay %d ms" % (typical, delay))
    host = socket.gethostname()
    for slow in (1, 2, 3):
        rc, m, recs = run(tmp_path / ("slow%d" % slow), env={"MESHRUN_FAULT_SLOW": "%d:%d" % (slow, delay)})
        assert rc == 0, m.describe()
        check_spread(recs, m)
        named = sum(r["slowest_rank"] == slow for r in recs)
        print("rank %d slow: named the slowest in %d of %d steps" % (slow, named, len(recs)))
        assert named >= 0.9 * len(recs), m.describe()
        lines = [l for l in m.err.splitlines() if "straggler rank" in l]
        assert lines, m.describe()
        assert all(("straggler rank %d (%s) +" % (slow, host)) in l for l in lines), m.describe()
        slow_lines = [l for l in m.err.splitlines() if " is slow: " in l]
        assert len(slow_lines) == 1, m.describe()
        assert ("rank %d on host %s is slow: +" % (slow, host)) in slow_lines[0], m.describe()
        assert ("of the last %d steps" % WINDOW) in slow_lines[0], m.describe()
    rc, m, recs = run(tmp_path / "quiet", env={"MESHRUN_FAULT_SLOW": "2:%d" % delay},
                      sets=["log.straggler_pct=1e9"])
    assert rc == 0, m.describe()
    check_spread(recs, m)
    assert sum(r["slowest_rank"] == 2 for r in recs) >= 0.9 * len(recs), m.describe()
    assert "straggler rank" not in m.err and " is slow: " not in m.err, m.describe()


def test_nan_loss_names_the_first_rank(tmp_path):
    """The last case is pp 2 x dp_shard 2: only the last stage's ranks (2 and 3) compute losses;
    rank 3's is nan, and every rank, stage 0's too, names it."""
    host = socket.gethostname()
    for bad, sets in ((1, []), (2, []), (3, []), (3, ["mesh.pp=2", "mesh.dp_shard=2"])):
        rc, m, recs = run(tmp_path / ("nan%d%s" % (bad, "pp" if sets else "")), env={"MESHRUN_FAULT_NAN": "%d:3" % bad},
                          sets=sets, interval=5)
        assert rc == 1, m.describe()
        lines = [l for l in m.err.splitlines() if l.startswith("[rank") and "loss is nan at step 3" in l]
        assert {l.split("]:")[0] for l in lines} == {"[rank0", "[rank1", "[rank2", "[rank3"}, m.describe()
        want = "; first non-finite: rank %d (host %s), its own loss (micro-batch 1)" % (bad, host)
        assert all(l.endswith(want) for l in lines), m.describe()
        assert [r["step"] for r in recs] == [1, 2], m.describe()  # the steps before the one that diverged


def test_nan_gradient_names_the_rank(tmp_path):
    """MESHRUN_FAULT_NAN_GRAD=R:3:T turns rank R's own gradient of tensor T nan in step 3, before
    the strategy reduces it: with a console line every step, the read at step 3 still has step 3's
    values, and every rank's message names R, its host and T, before the reduction, under DDP
    (dp_replicate 4), FSDP (dp_shard 4), HSDP (2 x 2) and DDP x TP (dp_replicate 2, tp 2: T is
    split over tp, so only R's slice is poisoned), pp 2 x dp_shard 2 and pp 2 x dp_replicate 2 (R
    is rank 1, of stage 0, whose tensors the last stage's ranks do not hold: the name travels); with a line every 5 steps,
    the message says that step 3's gradients are gone."""
    host = socket.gethostname()
    cases = [("ddp", ["mesh.dp_shard=1", "mesh.dp_replicate=4"], 1, "tok_embeddings.weight"),
             ("fsdp", [], 2, "layers.0.attention.wq.weight"),
             ("hsdp", ["mesh.dp_shard=2", "mesh.dp_replicate=2"], 3, "layers.1.feed_forward.w2.weight"),
             ("tp", ["mesh.dp_shard=1", "mesh.dp_replicate=2", "mesh.tp=2"], 3, "layers.1.feed_forward.w1.weight"),
             ("pp", ["mesh.pp=2", "mesh.dp_shard=2"], 1, "layers.0.feed_forward.w2.weight"),
             ("ppddp", ["mesh.pp=2", "mesh.dp_shard=1", "mesh.dp_replicate=2"], 1, "layers.0.attention.wo.weight")]
    for name, sets, bad, tensor in cases:
        rc, m, recs = run(tmp_path / name, env={"MESHRUN_FAULT_NAN_GRAD": "%d:3:%s" % (bad, tensor)}, sets=sets,
                          interval=1)
        assert rc == 1, m.describe()
        lines = [l for l in m.err.splitlines() if l.startswith("[rank") and "gradient norm is nan at step 3" in l]
        assert {l.split("]:")[0] for l in lines} == {"[rank0", "[rank1", "[rank2", "[rank3"}, m.describe()
        want = "; first non-finite gradient: rank %d (host %s), %s, before the reduction (step 3's)" % (bad, host,
                                                                                                      tensor)
        print("%s: %s" % (name, lines[0].split("; ", 1)[-1]))
        assert all(l.endswith(want) for l in lines), m.describe()
        assert [r["step"] for r in recs] == [1, 2], m.describe()
    rc, m, recs = run(tmp_path / "late", env={"MESHRUN_FAULT_NAN_GRAD": "1:3:%s" % cases[0][3]},
                      sets=["mesh.dp_shard=1", "mesh.dp_replicate=4"], interval=5)
    assert rc == 1, m.describe()
    assert "gradient norm is nan at step 3" in m.err, m.describe()
    assert "step 3's gradients are gone (read at step 5" in m.err, m.describe()
