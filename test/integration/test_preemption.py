"""test_preemption: a preempted run saves its work and resumes on the same losses.

checkpoint.on_signal (on by default with checkpoint.dir): SIGTERM, SIGINT or SIGUSR1 make the
trainer finish the current step, agree with every rank on stopping there, save a checkpoint and
exit 128 + the signal. The plan is test_checkpoint's tiny Llama under fsdp2, checkpoints only at
the end (checkpoint.interval 0), so the only checkpoint before the last step is the one the
signal made. Signals are sent once the metrics file shows progress (polled), never after sleeps.

- SIGTERM to meshrun mid-run: meshrun forwards it; every rank stops after the same step N; the
  job exits 143 with step-N committed; a resume (checkpoint.resume auto) continues from N and
  every loss after N is bit-identical to the run that was never stopped.
- SIGUSR1 to a lone trainer: exit 138 and a checkpoint of the step it finished.
- Without a checkpoint directory the signal ends the run as before (on_signal is off by
  default there; asking for it without a directory is a plan error).
- Ctrl-C without on_signal (no checkpoint.dir, or on_signal false): the trainer dies by SIGINT as
  before, after one line naming the step in progress and what is saved ("nothing saved: set
  checkpoint.dir ...", or the last checkpoint); under meshrun, one such line (rank 0's).
- A plan error writes TORCHELASTIC_ERROR_FILE with the message and {"meshrun": {"restart": false}}
  (meshrun's summary carries it and does not restart).
"""
import json
import os
import re
import signal
import subprocess
import time

import pytest

from conftest import FAST_CONF, Meshrun
from test_checkpoint import TRAINER, clean_env, layout_sets, losses, read_records, run, write_plan

STEPS = 60


def wait_metrics_step(d, step, proc, timeout=60):
    """Polls the metrics file every 5 ms until a step record >= step; fails if proc exits first."""
    path = os.path.join(str(d), "metrics.jsonl")
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            pytest.fail("the run exited (%s) before step %d" % (proc.returncode, step))
        if os.path.exists(path) and any(r.get("step", 0) >= step and "loss" in r for r in read_records(path)):
            return
        time.sleep(0.005)
    pytest.fail("no step %d within %ds" % (step, timeout))


def signal_lone_trainer(d, args, sig):
    """Starts a trainer in d, sends sig once its metrics file shows step 5; (exit status, stderr)."""
    p = subprocess.Popen(args, cwd=str(d), env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    try:
        wait_metrics_step(d, 5, p)
        p.send_signal(sig)
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    return p.returncode, err


def latest(d):
    with open(os.path.join(str(d), "ck", "latest")) as f:
        return f.read().strip()


def test_sigterm_to_meshrun_saves_and_resumes(tmp_path):
    straight, pre = tmp_path / "straight", tmp_path / "pre"
    straight.mkdir()
    pre.mkdir()
    extra = ["train.steps=%d" % STEPS, "eval.interval=0"]
    r = run(straight, "fsdp2", extra)
    assert r.rc == 0, r.describe()
    m = Meshrun(["--nproc_per_node=2", "--rdzv_conf=" + FAST_CONF, TRAINER, write_plan(pre)] +
                layout_sets(pre, "fsdp2", extra), env={"OMP_NUM_THREADS": "1"}, cwd=str(pre))
    try:
        wait_metrics_step(pre, 10, m.proc)
        t0 = time.monotonic()
        m.signal(signal.SIGTERM)
        rc = m.wait(60)
    finally:
        m.kill()
    took = time.monotonic() - t0
    line = [l for l in m.err.splitlines() if "checkpoint saved; exiting" in l]
    print("SIGTERM -> exit %d in %.2f s; %s" % (rc, took, line[0] if line else m.err[-2000:]))
    assert rc == 128 + signal.SIGTERM, m.describe()
    assert line and "Terminated after step" in line[0]
    n = int(line[0].split("after step ")[1].split(":")[0])
    assert 10 <= n < STEPS and latest(pre) == "step-%d" % n
    r = run(pre, "fsdp2", extra + ["checkpoint.resume=auto"])
    assert r.rc == 0, r.describe()
    assert "resumed from" in r.err and "(step %d," % n in r.err, r.err[-2000:]
    ref, got = losses(straight), losses(pre)
    keys = sorted(k for k in ref if k[1] > n)
    assert keys and all(got[k] == ref[k] for k in keys), [(k, ref[k], got.get(k)) for k in keys if got.get(k) != ref[k]]
    print("resumed from step %d: the %d losses after it are bit-identical to the run never stopped" % (n, len(keys)))


def test_sigusr1_lone_trainer(tmp_path):
    args = [TRAINER, write_plan(tmp_path)] + layout_sets(tmp_path, "serial", ["train.steps=%d" % STEPS])
    rc, err = signal_lone_trainer(tmp_path, args, signal.SIGUSR1)
    print(err.strip().splitlines()[-1])
    assert rc == 128 + signal.SIGUSR1, err[-2000:]
    n = int(err.split("after step ")[1].split(":")[0])
    assert latest(tmp_path) == "step-%d" % n


def test_no_checkpoint_dir_signal_ends_run(tmp_path):
    """on_signal is off without checkpoint.dir: SIGTERM ends the trainer as it always did."""
    plan = write_plan(tmp_path)
    p = subprocess.Popen([TRAINER, plan, "--set", "train.steps=100000", "--set", "log.metrics_file=%s" %
                          os.path.join(str(tmp_path), "metrics.jsonl")], cwd=str(tmp_path), env=clean_env(),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_metrics_step(tmp_path, 2, p)
        p.send_signal(signal.SIGTERM)
        p.communicate(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == -signal.SIGTERM
    r = subprocess.run([TRAINER, plan, "--set", "checkpoint.on_signal=true"], cwd=str(tmp_path), env=clean_env(),
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and r.stderr.strip() == (
        "plan error: checkpoint.on_signal: needs checkpoint.dir (where the checkpoint on a signal goes)"), r.stderr


def test_plan_error_writes_error_file(tmp_path):
    ef = os.path.join(str(tmp_path), "error.json")
    r = subprocess.run([TRAINER, write_plan(tmp_path), "--set", "train.lr=-1"], cwd=str(tmp_path),
                       env=clean_env({"TORCHELASTIC_ERROR_FILE": ef}), capture_output=True, text=True, timeout=30)
    assert r.returncode == 2
    with open(ef) as f:
        doc = json.load(f)
    print(doc)
    assert doc["message"]["message"] == r.stderr.strip() and doc["meshrun"] == {"restart": False}


INTERRUPTED = re.compile(r"trainer: interrupted in step (\d+) of 100000; (.*)$")


def interrupted_lines(err):
    return [m for m in (INTERRUPTED.search(l) for l in err.splitlines()) if m]


@pytest.mark.parametrize("case", ["no_dir", "on_signal_off"])
def test_ctrl_c_says_what_was_lost(tmp_path, case):
    """Ctrl-C (SIGINT) without checkpoint.on_signal ends the trainer at once, as by default (killed
    by SIGINT), after one line that says what was lost: the step in progress and "nothing saved"
    (no checkpoint.dir), or the last checkpoint (a directory with on_signal off). Before: no line."""
    sets = ["train.steps=100000", "eval.interval=0", "log.metrics_file=%s" % (tmp_path / "metrics.jsonl")]
    if case == "on_signal_off":
        sets += ["checkpoint.dir=%s" % (tmp_path / "ck"), "checkpoint.interval=2", "checkpoint.on_signal=false"]
    args = [TRAINER, write_plan(tmp_path)] + [a for s in sets for a in ("--set", s)]
    rc, err = signal_lone_trainer(tmp_path, args, signal.SIGINT)
    lines = interrupted_lines(err)
    print(lines[0].group(0) if lines else err[-2000:])
    assert rc == -signal.SIGINT, err[-2000:]
    assert len(lines) == 1, err[-2000:]
    n, rest = int(lines[0].group(1)), lines[0].group(2)
    logged = max(r["step"] for r in read_records(tmp_path / "metrics.jsonl") if "loss" in r)
    assert n >= 5 and logged in (n - 1, n), (n, logged)
    if case == "no_dir":
        assert rest == "nothing saved: set checkpoint.dir to save a checkpoint on Ctrl-C"
    else:
        k = int(rest.split("the last checkpoint is step ")[1].split(" ")[0])
        assert rest.endswith("(checkpoint.on_signal is off)")
        # a save committed in the instant of the signal may be one newer than the line says
        assert k % 2 == 0 and k <= n and int(latest(tmp_path).split("-")[1]) in (k, k + 2), (k, latest(tmp_path))


def test_ctrl_c_under_meshrun_one_line(tmp_path):
    """meshrun forwards SIGINT to its workers; rank 0 alone says what was lost, and the job exits
    128 + SIGINT."""
    sets = ["train.steps=100000", "eval.interval=0", "mesh.dp_shard=2",
            "log.metrics_file=%s" % (tmp_path / "metrics.jsonl")]
    m = Meshrun(["--nproc_per_node=2", "--rdzv_conf=" + FAST_CONF, TRAINER, write_plan(tmp_path)] +
                [a for s in sets for a in ("--set", s)], env={"OMP_NUM_THREADS": "1"}, cwd=str(tmp_path))
    try:
        wait_metrics_step(tmp_path, 3, m.proc)
        m.signal(signal.SIGINT)
        rc = m.wait(60)
    finally:
        m.kill()
    lines = interrupted_lines(m.err)
    print(lines[0].group(0) if lines else m.err[-2000:])
    assert rc == 128 + signal.SIGINT, m.describe()
    assert len(lines) == 1 and lines[0].group(2).startswith("nothing saved"), m.describe()
