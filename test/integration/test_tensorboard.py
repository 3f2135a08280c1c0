"""test_tensorboard: log.tensorboard_dir, read back by TensorBoard's own reader.

What: cpu runs of a tiny plan write TensorBoard event files beside their metrics file; TensorBoard's
EventAccumulator (the PyPI `tensorboard` package, which checks every record's CRCs) reads the
folder, and every scalar must be the number of the metrics file's record: each step record's
numeric fields as train/<key> (train/mfu where log.peak_tflops gives a peak), each eval as
eval/loss, no other tag or step. Cases:
- one process, 12 steps with evals: one file, file version 2, wall times within the run's;
- a run killed by SIGKILL mid-run (no close, no flush at exit), then resumed from its newest
  checkpoint: the killed run's file holds every step it logged, and the folder reads as one run,
  each step once with the values the metrics file logged last for it (the resumed run's START
  record makes TensorBoard drop the killed run's steps past the checkpoint);
- two ranks under meshrun: rank 0 alone writes, its values (the loss is float32 there: exact);
- plan errors (exit 2, one line, before step 1): a folder that cannot be made, one that is a
  file, and a fresh run beside an earlier run's events (overwrite=true then shows the new run
  alone, and a restart of a meshrun job continues without it).
Tolerance: a value that was a float32 (the loss averaged over dp ranks) or an integer must be
equal to the metrics file's, as float32; any other within the metrics file's printed precision
(%.9g, %.6g: relative; %.1f, %.3f, %.6f: absolute) plus one float32 ulp (the event holds the
value rounded to float32, the metrics file the double rounded to its digits). The largest
difference is printed, as a share of its bound.
TensorBoard must be importable (scripts/install-deps.sh installs it for /usr/bin/python3): without
it these tests fail.
"""
import json
import os
import subprocess
import time

import numpy as np
import pytest

from conftest import FAST_CONF, Meshrun, bin_dir, solo_env, tiny_plan, wait_for

try:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    IMPORT_ERROR = None
except ImportError as e:  # reported by the tests, which fail
    EventAccumulator, IMPORT_ERROR = None, e

TRAINER = os.path.join(bin_dir(), "trainer")
PLAN = tiny_plan(eval={"interval": 4, "batches": 1})
# The metrics file's numeric step fields and how it prints them: (kind, precision) with kind
# "rel" (%.9g, %.6g), "abs" (%.Nf) or "int".
FIELDS = {"loss": ("rel", 5e-9), "lr": ("rel", 5e-9), "grad_norm": ("rel", 5e-9), "tokens_per_s": ("abs", 0.05),
          "flops_per_s": ("rel", 5e-6), "mfu": ("abs", 5e-7), "peak_mem_bytes": ("int", 0),
          "step_ms": ("abs", 5e-4), "compute_ms": ("abs", 5e-4), "comm_wait_ms": ("abs", 5e-4),
          "straggler_spread_pct": ("abs", 5e-4)}


def accumulator(folder):
    if EventAccumulator is None:
        pytest.fail("TensorBoard is not importable (%s): scripts/install-deps.sh installs it "
                    "(/usr/bin/python3 -m pip install --break-system-packages tensorboard)" % IMPORT_ERROR)
    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0})  # 0: keep every event
    acc.Reload()
    return acc


def tb_scalars(folder):
    """{tag: [(step, value, wall_time)]} as TensorBoard reads the folder."""
    acc = accumulator(folder)
    return acc, {t: [(e.step, e.value, e.wall_time) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}


def metrics_expected(path):
    """{tag: {step: (value, field)}} from the metrics file, the last record of a step winning (a
    resumed run logs again the steps after its checkpoint); a torn last line is skipped."""
    want = {}
    with open(path) as f:
        for line in f:
            try:
                r = json.loads(line)
            except ValueError:
                continue
            if "eval_loss" in r:
                want.setdefault("eval/loss", {})[r["step"]] = (r["eval_loss"], "loss")
            elif "loss" in r:
                for k in FIELDS:
                    if r.get(k) is not None:
                        want.setdefault("train/" + k, {})[r["step"]] = (r[k], k)
    return want


def close_enough(got, v, field, exact):
    """How far TensorBoard's got is from the metrics file's v, as a share of the bound (0 when
    equal); None when out of bounds. exact: fields whose values were float32 (the metrics file's
    %.9g reads back as the same float32)."""
    kind, prec = FIELDS[field]
    if kind == "int" or field in exact:
        return 0.0 if got == float(np.float32(v)) else None
    diff = abs(got - v)
    bound = (prec * abs(v) if kind == "rel" else prec) + float(np.spacing(np.float32(abs(v))))
    return diff / bound if diff <= bound else None


def compare(tb, want, exact=()):
    """Every tag and step of want in tb with its value, each step once, and nothing else. Prints
    the largest difference as a share of its bound."""
    worst = (-1.0, "", 0)
    assert set(tb) == set(want), (sorted(tb), sorted(want))
    for tag, steps in want.items():
        got = {s: v for s, v, _ in tb[tag]}
        assert len(got) == len(tb[tag]), "%s: a step twice: %s" % (tag, [s for s, _, _ in tb[tag]])
        assert sorted(got) == sorted(steps), "%s: TensorBoard's steps %s, the metrics' %s" % (
            tag, sorted(got), sorted(steps))
        for s, g in got.items():
            v, field = steps[s]
            d = close_enough(g, v, field, exact)
            assert d is not None, "%s step %d: TensorBoard %r, metrics %r" % (tag, s, g, v)
            worst = max(worst, (d, tag, s))
    print("%d tags, %d values; largest difference %.2f of its bound (%s, step %s)" %
          (len(tb), sum(len(v) for v in tb.values()), *worst))


def run(d, sets, flags=(), env=None, timeout=120):
    args = [TRAINER, str(d / "plan.json")] + list(flags)
    for s in sets:
        args += ["--set", s]
    return subprocess.run(args, cwd=str(d), env=env or solo_env(), capture_output=True, text=True,
                          errors="replace", timeout=timeout)


def outputs(d):
    (d / "plan.json").write_text(json.dumps(PLAN))
    return ["log.metrics_file=%s" % (d / "m.jsonl"), "log.tensorboard_dir=%s" % (d / "tb"),
            "checkpoint.dir=%s" % (d / "ck")]


def event_files(d):
    return sorted(f for f in os.listdir(d / "tb") if "tfevents" in f)


def test_scalars_are_the_metrics_records(tmp_path):
    sets = outputs(tmp_path) + ["train.steps=12", "log.peak_tflops=0.001"]
    t0 = time.time()
    r = run(tmp_path, sets)
    t1 = time.time()
    assert r.returncode == 0, r.stderr
    files = event_files(tmp_path)
    print(files)
    assert len(files) == 1 and files[0].startswith("events.out.tfevents.")
    acc, tb = tb_scalars(tmp_path / "tb")
    assert acc.file_version == 2.0
    want = metrics_expected(tmp_path / "m.jsonl")
    assert "train/mfu" in want and sorted(want["eval/loss"]) == [4, 8, 12]
    assert sorted(want["train/loss"]) == list(range(1, 13))
    compare(tb, want)
    walls = [w for _, _, w in tb["train/loss"]]
    assert walls == sorted(walls) and t0 - 1 <= walls[0] and walls[-1] <= t1 + 1


def test_killed_then_resumed_reads_as_one_run(tmp_path):
    """Killed (SIGKILL) while stalled before step 9 (MESHRUN_FAULT_STALL), its checkpoint at 6:
    the resumed run logs steps 7 and 8 again."""
    sets = outputs(tmp_path) + ["train.steps=12", "checkpoint.interval=3", "checkpoint.resume=auto",
                                "sample.tokens=0"]
    args = [TRAINER, str(tmp_path / "plan.json")]
    for s in sets:
        args += ["--set", s]
    log = tmp_path / "killed.log"
    with open(log, "wb") as err:
        p = subprocess.Popen(args, cwd=str(tmp_path), env=solo_env(MESHRUN_FAULT_STALL="0:9"),
                             stdout=subprocess.DEVNULL, stderr=err)
    try:
        wait_for(lambda: "stalling before step 9" in log.read_text() or p.poll() is not None, 120,
                 "the stall before step 9")
        assert p.poll() is None, log.read_text()
    finally:
        p.kill()
        p.wait()
    want = metrics_expected(tmp_path / "m.jsonl")
    assert sorted(want["train/loss"]) == list(range(1, 9))
    _, tb = tb_scalars(tmp_path / "tb")
    compare(tb, want)

    r = run(tmp_path, sets)
    assert r.returncode == 0, r.stderr
    starts = [json.loads(l)["start_step"] for l in open(tmp_path / "m.jsonl") if '"start_step"' in l]
    assert starts == [0, 6]  # resumed from the checkpoint of step 6
    files = event_files(tmp_path)
    print(files)
    assert len(files) == 2
    want = metrics_expected(tmp_path / "m.jsonl")
    assert sorted(want["train/loss"]) == list(range(1, 13))
    _, tb = tb_scalars(tmp_path / "tb")
    compare(tb, want)


def test_only_rank_0_writes(tmp_path):
    sets = outputs(tmp_path) + ["mesh.dp_shard=2", "train.steps=6", "sample.tokens=0"]
    args = ["--nproc_per_node=2", "--rdzv_conf=" + FAST_CONF, TRAINER, str(tmp_path / "plan.json")]
    for s in sets:
        args += ["--set", s]
    m = Meshrun(args, env={"OMP_NUM_THREADS": "1"}, cwd=str(tmp_path))
    assert m.wait(180) == 0, m.err
    files = event_files(tmp_path)
    print(files)
    assert len(files) == 1
    _, tb = tb_scalars(tmp_path / "tb")
    compare(tb, metrics_expected(tmp_path / "m.jsonl"), exact={"loss"})  # averaged over dp in float32


def test_plan_errors(tmp_path):
    base = outputs(tmp_path) + ["train.steps=2", "sample.tokens=0"]
    (tmp_path / "f").write_text("a file, not a folder\n")
    for tb, says in [(tmp_path / "f" / "tb", "cannot create"), (tmp_path / "f", "exists and is not a directory")]:
        r = run(tmp_path, base + ["log.tensorboard_dir=%s" % tb])
        line = r.stderr.strip().splitlines()[-1]
        print(line)
        assert r.returncode == 2 and line.startswith("plan error: log.tensorboard_dir: ") and says in line, r.stderr
        assert "step 1/" not in r.stderr

    # an earlier run's events: refused afresh; continued by a restart; replaced with overwrite
    assert run(tmp_path, base + ["train.steps=4"]).returncode == 0
    os.rename(tmp_path / "ck", tmp_path / "ck-earlier")
    (tmp_path / "m.jsonl").unlink()
    r = run(tmp_path, base)
    line = r.stderr.strip().splitlines()[-1]
    print(line)
    assert r.returncode == 2 and line.startswith("plan error: log.tensorboard_dir: "), r.stderr
    assert event_files(tmp_path)[0] in line and "overwrite=true" in line and "step 1/" not in r.stderr
    r = run(tmp_path, base + ["seed=99"], env=solo_env(TORCHELASTIC_RESTART_COUNT="1"))
    assert r.returncode == 0, r.stderr
    (tmp_path / "m.jsonl").unlink()
    r = run(tmp_path, base + ["seed=5", "overwrite=true"])
    assert r.returncode == 0, r.stderr
    assert len(event_files(tmp_path)) == 3
    _, tb = tb_scalars(tmp_path / "tb")
    compare(tb, metrics_expected(tmp_path / "m.jsonl"))  # the last run's 2 steps alone
