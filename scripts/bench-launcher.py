#!/usr/bin/env python3
"""Launcher benchmarks: meshrun, and torchrun beside it when it is installed.

  (a) start to exit of 8 workers running `true` (median of --reps runs)
  (b) failover: from a worker's failure (its own exit timestamp) to all workers of the next
      attempt running (their start timestamps), median of --reps/3 runs
  (c) 64 meshrun processes on loopback (--nnodes=64, one worker each) from start to the last
      worker running (the round closed and every node spawned)

Prints a fixed-width table with units, the ratio torchrun/meshrun, and the targets.
Environment: MESHRUN_BIN (meshrun's directory), MESHRUN_BUILD (for tools/bench_worker; built
on the fly with cc when absent). torchrun 1.13 under Python 3.11 needs Std.from_str patched;
the wrapper below does that and then calls torch.distributed.run.main().
"""
import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

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
    starts = [read_ns(os.path.join(d, f)) for f in os.listdir(d) if f.startswith("start.") and f.endswith(".1")]
    if len(starts) != 8:
        raise RuntimeError("expected 8 restarted workers, found %d" % len(starts))
    return (max(starts) - fail) / 1e9


def many_nodes(meshrun, worker, d, n):
    port = free_port()
    conf = "join_timeout=60,last_call_timeout=30,heartbeat_interval=1,heartbeat_timeout=10"
    cmd = [meshrun, "--nnodes=%d" % n, "--nproc_per_node=1", "--rdzv_endpoint=127.0.0.1:%d" % port,
           "--rdzv_conf=" + conf, worker, d, "stamp"]
    t0 = time.time_ns()
    procs = [subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) for _ in range(n)]
    bad = []
    for p in procs:
        _, err = p.communicate(timeout=120)
        if p.returncode:
            bad.append(err.decode()[-500:])
    if bad:
        raise RuntimeError("%d of %d nodes failed: %s" % (len(bad), n, bad[0]))
    starts = [read_ns(os.path.join(d, f)) for f in os.listdir(d) if f.startswith("start.")]
    if len(starts) != n:
        raise RuntimeError("expected %d workers, found %d" % (n, len(starts)))
    return (max(starts) - t0) / 1e9


def fmt_ms(x):
    return "%.1f ms" % (x * 1e3) if x is not None else "-"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--nodes", type=int, default=64)
    ap.add_argument("--no-torchrun", action="store_true")
    args = ap.parse_args()
    bindir = os.environ.get("MESHRUN_BIN", os.path.join(ROOT, "bin"))
    meshrun = os.path.join(bindir, "meshrun")
    tmp = tempfile.mkdtemp(prefix="bench-launcher-")
    try:
        worker = bench_worker(tmp)
        have_torchrun = False
        torchrun = None
        if not args.no_torchrun and shutil.which("torchrun"):
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
        d = os.path.join(tmp, "w")
        os.makedirs(d)

        # (a)
        a_mesh = statistics.median(run_quiet([meshrun, "--nproc_per_node=8", "true"]) for _ in range(args.reps))
        a_torch = None
        if have_torchrun:
            a_torch = statistics.median(
                run_quiet(torchrun + ["--standalone", "--nproc_per_node=8", "--no_python", "true"])
                for _ in range(3))
        rows.append(("(a) 8 x true, start->exit (median)", a_mesh, a_torch, 0.020))

        # (b)
        reps_b = max(3, args.reps // 3)
        mesh_b = [meshrun, "--nproc_per_node=8", "--max_restarts=1", "--shutdown_timeout=5"]
        b_mesh = statistics.median(failover_once(mesh_b, worker, d) for _ in range(reps_b))
        b_torch = None
        if have_torchrun:
            tr_b = torchrun + ["--standalone", "--nproc_per_node=8", "--max_restarts=1", "--monitor_interval=0.1",
                               "--no_python"]
            b_torch = statistics.median(failover_once(tr_b, worker, d) for _ in range(3))
        rows.append(("(b) failure -> 8 workers running again", b_mesh, b_torch, 0.025))

        # (c)
        for f in os.listdir(d):
            os.unlink(os.path.join(d, f))
        c_mesh = many_nodes(meshrun, worker, d, args.nodes)
        rows.append(("(c) %d nodes on loopback, start->round closed" % args.nodes, c_mesh, None, 2.0))

        print("%-46s %12s %12s %8s %10s %5s" % ("benchmark", "meshrun", "torchrun", "ratio", "target", "ok"))
        print("-" * 98)
        for name, m, t, target in rows:
            ratio = "%.0fx" % (t / m) if t else "-"
            print("%-46s %12s %12s %8s %10s %5s" % (name, fmt_ms(m), fmt_ms(t), ratio, "< " + fmt_ms(target),
                                                   "yes" if m < target else "NO"))
        print("(torchrun: %s; (b) with --monitor_interval=0.1; (c) meshrun only)" %
              ("1.13 via a Std.from_str-patching wrapper" if have_torchrun else "not available"))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
