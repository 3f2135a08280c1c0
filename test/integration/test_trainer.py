"""test_trainer: the trainer program end to end on the cpu backend, as a user runs it.

A tiny plan trains and its loss falls; two identical runs write bit-identical losses; the
metrics file has its fields; `trainer sample` reproduces the sample printed after training from
the saved weights; and each bad input (missing or unreadable data, data shorter than one
sequence, token id >= vocab, a diverging run, plan errors, unsupported worlds and devices) ends
with a one-line message naming the cause and a non-zero exit. Also: a plan that is not a regular
file (/dev/zero) or is over 16 MiB; a checkpoint.dir that is a file, lies under a file or is on a
read-only mount (plan errors before step 1; the mount test skips where mounting is not allowed);
metrics that cannot be written (/dev/full: one warning, the run finishes, exit 1); an unset
variable in the "bad environment" line is printed as (unset), never (null).

Binaries come from MESHRUN_BIN (the Makefile's `integration` target sets it); runs use one
thread and tiny models so the whole file takes a few seconds.
"""
import json
import os
import resource
import struct
import subprocess
import tempfile

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.environ.get("MESHRUN_BIN", os.path.join(REPO, "bin"))
TRAINER = os.path.join(BIN, "trainer")
TEXT = os.path.join(REPO, "data", "tinyshakespeare.txt")

# A plan small enough to run 30 steps in well under a second.
TINY = {
    "device": "cpu",
    "seed": 7,
    "model": {"dim": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 256,
              "max_seq_len": 32, "multiple_of": 16},
    "train": {"steps": 30, "seq_len": 32, "micro_batch_size": 4, "global_batch_size": 8,
              "lr": 1e-2, "warmup_steps": 3},
    "data": {"train": TEXT, "format": "auto", "val_fraction": 0.1},
    "eval": {"interval": 10, "batches": 2},
    "log": {"interval": 5},
    "sample": {"tokens": 40, "temperature": 0.8, "prompt": "ROMEO:"},
}


def run(args, cwd, timeout=120, env_extra=None):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(k, None)
    env.update(env_extra or {})
    return subprocess.run([TRAINER] + args, cwd=cwd, env=env, capture_output=True, text=True,
                          errors="replace", timeout=timeout)


def write_plan(tmp_path, plan, name="plan.json"):
    path = tmp_path / name
    path.write_text(json.dumps(plan))
    return str(path)


def read_metrics(path):
    with open(path) as f:
        recs = [json.loads(line) for line in f if line.strip()]
    steps = [r for r in recs if "loss" in r]
    evals = [r for r in recs if "eval_loss" in r]
    return recs, steps, evals


def train(tmp_path, extra_sets=(), plan=TINY, name="m.jsonl"):
    plan_path = write_plan(tmp_path, plan)
    metrics = str(tmp_path / name)
    ck = tmp_path / ("ck" if name == "m.jsonl" else "ck-" + os.path.splitext(name)[0])  # a run's own outputs
    sets = ["--set", f"log.metrics_file={metrics}", "--set", f"checkpoint.dir={ck}"]
    for s in extra_sets:
        sets += ["--set", s]
    r = run([plan_path] + sets, cwd=tmp_path)
    return r, metrics


def one_error_line(r):
    """The trainer's last stderr line, which must name the cause."""
    lines = [l for l in r.stderr.splitlines() if l.strip()]
    assert lines, "no message on stderr"
    return lines[-1]


def test_help_and_version(tmp_path):
    r = run(["--help"], cwd=tmp_path)
    assert r.returncode == 0 and "usage: trainer" in r.stdout and "--set" in r.stdout
    r = run(["--version"], cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.startswith("trainer (meshrun)")


@pytest.mark.parametrize("args, first, must", [
    (["-h"], "usage: trainer [PLAN.json]", ["--set", "--print-plan"]),
    (["configs/tiny.json", "--set", "train.steps=5", "--help"], "usage: trainer [PLAN.json]", ["--set"]),
    (["sample", "--help"], "usage: trainer sample", ["--weights", "sample.tokens", "sample.top_p"]),
    (["sample", "--weights", "nowhere.safetensors", "-h"], "usage: trainer sample", ["data.tokenizer"]),
    (["export", "--help"], "usage: trainer export", ["--format llama2c", "--format hf", "--out PATH"]),
])
def test_help_of_each_command(tmp_path, args, first, must):
    """Each command's own page on stdout, exit 0, whatever else the line holds (nothing is run:
    no weights are read, no plan is loaded)."""
    r = run(args, cwd=REPO)
    print(r.returncode, r.stdout[:200], r.stderr[:200])
    assert r.returncode == 0
    assert r.stdout.startswith(first)
    for m in must:
        assert m in r.stdout, m
    assert r.stderr == ""


def test_tiny_plan_trains_and_loss_falls(tmp_path):
    r, metrics = train(tmp_path)
    assert r.returncode == 0, r.stderr
    recs, steps, evals = read_metrics(metrics)
    first = recs[0]
    assert first["plan"]["model"]["dim"] == 32 and first["num_params"] > 0
    assert first["plan"]["train"]["global_batch_size"] == 8 and first["tokens_per_step"] == 8 * 32
    assert [s["step"] for s in steps] == list(range(1, 31))
    for s in steps:
        assert set(s) == {"step", "loss", "lr", "grad_norm", "tokens_per_s", "flops_per_s", "mfu", "peak_mem_bytes",
                          "step_ms", "compute_ms", "comm_wait_ms", "compute_ms_min", "compute_ms_median",
                          "compute_ms_max", "slowest_rank", "straggler_spread_pct", "kernels", "host_syncs"}
        assert s["tokens_per_s"] > 0 and s["step_ms"] > 0 and s["grad_norm"] > 0
        assert s["comm_wait_ms"] == 0 and s["compute_ms"] == s["step_ms"]  # one process: nothing to wait on
        # one process: the spread over ranks is its own compute time
        assert s["compute_ms_min"] == s["compute_ms_median"] == s["compute_ms_max"] == s["compute_ms"], s
        assert s["slowest_rank"] == 0 and s["straggler_spread_pct"] == 0, s
        # the loss and the norm stay on the device; a step that logs (every 5th, the first), evaluates
        # (every 10th) or saves (the last) reads them back, with those of the steps before it, in one copy
        reads = s["step"] == 1 or s["step"] % 5 == 0
        assert s["kernels"] > 0 and s["host_syncs"] == (1 if reads else 0), s
    assert [e["step"] for e in evals] == [10, 20, 30]
    # Warmup then cosine decay: lr rises for 3 steps, then falls to min_lr (lr/10 by default).
    lrs = [s["lr"] for s in steps]
    assert lrs[2] == pytest.approx(1e-2) and lrs[0] == pytest.approx(1e-2 / 3)
    assert all(a >= b for a, b in zip(lrs[3:], lrs[4:]))
    first_loss, last_loss = steps[0]["loss"], sum(s["loss"] for s in steps[-5:]) / 5
    print(f"loss {first_loss:.4f} -> {last_loss:.4f} (mean of the last 5 steps); eval {evals[0]['eval_loss']:.4f}"
          f" -> {evals[-1]['eval_loss']:.4f}")
    assert first_loss == pytest.approx(5.545, abs=0.15)  # ln(256) at init
    assert last_loss < first_loss - 1.0
    assert evals[-1]["eval_loss"] < evals[0]["eval_loss"]
    # The console line, the saved weights and the sample.
    assert "step 30/30 | loss " in r.stderr and " tok/s | " in r.stderr and "| ETA " in r.stderr
    assert "(job)" not in r.stderr and "FLOP/s/rank" not in r.stderr  # one process: no scope to name
    assert os.path.getsize(tmp_path / "ck" / "final.safetensors") > first["num_params"] * 4
    assert r.stdout.startswith("ROMEO:") and len(r.stdout) >= len("ROMEO:") + 40


def test_two_runs_give_identical_losses(tmp_path):
    r1, m1 = train(tmp_path, name="a.jsonl")
    r2, m2 = train(tmp_path, name="b.jsonl")
    assert r1.returncode == 0 and r2.returncode == 0
    _, s1, e1 = read_metrics(m1)
    _, s2, e2 = read_metrics(m2)
    l1 = [(s["loss"], s["grad_norm"]) for s in s1] + [e["eval_loss"] for e in e1]
    l2 = [(s["loss"], s["grad_norm"]) for s in s2] + [e["eval_loss"] for e in e2]
    diffs = sum(a != b for a, b in zip(l1, l2))
    print(f"{len(l1)} values compared, {diffs} differ (tolerance: 0, bit-identical)")
    assert l1 == l2
    # A different seed draws other batches and weights.
    r3, m3 = train(tmp_path, ["seed=8"], name="c.jsonl")
    assert r3.returncode == 0
    assert read_metrics(m3)[1][0]["loss"] != s1[0]["loss"]


def test_sample_from_saved_weights(tmp_path):
    r, _ = train(tmp_path)
    assert r.returncode == 0, r.stderr
    plan_path = write_plan(tmp_path, TINY)
    weights = str(tmp_path / "ck" / "final.safetensors")
    s = run(["sample", plan_path, "--weights", weights], cwd=tmp_path)
    assert s.returncode == 0, s.stderr
    # Same weights, seed and settings: the same text as printed at the end of training.
    assert s.stdout == r.stdout
    s2 = run(["sample", plan_path, "--weights", weights, "--set", "sample.tokens=10",
              "--set", "sample.temperature=0"], cwd=tmp_path)
    assert s2.returncode == 0 and len(s2.stdout) == len("ROMEO:") + 10 + 1
    # A weights file from another model is refused by tensor name and size.
    bad = run(["sample", plan_path, "--weights", weights, "--set", "model.dim=64"], cwd=tmp_path)
    assert bad.returncode == 2 and "dim 32 but the plan says 64" in one_error_line(bad)
    none = run(["sample", plan_path], cwd=tmp_path)
    assert none.returncode == 2 and "--weights" in one_error_line(none)


def test_default_weights_path_and_synthetic_data(tmp_path):
    plan = json.loads(json.dumps(TINY))
    plan["data"] = {"format": "synthetic", "train": ""}
    plan["model"]["vocab_size"] = 64
    plan["sample"] = {"tokens": 5, "prompt": "1 2 3"}
    plan_path = write_plan(tmp_path, plan, "synth.json")
    r = run([plan_path, "--set", "train.steps=40"], cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "out" / "synth" / "final.safetensors").exists()
    # Non-text data samples ids: the prompt's ids, a bar, then 5 generated ids.
    words = r.stdout.split()
    assert words[:4] == ["1", "2", "3", "|"] and len(words) == 9
    assert all(0 <= int(w) < 64 for w in words if w != "|")


# --- bad inputs: each a one-line message and a non-zero exit ----------------------------------


def test_missing_data_file(tmp_path):
    r, _ = train(tmp_path, [f"data.train={tmp_path / 'nope.txt'}"])
    line = one_error_line(r)
    print(line)
    assert r.returncode == 2 and "plan error: data.train" in line and "nope.txt" in line and "No such file" in line


def test_unreadable_data_file(tmp_path):
    if os.geteuid() == 0:  # root reads mode-000 files; a directory is unreadable as data for anyone
        bad = tmp_path / "dir.txt"
        bad.mkdir()
    else:
        bad = tmp_path / "secret.txt"
        bad.write_text("x" * 1000)
        bad.chmod(0)
    r, _ = train(tmp_path, [f"data.train={bad}"])
    line = one_error_line(r)
    print(line)
    assert r.returncode == 2 and str(bad) in line and ("cannot" in line or "not a regular file" in line)


def test_data_shorter_than_one_sequence(tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("a" * 32)  # seq_len 32 needs 33 tokens
    r, _ = train(tmp_path, [f"data.train={short}", "data.val_fraction=0", "eval.interval=0"])
    line = one_error_line(r)
    print(line)
    assert r.returncode == 2 and "short.txt" in line and "fewer than one sequence" in line


def test_token_id_out_of_vocab(tmp_path):
    ids = [3] * 500
    ids[123] = 300  # >= vocab_size 256
    path = tmp_path / "toks.u16"
    path.write_bytes(struct.pack(f"<{len(ids)}H", *ids))
    r, _ = train(tmp_path, [f"data.train={path}"])
    line = one_error_line(r)
    print(line)
    assert r.returncode == 2 and "toks.u16" in line and "token id 300 at position 123" in line


def test_nan_loss_stops_at_once(tmp_path):
    # A learning rate of 1e30 survives step 1 (the loss is computed before the update), then
    # the weights are ~1e30 and the loss of step 2's first micro-batch is not finite.
    r, metrics = train(tmp_path, ["train.lr=1e30", "train.warmup_steps=0", "train.grad_clip=0"])
    line = one_error_line(r)
    print(line)
    assert r.returncode == 1
    assert line.startswith("trainer: loss is nan at step 2 (micro-batch 1);") or \
        line.startswith("trainer: loss is inf at step 2 (micro-batch 1);")
    assert [s["step"] for s in read_metrics(metrics)[1]] == [1]  # step 1 was logged, no more
    # Huge initial weights: RMSNorm keeps the forward finite, but the gradients overflow.
    r, metrics = train(tmp_path, ["model.init_std=1e30"], name="m2.jsonl")
    line = one_error_line(r)
    print(line)
    assert r.returncode == 1 and "is nan at step 1" in line
    assert not read_metrics(metrics)[1]


@pytest.mark.parametrize("sets,key", [
    (["train.steps=-3"], "train.steps"),
    (["train.nosuchkey=1"], "train.nosuchkey"),
    (["model.n_kv_heads=3"], "model.n_kv_heads"),
])
def test_plan_errors_exit_2(tmp_path, sets, key):
    r, _ = train(tmp_path, sets)
    line = one_error_line(r)
    print(line)
    assert r.returncode == 2 and line.startswith(f"plan error: {key}: "), line


def choice_on_cpu(tmp_path, key, refused, refused_line, bad, bad_says, modes):
    """A plan choice the cpu lacks: key=refused is a plan error (exit 2, exactly refused_line);
    key=bad is one whose line names the choices (bad_says); the modes run, silent about key, with
    the same losses."""
    r, _ = train(tmp_path, [f"{key}={refused}", "train.steps=2"])
    line = one_error_line(r)
    print(line)
    assert r.returncode == 2 and line == refused_line, line
    r, _ = train(tmp_path, [f"{key}={bad}", "train.steps=2"])
    line = one_error_line(r)
    print(line)
    assert r.returncode == 2 and line.startswith(f"plan error: {key}: ") and bad_says in line, line
    losses = {}
    for mode in modes:
        r, metrics = train(tmp_path, [f"{key}={mode}", "train.steps=3"], name=f"{mode}.jsonl")
        assert r.returncode == 0, r.stderr
        losses[mode] = [s["loss"] for s in read_metrics(metrics)[1]]
        yield r, read_metrics(metrics)[1]
    print(losses)
    assert losses[modes[0]] == losses[modes[1]] and len(losses[modes[0]]) == 3


def test_model_attention_on_cpu(tmp_path):
    """model.attention: "cudnn" on a device without cuDNN is a plan error (exit 2, the device named);
    "reference" and "auto" run the cpu's own kernel, and give the same losses (one kernel)."""
    for _ in choice_on_cpu(tmp_path, "model.attention", "cudnn", "plan error: model.attention: cudnn: device cpu has "
                           "no fused attention kernel: use auto or reference", "flash", "auto", ("auto", "reference")):
        pass


def test_cuda_graphs_on_cpu(tmp_path):
    """train.cuda_graphs: "on" where the backend records nothing (cpu) is a plan error (exit 2, one
    line naming the backend); a value not in auto/on/off is one too; "auto" runs there without a
    word about graphs and without "graph" in the records, with the losses of "off"."""
    for r, recs in choice_on_cpu(tmp_path, "train.cuda_graphs", "on", "plan error: train.cuda_graphs: on, but the cpu "
                                 "backend runs each call as it comes and records nothing; use auto or off", "yes",
                                 "auto, on, off", ("auto", "off")):
        assert "train.cuda_graphs" not in r.stderr + r.stdout
        assert all("graph" not in s for s in recs)


@pytest.mark.parametrize("value, says", [
    ("1e12", "must be an integer from 1 to 2147483647 (2^31 - 1), got 1000000000000"),
    ("3000000000", "must be an integer from 1 to 2147483647 (2^31 - 1), got 3000000000"),
    ("0", "must be an integer >= 1, got 0"),
    ("2.5", "must be an integer >= 1, got 2.5"),
])
def test_integer_keys_say_their_range(tmp_path, value, says):
    """A value past an int's top names the whole range, not only the lower bound it meets."""
    r, _ = train(tmp_path, [f"train.steps={value}"])
    line = one_error_line(r)
    print(line)
    assert r.returncode == 2 and line == f"plan error: train.steps: {says}", line


def test_usage_errors(tmp_path):
    r = run([str(tmp_path / "missing-plan.json")], cwd=tmp_path)
    assert r.returncode == 2 and "missing-plan.json" in one_error_line(r)
    r = run(["--bogus"], cwd=tmp_path)
    assert r.returncode == 2 and "--bogus" in one_error_line(r)
    bad_json = tmp_path / "bad.json"
    bad_json.write_text("{ not json")
    r = run([str(bad_json)], cwd=tmp_path)
    assert r.returncode == 2 and "bad.json" in one_error_line(r)


def test_plan_must_be_a_small_regular_file(tmp_path):
    def limit_memory():  # without the check, /dev/zero is read until memory runs out: fail fast
        resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))

    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run([TRAINER, "/dev/zero"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60,
                       preexec_fn=limit_memory)
    line = one_error_line(r)
    print(line)
    assert r.returncode == 2 and line == "plan error: /dev/zero: not a regular file (a plan is a JSON file)", r.stderr
    big = tmp_path / "big.json"
    with open(big, "w") as f:
        f.write("{}" + " " * (17 << 20))
    r = run([str(big)], cwd=tmp_path)
    line = one_error_line(r)
    print(line)
    assert r.returncode == 2 and line == "plan error: %s: %d bytes; a plan file is at most 16 MiB" % (
        big, (17 << 20) + 2), r.stderr
    assert len([l for l in r.stderr.splitlines() if l.strip()]) == 1


def _mount_tmpfs(where, opts):
    """Mounts a tmpfs at where; False where mounting is not allowed (not root, no CAP_SYS_ADMIN)."""
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(where)], capture_output=True, text=True)
    return r.returncode == 0


def test_checkpoint_dir_checked_before_the_first_step(tmp_path):
    # interval 0: without the check, the first save would come after the last step.
    f = tmp_path / "a-file"
    f.write_text("x")
    for ck, why in [(f, "exists and is not a directory"), (f / "ck", "Not a directory")]:
        r, _ = train(tmp_path, [f"checkpoint.dir={ck}", "checkpoint.interval=0"])
        lines = [l for l in r.stderr.splitlines() if l.strip()]
        print(lines[-1])
        assert r.returncode == 2 and lines[-1].startswith("plan error: checkpoint.dir: ") and why in lines[-1], r.stderr
        assert len(lines) == 1 and "step 1/" not in r.stderr
    ro = tmp_path / "ro"
    ro.mkdir()
    if not _mount_tmpfs(ro, "ro"):
        pytest.skip("cannot mount a read-only tmpfs here (the file cases above passed)")
    try:
        for ck in (ro, ro / "sub" / "ck"):
            r, _ = train(tmp_path, [f"checkpoint.dir={ck}"])
            line = one_error_line(r)
            print(line)
            assert r.returncode == 2 and line.startswith("plan error: checkpoint.dir: "), r.stderr
            assert "Read-only file system" in line and "step 1/" not in r.stderr
    finally:
        subprocess.run(["umount", str(ro)], check=True)


def test_metrics_write_error_is_reported(tmp_path):
    plan_path = write_plan(tmp_path, TINY)
    r = run([plan_path, "--set", "log.metrics_file=/dev/full", "--set", f"checkpoint.dir={tmp_path / 'ck'}",
             "--set", "train.steps=5"], cwd=tmp_path)
    warnings = [l for l in r.stderr.splitlines() if "log.metrics_file /dev/full" in l]
    print("\n".join(warnings))
    assert r.returncode == 1, r.stderr
    assert len(warnings) == 2  # the warning when it happened, and the last line
    assert "No space left on device" in warnings[0] and "exit 1" in warnings[0]
    line = one_error_line(r)
    assert line.startswith("trainer: log.metrics_file /dev/full: ") and "No space left on device" in line
    # The run itself finished: every step, the final weights, the sample.
    assert "step 5/5" in r.stderr and (tmp_path / "ck" / "final.safetensors").exists()
    assert r.stdout.startswith("ROMEO:")


def test_bad_environment_names_unset_variables(tmp_path):
    r = run([write_plan(tmp_path, TINY)], cwd=tmp_path, env_extra={"RANK": "5"})
    line = one_error_line(r)
    print(line)
    assert r.returncode == 2 and line == "trainer: bad environment RANK=5 WORLD_SIZE=(unset) LOCAL_RANK=(unset)"


def test_world_and_device_errors(tmp_path):
    plan_path = write_plan(tmp_path, TINY)
    r = run([plan_path], cwd=tmp_path, env_extra={"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"})
    line = one_error_line(r)
    print(line)
    assert r.returncode != 0 and "mesh" in line
    v = run(["--version"], cwd=tmp_path)
    if "cuda" not in v.stdout:
        r = run([plan_path, "--set", "device=cuda"], cwd=tmp_path)
        line = one_error_line(r)
        print(line)
        assert r.returncode == 2 and "built without the cuda backend" in line


def test_plot_metrics_draws_a_png(tmp_path):
    r, metrics = train(tmp_path)
    assert r.returncode == 0, r.stderr
    png = tmp_path / "loss.png"
    p = subprocess.run(["/usr/bin/python3", os.path.join(REPO, "tools", "plot_metrics.py"), metrics, metrics,
                        "--labels", "a,b", "--lr", "-o", str(png)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10000
    empty = tmp_path / "empty.jsonl"
    empty.write_text('{"plan": {}}\n')
    p = subprocess.run(["/usr/bin/python3", os.path.join(REPO, "tools", "plot_metrics.py"), str(empty),
                        "-o", str(png)], capture_output=True, text=True, timeout=120)
    assert p.returncode != 0 and "no loss records" in p.stderr


@pytest.mark.parametrize("target", ["demo", "stories"])
def test_make_targets_build_both_programs(tmp_path, target):
    """`make demo` (the README's first command) and `make stories` build meshrun as well as the
    trainer, so the README's next examples, which launch meshrun, work after them. A dry run
    (make -n) into an empty build tree lists the links it would do."""
    r = subprocess.run(["make", "-n", "--no-print-directory", "V=1", target, f"BUILD={tmp_path}/build",
                        f"BIN={tmp_path}/bin"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    links = [l for l in r.stdout.splitlines() if f" -o {tmp_path}/bin/" in l]
    print("\n".join(l[:160] for l in links))
    assert any(f"-o {tmp_path}/bin/trainer " in l for l in links)
    assert any(f"-o {tmp_path}/bin/meshrun " in l for l in links)


@pytest.mark.parametrize("case", ["weights", "metrics", "trace"])
def test_outputs_checked_before_step_1(tmp_path, case):
    """Every output is checked before the device starts: a folder that cannot be made is a plan
    error (exit 2, one line) before step 1, not a failure after the last step that loses the
    weights (was: 20 steps trained, then exit 1). A regular file where a folder must go makes
    the folder impossible for root too."""
    (tmp_path / "f").write_text("a file, not a folder\n")
    sets = ["--set", "train.steps=20", "--set", "eval.interval=0", "--set", "sample.tokens=0"]
    if case == "weights":
        (tmp_path / "out").write_text("a file where out/ would go\n")
        key = "final weights"
    elif case == "metrics":
        sets += ["--set", f"log.metrics_file={tmp_path}/f/m.jsonl", "--set", f"checkpoint.dir={tmp_path}/ck"]
        key = "log.metrics_file"
    else:
        sets += ["--set", f"log.trace_file={tmp_path}/f/t.json", "--set", f"checkpoint.dir={tmp_path}/ck"]
        key = "log.trace_file"
    r = run([os.path.join(REPO, "configs", "tiny.json")] + sets, cwd=tmp_path)
    line = one_error_line(r)
    print(line)
    assert r.returncode == 2 and line.startswith(f"plan error: {key}: "), r.stderr
    assert "step 1/" not in r.stderr


@pytest.mark.parametrize("case", ["weights", "metrics", "trace", "checkpoints"])
def test_results_never_silently_overwritten(tmp_path, case):
    """A run that starts at step 1 replaces no earlier run's results: existing final weights,
    metrics, trace, or checkpoints in checkpoint.dir with checkpoint.resume none are refused
    before step 1 (exit 2, one line naming the key, the file and --set overwrite=true), the file
    left as it was; overwrite=true replaces it, and so may a restart of a meshrun job
    (TORCHELASTIC_RESTART_COUNT 1), which continues the outputs of its own run. Before: each was
    replaced without a word (make demo, then a 2-step run, left 300-step metrics beside 2-step
    weights)."""
    base = ["--set", "train.steps=2", "--set", "eval.interval=0", "--set", "sample.tokens=0"]
    if case == "weights":
        key, target, sets = "final weights", tmp_path / "out" / "tiny" / "final.safetensors", []
    elif case == "metrics":
        target = tmp_path / "m.jsonl"
        key, sets = "log.metrics_file", ["--set", f"log.metrics_file={target}"]
    elif case == "trace":
        target = tmp_path / "t.json"
        key, sets = "log.trace_file", ["--set", f"log.trace_file={target}"]
    else:
        key, target = "checkpoint.resume", tmp_path / "ck" / "step-2" / "metadata.json"
        sets = ["--set", f"checkpoint.dir={tmp_path / 'ck'}"]
    args = [os.path.join(REPO, "configs", "tiny.json")] + base + sets
    if case == "checkpoints":  # an earlier run's checkpoint, its final weights moved away
        assert run(args, cwd=tmp_path).returncode == 0
        os.remove(tmp_path / "ck" / "final.safetensors")
    else:
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text("an earlier run's result\n")
    before = target.read_bytes()
    r = run(args, cwd=tmp_path)
    line = one_error_line(r)
    print(line)
    assert r.returncode == 2 and line.startswith(f"plan error: {key}: ") and "overwrite=true" in line, r.stderr
    assert str(target.parent if case == "checkpoints" else target.name) in line or target.name in line
    assert "step 1/" not in r.stderr and target.read_bytes() == before
    r = run(args, cwd=tmp_path, env_extra={"TORCHELASTIC_RESTART_COUNT": "1"})
    assert r.returncode == 0, r.stderr
    if case != "checkpoints":
        target.write_text("an earlier run's result\n")
    r = run(args + ["--set", "overwrite=true"], cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert case == "checkpoints" or target.read_bytes() != before


def test_a_resumed_run_continues_its_outputs(tmp_path):
    """A resume (checkpoint.resume auto finding a checkpoint) is the same run going on: no
    overwrite needed; its metrics file keeps the steps before the checkpoint and gains the rest."""
    metrics = tmp_path / "m.jsonl"
    args = [os.path.join(REPO, "configs", "tiny.json"), "--set", "eval.interval=0", "--set", "sample.tokens=0",
            "--set", f"log.metrics_file={metrics}", "--set", f"checkpoint.dir={tmp_path / 'ck'}",
            "--set", "checkpoint.interval=2", "--set", "checkpoint.resume=auto"]
    r = run(args + ["--set", "train.steps=4"], cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    r = run(args + ["--set", "train.steps=6"], cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    _, steps, _ = read_metrics(metrics)
    print([s["step"] for s in steps])
    assert [s["step"] for s in steps] == [1, 2, 3, 4, 5, 6]


def test_plot_is_not_replaced_by_other_data(tmp_path):
    """plot_metrics.py redraws a PNG drawn from the same metrics files (a run that went on), and
    refuses (exit 2, one line) to replace one drawn from others, or not by it, unless --overwrite."""
    plot = [os.path.join(REPO, "tools", "plot_metrics.py")]
    r, metrics = train(tmp_path)
    assert r.returncode == 0, r.stderr
    other = tmp_path / "other.jsonl"
    other.write_bytes(open(metrics, "rb").read())
    png = tmp_path / "loss.png"

    def draw(*args):
        return subprocess.run(["/usr/bin/python3"] + plot + list(args) + ["-o", str(png)], capture_output=True,
                              text=True, timeout=120)

    assert draw(metrics).returncode == 0
    assert draw(metrics).returncode == 0  # the same run's plot, redrawn
    first = png.read_bytes()
    p = draw(str(other))
    print(p.stderr.strip())
    assert p.returncode == 2 and p.stderr.strip() == (
        f"plot_metrics: {png} exists (drawn from {os.path.realpath(metrics)}): --overwrite replaces it, or "
        "choose another -o") and png.read_bytes() == first
    assert draw(str(other), "--overwrite").returncode == 0
    png.write_text("not a plot\n")
    p = draw(metrics)
    assert p.returncode == 2 and "not drawn by plot_metrics" in p.stderr
