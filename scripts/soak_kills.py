#!/usr/bin/python3
"""soak_kills: kill -9 random workers of one training job again and again; check every loss.

    scripts/soak_kills.py [--kills 20] [--nproc 4] [--bin bin] [--keep DIR]

An fsdp run of the tests' tiny Llama (synthetic data, global batch 16, checkpoints every 5
steps, checkpoint.resume auto) under meshrun with enough restarts. Each time the job trains
again after a restart, the soak waits a random 3 to 12 steps, then sends SIGKILL to one random
worker; after the last kill it lets the job finish. Then it runs the same job uninterrupted and
compares: every step's loss (the last record of each step: the attempt that finished it) must be
bit-identical to the uninterrupted run's. Progress is read from the metrics file (polled every
5 ms), never from sleeps. Prints one line per kill (step, kill -> training again) and a summary:
kills, steps compared, steps that differ, the median and worst time from a kill to the next
trained step. Exit 0 when every loss matched and the job exited 0.
"""
import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONF = "join_timeout=30,last_call_timeout=0.3,heartbeat_interval=0.1,heartbeat_timeout=1"

PLAN = {
    "device": "cpu", "seed": 1337,
    "model": {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 256, "max_seq_len": 32,
              "multiple_of": 32},
    "mesh": {"dp_replicate": 1, "dp_shard": -1, "tp": 1},
    "train": {"seq_len": 32, "micro_batch_size": 2, "global_batch_size": 16, "lr": 3e-3, "warmup_steps": 2},
    "data": {"format": "synthetic"},
    "eval": {"interval": 0},
    "log": {"interval": 50},
    "sample": {"tokens": 0},
}


def records(d):
    p = os.path.join(d, "metrics.jsonl")
    out = []
    if os.path.exists(p):
        with open(p) as f:
            for line in f:
                try:
                    out.append(json.loads(line))
                except ValueError:  # a line torn by the kill
                    pass
    return out


def progress(d):
    """(attempts started = header records, last step logged by the latest attempt or 0)."""
    heads, last = 0, 0
    for r in records(d):
        if "plan" in r:
            heads, last = heads + 1, 0
        elif "loss" in r:
            last = r["step"]
    return heads, last


def losses(d):
    out = {}
    for r in records(d):
        if "loss" in r:
            out[r["step"]] = r["loss"]
    return out


def start(binary, d, nproc, steps, restarts):
    plan = os.path.join(d, "plan.json")
    with open(plan, "w") as f:
        json.dump(PLAN, f)
    args = [os.path.join(binary, "meshrun"), "--nproc_per_node=%d" % nproc, "--max_restarts=%d" % restarts,
            "--rdzv_conf=" + CONF, os.path.join(binary, "trainer"), plan]
    for kv in ["train.steps=%d" % steps, "log.metrics_file=%s" % os.path.join(d, "metrics.jsonl"),
               "checkpoint.dir=%s" % os.path.join(d, "ck"), "checkpoint.interval=5", "checkpoint.resume=auto"]:
        args += ["--set", kv]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.Popen(args, cwd=d, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def children(pid):
    out = []
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                with open("/proc/%s/stat" % p) as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(p))
            except (OSError, IndexError, ValueError):
                pass
    return out


def workers(meshrun_pid):
    """The trainer processes under meshrun (its children, or their children)."""
    found = []
    for c in children(meshrun_pid):
        try:
            with open("/proc/%d/cmdline" % c, "rb") as f:
                is_trainer = b"trainer" in f.read().split(b"\0")[0]
        except OSError:
            continue
        found += [c] if is_trainer else [g for g in children(c)]
    return found


def wait_for(d, pred, timeout, what, proc):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        h, s = progress(d)
        if pred(h, s):
            return time.monotonic(), h, s
        if proc.poll() is not None:
            sys.exit("soak_kills: the job exited (%s) while waiting for %s:\n%s" %
                     (proc.returncode, what, proc.stderr.read()[-3000:]))
        time.sleep(0.005)
    sys.exit("soak_kills: no %s within %d s" % (what, timeout))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kills", type=int, default=20)
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--bin", default=os.path.join(REPO, "bin"))
    ap.add_argument("--seed", type=int, default=None, help="of the kill schedule (default: random, printed)")
    ap.add_argument("--keep", help="work in this folder and keep it")
    a = ap.parse_args()
    seed = a.seed if a.seed is not None else random.randrange(1 << 30)
    rnd = random.Random(seed)
    steps = 40 + a.kills * 20
    base = a.keep or tempfile.mkdtemp(prefix="soak-kills-")
    soak, ref = os.path.join(base, "soak"), os.path.join(base, "uninterrupted")
    os.makedirs(soak, exist_ok=True)
    os.makedirs(ref, exist_ok=True)
    print("soak_kills: %d kills of %d workers, %d steps, schedule seed %d, in %s" % (a.kills, a.nproc, steps, seed,
                                                                                    base))
    job = start(a.bin, soak, a.nproc, steps, a.kills + 2)
    backs = []
    try:
        heads = 1
        for k in range(a.kills):
            target = rnd.randrange(3, 13)
            _, h, s = wait_for(soak, lambda h, s: h >= heads and s >= 1, 120, "round %d training" % heads, job)
            _, h, s = wait_for(soak, lambda h, s, s0=s: h > heads or s >= s0 + target, 120, "%d more steps" % target,
                               job)
            if h > heads or s >= steps - 5:
                sys.exit("soak_kills: the job ran out of steps before kill %d; raise the step count" % (k + 1))
            pids = workers(job.pid)
            if len(pids) != a.nproc:
                sys.exit("soak_kills: found %d workers under meshrun, expected %d" % (len(pids), a.nproc))
            victim = rnd.choice(pids)
            os.kill(victim, signal.SIGKILL)
            t_kill = time.monotonic()
            t_back, _, _ = wait_for(soak, lambda h, s: h > heads and s >= 1, 120, "training after kill %d" % (k + 1),
                                    job)
            heads += 1
            backs.append(t_back - t_kill)
            print("kill %2d: pid %d at step %d; kill -> training again %.2f s" % (k + 1, victim, s, backs[-1]))
        job_rc = job.wait(600)
        err = job.stderr.read()
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
    if job_rc != 0:
        sys.exit("soak_kills: the job exited %d:\n%s" % (job_rc, err[-3000:]))
    r = start(a.bin, ref, a.nproc, steps, 0)
    if r.wait(600) != 0:
        sys.exit("soak_kills: the uninterrupted run failed:\n%s" % r.stderr.read()[-3000:])
    got, want = losses(soak), losses(ref)
    missing = [s for s in want if s not in got]
    differ = [s for s in want if s in got and got[s] != want[s]]
    print("soak_kills: %d kills; %d steps compared, %d missing, %d differ (tolerance 0: bit-identical); "
          "kill -> training again: median %.2f s, worst %.2f s" %
          (len(backs), len(want), len(missing), len(differ), statistics.median(backs) if backs else 0,
           max(backs) if backs else 0))
    if differ:
        print("first differing steps: %s" % [(s, want[s], got[s]) for s in differ[:5]])
    sys.exit(0 if not differ and not missing else 1)


if __name__ == "__main__":
    main()
