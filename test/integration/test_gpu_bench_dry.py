"""The GPU window's benchmark and kernel profile, dry-run on the cpu (bench/bench_gpu.py with
--device cpu, the path scripts/gpu-session.sh --dry-run takes): the trainer's MESHRUN_OP_PROFILE
table is printed for the chosen step only, its kernel times add up to no more than that step,
and the measured row lands in --results as JSON. A broken stage shows here, before GPU time is
spent on it.

Also: MESHRUN_OP_PROFILE with a bad value is refused at start with a one-line message and
status 2."""
import json
import os
import re
import subprocess
import sys

from conftest import PYTHON, bin_dir

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def test_bench_dry_run_profile_and_results(tmp_path):
    results = tmp_path / "results.jsonl"
    r = subprocess.run([PYTHON, os.path.join(ROOT, "bench", "bench_gpu.py"), "--bin", bin_dir(), "--sizes", "tiny",
                        "--device", "cpu", "--no-torch", "--profile", "--steps", "3", "--warmup", "2",
                        "--results", str(results)], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    print(r.stdout[-3000:], r.stderr[-2000:])
    assert r.returncode == 0
    heads = re.findall(r"op profile of step (\d+) on cpu: (\d+) kernel calls, ([\d.]+) ms in kernels of a ([\d.]+) ms step",
                       r.stdout)
    assert len(heads) == 1, "one profile, of the last warmup step"
    step, calls, in_k, step_ms = int(heads[0][0]), int(heads[0][1]), float(heads[0][2]), float(heads[0][3])
    print("profiled step %d: %d calls, %.2f of %.2f ms" % (step, calls, in_k, step_ms))
    assert step == 2
    assert calls > 50
    assert 0 < in_k <= step_ms + 0.05  # the printed figures are rounded to 0.1 ms
    for op in ("matmul", "attention_fwd", "attention_bwd", "adamw_multi", "cross_entropy", "(outside)"):
        assert re.search(r"^  %s\s" % re.escape(op), r.stdout, re.M), op
    rows = [json.loads(line) for line in results.read_text().splitlines()]
    print(rows)
    # ours (model.attention auto), then ours with the reference kernels; one profile, of the first
    assert [row["impl"] for row in rows] == ["ours", "ours reference"]
    for row in rows:
        assert row["check"] == "bench" and row["model"] == "tiny"
        assert row["mode"] == "bf16 mixed"
        assert row["tokens_per_s"] > 0
        # what a step asked of the device: the trainer's counts (of the last step, which reads the
        # loss and norm of the steps before it back in one copy), carried into every row of ours
        assert row["kernels_per_step"] > 50 and row["host_syncs_per_step"] == 1, row


def test_op_profile_bad_value_refused(tmp_path):
    r = subprocess.run([os.path.join(bin_dir(), "trainer"), os.path.join(ROOT, "configs", "tiny.json"),
                        "--set", "train.steps=1", "--set", "checkpoint.dir=%s" % tmp_path],
                       capture_output=True, text=True, timeout=120, env=dict(os.environ, MESHRUN_OP_PROFILE="two"))
    print(r.stderr)
    assert r.returncode == 2
    lines = [ln for ln in r.stderr.splitlines() if "MESHRUN_OP_PROFILE" in ln]
    assert len(lines) == 1 and "positive integer" in lines[0]
