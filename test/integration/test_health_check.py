"""meshrun --health_check (launcher/health.c): before a round's workers start, every node runs a
short GEMM and sends 8 MiB to the next node; a node below --health_min_fraction of the median is
named, and left out of the round while --nnodes' minimum remains.

The slow node is made with MESHRUN_FAULT_HEALTH_GEMM=0.05 (its GEMM pauses after each batch of
products for 19 times the batch's time). The nodes' GEMMs do not run at the same moment, and on
this shared machine a healthy node's may compete for the cores with another's: the measured
fraction of the slow node was 0.01 to 0.24 with the trainer's probe in 40 runs, most often below
0.1 (0.2 to 0.35 with meshrun's own loop, which it replaced): below 0.5, named every time.

- loopback, 3 nodes, --nnodes 2:3, node 2 slow: named by every node, left out (it exits 1 and
  says why), the other two go on as a round of 2 and exit 0. RUNS times, named every time.
- loopback, 2 nodes, --nnodes 2:2, node 1 slow: named as a warning (leaving it out would leave
  1 node), the round goes on with both.
- 2 emulated hosts (network namespaces, test/support/netcluster.py): the tiny model trains with
  and without --health_check, same losses bit for bit, no node named; the time the check adds
  is printed. Then host 1 slow under --nnodes 2: named, kept, trained.

The GEMM is the trainer's (`trainer --health-gemm`, trainer/run/health_gemm.h), run by meshrun
from its own folder (launcher/health_probe.h); on this machine its cpu backend:
- the probe alone: one line of JSON naming cpu and fp32, one device; throttled by
  MESHRUN_FAULT_HEALTH_GEMM as meshrun's own loop is; its time printed.
- meshrun says the probe measured ("this node's GEMM ... on cpu in fp32 (.../trainer
  --health-gemm, ...)"), and no fallback line.
- meshrun copied alone into a folder: one line says there is no trainer beside it, and the GEMM
  runs on the host ("host-cpu"); a trainer there that fails: one line with its message, the same.
- a trainer there that never answers, meshrun stopped meanwhile (SIGTERM): the probe is gone
  when meshrun has exited.
Each runs CUDA_VISIBLE_DEVICES= so that the probe's device is the cpu on a GPU machine too.

- --rdzv_backend=etcd (one etcd member on loopback, test_etcd_rdzv's fixture; skipped without
  /usr/bin/etcd), 3 nodes, --nnodes 2:3, one slow: named by every node through the probe's
  rates, left out, the other two run as a round of 2.
"""
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import time

import netcluster_pytest as nc
import pytest
from conftest import FAST_CONF, MESHRUN, free_port, pid_alive, wait_for
from test_etcd_rdzv import ETCD, etcd  # noqa: F401 (a fixture)
from test_netcluster import losses, trainer_args

RUNS = 3
SLOW = {"MESHRUN_FAULT_HEALTH_GEMM": "0.05"}
ECHO = ["--no_python", "/bin/sh", "-c", "echo rank $RANK of $WORLD_SIZE"]
TRAINER = os.path.join(os.path.dirname(MESHRUN), "trainer")
NO_GPU = {"CUDA_VISIBLE_DEVICES": ""}
FALLBACK = "the GEMM runs on this host's CPU"


def _listening(port):
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def loopback_nodes(launch, n, nnodes, slow):
    """n meshruns on loopback, node_rank i each; node 0 first (it serves the store: the slow node
    must not be the one that cannot leave), the others once its port listens. Returns them, all
    exited, with their output."""
    port = free_port()
    args = ["--nnodes=%s" % nnodes, "--rdzv_endpoint=127.0.0.1:%d" % port, "--rdzv_conf=" + FAST_CONF,
            "--health_check"]
    ms = [launch(args + ["--node_rank=0"] + ECHO)]
    wait_for(lambda: _listening(port), 20, "node 0's store")
    for i in range(1, n):
        ms.append(launch(args + ["--node_rank=%d" % i] + ECHO, env=SLOW if i == slow else None))
    for m in ms:
        m.wait(60)
    return ms


def report(ms):
    return "\n".join("--- node %d %s" % (i, m.describe()) for i, m in enumerate(ms))


def test_slow_node_left_out(launch):
    named = 0
    for run in range(RUNS):
        ms = loopback_nodes(launch, 3, "2:3", slow=2)
        rep = report(ms)
        codes = [m.proc.returncode for m in ms]
        assert codes == [0, 0, 1], rep
        line = re.compile(r"health check: node 2 \(host [^)]*\) GEMM [0-9.]+ GFLOP/s on cpu is ([0-9.]+) of the median "
                          r"[0-9.]+ GFLOP/s: left out of this round \(2 of --nnodes 2:3 remain\)")
        fractions = [float(line.search(m.err).group(1)) for m in ms if line.search(m.err)]
        assert len(fractions) == 3, "every node names node 2\n" + rep
        assert "this node was left out by --health_check: exiting" in ms[2].err, rep
        for m in ms[:2]:
            assert "round 0 ended (health)" in m.err, rep
            assert re.search(r"of 2 \(group rank \d\), ranks \d\.\.\d of 2", m.err), rep
            assert "of 2\n" in m.out, rep  # the worker ran in the round of 2
            assert "rank 0 of 3" not in m.out and "rank 1 of 3" not in m.out, rep
        assert not any("node 0 (host" in m.err or "node 1 (host" in m.err for m in ms), rep
        named += 1
        print("run %d: node 2 named at %s of the median, left out" % (run, fractions[0]))
    assert named == RUNS


def test_slow_node_kept_at_the_minimum(launch):
    ms = loopback_nodes(launch, 2, "2:2", slow=1)
    rep = report(ms)
    assert [m.proc.returncode for m in ms] == [0, 0], rep
    for m in ms:
        assert re.search(r"health check: node 1 \(host [^)]*\) GEMM [0-9.]+ GFLOP/s on cpu is 0\.[0-4][0-9] of the median "
                         r"[0-9.]+ GFLOP/s \(below 0\.5\): kept: leaving it out would leave 1 node\(s\), fewer than "
                         r"--nnodes 2:2 allows", m.err), rep
        assert "of 2\n" in m.out, rep


def train(c, d, extra, node_env=None):
    d.mkdir()
    t0 = time.monotonic()
    codes, outs = nc.run_nodes(c, ["--nproc_per_node=1", "--rdzv_conf=" + FAST_CONF, "--shutdown_timeout=5"] +
                               extra + trainer_args(d), 90, meshrun=MESHRUN, env={"OMP_NUM_THREADS": "1"},
                               cwd=str(d), node_env=node_env)
    rep = "\n".join("--- node %d rc=%s\n%s" % (i, rc, o) for i, (rc, o) in enumerate(zip(codes, outs)))
    return codes, outs, rep, time.monotonic() - t0


def test_emulated_hosts(netcluster, tmp_path):
    nc.require()
    c = netcluster(2)
    codes, _, rep, t_plain = train(c, tmp_path / "plain", [])
    assert codes == [0, 0], rep
    codes, outs, rep, t_check = train(c, tmp_path / "checked", ["--health_check"])
    assert codes == [0, 0], rep
    took = []
    for o in outs:
        m = re.search(r"health check: round 0, 2 node\(s\) in ([0-9.]+)s: median GEMM [0-9.]+ GFLOP/s on cpu, median link "
                      r"([0-9]+) MB/s, 0 below 0.5 of a median", o)
        assert m, rep
        took.append(float(m.group(1)))
    assert "left out" not in rep and "kept" not in rep, rep
    a, b = losses(tmp_path / "plain"), losses(tmp_path / "checked")
    print("losses without the check: %s\nlosses with it:          %s" % (a, b))
    assert len(a) == 4 and a == b, "losses differ (tolerance: none, bit-identical)"
    print("the check took %s s per node (job %.2fs without, %.2fs with)" % (took, t_plain, t_check))

    codes, outs, rep, _ = train(c, tmp_path / "slow", ["--health_check"],
                                node_env=lambda i: SLOW if i == 1 else {})
    assert codes == [0, 0], rep
    for o in outs:
        assert re.search(r"health check: node 1 \(host [^)]*\) GEMM [0-9.]+ GFLOP/s on cpu is 0\.[0-4][0-9] of the median "
                         r"[0-9.]+ GFLOP/s \(below 0\.5\): kept: leaving it out would leave 1 node\(s\)", o), rep
    assert len(losses(tmp_path / "slow")) == 4


def probe(env):
    t0 = time.monotonic()
    r = subprocess.run([TRAINER, "--health-gemm"], env=dict(os.environ, **NO_GPU, **env), capture_output=True,
                       text=True, timeout=60)
    took = time.monotonic() - t0
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert len(lines) == 1, "one line on stdout, got %r" % r.stdout
    return json.loads(lines[0]), took


def test_probe_line():
    p, took = probe({"LOCAL_WORLD_SIZE": "2"})
    print("trainer --health-gemm: %s in %.2fs (the whole process)" % (json.dumps(p), took))
    assert p["device"] == "cpu" and p["dtype"] == "fp32", p  # the cpu backend: one "device"
    assert len(p["devices"]) == 1 and p["gflops"] == min(p["devices"]) > 0, p
    slow, _ = probe({"MESHRUN_FAULT_HEALTH_GEMM": "0.1"})
    ratio = slow["gflops"] / p["gflops"]
    print("throttled to 0.1: %.1f GFLOP/s, %.3f of the unthrottled (bound: < 0.5)" % (slow["gflops"], ratio))
    assert ratio < 0.5


def solo(meshrun, env=None, cwd=None):
    """One node under --health_check, the echo worker, run to its end: its stderr."""
    e = dict(os.environ, **NO_GPU, **(env or {}))
    e.pop("OMP_NUM_THREADS", None)
    r = subprocess.run([meshrun, "--nnodes=1", "--health_check", "--rdzv_conf=" + FAST_CONF] + ECHO, env=e,
                       capture_output=True, text=True, timeout=60, cwd=cwd)
    assert r.returncode == 0, r.stderr
    assert "rank 0 of 1" in r.stdout, r.stdout + r.stderr
    return r.stderr


def test_probe_measures():
    err = solo(MESHRUN)
    print(err)
    mine = re.search(r"health check: this node's GEMM ([0-9.]+) GFLOP/s on cpu in fp32 \((\S+) --health-gemm, "
                     r"([0-9.]+)s\)", err)
    assert mine and mine.group(2) == TRAINER, err
    assert re.search(r"health check: round 0, 1 node\(s\) in [0-9.]+s: median GEMM %s GFLOP/s on cpu, 0 below" %
                     re.escape(mine.group(1)), err), err
    assert FALLBACK not in err, err
    print("the probe measured %s GFLOP/s in %ss" % (mine.group(1), mine.group(3)))


def alone(tmp_path, trainer=None):
    """meshrun copied into a folder of its own, with the trainer script given (or none)."""
    d = tmp_path / "bin"
    d.mkdir()
    shutil.copy(MESHRUN, d / "meshrun")
    if trainer:
        (d / "trainer").write_text("#!/bin/sh\n" + trainer + "\n")
        (d / "trainer").chmod(0o755)
    return str(d / "meshrun"), d


def test_no_trainer_beside_meshrun(tmp_path):
    meshrun, d = alone(tmp_path)
    err = solo(meshrun, cwd=str(tmp_path))
    print(err)
    lines = [l for l in err.splitlines() if FALLBACK in l]
    assert lines == ["[meshrun] health check: no trainer beside meshrun (%s/trainer): %s" % (d, FALLBACK)], err
    assert re.search(r"median GEMM [0-9.]+ GFLOP/s on host-cpu, 0 below", err), err
    assert "this node's GEMM" not in err, err


def test_failing_trainer_beside_meshrun(tmp_path):
    meshrun, d = alone(tmp_path, "echo 'trainer --health-gemm: no device today' >&2\nexit 1")
    err = solo(meshrun, cwd=str(tmp_path))
    print(err)
    lines = [l for l in err.splitlines() if FALLBACK in l]
    assert len(lines) == 1, err
    assert re.fullmatch(r"\[meshrun\] health check: the trainer's GEMM probe \(%s/trainer --health-gemm\) failed: "
                        r"(exit status 1: )?trainer --health-gemm: no device today: %s" % (re.escape(str(d)), FALLBACK),
                        lines[0]), lines[0]
    assert re.search(r"median GEMM [0-9.]+ GFLOP/s on host-cpu, 0 below", err), err


def test_probe_stopped_with_meshrun(tmp_path, launch):
    pidfile = tmp_path / "probe.pid"
    meshrun, d = alone(tmp_path, "echo $$ > %s\nexec sleep 300" % pidfile)
    e = dict(os.environ, **NO_GPU)
    m = subprocess.Popen([meshrun, "--nnodes=1", "--health_check", "--rdzv_conf=" + FAST_CONF] + ECHO, env=e,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    pid = 0
    try:
        pid = wait_for(lambda: pidfile.exists() and pidfile.read_text().strip() and int(pidfile.read_text()), 20,
                       "the probe's pid")
        m.send_signal(signal.SIGTERM)
        _, err = m.communicate(timeout=30)
        print(err)
        alive = pid_alive(pid)
        print("meshrun exited %d; the probe (pid %d) %s" % (m.returncode, pid, "is ALIVE" if alive else "is gone"))
        assert not alive
        assert m.returncode == 128 + signal.SIGTERM, err
        assert "rank 0 of 1" not in err
    finally:
        if m.poll() is None:
            os.killpg(m.pid, signal.SIGKILL)
            m.communicate()
        if pid and pid_alive(pid):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.skipif(not os.access(ETCD, os.X_OK), reason="%s not found (Debian package etcd-server)" % ETCD)
def test_slow_node_left_out_under_etcd(launch, etcd):
    args = ["--rdzv_backend=etcd", "--rdzv_endpoint=" + etcd.endpoint, "--nnodes=2:3", "--nproc_per_node=1",
            "--rdzv_conf=join_timeout=20,last_call_timeout=1,heartbeat_interval=0.1,heartbeat_timeout=2",
            "--health_check"]
    ms = [launch(args + ["--node_rank=%d" % i] + ECHO, env=dict(NO_GPU, **(SLOW if i == 2 else {})))
          for i in range(3)]
    for m in ms:
        m.wait(60)
    rep = report(ms)
    print(rep)
    assert [m.proc.returncode for m in ms] == [0, 0, 1], rep
    slow = re.search(r"this node's GEMM ([0-9.]+) GFLOP/s on cpu in fp32", ms[2].err)
    assert slow, rep
    line = re.compile(r"health check: node \d \(host [^)]*\) GEMM %s GFLOP/s on cpu is ([0-9.]+) of the median "
                      r"[0-9.]+ GFLOP/s: left out of this round \(2 of --nnodes 2:3 remain\)" % re.escape(slow.group(1)))
    fractions = [line.search(m.err).group(1) for m in ms if line.search(m.err)]
    assert len(fractions) == 3, "every node names the slow one\n" + rep
    assert "this node was left out by --health_check: exiting" in ms[2].err, rep
    for m in ms[:2]:
        assert "of 2\n" in m.out, rep
    print("under etcd: the slow node named by all 3 at %s of the median, left out" % fractions[0])
