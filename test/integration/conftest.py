"""Shared fixtures for meshrun's integration tests: real meshrun processes on loopback.

- MESHRUN_BIN names the directory holding meshrun and trainer (the Makefile sets it).
- Meshrun() starts one meshrun process in its own session with captured output and a
  deadline; wait_for() polls a condition with a deadline (no fixed sleeps: every wait ends
  as soon as the observed event happens).
- free_port() asks the kernel for a port on 127.0.0.1 (nothing fixed); free_port6() on ::1,
  or None where this machine cannot bind ::1 (IPv6 tests skip then).
- pids_alive() scans /proc, for the "no orphan survives" checks; meshrun_guard() tells meshrun's
  guard process from its workers.
"""
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "worker.py")
PYTHON = "/usr/bin/python3"


@pytest.fixture(autouse=True, scope="session")
def _dump_dir(tmp_path_factory):
    """Flight-recorder dumps (a comm timeout writes one) go to a folder of this session that
    pytest removes with its other temporary folders, unless the test or its caller names one;
    under meshrun they go to the run's log folder anyway."""
    if "MESHRUN_DUMP_DIR" not in os.environ:
        os.environ["MESHRUN_DUMP_DIR"] = str(tmp_path_factory.mktemp("dumps"))
    yield


def bin_dir():
    d = os.environ.get("MESHRUN_BIN")
    if not d:
        d = os.path.join(HERE, "..", "..", "bin")
    return os.path.abspath(d)


MESHRUN = os.path.join(bin_dir(), "meshrun")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port6():
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
            return s.getsockname()[1]
    except OSError:
        return None


def wait_for(cond, timeout, what):
    """Polls cond() until truthy (returned) or timeout seconds pass (the test fails, naming what)."""
    deadline = time.monotonic() + timeout
    delay = 0.005
    while True:
        v = cond()
        if v:
            return v
        if time.monotonic() > deadline:
            pytest.fail("timed out after %.1fs waiting for %s" % (timeout, what))
        time.sleep(delay)
        delay = min(delay * 2, 0.05)


def pid_alive(pid):
    """True if pid exists and is not a zombie (read from /proc)."""
    try:
        with open("/proc/%d/stat" % pid) as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        return state != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def pids_alive(pids):
    return [p for p in pids if pid_alive(p)]


def meshrun_guard(pid):
    """True if pid is a meshrun's guard (launcher/tree: the process that cleans up after a
    killed meshrun), which runs beside the workers as meshrun's child, not a worker."""
    try:
        with open("/proc/%d/comm" % pid) as f:
            return f.read().strip() == "meshrun-guard"
    except OSError:
        return False


# Small timeouts so that tests take seconds; every one is still an upper bound, not a sleep.
FAST_CONF = "join_timeout=20,last_call_timeout=0.5,heartbeat_interval=0.1,heartbeat_timeout=1"


def solo_env(**extra):
    """The environment of a trainer run as one process outside meshrun: no rank, world or store
    variables inherited, one OpenMP thread; extra entries added (or replacing)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MESHRUN_STORE", "MESHRUN_RDZV_TOKEN"):
        env.pop(k, None)
    env.update(extra)
    return env


def timed_meshrun(d, plan_json, args, env, after=()):
    """meshrun started in d (its own session) on plan_json written to d/plan.json: args are its
    flags and the trainer, then come the plan's path and after (--set ...); env adds to the environment without PET_, SLURM_ or
    MESHRUN_ variables and with one OpenMP thread. Returns (the Popen, [(time.monotonic(), stderr
    line)], the thread that reads): each line is timed as it arrives, so a test sees when what was
    said (join the thread once the process has ended)."""
    plan = os.path.join(str(d), "plan.json")
    with open(plan, "w") as f:
        json.dump(plan_json, f)
    e = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "SLURM_", "MESHRUN_"))}
    e.update({"OMP_NUM_THREADS": "1"}, **env)
    p = subprocess.Popen([MESHRUN] + list(args) + [plan] + list(after), stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, env=e, cwd=str(d), start_new_session=True)
    lines = []

    def read():
        for raw in p.stderr:
            lines.append((time.monotonic(), raw.decode(errors="replace").rstrip("\n")))

    reader = threading.Thread(target=read)
    reader.start()
    return p, lines, reader


def tiny_plan(**sections):
    """The tiny Llama the trainer tests share (every sharded size divides by 2 and 4: dim 64,
    4 heads, 2 kv heads, vocab 256, seq 32, 2 layers), 20 steps of a global batch of 16 (micro-
    batch 2), synthetic data, no sample; keyword arguments replace whole sections."""
    plan = {
        "device": "cpu",
        "seed": 1337,
        "model": {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 256,
                  "max_seq_len": 32, "multiple_of": 32},
        "mesh": {"dp_replicate": 1, "dp_shard": 1, "tp": 1},
        "train": {"steps": 20, "seq_len": 32, "micro_batch_size": 2, "global_batch_size": 16,
                  "lr": 3e-3, "warmup_steps": 2, "decay": "cosine"},
        "data": {"format": "synthetic"},
        "eval": {"interval": 10, "batches": 2},
        "log": {"interval": 10},
        "sample": {"tokens": 0},
    }
    plan.update(sections)
    return plan


class Meshrun:
    """One meshrun process. args: meshrun flags then the program and its arguments; preexec_fn
    runs in the child before exec (e.g. to set its resource limits)."""

    def __init__(self, args, env=None, cwd=None, preexec_fn=None):
        e = dict(os.environ)
        e.pop("OMP_NUM_THREADS", None)
        # meshrun reads its flags from PET_* and, inside a Slurm allocation, its rendezvous from
        # SLURM_*: a test's meshrun gets neither from the shell that runs the suite
        for k in [k for k in e if k.startswith(("PET_", "SLURM_"))]:
            del e[k]
        if env:
            e.update(env)
        self.args = [MESHRUN] + list(args)
        self.proc = subprocess.Popen(self.args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=e,
                                     cwd=cwd, start_new_session=True, preexec_fn=preexec_fn)
        self.out = self.err = None

    @property
    def pid(self):
        return self.proc.pid

    def wait(self, timeout=60):
        try:
            out, err = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            out, err = self.proc.communicate()
            pytest.fail("meshrun did not exit within %ss\nstdout:\n%s\nstderr:\n%s" %
                        (timeout, out.decode(errors="replace"), err.decode(errors="replace")))
        self.out, self.err = out.decode(errors="replace"), err.decode(errors="replace")
        return self.proc.returncode

    def signal(self, sig):
        self.proc.send_signal(sig)

    def kill(self):
        """SIGKILL meshrun's whole session (meshrun and anything it left)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def describe(self):
        return "rc=%s\nstdout:\n%s\nstderr:\n%s" % (self.proc.returncode, self.out, self.err)


@pytest.fixture
def launch():
    """Starts Meshrun processes and guarantees none outlives the test."""
    started = []

    def start(args, **kw):
        m = Meshrun(args, **kw)
        started.append(m)
        return m

    yield start
    for m in started:
        if m.proc.poll() is None:
            m.kill()
            m.proc.communicate()


def worker_cmd(d, *extra):
    return [PYTHON, WORKER, "--dir", str(d)] + list(extra)


def read_json(path):
    with open(path) as f:
        return json.load(f)


def worker_file(d, rank, rnd, suffix):
    """A file worker.py wrote in round rnd (its MESHRUN_ROUND, not its restart count)."""
    return os.path.join(str(d), "rank%d.attempt%d.%s" % (rank, rnd, suffix))


@pytest.fixture
def netcluster():
    """Emulated clusters (test/support/netcluster.py; test/integration/netcluster_pytest.py): a factory,
    netcluster(n_hosts, rate="2gbit", delay="200us", cpu=None) returns a started Cluster of network
    namespaces; every one made is torn down at teardown, also when the test failed. Skips with
    the reason where namespaces cannot be made."""
    import netcluster_pytest as nc

    made = []

    def make(n_hosts, rate="2gbit", delay="200us", cpu=None):
        nc.require()
        c = nc.Cluster(n_hosts, rate=rate, delay=delay, cpu=cpu)
        made.append(c)
        return c.start()

    yield make
    errors = []
    for c in made:
        try:
            c.close()
        except Exception as e:  # close every cluster, then report
            errors.append(str(e))
    assert not errors, "netcluster teardown: %s" % "; ".join(errors)
