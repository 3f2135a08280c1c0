"""meshrun --health_check (launcher/health.c): before a round's workers start, every node runs a
short GEMM and sends 8 MiB to the next node; a node below --health_min_fraction of the median is
named, and left out of the round while --nnodes' minimum remains.

The slow node is made with MESHRUN_FAULT_HEALTH_GEMM=0.05 (its GEMM pauses after each product
for 19 times the product's time). On this shared machine the healthy nodes' GEMMs compete for
the cores while the slow one sleeps, so its measured fraction is higher than 0.05 (0.2 to 0.35
seen): far enough below 0.5 to be named every time.

- loopback, 3 nodes, --nnodes 2:3, node 2 slow: named by every node, left out (it exits 1 and
  says why), the other two go on as a round of 2 and exit 0. RUNS times, named every time.
- loopback, 2 nodes, --nnodes 2:2, node 1 slow: named as a warning (leaving it out would leave
  1 node), the round goes on with both.
- 2 emulated hosts (network namespaces, test/support/netcluster.py): the tiny model trains with
  and without --health_check, same losses bit for bit, no node named; the time the check adds
  is printed. Then host 1 slow under --nnodes 2: named, kept, trained.
"""
import os
import re
import socket
import time

import netcluster_pytest as nc
from conftest import FAST_CONF, MESHRUN, free_port, wait_for
from test_netcluster import losses, trainer_args

RUNS = 3
SLOW = {"MESHRUN_FAULT_HEALTH_GEMM": "0.05"}
ECHO = ["--no_python", "/bin/sh", "-c", "echo rank $RANK of $WORLD_SIZE"]


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
        line = re.compile(r"health check: node 2 \(host [^)]*\) GEMM [0-9.]+ GFLOP/s is ([0-9.]+) of the median "
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
        assert re.search(r"health check: node 1 \(host [^)]*\) GEMM [0-9.]+ GFLOP/s is 0\.[0-4][0-9] of the median "
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
        m = re.search(r"health check: round 0, 2 node\(s\) in ([0-9.]+)s: median GEMM [0-9.]+ GFLOP/s, median link "
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
        assert re.search(r"health check: node 1 \(host [^)]*\) GEMM [0-9.]+ GFLOP/s is 0\.[0-4][0-9] of the median "
                         r"[0-9.]+ GFLOP/s \(below 0\.5\): kept: leaving it out would leave 1 node\(s\)", o), rep
    assert len(losses(tmp_path / "slow")) == 4
