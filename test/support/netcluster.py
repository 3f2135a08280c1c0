#!/usr/bin/python3
"""netcluster: an emulated cluster network on one machine, for meshrun's multi-node runs.

    test/support/netcluster.py check                      can network namespaces be made here? (exit 0/1)
    test/support/netcluster.py measure [--hosts N] [--rate R] [--delay D]   bring up, print RTT and throughput
    test/support/netcluster.py run --hosts 2 --rate 2gbit --delay 200us [--cpu auto] -- [meshrun args...] PROGRAM [ARGS...]
    test/support/netcluster.py clean                      delete namespaces left by netcluster runs that died

Each emulated host is a Linux network namespace with one veth link ("eth0", 10.211.X.(i+1)/24, X
random per cluster) to a bridge that lives in a namespace of its own (the switch, PREFIX-sw), so
nothing is added to the root namespace's network. Names carry the creating process's pid and a
random tag (nc<pid>-<tag>-h<i>), so parallel runs never collide; interface names are per
namespace (eth0, br0, p<i>), always short.

Shaping, on every link and in both directions: a tbf qdisc limits the rate (the host's egress on
its eth0, and the switch's egress toward that host on p<i>, so receiving is limited as sending
is: a full-duplex link of that rate). The delay is a netem qdisc under the host's tbf, so one
way between two hosts takes `delay` and a round trip 2 x delay. A kernel without sch_netem (some
VM kernels have CONFIG_NET_SCH_NETEM unset and no modules) gets the delay from a user-space
switch instead (test/tools/netdelay, built by make): the ports leave the bridge and that program
forwards frames between them after holding each for `delay`; the tbf qdiscs still shape. Without
either, the rate alone: Cluster says so in .delay_applied and .shaping, and the CLI prints a
warning; nothing is silently pretended.

CPU (cpu=C, "auto" = 80% of the machine's cores split evenly among the hosts, the rest left to
the network's own work): each host's processes run
in a cgroup of their own (cgroup v2 cpu.max, else v1 cpu.cfs_quota_us) limited to C cores, as
Mininet's CPU-limited hosts are. Without it, hosts share the machine's cores, and a rank that
waits on the network hands its core to another host's compute: a blocking step then looks
cheaper than on separate machines, and overlap has less to hide. The cgroups are named like the
namespaces and removed with them.

Traffic between two processes of the same host stays on that namespace's loopback, unshaped,
as on a real machine. meshrun nodes get MESHRUN_COMM_HOST set to their host's address, which the
trainer's cpu comm listens on and publishes to its peers (else it would publish the machine's
hostname, which resolves outside the namespaces).

Teardown (Cluster.close, also from atexit, and SIGTERM/SIGHUP turned into SystemExit while a
cluster is up) kills the process sessions started with run(), then whatever else still runs in
the cluster's namespaces (only processes we started can be in them), then deletes the
namespaces; the veths and the bridge go with them. Python 3 standard library only.
"""
import argparse
import atexit
import json
import math
import os
import random
import re
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time

PYTHON = sys.executable or "/usr/bin/python3"
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # test/support/..
NAME_RE = re.compile(r"^nc(\d+)-([0-9a-f]+)-(sw|h\d+|probe)$")


class NetclusterError(Exception):
    pass


# ---- units ---------------------------------------------------------------------------------

_RATE_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
               "bps": 8, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9}
_TIME_UNITS = {"ns": 1e-9, "us": 1e-6, "usec": 1e-6, "ms": 1e-3, "msec": 1e-3, "s": 1.0, "sec": 1.0}


def parse_rate(s):
    """'2gbit' -> 2e9 bits/s (tc's units: bit, kbit, mbit, gbit; bps, kbps... are bytes/s)."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", str(s))
    if not m or m.group(2).lower() not in _RATE_UNITS:
        raise NetclusterError("rate %r: expected a number and one of %s, e.g. 2gbit" % (s, ", ".join(_RATE_UNITS)))
    return float(m.group(1)) * _RATE_UNITS[m.group(2).lower()]


def parse_time(s):
    """'200us' -> 2e-4 seconds (units ns, us, ms, s)."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", str(s))
    if not m or m.group(2).lower() not in _TIME_UNITS:
        raise NetclusterError("delay %r: expected a number and one of ns, us, ms, s, e.g. 200us" % (s,))
    return float(m.group(1)) * _TIME_UNITS[m.group(2).lower()]


def parse_cpu(s, n_hosts):
    """--cpu / cpu=: None or "none" -> None (no budget); "auto" -> AUTO_CPU_SHARE of the
    machine's cores over n_hosts; else a number of cores > 0."""
    if s is None or str(s).strip().lower() == "none":
        return None
    if str(s).strip().lower() == "auto":
        return AUTO_CPU_SHARE * (os.cpu_count() or 1) / n_hosts
    try:
        cores = float(s)
    except ValueError:
        cores = 0.0
    if not cores > 0:
        raise NetclusterError("cpu %r: expected a number of cores > 0, auto or none" % (s,))
    return cores


def _off(s):
    """A rate or delay given as None, "", "0" or "none": no shaping of that kind."""
    return s is None or str(s).strip().lower() in ("", "0", "none")


def fmt_rate(bps):
    for unit, f in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bps >= f:
            return "%.2f %s" % (bps / f, unit)
    return "%.0f bit/s" % bps


# ---- commands ------------------------------------------------------------------------------

def _sh(argv, check=True, timeout=30):
    """Runs a short command (ip, tc); returns its CompletedProcess, or raises naming the command
    and its stderr."""
    try:
        p = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise NetclusterError("%s: %s" % (" ".join(argv), e))
    if check and p.returncode != 0:
        raise NetclusterError("%s: exit %d: %s" % (" ".join(argv), p.returncode, p.stderr.strip()))
    return p


def list_netns():
    p = _sh(["ip", "netns", "list"], check=False)
    return [l.split()[0] for l in p.stdout.splitlines() if l.strip()]


def netns_pids(ns):
    p = _sh(["ip", "netns", "pids", ns], check=False)
    return [int(x) for x in p.stdout.split() if x.isdigit()]


def _pid_alive(pid):
    """True if pid exists and is not a zombie (a killed creator may wait a moment to be reaped)."""
    try:
        with open("/proc/%d/stat" % pid) as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _kill_netns(ns, deadline_s=5.0):
    """SIGKILLs every process in namespace ns and waits (polling) until none is left or the
    deadline passes, then deletes the namespace. Only namespaces this module made are passed."""
    pids = netns_pids(ns)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    end = time.monotonic() + deadline_s
    while pids and time.monotonic() < end:
        pids = netns_pids(ns)
        if pids:
            time.sleep(0.01)
    _sh(["ip", "netns", "del", ns], check=False)


def sweep_stale():
    """Deletes namespaces named by this module whose creating process is gone (a run that was
    SIGKILLed could not clean up). Returns their names."""
    gone = []
    for ns in list_netns():
        m = NAME_RE.match(ns)
        if m and not _pid_alive(int(m.group(1))):
            _kill_netns(ns, 1.0)
            gone.append(ns)
    for cg in _stale_cgroups():
        if _cgroup_remove(cg, 1.0):
            gone.append(cg)
    return gone

# ---- CPU budgets ---------------------------------------------------------------------------

# The period of a host's CPU budget: a throttled host waits at most one period to run again, and
# its threads with it (a rank's communication thread woken while its compute has spent the
# period's quota waits out the period: at 10 ms that stalled each pipeline hop by milliseconds).
# So the period is the shortest the kernel allows for the budget, whose quota may not go below
# 1 ms: 1 ms / cores, at least CPU_PERIOD_MIN_US (2.5 ms at 0.4 cores, 1.25 ms at 0.8).
CPU_PERIOD_MIN_US = 1000
CPU_QUOTA_MIN_US = 1000
# cpu="auto": the hosts share this fraction of the machine's cores; the rest is left to the
# emulated network (the kernel's packet work, tbf, the user-space switch), which would otherwise
# take its time from whichever host is running and make every host's step erratic.
AUTO_CPU_SHARE = 0.8


def _cgroup_root():
    """(version, directory under which a cpu-limited cgroup can be made) or (None, reason)."""
    v2 = "/sys/fs/cgroup"
    try:
        with open(os.path.join(v2, "cgroup.controllers")) as f:
            if "cpu" in f.read().split():
                with open(os.path.join(v2, "cgroup.subtree_control")) as f:
                    if "cpu" not in f.read().split():
                        return None, "cgroup v2 has the cpu controller but does not delegate it (cgroup.subtree_control)"
                return 2, v2
    except OSError:
        pass
    v1 = "/sys/fs/cgroup/cpu"
    if os.path.exists(os.path.join(v1, "cpu.cfs_quota_us")):
        return 1, v1
    return None, "no cgroup cpu controller (neither cgroup v2's cpu.max nor v1's cpu.cfs_quota_us)"


def _cgroup_make(path, version, cores):
    """Creates cgroup path limited to `cores` CPUs (a float); raises NetclusterError."""
    period = max(CPU_PERIOD_MIN_US, int(math.ceil(CPU_QUOTA_MIN_US / cores)))
    quota = max(CPU_QUOTA_MIN_US, int(round(cores * period)))
    try:
        os.mkdir(path)
        if version == 2:
            with open(os.path.join(path, "cpu.max"), "w") as f:
                f.write("%d %d" % (quota, period))
        else:
            with open(os.path.join(path, "cpu.cfs_period_us"), "w") as f:
                f.write(str(period))
            with open(os.path.join(path, "cpu.cfs_quota_us"), "w") as f:
                f.write(str(quota))
    except OSError as e:
        raise NetclusterError("cannot make a cpu-limited cgroup %s: %s" % (path, e))


def _cgroup_remove(path, deadline_s=5.0):
    """Removes cgroup path once the processes in it are gone (they were killed with the namespaces)."""
    end = time.monotonic() + deadline_s
    while os.path.isdir(path):
        try:
            os.rmdir(path)
        except OSError:
            if time.monotonic() > end:
                return False
            time.sleep(0.01)
    return True


def cpu_limit(path):
    """The cores a cgroup directory made here allows (quota / period), for tests and reports."""
    if os.path.exists(os.path.join(path, "cpu.max")):
        with open(os.path.join(path, "cpu.max")) as f:
            q, per = f.read().split()
        return None if q == "max" else int(q) / int(per)
    with open(os.path.join(path, "cpu.cfs_quota_us")) as f:
        q = int(f.read())
    with open(os.path.join(path, "cpu.cfs_period_us")) as f:
        per = int(f.read())
    return None if q < 0 else q / per


def _stale_cgroups():
    version, root = _cgroup_root()
    if version is None:
        return []
    try:
        names = os.listdir(root)
    except OSError:
        return []
    matches = [(n, NAME_RE.match(n)) for n in names]
    return [os.path.join(root, n) for n, m in matches if m and not _pid_alive(int(m.group(1)))]


def netdelay_path():
    """The user-space delaying switch (test/tools/netdelay.c, built by make), or None."""
    d = os.environ.get("MESHRUN_BUILD") or os.path.join(REPO, "build")
    path = os.path.join(os.path.abspath(d), "tools", "netdelay")
    return path if os.access(path, os.X_OK) else None


def can_create():
    """(True, "") when this process can make namespaces, veth links, a bridge and tbf qdiscs;
    else (False, reason). It tries for real, in a scratch namespace it deletes again."""
    if os.name != "posix" or not sys.platform.startswith("linux"):
        return False, "network namespaces need Linux (this is %s)" % sys.platform
    for tool in ("ip", "tc"):
        if not shutil.which(tool):
            return False, "no `%s` command (iproute2) on PATH" % tool
    if os.geteuid() != 0:
        return False, "not root (euid %d): `ip netns add` needs CAP_SYS_ADMIN" % os.geteuid()
    ns = "nc%d-%s-probe" % (os.getpid(), secrets.token_hex(3))
    try:
        _sh(["ip", "netns", "add", ns])
        _sh(["ip", "-n", ns, "link", "add", "br0", "type", "bridge"])
        _sh(["ip", "-n", ns, "link", "add", "p0", "type", "veth", "peer", "name", "q0"])
        _sh(["tc", "-n", ns, "qdisc", "add", "dev", "p0", "root", "tbf", "rate", "1gbit", "burst", "64kb",
             "latency", "10ms"])
    except NetclusterError as e:
        return False, "cannot build an emulated network here: %s" % e
    finally:
        _sh(["ip", "netns", "del", ns], check=False)
    return True, ""


# ---- the cluster ---------------------------------------------------------------------------

# Small programs run inside namespaces (python -c): the rendezvous port probe, the UDP echo and the
# TCP sink used to measure RTT and throughput. Each prints one line for the caller to read.
_FREE_PORT = "import socket,sys;s=socket.socket();s.bind((sys.argv[1],0));print(s.getsockname()[1])"
_UDP_ECHO = r"""
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind((sys.argv[1], 0)); s.settimeout(30)
print(s.getsockname()[1], flush=True)
for _ in range(int(sys.argv[2])):
    d, a = s.recvfrom(2048); s.sendto(d, a)
"""
_UDP_PING = r"""
import json, socket, sys, time
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.settimeout(5)
dst = (sys.argv[1], int(sys.argv[2])); out = []
for i in range(int(sys.argv[3])):
    t = time.perf_counter(); s.sendto(b"%08d" % i, dst); s.recvfrom(2048); out.append(time.perf_counter() - t)
print(json.dumps(out))
"""
_TCP_SINK = r"""
import json, socket, sys, time
l = socket.socket(); l.bind((sys.argv[1], 0)); l.listen(1); l.settimeout(30)
print(l.getsockname()[1], flush=True)
c, _ = l.accept(); c.settimeout(30); n = 0; t0 = None
buf = bytearray(1 << 20)
while True:
    k = c.recv_into(buf)
    if not k: break
    if t0 is None: t0 = time.perf_counter()
    n += k
print(json.dumps({"bytes": n, "s": time.perf_counter() - t0}))
"""
_TCP_SOURCE = r"""
import socket, sys
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=30)
chunk = b"\0" * (1 << 20); left = int(sys.argv[3])
while left > 0:
    c.sendall(chunk[:min(left, len(chunk))]); left -= len(chunk)
c.close()
"""


class Cluster:
    """n_hosts emulated hosts on one switch; rate (tc units, e.g. "2gbit") and one-way delay
    ("200us") per link, None for no shaping of that kind. A context manager: entering builds
    the network, leaving (also on an exception) tears it down."""

    def __init__(self, n_hosts, rate="2gbit", delay="200us", prefix=None, cpu=None):
        if n_hosts < 1 or n_hosts > 200:
            raise NetclusterError("n_hosts %d: expected 1 to 200" % n_hosts)
        self.cpu = parse_cpu(cpu, n_hosts)
        self._cgroups = []
        self.n = n_hosts
        self.rate = None if _off(rate) else rate
        self.delay = None if _off(delay) else delay
        self.rate_bps = parse_rate(rate) if self.rate else None
        self.delay_s = parse_time(delay) if self.delay else 0.0
        self.prefix = prefix or "nc%d-%s" % (os.getpid(), secrets.token_hex(3))
        self.subnet = "10.211.%d" % random.randint(1, 254)
        self.delay_applied = False
        self.shaping = "none"
        self._namespaces = []
        self._procs = []
        self._up = False
        self._lock = threading.Lock()

    # names and addresses
    def ns(self, i):
        return "%s-h%d" % (self.prefix, i)

    @property
    def switch(self):
        return "%s-sw" % self.prefix

    def addr(self, i):
        if not 0 <= i < self.n:
            raise IndexError("host %d of %d" % (i, self.n))
        return "%s.%d" % (self.subnet, i + 1)

    def namespaces(self):
        return list(self._namespaces)

    # lifetime
    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def start(self):
        if self._up:
            return self
        sweep_stale()
        self._up = True
        atexit.register(self.close)
        self._trap_signals()
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def _trap_signals(self):
        """SIGTERM and SIGHUP would end Python without finally blocks or atexit; while any
        cluster is up they raise SystemExit instead (only where they had the default action,
        and only from the main thread, where Python delivers signals). The first cluster up
        installs the handlers, the last one down restores them."""
        if threading.current_thread() is not threading.main_thread():
            return
        if not _trapped["clusters"]:
            for sig in (signal.SIGTERM, signal.SIGHUP):
                if signal.getsignal(sig) == signal.SIG_DFL:
                    _trapped["old"][sig] = signal.signal(sig, _raise_exit)
        _trapped["clusters"].add(id(self))

    def _untrap_signals(self):
        _trapped["clusters"].discard(id(self))
        if _trapped["clusters"] or threading.current_thread() is not threading.main_thread():
            return
        for sig, old in _trapped["old"].items():
            signal.signal(sig, old)
        _trapped["old"] = {}

    def _netns_add(self, name):
        _sh(["ip", "netns", "add", name])
        self._namespaces.append(name)
        _sh(["ip", "-n", name, "link", "set", "lo", "up"])

    def _build(self):
        sw = self.switch
        self._netns_add(sw)
        _sh(["ip", "-n", sw, "link", "add", "br0", "type", "bridge"])
        _sh(["ip", "-n", sw, "link", "set", "br0", "up"])
        for i in range(self.n):
            h = self.ns(i)
            self._netns_add(h)
            # Made in the switch's namespace, the peer end moved straight into the host's: the
            # root namespace never holds either end.
            _sh(["ip", "-n", sw, "link", "add", "p%d" % i, "type", "veth", "peer", "name", "eth0", "netns", h])
            _sh(["ip", "-n", sw, "link", "set", "p%d" % i, "master", "br0"])
            _sh(["ip", "-n", sw, "link", "set", "p%d" % i, "up"])
            _sh(["ip", "-n", h, "addr", "add", "%s/24" % self.addr(i), "dev", "eth0"])
            _sh(["ip", "-n", h, "link", "set", "eth0", "up"])
        self._shape()
        if self.cpu is not None:
            version, root = _cgroup_root()
            if version is None:
                raise NetclusterError("cpu=%g per host: %s" % (self.cpu, root))
            for i in range(self.n):
                path = os.path.join(root, "%s-h%d" % (self.prefix, i))
                _cgroup_make(path, version, self.cpu)
                self._cgroups.append(path)
        # Links come up asynchronously (and a bridge port starts forwarding only once the port
        # is up): poll until every host answers the first one.
        self._wait_reachable()

    def _tbf(self, ns, dev, handle):
        """tbf at self.rate on dev's egress. burst: at least two 64 KiB GSO packets, so tbf
        never has to split them, and about 100 us of the rate; the queue holds up to 20 ms."""
        burst = max(128 * 1024, int(self.rate_bps / 8 * 100e-6))
        _sh(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", handle, "tbf", "rate", self.rate,
             "burst", str(burst), "latency", "20ms"])

    def _shape(self):
        parts = []
        netem_error = None
        for i in range(self.n):
            h = self.ns(i)
            if self.rate:
                self._tbf(h, "eth0", "1:")
                self._tbf(self.switch, "p%d" % i, "1:")
            if self.delay and self.delay_s > 0 and netem_error is None:
                parent = ["parent", "1:1"] if self.rate else ["root"]
                p = _sh(["tc", "-n", h, "qdisc", "add", "dev", "eth0"] + parent +
                        ["handle", "10:", "netem", "delay", self.delay, "limit", "100000"], check=False)
                if p.returncode != 0:
                    netem_error = p.stderr.strip() or "exit %d" % p.returncode
                    if i > 0:  # some hosts delayed, others not: no consistent network to offer
                        raise NetclusterError("netem on host %d failed after host 0's worked: %s" % (i, netem_error))
        if self.rate:
            parts.append("tbf rate %s each way on every link" % self.rate)
        if self.delay and self.delay_s > 0:
            if netem_error is None:
                self.delay_applied = True
                parts.append("netem delay %s one way (host egress)" % self.delay)
            else:
                tool = netdelay_path()
                if tool:
                    self._start_netdelay(tool)
                    self.delay_applied = True
                    parts.append("delay %s one way in a user-space switch (%s; no netem in this kernel: %s)" %
                                 (self.delay, os.path.relpath(tool, REPO), netem_error))
                else:
                    parts.append("NO delay: netem unavailable (%s) and no netdelay tool built (make)" % netem_error)
        self.shaping = "; ".join(parts) or "none"

    def _start_netdelay(self, tool):
        """The switch becomes test/tools/netdelay: the ports leave the kernel bridge (else frames
        would cross twice) and the tool forwards between them, holding each frame for the delay."""
        sw = self.switch
        for i in range(self.n):
            _sh(["ip", "-n", sw, "link", "set", "p%d" % i, "nomaster"])
        argv = ["ip", "netns", "exec", sw, tool, "%g" % (self.delay_s * 1e6)] + ["p%d" % i for i in range(self.n)]
        p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        self._procs.append(p)
        line = p.stdout.readline()  # "ready" once every port is bound, or EOF if it failed
        if line.strip() != b"ready":
            p.kill()
            raise NetclusterError("netdelay did not start: %s" % p.communicate()[1].decode(errors="replace").strip())

    def _wait_reachable(self, timeout=20):
        if self.n < 2:
            return
        end = time.monotonic() + timeout
        for j in range(1, self.n):
            while True:
                try:
                    self.rtt(0, j, count=1, timeout=2)
                    break
                except (NetclusterError, subprocess.TimeoutExpired):
                    if time.monotonic() > end:
                        raise NetclusterError("host %d (%s) did not answer host 0 within %ds" % (j, self.addr(j), timeout))
                    time.sleep(0.02)

    def close(self):
        """Kills what runs in the cluster and deletes its namespaces. Idempotent."""
        with self._lock:
            if not self._up:
                return
            self._up = False
        for p in self._procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    try:
                        p.kill()
                    except ProcessLookupError:
                        pass
        for p in self._procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for ns in reversed(self._namespaces):
            _kill_netns(ns)
        left = set(list_netns()) & set(self._namespaces)
        left |= {cg for cg in self._cgroups if not _cgroup_remove(cg)}
        self._namespaces = []
        self._cgroups = []
        self._untrap_signals()
        try:
            atexit.unregister(self.close)
        except Exception:
            pass
        if left:
            raise NetclusterError("namespaces or cgroups still present after teardown: %s" % ", ".join(sorted(left)))

    # processes
    def exec_argv(self, i, argv):
        """argv run in host i's namespace and, with a cpu budget, its cgroup (the shell enters
        it, then execs: every process started from there inherits it)."""
        cmd = ["ip", "netns", "exec", self.ns(i)] + list(argv)
        if self._cgroups:
            cmd = ["/bin/sh", "-c", 'echo $$ > "$0" && exec "$@"', os.path.join(self._cgroups[i], "cgroup.procs")] + cmd
        return cmd

    def cgroup(self, i):
        """Host i's cgroup directory, or None without a cpu budget."""
        return self._cgroups[i] if self._cgroups else None

    def run(self, i, argv, **popen_kwargs):
        """subprocess.Popen of argv inside host i's namespace, in a session of its own (unless
        start_new_session is given), killed with its session at close()."""
        if not self._up:
            raise NetclusterError("cluster is not up")
        popen_kwargs.setdefault("start_new_session", True)
        p = subprocess.Popen(self.exec_argv(i, argv), **popen_kwargs)
        self._procs.append(p)
        return p

    def _py(self, i, code, *args, timeout=30):
        return subprocess.run(self.exec_argv(i, [PYTHON, "-c", code] + [str(a) for a in args]),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=timeout)

    def free_port(self, i):
        """A TCP port the kernel just handed out on host i's address (free at that moment)."""
        p = self._py(i, _FREE_PORT, self.addr(i))
        if p.returncode != 0:
            raise NetclusterError("free port on host %d: %s" % (i, p.stderr.strip()))
        return int(p.stdout.strip())

    def _server(self, j, code, *args):
        """Starts a measuring server on host j; returns (Popen, port) once it printed its port."""
        srv = self.run(j, [PYTHON, "-c", code, self.addr(j)] + [str(a) for a in args],
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = srv.stdout.readline()  # blocks until the server is bound, or it died
        if not line.strip().isdigit():
            srv.kill()
            raise NetclusterError("server on host %d failed: %s" % (j, srv.stderr.read().strip()))
        return srv, int(line)

    def rtt(self, i, j, count=50, timeout=30):
        """count UDP round trips host i -> host j -> host i; returns the list of seconds."""
        srv, port = self._server(j, _UDP_ECHO, count)
        try:
            p = self._py(i, _UDP_PING, self.addr(j), port, count, timeout=timeout)
            if p.returncode != 0:
                raise NetclusterError("ping host %d -> %d: %s" % (i, j, p.stderr.strip()))
            return json.loads(p.stdout)
        finally:
            if srv.poll() is None:
                srv.kill()
            srv.communicate()

    def throughput(self, i, j, nbytes=32 << 20, timeout=60):
        """Bits per second of one TCP stream host i -> host j moving nbytes, timed at the receiver
        from its first byte to the sender's close."""
        srv, port = self._server(j, _TCP_SINK)
        try:
            p = self._py(i, _TCP_SOURCE, self.addr(j), port, nbytes, timeout=timeout)
            if p.returncode != 0:
                raise NetclusterError("stream host %d -> %d: %s" % (i, j, p.stderr.strip()))
            out, err = srv.communicate(timeout=timeout)
            r = json.loads(out)
            return r["bytes"] * 8 / r["s"]
        finally:
            if srv.poll() is None:
                srv.kill()
                srv.communicate()

    def link_bytes(self, i):
        """(tx, rx) bytes host i's eth0 has moved so far: what crossed the emulated link."""
        p = _sh(["ip", "-n", self.ns(i), "-j", "-s", "link", "show", "dev", "eth0"])
        st = json.loads(p.stdout)[0]["stats64"]
        return st["tx"]["bytes"], st["rx"]["bytes"]

    def describe(self):
        cpu = "; %g cores per host (cgroup)" % self.cpu if self.cpu is not None else ""
        return "%d hosts %s.1-%d on one switch; %s%s" % (self.n, self.subnet, self.n, self.shaping, cpu)


_trapped = {"clusters": set(), "old": {}}


def _raise_exit(sig, frame):
    raise SystemExit(128 + sig)


# ---- meshrun on the cluster ----------------------------------------------------------------

def meshrun_path():
    d = os.environ.get("MESHRUN_BIN") or os.path.join(REPO, "bin")
    return os.path.join(os.path.abspath(d), "meshrun")


def start_meshrun(cluster, args, meshrun=None, env=None, rdzv_id=None, nnodes=None, node_args=None, hosts=None,
                  endpoint=None, node_env=None, **popen_kwargs):
    """One meshrun per host: --nnodes=N --node_rank=i --rdzv_endpoint=<host 0>:<free port>, then
    args. Every node gets MESHRUN_COMM_HOST = its host's address and one job secret (a fresh
    random MESHRUN_RDZV_TOKEN unless env or the environment has one). nnodes: the --nnodes value
    when not the number of nodes, e.g. "2:4" for an elastic job; node_args(i): meshrun flags for
    node i alone, put before args; node_env(i): environment entries for node i alone (a fault);
    hosts: how many hosts run a node (hosts 0..hosts-1; default all, others may serve something
    else, such as etcd); endpoint: the --rdzv_endpoint value instead of host 0's (etcd's
    members). Returns the Popens."""
    meshrun = meshrun or meshrun_path()
    hosts = cluster.n if hosts is None else hosts
    endpoint = endpoint or "%s:%d" % (cluster.addr(0), cluster.free_port(0))
    base = dict(os.environ)
    if env:
        base.update(env)
    base.setdefault("MESHRUN_RDZV_TOKEN", secrets.token_hex(16))
    rdzv_id = rdzv_id or cluster.prefix
    procs = []
    for i in range(hosts):
        e = dict(base, MESHRUN_COMM_HOST=cluster.addr(i))
        e.update(node_env(i) if node_env else {})
        argv = [meshrun, "--nnodes=%s" % (nnodes or hosts), "--node_rank=%d" % i,
                "--rdzv_endpoint=%s" % endpoint, "--rdzv_id=%s" % rdzv_id]
        argv += list(node_args(i) if node_args else []) + list(args)
        procs.append(cluster.run(i, argv, env=e, **popen_kwargs))
    return procs


def read_metrics(path):
    """The records of a trainer metrics JSONL file (log.metrics_file)."""
    with open(path) as f:
        return [json.loads(l) for l in f if l.strip()]


def wait_all(procs, timeout=None):
    """Polls until every process has exited or timeout seconds pass; returns the exit codes
    (None for one still running at the deadline)."""
    end = None if timeout is None else time.monotonic() + timeout
    delay = 0.005
    while any(p.poll() is None for p in procs):
        if end is not None and time.monotonic() > end:
            break
        time.sleep(delay)
        delay = min(delay * 2, 0.1)
    return [p.poll() for p in procs]


# ---- CLI -----------------------------------------------------------------------------------

def measure(c, out=sys.stdout):
    """Prints the RTT host 0 <-> 1 (median of 100 UDP round trips) and one stream's throughput."""
    rtts = sorted(c.rtt(0, 1, count=100))
    med = statistics.median(rtts)
    expect = 2 * c.delay_s if c.delay_applied else 0.0
    print("rtt host0<->host1: median %.0f us, min %.0f us, p90 %.0f us (configured 2 x delay = %.0f us%s)" %
          (med * 1e6, rtts[0] * 1e6, rtts[int(len(rtts) * 0.9)] * 1e6, 2 * c.delay_s * 1e6,
           "" if c.delay_applied else ", not applied"), file=out)
    bps = c.throughput(0, 1)
    print("throughput host0->host1: %s (configured %s)" % (fmt_rate(bps), c.rate or "unshaped"), file=out)
    return med, expect, bps


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    rest = []
    if "--" in argv:
        k = argv.index("--")
        argv, rest = argv[:k], argv[k + 1:]
    ap = argparse.ArgumentParser(prog="netcluster.py", description=__doc__.split("\n\n")[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("check", help="can network namespaces be made here? exit 0 yes, 1 no (with the reason)")
    sub.add_parser("clean", help="delete namespaces left by netcluster runs whose process died")
    for name in ("run", "measure"):
        p = sub.add_parser(name)
        p.add_argument("--hosts", type=int, default=2)
        p.add_argument("--rate", default="2gbit", help="per link, tc units (default 2gbit); 0 for none")
        p.add_argument("--delay", default="200us", help="one way, tc units (default 200us); 0 for none")
        p.add_argument("--cpu", default=None, help="cores per host (a cgroup budget), auto: 80%% of the machine's split evenly, or none")
        if name == "run":
            p.add_argument("--meshrun", default=None, help="meshrun binary (default $MESHRUN_BIN/meshrun, else bin/)")
            p.add_argument("--timeout", type=float, default=None, help="kill the job after this many seconds")
    a = ap.parse_args(argv)

    if a.cmd == "check":
        ok, why = can_create()
        print("netcluster: namespaces can be made here" if ok else "netcluster: cannot: %s" % why)
        return 0 if ok else 1
    if a.cmd == "clean":
        for ns in sweep_stale():
            print("deleted", ns)
        return 0
    ok, why = can_create()
    if not ok:
        print("netcluster: cannot: %s" % why, file=sys.stderr)
        return 1
    if a.cmd == "run" and not rest:
        ap.error("run: give the meshrun arguments after --")
    # SIGINT is KeyboardInterrupt already; Cluster turns TERM/HUP into SystemExit: either way the
    # with block's exit tears everything down.
    try:
        parse_cpu(a.cpu, a.hosts)
    except NetclusterError as e:
        ap.error("--%s" % e)
    with Cluster(a.hosts, rate=a.rate, delay=a.delay, cpu=a.cpu) as c:
        print("netcluster: %s" % c.describe(), file=sys.stderr)
        if c.delay and not c.delay_applied:
            print("netcluster: warning: delay %s was not applied (no netem in this kernel)" % c.delay, file=sys.stderr)
        if a.cmd == "measure":
            measure(c)
            return 0
        procs = start_meshrun(c, rest, meshrun=a.meshrun)
        codes = wait_all(procs, a.timeout)
        for i, rc in enumerate(codes):
            print("netcluster: node %d (%s): %s" % (i, c.addr(i), "exit %d" % rc if rc is not None else "timed out"),
                  file=sys.stderr)
        return 0 if all(rc == 0 for rc in codes) else 1


if __name__ == "__main__":
    sys.exit(main())
