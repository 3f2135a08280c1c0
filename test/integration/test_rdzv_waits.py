"""No silent waits, and run ids that cannot name other paths or keys (issue 37, items 7 and 8).

1. test_store_endpoint_that_does_not_answer: the c10d endpoint (--rdzv_endpoint) or the static
   one (--master_addr/--master_port) is held by a program that is not a meshrun store: a socket
   that listens and never accepts, one that accepts and never replies, one that replies HTTP.
   meshrun exits 1 within the probe (1 s) + handshake_timeout + a margin, not after join_timeout,
   with one line that names the endpoint, what answered and the flags the user gave.
2. test_etcd_endpoint_that_does_not_answer: --rdzv_backend=etcd at a port nothing listens on, and
   at an HTTP server that is not etcd: exit 1 within handshake_timeout + a margin, one line.
3. test_progress_while_peers_do_not_come: a 2-node rendezvous whose second node never comes
   prints a progress line every progress_interval (joined, min, max, time left) until
   join_timeout ends it; test_progress_while_the_store_is_not_up: the same while the store's
   address (TEST-NET-1, never routed) does not answer.
4. test_bad_run_id / test_good_run_id: run ids outside [A-Za-z0-9._-] (or starting with '.', empty,
   over 64 bytes), from the command line or PET_RDZV_ID, exit 2 with one line naming the flag and
   the allowed characters, before any directory is made; a good one (64 bytes, every kind of
   character) runs, and --help states the set.

Times are printed; each bound is stated next to its assertion."""
import http.server
import os
import re
import socket
import threading
import time

import pytest

from conftest import free_port, read_json, worker_cmd, worker_file
from test_launcher_multinode import ForeignServer

HANDSHAKE = 0.5  # handshake_timeout given to meshrun, seconds
PROBE = 1.0      # agent.c's probe of the endpoint: its handshake waits at least a second
MARGIN = 4.0     # process start and exit on a loaded two-core machine
JOIN = 60        # join_timeout: a wait that reaches it is the bug
SECRET = {"MESHRUN_RDZV_TOKEN": "waits-test-secret-0123456789"}  # no "open store" warning line
ALLOWED = "A-Z a-z 0-9 . _ -"


class Unaccepted:
    """A socket that listens and never accepts: the kernel completes the connections (backlog 1
    holds two), nobody reads them."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(1)
        self.port = self.sock.getsockname()[1]

    def close(self):
        self.sock.close()


class NotEtcd:
    """An HTTP server that is not etcd (Python's, as `python3 -m http.server`): POST gets 501."""

    def __init__(self):
        class Quiet(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass
        self.srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
        self.port = self.srv.server_address[1]
        self.t = threading.Thread(target=self.srv.serve_forever, daemon=True)
        self.t.start()

    def close(self):
        self.srv.shutdown()
        self.srv.server_close()


SERVERS = {
    "listens_never_accepts": (Unaccepted, "no answer"),
    "accepts_never_replies": (lambda: ForeignServer(silent=True), "no answer"),
    "replies_http": (lambda: ForeignServer(silent=False), "not a meshrun store"),
}


def timed_exit(m, bound):
    t0 = time.monotonic()
    rc = m.wait(bound)
    return rc, time.monotonic() - t0


def lines_naming(err, what):
    return [l for l in err.splitlines() if what in l]


# c10d's HTTP case is test_launcher_multinode.py's test_endpoint_taken_by_another_program
CASES = [(s, m) for s in sorted(SERVERS) for m in ("c10d", "static") if (s, m) != ("replies_http", "c10d")]


@pytest.mark.parametrize("server,mode", CASES)
def test_store_endpoint_that_does_not_answer(launch, tmp_path, mode, server):
    make, answered = SERVERS[server]
    srv = make()
    try:
        conf = "--rdzv_conf=handshake_timeout=%g,join_timeout=%d" % (HANDSHAKE, JOIN)
        if mode == "c10d":
            flags = ["--nnodes=2", "--rdzv_endpoint=127.0.0.1:%d" % srv.port]
        else:
            flags = ["--rdzv_backend=static", "--nnodes=2", "--node_rank=1", "--master_addr=127.0.0.1",
                     "--master_port=%d" % srv.port]
        m = launch(flags + [conf, "--nproc_per_node=1"] + worker_cmd(tmp_path), env=SECRET)
        bound = PROBE + HANDSHAKE + MARGIN
        rc, took = timed_exit(m, bound)
        ep = "127.0.0.1:%d" % srv.port
        lines = lines_naming(m.err, ep)
        print("%s, %s: exit %d after %.2f s (bound %.1f s): %s" % (mode, server, rc, took, bound, lines))
        assert rc == 1, m.describe()
        assert len(lines) == 1, m.describe()
        assert answered in lines[0] and "not a meshrun store" in lines[0], lines[0]
        if mode == "c10d":
            assert "--rdzv_endpoint" in lines[0], lines[0]
        else:
            assert "--master_addr" in lines[0] and "--master_port" in lines[0], lines[0]
            assert "--rdzv_endpoint" not in m.err, m.describe()
    finally:
        srv.close()


def closed_port():
    """A port nothing listens on: bound, read, closed."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("server", ["nothing", "not_etcd"])
def test_etcd_endpoint_that_does_not_answer(launch, tmp_path, server):
    srv = NotEtcd() if server == "not_etcd" else None
    port = srv.port if srv else closed_port()
    try:
        m = launch(["--rdzv_backend=etcd", "--rdzv_endpoint=127.0.0.1:%d" % port, "--nnodes=2",
                    "--rdzv_conf=handshake_timeout=%g,join_timeout=%d" % (HANDSHAKE, JOIN)] + worker_cmd(tmp_path),
                   env=SECRET)
        bound = HANDSHAKE + MARGIN
        rc, took = timed_exit(m, bound)
        lines = lines_naming(m.err, "127.0.0.1:%d" % port)
        print("etcd, %s: exit %d after %.2f s (bound %.1f s): %s" % (server, rc, took, bound, lines))
        assert rc == 1, m.describe()
        assert len(lines) == 1 and "--rdzv_endpoint" in lines[0], m.describe()
        if srv:
            assert "not etcd" in lines[0], lines[0]
        else:
            assert "no answer" in lines[0] and "refused" in lines[0].lower(), lines[0]
    finally:
        if srv:
            srv.close()


PROGRESS = re.compile(r"rendezvous: (\d+) of min (\d+) / max (\d+) nodes joined, ([\d.]+) s left \(join_timeout\)")


def test_progress_while_peers_do_not_come(launch, tmp_path):
    join, every = 3.0, 0.5
    m = launch(["--nnodes=2", "--rdzv_endpoint=127.0.0.1:%d" % free_port(), "--nproc_per_node=1",
                "--rdzv_conf=join_timeout=%g,progress_interval=%g" % (join, every)] + worker_cmd(tmp_path),
               env=SECRET)
    rc, took = timed_exit(m, join + MARGIN)
    found = [PROGRESS.search(l) for l in m.err.splitlines()]
    found = [f for f in found if f]
    print("exit %d after %.2f s, %d progress lines:\n%s" % (rc, took, len(found), "\n".join(f.group(0) for f in found)))
    assert rc == 1, m.describe()
    # join / every = 6 intervals; at least 2 lines leave room for a slow start
    assert len(found) >= 2, m.describe()
    assert all(f.group(1, 2, 3) == ("1", "2", "2") for f in found), m.describe()
    left = [float(f.group(4)) for f in found]
    assert all(0 <= x < join for x in left) and left == sorted(left, reverse=True), left
    assert "did not close within join_timeout" in m.err, m.describe()


def test_progress_while_the_store_is_not_up(launch, tmp_path):
    # 192.0.2.1 (TEST-NET-1) is never routed: node 1's store connection is refused, unreachable
    # or unanswered, which all mean "node 0 is not up yet": it waits, and says so.
    join, every = 3.0, 0.5
    m = launch(["--rdzv_backend=static", "--nnodes=2", "--node_rank=1", "--master_addr=192.0.2.1",
                "--master_port=%d" % free_port(), "--nproc_per_node=1",
                "--rdzv_conf=join_timeout=%g,progress_interval=%g" % (join, every)] + worker_cmd(tmp_path),
               env=SECRET)
    rc, took = timed_exit(m, join + MARGIN)
    found = [l for l in m.err.splitlines() if "waiting for the store at 192.0.2.1:" in l]
    print("exit %d after %.2f s, %d progress lines:\n%s" % (rc, took, len(found), "\n".join(found)))
    assert rc == 1, m.describe()
    assert len(found) >= 2, m.describe()
    assert all("--master_addr/--master_port" in l and "s left (join_timeout)" in l for l in found), found


BAD_IDS = ["../x", "a/b", ".hidden", "", "x" * 65, "a b", "a:b"]


@pytest.mark.parametrize("run_id", BAD_IDS, ids=["dotdot", "slash", "dot", "empty", "long", "space", "colon"])
def test_bad_run_id(launch, tmp_path, run_id):
    # --log_dir one level down, so that "../x" would land in tmp_path itself
    (tmp_path / "a").mkdir()
    logs = tmp_path / "a" / "L"
    m = launch(["--rdzv_id=" + run_id, "--log_dir=%s" % logs, "--tee=3"] + worker_cmd(tmp_path))
    rc = m.wait(30)
    lines = m.err.splitlines()
    print("exit %d: %s" % (rc, lines))
    assert rc == 2, m.describe()
    assert len(lines) == 1 and "--rdzv_id" in lines[0] and ALLOWED in lines[0], m.describe()
    assert sorted(os.listdir(str(tmp_path))) == ["a"] and not logs.exists(), os.listdir(str(tmp_path))


def test_bad_run_id_from_the_environment(launch, tmp_path):
    m = launch(worker_cmd(tmp_path), env={"PET_RDZV_ID": "../x"})
    rc = m.wait(30)
    print("exit %d: %s" % (rc, m.err.strip()))
    assert rc == 2, m.describe()
    assert len(m.err.splitlines()) == 1 and "PET_RDZV_ID" in m.err and ALLOWED in m.err, m.describe()


def test_good_run_id(launch, tmp_path):
    h = launch(["--help"])
    assert h.wait(10) == 0 and ALLOWED in h.out, h.describe()
    run_id = "Job-1.a_B" + "x" * 55  # 64 bytes, every kind of character allowed
    logs = tmp_path / "logs"
    m = launch(["--rdzv_id=" + run_id, "--log_dir=%s" % logs, "--tee=3"] + worker_cmd(tmp_path))
    assert m.wait(30) == 0, m.describe()
    assert read_json(worker_file(tmp_path, 0, 0, "json"))["TORCHELASTIC_RUN_ID"] == run_id
    assert [d.startswith(run_id + "_") for d in os.listdir(str(logs))] == [True]
