"""test_faults: a collective that fails inside a training step stops that step before the
optimizer, on every rank, at once.

tp2 under bin/meshrun (2 ranks, cpu backend, comm "cpu" on loopback): the tensor-parallel model
runs collectives in the forward (reductions of the rowwise linears, the vocab-parallel
embedding, the loss) and in the backward (their mirrors). MESHRUN_FAULT_COMM=1:3:fwd|bwd (a
test hook of trainer/model/model.c) makes rank 1's first tensor-parallel collective of its third
training pass fail as a lost connection would: that rank shuts its ring down, so rank 0, inside
the same collective, fails at once too. With one micro-batch per step, no eval before the last
step and no resume, the third pass is step 3. Checked, for a fault in the forward and one in the
backward:
  - meshrun exits non-zero (the trainer's status; no restarts are allowed);
  - well under the comm timeout: MESHRUN_COMM_TIMEOUT is 60 s, the run must end within 30 s
    (observed: a few seconds, most of it start-up);
  - both ranks name the cause: "step 3 ... the forward|backward pass failed", rank 1 with
    "fault injected", rank 0 with the tensor-parallel collective and its lost peer;
  - no rank completed step 3: the metrics file has steps 1 and 2 only, and the checkpoints
    (saved every step) are step-1 and step-2, no step-3.
Before model_backward returned a status, a failed backward collective was noticed only at the
next forward, after the optimizer had stepped on partial gradients, and step 3 was logged and
saved: this test fails that way.

A stalled peer, the same tp2 run: MESHRUN_FAULT_STALL=1:3 (trainer/run/hooks.c) stops rank 1 before
step 3 as a hung device would, alive and silent, so only the comm timeout can end rank 0's wait in
step 3's first tensor-parallel collective. With the plan's parallel.comm_timeout_s=2 (and, second
case, the plan's 300 overridden by MESHRUN_COMM_TIMEOUT=1.5, which wins as documented), rank 0
fails naming the collective, its group, the peer and the timeout; the time from rank 1's stall
line to rank 0's timeout line, as meshrun forwards them, is the timeout T, within [T - 0.25 s,
T + 1.5 s] (observed T + 0.01 s); meshrun ends within 10 s after that. Before the plan key
existed, the run was a plan error (unknown key parallel.comm_timeout_s), and the only timeout was
MESHRUN_COMM_TIMEOUT's or the default 300 s.
"""
import json
import os
import re
import subprocess
import time

import pytest

from conftest import FAST_CONF, Meshrun, bin_dir, timed_meshrun, tiny_plan

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRAINER = os.path.join(bin_dir(), "trainer")
TEXT = os.path.join(REPO, "data", "tinyshakespeare.txt")
COMM_TIMEOUT_S = 60
LIMIT_S = 30

PLAN = tiny_plan(
    mesh={"dp_replicate": 1, "dp_shard": 1, "tp": 2},
    parallel={"sequence_parallel": True, "loss_parallel": True},
    # one micro-batch per step (dp is 1), so training pass k is step k
    train={"steps": 6, "seq_len": 32, "micro_batch_size": 2, "global_batch_size": 2,
           "lr": 3e-3, "warmup_steps": 2, "decay": "cosine"},
    data={"train": TEXT, "format": "text"},
    eval={"interval": 1000, "batches": 1},  # only after the last step, never reached
    log={"interval": 1},
)


def run_faulted(d, phase):
    plan = os.path.join(str(d), "plan.json")
    with open(plan, "w") as f:
        json.dump(PLAN, f)
    sets = []
    for kv in ["log.metrics_file=%s" % os.path.join(str(d), "metrics.jsonl"),
               "checkpoint.dir=%s" % os.path.join(str(d), "ck"), "checkpoint.interval=1"]:
        sets += ["--set", kv]
    t0 = time.monotonic()
    m = Meshrun(["--nproc_per_node=2", "--max_restarts=0", "--rdzv_conf=" + FAST_CONF, TRAINER, plan] + sets,
                env={"OMP_NUM_THREADS": "1", "MESHRUN_COMM_TIMEOUT": str(COMM_TIMEOUT_S),
                     "MESHRUN_FAULT_COMM": "1:3:%s" % phase},
                cwd=str(d))
    rc = m.wait(120)
    return rc, time.monotonic() - t0, m


@pytest.mark.parametrize("phase,word", [("fwd", "forward"), ("bwd", "backward")])
def test_failed_collective_stops_the_step_on_every_rank(tmp_path, phase, word):
    rc, took, m = run_faulted(tmp_path, phase)
    print("tp2, collective failed in the %s of step 3: meshrun rc %d after %.2f s (limit %d s, comm timeout %d s)" %
          (word, rc, took, LIMIT_S, COMM_TIMEOUT_S))
    assert rc != 0, m.describe()
    assert took < LIMIT_S, m.describe()

    # Both ranks stop in step 3 with the cause named (the ranks' own lines, "[rankN]:" prefixed).
    lines = [l for l in m.err.splitlines() if l.startswith("[rank") and "step 3" in l and
             "the %s pass failed" % word in l]
    for l in lines:
        print("  " + l)
    by_rank = {l.split("]:")[0]: l for l in lines}
    assert set(by_rank) == {"[rank0", "[rank1"}, m.describe()
    assert "fault injected" in by_rank["[rank1"], m.describe()
    assert "tensor-parallel" in by_rank["[rank0"] and "rank 1" in by_rank["[rank0"], m.describe()

    # No rank completed step 3: not logged, not saved.
    with open(tmp_path / "metrics.jsonl") as f:
        steps = sorted({r["step"] for r in (json.loads(x) for x in f if x.strip()) if "step" in r})
    print("  steps in the metrics file: %s; checkpoints: %s" % (steps, sorted(os.listdir(tmp_path / "ck"))))
    assert steps == [1, 2], m.describe()
    saved = sorted(x for x in os.listdir(tmp_path / "ck") if x.startswith("step-"))
    assert saved == ["step-1", "step-2"], m.describe()


def run_stalled(d, sets, env):
    """meshrun with rank 1 stalled before step 3: (rc, [(arrival time, stderr line)], end time).
    Lines are timed as they arrive (a reader thread), so the test sees when each rank said what."""
    after = []
    for kv in sets:
        after += ["--set", kv]
    p, lines, reader = timed_meshrun(d, PLAN, ["--nproc_per_node=2", "--max_restarts=0", "--rdzv_conf=" + FAST_CONF,
                                               TRAINER], dict({"MESHRUN_FAULT_STALL": "1:3"}, **env), after)
    try:
        rc = p.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, 9)
        rc = p.wait()
    end = time.monotonic()
    reader.join(10)
    return rc, lines, end


@pytest.mark.parametrize("case,sets,env,timeout_s", [
    ("plan", ["parallel.comm_timeout_s=2"], {}, 2.0),
    ("env_overrides_plan", ["parallel.comm_timeout_s=300"], {"MESHRUN_COMM_TIMEOUT": "1.5"}, 1.5),
])
def test_stalled_peer_fails_after_the_comm_timeout(tmp_path, case, sets, env, timeout_s):
    rc, lines, end = run_stalled(tmp_path, sets, env)
    text = "\n".join(l for _, l in lines)
    stall = [(t, l) for t, l in lines if l.startswith("[rank1]") and "MESHRUN_FAULT_STALL: stalling before step 3" in l]
    timeout = [(t, l) for t, l in lines if l.startswith("[rank0]") and "timed out after %g s" % timeout_s in l]
    assert rc != 0 and stall and timeout, "rc=%d\n%s" % (rc, text)
    waited, ended = timeout[0][0] - stall[0][0], end - timeout[0][0]
    print("%s: rank 0 failed %.2f s after rank 1 stalled (timeout %g s, bound [%g, %g] s); meshrun rc %d %.2f s "
          "later\n  %s" % (case, waited, timeout_s, timeout_s - 0.25, timeout_s + 1.5, rc, ended, timeout[0][1]))
    # the collective, its group, the peer waited for, the step and the pass
    assert re.search(r"step 3 .*the forward pass failed: .*comm tp\.0 .*: (all_reduce|all_gather|reduce_scatter) "
                     r"timed out after %g s waiting for rank 1" % timeout_s, timeout[0][1]), timeout[0][1]
    assert timeout_s - 0.25 <= waited <= timeout_s + 1.5
    assert ended < 10
