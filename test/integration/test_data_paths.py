"""Real data from anywhere: plans whose paths are relative to their folder, inputs checked before
anything starts (plan errors, exit 2, not retried by meshrun), llm.c files never read as text,
sharded datasets that resume exactly across shard boundaries and data-parallel degrees, and the
throughput numbers of the step line (FLOP/s, MFU, peak memory).

- A shipped plan (configs/tiny.json, "../data/tinyshakespeare.txt") runs from another working
  directory; a plan naming a missing file fails at once with exit 2 and the plan's folder named,
  under meshrun too, with no restart spent (--max_restarts=3).
- An llm.c shard under "format": "text" is a plan error (exit 2) naming the header.
- Shards: tinyshakespeare's bytes cut into 4 llm.c shards (both header kinds) and given as a
  glob train to the same loss bits as the one text file (tolerance 0); a 2-rank FSDP run stopped
  at step 6 and resumed on 1 rank continues on the never-stopped 1-rank run's losses (relative
  tolerance 1e-4: a different reduction order).
- The records carry flops_per_s = tokens_per_s x (6N + 12 L d T) (rel 1e-5: tokens_per_s is rounded in the record), mfu null on cpu and
  flops_per_s / peak with log.peak_tflops; peak_mem_bytes > 0; the console line shows them.
OMP_NUM_THREADS=1 everywhere (2 shared cores).
"""
import json
import os
import subprocess

from conftest import FAST_CONF, Meshrun, bin_dir, tiny_plan

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRAINER = os.path.join(bin_dir(), "trainer")
TEXT = os.path.join(REPO, "data", "tinyshakespeare.txt")
TOL = 1e-4


def env():
    e = dict(os.environ, OMP_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MESHRUN_STORE", "TORCHELASTIC_ERROR_FILE"):
        e.pop(k, None)
    return e


def trainer(args, cwd, timeout=120):
    return subprocess.run([TRAINER] + list(args), cwd=str(cwd), env=env(), capture_output=True, text=True,
                          timeout=timeout)


def write_json(path, obj):
    with open(path, "w") as f:
        json.dump(obj, f)
    return str(path)


def records(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def step_losses(path):
    return {(("eval_loss" in r), r["step"]): r.get("loss", r.get("eval_loss")) for r in records(path) if "step" in r}


def test_shipped_plan_runs_from_another_folder(tmp_path):
    r = trainer([os.path.join(REPO, "configs", "tiny.json"), "--set", "train.steps=2", "--set", "sample.tokens=0",
                 "--set", "eval.interval=0", "--set", "checkpoint.dir=ck"], tmp_path)
    assert r.returncode == 0, r.stderr
    assert "data/tinyshakespeare.txt" in r.stderr and "step 2/2" in r.stderr
    assert (tmp_path / "ck").is_dir()  # what a run writes stays in the working directory


def test_missing_input_is_a_plan_error_not_retried(tmp_path):
    plans = tmp_path / "plans"
    plans.mkdir()
    plan = tiny_plan(data={"train": "corpus/missing.txt", "format": "text"})
    path = write_json(plans / "p.json", plan)
    r = trainer([path], tmp_path)
    print(r.stderr.strip())
    assert r.returncode == 2
    want = "plan error: data.train: %s/corpus/missing.txt: No such file or directory" % os.path.realpath(plans)
    assert want in r.stderr
    assert "taken from the plan's folder" in r.stderr

    m = Meshrun(["--nproc_per_node=2", "--max_restarts=3", "--rdzv_conf=" + FAST_CONF, TRAINER, path,
                 "--set", "mesh.dp_shard=2"],
                env={"OMP_NUM_THREADS": "1"}, cwd=str(tmp_path))
    rc = m.wait(60)
    print(m.err.strip().splitlines()[-1])
    assert rc == 2, m.err
    assert want in m.err
    assert "restart 1" not in m.err and "restarting" not in m.err.lower(), m.err


def write_llmc(path, ids, width):
    import numpy as np
    hdr = np.zeros(256, dtype="<i4")
    hdr[0], hdr[1], hdr[2] = (20240520, 1, len(ids)) if width == 2 else (20240801, 7, len(ids))
    with open(path, "wb") as f:
        f.write(hdr.tobytes())
        f.write(np.asarray(ids, dtype="<u2" if width == 2 else "<u4").tobytes())


def test_llmc_file_is_never_text(tmp_path):
    data = open(TEXT, "rb").read()[:20000]
    write_llmc(tmp_path / "shard.bin", list(data), 2)
    plan = tiny_plan(data={"train": "shard.bin", "format": "text"})
    r = trainer([write_json(tmp_path / "p.json", plan)], tmp_path)
    print(r.stderr.strip())
    assert r.returncode == 2
    assert "starts with an llm.c header (magic 20240520, uint16 tokens) but data.format is text" in r.stderr


def test_shards_train_and_resume_like_one_file(tmp_path):
    data = open(TEXT, "rb").read()
    n = len(data)
    cuts = [0, n // 5, n // 5 + 777, n // 2, n]  # unequal shards, one small
    shards = tmp_path / "shards"
    shards.mkdir()
    for i in range(4):
        write_llmc(shards / ("tiny_train_%06d.bin" % i), list(data[cuts[i]:cuts[i + 1]]), 2 if i % 2 else 4)
    common = dict(eval={"interval": 3, "batches": 2}, log={"interval": 1})
    one = tiny_plan(data={"train": TEXT, "format": "text", "val_fraction": 0.1}, **common)
    sharded = tiny_plan(data={"train": "shards/tiny_train_*.bin", "val_fraction": 0.1}, **common)
    sharded["train"]["steps"] = one["train"]["steps"] = 10

    for name, plan in (("one", one), ("sharded", sharded)):
        d = tmp_path / name
        d.mkdir()
        r = trainer([write_json(tmp_path / ("%s.json" % name), plan), "--set", "log.metrics_file=m.jsonl"], d)
        assert r.returncode == 0, r.stderr
    a, b = step_losses(tmp_path / "one" / "m.jsonl"), step_losses(tmp_path / "sharded" / "m.jsonl")
    diff = [k for k in a if a[k] != b.get(k)]
    print("4 shards vs one file: %d losses, %d differ in any bit (tolerance 0)" % (len(a), len(diff)))
    assert len(a) >= 10 and not diff

    # 2-rank fsdp stopped after step 6 (its checkpoint; --stop-after ends it there as a preemption
    # would, the plan unchanged), resumed on 1 rank.
    plan_path = write_json(tmp_path / "sharded.json", sharded)
    d2 = tmp_path / "fsdp2"
    d2.mkdir()
    m = Meshrun(["--nproc_per_node=2", "--rdzv_conf=" + FAST_CONF, TRAINER, plan_path, "--set", "mesh.dp_shard=2",
                 "--set", "log.metrics_file=m.jsonl", "--set", "checkpoint.dir=ck", "--set", "checkpoint.interval=6",
                 "--stop-after", "6"], env={"OMP_NUM_THREADS": "1"}, cwd=str(d2))
    m.wait(120)
    assert os.path.isdir(d2 / "ck" / "step-6"), m.err
    r = trainer([plan_path, "--set", "log.metrics_file=m.jsonl", "--set", "checkpoint.dir=ck",
                 "--set", "checkpoint.resume=auto"], d2)
    assert r.returncode == 0, r.stderr
    assert "resumed from" in r.stderr and "(step 6, saved by world 2, now world 1" in r.stderr
    got = step_losses(d2 / "m.jsonl")
    keys = sorted(k for k in b if k[1] > 6)
    rel = max(abs(got[k] - b[k]) / abs(b[k]) for k in keys)
    print("fsdp2 stopped at step 6, resumed on 1 rank: %d losses after it, max rel diff %.2e (tolerance %.0e)" %
          (len(keys), rel, TOL))
    assert rel <= TOL


def test_step_records_carry_flops_mfu_and_memory(tmp_path):
    plan = tiny_plan(data={"train": TEXT, "format": "text"}, log={"interval": 1, "metrics_file": "m.jsonl"})
    plan["train"]["steps"] = 3
    path = write_json(tmp_path / "p.json", plan)
    c = plan["model"]
    d, L, T, V = c["dim"], c["n_layers"], plan["train"]["seq_len"], c["vocab_size"]
    hidden = 32 * ((int(2 * 4 * d / 3) + 31) // 32)  # Llama's rule, multiple_of 32
    kv = d // c["n_heads"] * c["n_kv_heads"]
    n = L * (2 * d * d + 2 * d * kv + 3 * d * hidden) + V * d
    per_token = 6 * n + 12 * L * d * T

    r = trainer([path], tmp_path)
    assert r.returncode == 0, r.stderr
    steps = [x for x in records(tmp_path / "m.jsonl") if "loss" in x]
    assert len(steps) == 3
    worst = max(abs(x["flops_per_s"] - x["tokens_per_s"] * per_token) / (x["tokens_per_s"] * per_token)
                for x in steps)
    print("flops_per_s against tokens_per_s x %d FLOPs/token: max rel diff %.2e (tolerance 1e-5)" % (per_token, worst))
    assert worst <= 1e-5
    assert all(x["mfu"] is None and x["peak_mem_bytes"] > 1 << 20 for x in steps)
    line = [l for l in r.stderr.splitlines() if "step 3/3 | loss" in l][0]
    print(line)
    assert "FLOP/s" in line and "| mem " in line and "MFU" not in line

    # a 1 GFLOP/s "device", into the first run's metrics file
    r = trainer([path, "--set", "log.peak_tflops=0.001", "--set", "overwrite=true"], tmp_path)
    assert r.returncode == 0, r.stderr
    steps = [x for x in records(tmp_path / "m.jsonl") if "loss" in x]
    worst = max(abs(x["mfu"] - x["flops_per_s"] / 1e9) / x["mfu"] for x in steps)
    print("mfu against flops_per_s / 1e9: max rel diff %.2e (tolerance 1e-5)" % worst)
    assert worst <= 1e-5
    assert "MFU" in [l for l in r.stderr.splitlines() if "step 3/3 | loss" in l][0]
