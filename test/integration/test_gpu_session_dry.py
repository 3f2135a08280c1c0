"""test_gpu_session_dry: scripts/gpu-session.sh --dry-run, the GPU window's one command, run here
whole (device cpu, no PyTorch, no GPU test binaries) on the programs this checkout built, so that
a stage that would break on the GPU machine breaks here first.

Every stage passes and says so in results.jsonl, line by line; the output folder holds only
results.jsonl and session.log (the device tool brings back at most 8 files); the benchmark's rows
carry the trainer's counts of kernels and host syncs per step; and the run ends within its own
budget. Without --dry-run and without a kit, the script stops at once saying where the kit should
be."""
import json
import os
import subprocess
import time

from conftest import bin_dir

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
SCRIPT = os.path.join(ROOT, "scripts", "gpu-session.sh")


def run(args, tmp_path, timeout):
    env = dict(os.environ, MESHRUN_BIN=bin_dir(), KIT=str(tmp_path / "no-kit"))
    t0 = time.time()
    r = subprocess.run([SCRIPT] + args, capture_output=True, text=True, timeout=timeout, env=env)
    return r, time.time() - t0


def test_dry_run_passes_every_stage(tmp_path):
    out = tmp_path / "out"
    budget = 300
    r, took = run(["--dry-run", "--budget", str(budget), str(out)], tmp_path, budget + 60)
    print(r.stdout[-3000:], r.stderr[-2000:])
    assert r.returncode == 0, r.stdout[-2000:]
    assert "dry run without a kit" in r.stdout
    assert sorted(os.listdir(out)) == ["results.jsonl", "session.log"]
    recs = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    stages = [x for x in recs if "seconds" in x]
    print("%d stages in %.0f s: %s" % (len(stages), took, [(x["check"], x["result"]) for x in stages]))
    assert [x["check"] for x in stages] == ["versions", "smoke", "kernels", "bench tiny", "training", "attention",
                                            "sanitizer"]
    assert all(x["result"] == "pass" for x in stages), stages
    assert all(x["result"] == "pass" for x in recs if x.get("check") == "test-gpu")
    rows = [x for x in recs if x.get("check") == "bench"]
    assert [x["impl"] for x in rows] == ["ours", "ours reference", "ours no graphs"]
    for row in rows:  # the cpu records no step: every step's calls are its kernels
        assert row["tokens_per_s"] > 0 and row["kernels_per_step"] > 0 and row["host_syncs_per_step"] == 1, row
        assert row["graph"] == "none" and "host_calls_per_step" not in row, row
    assert took < budget


def test_without_kit_says_where(tmp_path):
    r, _ = run([str(tmp_path / "out")], tmp_path, 60)
    print(r.stdout, r.stderr)
    assert r.returncode == 1
    assert "gpu-session: no kit at %s" % (tmp_path / "no-kit") in r.stdout
