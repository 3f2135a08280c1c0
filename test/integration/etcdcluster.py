"""etcdcluster: a real etcd cluster inside the emulated hosts of test/support/netcluster.py, for tests.

    with EtcdCluster(c, [0, 1, 2], tmp_path) as e:   # one member per host index, started
        e.wait_ready(20)                               # every live member serves linearizable reads
        meshrun ... --rdzv_endpoint=e.endpoints()      # "10.211.X.1:p1,10.211.X.2:p2,10.211.X.3:p3"
        e.put("k", "v", 0); e.get("k", 2) == b"v"; e.kill(1)

Each member is Debian's /usr/bin/etcd (etcd-server, 3.4) started with c.run in its host's network
namespace, listening for clients and peers on that host's address (c.addr(i)) at two ports free
there (c.free_port), its data in TMPDIR/etcd-h<i>.data and its stdout and stderr in
TMPDIR/etcd-h<i>.log (every error names the log and quotes its last lines). The members are
named h<i> after their host and all know each other from the start (--initial-cluster), under a
token unique to this cluster, with the heartbeat and election timeout given (100 ms and 1 s by
default, etcd's own defaults, written out so a test states what it relies on).

Members are addressed by host index everywhere (kill(1) kills the member on host 1). The root
namespace cannot reach the hosts' addresses, so every request (readiness, put, get, lease grant)
is a short Python program run inside a host's namespace (c.exec_argv) that speaks etcd's v3
JSON gateway (keys and values base64, 64-bit numbers as strings) with the header
Grpc-Metadata-hasleader: true, so that a member without a leader refuses at once instead of
holding the request for its 7 s request timeout. Proxy variables are ignored there and removed
from etcd's environment (Go would send peer traffic to a proxy the namespaces cannot reach), as
are ETCD_* variables (etcd reads them as flags).

Teardown: close() (also leaving the `with` block, and idempotent) SIGKILLs every member and reaps
it; the cluster's own close() does the same, since the members are c.run processes (sessions of
their own, killed with their session, then waited for). Nothing under TMPDIR is removed: the logs
and data directories stay for diagnosis (pytest's tmp_path removes them in its own time).
Every wait polls with a deadline. Python 3 standard library only; no pytest here (the test
decides to skip, see available()).
"""
import base64
import json
import os
import secrets
import signal
import subprocess
import sys
import time

ETCD = "/usr/bin/etcd"
PYTHON = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable
PROBE_KEY = "etcdcluster/ready-probe"


class EtcdError(Exception):
    pass


def available():
    """(True, version line) when /usr/bin/etcd runs here, else (False, reason)."""
    if not os.access(ETCD, os.X_OK):
        return False, "%s not found (Debian package etcd-server)" % ETCD
    try:
        p = subprocess.run([ETCD, "--version"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           timeout=10)
    except (OSError, subprocess.TimeoutExpired) as e:
        return False, "%s --version: %s" % (ETCD, e)
    if p.returncode != 0:
        return False, "%s --version: exit %d: %s" % (ETCD, p.returncode, p.stdout.strip())
    return True, p.stdout.splitlines()[0] if p.stdout else "etcd"


def b64(s):
    return base64.b64encode(s.encode() if isinstance(s, str) else bytes(s)).decode()


# Run inside a host's namespace: POSTs argv[3] (JSON) to argv[1] + argv[2], each attempt bounded
# by argv[4] seconds; with argv[5] > 0 retries (connection refused, no leader, timeout) until a
# 200 or argv[5] seconds have passed. Prints one JSON line: status (None: no HTTP answer), body
# or error, tries, and the seconds taken.
_CALL = r"""
import json, sys, time, urllib.error, urllib.request
url, body, attempt_s, poll_s = sys.argv[1] + sys.argv[2], sys.argv[3].encode(), float(sys.argv[4]), float(sys.argv[5])
opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
hdrs = {"Content-Type": "application/json", "Grpc-Metadata-hasleader": "true"}
t0 = time.monotonic(); end = t0 + poll_s; tries = 0; delay = 0.01
while True:
    tries += 1
    out = {"status": None}
    try:
        with opener.open(urllib.request.Request(url, data=body, headers=hdrs), timeout=attempt_s) as r:
            out = {"status": r.status, "body": r.read().decode(errors="replace")}
    except urllib.error.HTTPError as e:
        out = {"status": e.code, "body": e.read().decode(errors="replace")}
    except Exception as e:
        out["error"] = "%s: %s" % (type(e).__name__, e)
    if out["status"] == 200 or time.monotonic() + delay > end:
        break
    time.sleep(delay); delay = min(2 * delay, 0.1)
out.update(tries=tries, seconds=time.monotonic() - t0)
print(json.dumps(out))
"""


class EtcdCluster:
    """One etcd member per host index in hosts, on cluster c (a started netcluster Cluster); data
    and logs under tmpdir. Started on construction; wait_ready() says when it serves."""

    def __init__(self, c, hosts, tmpdir, heartbeat_ms=100, election_ms=1000):
        if not hosts or len(set(hosts)) != len(hosts):
            raise EtcdError("hosts %r: expected distinct host indexes, at least one" % (hosts,))
        self.c = c
        self.hosts = list(hosts)
        self.tmpdir = str(tmpdir)
        self.heartbeat_ms, self.election_ms = heartbeat_ms, election_ms
        self.token = "%s-etcd-%s" % (c.prefix, secrets.token_hex(4))
        self.client_port, self.peer_port, self.procs = {}, {}, {}
        for i in self.hosts:
            c.addr(i)  # IndexError for a host the cluster does not have
            if os.path.exists(self.data_dir(i)):  # etcd would restart that old member, not join this cluster
                raise EtcdError("%s exists: give each EtcdCluster a fresh tmpdir" % self.data_dir(i))
            self.client_port[i], self.peer_port[i] = self._two_ports(i)
        initial = ",".join("h%d=%s" % (i, self.peer_url(i)) for i in self.hosts)
        env = {k: v for k, v in os.environ.items()
               if not k.startswith("ETCD_") and k.lower() not in ("http_proxy", "https_proxy", "all_proxy", "no_proxy")}
        try:
            for i in self.hosts:
                argv = [ETCD, "--name", "h%d" % i, "--data-dir", self.data_dir(i),
                        "--listen-client-urls", self.client_url(i), "--advertise-client-urls", self.client_url(i),
                        "--listen-peer-urls", self.peer_url(i), "--initial-advertise-peer-urls", self.peer_url(i),
                        "--initial-cluster", initial, "--initial-cluster-state", "new",
                        "--initial-cluster-token", self.token,
                        "--heartbeat-interval", str(heartbeat_ms), "--election-timeout", str(election_ms)]
                with open(self.log_path(i), "wb") as log:  # the child keeps its own descriptor
                    self.procs[i] = c.run(i, argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                          env=env)
        except BaseException:
            self.close()
            raise

    def _two_ports(self, i, tries=20):
        """A client and a peer port free on host i; free_port probes one at a time, so the
        kernel may hand out the same port twice: ask again until they differ."""
        a = self.c.free_port(i)
        for _ in range(tries):
            b = self.c.free_port(i)
            if b != a:
                return a, b
        raise EtcdError("host %d: free_port returned %d %d times" % (i, a, tries))

    # ---- names and places
    def client_url(self, i):
        return "http://%s:%d" % (self.c.addr(i), self.client_port[i])

    def peer_url(self, i):
        return "http://%s:%d" % (self.c.addr(i), self.peer_port[i])

    def data_dir(self, i):
        return os.path.join(self.tmpdir, "etcd-h%d.data" % i)

    def log_path(self, i):
        return os.path.join(self.tmpdir, "etcd-h%d.log" % i)

    def endpoints(self, hosts=None):
        """"addr:port,..." of the members (all, or those of hosts), as --rdzv_endpoint takes them."""
        return ",".join("%s:%d" % (self.c.addr(i), self.client_port[i]) for i in (hosts or self.hosts))

    def log_tail(self, i, lines=15):
        try:
            with open(self.log_path(i), errors="replace") as f:
                tail = f.read().splitlines()[-lines:]
        except OSError as e:
            return "(no log %s: %s)" % (self.log_path(i), e)
        return "--- last %d lines of %s:\n%s" % (len(tail), self.log_path(i), "\n".join(tail))

    # ---- lifetime
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def alive(self, i):
        p = self.procs.get(i)
        return p is not None and p.poll() is None

    def live(self):
        return [i for i in self.hosts if self.alive(i)]

    def kill(self, i, timeout=10):
        """SIGKILLs the member on host i and waits until it is reaped."""
        p = self.procs[i]
        if p.poll() is None:
            try:
                os.kill(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise EtcdError("etcd member h%d (pid %d) not reaped %gs after SIGKILL" % (i, p.pid, timeout))

    def close(self):
        """Kills and reaps every member; keeps tmpdir. Idempotent."""
        for p in self.procs.values():
            if p.poll() is None:
                try:
                    os.kill(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for p in self.procs.values():
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass

    # ---- requests
    def _exited(self):
        """An EtcdError for the first member that exited on its own, or None."""
        for i, p in self.procs.items():
            rc = p.poll()
            if rc is not None and rc != -signal.SIGKILL:
                return EtcdError("etcd member h%d exited with status %d\n%s" % (i, rc, self.log_tail(i)))
        return None

    def _raw(self, via_host, member, path, body, attempt_s, poll_s=0.0):
        argv = self.c.exec_argv(via_host, [PYTHON, "-c", _CALL, self.client_url(member), path, json.dumps(body),
                                           "%g" % attempt_s, "%g" % poll_s])
        try:
            p = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, timeout=poll_s + attempt_s + 10)
        except subprocess.TimeoutExpired:
            return {"status": None, "error": "the request program in host %d's namespace hung" % via_host}
        if p.returncode != 0:
            return {"status": None, "error": "request program exit %d: %s" % (p.returncode, p.stderr.strip())}
        return json.loads(p.stdout)

    def call(self, path, body, via_host, member=None, timeout=5.0):
        """POSTs body (a dict) to member's client URL + path (e.g. /v3/kv/put) from inside host
        via_host's namespace, one attempt bounded by timeout seconds; member defaults to via_host's
        own. Returns the decoded JSON reply, or raises EtcdError naming the member, its answer and
        its log."""
        member = via_host if member is None else member
        if member not in self.procs:
            raise EtcdError("host %d runs no etcd member (members on hosts %s)" % (member, self.hosts))
        r = self._raw(via_host, member, path, body, timeout)
        if r["status"] == 200:
            return json.loads(r["body"])
        what = r.get("error") or "HTTP %s: %s" % (r["status"], r.get("body", "").strip())
        raise EtcdError("etcd %s via host %d -> member h%d (%s, %s): %s\n%s" %
                        (path, via_host, member, self.client_url(member),
                         "running" if self.alive(member) else "not running", what, self.log_tail(member, 5)))

    def put(self, key, value, via_host, member=None, timeout=5.0):
        """Writes key = value (str or bytes); returns the revision."""
        r = self.call("/v3/kv/put", {"key": b64(key), "value": b64(value)}, via_host, member, timeout)
        return int(r["header"]["revision"])

    def get(self, key, via_host, member=None, timeout=5.0):
        """The value of key (bytes) by a linearizable read, or None where it is absent."""
        r = self.call("/v3/kv/range", {"key": b64(key)}, via_host, member, timeout)
        kvs = r.get("kvs") or []
        return base64.b64decode(kvs[0].get("value", "")) if kvs else None

    def lease_grant(self, ttl, via_host, member=None, timeout=5.0):
        """(lease id, TTL etcd granted) for a lease asked with ttl seconds: etcd raises a TTL below
        its minimum (about 1.5 x election timeout, rounded up to whole seconds) to that minimum."""
        r = self.call("/v3/lease/grant", {"TTL": ttl}, via_host, member, timeout)
        return int(r["ID"]), int(r["TTL"])

    def leader(self, timeout=5.0):
        """The host index of the member the live members report as leader, or None."""
        for i in self.live():
            try:
                s = self.call("/v3/maintenance/status", {}, i, timeout=timeout)
            except EtcdError:
                continue
            if s.get("header", {}).get("member_id") == s.get("leader"):
                return i
        return None

    def wait_ready(self, timeout=20.0):
        """Polls, each live member from inside its own host, until every one answers a
        linearizable read (so has a leader and a quorum behind it) or timeout seconds have
        passed; returns the seconds it took. Raises EtcdError, quoting the member's log, when one
        is not ready by then or one exited on its own."""
        t0 = time.monotonic()
        end = t0 + timeout
        for i in self.live():
            while True:
                err = self._exited()
                if err:
                    raise err
                left = end - time.monotonic()
                # Polled in slices of at most 2 s so that a member dying meanwhile is noticed.
                r = self._raw(i, i, "/v3/kv/range", {"key": b64(PROBE_KEY)}, min(1.0, max(left, 0.1)),
                              min(2.0, max(left, 0.0)))
                if r["status"] == 200:
                    break
                if time.monotonic() >= end:
                    what = r.get("error") or "HTTP %s: %s" % (r["status"], r.get("body", "").strip())
                    raise EtcdError("etcd member h%d (%s) not ready within %gs: %s\n%s" %
                                    (i, self.client_url(i), timeout, what, self.log_tail(i)))
        return time.monotonic() - t0
