"""test_isolation: jobs never mix, strangers stay out (meshrun's store: run ids, secret, limits).

Real meshrun processes on loopback, each test on its own free port. A test-side store client
(StoreClient below, the standard library only) speaks the wire protocol of common/store_proto.h,
version 2: HELLO naming a run id, then AUTH with the HMAC-SHA256 proof of the job secret.

(a) Two jobs on one port with the same secret (MESHRUN_RDZV_TOKEN), each bin/trainer on 2 ranks
    with its own seed: each job's losses equal, bit for bit (tolerance 0), the same job run
    alone; the job hosting the store ends first (its meshrun then serves the other job until it
    leaves) and the other job finishes normally.
(b) Two jobs with different secrets (given, or generated for single-node jobs): the second exits
    1 at once (bound: 10 s, against a join_timeout of 60 s) naming the first job's run id; the
    first finishes normally.
(c) A stranger without the secret (raw sockets) can neither set nor read a key of the job: every
    attempt is answered with an error and the connection closed; the job's key keeps its value
    and the job finishes normally.
(d) 1,100 idle TCP connections to the store of a 2-node job whose meshrun starts with a soft
    open-file limit of 1024 (a common default): the job runs on, a worker failure restarts
    (no "Too many open files"), the second node joins. meshrun's open fds are printed.
(e) 20 connections each announcing a 64 MiB frame and sending half of it: meshrun's peak RSS
    (VmHWM) grows by less than 32 MiB when they come from a stranger, by less than the store's
    in-flight budget (256 MiB) + 32 MiB when they hold the secret (640 MiB unbounded); the job
    still works. Before/after printed.
(f) A script whose "#!" interpreter is missing: exit 127 (a shell's "command not found").
(g) Connections that hold the secret, HELLO + AUTH then idle, against a store host whose
    meshrun runs under `ulimit -n 256`: 100 from one address get at most the limit per host
    (76 for this job), the rest refused naming it, and a client from another address still
    gets in; 100 more from each of four other addresses stop at the limit in all, with
    descriptors left for the host (at most 256 - 40 held); a worker failure then restarts
    (no "too many open files"), and once one address's connections go a client gets in again.
(h) Four clients holding the secret announce 64 MiB SETs (the whole 256 MiB in-flight budget)
    and send half: with frame_timeout=0.5 they are dropped, each told so, and another client's
    8 MiB SET is stored (bound: 20 s); meshrun logs the drop.
Also: workers get MESHRUN_RDZV_TOKEN (the given secret, or the generated one), the open-store
and token-file-mode warnings, and a worker's error file asking for no restart.
"""
import hashlib
import hmac
import json
import os
import resource
import select
import socket
import stat
import struct
import time

import pytest

from conftest import FAST_CONF, PYTHON, free_port, read_json, wait_for, worker_cmd
from test_checkpoint import PLAN, TRAINER, losses, write_plan

SECRET = "isolation-test-secret-0123456789"
OTHER_SECRET = "some-other-secret-abcdefghijklmn"

# ---- a store client (common/store_proto.h, version 2) ----

MAGIC, VERSION = 0x4D, 2
OP = {"HELLO": 1, "SET": 2, "GET": 3, "GET_NOWAIT": 4, "ADD": 5, "CAS": 6, "WAIT": 7, "CHECK": 8,
      "DELETE": 9, "MULTI_GET": 10, "MULTI_SET": 11, "NUM_KEYS": 12, "AUTH": 13}
REP = {0x80: "OK", 0x81: "HELLO", 0x82: "VALUE", 0x83: "VALUES", 0x84: "INT", 0x85: "TIMEOUT",
       0x86: "NOKEY", 0x87: "ERROR", 0x88: "AUTH"}
STORE_EAUTH = -9
STORE_ETIMEDOUT = -5


def b(x):
    x = x.encode() if isinstance(x, str) else x
    return struct.pack(">I", len(x)) + x


def frame(op, payload=b"", version=VERSION):
    return struct.pack(">IBBBB", 8 + len(payload), MAGIC, version, OP[op], 0) + payload


def proof(secret, side, cn, sn, run_id):
    return hmac.new(secret.encode(), b"meshrun-store/2 " + side.encode() + cn + sn + run_id.encode(),
                    hashlib.sha256).digest()


class Closed(Exception):
    pass


class StoreClient:
    """One connection. hello()/auth() for the handshake; call() sends a frame and reads the reply
    ("ERROR" replies come back as ("ERROR", code, message)); Closed when the server hung up."""

    def __init__(self, port, timeout=10, src=None):
        self.s = socket.create_connection(("127.0.0.1", port), timeout=timeout,
                                          source_address=(src, 0) if src else None)

    def close(self):
        self.s.close()

    def _read(self, n):
        out = b""
        while len(out) < n:
            try:
                k = self.s.recv(n - len(out))
            except ConnectionResetError:
                k = b""
            if not k:
                raise Closed()
            out += k
        return out

    def reply(self):
        length, magic, version, op, _ = struct.unpack(">IBBBB", self._read(8))
        assert magic == MAGIC and version == VERSION, (magic, version)
        body = self._read(length - 8)
        name = REP.get(op, hex(op))
        if name == "ERROR":
            code = struct.unpack(">q", body[:8])[0]
            (n,) = struct.unpack(">I", body[8:12])
            return ("ERROR", code, body[12:12 + n].decode(errors="replace"))
        return (name, body)

    def call(self, op, payload=b""):
        try:
            self.s.sendall(frame(op, payload))
        except (BrokenPipeError, ConnectionResetError):
            raise Closed()
        return self.reply()

    def hello(self, run_id):
        self.cn = os.urandom(32)
        self.run_id = run_id
        r = self.call("HELLO", b(b"meshrun-store") + b(run_id) + b(self.cn))
        if r[0] != "HELLO":
            return r
        body, fields, off = r[1], [], 0
        for kind in ("bytes", "bytes", "u8", "bytes"):
            if kind == "u8":
                fields.append(body[off])
                off += 1
            else:
                (n,) = struct.unpack(">I", body[off:off + 4])
                fields.append(body[off + 4:off + 4 + n])
                off += 4 + n
        self.owner, self.secret_required, self.sn = fields[1].decode(), fields[2], fields[3]
        return ("HELLO", self.owner, self.secret_required)

    def auth(self, secret):
        r = self.call("AUTH", b(proof(secret, "client", self.cn, self.sn, self.run_id)))
        if r[0] == "AUTH":
            (n,) = struct.unpack(">I", r[1][:4])
            assert r[1][4:4 + n] == proof(secret, "server", self.cn, self.sn, self.owner), "bad server proof"
        return r

    def set(self, key, value):
        return self.call("SET", b(key) + b(value))

    def get_nowait(self, key):
        return self.call("GET_NOWAIT", b(key))


def authed_client(port, run_id, secret):
    c = StoreClient(port)
    assert c.hello(run_id)[0] == "HELLO"
    r = c.auth(secret)
    assert r[0] == "AUTH", r
    return c


def port_up(port):
    def check():
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return True
        except OSError:
            return False
    return check


# ---- a worker driven by files in its directory ----

MINI_WORKER = r'''
import json, os, sys, time
d = sys.argv[1]
rank, rnd = int(os.environ["RANK"]), int(os.environ["MESHRUN_ROUND"])
tag = os.path.join(d, "rank%d.round%d" % (rank, rnd))
with open(tag + ".tmp", "w") as f:
    json.dump(dict(os.environ), f)
os.rename(tag + ".tmp", tag + ".json")
deadline = time.time() + 120
while time.time() < deadline:
    if rank == 0 and os.path.exists(os.path.join(d, "fail.%d" % rnd)):
        sys.exit(3)
    if os.path.exists(os.path.join(d, "release")):
        sys.exit(0)
    time.sleep(0.01)
sys.exit(4)
'''


def mini_worker(d):
    path = os.path.join(str(d), "mini_worker.py")
    with open(path, "w") as f:
        f.write(MINI_WORKER)
    return [PYTHON, path, str(d)]


def started(d, rank, rnd):
    return os.path.exists(os.path.join(str(d), "rank%d.round%d.json" % (rank, rnd)))


def release(d):
    open(os.path.join(str(d), "release"), "w").close()


def job(launch, port, run_id, prog, secret=SECRET, nnodes="1", nproc=1, conf=FAST_CONF, extra=(), **kw):
    env = kw.pop("env", {})
    env = dict(env)
    if secret is None:
        env["MESHRUN_RDZV_TOKEN"] = ""
    else:
        env["MESHRUN_RDZV_TOKEN"] = secret
    return launch(["--nnodes=%s" % nnodes, "--nproc_per_node=%d" % nproc, "--rdzv_endpoint=127.0.0.1:%d" % port,
                   "--rdzv_id=%s" % run_id, "--rdzv_conf=" + conf] + list(extra) + list(prog), env=env, **kw)


def proc_status(pid, field):
    with open("/proc/%d/status" % pid) as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])  # kB
    raise KeyError(field)


def nfds(pid):
    return len(os.listdir("/proc/%d/fd" % pid))


# ---- (a) two jobs, one port, one secret ----

def trainer_args(d, seed, steps):
    plan = dict(PLAN)
    plan["mesh"] = {"dp_replicate": 1, "dp_shard": 2, "tp": 1}
    plan["log"] = {"interval": 1}
    plan["eval"] = {"interval": 0}
    out = [TRAINER, write_plan(d, plan)]
    for kv in ["seed=%d" % seed, "train.steps=%d" % steps,
               "log.metrics_file=%s" % os.path.join(str(d), "metrics.jsonl")]:
        out += ["--set", kv]
    return out


A_STEPS, B_STEPS = 10, 160


def final_logged(d, steps):
    return lambda: losses(d).get((False, steps)) is not None if os.path.exists(os.path.join(str(d), "metrics.jsonl")) else False


def test_two_jobs_one_port_same_secret_do_not_mix(launch, tmp_path):
    env = {"OMP_NUM_THREADS": "1"}
    # Each job alone first, on ports of their own: the reference losses.
    solo = {}
    for name, seed, steps in (("A", 1, A_STEPS), ("B", 2, B_STEPS)):
        d = tmp_path / ("solo" + name)
        d.mkdir()
        m = job(launch, free_port(), "job" + name, trainer_args(d, seed, steps), nproc=2, env=env, cwd=str(d))
        assert m.wait(240) == 0, m.describe()
        solo[name] = losses(d)
        assert solo[name].get((False, steps)) is not None
    assert solo["A"][(False, 1)] != solo["B"][(False, 1)], "the two jobs must differ to show they do not mix"

    port = free_port()
    da, db = tmp_path / "A", tmp_path / "B"
    da.mkdir()
    db.mkdir()
    a = job(launch, port, "jobA", trainer_args(da, 1, A_STEPS), nproc=2, env=env, cwd=str(da))
    wait_for(port_up(port), 20, "job A's store on port %d" % port)
    b_ = job(launch, port, "jobB", trainer_args(db, 2, B_STEPS), nproc=2, env=env, cwd=str(db))
    wait_for(final_logged(da, A_STEPS), 240, "job A's last step")
    b_running_at_a_end = b_.proc.poll() is None
    rb = b_.wait(240)
    ra = a.wait(60)
    print("job A (hosts the store): rc %d; job B: rc %d; B still running when A logged its last step: %s"
          % (ra, rb, b_running_at_a_end))
    assert rb == 0, b_.describe()
    assert ra == 0, a.describe()
    assert b_running_at_a_end, "job B was not longer than job A: the test shows nothing"
    assert "job 'jobA' is done; the store stays up for" in a.err, a.err
    assert "lost" not in b_.err, b_.err
    for name, d in (("A", da), ("B", db)):
        got = losses(d)
        diff = max(abs(got[k] - solo[name][k]) for k in solo[name])
        print("job %s: %d losses vs the job alone: max abs diff %.3g (tolerance 0)" % (name, len(solo[name]), diff))
        assert got == solo[name]


# ---- (b) different secrets ----

# (job A's secret, job B's secret, job B's --nnodes): None = not given (a single-node job makes
# one up; B on 1:2 nodes then has none at all).
SECRET_CASES = {"given": (SECRET, OTHER_SECRET, "1"), "generated": (None, None, "1"),
                "none_vs_given": (SECRET, None, "1:2")}


@pytest.mark.parametrize("secrets", sorted(SECRET_CASES))
def test_second_job_with_another_secret_stops_at_once(launch, tmp_path, secrets):
    sa, sb, nb = SECRET_CASES[secrets]
    port = free_port()
    da, db = tmp_path / "A", tmp_path / "B"
    da.mkdir()
    db.mkdir()
    a = job(launch, port, "jobA", mini_worker(da), secret=sa)
    wait_for(lambda: started(da, 0, 0), 20, "job A's worker")
    t0 = time.monotonic()
    b_ = job(launch, port, "jobB", mini_worker(db), secret=sb, nnodes=nb, conf="join_timeout=60")
    rb = b_.wait(30)
    took = time.monotonic() - t0
    line = [l for l in b_.err.splitlines() if "jobA" in l]
    print("%s: job B exit %d after %.2fs (bound 10s, join_timeout 60s): %s" % (secrets, rb, took, line))
    assert rb == 1, b_.describe()
    assert took < 10
    assert line, b_.describe()
    assert not started(db, 0, 0)
    release(da)
    assert a.wait(30) == 0, a.describe()


# ---- (c) a stranger ----

def test_stranger_cannot_set_or_read_keys(launch, tmp_path):
    port = free_port()
    d = tmp_path
    m = job(launch, port, "jobA", mini_worker(d))
    wait_for(lambda: started(d, 0, 0), 20, "the worker")
    me = authed_client(port, "jobA", SECRET)
    assert me.set("isolation/probe", "mine")[0] == "OK"

    outcomes = []
    # 1. HELLO naming the job, then SET and GET without AUTH.
    for op, payload in (("SET", b("isolation/probe") + b("stranger")), ("GET_NOWAIT", b("isolation/probe"))):
        c = StoreClient(port)
        h = c.hello("jobA")
        assert h == ("HELLO", "jobA", 1), h
        try:
            r = c.call(op, payload)
            assert r[0] == "ERROR", r
            outcomes.append("%s before AUTH: %s" % (op, r))
            with pytest.raises(Closed):
                c.call("GET_NOWAIT", b("isolation/probe"))
        except Closed:
            outcomes.append("%s before AUTH: closed" % op)
        c.close()
    # 2. A wrong proof.
    c = StoreClient(port)
    c.hello("jobA")
    r = c.auth(OTHER_SECRET)
    assert r[0] == "ERROR" and r[1] == STORE_EAUTH and "jobA" in r[2], r
    outcomes.append("AUTH with a wrong secret: %s" % (r,))
    with pytest.raises(Closed):
        c.set("isolation/probe", "stranger")
    c.close()
    # 3. No HELLO at all, and the old protocol (version 1).
    for version in (VERSION, 1):
        c = StoreClient(port)
        try:
            c.s.sendall(frame("SET", b("isolation/probe") + b("stranger"), version=version))
            r = c.reply()
            assert r[0] == "ERROR", r
            outcomes.append("SET without HELLO (v%d): %s" % (version, r))
            with pytest.raises(Closed):
                c.get_nowait("isolation/probe")
        except (Closed, AssertionError) as e:
            if isinstance(e, AssertionError) and version == VERSION:
                raise
            outcomes.append("SET without HELLO (v%d): closed" % version)
        c.close()
    print("\n".join(outcomes))
    assert me.get_nowait("isolation/probe") == ("VALUE", b("mine"))
    me.close()
    release(d)
    assert m.wait(30) == 0, m.describe()


# ---- (d) a flood of idle connections ----

def nofile_1024():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(1024, hard), hard))


def test_idle_connection_flood(launch, tmp_path):
    n_idle = 1100
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < n_idle + 200:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4096), hard))
        except (ValueError, OSError):
            pass
        if resource.getrlimit(resource.RLIMIT_NOFILE)[0] < n_idle + 200:
            pytest.skip("cannot open %d sockets here (RLIMIT_NOFILE %d)" % (n_idle, soft))
    port = free_port()
    d = tmp_path
    conf = FAST_CONF.replace("join_timeout=20", "join_timeout=60")
    n1 = job(launch, port, "jobF", mini_worker(d), nnodes="1:2", conf=conf, extra=["--max_restarts=3"],
             preexec_fn=nofile_1024)
    wait_for(lambda: started(d, 0, 0), 20, "node 1's worker")
    fds_before = nfds(n1.pid)
    idle = []
    refused = 0
    for _ in range(n_idle):
        try:
            idle.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        except OSError:
            refused += 1
    # Let the loop see them: a store round trip by an authenticated client comes after them.
    me = authed_client(port, "jobF", SECRET)
    me.close()
    fds_flood = nfds(n1.pid)
    # A worker failure: the round restarts (fork, pipes, a new store connection per node).
    open(os.path.join(str(d), "fail.0"), "w").close()
    wait_for(lambda: started(d, 0, 1), 30, "the restarted worker (round 1)")
    # A second node joins: the job scales up to 2 nodes.
    n2 = job(launch, port, "jobF", mini_worker(d), nnodes="1:2", conf=conf, extra=["--max_restarts=3"],
             preexec_fn=nofile_1024)
    wait_for(lambda: started(d, 0, 2) and started(d, 1, 2), 30, "both nodes in round 2")
    world = read_json(os.path.join(str(d), "rank1.round2.json"))["WORLD_SIZE"]
    fds_after = nfds(n1.pid)
    state = {"idle": 0, "refused with an error": 0, "closed": 0}
    for s in idle:
        try:
            state["refused with an error" if s.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) else "closed"] += 1
        except BlockingIOError:
            state["idle"] += 1
        except OSError:
            state["closed"] += 1
    release(d)
    r1, r2 = n1.wait(60), n2.wait(60)
    for s in idle:
        s.close()
    print("%d idle connections (%d refused by the kernel): meshrun fds %d before, %d with the flood, %d after the "
          "restart and the join; the flood's connections then: %s; node exits %d, %d; world after the join %s"
          % (n_idle, refused, fds_before, fds_flood, fds_after, state, r1, r2, world))
    assert "Too many open files" not in n1.err + n2.err, n1.describe() + n2.describe()
    assert r1 == 0, n1.describe()
    assert r2 == 0, n2.describe()
    assert world == "2"


# ---- (e) frames announced and half sent ----

BIG = 64 << 20


def half_send_big_frames(port, n, authed):
    """n connections, each announcing a 64 MiB SET and sending half of it, all at once
    (non-blocking); stops when every one has sent its half, was closed, or made no progress for
    2 s. Returns (sockets, bytes sent, connections closed by the server)."""
    socks, left = [], {}
    for _ in range(n):
        if authed:
            c = authed_client(port, "jobR", SECRET)
            s = c.s
        else:
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
        key = b"k" * 16
        head = struct.pack(">IBBBB", BIG, MAGIC, VERSION, OP["SET"], 0) + b(key) + struct.pack(">I", BIG - 8 - 20 - 4)
        s.setblocking(False)
        socks.append(s)
        left[s] = [head, BIG // 2 - len(head)]
    chunk = b"\0" * (1 << 20)
    sent = closed = 0
    last_progress = time.monotonic()
    while left and time.monotonic() - last_progress < 2:
        _, w, _ = select.select([], list(left), [], 0.2)
        for s in w:
            head, rest = left[s]
            data = head if head else chunk[:min(len(chunk), rest)]
            try:
                k = s.send(data)
            except BlockingIOError:
                continue
            except OSError:
                closed += 1
                del left[s]
                continue
            sent += k
            last_progress = time.monotonic()
            if head:
                left[s][0] = head[k:]
            else:
                left[s][1] = rest - k
                if left[s][1] == 0:
                    del left[s]
    for s in socks:
        try:
            if s.recv(1, socket.MSG_PEEK) == b"":
                closed += 1
        except BlockingIOError:
            pass
        except OSError:
            closed += 1
    return socks, sent, closed


# Peak RSS growth allowed: a stranger never gets past the 4 KiB handshake frames; a client with
# the secret (a job's own program gone wrong) gets frames reserved whole against the store's
# in-flight budget (256 MiB by default), so at most that, where 20 x 32 MiB would be 640 MiB.
RSS_BOUND_MIB = {False: 32, True: 256 + 32}


@pytest.mark.parametrize("authed", [False, True], ids=["stranger", "with_secret"])
def test_half_sent_big_frames_do_not_grow_memory(launch, tmp_path, authed):
    bound_kb = RSS_BOUND_MIB[authed] << 10
    port = free_port()
    d = tmp_path
    m = job(launch, port, "jobR", mini_worker(d), extra=["--max_restarts=1"])
    wait_for(lambda: started(d, 0, 0), 20, "the worker")
    rss0, hwm0 = proc_status(m.pid, "VmRSS"), proc_status(m.pid, "VmHWM")
    socks, sent, closed = half_send_big_frames(port, 20, authed)
    # The store has read what it was going to read once an authenticated round trip is answered.
    me = authed_client(port, "jobR", SECRET)
    assert me.set("after", "attack")[0] == "OK"
    assert me.get_nowait("after") == ("VALUE", b("attack"))
    me.close()
    rss1, hwm1 = proc_status(m.pid, "VmRSS"), proc_status(m.pid, "VmHWM")
    # The job still works: a failure restarts it, then it finishes.
    open(os.path.join(str(d), "fail.0"), "w").close()
    wait_for(lambda: started(d, 0, 1), 30, "the restarted worker")
    release(d)
    rc = m.wait(60)
    for s in socks:
        s.close()
    print("%s: 20 x 64 MiB frames, %.0f MiB sent, %d connections closed by the store; meshrun VmRSS %.1f -> %.1f MiB, "
          "peak (VmHWM) %.1f -> %.1f MiB: +%.1f MiB (bound %d MiB)"
          % ("with the secret" if authed else "stranger", sent / 2**20, closed, rss0 / 1024, rss1 / 1024,
             hwm0 / 1024, hwm1 / 1024, (hwm1 - hwm0) / 1024, bound_kb >> 10))
    assert hwm1 - hwm0 < bound_kb
    assert rc == 0, m.describe()


# ---- (g) connections that hold the secret ----

NOFILE_LOW = 256
# The store's room for a job of --nnodes=1:2 --nproc_per_node=1 (README, Limits): per host
# 2 nodes x 2 x (1 worker + 2) + 64 = 76 connections; in all 256 - (64 + 8 x 1) - 16 = 168.
PER_HOST = 76
# Descriptors the host must still have free with the store full: a restart takes about 5.
FDS_LEFT = 40


def nofile_low():
    resource.setrlimit(resource.RLIMIT_NOFILE, (NOFILE_LOW, NOFILE_LOW))


def open_authed(port, src, n, run_id):
    """n connections from source address src, each HELLO + AUTH, then left idle. Returns (the
    admitted clients, the replies of the refused ones, all clients). Refused connections are
    left open too, as a careless or hostile client leaves them."""
    kept, refused, every = [], [], []
    for _ in range(n):
        c = StoreClient(port, src=src)
        every.append(c)
        try:
            r = c.hello(run_id)
            if r[0] == "HELLO":
                r = c.auth(SECRET)
        except Closed:
            r = ("closed",)
        if r[0] == "AUTH":
            kept.append(c)
        else:
            refused.append(r)
    return kept, refused, every


def served(port):
    try:
        c = authed_client(port, "jobH", SECRET)
    except (AssertionError, Closed, OSError):
        return False
    ok = c.set("still", "served")[0] == "OK"
    c.close()
    return ok


def test_connections_with_the_secret_are_bounded(launch, tmp_path):
    n_each, hosts = 100, ["127.0.0.%d" % i for i in range(3, 7)]
    want = n_each * (len(hosts) + 1) + 100
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4096), hard))
        except (ValueError, OSError):
            pass
        if resource.getrlimit(resource.RLIMIT_NOFILE)[0] < want:
            pytest.skip("cannot open %d sockets here (RLIMIT_NOFILE %d)" % (want, soft))
    try:
        socket.socket().bind(("127.0.0.2", 0))
    except OSError:
        pytest.skip("cannot bind 127.0.0.2 here")
    port = free_port()
    d = tmp_path
    n1 = job(launch, port, "jobH", mini_worker(d), nnodes="1:2", extra=["--max_restarts=3"], preexec_fn=nofile_low)
    wait_for(lambda: started(d, 0, 0), 20, "node 1's worker")
    fds_before = nfds(n1.pid)
    # One host: past its limit it is refused, naming the limit; another address still gets in.
    kept1, refused1, every1 = open_authed(port, "127.0.0.2", n_each, "jobH")
    other_ok = served(port)
    # More hosts: the store stops at its limit in all, short of the file limit.
    floods = {h: open_authed(port, h, n_each, "jobH") for h in hosts}
    fds_flood = nfds(n1.pid)
    kept = len(kept1) + sum(len(k) for k, _, _ in floods.values())
    msgs = sorted(set(r[2] for _, rs, _ in floods.values() for r in rs if r[0] == "ERROR"))
    print("meshrun under ulimit -n %d: fds %d before; 127.0.0.2: %d of %d admitted (limit per host %d), refused: %s; "
          "%s: %s admitted; %d admitted in all; fds with the flood %d (at most %d)"
          % (NOFILE_LOW, fds_before, len(kept1), n_each, PER_HOST, refused1[:1], ", ".join(hosts),
             [len(k) for k, _, _ in floods.values()], kept, fds_flood, NOFILE_LOW - FDS_LEFT))
    print("refusals: %s" % msgs)
    assert fds_flood <= NOFILE_LOW - FDS_LEFT, "meshrun holds %d of %d descriptors" % (fds_flood, NOFILE_LOW)
    assert len(kept1) <= PER_HOST, "127.0.0.2 got %d connections past the limit per host" % len(kept1)
    assert refused1 and all(r[0] == "ERROR" and "limit per host" in r[2] for r in refused1), refused1[:3]
    assert other_ok, "a client from 127.0.0.1 was not served while 127.0.0.2 was at its limit"
    assert any("at its limit of" in m for m in msgs), msgs
    # A worker failure: the round restarts (fork, pipes, a listener for MASTER_PORT).
    open(os.path.join(str(d), "fail.0"), "w").close()
    wait_for(lambda: started(d, 0, 1), 30, "the restarted worker (round 1)")
    fds_restart = nfds(n1.pid)
    # One address's connections go: there is room again.
    for c in every1:
        c.close()
    wait_for(lambda: served(port), 10, "a client admitted once 127.0.0.2's connections closed")
    release(d)
    rc = n1.wait(60)
    for c in [c for _, _, every in floods.values() for c in every]:
        c.close()
    print("fds after the restart %d; node exit %d" % (fds_restart, rc))
    assert "too many open files" not in n1.err.lower(), n1.describe()
    assert rc == 0, n1.describe()


# ---- (h) big frames that stall ----

def test_stalled_big_frames_are_dropped(launch, tmp_path):
    port = free_port()
    d = tmp_path
    m = job(launch, port, "jobS", mini_worker(d), conf=FAST_CONF + ",frame_timeout=0.5", extra=["--max_restarts=1"])
    wait_for(lambda: started(d, 0, 0), 20, "the worker")
    stalled = []
    key = b"stalled"
    head = (struct.pack(">IBBBB", BIG, MAGIC, VERSION, OP["SET"], 0) + b(key)
            + struct.pack(">I", BIG - 8 - 4 - len(key) - 4))
    body = bytes(BIG // 2 - len(head))
    for _ in range(4):  # 4 x 64 MiB: the whole in-flight budget
        c = authed_client(port, "jobS", SECRET)
        c.s.sendall(head)
        c.s.sendall(body)
        stalled.append(c)
    t0 = time.monotonic()
    value = bytes(8 << 20)
    tries = []

    def big_set():
        c = authed_client(port, "jobS", SECRET)
        try:
            r = c.set("big", value)
        except Closed:
            r = ("closed",)
        c.close()
        tries.append(r[0] if r[0] != "ERROR" else r[2])
        return r[0] == "OK"

    wait_for(big_set, 20, "another client's 8 MiB SET once the stalled frames are dropped")
    took = time.monotonic() - t0
    told = []
    for c in stalled:
        try:
            told.append(c.reply())
        except Closed:
            told.append(("closed",))
        c.close()
    release(d)
    rc = m.wait(60)
    print("4 x 64 MiB frames half sent; an 8 MiB SET stored %.2fs later (frame_timeout 0.5s) after %d tries, the "
          "first: %s; the stalled clients were told: %s" % (took, len(tries), tries[0], told[0]))
    assert all(r[0] == "ERROR" and r[1] == STORE_ETIMEDOUT and "stalled" in r[2] for r in told), told
    assert "stalled" in m.err, m.describe()
    assert rc == 0, m.describe()


# ---- (f) a script whose interpreter is missing ----

def test_missing_interpreter_exits_127(launch, tmp_path):
    # --no_python: exec'd itself, so its #! line names the interpreter (without it, a .py
    # program runs under python3, as torchrun runs it)
    script = tmp_path / "script.py"
    script.write_text("#!/nonexistent/python\nprint('never')\n")
    script.chmod(0o755)
    m = launch(["--standalone", "--nproc_per_node=2", "--no_python", str(script)])
    rc = m.wait(30)
    line = [l for l in m.err.splitlines() if "interpreter" in l]
    print("exit %d: %s" % (rc, line))
    assert rc == 127, m.describe()
    assert line and "/nonexistent/python" in line[0], m.describe()


# ---- the secret reaches the workers; warnings ----

def test_workers_get_the_secret(launch, tmp_path):
    # Given: the same value. Generated (single node, none given): 64 hex digits, new per job.
    m = launch(["--standalone", "--nproc_per_node=2", "--rdzv_conf=" + FAST_CONF] + worker_cmd(tmp_path),
               env={"MESHRUN_RDZV_TOKEN": SECRET})
    assert m.wait(30) == 0, m.describe()
    for r in (0, 1):
        assert read_json(os.path.join(str(tmp_path), "rank%d.attempt0.json" % r))["MESHRUN_RDZV_TOKEN"] == SECRET
    seen = []
    for i in range(2):
        d = tmp_path / ("gen%d" % i)
        d.mkdir()
        m = launch(["--standalone", "--nproc_per_node=2", "--rdzv_conf=" + FAST_CONF] + worker_cmd(d),
                   env={"MESHRUN_RDZV_TOKEN": ""})
        assert m.wait(30) == 0, m.describe()
        toks = {read_json(os.path.join(str(d), "rank%d.attempt0.json" % r))["MESHRUN_RDZV_TOKEN"] for r in (0, 1)}
        assert len(toks) == 1
        tok = toks.pop()
        assert len(tok) == 64 and all(c in "0123456789abcdef" for c in tok), tok
        seen.append(tok)
        assert "warning" not in m.err, m.err
    assert seen[0] != seen[1]


def test_open_store_warns_once_per_node(launch, tmp_path):
    port = free_port()
    nodes = [job(launch, port, "jobW", worker_cmd(tmp_path), secret=None, nnodes="2") for _ in range(2)]
    for n in nodes:
        assert n.wait(30) == 0, n.describe()
        lines = [l for l in n.err.splitlines() if "warning" in l]
        print(lines)
        assert len(lines) == 1, n.describe()
        assert "127.0.0.1:%d is open" % port in lines[0] and "token_file" in lines[0]
    env = read_json(os.path.join(str(tmp_path), "rank0.attempt0.json"))
    assert "MESHRUN_RDZV_TOKEN" not in env


def test_token_file(launch, tmp_path):
    tok = tmp_path / "token"
    tok.write_text(SECRET + "\n")
    tok.chmod(0o644)
    port = free_port()
    conf = FAST_CONF + ",token_file=" + str(tok)
    # token_file wins over the environment: both nodes agree although their variables differ.
    nodes = [job(launch, port, "jobT", worker_cmd(tmp_path), secret=s, nnodes="2", conf=conf)
             for s in (OTHER_SECRET, None)]
    for n in nodes:
        assert n.wait(30) == 0, n.describe()
        lines = [l for l in n.err.splitlines() if "warning" in l]
        assert len(lines) == 1 and "group or others" in lines[0] and "0644" in lines[0], n.describe()
    for r in (0, 1):
        assert read_json(os.path.join(str(tmp_path), "rank%d.attempt0.json" % r))["MESHRUN_RDZV_TOKEN"] == SECRET
    tok.chmod(0o600)
    short = tmp_path / "short"
    short.write_text("tooshort\n")
    m = launch(["--standalone", "--rdzv_conf=token_file=" + str(short)] + worker_cmd(tmp_path))
    assert m.wait(10) == 2, m.describe()
    assert m.err.count("\n") == 1 and "token_file" in m.err and "8 bytes" in m.err, m.err


# ---- a worker that asks not to be restarted ----

NO_RESTART_WORKER = r'''
import json, os, sys
if os.environ["RANK"] == "1":
    with open(os.environ["TORCHELASTIC_ERROR_FILE"], "w") as f:
        json.dump({"message": {"message": "plan error: nothing to retry", "extraInfo": {"timestamp": "1"}},
                   "meshrun": {"restart": False}}, f)
    sys.exit(5)
'''


def test_worker_asking_for_no_restart_ends_the_job(launch, tmp_path):
    w = tmp_path / "w.py"
    w.write_text(NO_RESTART_WORKER)
    m = launch(["--standalone", "--nproc_per_node=2", "--max_restarts=3", "--rdzv_conf=" + FAST_CONF,
                PYTHON, str(w)])
    rc = m.wait(30)
    print("exit %d" % rc)
    assert rc == 5, m.describe()
    assert "re-rendezvous" not in m.err, m.describe()
    assert "no restart tried" in m.err and "plan error: nothing to retry" in m.err, m.describe()
