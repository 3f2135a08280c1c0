"""test_skip: train.skip_nonfinite, train.skip_loss_z and train.skip_grad_z skip a step's update,
decided on the device inside the step, and say so in the records and on the console.

The tiny Llama of conftest on tinyshakespeare (text), global batch 4. Faults (trainer/run/hooks.c):
MESHRUN_FAULT_NAN=RANK:STEP (that rank's loss turns nan), MESHRUN_FAULT_NAN_GRAD=RANK:STEP:TENSOR
(that rank's own gradient of one tensor turns nan before the reduction) and
MESHRUN_FAULT_SPIKE=RANK:STEP[:STEP] (that rank's targets of the step are all token 0: a batch of
bad data, whose loss and gradient norm jump; observed: loss 7.5 over a window of mean 4.1, std 0.7).

  - a nan loss on rank 1 of ZeRO-1 over 2 ranks (each rank updates and saves its own half of the
    optimizer state) with skip_nonfinite: step 5 is skipped on every rank: its record says
    skipped 1 and skipped_total 1, the console names the cause, the run ends 0, and the
    checkpoint after step 5 holds exactly (bit for bit) the parameters and moments of the one
    after step 4, while the one after step 6 differs; without the key the run stops with the
    loss message, as always;
  - a nan gradient on rank 1 (same run): skipped, the same checks;
  - a loss spike at step 20 (one process): skipped under skip_loss_z 3 ("loss ... z-score"), and
    under skip_grad_z 3 ("gradient norm ... z-score"), with the checkpoints as above; with the
    keys off the step updates, and the records carry no "skipped" key;
  - kill -9 and resume: spikes at steps 17 and 21, a checkpoint every 9 steps, the process
    stalled before step 23 (MESHRUN_FAULT_STALL) and killed with SIGKILL, then resumed from step
    18: the records of every step equal those of an uninterrupted run (loss, grad_norm, skipped,
    skipped_total; exact). Step 21 is skipped again after the resume only because the window
    (16 values at least) and the total came back with the checkpoint.
"""
import json
import os
import signal
import struct
import subprocess

import pytest

from conftest import FAST_CONF, Meshrun, bin_dir, tiny_plan

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRAINER = os.path.join(bin_dir(), "trainer")
TEXT = os.path.join(REPO, "data", "tinyshakespeare.txt")
TENSOR = "layers.0.attention.wq.weight"


def plan(steps):
    return tiny_plan(train={"steps": steps, "seq_len": 32, "micro_batch_size": 2, "global_batch_size": 4,
                            "lr": 3e-3, "warmup_steps": 2, "decay": "cosine"},
                     data={"train": TEXT, "format": "text"}, eval={"interval": 0}, log={"interval": 10})


def write_plan(d, steps):
    path = os.path.join(str(d), "plan.json")
    with open(path, "w") as f:
        json.dump(plan(steps), f)
    return path


def sets(d, extra):
    out = []
    for kv in ["log.metrics_file=%s" % os.path.join(str(d), "metrics.jsonl"),
               "checkpoint.dir=%s" % os.path.join(str(d), "ck"), "checkpoint.keep=0"] + list(extra):
        out += ["--set", kv]
    return out


def records(d):
    """The step records, by step (the last one of each: a resumed run writes some twice)."""
    out = {}
    with open(os.path.join(str(d), "metrics.jsonl")) as f:
        for line in f:
            r = json.loads(line)
            if "step" in r and "lr" in r:
                out[r["step"]] = r
    return out


def trainer(d, steps, extra, env):
    e = dict(os.environ, OMP_NUM_THREADS="1", **env)
    return subprocess.run([TRAINER, write_plan(d, steps)] + sets(d, extra), cwd=str(d), env=e, capture_output=True,
                          text=True, timeout=120)


def ddp2(d, extra, env):
    m = Meshrun(["--nproc_per_node=2", "--max_restarts=0", "--rdzv_conf=" + FAST_CONF, TRAINER, write_plan(d, 8)] +
                sets(d, ["mesh.dp_replicate=2", "parallel.zero=1"] + list(extra)),
                env=dict({"OMP_NUM_THREADS": "1", "MESHRUN_COMM_TIMEOUT": "60"}, **env), cwd=str(d))
    return m.wait(120), m


def state(ckdir):
    """Every tensor chunk of a checkpoint (all ranks' shards) as bytes, by its safetensors name."""
    out = {}
    for name in sorted(os.listdir(ckdir)):
        if not name.endswith(".safetensors"):
            continue
        with open(os.path.join(ckdir, name), "rb") as f:
            b = f.read()
        n = struct.unpack("<Q", b[:8])[0]
        head = json.loads(b[8:8 + n])
        for k, v in head.items():
            if k != "__metadata__":
                lo, hi = v["data_offsets"]
                out[name + ":" + k] = b[8 + n + lo:8 + n + hi]
    return out


def check_not_updated(d, k):
    """The optimizer state after step k is that after step k - 1, bit for bit; after k + 1 it is not."""
    ck = os.path.join(str(d), "ck")
    before, at, after = (state(os.path.join(ck, "step-%d" % s)) for s in (k - 1, k, k + 1))
    model = [n for n in before if "/skip/" not in n and ":skip/" not in n]
    same = sum(before[n] == at[n] for n in model)
    moved = sum(at[n] != after[n] for n in model)
    print("checkpoint chunks: %d of %d identical from step %d to %d (want all); %d differ from step %d to %d "
          "(want > 0)" % (same, len(model), k - 1, k, moved, k, k + 1))
    assert model and same == len(model)
    assert moved > 0


def check_records(recs, k, total_after=1):
    got = [(s, recs[s].get("skipped"), recs[s].get("skipped_total")) for s in sorted(recs)]
    print("records (step, skipped, skipped_total):", got)
    for s, sk, tot in got:
        assert sk == (1 if s == k else 0)
        assert tot == (0 if s < k else total_after)


def test_nan_loss_on_one_rank_is_skipped_by_every_rank(tmp_path):
    rc, m = ddp2(tmp_path, ["train.skip_nonfinite=true", "checkpoint.interval=1"], {"MESHRUN_FAULT_NAN": "1:5"})
    assert rc == 0, m.describe()
    recs = records(tmp_path)
    check_records(recs, 5)
    assert recs[5]["loss"] is None  # nan: JSON's null
    assert "step 5 skipped: loss nan (train.skip_nonfinite)" in m.err, m.describe()
    assert "done: 8 steps" in m.err and "; 1 step skipped" in m.err, m.describe()
    check_not_updated(tmp_path, 5)
    off = tmp_path / "off"
    off.mkdir()
    rc, m = ddp2(off, [], {"MESHRUN_FAULT_NAN": "1:5"})
    print("without the key: rc %d" % rc)
    assert rc == 1, m.describe()
    assert "loss is nan at step 5" in m.err, m.describe()


def test_nan_gradient_on_one_rank_is_skipped(tmp_path):
    rc, m = ddp2(tmp_path, ["train.skip_nonfinite=true", "checkpoint.interval=1"],
                 {"MESHRUN_FAULT_NAN_GRAD": "1:5:" + TENSOR})
    assert rc == 0, m.describe()
    check_records(records(tmp_path), 5)
    assert "step 5 skipped: gradient norm nan (train.skip_nonfinite)" in m.err, m.describe()
    check_not_updated(tmp_path, 5)


@pytest.mark.parametrize("key,what", [("skip_loss_z", "loss"), ("skip_grad_z", "gradient norm")])
def test_spike_is_skipped(tmp_path, key, what):
    r = trainer(tmp_path, 22, ["train.%s=3" % key, "checkpoint.interval=1"], {"MESHRUN_FAULT_SPIKE": "0:20"})
    assert r.returncode == 0, r.stderr
    line = [l for l in r.stderr.splitlines() if "skipped:" in l]
    print("\n".join(line))
    assert len(line) == 1 and "step 20 skipped: %s " % what in line[0] and "over train.%s 3 " % key in line[0]
    check_records(records(tmp_path), 20)
    check_not_updated(tmp_path, 20)
    off = tmp_path / "off"
    off.mkdir()
    r = trainer(off, 22, [], {"MESHRUN_FAULT_SPIKE": "0:20"})
    assert r.returncode == 0, r.stderr
    recs = records(off)
    print("keys off: loss at steps 19, 20: %.4f %.4f; keys on: %.4f" % (recs[19]["loss"], recs[20]["loss"],
                                                                        records(tmp_path)[20]["loss"]))
    assert "skipped" not in recs[20] and "skipped:" not in r.stderr
    assert recs[20]["loss"] == records(tmp_path)[20]["loss"]  # the same spike, updated on
    assert recs[21]["loss"] != records(tmp_path)[21]["loss"]


def test_kill_and_resume_gives_the_same_records(tmp_path):
    keys = ["train.skip_loss_z=3", "train.skip_nonfinite=true", "checkpoint.interval=9"]
    spikes = {"MESHRUN_FAULT_SPIKE": "0:17:21"}
    ref = tmp_path / "straight"
    ref.mkdir()
    r = trainer(ref, 30, keys, spikes)
    assert r.returncode == 0, r.stderr
    want = records(ref)
    run = tmp_path / "killed"
    run.mkdir()
    e = dict(os.environ, OMP_NUM_THREADS="1", MESHRUN_FAULT_STALL="0:23", **spikes)
    p = subprocess.Popen([TRAINER, write_plan(run, 30)] + sets(run, keys), cwd=str(run), env=e,
                         stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    try:
        for line in p.stderr:
            if "MESHRUN_FAULT_STALL" in line:
                break
        p.send_signal(signal.SIGKILL)
    finally:
        p.wait(60)
        p.stderr.close()
    print("killed before step 23: rc %d; checkpoints %s" % (p.returncode, sorted(os.listdir(str(run / "ck")))))
    assert p.returncode == -signal.SIGKILL
    r = trainer(run, 30, keys + ["checkpoint.resume=auto"], spikes)
    assert r.returncode == 0, r.stderr
    assert "resumed from" in r.stderr and "step-18" in r.stderr, r.stderr
    got = records(run)
    keys_cmp = ("loss", "grad_norm", "skipped", "skipped_total")
    diff = [s for s in want if any(want[s][k] != got.get(s, {}).get(k) for k in keys_cmp)]
    print("skipped steps: straight %s, killed and resumed %s; steps whose records differ: %s" %
          ([s for s in want if want[s]["skipped"]], [s for s in got if got[s]["skipped"]], diff))
    assert [s for s in want if want[s]["skipped"]] == [17, 21]
    assert sorted(got) == sorted(want) and not diff
