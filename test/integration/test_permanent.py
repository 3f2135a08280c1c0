"""test_permanent: a failure no restart can cure ends the job at once, with one line.

Each case runs bin/trainer under bin/meshrun with --max_restarts=3 on the tiny Llama of the
trainer tests (cpu backend, one rank) and counts the rendezvous rounds meshrun started (its
"round N: node 0 of 1" lines). A permanent failure is a plan or input error (exit 2, which meshrun
never retries) found before the device starts where it can be: weights in model.init that are cut
short or not weights at all (their headers are read first); a model or micro-batch that cannot fit
this machine's memory (a lower bound from the plan: parameters, gradients and AdamW moments, and
one micro-batch's logits, against RAM + swap or the cgroup's limit); a checkpoint directory where
no checkpoint is intact under checkpoint.resume auto; device "cuda" with no GPU visible. A loss
that turns non-finite again in a restart that replayed the run from the same state (training is
deterministic) is permanent too: exit 1 with {"meshrun": {"restart": false}} after one restart.
Before: each of these spent all 3 restarts (4 rounds), and the sizes took an allocation failure or
an out-of-memory kill to end.
"""
import json
import os
import shutil
import subprocess

import pytest

from conftest import FAST_CONF, Meshrun, bin_dir, tiny_plan

TRAINER = os.path.join(bin_dir(), "trainer")


def job(d, sets, timeout=120):
    plan = os.path.join(str(d), "plan.json")
    with open(plan, "w") as f:
        json.dump(tiny_plan(), f)
    args = ["--nproc_per_node=1", "--max_restarts=3", "--rdzv_conf=" + FAST_CONF, TRAINER, plan]
    for s in sets:
        args += ["--set", s]
    m = Meshrun(args, env={"OMP_NUM_THREADS": "1"}, cwd=str(d))
    rc = m.wait(timeout)
    rounds = [l for l in m.err.splitlines() if "[meshrun] round " in l and ": node 0 of 1" in l]
    return rc, len(rounds), m


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    """A tiny model's final.safetensors (2 steps)."""
    d = tmp_path_factory.mktemp("weights")
    with open(d / "plan.json", "w") as f:
        json.dump(tiny_plan(), f)
    r = subprocess.run([TRAINER, str(d / "plan.json"), "--set", "train.steps=2"], cwd=str(d), capture_output=True,
                       text=True, timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 0, r.stderr
    return d / "out" / "plan" / "final.safetensors"


def corrupt_checkpoints(d):
    """ck/ with a step-2 whose metadata fails its checksum (every checkpoint there damaged)."""
    r = subprocess.run([TRAINER, os.path.join(str(d), "plan.json"), "--set", "train.steps=2", "--set",
                        "checkpoint.dir=%s" % (d / "ck")], cwd=str(d), capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 0, r.stderr
    meta = d / "ck" / "step-2" / "metadata.json"
    text = meta.read_text().rstrip()
    assert text.endswith("}")
    meta.write_text(text[:-1] + " }\n")  # one byte more than its checksum covers
    os.remove(d / "ck" / "final.safetensors")


CASES = {
    "truncated_init": ([], "data_offsets outside"),
    "not_weights_init": ([], "is not our safetensors, a Hugging Face folder or a llama2.c version 0 file"),
    "n_layers": (["model.n_layers=1000000000"], "plan error: model: one rank needs at least"),
    "micro_batch": (["train.micro_batch_size=1000000000", "train.global_batch_size=1000000000"], "plan error: model: one rank needs at least"),
    "vocab": (["model.vocab_size=50000000"], "plan error: model: one rank needs at least"),
    "corrupt_checkpoints": (["checkpoint.resume=auto"], "no intact checkpoint in"),
    "cuda_without_gpu": (["device=cuda"], "cuda"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_permanent_failure_ends_the_job_at_once(tmp_path, weights, case):
    sets, says = CASES[case]
    sets = list(sets)
    if case == "truncated_init":
        data = weights.read_bytes()
        (tmp_path / "t.safetensors").write_bytes(data[:len(data) // 2])
        sets.append("model.init=%s" % (tmp_path / "t.safetensors"))
    elif case == "not_weights_init":
        (tmp_path / "t.bin").write_bytes(b"x" * 64)
        sets.append("model.init=%s" % (tmp_path / "t.bin"))
    elif case == "corrupt_checkpoints":
        with open(tmp_path / "plan.json", "w") as f:
            json.dump(tiny_plan(), f)
        corrupt_checkpoints(tmp_path)
        sets.append("checkpoint.dir=%s" % (tmp_path / "ck"))
    elif case == "cuda_without_gpu" and shutil.which("nvidia-smi") and \
            subprocess.run(["nvidia-smi", "-L"], capture_output=True).returncode == 0:
        pytest.skip("a GPU is visible here")
    rc, rounds, m = job(tmp_path, sets)
    line = [l for l in m.err.splitlines() if says in l]
    print("rc %d after %d round(s): %s" % (rc, rounds, line[0][:300] if line else m.err[-1500:]))
    assert rc == 2 and rounds == 1 and line, m.describe()
    assert "step 1/" not in m.err


def test_divergence_replayed_is_permanent(tmp_path):
    """train.lr=1e308: the loss is nan at step 2; the first restart replays the run bit for bit and
    diverges at the same step, and says so: no further restart (2 rounds of the 4 allowed)."""
    rc, rounds, m = job(tmp_path, ["train.lr=1e308", "train.warmup_steps=0", "train.grad_clip=0"])
    again = [l for l in m.err.splitlines() if "again after restart 1 from step 0" in l]
    print("rc %d after %d rounds: %s" % (rc, rounds, again[0][:300] if again else m.err[-1500:]))
    assert rc == 1 and rounds == 2 and again, m.describe()
    assert '"restart": false' in m.err or "asks for none" in m.err, m.describe()
