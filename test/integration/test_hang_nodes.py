"""meshrun's hang watch across nodes (launcher/hang.c over launcher/hang_share.c): 2 emulated
hosts x 2 ranks (test/support/netcluster.py), so the progress counter, the ask and the dumps
cross hosts through the workers' store.

The tiny Llama on the cpu comm, tensor parallel within a host (tp.0 = ranks 0,1 on node 0, tp.2 =
ranks 2,3 on node 1) and data parallel across them, the comm timeout far away (60 s) so that only
the hang watch ends the wait. Every node gets its own log folder. Node 0 alone judges the job,
gathers every node's dumps and prints the diagnosis; the other node's workers are stopped by the
round's end. Each scenario runs RUNS times; every run must name the right rank on the right node
(node 1: the fault is put on host 1's ranks, so that the gathering must cross hosts), within
--hang_timeout + 2 s of the fault:

- never entered: MESHRUN_FAULT_STALL=2:3 (trainer/run/hooks.c) stops rank 2 before step 3,
  alive; rank 3 waits in step 3's first tp.2 call, ranks 0 and 1 soon in calls of their data
  parallel groups with ranks 2 and 3. The fault's time is rank 2's stall line (node
  1's output).
- stopped: SIGSTOP to rank 3 once every rank has reported step 2: it cannot answer; named
  stopped. The fault's time is the kill.
- skipped: a pipeline over the two hosts instead (PP_PLAN: stage 0 = ranks 0,1 on node 0, stage 1
  = ranks 2,3 on node 1, tp 2 within each), and MESHRUN_FAULT_SKIP=3:3:ppgrad makes rank 3 skip
  its first gradient send to rank 1 in step 3 (comm_skip_next: the call is recorded "skipped").
  A real hang: its later sends meet rank 1's earlier receives (a channel does not tell them
  apart), so rank 1 waits for one message more at the end of the step while rank 3 has gone on
  to the step's reductions, which wait for rank 1. Named as the rank that skipped. (On the tp
  ring a skip does not hang: the calls' bytes slide into each other and the loss turns nan.)

The stall also runs once with --rdzv_backend=etcd (one etcd member on a third host), where the
nodes share the round's first node's store instead of the rendezvous's.

Then `meshrun diagnose` over node 0's log folder prints the same summary: node 1's ranks' dumps
were written there. Skipped, naming the reason, only where network namespaces cannot be made.
"""
import json
import os
import re
import signal
import subprocess
import threading
import time

import pytest

import etcdcluster
import netcluster_pytest as nc
from conftest import FAST_CONF, MESHRUN, bin_dir, tiny_plan
from test_hang import progress_pids, progress_steps

TRAINER = os.path.join(bin_dir(), "trainer")
HANG_S = 2.0
RUNS = 3
NODES, NPROC = 2, 2
PLAN = tiny_plan(
    mesh={"dp_replicate": 1, "dp_shard": NODES, "tp": NPROC},
    train={"steps": 100000, "seq_len": 32, "micro_batch_size": 2, "global_batch_size": 4,
           "lr": 3e-3, "warmup_steps": 2, "decay": "cosine"},
    eval={"interval": 1000000, "batches": 1},
    log={"interval": 1000},
    parallel={"comm_timeout_s": 60},
)


PP_PLAN = dict(PLAN, mesh={"dp_replicate": 1, "dp_shard": 1, "tp": NPROC, "pp": NODES},
               train=dict(PLAN["train"], global_batch_size=8),
               parallel=dict(PLAN["parallel"], pp_microbatches=4))


class Job:
    """One meshrun per host, each with its log folder d/logs<i>; stderr lines with the time each
    arrived, per node."""

    def __init__(self, c, d, env, plan_json=PLAN, etcd=None):
        self.d = d
        plan = os.path.join(str(d), "plan.json")
        with open(plan, "w") as f:
            json.dump(plan_json, f)
        e = {"OMP_NUM_THREADS": "1", "MESHRUN_DUMP_DIR": ""}  # dumps in the log folders (an empty value is unset)
        e.update(env)
        args = ["--nproc_per_node=%d" % NPROC, "--max_restarts=0", "--rdzv_conf=" + FAST_CONF,
                "--hang_timeout=%g" % HANG_S, "--shutdown_timeout=2", TRAINER, plan]
        if etcd:  # the rendezvous in etcd; the workers' store is then the round's first node's own
            args = ["--rdzv_backend=etcd"] + args
        self.procs = nc.start_meshrun(c, args, meshrun=MESHRUN, env=e, cwd=str(d), stdout=subprocess.DEVNULL,
                                      stderr=subprocess.PIPE, node_args=lambda i: ["--log_dir=%s" % self.logs(i)],
                                      hosts=NODES, endpoint=etcd.endpoints() if etcd else None)
        self.lines = [[] for _ in self.procs]
        self.readers = [threading.Thread(target=self._read, args=(i,)) for i in range(len(self.procs))]
        for t in self.readers:
            t.start()

    def logs(self, i):
        return os.path.join(str(self.d), "logs%d" % i)

    def _read(self, i):
        for raw in self.procs[i].stderr:
            self.lines[i].append((time.monotonic(), raw.decode(errors="replace").rstrip("\n")))

    def finish(self, timeout=90):
        codes = nc.wait_all(self.procs, timeout)
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for t in self.readers:
            t.join(10)
        return codes

    def text(self):
        return "\n".join("node%d: %s" % (i, l) for i, ls in enumerate(self.lines) for _, l in ls)


def summary_of(job):
    diag = [(t, l) for t, l in job.lines[0] if "[meshrun]" in l and "hang: rank" in l]
    assert diag, "node 0 printed no diagnosis\n" + job.text()
    return diag[0][0], re.sub(r"^.*?(hang: )", r"\1", diag[0][1])


def report(job, run, what, took):
    print("run %d: diagnosis %.2f s after the %s (bound %.1f s)\n%s" % (run, took, what, HANG_S + 2, "\n".join(
        l for _, l in job.lines[0] if "[meshrun]" in l and ("hang" in l or l.split("] ", 1)[-1].startswith("  ")))))


def check_diagnose_command(job, summary):
    r = subprocess.run([MESHRUN, "diagnose", job.logs(0)], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    first = r.stdout.splitlines()[0]
    assert first == summary, "meshrun diagnose: %r\nlive: %r" % (first, summary)
    for rank in range(NODES * NPROC):  # every rank's dump is in node 0's folder
        assert re.search(r"flight-rank%d-" % rank, "\n".join(
            f for _, _, fs in os.walk(job.logs(0)) for f in fs)), "rank %d has no dump in %s" % (rank, job.logs(0))
    return r.stdout


def fault_line(job, node, rank, text):
    ts = [t for t, l in job.lines[node] if l.startswith("[rank%d]" % rank) and text in l]
    assert ts, "no %r from rank %d\n%s" % (text, rank, job.text())
    return ts[0]


def named_after_fault(job, run, rank, fault, pattern):
    """The fault's time is rank's line containing fault (node 1's output); the summary must match
    pattern within the bound; returns what meshrun diagnose printed on node 0's folder."""
    codes = job.finish()
    assert codes[0] == 1, "exit codes %s\n%s" % (codes, job.text())
    t, summary = summary_of(job)
    took = t - fault_line(job, 1, rank, fault)
    report(job, run, "fault", took)
    assert re.search(pattern, summary), job.text()
    assert took <= HANG_S + 2, "diagnosis %.2f s after the fault" % took
    return check_diagnose_command(job, summary)


@pytest.mark.parametrize("run", range(RUNS))
def test_rank_that_never_entered_is_named_across_nodes(netcluster, tmp_path, run):
    job = Job(netcluster(NODES), tmp_path, {"MESHRUN_FAULT_STALL": "2:3"})
    out = named_after_fault(job, run, 2, "MESHRUN_FAULT_STALL: stalling before step 3",
                            r"hang: rank 2 \(host [^,]+, node 1, pid \d+\) never entered \S+ #\d+ of group \S+, which "
                            r"ranks? [0-9,-]+ waits? in")
    assert "hooks_stall" in out


def test_rank_that_never_entered_is_named_with_etcd(netcluster, tmp_path):
    """The same through --rdzv_backend=etcd (one member on a host of its own): the nodes share
    the round's first node's store, not the rendezvous's."""
    ok, why = etcdcluster.available()
    if not ok:
        pytest.skip(why)
    c = netcluster(NODES + 1)
    e = etcdcluster.EtcdCluster(c, [NODES], str(tmp_path))
    e.wait_ready()
    job = Job(c, tmp_path, {"MESHRUN_FAULT_STALL": "2:3"}, etcd=e)
    named_after_fault(job, 0, 2, "MESHRUN_FAULT_STALL: stalling before step 3",
                      r"hang: rank 2 \(host [^,]+, node 1, pid \d+\) never entered \S+ #\d+ of group \S+")


@pytest.mark.parametrize("run", range(RUNS))
def test_stopped_rank_is_named_across_nodes(netcluster, tmp_path, run):
    job = Job(netcluster(NODES), tmp_path, {})
    deadline = time.monotonic() + 60
    pids = {}
    while time.monotonic() < deadline and all(p.poll() is None for p in job.procs):
        steps, pids = progress_steps(tmp_path), progress_pids(tmp_path)
        if len(steps) == NODES * NPROC and min(steps) >= 2 and len(pids) == NODES * NPROC:
            break
        time.sleep(0.05)
    assert len(pids) == NODES * NPROC, job.text()
    os.kill(pids[3], signal.SIGSTOP)
    t0 = time.monotonic()
    codes = job.finish()
    assert codes[0] == 1, "exit codes %s\n%s" % (codes, job.text())
    t, summary = summary_of(job)
    report(job, run, "SIGSTOP", t - t0)
    assert re.search(r"hang: rank 3 \(host [^,]+, node 1, pid %d\) did not answer the dump request \(stopped\)" %
                     pids[3], summary), job.text()
    assert t - t0 <= HANG_S + 2, "diagnosis %.2f s after the fault" % (t - t0)
    check_diagnose_command(job, summary)


@pytest.mark.parametrize("run", range(RUNS))
def test_rank_that_skipped_is_named_across_nodes(netcluster, tmp_path, run):
    job = Job(netcluster(NODES), tmp_path, {"MESHRUN_FAULT_SKIP": "3:3:ppgrad"}, PP_PLAN)
    named_after_fault(job, run, 3, "MESHRUN_FAULT_SKIP: skipping",
                      r"hang: rank 3 \(host [^,]+, node 1, pid \d+\) skipped send #\d+ of group ppgrad\.3: it "
                      r"(waits in|has completed) #\d+ while rank 1 waits in #\d+")
