"""A worker for meshrun's integration tests: run under meshrun, does what its flags say.

Every action that a test synchronizes on leaves a file in --dir (written atomically: tmp +
rename), so tests wait on files with deadlines instead of sleeping. Files are named
rank<RANK>.attempt<MESHRUN_ROUND>.<what>: the round is unique per round, where the restart count
(failures only) repeats across rounds a node joining or leaving started. Imports only the standard
library, so it starts fast.
"""
import argparse
import json
import os
import signal
import socket
import sys
import time


def atomic_write(path, text):
    tmp = path + ".tmp%d" % os.getpid()
    with open(tmp, "w") as f:
        f.write(text)
    os.rename(tmp, path)


def meet(path, deadline_s=20):
    """Proves the endpoints are usable as given: every rank opens a TCP connection to
    MESHRUN_STORE ("host:port" or "[v6]:port"); rank 0 listens on (MASTER_ADDR, MASTER_PORT)
    as torch's TCPStore does (MASTER_ADDR is a bare host: no brackets) and the other ranks dial
    it and send their rank. Writes {"store": true, "peers": [...]} (peers: rank 0 only)."""
    host, port = os.environ["MESHRUN_STORE"].rsplit(":", 1)
    with socket.create_connection((host.strip("[]"), int(port)), timeout=10):
        pass
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    addr, mport = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    peers = []
    if rank == 0:
        fam, _, _, _, sa = socket.getaddrinfo(addr, mport, 0, socket.SOCK_STREAM)[0]
        with socket.socket(fam, socket.SOCK_STREAM) as ls:
            ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            ls.bind(sa)
            ls.listen(world)
            ls.settimeout(deadline_s)
            while len(peers) < world - 1:
                c, _ = ls.accept()
                with c:
                    c.settimeout(deadline_s)
                    peers.append(int(c.recv(16).decode()))
    else:
        end = time.time() + deadline_s
        while True:
            try:
                with socket.create_connection((addr, mport), timeout=5) as c:
                    c.sendall(str(rank).encode())
                break
            except OSError:
                if time.time() > end:
                    raise
                time.sleep(0.02)  # rank 0 is not listening yet: retry until the deadline
    atomic_write(path, json.dumps({"store": True, "peers": sorted(peers)}))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--dir", required=True)
    p.add_argument("--fail-rank", type=int, default=-1, help="this global rank fails")
    p.add_argument("--fail-attempts", type=int, default=1 << 30, help="fail while TORCHELASTIC_RESTART_COUNT (failure restarts) < this")
    p.add_argument("--code", type=int, default=3)
    p.add_argument("--errfile", default="", help="write this message to TORCHELASTIC_ERROR_FILE before failing")
    p.add_argument("--errfile-plain", action="store_true", help='use {"message": "..."} instead of torch\'s format')
    p.add_argument("--errfile-restart", choices=("true", "false"), default=None,
                   help='add meshrun\'s {"meshrun": {"restart": true|false}} to the error file')
    p.add_argument("--hang", action="store_true", help="after starting, wait until a signal ends us")
    p.add_argument("--hang-until", default="", help="wait until this file exists (30 s cap)")
    p.add_argument("--print", type=int, default=0, help="print N lines to stdout and stderr")
    p.add_argument("--meet", action="store_true",
                   help="use MASTER_ADDR/MASTER_PORT and MESHRUN_STORE as a torch program would (see meet())")
    a = p.parse_args()

    rank = int(os.environ["RANK"])
    restarts = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    tag = "rank%d.attempt%d" % (rank, int(os.environ["MESHRUN_ROUND"]))

    def on_signal(sig, frame):
        atomic_write(os.path.join(a.dir, "%s.sig%d" % (tag, sig)), str(time.time()))
        if sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            sys.exit(128 + sig)

    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(s, on_signal)

    env = {k: v for k, v in os.environ.items()}
    env["_pid"] = os.getpid()
    env["_start"] = time.time()
    atomic_write(os.path.join(a.dir, tag + ".json"), json.dumps(env))

    if a.meet:
        meet(os.path.join(a.dir, tag + ".meet"))

    for i in range(a.print):
        print("out line %d from %d" % (i, rank), flush=True)
        print("err line %d from %d" % (i, rank), file=sys.stderr, flush=True)

    if rank == a.fail_rank and restarts < a.fail_attempts:
        if a.errfile:
            if a.errfile_plain:
                doc = {"message": a.errfile}
            else:
                doc = {"message": {"message": a.errfile, "extraInfo": {"timestamp": str(int(time.time()))}}}
            if a.errfile_restart:
                doc["meshrun"] = {"restart": a.errfile_restart == "true"}
            with open(os.environ["TORCHELASTIC_ERROR_FILE"], "w") as f:
                json.dump(doc, f)
        atomic_write(os.path.join(a.dir, tag + ".exit"), str(time.time()))
        sys.exit(a.code)

    if a.hang_until:
        deadline = time.time() + 30
        while not os.path.exists(a.hang_until) and time.time() < deadline:
            time.sleep(0.01)
    if a.hang:
        deadline = time.time() + 60
        while time.time() < deadline:
            signal.pause() if hasattr(signal, "pause") else time.sleep(1)
    atomic_write(os.path.join(a.dir, tag + ".done"), str(time.time()))


if __name__ == "__main__":
    main()
