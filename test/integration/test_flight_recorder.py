"""The comm flight recorder's dumps from real trainer runs (trainer/comm/comm_flight.c).

Two ranks under meshrun on the cpu comm, the tiny Llama of the trainer tests, dumps into the
test's MESHRUN_DUMP_DIR:

- A stalled peer: MESHRUN_FAULT_STALL=1:3 stops rank 1 before step 3 (trainer/run/hooks.c) and
  rank 0 waits in step 3's first tensor-parallel collective until MESHRUN_COMM_TIMEOUT ends it.
  While rank 1 is stalled the test sends it SIGUSR1: its dump (reason "signal") has tp.0 with
  every call it issued done. Rank 0's own dump (reason "timeout", written before it fails, named
  on stderr) names tp.0, the op and the sequence number S it waited in, its last op line is that
  call, failed, and its tp.0 is done up to S - 1, which is rank 1's last completed call too: the
  rank one behind is the one the others wait for.
- SIGUSR1 to both ranks of a healthy ddp run once its first step is logged: each writes a dump
  with its threads' stacks, the run goes on to exit 0 with the losses of the same run without
  the signal, bit for bit (the recorder never touches the arithmetic); with
  MESHRUN_COMM_FLIGHT_RECORDS=8 the dumps (after step 5, some 40 calls) keep exactly the last 8
  calls, consecutive, newest last.
- SIGUSR1 where checkpoint.on_signal holds it (a checkpoint folder, the default on): the ranks
  dump and also save a checkpoint and exit as preempted (138 = 128 + SIGUSR1).
Every wait polls with a deadline; nothing sleeps a fixed time.
"""
import glob
import json
import os
import signal
import subprocess
import threading
import time

from conftest import FAST_CONF, MESHRUN, bin_dir, tiny_plan, wait_for

TRAINER = os.path.join(bin_dir(), "trainer")
COMM_TIMEOUT_S = 4


def start(d, plan, env, sets=()):
    """meshrun with 2 ranks of plan, stderr read line by line into a list (a reader thread)."""
    path = os.path.join(str(d), "plan.json")
    with open(path, "w") as f:
        json.dump(plan, f)
    e = dict(os.environ)
    for k in [k for k in e if k.startswith(("PET_", "SLURM_", "MESHRUN_FAULT", "MESHRUN_COMM"))]:
        del e[k]
    e.update({"OMP_NUM_THREADS": "1", "MESHRUN_DUMP_DIR": str(d / "dumps")}, **env)
    args = [MESHRUN, "--nproc_per_node=2", "--max_restarts=0", "--rdzv_conf=" + FAST_CONF, TRAINER, path]
    for kv in sets:
        args += ["--set", kv]
    p = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=e, cwd=str(d),
                         start_new_session=True)
    lines = []
    reader = threading.Thread(target=lambda: lines.extend(l.decode(errors="replace").rstrip("\n") for l in p.stderr))
    reader.start()
    return p, lines, reader


def finish(p, reader, timeout=90):
    try:
        rc = p.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        rc = p.wait()
    reader.join(10)
    return rc


def rank_pid(d, rank):
    """The trainer process of rank whose MESHRUN_DUMP_DIR is this test's (its /proc environment)."""
    mine = ("MESHRUN_DUMP_DIR=%s" % (d / "dumps")).encode()
    for pid in (int(x) for x in os.listdir("/proc") if x.isdigit()):
        try:
            with open("/proc/%d/environ" % pid, "rb") as f:
                env = f.read().split(b"\0")
            exe = os.readlink("/proc/%d/exe" % pid)
        except OSError:
            continue
        if os.path.basename(exe) == "trainer" and mine in env and b"RANK=%d" % rank in env:
            return pid
    return None


def dumps(d, rank):
    return sorted(glob.glob(str(d / "dumps" / ("flight-rank%d-*.jsonl" % rank))))


def read_dump(path):
    with open(path) as f:
        recs = [json.loads(l) for l in f]
    header = recs[0]
    assert header["type"] == "header", header
    return header, [r for r in recs if r["type"] == "op"], [r for r in recs if r["type"] == "stack"]


def comm_of(header, name):
    return next(c for c in header["comms"] if c["name"] == name)


STALL_PLAN = tiny_plan(
    mesh={"dp_replicate": 1, "dp_shard": 1, "tp": 2},
    parallel={"sequence_parallel": True, "loss_parallel": True},
    train={"steps": 6, "seq_len": 32, "micro_batch_size": 2, "global_batch_size": 2,
           "lr": 3e-3, "warmup_steps": 2, "decay": "cosine"},
    eval={"interval": 1000, "batches": 1},
    log={"interval": 1},
)


def test_stalled_rank_and_its_waiting_peer_dump(tmp_path):
    p, lines, reader = start(tmp_path, STALL_PLAN, {"MESHRUN_FAULT_STALL": "1:3",
                                                   "MESHRUN_COMM_TIMEOUT": str(COMM_TIMEOUT_S)})
    try:
        wait_for(lambda: any("MESHRUN_FAULT_STALL: stalling before step 3" in l for l in lines), 60,
                 "rank 1 to stall")
        pid1 = wait_for(lambda: rank_pid(tmp_path, 1), 10, "rank 1's process")
        os.kill(pid1, signal.SIGUSR1)
        d1 = wait_for(lambda: dumps(tmp_path, 1), COMM_TIMEOUT_S,
                      "rank 1's dump after SIGUSR1")[0]
    finally:
        rc = finish(p, reader)
    text = "\n".join(lines)
    assert rc != 0, text
    d0 = dumps(tmp_path, 0)
    assert len(d0) == 1, "rank 0 wrote %s\n%s" % (d0, text)
    h0, ops0, stacks0 = read_dump(d0[0])
    h1, ops1, stacks1 = read_dump(d1)
    failed = h0["failed"]
    print("rank 0 (%s): timed out in %s call %d (%s); rank 1 (%s): tp.0 issued %d, done %d" %
          (os.path.basename(d0[0]), failed["comm"], failed["seq"], failed["op"], os.path.basename(d1),
           comm_of(h1, "tp.0")["issued"], comm_of(h1, "tp.0")["done"]))
    # rank 0: the call it waited in, named in the header, as its newest record, and on stderr
    assert h0["reason"] == "timeout" and h0["rank"] == 0 and failed["comm"] == "tp.0", h0
    assert failed["op"] in ("all_reduce", "all_gather", "reduce_scatter"), h0
    last = [o for o in ops0 if o["comm"] == "tp.0"][-1]
    assert (last["seq"], last["op"], last["state"], last["error"]) == (failed["seq"], failed["op"], "failed",
                                                                       "timed out"), last
    tp0 = comm_of(h0, "tp.0")
    assert (tp0["issued"], tp0["done"]) == (failed["seq"], failed["seq"] - 1), tp0
    said = [l for l in lines if l.startswith("[rank0]") and "comm flight recorder: timeout in comm tp.0 call %d" %
            failed["seq"] in l]
    assert said and said[0].endswith(d0[0]), text
    # rank 1: alive (a signal dump), every call it issued done, one behind rank 0's
    assert h1["reason"] == "signal" and h1["rank"] == 1 and h1["pid"] == pid1, h1
    tp1 = comm_of(h1, "tp.0")
    assert tp1["issued"] == tp1["done"] == failed["seq"] - 1, tp1
    assert all(o["state"] == "done" for o in ops1), [o for o in ops1 if o["state"] != "done"]
    # stacks: rank 1's main thread is in the stall (pause, under hooks_stall), rank 0's dumping
    # thread is the one that timed out
    main1 = [s for s in stacks1 if s["main"]]
    assert main1 and any("hooks_stall" in f for f in main1[0]["frames"]), main1
    dumping0 = [s for s in stacks0 if s["dumping"]]
    assert dumping0 and any("comm_flight_end" in f for f in dumping0[0]["frames"]), dumping0


def losses(path):
    with open(path) as f:
        return [(r["step"], r["loss"]) for r in (json.loads(l) for l in f if l.strip()) if "loss" in r and "step" in r]


DDP_PLAN = tiny_plan(mesh={"dp_replicate": 2, "dp_shard": 1, "tp": 1}, log={"interval": 1},
                     eval={"interval": 1000, "batches": 1},
                     train={"steps": 40, "seq_len": 32, "micro_batch_size": 2, "global_batch_size": 16,
                            "lr": 3e-3, "warmup_steps": 2, "decay": "cosine"})


def test_sigusr1_dumps_and_the_run_goes_on(tmp_path):
    ref_dir, sig_dir = tmp_path / "ref", tmp_path / "sig"
    ref_dir.mkdir()
    sig_dir.mkdir()
    p, lines, reader = start(ref_dir, DDP_PLAN, {}, ["log.metrics_file=%s" % (ref_dir / "m.jsonl")])
    assert finish(p, reader) == 0, "\n".join(lines)
    metrics = sig_dir / "m.jsonl"
    p, lines, reader = start(sig_dir, DDP_PLAN, {"MESHRUN_COMM_FLIGHT_RECORDS": "8"},
                             ["log.metrics_file=%s" % metrics])
    try:
        wait_for(lambda: metrics.exists() and len(losses(metrics)) >= 5, 60, "step 5's metrics")
        pids = [wait_for(lambda r=r: rank_pid(sig_dir, r), 10, "rank %d's process" % r) for r in (0, 1)]
        for pid in pids:
            os.kill(pid, signal.SIGUSR1)
        got = [wait_for(lambda r=r: dumps(sig_dir, r), 30, "rank %d's dump" % r)[0]
               for r in (0, 1)]
        still_running = p.poll() is None
    finally:
        rc = finish(p, reader)
    text = "\n".join(lines)
    assert still_running, "the run ended before both dumps were written: make it longer\n" + text
    assert rc == 0, text
    ref, sig = losses(ref_dir / "m.jsonl"), losses(metrics)
    print("losses: %d steps, signalled run identical: %s; dumps %s" % (len(ref), ref == sig,
                                                                      [os.path.basename(g) for g in got]))
    assert len(ref) == 40 and sig == ref, (ref, sig)
    for r, path in enumerate(got):
        h, ops, stacks = read_dump(path)
        assert h["reason"] == "signal" and h["rank"] == r and h["records"] == 8, h
        assert any(l.startswith("[rank%d]" % r) and "comm flight recorder: signal: dump in " + path in l
                   for l in lines), text
        # the ring keeps the last 8 of more calls, oldest first; each communicator's consecutive
        assert h["issued"] > 8 and len(ops) == 8, (h["issued"], len(ops))
        assert [o["t_issue_ns"] for o in ops] == sorted(o["t_issue_ns"] for o in ops), ops
        for name in {o["comm"] for o in ops}:
            seqs = [o["seq"] for o in ops if o["comm"] == name]
            assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), (name, seqs)
        # every thread with a stack: the dump thread's own, and the main thread's by signal
        names = {s["name"] for s in stacks}
        assert "comm dump" in names and any(s["main"] and len(s["frames"]) > 2 for s in stacks), stacks


def test_sigusr1_with_preemption_dumps_and_saves(tmp_path):
    metrics, ck = tmp_path / "m.jsonl", tmp_path / "ck"
    p, lines, reader = start(tmp_path, DDP_PLAN, {}, ["log.metrics_file=%s" % metrics, "checkpoint.dir=%s" % ck,
                                                      "checkpoint.interval=1000"])
    try:
        wait_for(lambda: metrics.exists() and len(losses(metrics)) >= 3, 60, "step 3's metrics")
        pids = [wait_for(lambda r=r: rank_pid(tmp_path, r), 10, "rank %d's process" % r) for r in (0, 1)]
        for pid in pids:
            os.kill(pid, signal.SIGUSR1)
        got = [wait_for(lambda r=r: dumps(tmp_path, r), 30, "rank %d's dump" % r)[0] for r in (0, 1)]
    finally:
        rc = finish(p, reader)
    text = "\n".join(lines)
    saved = sorted(x for x in os.listdir(ck) if x.startswith("step-")) if ck.exists() else []
    print("exit %s; dumps %s; checkpoints %s" % (rc, [os.path.basename(g) for g in got], saved))
    assert rc == 138, text
    assert saved, text
    for r, path in enumerate(got):
        h, _, _ = read_dump(path)
        assert h["reason"] == "signal" and h["rank"] == r, h
