"""test_netcluster: the emulated cluster network (test/support/netcluster.py) and meshrun across it.

- The cluster comes up: every host reaches every other over the switch, lo is up in every
  namespace, and the root namespace's addresses and links are the same before, during and after
  (nothing of the cluster lives there); after teardown none of its namespaces is left, also when
  the `with` block raised, and a process started in a namespace is gone with it.
- The shaping takes effect: one TCP stream at a tbf rate of 500 Mbit/s moves at most 5% above
  the rate and at least 60% of it, and an unshaped link between the same kind of namespaces at
  least 1.5 x faster (so the limit is the shaping, not the machine). With a 2 ms delay the median
  round trip exceeds an undelayed cluster's by at least 0.9 x 2 x delay (the delay is what the
  cluster added), and the delaying element's own floor (the same cluster at 1 us) by less than
  1.5 x 2 x delay (applied once per link each way, not twice; room for a late timer). On kernels without sch_netem the delay comes from the user-space switch
  (test/tools/netdelay); then the rate limit must still hold through it (at most 5% above a
  500 Mbit/s rate with 200 us of delay). Skipped, with the reason, only where neither exists.
- A CPU budget holds: a busy loop on a host with cpu=0.25 gets at most 0.4 s of CPU in 1 s of
  wall time (without the budget it would get about 1 s on an idle core), the host's cgroup says
  0.25 cores, and the cgroups are gone after teardown.
- meshrun across 2 emulated hosts x 2 processes trains the tiny FSDP plan (configs/tiny.json,
  4 steps) to exit 0 with world size 4, its collectives really crossing the emulated link (each
  host's eth0 sent more than 1 MB), and its losses equal, bit for bit, those of the same plan at
  world size 4 on loopback (one meshrun, 4 processes): the ring collectives reduce in the same
  order whatever the transport.
- `test/support/netcluster.py run` killed by SIGTERM while its nodes run leaves no namespace and no
  process behind.
- A real 3-member etcd cluster (test/integration/etcdcluster.py), one member per emulated host on
  that host's address, serves: a put through member 0 reads back through member 2 (linearizable);
  once the leader is SIGKILLed the two survivors elect another and a put through one reads back
  through the other (quorum 2 of 3), while one member alone refuses a put; the last member, a
  c.run process, is killed and reaped by the cluster's own close. Skipped, with the reason, where
  /usr/bin/etcd is missing.
Every test skips, naming the reason, where network namespaces cannot be made (not root, ...).
"""
import os
import signal
import statistics
import subprocess
import time

import pytest

import etcdcluster
import netcluster_pytest as nc
from conftest import FAST_CONF, MESHRUN, Meshrun, bin_dir, pid_alive, pids_alive, wait_for

REPO = nc.REPO
TRAINER = os.path.join(bin_dir(), "trainer")
TINY = os.path.join(REPO, "configs", "tiny.json")
TEXT = os.path.join(REPO, "data", "tinyshakespeare.txt")


def root_net():
    """The root namespace's links and addresses, without counters."""
    addrs = subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True, check=True).stdout
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout
    return sorted(addrs.splitlines()), sorted(l.split("\\")[0] for l in links.splitlines())


def test_cluster_comes_up_and_leaves_nothing(netcluster):
    nc.require()
    before = root_net()
    c = netcluster(3)
    print("cluster:", c.describe())
    assert root_net() == before, "the cluster touched the root namespace's network"
    for i in range(3):
        out = subprocess.run(["ip", "-n", c.ns(i), "-o", "addr"], capture_output=True, text=True, check=True).stdout
        assert "inet 127.0.0.1/8" in out and "inet %s/24" % c.addr(i) in out, out
    for i in range(3):
        for j in range(3):
            if i != j:
                r = c.rtt(i, j, count=3)
                print("rtt %d->%d: %s us" % (i, j, ", ".join("%.0f" % (x * 1e6) for x in r)))
                assert len(r) == 3
    names = c.namespaces()
    assert len(names) == 4 and all(n in nc.list_netns() for n in names)
    c.close()
    assert not set(names) & set(nc.list_netns()), "namespaces left after teardown"
    assert root_net() == before


def test_teardown_after_exception_kills_and_deletes():
    nc.require()
    names, pid = None, None
    with pytest.raises(RuntimeError, match="boom"):
        with nc.Cluster(2, rate="1gbit", delay=None) as c:
            names = c.namespaces()
            p = c.run(1, ["/usr/bin/python3", "-c", "import sys; print('up', flush=True); sys.stdin.read()"],
                      stdin=subprocess.PIPE, stdout=subprocess.PIPE)
            assert p.stdout.readline().strip() == b"up"  # it runs inside the namespace now
            pid = p.pid
            raise RuntimeError("boom")
    assert names and not set(names) & set(nc.list_netns()), "namespaces left after an exception"
    assert p.poll() is not None, "process %d in the namespace outlived the cluster" % pid


def test_rate_shapes_throughput(netcluster):
    nc.require()
    rate = 500e6
    shaped = netcluster(2, rate="500mbit", delay=None)
    got = shaped.throughput(0, 1, nbytes=24 << 20)
    free = netcluster(2, rate=None, delay=None)
    top = free.throughput(0, 1, nbytes=24 << 20)
    print("tbf 500mbit: %s; unshaped: %s (tolerance: 0.6x to 1.05x the rate; unshaped >= 1.5x)" %
          (nc.core.fmt_rate(got), nc.core.fmt_rate(top)))
    assert 0.6 * rate <= got <= 1.05 * rate
    assert top >= 1.5 * got


def test_rtt_reflects_delay(netcluster):
    """The delay lands once per link each way: RTT grows by 2 x delay over an undelayed cluster, and
    by less than 1.5 x that over the delaying element's own floor. The delay is 2 ms so that a
    timer's late wake-up on a loaded machine (hundreds of us on 2 busy cores: once 839 us over the
    floor against a 200 us delay) stays far from what a delay applied twice would add (2 x)."""
    nc.require()
    c = netcluster(2, rate="2gbit", delay="2ms")
    if not c.delay_applied:
        pytest.skip("delay not emulated on this kernel: %s" % c.shaping)
    plain = netcluster(2, rate="2gbit", delay=None)
    # the delaying element itself (netem, or the user-space switch: a hop through a process on
    # each way) with next to nothing to delay: what it costs on this machine, now
    tiny = netcluster(2, rate="2gbit", delay="1us")
    # the three measured in turns, so that a change in the machine's load falls on all three
    got = {"med": [], "base": [], "floor": []}
    for _ in range(5):
        for k, cl in (("med", c), ("base", plain), ("floor", tiny)):
            got[k] += cl.rtt(0, 1, count=10)
    med, base, floor = (statistics.median(got[k]) for k in ("med", "base", "floor"))
    want = 2 * c.delay_s
    # Above the element's own floor the delay may run late (a timer's wake-up on a loaded machine)
    # but not twice over: what a delay applied twice, or per packet instead of per link, would do.
    print("rtt median %.0f us; undelayed %.0f us; through the delaying element at 1 us %.0f us; configured 2 x "
          "2 ms = %.0f us (tolerance: added over undelayed >= 0.9 x configured; added over the 1 us floor < 1.5 x "
          "configured) via %s" % (med * 1e6, base * 1e6, floor * 1e6, want * 1e6, c.shaping))
    assert med - base >= 0.9 * want
    assert med - floor < 1.5 * want


def test_rate_holds_through_the_delaying_switch(netcluster):
    nc.require()
    c = netcluster(2, rate="500mbit", delay="200us")
    if "user-space switch" not in c.shaping:
        pytest.skip("this kernel delays with netem; the user-space switch is not used: %s" % c.shaping)
    got = c.throughput(0, 1, nbytes=24 << 20)
    print("tbf 500mbit + 200 us through netdelay: %s (tolerance: 0.5x to 1.05x the rate)" % nc.core.fmt_rate(got))
    assert 0.5 * 500e6 <= got <= 1.05 * 500e6


_BUSY = "import os,time\nt=time.monotonic()\nwhile time.monotonic()-t<1.0: pass\nprint(sum(os.times()[:2]))"


def test_cpu_budget_limits_a_host(netcluster):
    nc.require()
    ok, why = nc.core._cgroup_root()
    if ok is None:
        pytest.skip("no cpu budget here: %s" % why)
    c = netcluster(1, rate=None, delay=None, cpu=0.25)
    cg = c.cgroup(0)
    assert nc.core.cpu_limit(cg) == pytest.approx(0.25)
    p = c.run(0, ["/usr/bin/python3", "-c", _BUSY], stdout=subprocess.PIPE)
    used = float(p.communicate(timeout=30)[0])
    print("busy loop under cpu=0.25: %.2f s of CPU in 1 s of wall time (tolerance: <= 0.4)" % used)
    assert 0 < used <= 0.4
    c.close()
    assert not os.path.exists(cg)


def trainer_args(d):
    return [TRAINER, TINY, "--set", "train.steps=4", "--set", "eval.interval=0", "--set", "sample.tokens=0",
            "--set", "data.train=" + TEXT, "--set", "mesh.dp_shard=-1",
            "--set", "log.metrics_file=" + os.path.join(str(d), "metrics.jsonl")]


def losses(d):
    return [(r["step"], r["loss"]) for r in nc.read_metrics(os.path.join(str(d), "metrics.jsonl")) if "loss" in r]


def test_meshrun_across_emulated_hosts_matches_loopback(netcluster, tmp_path):
    nc.require()
    lo, net = tmp_path / "loopback", tmp_path / "net"
    lo.mkdir()
    net.mkdir()
    t0 = time.monotonic()
    ref = Meshrun(["--nproc_per_node=4", "--rdzv_conf=" + FAST_CONF] + trainer_args(lo),
                  env={"OMP_NUM_THREADS": "1"}, cwd=str(lo))
    assert ref.wait(60) == 0, ref.describe()
    t1 = time.monotonic()

    c = netcluster(2)
    env = {"OMP_NUM_THREADS": "1"}
    codes, outs = nc.run_nodes(c, ["--nproc_per_node=2", "--rdzv_conf=" + FAST_CONF, "--shutdown_timeout=5"] +
                               trainer_args(net), 60, meshrun=MESHRUN, env=env, cwd=str(net))
    t2 = time.monotonic()
    report = "\n".join("--- node %d rc=%s\n%s" % (i, rc, o) for i, (rc, o) in enumerate(zip(codes, outs)))
    assert codes == [0, 0], report
    assert "ranks 2..3 of 4" in report, report
    sent = [c.link_bytes(i)[0] for i in range(2)]
    print("loopback %.1fs, emulated hosts %.1fs (%s); bytes sent on eth0 per host: %s" %
          (t1 - t0, t2 - t1, c.shaping, sent))
    assert all(b > 1e6 for b in sent), "the collectives did not cross the emulated link: %s" % sent

    a, b = losses(lo), losses(net)
    print("losses loopback: %s\nlosses emulated: %s" % (a, b))
    assert len(a) == 4 and a == b, "losses differ (tolerance: none, bit-identical)"


def test_cli_run_torn_down_by_sigterm(tmp_path):
    """test/support/netcluster.py run, its meshrun nodes and their workers up, then SIGTERM to the
    script: it exits, and neither a namespace of its own (named nc<its pid>-...) nor a process
    that ran in one is left."""
    nc.require()
    script = os.path.join(REPO, "test", "support", "netcluster.py")
    worker = ["/usr/bin/python3", "-c", "import signal; signal.pause()"]  # runs until killed
    p = subprocess.Popen(["/usr/bin/python3", script, "run", "--hosts", "2", "--", "--nproc_per_node=1",
                          "--rdzv_conf=" + FAST_CONF] + worker, env=dict(os.environ, MESHRUN_BIN=bin_dir()),
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        def mine():
            return [n for n in nc.list_netns() if n.startswith("nc%d-" % p.pid)]

        seen = {}

        def workers_up():
            # Each host runs its meshrun and one worker: two processes in each host namespace.
            for n in mine():
                seen[n] = set(nc.core.netns_pids(n)) | seen.get(n, set())
            hosts = [n for n in mine() if not n.endswith("-sw")]
            return len(hosts) == 2 and all(len(nc.core.netns_pids(n)) >= 2 for n in hosts)

        wait_for(workers_up, 30, "both hosts' meshrun and worker")
        pids = set().union(*seen.values())
        p.send_signal(signal.SIGTERM)
        out = p.communicate(timeout=30)[0].decode(errors="replace")
        print(out)
        assert p.returncode != 0, out
        assert mine() == [], "namespaces left after SIGTERM: %s" % mine()
        assert pids_alive(sorted(pids)) == [], "processes of the cluster survived"
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.communicate()


ETCD_READY_S = 20  # bound on a start (etcd itself spends about 2 s probing its peers) or a re-election


def test_etcd_cluster_in_namespaces(netcluster, tmp_path):
    nc.require()
    ok, why = etcdcluster.available()
    if not ok:
        pytest.skip("no etcd to run: %s" % why)
    c = netcluster(3)
    with etcdcluster.EtcdCluster(c, [0, 1, 2], tmp_path) as e:
        ready = e.wait_ready(ETCD_READY_S)
        eps = e.endpoints().split(",")
        print("%s; 3 etcd members (%s) ready in %.2f s (bound %d s); logs %s" %
              (why, ",".join(eps), ready, ETCD_READY_S, os.path.join(str(tmp_path), "etcd-h*.log")))
        assert [ep.rsplit(":", 1)[0] for ep in eps] == [c.addr(i) for i in range(3)]

        e.put("test/k", "v0", via_host=0)
        assert e.get("test/k", via_host=2) == b"v0"
        assert e.get("test/absent", via_host=1) is None
        _, ttl = e.lease_grant(1, via_host=1)
        print("lease asked with TTL 1 s granted TTL %d s (heartbeat %d ms, election %d ms)" %
              (ttl, e.heartbeat_ms, e.election_ms))
        assert ttl >= 1

        victim = e.leader()
        assert victim is not None, "no member reports itself leader"
        pid = e.procs[victim].pid
        t = time.monotonic()
        e.kill(victim)
        assert not e.alive(victim) and not pid_alive(pid)
        survivors = [i for i in range(3) if i != victim]
        elect = e.wait_ready(ETCD_READY_S)
        e.put("test/k", "v1", via_host=survivors[0])
        assert e.get("test/k", via_host=survivors[1]) == b"v1"
        print("leader h%d SIGKILLed: survivors %s serve a put and a linearizable get %.2f s later "
              "(re-election %.2f s, bound %d s)" % (victim, survivors, time.monotonic() - t, elect, ETCD_READY_S))

        # One of three is no quorum: the last member refuses a write (no leader, or no answer).
        e.kill(survivors[1])
        t = time.monotonic()
        with pytest.raises(etcdcluster.EtcdError) as refused:
            e.put("test/k", "v2", via_host=survivors[0], timeout=3)
        print("one member of three refused the put in %.2f s: %s" %
              (time.monotonic() - t, str(refused.value).splitlines()[0]))

        # The members are c.run processes: the cluster's close kills and reaps the last one.
        last = e.procs[survivors[0]]
        assert e.alive(survivors[0])
        c.close()
        assert last.poll() is not None and not pid_alive(last.pid), "etcd h%d outlived the cluster" % survivors[0]
    assert all(p.poll() is not None for p in e.procs.values())
