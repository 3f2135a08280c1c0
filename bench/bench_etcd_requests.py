#!/usr/bin/env python3
"""etcd's own CPU per request, through its JSON gateway and through gRPC, side by side.

What bounds an etcd rendezvous of many nodes on a small machine is etcd's CPU per request, so
this measures it: one etcd member on loopback (started as bench_launcher.py starts it), P
clients in parallel, each sending N Range requests for one key over one kept connection; the
etcd process's CPU (utime + stime from /proc) over the batch, divided by the requests.

  gateway   POST /v3/kv/range with a JSON body (what meshrun sends), Python's http.client
  grpc      /etcdserverpb.KV/Range over HTTP/2 with a protobuf body, nghttp2's `nghttp`
            (Debian's nghttp2-client; the row is skipped when it is not installed)

Prints microseconds of etcd CPU per request for each, and the ratio gateway/grpc. The clients
share the machine with etcd, so run it on an otherwise idle machine. --clients P (8),
--requests N (1000 per client), --reps R (3, the median is printed).
"""
import argparse
import base64
import importlib.util
import multiprocessing
import os
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import time
import http.client

HERE = os.path.dirname(os.path.abspath(__file__))
spec = importlib.util.spec_from_file_location("bench_launcher", os.path.join(HERE, "bench_launcher.py"))
bench_launcher = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench_launcher)

KEY_B64 = "aw=="          # "k"
GRPC_RANGE = b"\x0a\x01k"  # RangeRequest{key: "k"}: field 1, length-delimited


def cpu_seconds(pid):
    fields = open("/proc/%d/stat" % pid).read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def gateway_client(args):
    endpoint, n = args
    host, port = endpoint.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    body = '{"key":"%s"}' % KEY_B64
    for _ in range(n):
        conn.request("POST", "/v3/kv/range", body)
        reply = conn.getresponse()
        if reply.status != 200:
            raise RuntimeError("gateway range: HTTP %d" % reply.status)
        reply.read()
    conn.close()


def run_gateway(endpoint, clients, n):
    with multiprocessing.Pool(clients) as pool:
        pool.map(gateway_client, [(endpoint, n)] * clients)


def run_grpc(endpoint, clients, n, tmp):
    body = os.path.join(tmp, "range.grpc")
    with open(body, "wb") as f:
        f.write(b"\x00" + struct.pack(">I", len(GRPC_RANGE)) + GRPC_RANGE)
    cmd = ["nghttp", "-n", "-H", "content-type: application/grpc", "-H", "te: trailers", "-d", body,
           "-m", str(n), "http://%s/etcdserverpb.KV/Range" % endpoint]
    procs = [subprocess.Popen(cmd, stderr=subprocess.PIPE) for _ in range(clients)]
    for p in procs:
        _, err = p.communicate()
        if p.returncode != 0:
            raise RuntimeError("nghttp failed (%d): %s" % (p.returncode, err.decode()[-500:]))


def measure(etcd_pid, fn):
    c0 = cpu_seconds(etcd_pid)
    fn()
    return cpu_seconds(etcd_pid) - c0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    if not os.path.exists(bench_launcher.ETCD):
        sys.exit("bench-etcd-requests: etcd is not installed (Debian's etcd-server)")
    have_grpc = shutil.which("nghttp") is not None
    tmp = tempfile.mkdtemp(prefix="meshrun-etcdreq-")
    etcd, endpoint = bench_launcher.start_etcd(tmp)
    try:
        # the key the ranges read (40 bytes, as a rendezvous value might be)
        gateway_client_put(endpoint)
        total = a.clients * a.requests
        rows = {"gateway": [], "grpc": []}
        for _ in range(a.reps):
            rows["gateway"].append(measure(etcd.pid, lambda: run_gateway(endpoint, a.clients, a.requests)) / total)
            if have_grpc:
                rows["grpc"].append(measure(etcd.pid, lambda: run_grpc(endpoint, a.clients, a.requests, tmp)) / total)
        print("etcd CPU per Range request, %d clients x %d requests, median of %d" % (a.clients, a.requests, a.reps))
        print("%-10s %14s" % ("transport", "us/request"))
        gw = statistics.median(rows["gateway"]) * 1e6
        print("%-10s %14.1f" % ("gateway", gw))
        if have_grpc:
            g = statistics.median(rows["grpc"]) * 1e6
            print("%-10s %14.1f" % ("grpc", g))
            print("ratio gateway/grpc: %.2f" % (gw / g))
        else:
            print("grpc: skipped (nghttp not installed: Debian's nghttp2-client)")
    finally:
        etcd.kill()
        etcd.wait()
        shutil.rmtree(tmp, ignore_errors=True)


def gateway_client_put(endpoint):
    host, port = endpoint.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    value = base64.b64encode(b"v" * 40).decode()
    conn.request("POST", "/v3/kv/put", '{"key":"%s","value":"%s"}' % (KEY_B64, value))
    if conn.getresponse().status != 200:
        raise RuntimeError("gateway put failed")
    conn.close()


if __name__ == "__main__":
    main()
