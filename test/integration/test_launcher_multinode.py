"""Several meshrun processes on loopback forming one job: heterogeneous nodes, a node that
dies, a node that arrives late, garbage on the store port, a port held by another program,
IPv6 and hostname endpoints, worker failures on one node restarting every node, the job-wide
restart budget."""
import glob
import os
import re
import select
import signal
import socket
import threading
import time

import pytest

from conftest import (FAST_CONF, free_port, free_port6, pids_alive, read_json, wait_for, worker_cmd,
                      worker_file)


def endpoint_up(port, host="127.0.0.1"):
    def check():
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return True
        except OSError:
            return False
    return check


def node(launch, port, nnodes, nproc, prog, extra=(), host="127.0.0.1"):
    return launch(["--nnodes=%s" % nnodes, "--nproc_per_node=%d" % nproc, "--rdzv_endpoint=%s:%d" % (host, port),
                   "--rdzv_conf=" + FAST_CONF, "--shutdown_timeout=5"] + list(extra) + prog)


def test_two_nodes_heterogeneous_ranks(launch, tmp_path):
    port = free_port()
    a = node(launch, port, "2", 1, worker_cmd(tmp_path), ["--node_rank=1"])
    b = node(launch, port, "2", 2, worker_cmd(tmp_path), ["--node_rank=0"])
    assert a.wait(30) == 0, a.describe()
    assert b.wait(30) == 0, b.describe()
    envs = {r: read_json(worker_file(tmp_path, r, 0, "json")) for r in range(3)}
    # node_rank 0 (two workers) owns ranks 0,1; node_rank 1 owns rank 2.
    assert envs[0]["GROUP_RANK"] == "0" and envs[1]["GROUP_RANK"] == "0" and envs[2]["GROUP_RANK"] == "1"
    assert envs[2]["LOCAL_RANK"] == "0" and envs[2]["LOCAL_WORLD_SIZE"] == "1"
    assert envs[1]["LOCAL_RANK"] == "1" and envs[1]["LOCAL_WORLD_SIZE"] == "2"
    for e in envs.values():
        assert e["WORLD_SIZE"] == "3" and e["GROUP_WORLD_SIZE"] == "2"
        assert e["MASTER_PORT"] == envs[0]["MASTER_PORT"] and e["MASTER_ADDR"] == "127.0.0.1"
        assert int(e["MASTER_PORT"]) != port
        assert e["MESHRUN_STORE"] == "127.0.0.1:%d" % port
    # output of the node with 2 workers is prefixed by global rank
    assert "[rank" not in a.out


def start_two(launch, tmp_path, port, nnodes, extra_worker=()):
    """Node A first (it hosts the store), then node B; both running their workers."""
    prog = worker_cmd(tmp_path, "--hang-until=%s" % (tmp_path / "go"), *extra_worker)
    a = node(launch, port, nnodes, 1, prog, ["--max_restarts=0"])
    wait_for(endpoint_up(port), 20, "node A to serve the store")
    b = node(launch, port, nnodes, 1, prog, ["--max_restarts=0"])
    wait_for(lambda: all(os.path.exists(worker_file(tmp_path, r, 0, "json")) for r in range(2)), 30,
             "both ranks of attempt 0")
    return a, b


def node_of_rank(tmp_path, r):
    return read_json(worker_file(tmp_path, r, 0, "json"))["_pid"]


def test_whole_node_dies_elastic_survivor_restarts_alone(launch, tmp_path):
    port = free_port()
    a, b = start_two(launch, tmp_path, port, "1:2")
    worker_pids = [node_of_rank(tmp_path, r) for r in range(2)]
    b.proc.send_signal(signal.SIGKILL)  # B's meshrun; its worker dies with it (PDEATHSIG)
    b.wait(10)
    # A notices B's silence within heartbeat_timeout, restarts alone as a world of 1.
    f = wait_for(lambda: os.path.exists(worker_file(tmp_path, 0, 1, "json")) and worker_file(tmp_path, 0, 1, "json"),
                 20, "the survivor's attempt 1")
    e = read_json(f)
    assert e["WORLD_SIZE"] == "1" and e["GROUP_WORLD_SIZE"] == "1", e
    # A dead node is a new round, not a failure restart (torchrun's meaning of the count).
    assert e["TORCHELASTIC_RESTART_COUNT"] == "0" and e["MESHRUN_ROUND"] == "1", e
    (tmp_path / "go").write_text("")
    assert a.wait(30) == 0, a.describe()
    assert "heartbeat" in a.err, a.describe()
    assert pids_alive(worker_pids) == []


def test_whole_node_dies_fixed_size_exits_with_error(launch, tmp_path):
    port = free_port()
    a, b = start_two(launch, tmp_path, port, "2")
    b.proc.send_signal(signal.SIGKILL)
    b.wait(10)
    rc = a.wait(30)
    assert rc != 0, a.describe()
    assert "no heartbeat" in a.err and "min 2" in a.err, a.describe()


def test_store_host_dies_client_reports_store_lost(launch, tmp_path):
    port = free_port()
    a, b = start_two(launch, tmp_path, port, "2")
    a.proc.send_signal(signal.SIGKILL)
    a.wait(10)
    rc = b.wait(30)
    assert rc == 69, b.describe()  # the store-lost status (test_launcher_failures has the timing)
    assert "rendezvous store at 127.0.0.1:%d lost" % port in b.err, b.describe()


def test_late_joiner_scales_the_job_up(launch, tmp_path):
    port = free_port()
    prog = worker_cmd(tmp_path, "--hang-until=%s" % (tmp_path / "go"))
    a = node(launch, port, "1:2", 1, prog)
    f = wait_for(lambda: os.path.exists(worker_file(tmp_path, 0, 0, "json")) and worker_file(tmp_path, 0, 0, "json"),
                 20, "node A's round of one")
    assert read_json(f)["WORLD_SIZE"] == "1"
    b = node(launch, port, "1:2", 1, prog)
    wait_for(lambda: all(os.path.exists(worker_file(tmp_path, r, 1, "json")) for r in range(2)), 20,
             "the bigger round (attempt 1, two ranks)")
    for r in range(2):
        e = read_json(worker_file(tmp_path, r, 1, "json"))
        assert e["WORLD_SIZE"] == "2" and e["GROUP_WORLD_SIZE"] == "2"
        # A scale-up is a new round, not a failure restart.
        assert e["TORCHELASTIC_RESTART_COUNT"] == "0" and e["MESHRUN_ROUND"] == "1", e
    (tmp_path / "go").write_text("")
    assert a.wait(30) == 0, a.describe()
    assert b.wait(30) == 0, b.describe()


def test_scale_up_then_failure_counts_only_the_failure(launch, tmp_path):
    """Round 0: A alone. Round 1: B joined (scale-up, count 0); rank 1 (on B) fails while the
    count is 0. Round 2: the failure restart, count 1 on both nodes; with --max_restarts=1 the
    job succeeds, so the scale-up spent no budget."""
    port = free_port()
    prog = worker_cmd(tmp_path, "--fail-rank=1", "--fail-attempts=1", "--code=6",
                      "--hang-until=%s" % (tmp_path / "go"))
    a = node(launch, port, "1:2", 1, prog, ["--max_restarts=1"])
    wait_for(lambda: os.path.exists(worker_file(tmp_path, 0, 0, "json")), 20, "node A's round of one")
    b = node(launch, port, "1:2", 1, prog, ["--max_restarts=1"])
    wait_for(lambda: all(os.path.exists(worker_file(tmp_path, r, 2, "json")) for r in range(2)), 30,
             "round 2 (after the scale-up and the failure), two ranks")
    assert os.path.exists(worker_file(tmp_path, 1, 1, "exit"))
    assert read_json(worker_file(tmp_path, 1, 1, "json"))["TORCHELASTIC_RESTART_COUNT"] == "0"
    for r in range(2):
        e = read_json(worker_file(tmp_path, r, 2, "json"))
        assert e["TORCHELASTIC_RESTART_COUNT"] == "1" and e["MESHRUN_ROUND"] == "2", e
        assert e["WORLD_SIZE"] == "2", e
    (tmp_path / "go").write_text("")
    assert a.wait(30) == 0, a.describe()
    assert b.wait(30) == 0, b.describe()
    for r in range(2):
        assert os.path.exists(worker_file(tmp_path, r, 2, "done"))
        assert not os.path.exists(worker_file(tmp_path, r, 3, "json"))


def test_garbage_to_store_port_does_not_disturb(launch, tmp_path):
    port = free_port()
    prog = worker_cmd(tmp_path, "--hang-until=%s" % (tmp_path / "go"))
    a = node(launch, port, "1", 2, prog)
    wait_for(lambda: all(os.path.exists(worker_file(tmp_path, r, 0, "json")) for r in range(2)), 20,
             "workers to start")
    for payload in (b"GET / HTTP/1.0\r\n\r\n", os.urandom(4096), b"\xff" * 16, b""):
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(payload)
            s.shutdown(socket.SHUT_WR)
            s.settimeout(5)
            try:
                while s.recv(4096):
                    pass  # the server must close on us, not hang
            except ConnectionResetError:
                pass
    (tmp_path / "go").write_text("")
    assert a.wait(30) == 0, a.describe()
    assert not os.path.exists(worker_file(tmp_path, 0, 1, "json"))  # no restart happened


class ForeignServer:
    """A program that is not a meshrun store: answers HTTP garbage, or nothing at all."""

    def __init__(self, silent):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.silent = silent
        self.conns = []
        self.t = threading.Thread(target=self.serve, daemon=True)
        self.t.start()

    def serve(self):
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(c)
            if not self.silent:
                try:
                    c.sendall(b"HTTP/1.0 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
                    c.close()
                except OSError:
                    pass

    def close(self):
        self.sock.close()
        for c in self.conns:
            c.close()


def test_endpoint_taken_by_another_program(launch, tmp_path):
    srv = ForeignServer(silent=False)
    try:
        m = node(launch, srv.port, "1", 1, ["true"])
        rc = m.wait(30)
        assert rc != 0, m.describe()
        assert ("--rdzv_endpoint 127.0.0.1:%d: port is in use by another program (not a meshrun store)" % srv.port
                in m.err), m.describe()
    finally:
        srv.close()


def test_endpoint_that_never_answers_ends_after_join_timeout(launch, tmp_path):
    srv = ForeignServer(silent=True)
    try:
        m = launch(["--nnodes=1", "--nproc_per_node=1", "--rdzv_endpoint=127.0.0.1:%d" % srv.port,
                    "--rdzv_conf=join_timeout=1.5,heartbeat_interval=0.1,heartbeat_timeout=1", "true"])
        rc = m.wait(30)
        assert rc != 0, m.describe()
        assert "127.0.0.1:%d" % srv.port in m.err and "answer" in m.err, m.describe()
    finally:
        srv.close()


def check_met(tmp_path, world):
    """Every rank reached the store and rank 0's MASTER_ADDR:MASTER_PORT (worker.py --meet)."""
    for r in range(world):
        m = read_json(worker_file(tmp_path, r, 0, "meet"))
        assert m["store"] is True
    assert read_json(worker_file(tmp_path, 0, 0, "meet"))["peers"] == list(range(1, world))


def test_rendezvous_over_ipv6(launch, tmp_path):
    port = free_port6()
    if port is None:
        pytest.skip("::1 cannot be bound on this machine")
    prog = worker_cmd(tmp_path, "--meet")
    a = node(launch, port, "2", 1, prog, ["--node_rank=0"], host="[::1]")
    b = node(launch, port, "2", 1, prog, ["--node_rank=1"], host="[::1]")
    assert a.wait(30) == 0, a.describe()
    assert b.wait(30) == 0, b.describe()
    envs = [read_json(worker_file(tmp_path, r, 0, "json")) for r in range(2)]
    for e in envs:
        assert e["WORLD_SIZE"] == "2" and e["GROUP_WORLD_SIZE"] == "2"
        # torch wants MASTER_ADDR bare (no brackets); MESHRUN_STORE is host:port, bracketed for v6.
        assert e["MASTER_ADDR"] == "::1", e["MASTER_ADDR"]
        assert e["MESHRUN_STORE"] == "[::1]:%d" % port, e["MESHRUN_STORE"]
        assert e["MASTER_PORT"] == envs[0]["MASTER_PORT"]
    check_met(tmp_path, 2)


def test_rendezvous_over_hostname(launch, tmp_path):
    port = free_port()
    go = tmp_path / "go"
    prog = worker_cmd(tmp_path, "--meet", "--hang-until=%s" % go)
    a = node(launch, port, "2", 1, prog, ["--node_rank=0"], host="localhost")
    b = node(launch, port, "2", 1, prog, ["--node_rank=1"], host="localhost")
    wait_for(lambda: all(os.path.exists(worker_file(tmp_path, r, 0, "meet")) for r in range(2)), 30,
             "both ranks to meet")
    # Whichever address of "localhost" a client tries first, the store answers there.
    addrs = {ai[4][0] for ai in socket.getaddrinfo("localhost", port, 0, socket.SOCK_STREAM)}
    for ip in addrs:
        assert endpoint_up(port, ip)(), "store not reachable on %s (localhost resolves to %s)" % (ip, addrs)
    go.write_text("")
    assert a.wait(30) == 0, a.describe()
    assert b.wait(30) == 0, b.describe()
    for r in range(2):
        e = read_json(worker_file(tmp_path, r, 0, "json"))
        assert e["WORLD_SIZE"] == "2" and e["MESHRUN_STORE"] == "localhost:%d" % port, e
    check_met(tmp_path, 2)


def start_two_by_two(launch, tmp_path, port, prog, max_restarts):
    """Node A (node rank 0: ranks 0,1) serves the store; node B (node rank 1: ranks 2,3) joins."""
    extra = ["--max_restarts=%d" % max_restarts]
    a = node(launch, port, "2", 2, prog, ["--node_rank=0"] + extra)
    wait_for(endpoint_up(port), 20, "node A to serve the store")
    b = node(launch, port, "2", 2, prog, ["--node_rank=1"] + extra)
    return a, b


def test_worker_failure_on_one_node_restarts_every_node(launch, tmp_path):
    port = free_port()
    go = tmp_path / "go"
    prog = worker_cmd(tmp_path, "--fail-rank=3", "--fail-attempts=1", "--code=5", "--hang-until=%s" % go)
    a, b = start_two_by_two(launch, tmp_path, port, prog, 1)
    wait_for(lambda: all(os.path.exists(worker_file(tmp_path, r, 1, "json")) for r in range(4)), 30,
             "all four ranks of attempt 1")
    # Attempt 0 is over on both nodes before attempt 1 starts: nothing of it still runs.
    first = [read_json(worker_file(tmp_path, r, 0, "json"))["_pid"] for r in range(4)
             if os.path.exists(worker_file(tmp_path, r, 0, "json"))]
    assert pids_alive(first) == [], first
    go.write_text("")
    assert a.wait(30) == 0, a.describe()
    assert b.wait(30) == 0, b.describe()
    assert os.path.exists(worker_file(tmp_path, 3, 0, "exit"))
    for r in range(4):
        e = read_json(worker_file(tmp_path, r, 1, "json"))
        assert e["TORCHELASTIC_RESTART_COUNT"] == "1" and e["MESHRUN_ROUND"] == "1" and e["WORLD_SIZE"] == "4", e
        assert os.path.exists(worker_file(tmp_path, r, 1, "done"))
        assert not os.path.exists(worker_file(tmp_path, r, 0, "done"))  # stopped, not finished
        assert not os.path.exists(worker_file(tmp_path, r, 2, "json"))


def test_restart_budget_is_global_to_the_job(launch, tmp_path):
    port = free_port()
    prog = worker_cmd(tmp_path, "--fail-rank=3", "--code=9", "--errfile=rank three broke",
                      "--hang-until=%s" % (tmp_path / "never"))
    a, b = start_two_by_two(launch, tmp_path, port, prog, 2)
    assert a.wait(60) == 9, a.describe()
    assert b.wait(60) == 9, b.describe()
    # 2 restarts job-wide: attempts 0, 1, 2 and no attempt 3 on either node.
    exits = sorted(glob.glob(os.path.join(str(tmp_path), "rank3.attempt*.exit")))
    assert [os.path.basename(f) for f in exits] == ["rank3.attempt%d.exit" % i for i in range(3)], exits
    assert glob.glob(os.path.join(str(tmp_path), "rank*.attempt3.*")) == []
    # Only failures here, so each round's restart count is its number, the same on both nodes.
    for rnd in range(3):
        e = read_json(worker_file(tmp_path, 3, rnd, "json"))
        assert e["TORCHELASTIC_RESTART_COUNT"] == str(rnd) and e["MESHRUN_ROUND"] == str(rnd), e
    # Node A took part in all three (its other ranks may be stopped before they write a file:
    # rank 3 fails fast, so A's own log says which rounds it ran).
    assert [int(x) for x in re.findall(r"round (\d+): node 0 of 2", a.err)] == [0, 1, 2], a.describe()
    # Node A reports the remote root cause: rank 3 on B (its pid proves which process).
    pid = read_json(worker_file(tmp_path, 3, 2, "json"))["_pid"]
    assert "root cause" in a.err and "rank three broke" in a.err, a.describe()
    assert re.search(r"rank:\s+3 \(local_rank 1\)", a.err), a.describe()
    assert re.search(r"host:\s+%s\b" % re.escape(socket.gethostname()), a.err), a.describe()
    assert re.search(r"exitcode:\s+9\b", a.err), a.describe()
    assert "rank 3 (pid %d)" % pid in a.err, a.describe()


def test_endpoint_port_busy_without_listener_is_retried(launch, tmp_path):
    # The endpoint port is bound by a socket that does not listen (as when it is some outgoing
    # connection's source port): binding fails, nobody answers. meshrun must keep trying to host
    # the store instead of waiting as a client of nobody until join_timeout.
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    port = holder.getsockname()[1]
    m = launch(["--nnodes=1", "--nproc_per_node=1", "--rdzv_endpoint=127.0.0.1:%d" % port,
                "--rdzv_conf=" + FAST_CONF, "true"], env={"MESHRUN_LOG_LEVEL": "debug"})
    deadline = time.monotonic() + 20
    seen = b""
    while b"retrying the bind" not in seen:
        left = deadline - time.monotonic()
        assert left > 0, "meshrun never said it retries the bind:\n" + seen.decode(errors="replace")
        r, _, _ = select.select([m.proc.stderr], [], [], left)
        if r:
            chunk = os.read(m.proc.stderr.fileno(), 4096)
            assert chunk, "meshrun closed stderr first:\n" + seen.decode(errors="replace")
            seen += chunk
    holder.close()  # the port is free now: meshrun must bind it and run the job
    assert m.wait(30) == 0, seen.decode(errors="replace") + m.describe()
