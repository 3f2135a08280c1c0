"""test_checkpoint: the trainer's checkpoints (trainer/formats/ckpt through trainer/run/main.c and trainer/parallel/dp.c).

Every run is bin/trainer (one process) or bin/trainer under bin/meshrun, on a tiny Llama (dim 64,
n_heads 4, n_kv_heads 2, vocab 256, 2 layers, seq 32) with synthetic data, 20 steps of a global
batch of 16 sequences (24 for the 8 -> 6 ranks case, so that both worlds divide it).

- Exact resume: a run stopped after step 12 (--stop-after, as if killed there; checkpoints every
  5 steps) and resumed with checkpoint.resume=auto continues from step-10 on the SAME loss bits
  (every step and eval after the checkpoint; tolerance 0) as a run that never stopped, for one
  process, fsdp4, tp2 and ZeRO-2 over 4 ranks, and fsdp4 with asynchronous saves.
- Resharding: the never-stopped run's step-10 checkpoint loads under another mesh and world
  (fsdp4 -> fsdp2, tp2 -> fsdp4, ddp2 -> fsdp4, zero2 over 4 -> fsdp2, 8 ranks (hsdp 2x2 x tp2) -> 6 ranks (fsdp3 x tp2))
  and the losses of steps 11..20 stay within 1e-4 relative of the run that kept its layout
  (observed about 1e-7: the reductions' order).
- Corruption through the trainer: a truncated shard of step-10 and a flipped bit in step-15 ->
  resume auto names both files, falls back to step-5, and still ends on the never-stopped run's
  bits; saving step-10 again removes the abandoned step-15 with a warning.
- Another model shape -> refused with a message naming the shape, exit 2; another global batch ->
  exit 2; a plan without train.global_batch_size takes the checkpoint's (fsdp2 -> one process with
  2 accumulation steps, losses within 1e-4 of the run that kept its world).
- Tampered metadata: a one-bit flip of optim_step in step-15's metadata.json and of data_position
  in step-10's -> both named (checksum mismatch), resume falls back to step-5 and ends on the
  never-stopped run's bits.
- Diverged: a checkpoint that holds a NaN or an infinity (saved by a run whose parameters overflowed,
  train.lr=1e39) is not resumed: exit 2 on every rank (fsdp2), no restart, the checkpoint, tensor
  and element named, no fallback to the older step-2 (which resumes when named); `trainer sample`
  refuses it too.
- Failed saves: a shard write failing on rank 1 at step 10 (MESHRUN_FAULT_SAVE, sync and async)
  -> one warning, no step-10.tmp left, the run goes on to the same loss bits and exits 0; the
  save after the last step failing -> the final weights are still saved, exit 1, an error file
  without meshrun's no-restart flag; no space (a 256 KiB tmpfs as checkpoint.dir, skipped where
  mounting is not allowed) -> the run stops at the first save, exit 1, "No space left on device",
  nothing left in the directory, and the error file says {"meshrun": {"restart": false}}; no space
  on rank 1 only (fault injection) -> every rank stops with that cause; no space for fsdp2's final
  weights (rank 0 writes them) -> both ranks exit 1, rank 0 naming the cause.
- One run per checkpoint.dir: a second run (another job, seed 7) is refused while the first holds
  ck/meshrun.lock, and takes it over once the first is killed -9; locks of another host (touched:
  refused; untouched for 60 s: taken over), of the same job (taken over silently) and garbage.
- Interop: `trainer export` to llama2.c and HF from a run's final weights; model.init from each
  (and from our safetensors) trains step 1 to the same loss bits; a wrong shape is refused with
  the interop message (exit 2); configs/stories260K.json loads data/stories260K.bin (../data from its
  folder), and without it says where the file comes from; configs/stories.json before `make
  stories` names tools/prepare_data.py.
OMP_NUM_THREADS=1 everywhere (2 shared cores).
"""
import json
import os
import re
import shutil
import struct
import subprocess

import pytest

from conftest import FAST_CONF, Meshrun, bin_dir, tiny_plan

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRAINER = os.path.join(bin_dir(), "trainer")
TOL = 1e-4

PLAN = tiny_plan()

# name: (ranks, mesh (dp_replicate, dp_shard, tp), extra --set)
LAYOUTS = {
    "serial": (1, (1, 1, 1), []),
    "fsdp4": (4, (1, 4, 1), []),
    "fsdp2": (2, (1, 2, 1), []),
    "tp2": (2, (1, 1, 2), []),
    "ddp2": (2, (2, 1, 1), []),
    "zero2_4": (4, (4, 1, 1), ["parallel.zero=2"]),
    "hsdp2x2_tp2": (8, (2, 2, 2), ["train.global_batch_size=24"]),
    "fsdp3_tp2": (6, (1, 3, 2), ["train.global_batch_size=24"]),
}


def write_plan(d, plan=None):
    path = os.path.join(str(d), "plan.json")
    with open(path, "w") as f:
        json.dump(plan or PLAN, f)
    return path


def clean_env(extra=None):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MESHRUN_STORE", "TORCHELASTIC_RESTART_COUNT",
              "TORCHELASTIC_ERROR_FILE", "MESHRUN_FAULT_SAVE"):
        env.pop(k, None)
    env.update(extra or {})
    return env


def layout_sets(d, name, extra=()):
    nproc, (r, s, t), lx = LAYOUTS[name]
    out = []
    for kv in ["mesh.dp_replicate=%d" % r, "mesh.dp_shard=%d" % s, "mesh.tp=%d" % t,
               "log.metrics_file=%s" % os.path.join(str(d), "metrics.jsonl"),
               "checkpoint.dir=%s" % os.path.join(str(d), "ck")] + lx + list(extra):
        out += ["--set", kv]
    return out


class Result:
    def __init__(self, rc, out, err):
        self.rc, self.out, self.err = rc, out, err

    def describe(self):
        return "rc=%s\nstdout:\n%s\nstderr:\n%s" % (self.rc, self.out, self.err)


def run(d, name, extra=(), flags=(), timeout=120, env=None, plan=None):
    """Runs layout `name` in directory d (one process, or meshrun with its ranks); env: extra
    variables; plan: another plan than PLAN."""
    nproc = LAYOUTS[name][0]
    args = [write_plan(d, plan)] + layout_sets(d, name, extra) + list(flags)
    if nproc == 1:
        r = subprocess.run([TRAINER] + args, cwd=str(d), env=clean_env(env), capture_output=True, text=True,
                           timeout=timeout)
        return Result(r.returncode, r.stdout, r.stderr)
    m = Meshrun(["--nproc_per_node=%d" % nproc, "--rdzv_conf=" + FAST_CONF, TRAINER] + args,
                env=dict({"OMP_NUM_THREADS": "1"}, **(env or {})), cwd=str(d))
    rc = m.wait(timeout)
    return Result(rc, m.out, m.err)


def read_records(path):
    """Metrics records; a line torn by a killed writer (not JSON) is skipped."""
    out = []
    with open(path) as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
    return out


def losses(d_or_path):
    """{(is_eval, step): loss}; a step logged twice (by a run that stopped after its checkpoint,
    then by the resumed run) keeps the last record."""
    p = str(d_or_path)
    if os.path.isdir(p):
        p = os.path.join(p, "metrics.jsonl")
    out = {}
    for r in read_records(p):
        if "step" in r:
            out[("eval_loss" in r, r["step"])] = r.get("loss", r.get("eval_loss"))
    return out


def max_rel(ref, got, keys):
    return max(abs(got[k] - ref[k]) / abs(ref[k]) for k in keys)


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """straight(name) -> directory of a never-stopped 20-step run of layout name, checkpoints every
    5 steps, all kept (each run once per module)."""
    runs = {}

    def get(name):
        if name not in runs:
            d = tmp_path_factory.mktemp("straight_" + name)
            r = run(d, name, ["checkpoint.interval=5", "checkpoint.keep=0"])
            assert r.rc == 0, r.describe()
            runs[name] = d
        return runs[name]

    return get


@pytest.mark.parametrize("name,mode", [("serial", "sync"), ("fsdp4", "sync"), ("tp2", "sync"), ("fsdp4", "async"),
                                       ("zero2_4", "sync")])
def test_exact_resume(straight, tmp_path, name, mode):
    ref = losses(straight(name))
    asyn = "checkpoint.async=%s" % ("true" if mode == "async" else "false")
    r = run(tmp_path, name, ["checkpoint.interval=5", asyn], ["--stop-after", "12"])
    assert r.rc == 0, r.describe()
    assert "stopping after step 12" in r.err
    assert sorted(os.listdir(tmp_path / "ck")) == ["latest", "step-10", "step-5"]
    r = run(tmp_path, name, ["checkpoint.interval=5", "checkpoint.resume=auto", asyn])
    assert r.rc == 0, r.describe()
    assert "resumed from %s/step-10 (step 10, saved by world %d, now world %d, restart 0, round 0)" % (
        tmp_path / "ck", LAYOUTS[name][0], LAYOUTS[name][0]) in r.err, r.describe()
    got = losses(tmp_path)
    assert sorted(got) == sorted(ref)
    after = [k for k in ref if k[1] > 10]
    diff = [(k, got[k], ref[k]) for k in sorted(after) if got[k] != ref[k]]
    print("%-7s (%s saves) resumed at step 10: %d losses after it (steps + evals), %d differ in any bit (tolerance 0)%s" %
          (name, mode, len(after), len(diff), "" if not diff else ": max rel %.2e" % max_rel(ref, got, after)))
    assert not diff, "%s: losses after resume differ from the never-stopped run: %s" % (name, diff[:3])


@pytest.mark.parametrize("src,dst", [("fsdp4", "fsdp2"), ("tp2", "fsdp4"), ("ddp2", "fsdp4"),
                                     ("zero2_4", "fsdp2"), ("hsdp2x2_tp2", "fsdp3_tp2")])
def test_resharded_resume(tmp_path_factory, straight, tmp_path, src, dst):
    train = lambda name: [e for e in LAYOUTS[name][2] if e.startswith("train.")]
    if train(src) != train(dst):
        pytest.fail("the global batch must be the same in both layouts")
    if src == "hsdp2x2_tp2":  # global batch 24: its own never-stopped run (8 ranks)
        sd = tmp_path_factory.mktemp("straight_8")
        r = run(sd, src, ["checkpoint.interval=10"])
        assert r.rc == 0, r.describe()
    else:
        sd = straight(src)
    ref = losses(sd)
    r = run(tmp_path, dst, ["checkpoint.resume=%s" % (sd / "ck" / "step-10")])
    assert r.rc == 0, r.describe()
    assert "(step 10, saved by world %d, now world %d, restart 0, round 0)" % (LAYOUTS[src][0], LAYOUTS[dst][0]) in r.err
    got = losses(tmp_path)
    keys = sorted(k for k in ref if k[1] > 10)
    assert sorted(got) == keys, "the resumed run logged other steps than 11..20"
    d = max_rel(ref, got, keys)
    print("%s (%d ranks) -> %s (%d ranks): %d losses after step 10, max rel diff %.2e (tolerance %.0e)" %
          (src, LAYOUTS[src][0], dst, LAYOUTS[dst][0], len(keys), d, TOL))
    assert d <= TOL


def flip_bit(path, at):
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x10]))


def test_corrupt_shards_fall_back(straight, tmp_path):
    ref = losses(straight("fsdp2"))
    r = run(tmp_path, "fsdp2", ["checkpoint.interval=5"], ["--stop-after", "16"])
    assert r.rc == 0, r.describe()
    ck = tmp_path / "ck"
    assert sorted(os.listdir(ck)) == ["latest", "step-10", "step-15", "step-5"]
    trunc = ck / "step-10" / "shard-1.safetensors"
    with open(trunc, "r+b") as f:
        f.truncate(os.path.getsize(trunc) - 100)
    flipped = ck / "step-15" / "shard-0.safetensors"
    flip_bit(flipped, os.path.getsize(flipped) - 7)  # inside the last tensor's data
    r = run(tmp_path, "fsdp2", ["checkpoint.interval=5", "checkpoint.resume=auto"])
    assert r.rc == 0, r.describe()
    print("\n".join(l for l in r.err.splitlines() if "checkpoint" in l or "resumed" in l))
    assert "%s" % flipped in r.err and "falling back to step-10" in r.err, r.describe()
    assert "%s" % trunc in r.err and "falling back to step-5" in r.err, r.describe()
    assert "resumed from %s/step-5 (step 5" % ck in r.err
    assert "removing %s/step-15" % ck in r.err and "abandoned" in r.err, r.describe()
    got = losses(tmp_path)
    after = sorted(k for k in ref if k[1] > 5)
    diff = [k for k in after if got[k] != ref[k]]
    print("fallback to step-5: %d losses after it, %d differ in any bit (tolerance 0)" % (len(after), len(diff)))
    assert not diff


def replace_once(path, old, new):
    with open(path) as f:
        text = f.read()
    assert text.count(old) == 1, "%s: %r appears %d times" % (path, old, text.count(old))
    with open(path, "w") as f:
        f.write(text.replace(old, new))


def test_tampered_metadata_falls_back(straight, tmp_path):
    ref = losses(straight("serial"))
    r = run(tmp_path, "serial", ["checkpoint.interval=5"], ["--stop-after", "16"])
    assert r.rc == 0, r.describe()
    ck = tmp_path / "ck"
    # One-bit flips: '5' (0x35) -> '4' (0x34) and '0' (0x30) -> '1' (0x31).
    replace_once(ck / "step-15" / "metadata.json", '"optim_step":\t15,', '"optim_step":\t14,')
    replace_once(ck / "step-10" / "metadata.json", '"data_position":\t"160"', '"data_position":\t"161"')
    r = run(tmp_path, "serial", ["checkpoint.interval=5", "checkpoint.resume=auto"])
    print("\n".join(l for l in r.err.splitlines() if "checkpoint" in l or "resumed" in l))
    assert r.rc == 0, r.describe()
    assert "%s: checksum mismatch" % (ck / "step-15" / "metadata.json") in r.err and \
        "falling back to step-10" in r.err, r.describe()
    assert "%s: checksum mismatch" % (ck / "step-10" / "metadata.json") in r.err and \
        "falling back to step-5" in r.err, r.describe()
    assert "resumed from %s/step-5 (step 5" % ck in r.err
    got = losses(tmp_path)
    after = sorted(k for k in ref if k[1] > 5)
    diff = [k for k in after if got[k] != ref[k]]
    print("fallback to step-5: %d losses after it, %d differ in any bit (tolerance 0)" % (len(after), len(diff)))
    assert not diff


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_failed_save_goes_on(straight, tmp_path, mode):
    ref = losses(straight("fsdp2"))
    r = run(tmp_path, "fsdp2", ["checkpoint.interval=5", "checkpoint.keep=0",
                                "checkpoint.async=%s" % ("true" if mode == "async" else "false")],
            env={"MESHRUN_FAULT_SAVE": "1:10"})
    assert r.rc == 0, r.describe()
    warn = [l for l in r.err.splitlines() if "checkpoint of step 10 failed" in l]
    print("\n".join(warn))
    assert len(warn) == 1, r.describe()  # one line, from rank 0; every rank went on
    assert "step-10.tmp/shard-1.safetensors: Input/output error" in warn[0] and "training goes on" in warn[0]
    assert sorted(os.listdir(tmp_path / "ck")) == ["final.safetensors", "latest", "step-15", "step-20", "step-5"]
    got = losses(tmp_path)
    diff = [k for k in ref if got.get(k) != ref[k]]
    print("%s: %d losses, %d differ from the run without the failure (tolerance 0)" % (mode, len(ref), len(diff)))
    assert sorted(got) == sorted(ref) and not diff


def test_failed_final_save_exits_1(tmp_path):
    errfile = tmp_path / "error.json"
    r = run(tmp_path, "serial", ["checkpoint.interval=5"],
            env={"MESHRUN_FAULT_SAVE": "0:20", "TORCHELASTIC_ERROR_FILE": str(errfile)})
    line = r.err.strip().splitlines()[-1]
    print(line)
    assert r.rc == 1, r.describe()
    assert line.startswith("trainer: the checkpoint after the last step (20) was not saved: ") and \
        "Input/output error" in line
    ck = tmp_path / "ck"
    assert sorted(os.listdir(ck)) == ["final.safetensors", "latest", "step-10", "step-15", "step-5"]
    with open(errfile) as f:
        doc = json.load(f)
    print(doc)
    assert "was not saved" in doc["message"]["message"] and doc["message"]["extraInfo"]["timestamp"].isdigit()
    assert "meshrun" not in doc  # a restart may help an i/o error


def test_no_space_stops_at_once(tmp_path):
    ck = tmp_path / "ck"
    ck.mkdir()
    m = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(ck)], capture_output=True, text=True)
    if m.returncode != 0:
        pytest.skip("cannot mount a tmpfs here: %s" % m.stderr.strip())
    try:
        errfile = tmp_path / "error.json"
        # A checkpoint of this model is about 1.6 MB: the first save (step 5) cannot fit.
        r = run(tmp_path, "serial", ["checkpoint.interval=5"], env={"TORCHELASTIC_ERROR_FILE": str(errfile)})
        line = r.err.strip().splitlines()[-1]
        print(line)
        assert r.rc == 1, r.describe()
        assert line.startswith("trainer: the checkpoint of step 5 failed, stopping: ") and \
            "No space left on device" in line
        assert os.listdir(ck) == [], "left behind: %s" % os.listdir(ck)
        assert max(k[1] for k in losses(tmp_path)) == 5  # stopped at once
        with open(errfile) as f:
            doc = json.load(f)
        print(doc)
        assert doc["meshrun"] == {"restart": False}
        assert "No space left on device" in doc["message"]["message"]
    finally:
        subprocess.run(["umount", str(ck)], check=True)


def test_no_space_for_final_weights(tmp_path):
    ck = tmp_path / "ck"
    ck.mkdir()
    # fsdp2's checkpoint of this model is 1.60 MB and its final weights 0.53 MB: 1900 KiB holds
    # the checkpoint after the last step, not the weights after it.
    m = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1900k", "tmpfs", str(ck)], capture_output=True, text=True)
    if m.returncode != 0:
        pytest.skip("cannot mount a tmpfs here: %s" % m.stderr.strip())
    try:
        r = run(tmp_path, "fsdp2", ["checkpoint.interval=0"])
        assert r.rc == 1, r.describe()
        r0 = [l for l in r.err.splitlines() if l.startswith("[rank0]:trainer: ")]
        r1 = [l for l in r.err.splitlines() if l.startswith("[rank1]:trainer: ")]
        print("\n".join(r0 + r1))
        assert len(r0) == 1 and "final.safetensors" in r0[0] and "No space left on device" in r0[0], r.describe()
        assert len(r1) == 1 and "were not saved (rank 0 says why)" in r1[0], r.describe()
        assert sorted(os.listdir(ck)) == ["latest", "step-20"]
    finally:
        subprocess.run(["umount", str(ck)], check=True)


def test_no_space_on_one_rank_stops_every_rank(tmp_path):
    r = run(tmp_path, "fsdp2", ["checkpoint.interval=5"], env={"MESHRUN_FAULT_SAVE": "1:10:ENOSPC"})
    assert r.rc == 1, r.describe()
    for rank in range(2):
        lines = [l for l in r.err.splitlines() if l.startswith("[rank%d]:" % rank) and
                 "trainer: the checkpoint of step 10 failed, stopping: " in l]
        print(lines)
        assert len(lines) == 1 and "shard-1.safetensors: No space left on device" in lines[0], r.describe()
    assert sorted(os.listdir(tmp_path / "ck")) == ["latest", "step-5"]
    assert max(k[1] for k in losses(tmp_path)) == 10


def test_wrong_shape_and_batch_refused(straight, tmp_path):
    src = straight("serial") / "ck" / "step-10"
    r = run(tmp_path, "serial", ["checkpoint.resume=%s" % src, "model.n_layers=3"])
    print(r.err.strip().splitlines()[-1])
    assert r.rc == 2, r.describe()
    assert "n_layers" in r.err and "step-10" in r.err, r.describe()
    r = run(tmp_path, "serial", ["checkpoint.resume=%s" % src, "train.global_batch_size=8"])
    print(r.err.strip().splitlines()[-1])
    assert r.rc == 2, r.describe()
    assert "global_batch_size" in r.err, r.describe()
    r = run(tmp_path, "serial", ["checkpoint.resume=%s" % (tmp_path / "nowhere")])
    assert r.rc == 2 and "no such checkpoint" in r.err, r.describe()


def test_resume_on_another_world_keeps_the_global_batch(tmp_path):
    """A plan that leaves train.global_batch_size unset gets micro-batch x dp, which changes with
    the world; a resume takes the checkpoint's instead (one line says so), so fsdp2's checkpoint
    (global batch 2 x 2 = 4) resumes in one process as 2 x 1 x 2 accumulation steps, on the losses
    of the run that kept its world (tolerance 1e-4 relative). A world that cannot make that batch
    from its micro-batches is refused, naming the checkpoint. Before: exit 2, "set
    train.global_batch_size=4"."""
    plan = tiny_plan()
    del plan["train"]["global_batch_size"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    straight.mkdir()
    resumed.mkdir()
    r = run(straight, "fsdp2", ["checkpoint.interval=10"], plan=plan)
    assert r.rc == 0, r.describe()
    src = straight / "ck" / "step-10"
    args = [write_plan(resumed, plan)] + layout_sets(resumed, "serial", ["checkpoint.resume=%s" % src])
    r = subprocess.run([TRAINER] + args, cwd=str(resumed), env=clean_env(), capture_output=True, text=True,
                       timeout=120)
    line = [l for l in r.stderr.splitlines() if "train.global_batch_size=4 as" in l]
    print(line[0] if line else r.stderr[-2000:])
    assert r.returncode == 0, r.stderr[-2000:]
    assert line and "micro-batch 2 x dp 1 x 2 accumulation steps" in line[0]
    ref, got = losses(straight), losses(resumed)
    keys = sorted(k for k in ref if k[1] > 10)
    assert sorted(got) == keys
    d = max_rel(ref, got, keys)
    print("fsdp2 -> one process, global batch carried: max rel diff %.2e over %d losses (tolerance %.0e)" %
          (d, len(keys), TOL))
    assert d <= TOL
    r = subprocess.run([TRAINER] + args + ["--set", "train.micro_batch_size=3"], cwd=str(resumed), env=clean_env(),
                       capture_output=True, text=True, timeout=120)
    print(r.stderr.strip().splitlines()[-1])
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith(
        "plan error: train.global_batch_size: 4 is not a multiple of train.micro_batch_size 3") and str(src) in r.stderr


def lock_line(d):
    with open(os.path.join(str(d), "ck", "meshrun.lock")) as f:
        return f.read().strip()


def test_two_runs_one_checkpoint_dir(tmp_path):
    """Two runs on one checkpoint.dir: the second is refused before step 1 (exit 2, one line
    naming the holder's host and pid) instead of pruning the first's checkpoints; once the first
    is killed (-9: its lock stays behind), a run takes the lock over with one line and resumes.
    Before: both ran and exited 0, every surviving checkpoint the other's."""
    from test_preemption import wait_metrics_step
    args = [TRAINER, write_plan(tmp_path)] + layout_sets(tmp_path, "serial", ["train.steps=100000",
                                                                             "checkpoint.interval=2"])
    first = subprocess.Popen(args, cwd=str(tmp_path), env=clean_env(), stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    try:
        wait_metrics_step(tmp_path, 3, first)
        held = lock_line(tmp_path)
        print("lock:", held)
        assert held.startswith("host ") and " pid %d job - since " % first.pid in held
        other = tmp_path / "other"
        other.mkdir()
        r = run(other, "fsdp2", ["checkpoint.dir=%s" % (tmp_path / "ck"), "checkpoint.resume=auto", "seed=7"])
        line = r.err.strip().splitlines()[-1] if r.err.strip() else ""
        print(line)
        assert r.rc == 2 and "plan error: checkpoint.dir: %s is in use by another run (host " % (tmp_path / "ck") in r.err
        assert "pid %d, job -," % first.pid in r.err and "step 1/" not in r.err, r.describe()
        assert first.poll() is None and lock_line(tmp_path) == held
    finally:
        first.kill()
        first.wait()
    with open(tmp_path / "ck" / "latest") as f:
        upto = int(f.read().strip().split("-")[1]) + 2
    r = run(tmp_path / "other", "serial", ["checkpoint.dir=%s" % (tmp_path / "ck"), "checkpoint.resume=auto",
                                           "train.steps=%d" % upto])
    taken = [l for l in r.err.splitlines() if "taking over the lock of pid %d" % first.pid in l]
    print(taken[0] if taken else r.describe())
    assert r.rc == 0 and len(taken) == 1 and "which is gone" in taken[0], r.describe()
    assert not os.path.exists(tmp_path / "ck" / "meshrun.lock"), "the lock outlived its run"


@pytest.mark.parametrize("case", ["other_host_alive", "other_host_stale", "same_job", "garbage"])
def test_checkpoint_lock_holders(tmp_path, case):
    """A lock from another host is refused while it is touched (its holder's heartbeat) and taken
    over once untouched for 60 s; a lock of the same meshrun job (MESHRUN_JOB_ID: a restart or a
    later round) is taken over without a word; a file that is no lock of ours is taken over with a
    warning. Every run that took it removes it at its end."""
    ck = tmp_path / "ck"
    ck.mkdir()
    lock = ck / "meshrun.lock"
    job = "none@127.0.0.1:29400"
    text = {"same_job": "host elsewhere pid 1 job %s since 1700000000\n" % job, "garbage": "not a lock\n"}
    lock.write_text(text.get(case, "host elsewhere pid 1 job other@x:1 since 1700000000\n"))
    if case == "other_host_stale":
        old = lock.stat().st_mtime - 120
        os.utime(lock, (old, old))
    r = run(tmp_path, "serial", ["train.steps=2"], env={"MESHRUN_JOB_ID": job})
    print(r.err.strip().splitlines()[-1] if case == "other_host_alive" else
          [l for l in r.err.splitlines() if "lock" in l])
    if case == "other_host_alive":
        assert r.rc == 2 and "in use by another run (host elsewhere, pid 1, job other@x:1, since 2023-11-14T22:13:20Z" \
            "; its lock was touched " in r.err and "s ago, and one left for 60s is taken over)" in r.err, r.describe()
        assert lock.read_text().startswith("host elsewhere")
        return
    assert r.rc == 0, r.describe()
    warned = [l for l in r.err.splitlines() if "taking over" in l or "taking it over" in l]
    assert len(warned) == (0 if case == "same_job" else 1), warned
    assert not lock.exists()


def test_diverged_checkpoint_is_not_resumed(tmp_path):
    """A checkpoint whose files are intact but whose values are not all finite was saved by a run
    that diverged: here train.lr=1e39 from step 3 (resumed from step-2) overflows the parameters in
    step 3's update, step-3 is saved, and step 4's loss is nan (exit 1). Resuming it (auto) under
    fsdp2 with --max_restarts=2 stops both ranks at once, exit 2 with no restart spent, one line
    naming step-3, the tensor and the element, and step-2, which auto does not fall back to (the
    same plan would replay the same batches into the same divergence); `trainer sample` refuses
    step-3 too; named, step-2 resumes and the run ends (exit 0). Before the check, the resume
    loaded step-3, step 4's loss was nan, exit 1, and meshrun spent its restarts on it."""
    base = ["train.steps=4", "train.decay=constant", "eval.interval=0", "checkpoint.interval=1", "checkpoint.keep=0"]
    r = run(tmp_path, "serial", base, flags=["--stop-after", "2"])
    assert r.rc == 0, r.describe()
    r = run(tmp_path, "serial", base + ["checkpoint.resume=auto", "train.lr=1e39"])
    assert r.rc == 1 and "loss is nan at step 4" in r.err, r.describe()
    ck = tmp_path / "ck"
    assert sorted(x for x in os.listdir(ck) if x.startswith("step-")) == ["step-1", "step-2", "step-3"]

    m = Meshrun(["--nproc_per_node=2", "--max_restarts=2", "--rdzv_conf=" + FAST_CONF, TRAINER, write_plan(tmp_path)] +
                layout_sets(tmp_path, "fsdp2", base + ["checkpoint.resume=auto"]),
                env={"OMP_NUM_THREADS": "1"}, cwd=str(tmp_path))
    rc = m.wait(120)
    pat = re.compile(r"checkpoint error: %s/step-3: tensor (param|adam_m|adam_v)/\S+ element \d+ is (nan|inf|-inf) "
                     r"\(not a finite number\); .*does not fall back to step-2" % re.escape(str(ck)))
    named = [l for l in m.err.splitlines() if l.startswith("[rank") and pat.search(l)]
    for l in named:
        print("  " + l)
    assert rc == 2 and "no restart tried" in m.err, m.describe()
    assert {l.split("]:")[0] for l in named} == {"[rank0", "[rank1"}, m.describe()
    assert "resumed from" not in m.err, m.describe()

    s = subprocess.run([TRAINER, "sample", "--weights", str(ck / "step-3")], cwd=str(tmp_path), env=clean_env(),
                       capture_output=True, text=True, timeout=60)
    print(s.stderr.strip().splitlines()[-1])
    assert s.returncode == 2 and re.search(r"checkpoint error: .*step-3: tensor \S+ element \d+ is", s.stderr), s.stderr
    r = run(tmp_path, "serial", base + ["checkpoint.resume=step-2"])
    assert r.rc == 0 and "resumed from %s/step-2" % ck in r.err, r.describe()


# ---------------------------------------------------------------------------------------- interop

def test_export_and_reimport(straight, tmp_path):
    weights = straight("serial") / "ck" / "final.safetensors"
    ref = None
    for fmt, out in [("llama2c", tmp_path / "model.bin"), ("hf", tmp_path / "hf")]:
        r = subprocess.run([TRAINER, "export", "--format", fmt, write_plan(tmp_path), "--weights", str(weights),
                            "--out", str(out)], cwd=str(tmp_path), env=clean_env(), capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == 0, r.stderr
        assert os.path.exists(out)
    # One step from each: the same weights, so the same first loss bits.
    firsts = {}
    for label, init in [("ours", weights), ("llama2c", tmp_path / "model.bin"), ("hf", tmp_path / "hf")]:
        d = tmp_path / ("run_" + label)
        d.mkdir()
        r = run(d, "serial", ["model.init=%s" % init, "train.steps=1", "eval.interval=0"])
        assert r.rc == 0, r.describe()
        firsts[label] = losses(d)[(False, 1)]
    print("first loss from our weights %.9g, from llama2.c export %.9g, from HF export %.9g (tolerance 0)" %
          (firsts["ours"], firsts["llama2c"], firsts["hf"]))
    assert firsts["llama2c"] == firsts["ours"] and firsts["hf"] == firsts["ours"]
    # and under a mesh (fsdp2 shards what interop reads)
    d = tmp_path / "run_hf_fsdp2"
    d.mkdir()
    r = run(d, "fsdp2", ["model.init=%s" % (tmp_path / "hf"), "train.steps=1", "eval.interval=0"])
    assert r.rc == 0, r.describe()
    got = losses(d)[(False, 1)]
    print("fsdp2 from the HF export: %.9g (rel diff %.2e, tolerance %.0e)" %
          (got, abs(got - firsts["ours"]) / firsts["ours"], TOL))
    assert abs(got - firsts["ours"]) <= TOL * firsts["ours"]
    # a plan of another shape is refused before the device starts, naming the key and its value
    r = run(tmp_path, "serial", ["model.init=%s" % (tmp_path / "model.bin"), "model.n_kv_heads=4"])
    print(r.err.strip().splitlines()[-1])
    assert r.rc == 2 and "model.bin: n_kv_heads 2 but the plan says 4 (set model.n_kv_heads=2)" in r.err, r.describe()


def layout(tmp_path, config, files):
    """A copy of the repository's layout in tmp_path: configs/CONFIG and the data files named
    (REPO-relative source, tmp-relative destination), so a plan's ../data paths resolve there."""
    (tmp_path / "configs").mkdir()
    shutil.copy(os.path.join(REPO, "configs", config), tmp_path / "configs" / config)
    for src, dst in files:
        (tmp_path / dst).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(src, tmp_path / dst)
    return str(tmp_path / "configs" / config)


def test_stories260k_config(tmp_path):
    """configs/stories260K.json reads data/stories260K.bin (from its own folder: ../data); without
    the file, the plan error says where llama2.c's checkpoints come from."""
    bin_path = os.path.join(REPO, "..", "shared", "data", "stories260K.bin")
    data = [(os.path.join(REPO, "data", f), "data/" + f) for f in ("tinyshakespeare.txt", "tinyshakespeare-bpe512.json")]
    bare = tmp_path / "bare"
    bare.mkdir()
    r = subprocess.run([TRAINER, layout(bare, "stories260K.json", data), "--set", "train.steps=2"], cwd=bare,
                       env=clean_env(), capture_output=True, text=True, timeout=120)
    print(r.stderr.strip().splitlines()[-1])
    assert r.returncode == 2 and "model.init: %s/data/stories260K.bin: No such file" % os.path.realpath(bare) in r.stderr
    assert "huggingface.co/karpathy/tinyllamas" in r.stderr, r.stderr
    if not os.path.exists(bin_path):
        pytest.skip("no %s" % bin_path)
    full = tmp_path / "full"
    full.mkdir()
    plan = layout(full, "stories260K.json", data + [(bin_path, "data/stories260K.bin")])
    r = subprocess.run([TRAINER, plan, "--set", "train.steps=2", "--set", "sample.tokens=8", "--set",
                        "checkpoint.dir=%s" % (tmp_path / "ck")],
                       cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    want = "model.init: %s (llama2c" % os.path.realpath(full / "data" / "stories260K.bin")
    assert "step 2/2" in r.stderr and want in r.stderr, r.stderr


def test_stories_config_says_how_data_is_made(tmp_path):
    """configs/stories.json before `make stories`: the missing shard's plan error names
    tools/prepare_data.py."""
    r = subprocess.run([TRAINER, layout(tmp_path, "stories.json", []), "--set", "train.steps=1"], cwd=tmp_path,
                       env=clean_env(), capture_output=True, text=True, timeout=60)
    line = r.stderr.strip().splitlines()[-1]
    print(line)
    assert r.returncode == 2 and line.startswith("plan error: data.") and "tools/prepare_data.py" in line
