"""meshrun's hang watch (--hang_timeout, launcher/hang.c) and its diagnosis (launcher/diagnose.c).

The tiny Llama under meshrun on the cpu comm, tensor parallel over RANKS ranks, the comm timeout
far away (60 s) so that only the hang watch can end the wait, dumps in the run's log folder (no
MESHRUN_DUMP_DIR). Each scenario runs RUNS times; every run must name the right rank, and the
diagnosis must appear within --hang_timeout + 2 s of the fault:

- never entered: MESHRUN_FAULT_STALL=1:3 (trainer/run/hooks.c) stops rank 1 before step 3, alive
  and answering signals, while rank 0 waits in step 3's first collective. The summary names rank
  1 as the rank that never entered that call, with its pid; the fault's time is its stall line.
- stopped: SIGSTOP to rank 1 once the ranks have reported a step (their progress files): it
  cannot answer the dump request; the summary names it as such, stopped, with its pid. The
  fault's time is the kill. Stopping the workers continues it (SIGCONT after SIGTERM), so
  meshrun exits before --shutdown_timeout's SIGKILL would come.
- skipped: a two-stage pipeline instead (PP_PLAN), and MESHRUN_FAULT_SKIP=1:3:ppgrad makes rank 1
  skip its first gradient send of step 3 (comm_skip_next, recorded "skipped"): its later sends
  meet rank 0's earlier receives, rank 0 waits for one more at the end of the step while rank 1
  waits in the step's reduction. The summary names rank 1 as the rank that skipped the send.
  (test_hang_nodes.py runs the three across two emulated hosts.)

Then `meshrun diagnose LOGDIR` prints the same summary from the files left there (exit 0), and a
folder without dumps is exit 2 with one line. Waits poll with deadlines; nothing sleeps a fixed
time.
"""
import os
import re
import signal
import subprocess
import time

import pytest

from conftest import FAST_CONF, MESHRUN, bin_dir, timed_meshrun, tiny_plan
from test_flight_recorder import finish

TRAINER = os.path.join(bin_dir(), "trainer")
HANG_S = 2.0
SHUTDOWN_S = 2.0
RUNS = 3
RANKS = 2
PLAN = tiny_plan(
    mesh={"dp_replicate": 1, "dp_shard": 1, "tp": RANKS},
    train={"steps": 100000, "seq_len": 32, "micro_batch_size": 2, "global_batch_size": 2,
           "lr": 3e-3, "warmup_steps": 2, "decay": "cosine"},
    eval={"interval": 1000000, "batches": 1},
    log={"interval": 1000},
    parallel={"comm_timeout_s": 60},
)

PP_PLAN = dict(PLAN, mesh={"dp_replicate": 1, "dp_shard": 1, "tp": 1, "pp": RANKS},
               train=dict(PLAN["train"], global_batch_size=8),
               parallel=dict(PLAN["parallel"], pp_microbatches=4))


def start(d, env, plan_json=PLAN):
    return timed_meshrun(d, plan_json, ["--nproc_per_node=%d" % RANKS, "--max_restarts=0", "--rdzv_conf=" + FAST_CONF,
                                        "--hang_timeout=%g" % HANG_S, "--shutdown_timeout=%g" % SHUTDOWN_S,
                                        "--log_dir=" + str(d / "logs"), TRAINER], env)


def progress_pids(d):
    """{rank: pid} of the trainers that report progress into this test's log folders (d/logs*)."""
    mine = str(d / "logs").encode()
    out = {}
    for pid in (int(x) for x in os.listdir("/proc") if x.isdigit()):
        try:
            with open("/proc/%d/environ" % pid, "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        except OSError:
            continue
        if mine in env.get(b"MESHRUN_PROGRESS_FILE", b"") and b"RANK" in env:
            out[int(env[b"RANK"])] = pid
    return out


def progress_steps(d):
    steps = []
    for root, _, files in os.walk(str(d)):
        for f in files:
            if f == "progress":
                with open(os.path.join(root, f)) as fh:
                    t = fh.read().strip()
                steps.append(int(t) if t else -1)
    return steps


def diagnosis(lines):
    return [(t, l) for t, l in lines if "[meshrun]" in l and "hang: rank" in l]


def check_diagnose_command(d, summary):
    r = subprocess.run([MESHRUN, "diagnose", str(d / "logs")], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    first = r.stdout.splitlines()[0]
    assert first == summary, "meshrun diagnose: %r\nlive: %r" % (first, summary)
    return r.stdout


def show(run, took, what, lines):
    print("run %d: diagnosis %.2f s after %s (bound %.1f s)\n%s" % (run, took, what, HANG_S + 2, "\n".join(
        l for _, l in lines if "[meshrun]" in l and ("hang" in l or l.split("] ", 1)[-1].startswith("  ")))))


def named_after_fault(d, run, env, fault, pattern, plan_json=PLAN):
    """A run with the fault of env, whose time is rank 1's line containing fault: the summary must
    match pattern within the bound; returns what meshrun diagnose printed."""
    p, lines, reader = start(d, env, plan_json)
    rc = finish(p, reader)
    text = "\n".join(l for _, l in lines)
    at = [t for t, l in lines if l.startswith("[rank1]") and fault in l]
    diag = diagnosis(lines)
    assert rc == 1 and at and diag, "rc=%d\n%s" % (rc, text)
    took = diag[0][0] - at[0]
    summary = re.sub(r"^.*?(hang: )", r"\1", diag[0][1])
    show(run, took, "the fault", lines)
    assert re.search(pattern, summary), text
    assert took <= HANG_S + 2, "diagnosis %.2f s after the fault" % took
    return check_diagnose_command(d, summary)


@pytest.mark.parametrize("run", range(RUNS))
def test_rank_that_never_entered_is_named(tmp_path, run):
    out = named_after_fault(tmp_path, run, {"MESHRUN_FAULT_STALL": "1:3"}, "MESHRUN_FAULT_STALL: stalling before step 3",
                            r"hang: rank 1 \(host [^,]+, pid \d+\) never entered \S+ #\d+ of group \S+, which rank 0 waits in")
    assert "rank 1" in out and "hooks_stall" in out, out


@pytest.mark.parametrize("run", range(RUNS))
def test_stopped_rank_is_named(tmp_path, run):
    p, lines, reader = start(tmp_path, {})
    deadline = time.monotonic() + 60
    pids = {}
    while time.monotonic() < deadline and p.poll() is None:
        steps = progress_steps(tmp_path)
        pids = progress_pids(tmp_path)
        if len(steps) == RANKS and min(steps) >= 2 and len(pids) == RANKS:
            break
        time.sleep(0.05)
    assert len(pids) == RANKS, "\n".join(l for _, l in lines)
    os.kill(pids[1], signal.SIGSTOP)
    t0 = time.monotonic()
    rc = finish(p, reader)
    t_exit = time.monotonic()
    text = "\n".join(l for _, l in lines)
    diag = diagnosis(lines)
    assert rc == 1 and diag, "rc=%d\n%s" % (rc, text)
    took = diag[0][0] - t0
    summary = re.sub(r"^.*?(hang: )", r"\1", diag[0][1])
    show(run, took, "SIGSTOP", lines)
    # the stopped rank continues with its SIGTERM (workers_stop's SIGCONT), not at SIGKILL after the grace
    print("meshrun exited %.2f s after the diagnosis (SIGKILL would come after %g s)" % (t_exit - diag[0][0], SHUTDOWN_S))
    assert t_exit - diag[0][0] < SHUTDOWN_S, "the stopped rank waited for SIGKILL"
    assert re.search(r"hang: rank 1 \(host [^,]+, pid %d\) did not answer the dump request \(stopped\)" % pids[1],
                     summary), text
    assert took <= HANG_S + 2, "diagnosis %.2f s after the fault" % took
    check_diagnose_command(tmp_path, summary)


@pytest.mark.parametrize("run", range(RUNS))
def test_rank_that_skipped_is_named(tmp_path, run):
    named_after_fault(tmp_path, run, {"MESHRUN_FAULT_SKIP": "1:3:ppgrad"}, "MESHRUN_FAULT_SKIP: skipping",
                      r"hang: rank 1 \(host [^,]+, pid \d+\) skipped send #\d+ of group ppgrad\.1: it (waits in|has "
                      r"completed) #\d+ while rank 0 waits in #\d+", PP_PLAN)


def test_diagnose_without_dumps_is_a_usage_error(tmp_path):
    r = subprocess.run([MESHRUN, "diagnose", str(tmp_path)], capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and r.stdout == "", r
    assert r.stderr.count("\n") == 1 and "no flight recorder dumps" in r.stderr, r.stderr
