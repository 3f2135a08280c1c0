#!/usr/bin/env python3
"""Launcher benchmarks: meshrun, and torchrun beside it when it is installed.

  (a) start to exit of 8 workers running `true` (median of --reps runs)
  (b) failover: from a worker's failure (its own exit timestamp) to all workers of the next
      attempt running (their start timestamps), median of --reps/3 runs
  (c) many meshrun processes on loopback (--nnodes=N, one worker each, N from --nodes: 64 by
      default, "1024,2048" for issue 13's scale targets) from start to the last worker running
      (the round closed and every node spawned), median of --nodes-reps runs
  (d) node death at scale (N from --death-nodes): N nodes run, one is killed with SIGKILL and a
      replacement started; seconds from the kill to the first and the last survivor's worker
      stopped (the death seen, the round ended) and to all N workers of the next round running
(c) and (d) run for each of --backends (c10d; etcd: one etcd member on loopback, started here).

Prints a fixed-width table with units, the ratio torchrun/meshrun, and the targets.
--parts picks what runs ("c" alone: only the many-nodes start). The soft open-file limit is
raised to the hard one. The nodes are started with posix_spawn, their stderr in one file; the
workers' stamp files go to a tmpfs (/dev/shm) where there is one.
Environment: MESHRUN_BIN (meshrun's directory), MESHRUN_BUILD (for tools/bench_worker; built
on the fly with cc when absent). torchrun 1.13 under Python 3.11 needs Std.from_str patched;
the wrapper below does that and then calls torch.distributed.run.main().
"""
import argparse
import os
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = "/usr/bin/python3"

TORCHRUN_WRAPPER = r'''
import re, sys
from torch.distributed.elastic.multiprocessing import api
def _from_str(cls, vm):
    if re.match(r"^[0-3]$", vm):
        return cls(int(vm))
    if re.match(r"^(\d+:[0-3],)*(\d+:[0-3])$", vm):
        return {int(k): cls(int(v)) for k, v in (x.split(":") for x in vm.split(","))}
    raise ValueError("bad std spec: %s" % vm)
api.Std.from_str = classmethod(_from_str)
from torch.distributed.run import main
sys.argv[0] = "torchrun"
main()
'''


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bench_worker(tmp):
    build = os.environ.get("MESHRUN_BUILD", os.path.join(ROOT, "build"))
    exe = os.path.join(build, "tools", "bench_worker")
    if os.path.exists(exe):
        return exe
    exe = os.path.join(tmp, "bench_worker")
    subprocess.check_call(["cc", "-O2", "-o", exe, os.path.join(ROOT, "test", "tools", "bench_worker.c")])
    return exe


def run_quiet(cmd, timeout=120, env=None):
    t0 = time.perf_counter()
    p = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=timeout, env=env)
    dt = time.perf_counter() - t0
    if p.returncode != 0:
        raise RuntimeError("%s failed (%d): %s" % (" ".join(cmd[:4]), p.returncode, p.stderr.decode()[-2000:]))
    return dt


def read_ns(path):
    with open(path) as f:
        return int(f.read())


def failover_once(launcher, worker, d):
    for f in os.listdir(d):
        os.unlink(os.path.join(d, f))
    run_quiet(launcher + [worker, d, "failover"], timeout=120)
    fail = read_ns(os.path.join(d, "fail"))
    starts = stamps(d, "start.", ".1")
    if len(starts) != 8:
        raise RuntimeError("expected 8 restarted workers, found %d" % len(starts))
    return (max(starts) - fail) / 1e9


def spawn_all(cmd, n, errpath):
    """Starts n copies of cmd with posix_spawn (vfork and exec: subprocess.Popen took twice as
    long per process, and the harness's own cost counted against meshrun), stdout to /dev/null,
    stderr of all of them appended to errpath. Returns the pids."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    err = os.open(errpath, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    fa = [(os.POSIX_SPAWN_DUP2, devnull, 1), (os.POSIX_SPAWN_DUP2, err, 2)]
    try:
        return [os.posix_spawn(cmd[0], cmd, os.environ, file_actions=fa) for _ in range(n)]
    finally:
        os.close(devnull)
        os.close(err)


def wait_all(pids, errpath, what):
    bad = 0
    for pid in pids:
        _, status = os.waitpid(pid, 0)
        if os.waitstatus_to_exitcode(status):
            bad += 1
    if bad:
        with open(errpath, errors="replace") as f:
            tail = f.read()[-1500:]
        raise RuntimeError("%d of %d %s failed: %s" % (bad, len(pids), what, tail))


ETCD = "/usr/bin/etcd"


def start_etcd(tmp):
    """One etcd member on loopback (Debian's etcd-server), data in tmp: (process, "127.0.0.1:PORT")."""
    client, peer = free_port(), free_port()
    cu, pu = "http://127.0.0.1:%d" % client, "http://127.0.0.1:%d" % peer
    with open(os.path.join(tmp, "etcd.log"), "wb") as log:
        p = subprocess.Popen([ETCD, "--name", "m0", "--data-dir", os.path.join(tmp, "etcd.data"),
                              "--listen-client-urls", cu, "--advertise-client-urls", cu,
                              "--listen-peer-urls", pu, "--initial-advertise-peer-urls", pu,
                              "--initial-cluster", "m0=" + pu, "--heartbeat-interval", "100",
                              "--election-timeout", "1000"], stdout=log, stderr=subprocess.STDOUT,
                             env={k: v for k, v in os.environ.items() if not k.startswith("ETCD_")})
    deadline = time.monotonic() + 30
    while True:
        if p.poll() is not None:
            raise RuntimeError("etcd exited: see %s" % os.path.join(tmp, "etcd.log"))
        try:
            req = urllib.request.Request(cu + "/v3/kv/range", data=b'{"key":"AA=="}')
            with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(req, timeout=1) as r:
                if b'"header"' in r.read():
                    return p, "127.0.0.1:%d" % client
        except OSError:
            pass
        if time.monotonic() > deadline:
            p.kill()
            raise RuntimeError("etcd did not serve within 30 s")
        time.sleep(0.05)


def rdzv_args(endpoint):
    """--rdzv_* flags: c10d on a free loopback port when endpoint is None, else etcd there."""
    if endpoint is None:
        return ["--rdzv_endpoint=127.0.0.1:%d" % free_port()]
    return ["--rdzv_backend=etcd", "--rdzv_endpoint=" + endpoint]


def many_nodes(meshrun, worker, d, n, etcd=None):
    conf = "join_timeout=60,last_call_timeout=30,heartbeat_interval=1,heartbeat_timeout=10"
    cmd = [meshrun, "--nnodes=%d" % n, "--nproc_per_node=1"] + rdzv_args(etcd) + [
           "--rdzv_conf=" + conf, worker, d, "stamp"]
    errpath = os.path.join(os.path.dirname(d), "nodes.err")
    t0 = time.time_ns()
    wait_all(spawn_all(cmd, n, errpath), errpath, "nodes")
    starts = stamps(d, "start.")
    if len(starts) != n:
        raise RuntimeError("expected %d workers, found %d" % (n, len(starts)))
    return (max(starts) - t0) / 1e9


def stamps(d, prefix, suffix=""):
    """The timestamps in d's files named prefix...suffix (bench_worker's, not its .tmp files)."""
    return [read_ns(os.path.join(d, f)) for f in os.listdir(d)
            if f.startswith(prefix) and f.endswith(suffix) and not f.endswith(".tmp")]


def wait_stamps(d, prefix, n, pids, timeout=120):
    """Polls d until n files named prefix* exist; fails early when a node exits first."""
    deadline = time.monotonic() + timeout
    while len(stamps(d, prefix)) < n:
        for pid in pids:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                raise RuntimeError("a node exited (%d) before %d workers ran" % (os.waitstatus_to_exitcode(status), n))
        if time.monotonic() > deadline:
            raise RuntimeError("only %d of %d workers ran within %ds" % (len(stamps(d, prefix)), n, timeout))
        time.sleep(0.02)


def node_death(meshrun, worker, d, n, interval, timeout, etcd=None):
    """(d) n nodes run round 0 (workers hold until stopped); one node, not the store's, is
    killed with SIGKILL (its worker dies with it) and a replacement started at once, as a
    scheduler would (--nnodes=n-1:n: the round may go on without it; with the replacement it
    closes at n at once). Returns seconds from the kill to: the first survivor's worker stopped (the
    death seen and the round ended), the last one stopped, and every worker of the next round
    running (n again, with the replacement)."""
    conf = "join_timeout=60,last_call_timeout=30,heartbeat_interval=%g,heartbeat_timeout=%g" % (interval, timeout)
    cmd = [meshrun, "--nnodes=%d:%d" % (n - 1, n), "--nproc_per_node=1", "--max_restarts=3"] + rdzv_args(etcd) + [
           "--rdzv_conf=" + conf, worker, d, "hold"]
    errpath = os.path.join(os.path.dirname(d), "nodes.err")
    pids = spawn_all(cmd, n, errpath)
    try:
        wait_stamps(d, "start.", n, pids)
    except Exception:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass  # exited already (and reaped by wait_stamps)
        raise
    victim = pids[n // 2]  # the store's node is the first to bind the port, not this one
    t_kill = time.time_ns()
    os.kill(victim, signal.SIGKILL)
    os.waitpid(victim, 0)
    rest = [p for p in pids if p != victim] + spawn_all(cmd, 1, errpath)
    wait_all(rest, errpath, "nodes")
    stops = stamps(d, "stop.")
    starts = stamps(d, "start.", ".1")
    if len(stops) != n - 1 or len(starts) != n:
        raise RuntimeError("expected %d stopped and %d restarted workers, found %d and %d" %
                           (n - 1, n, len(stops), len(starts)))
    return tuple((t - t_kill) / 1e9 for t in (min(stops), max(stops), max(starts)))


# Issue 13's targets for the many-nodes start, by node count; 2 s for any other count.
MANY_NODES_TARGET_S = {1024: 2.0, 2048: 4.0}


def raise_nofile():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard


def fmt_ms(x):
    return "%.1f ms" % (x * 1e3) if x is not None else "-"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--nodes", default="64", help="node counts for (c), comma-separated")
    ap.add_argument("--nodes-reps", type=int, default=1, help="runs of (c) per node count (median)")
    ap.add_argument("--parts", default="abc", help="which benchmarks to run: any of a, b, c, d")
    ap.add_argument("--death-nodes", default="64", help="node counts for (d), comma-separated")
    ap.add_argument("--backends", default="c10d", help="(c), (d): rendezvous backends, any of c10d, etcd (one "
                    "loopback etcd member, Debian's etcd-server)")
    ap.add_argument("--hb-interval", type=float, default=0.5, help="(d): heartbeat_interval, seconds")
    ap.add_argument("--hb-timeout", type=float, default=3.0, help="(d): heartbeat_timeout, seconds")
    ap.add_argument("--no-torchrun", action="store_true")
    args = ap.parse_args()
    node_counts = [int(x) for x in args.nodes.split(",") if x]
    nofile = raise_nofile()
    death_counts = [int(x) for x in args.death_nodes.split(",") if x]
    if ("c" in args.parts or "d" in args.parts) and max(node_counts + death_counts) + 64 > nofile:
        sys.exit("--nodes=%d needs more open files than the hard limit of %d" % (max(node_counts), nofile))
    bindir = os.environ.get("MESHRUN_BIN", os.path.join(ROOT, "bin"))
    meshrun = os.path.join(bindir, "meshrun")
    tmp = tempfile.mkdtemp(prefix="bench-launcher-")
    stamps_dir = None
    try:
        worker = bench_worker(tmp)
        have_torchrun = False
        torchrun = None
        if not args.no_torchrun and ("a" in args.parts or "b" in args.parts) and shutil.which("torchrun"):
            wrapper = os.path.join(tmp, "torchrun_wrapper.py")
            with open(wrapper, "w") as f:
                f.write(TORCHRUN_WRAPPER)
            torchrun = [PY, wrapper]
            try:
                run_quiet(torchrun + ["--standalone", "--nproc_per_node=1", "--no_python", "true"], timeout=120)
                have_torchrun = True
            except Exception as e:
                print("torchrun present but not usable: %s" % str(e)[:200], file=sys.stderr)
        rows = []
        # The workers' stamp files on a tmpfs where there is one: 2048 workers creating and
        # renaming files in one ext4 directory contended for its lock, about 0.8 ms of CPU a node
        # in a 2048-node start on 2 cores, the harness's cost, not meshrun's.
        shm = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
        d = tempfile.mkdtemp(prefix="bench-launcher-stamps-", dir=shm) if shm else os.path.join(tmp, "w")
        os.makedirs(d, exist_ok=True)
        stamps_dir = d

        # (a)
        if "a" in args.parts:
            a_mesh = statistics.median(run_quiet([meshrun, "--nproc_per_node=8", "true"]) for _ in range(args.reps))
            a_torch = None
            if have_torchrun:
                a_torch = statistics.median(
                    run_quiet(torchrun + ["--standalone", "--nproc_per_node=8", "--no_python", "true"])
                    for _ in range(3))
            rows.append(("(a) 8 x true, start->exit (median)", a_mesh, a_torch, 0.020))

        # (b)
        if "b" in args.parts:
            reps_b = max(3, args.reps // 3)
            mesh_b = [meshrun, "--nproc_per_node=8", "--max_restarts=1", "--shutdown_timeout=5"]
            b_mesh = statistics.median(failover_once(mesh_b, worker, d) for _ in range(reps_b))
            b_torch = None
            if have_torchrun:
                tr_b = torchrun + ["--standalone", "--nproc_per_node=8", "--max_restarts=1",
                                   "--monitor_interval=0.1", "--no_python"]
                b_torch = statistics.median(failover_once(tr_b, worker, d) for _ in range(3))
            rows.append(("(b) failure -> 8 workers running again", b_mesh, b_torch, 0.025))

        for backend in args.backends.split(",") if ("c" in args.parts or "d" in args.parts) else []:
            etcd = None
            if backend == "etcd":
                etcd_proc, etcd = start_etcd(tmp)
            try:
                # (c)
                for n in node_counts if "c" in args.parts else []:
                    times = []
                    for _ in range(max(1, args.nodes_reps)):
                        for f in os.listdir(d):
                            os.unlink(os.path.join(d, f))
                        times.append(many_nodes(meshrun, worker, d, n, etcd))
                    name = "(c) %s, %d nodes, start->all running" % (backend, n)
                    if len(times) > 1:
                        name += " (median of %d)" % len(times)
                    rows.append((name, statistics.median(times), None, MANY_NODES_TARGET_S.get(n, 2.0)))
                # (d)
                for n in death_counts if "d" in args.parts else []:
                    for f in os.listdir(d):
                        os.unlink(os.path.join(d, f))
                    first, last, again = node_death(meshrun, worker, d, n, args.hb_interval, args.hb_timeout, etcd)
                    bound = args.hb_timeout + 1.0
                    rows.append(("(d) %s, %d nodes, kill -9 -> first worker stopped" % (backend, n), first, None, bound))
                    rows.append(("(d) %s, %d nodes, kill -9 -> all %d stopped" % (backend, n, n - 1), last, None, bound))
                    rows.append(("(d) %s, %d nodes, kill -9 -> all %d running again" % (backend, n, n), again, None,
                                 bound + 1.0))
            finally:
                if etcd:
                    etcd_proc.kill()
                    etcd_proc.wait()
                    shutil.rmtree(os.path.join(tmp, "etcd.data"), ignore_errors=True)

        print("%-60s %12s %12s %8s %10s %5s" % ("benchmark", "meshrun", "torchrun", "ratio", "target", "ok"))
        print("-" * 112)
        for name, m, t, target in rows:
            ratio = "%.0fx" % (t / m) if t else "-"
            print("%-60s %12s %12s %8s %10s %5s" % (name, fmt_ms(m), fmt_ms(t), ratio, "< " + fmt_ms(target),
                                                   "yes" if m < target else "NO"))
        if "d" in args.parts:
            print("(d) heartbeat_interval=%gs heartbeat_timeout=%gs; targets: detected within the timeout + 1 s, "
                  "running again within the timeout + 2 s" % (args.hb_interval, args.hb_timeout))
        print("(torchrun: %s; (b) with --monitor_interval=0.1; (c), (d) meshrun only)" %
              ("1.13 via a Std.from_str-patching wrapper" if have_torchrun else "not available"))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if stamps_dir:
            shutil.rmtree(stamps_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
