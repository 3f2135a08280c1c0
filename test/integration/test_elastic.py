"""test_elastic: kills and joins under meshrun, end to end (trainer checkpoints + meshrun restarts).

The plan is test_checkpoint's tiny Llama with synthetic data, FSDP over whatever world there is
(mesh.dp_shard -1) and a fixed global batch of 16 sequences (micro-batch 2: gradient
accumulation adapts to the world), checkpoints every 5 steps, checkpoint.resume auto. Kills are
triggered by observed progress (the metrics file's step records), never by sleeps; the time from
a kill to the first training step of the next round is measured from the same file (polled every
5 ms) and printed.

(a) kill -9 of a random worker at a random step of an fsdp4 run (--max_restarts=3): the run
    finishes; every loss after the resume and the final loss equal the uninterrupted fsdp4 run
    (bit-identical expected, same world; asserted within 1e-4 relative, difference printed).
(b) SIGKILL of a whole node (its meshrun and its 2 workers) of a 2-node run (--nnodes=1:2): the
    survivor restarts alone as world 2 (fsdp2), resumes resharded from the last checkpoint and
    trains to the end; asserted: it resumed ("saved by world 4, now world 2"), and every loss
    after the resume and the final loss are within 1e-4 relative of the uninterrupted fsdp4 run
    (every layout trains to the same losses within fp32 rounding, about 1e-7, so a world-2 run
    from that checkpoint on is the same within the tolerance).
(c) a node joining later: a 1-node run (world 2) scales up to world 4 when a second node arrives,
    resumes from its checkpoint and finishes with the same check against the uninterrupted run.
(d) (b) under pipeline parallelism (mesh.pp 2): two nodes of 2 ranks train as pp2 x dp2 (node A
    holds stage 0's two data-parallel ranks, node B stage 1's); node B is killed, node A restarts
    alone as pp2 x dp1 (one rank per stage), resumes from the pp2 x dp2 checkpoint and finishes on
    the uninterrupted run's losses within 1e-4. The same under context parallelism (mesh.cp 2):
    cp2 x dp_shard 2 across the nodes, then node A alone as cp2 x dp_shard 1.
"""
import os
import random
import signal
import socket
import time

import pytest

from conftest import MESHRUN, Meshrun, free_port, meshrun_guard, wait_for
from test_checkpoint import PLAN, TOL, TRAINER, losses, read_records, write_plan

CONF = "join_timeout=30,last_call_timeout=0.3,heartbeat_interval=0.1,heartbeat_timeout=1"
STEPS = 120


def plan_args(d, extra=()):
    plan = dict(PLAN)
    plan["eval"] = {"interval": 0}
    plan["log"] = {"interval": 20}
    plan["mesh"] = {"dp_replicate": 1, "dp_shard": -1, "tp": 1}
    out = [write_plan(d, plan)]
    for kv in ["train.steps=%d" % STEPS, "log.metrics_file=%s" % os.path.join(str(d), "metrics.jsonl"),
               "checkpoint.dir=%s" % os.path.join(str(d), "ck"), "checkpoint.interval=5",
               "checkpoint.resume=auto"] + list(extra):
        out += ["--set", kv]
    return out


def metrics(d):
    p = os.path.join(str(d), "metrics.jsonl")
    return read_records(p) if os.path.exists(p) else []


def progress(d):
    """(headers seen, last step record after the last header or 0)."""
    heads, last = 0, 0
    for r in metrics(d):
        if "plan" in r:
            heads, last = heads + 1, 0
        elif "loss" in r:
            last = r["step"]
    return heads, last


def wait_step(d, heads, step, timeout, what):
    """Polls every 5 ms until round `heads` (1-based count of headers) logged a step >= step."""
    deadline = time.monotonic() + timeout
    while True:
        h, s = progress(d)
        if h >= heads and (h > heads or s >= step):
            return time.monotonic(), h, s
        if time.monotonic() > deadline:
            pytest.fail("timed out after %.0fs waiting for %s (rounds %d, last step %d)" % (timeout, what, h, s))
        time.sleep(0.005)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    d = tmp_path_factory.mktemp("uninterrupted")
    m = Meshrun(["--nproc_per_node=4", "--rdzv_conf=" + CONF, TRAINER] + plan_args(d),
                env={"OMP_NUM_THREADS": "1"}, cwd=str(d))
    assert m.wait(120) == 0, m.describe()
    return losses(d)


def check_against(ref, d, resumed_at, label):
    got = losses(d)
    assert got[(False, STEPS)], "%s: no final step" % label
    keys = sorted(k for k in ref if k[1] > resumed_at)
    assert all(k in got for k in keys), "%s: steps missing after the resume" % label
    d_all = max(abs(got[k] - ref[k]) / abs(ref[k]) for k in keys)
    d_final = abs(got[(False, STEPS)] - ref[(False, STEPS)]) / abs(ref[(False, STEPS)])
    print("%s: final loss %.9g vs uninterrupted %.9g: rel diff %.2e; max over the %d steps after the resume %.2e "
          "(tolerance %.0e)" % (label, got[(False, STEPS)], ref[(False, STEPS)], d_final, len(keys), d_all, TOL))
    assert d_all <= TOL
    return d_final


def resumed_step(err):
    for line in err.splitlines():
        if "resumed from" in line:
            return int(line.split("(step ")[1].split(",")[0]), line[line.index("resumed from"):]
    pytest.fail("no 'resumed from' line:\n" + err)


def worker_pids(meshrun_pid):
    """The processes whose parent is meshrun_pid (its workers; not its guard)."""
    out = []
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            with open("/proc/%s/stat" % p) as f:
                st = f.read()
            if int(st.rsplit(")", 1)[1].split()[1]) == meshrun_pid and not meshrun_guard(int(p)):
                out.append(int(p))
        except (OSError, IndexError, ValueError):
            pass
    return sorted(out)


def test_kill_random_worker(uninterrupted, tmp_path):
    rnd = random.Random()
    at = rnd.randrange(12, 40)
    m = Meshrun(["--nproc_per_node=4", "--max_restarts=3", "--rdzv_conf=" + CONF, TRAINER] + plan_args(tmp_path),
                env={"OMP_NUM_THREADS": "1"}, cwd=str(tmp_path))
    try:
        _, _, seen = wait_step(tmp_path, 1, at, 60, "step %d" % at)
        pids = worker_pids(m.pid)
        assert len(pids) == 4
        victim = rnd.choice(pids)
        os.kill(victim, signal.SIGKILL)
        t_kill = time.monotonic()
        t_back, _, _ = wait_step(tmp_path, 2, 1, 60, "the first step after the restart")
        assert m.wait(120) == 0, m.describe()
    finally:
        m.kill()
    step, line = resumed_step(m.err)
    print("killed worker pid %d at step %d (target %d); %s; kill -> training again: %.2f s" %
          (victim, seen, at, line, t_back - t_kill))
    # A worker failure is a failure restart: the restart count and the round both go up.
    assert "restart 1, round 1)" in line and "now world 4" in line
    check_against(uninterrupted, tmp_path, step, "kill -9 of a worker")


def node(port, d, nproc=2, extra=()):
    return Meshrun(["--nnodes=1:2", "--nproc_per_node=%d" % nproc, "--rdzv_endpoint=127.0.0.1:%d" % port,
                    "--rdzv_id=elastic", "--max_restarts=3", "--rdzv_conf=" + CONF, TRAINER] + plan_args(d, extra),
                   env={"OMP_NUM_THREADS": "1"}, cwd=str(d))


@pytest.mark.parametrize("extra", [(), ("mesh.pp=2",), ("mesh.cp=2",)], ids=["fsdp", "pp2", "cp2"])
def test_kill_whole_node(uninterrupted, tmp_path, extra):
    port = free_port()
    a = node(port, tmp_path, extra=extra)
    wait_for(lambda: _listening(port), 30, "node A to serve the store")
    b = node(port, tmp_path, extra=extra)
    try:
        wait_for(lambda: any(r.get("world_size") == 4 for r in metrics(tmp_path)), 60, "the 2-node round (world 4)")
        heads = sum(1 for r in metrics(tmp_path) if "plan" in r)
        at = random.randrange(12, 40)
        _, _, seen = wait_step(tmp_path, heads, at, 60, "step %d of world 4" % at)
        b.kill()  # SIGKILL to node B's session: its meshrun and both workers
        t_kill = time.monotonic()
        b.proc.communicate()
        t_back, _, _ = wait_step(tmp_path, heads + 1, 1, 60, "the survivor's first step")
        assert a.wait(120) == 0, a.describe()
    finally:
        a.kill()
        b.kill()
    step, line = resumed_step(a.err)
    print("killed node B at step %d; %s; kill -> training again: %.2f s" % (seen, line, t_back - t_kill))
    assert "saved by world 4, now world 2" in line
    heads = [r for r in metrics(tmp_path) if "plan" in r]
    assert heads[-1]["world_size"] == 2
    if extra:  # the pipeline (context parallelism) survives the shrink: x dp2, then x dp1
        dim = extra[0].split("=")[0].split(".")[1]
        meshes = [(h["plan"]["mesh"][dim], h["plan"]["mesh"]["dp_shard"]) for h in heads]
        assert meshes[0] == (2, 2) and meshes[-1] == (2, 1), meshes
    check_against(uninterrupted, tmp_path, step, "node killed, survivor alone (world 2%s)" % (
        ", %s2 x dp1" % dim if extra else ""))


def _listening(port):
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_node_joins_later(uninterrupted, tmp_path):
    port = free_port()
    a = node(port, tmp_path)
    b = None
    try:
        wait_step(tmp_path, 1, 6, 60, "node A alone (world 2) at step 6")
        assert metrics(tmp_path)[0]["world_size"] == 2
        b = node(port, tmp_path)
        t_join = time.monotonic()
        wait_for(lambda: any(r.get("world_size") == 4 for r in metrics(tmp_path)), 60,
                 "the bigger round (world 4)")
        t_back, _, _ = wait_step(tmp_path, 2, 1, 60, "the first step of world 4")
        assert a.wait(120) == 0, a.describe()
        assert b.wait(60) == 0, b.describe()
    finally:
        a.kill()
        if b:
            b.kill()
    step, line = resumed_step(a.err + b.err)  # rank 0 of the new round may be on either node
    print("node B joined; %s; join -> training again in world 4: %.2f s" % (line, t_back - t_join))
    assert "saved by world 2, now world 4" in line
    check_against(uninterrupted, tmp_path, step, "node joined (world 2 -> 4)")
