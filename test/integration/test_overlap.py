"""test_overlap: communication behind compute changes no bit, and its failures stop every rank.

Each plan runs bin/trainer under bin/meshrun twice, parallel.overlap false and true, on the tiny
Llama of conftest.tiny_plan (20 steps, micro-batch 2, so every plan accumulates over micro-steps
and the no_sync path is crossed too). overlap changes only when collectives are waited for, never
what they sum nor in which order, so the two runs must agree to the bit: every logged loss,
eval loss and grad norm equal (tolerance 0), and the final safetensors byte-identical. DDP and
ZeRO-1 use parallel.bucket_mb small enough (0.05 MiB) that the model's units fall in several
buckets, so the overlapped all-reduce really runs during the backward.

Then the step record's breakdown: compute_ms + comm_wait_ms is step_ms, the exposed part nonzero, the bytes per
group cover the strategy's traffic by operation, and a trace file (log.trace_file) is JSON that names a
compute span per unit and a collective per group on every rank.

Finally a collective that fails while others are in flight (MESHRUN_FAULT_COLLECTIVE, the
comm layer's fault-injection hook) is reported once, and every rank stops (no hang): meshrun exits
non-zero well within the comm timeout, and no rank reports a loss for the failed step.
OMP_NUM_THREADS=1 everywhere (2 shared cores).
"""
import hashlib
import json
import os
import re
import struct

import pytest

from conftest import FAST_CONF, Meshrun, bin_dir, tiny_plan

TRAINER = os.path.join(bin_dir(), "trainer")

# name: (ranks, mesh (dp_replicate, dp_shard, tp), extra --set)
PLANS = {
    "ddp4_buckets": (4, (4, 1, 1), ["parallel.bucket_mb=0.05"]),
    "ddp4_zero1": (4, (4, 1, 1), ["parallel.zero=1", "parallel.bucket_mb=0.05"]),
    "ddp4_zero2": (4, (4, 1, 1), ["parallel.zero=2"]),
    "fsdp4": (4, (1, 4, 1), []),
    "fsdp4_no_reshard": (4, (1, 4, 1), ["parallel.reshard_after_forward=false"]),
    "hsdp2x2": (4, (2, 2, 1), []),
    "fsdp2_tp2": (4, (1, 2, 2), []),
    "fsdp4_bf16": (4, (1, 4, 1), ["parallel.mixed_precision.param_dtype=bf16",
                                  "parallel.mixed_precision.reduce_dtype=bf16"]),
    "hsdp2x2_bf16": (4, (2, 2, 1), ["parallel.mixed_precision.param_dtype=bf16",
                                    "parallel.mixed_precision.reduce_dtype=bf16"]),
    "ddp4_bf16_reduce": (4, (4, 1, 1), ["parallel.bucket_mb=0.05", "parallel.mixed_precision.reduce_dtype=bf16"]),
}


def run(d, nproc, mesh, extra, overlap, env=None, timeout=180):
    os.makedirs(str(d), exist_ok=True)
    plan = os.path.join(str(d), "plan.json")
    with open(plan, "w") as f:
        json.dump(tiny_plan(), f)
    sets = ["mesh.dp_replicate=%d" % mesh[0], "mesh.dp_shard=%d" % mesh[1], "mesh.tp=%d" % mesh[2],
            "log.metrics_file=%s" % os.path.join(str(d), "metrics.jsonl"),
            "checkpoint.dir=%s" % os.path.join(str(d), "ck"),
            "parallel.overlap=%s" % ("true" if overlap else "false")] + list(extra)
    args = [TRAINER, plan]
    for kv in sets:
        args += ["--set", kv]
    e = {"OMP_NUM_THREADS": "1"}
    e.update(env or {})
    m = Meshrun(["--nproc_per_node=%d" % nproc, "--rdzv_conf=" + FAST_CONF] + args, env=e, cwd=str(d))
    rc = m.wait(timeout)
    return rc, m


def records(d):
    with open(os.path.join(str(d), "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def numbers(d):
    """(step, kind) -> the logged value, for every loss, eval loss and grad norm."""
    out = {}
    for r in records(d):
        for k in ("loss", "eval_loss", "grad_norm"):
            if k in r and "step" in r:
                out[(r["step"], k)] = r[k]
    return out


def digest(path):
    """sha256 of a safetensors file's tensors (names, shapes, offsets and bytes), without its
    metadata (which records the plan, overlap included)."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    header.pop("__metadata__", None)
    return hashlib.sha256(json.dumps(header, sort_keys=True).encode() + data).hexdigest()


@pytest.mark.parametrize("name", list(PLANS))
def test_overlap_is_bit_identical(tmp_path, name):
    nproc, mesh, extra = PLANS[name]
    got = {}
    for overlap in (False, True):
        d = tmp_path / ("on" if overlap else "off")
        rc, m = run(d, nproc, mesh, extra, overlap)
        assert rc == 0, m.describe()
        got[overlap] = (numbers(d), digest(os.path.join(str(d), "ck", "final.safetensors")))
    off, on = got[False][0], got[True][0]
    assert sorted(off) == sorted(on), "%s: overlap logged other steps" % name
    diff = max(abs(on[k] - off[k]) for k in off)
    print("%-18s %d values compared, max abs difference %.3g (tolerance 0); final weights %s" %
          (name, len(off), diff, "identical" if got[False][1] == got[True][1] else "DIFFER"))
    assert diff == 0, "%s: overlap changed a logged value by %g" % (name, diff)
    assert got[False][1] == got[True][1], "%s: overlap changed the final weights" % name


def test_step_breakdown_and_trace(tmp_path):
    """fsdp4 with overlap: each step record's breakdown is consistent, and the trace opens."""
    trace = os.path.join(str(tmp_path), "trace.json")
    rc, m = run(tmp_path, 4, (1, 4, 1), ["log.trace_file=" + trace, "log.trace_steps=2", "train.steps=4"], True)
    assert rc == 0, m.describe()
    steps = [r for r in records(tmp_path) if "loss" in r]
    assert len(steps) == 4
    for r in steps:
        # exposed communication: rank 0's time blocked in the step's collectives (4 ranks of FSDP
        # always wait some); compute: the rest of the step (0.002 ms: the records' rounding)
        assert 0 < r["comm_wait_ms"] < r["step_ms"] and r["compute_ms"] > 0, r
        assert abs(r["compute_ms"] + r["comm_wait_ms"] - r["step_ms"]) <= 0.002, r
        groups = {g: r["comm"][g] for g in ("dp_replicate", "dp_shard", "tp", "dp", "world")}
        assert groups["dp_shard"] > 0 and groups["tp"] == 0, r  # bytes this rank sent, per group
        ops = r["comm"]["all_gather"] + r["comm"]["reduce_scatter"] + r["comm"]["all_reduce"]
        assert ops <= sum(groups.values()), r  # the strategy's share of what the groups moved
    print("step 2: %.1f ms = %.1f compute + %.1f exposed communication (%.0f%%); bytes %s" %
          (steps[1]["step_ms"], steps[1]["compute_ms"], steps[1]["comm_wait_ms"],
           100 * steps[1]["comm_wait_ms"] / steps[1]["step_ms"], steps[1]["comm"]))
    assert re.search(r"step 4/4 .*\| comm \d+%", m.err + m.out), "console line without the exposed share"

    with open(trace) as f:
        text = f.read().rstrip()
    events = json.loads(text if text.endswith("]") else text.rstrip(",") + "]")
    assert isinstance(events, list) and events
    pids = {e["pid"] for e in events if e.get("ph") == "X"}
    assert pids == {0, 1, 2, 3}, "trace has spans of ranks %s" % sorted(pids)
    for rank in range(4):
        mine = [e for e in events if e.get("ph") == "X" and e["pid"] == rank]
        names = {e["name"] for e in mine}
        assert {"forward unit 0", "backward unit 0", "forward unit 3"} <= names, sorted(names)[:20]
        colls = [e for e in mine if e.get("cat") == "comm"]
        assert any(e["name"].startswith("all_gather") for e in colls), "rank %d: no all_gather span" % rank
        assert any(e["name"].startswith("reduce_scatter") for e in colls), "rank %d: no reduce_scatter" % rank
        for e in mine:
            assert e["dur"] >= 0 and e["ts"] > 0
        steps_traced = {e["args"]["step"] for e in mine if e.get("args", {}).get("step")}
        assert steps_traced == {1, 2}, "rank %d traced steps %s (log.trace_steps=2)" % (rank, steps_traced)
    threads = {e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"}
    assert any("dp_shard" in t for t in threads), threads


@pytest.mark.parametrize("plan", ["fsdp4", "ddp4_buckets"])
def test_failure_in_flight_stops_every_rank(tmp_path, plan):
    """Rank 1's 7th collective on dp_shard (or dp) fails while the overlapped ones are in flight."""
    nproc, mesh, extra = PLANS[plan]
    group = "dp_shard" if mesh[1] > 1 else "dp"
    env = {"MESHRUN_FAULT_COLLECTIVE": "1:%s:7" % group, "MESHRUN_COMM_TIMEOUT": "60"}
    rc, m = run(tmp_path, nproc, mesh, extra + ["train.steps=3"], True, env=env, timeout=50)
    assert rc not in (0, None), m.describe()
    text = m.err + m.out
    injected = [l for l in text.splitlines() if "fault injected" in l]
    print("\n".join(injected[:4]))
    assert len([l for l in injected if "rank 1" in l or "r1/" in l]) >= 1, text[-3000:]
    # reported once by the failing rank, not once per queued request
    assert len([l for l in text.splitlines() if "fault injected" in l and ("[trainer r1/" in l)]) <= 1, text[-3000:]


def run_emulated(netcluster, d, extra, overlap):
    """hsdp 2x2 over 2 emulated hosts (2 ranks each, 2 Gbit/s links): the replicate all-reduce
    crosses the link. Returns (numbers, weights digest)."""
    import netcluster_pytest as nc

    os.makedirs(str(d), exist_ok=True)
    plan = os.path.join(str(d), "plan.json")
    with open(plan, "w") as f:
        json.dump(tiny_plan(), f)
    args = [TRAINER, plan]
    for kv in ["mesh.dp_replicate=2", "mesh.dp_shard=2", "mesh.tp=1", "train.steps=6",
               "log.metrics_file=%s" % os.path.join(str(d), "metrics.jsonl"),
               "checkpoint.dir=%s" % os.path.join(str(d), "ck"),
               "parallel.overlap=%s" % ("true" if overlap else "false")] + list(extra):
        args += ["--set", kv]
    c = netcluster(2)
    codes, outs = nc.run_nodes(c, ["--nproc_per_node=2", "--rdzv_conf=" + FAST_CONF, "--shutdown_timeout=5"] + args,
                               120, env={"OMP_NUM_THREADS": "1"}, cwd=str(d))
    assert codes == [0, 0], "\n".join(outs)
    return numbers(d), digest(os.path.join(str(d), "ck", "final.safetensors"))


@pytest.mark.parametrize("extra", [[], ["parallel.mixed_precision.reduce_dtype=bf16"]], ids=["fp32", "bf16_reduce"])
def test_overlap_bit_identical_on_two_emulated_nodes(netcluster, tmp_path, extra):
    off = run_emulated(netcluster, tmp_path / "off", extra, False)
    on = run_emulated(netcluster, tmp_path / "on", extra, True)
    diff = max(abs(on[0][k] - off[0][k]) for k in off[0])
    print("hsdp 2x2 on 2 emulated hosts: %d values, max abs difference %.3g (tolerance 0); weights %s" %
          (len(off[0]), diff, "identical" if on[1] == off[1] else "DIFFER"))
    assert sorted(on[0]) == sorted(off[0]) and diff == 0
    assert on[1] == off[1]
