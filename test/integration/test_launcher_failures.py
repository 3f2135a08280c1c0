"""Failures meshrun does not retry, on one node and on two: a worker's permanent failure (exit 2
or 78, or an error file asking for no restart) ends the whole job at once with that code,
whatever restarts are left; the rendezvous store's node dying ends every other node at once
with exit 69 and one line that names the store and what would survive it.

"No restart happened" is proved by the files worker.py leaves per round (rank<R>.attempt<N>.*):
the failing worker fails only in its first round (--fail-attempts=1), so a restart would also
make the job succeed. Times are measured from the kill (or stop) to the survivor's exit and
printed; the bound is heartbeat_timeout + 1 s."""
import glob
import os
import re
import signal
import time

import pytest

from conftest import FAST_CONF, free_port, pids_alive, read_json, wait_for, worker_cmd, worker_file
from test_launcher_multinode import endpoint_up, node

HEARTBEAT_TIMEOUT = 1.0  # FAST_CONF's
assert "heartbeat_timeout=%g" % HEARTBEAT_TIMEOUT in FAST_CONF
STORE_LOST = 69
MEANING = {2: "a usage or plan error", 78: "EX_CONFIG, a configuration error"}


def later_rounds(d):
    """Files of any round after the first: there are none unless meshrun restarted."""
    return sorted(os.path.basename(f) for f in glob.glob(os.path.join(str(d), "rank*.attempt[1-9]*")))


def check_permanent_summary(err, rank, code, message):
    assert "no restart tried: exit code %d is permanent (%s)" % (code, MEANING[code]) in err, err
    assert "re-rendezvous" not in err, err
    assert re.search(r"rank:\s+%d\b" % rank, err), err
    assert re.search(r"exitcode:\s+%d\b" % code, err), err
    assert re.search(r"message:\s+%s" % re.escape(message), err), err


# ---- (A) permanent failures: one node ----

@pytest.mark.parametrize("code", [2, 78])
def test_permanent_exit_code_ends_the_job_at_once(launch, tmp_path, code):
    # Rank 1 fails once with the code; rank 0 waits for a file that never comes (meshrun stops it).
    m = launch(["--nproc_per_node=2", "--max_restarts=3", "--rdzv_conf=" + FAST_CONF, "--shutdown_timeout=5"] +
               worker_cmd(tmp_path, "--fail-rank=1", "--fail-attempts=1", "--code=%d" % code,
                          "--hang-until=%s" % (tmp_path / "never")))
    rc = m.wait(30)
    print("exit %d" % rc)
    assert rc == code, m.describe()
    assert os.path.exists(worker_file(tmp_path, 1, 0, "exit")), m.describe()
    assert later_rounds(tmp_path) == [], m.describe()
    check_permanent_summary(m.err, 1, code,
                            "exit code %d (permanent: %s; meshrun does not restart it)" % (code, MEANING[code]))


def test_permanent_exit_code_reports_the_error_file_message(launch, tmp_path):
    m = launch(["--nproc_per_node=1", "--max_restarts=3", "--rdzv_conf=" + FAST_CONF] +
               worker_cmd(tmp_path, "--fail-rank=0", "--fail-attempts=1", "--code=2",
                          "--errfile=plan error: mesh.tp=3 does not divide WORLD_SIZE 8"))
    assert m.wait(30) == 2, m.describe()
    assert later_rounds(tmp_path) == [], m.describe()
    check_permanent_summary(m.err, 0, 2, "plan error: mesh.tp=3 does not divide WORLD_SIZE 8")


@pytest.mark.parametrize("code,errfile", [(1, ()), (3, ()), (2, ("--errfile=transient", "--errfile-restart=true"))],
                         ids=["exit1", "exit3", "exit2-errfile-restart-true"])
def test_other_failures_still_restart(launch, tmp_path, code, errfile):
    # Any other code restarts; so does exit 2 when the error file says "restart": true.
    m = launch(["--nproc_per_node=2", "--max_restarts=3", "--rdzv_conf=" + FAST_CONF] +
               worker_cmd(tmp_path, "--fail-rank=1", "--fail-attempts=1", "--code=%d" % code, *errfile))
    assert m.wait(30) == 0, m.describe()
    assert os.path.exists(worker_file(tmp_path, 1, 0, "exit")), m.describe()
    for r in range(2):
        e = read_json(worker_file(tmp_path, r, 1, "json"))
        assert e["TORCHELASTIC_RESTART_COUNT"] == "1", e
        assert os.path.exists(worker_file(tmp_path, r, 1, "done"))
    assert "no restart tried" not in m.err, m.describe()


# ---- (A) permanent failures: two nodes ----

@pytest.mark.parametrize("fail_rank", [0, 1], ids=["on-store-node", "on-other-node"])
def test_permanent_exit_code_ends_every_node(launch, tmp_path, fail_rank):
    """Node A (node rank 0, rank 0) serves the store, node B (node rank 1, rank 1) joins; one rank
    exits 2 once under --max_restarts=3: both nodes stop at once with 2, neither starts round 1,
    and both name the same root cause."""
    port = free_port()
    prog = worker_cmd(tmp_path, "--fail-rank=%d" % fail_rank, "--fail-attempts=1", "--code=2",
                      "--hang-until=%s" % (tmp_path / "never"))
    a = node(launch, port, "2", 1, prog, ["--node_rank=0", "--max_restarts=3"])
    wait_for(endpoint_up(port), 20, "node A to serve the store")
    b = node(launch, port, "2", 1, prog, ["--node_rank=1", "--max_restarts=3"])
    ra, rb = a.wait(30), b.wait(30)
    print("node A exit %d, node B exit %d" % (ra, rb))
    assert ra == 2, a.describe()
    assert rb == 2, b.describe()
    assert os.path.exists(worker_file(tmp_path, fail_rank, 0, "exit"))
    assert later_rounds(tmp_path) == [], a.describe() + b.describe()
    for m in (a, b):
        assert "round 1" not in m.err, m.describe()
        check_permanent_summary(m.err, fail_rank, 2,
                                "exit code 2 (permanent: a usage or plan error; meshrun does not restart it)")
    # The node without the failure heard it through the round's end record.
    other = b if fail_rank == 0 else a
    assert "ended elsewhere" in other.err, other.describe()


# ---- (B) the store's node dies ----

def start_pair(launch, tmp_path, port, nnodes):
    """Node A serves the store, node B joins; returns once both workers run (B's pid too)."""
    prog = worker_cmd(tmp_path, "--hang-until=%s" % (tmp_path / "never"))
    a = node(launch, port, nnodes, 1, prog, ["--node_rank=0", "--max_restarts=3"])
    wait_for(endpoint_up(port), 20, "node A to serve the store")
    b = node(launch, port, nnodes, 1, prog, ["--node_rank=1", "--max_restarts=3"])
    wait_for(lambda: all(os.path.exists(worker_file(tmp_path, r, 0, "json")) for r in range(2)), 30,
             "both ranks of round 0")
    return a, b, read_json(worker_file(tmp_path, 1, 0, "json"))["_pid"]


def check_store_lost(b, port, elapsed, what):
    print("%s -> survivor's exit: %.3f s (heartbeat_timeout %g s, allowed < %g s)" % (
        what, elapsed, HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT + 1))
    assert b.proc.returncode == STORE_LOST, b.describe()
    lines = [l for l in b.err.splitlines() if "rendezvous store at 127.0.0.1:%d lost" % port in l]
    assert len(lines) == 1, b.describe()
    assert "--rdzv_backend=etcd" in lines[0] and "(exit %d)" % STORE_LOST in lines[0], b.describe()
    assert elapsed < HEARTBEAT_TIMEOUT + 1, b.describe()
    return lines[0]


@pytest.mark.parametrize("nnodes", ["2", "1:2"], ids=["fixed", "elastic"])
def test_store_node_killed_survivor_exits_69(launch, tmp_path, nnodes):
    """kill -9 of node A's meshrun session (its worker dies by PDEATHSIG): node B, even when it
    could go on alone (elastic), cannot without the store: exit 69 well within heartbeat_timeout."""
    port = free_port()
    a, b, b_worker = start_pair(launch, tmp_path, port, nnodes)
    a.kill()
    t_kill = time.monotonic()
    b.wait(30)
    elapsed = time.monotonic() - t_kill
    a.proc.communicate()
    check_store_lost(b, port, elapsed, "kill -9 of the store's node")
    assert pids_alive([b_worker]) == []
    assert later_rounds(tmp_path) == []


def test_store_node_frozen_survivor_exits_69_within_heartbeat_timeout(launch, tmp_path):
    """SIGSTOP of node A's meshrun: its sockets stay open and the kernel still acknowledges, but
    the store answers nothing (as a host that lost power or its network). Node B must give up
    after heartbeat_timeout of silence, not after the store client's 5 s reply slack."""
    port = free_port()
    a, b, _ = start_pair(launch, tmp_path, port, "2")
    os.kill(a.pid, signal.SIGSTOP)
    t_stop = time.monotonic()
    try:
        b.wait(30)
        elapsed = time.monotonic() - t_stop
    finally:
        a.kill()  # SIGKILL ends a stopped process too
        a.proc.communicate()
    line = check_store_lost(b, port, elapsed, "SIGSTOP of the store's node")
    assert "no reply for" in line and "heartbeat_timeout=%gs" % HEARTBEAT_TIMEOUT in line, line
    # The last reply came at most one heartbeat interval (0.1 s) before the stop.
    assert elapsed > HEARTBEAT_TIMEOUT - 0.2, "gave up before heartbeat_timeout of silence:\n" + b.describe()
