"""test_parallel: every parallel plan trains to the one-process losses and weights.

Each plan runs bin/trainer under bin/meshrun as real processes on loopback (4 or 8 ranks, or two
meshrun "nodes" of 2 ranks each), on a tiny Llama where every sharded size divides (dim 64,
n_heads 4, n_kv_heads 2, vocab 256, seq 32, 2 layers, hidden 192), for 20 steps of the same
global batch of 16 sequences (micro-batch 2, so every plan also accumulates gradients over
micro-steps: 8 in one process, 2 under dp 4). Checked against the one-process run of the same
plan:
  - the loss of every step and every eval, within 1e-4 relative (the max difference is printed);
  - the final safetensors, every tensor the same name and shape, values within 1e-4 absolute
    (weights are O(0.1), norm weights O(1); the max absolute difference and the max relative to
    each tensor's largest magnitude are printed).
Observed: losses about 1e-7 relative (fp32 rounding of the reductions' order); weights up to
about 1e-5 absolute, where AdamW divides rounding noise of near-zero gradients by their own
small second moments (the same happens between any two summation orders).

The memory test reads the first metrics record (per-rank bytes written by the trainer): FSDP over
4 ranks holds at most 30% of DDP's parameters + gradients + optimizer state, ZeRO-2 over 4 ranks
at most 1/4 + 2% of DDP's gradient bytes (its shards are padded to a multiple of 4 per unit) and
of its optimizer state, and TP over 2 ranks at most 55% of the parameters.

Tensor-parallel plans need the tensor-parallel model (trainer/model/model.c); while it refuses them,
they are skipped with the trainer's own message. OMP_NUM_THREADS=1 everywhere (2 shared cores).
"""
import json
import os
import re
import struct
import subprocess
import time

import pytest

from conftest import FAST_CONF, MESHRUN, Meshrun, bin_dir, free_port, solo_env, tiny_plan

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRAINER = os.path.join(bin_dir(), "trainer")
TEXT = os.path.join(REPO, "data", "tinyshakespeare.txt")
TOL = 1e-4

PLAN = tiny_plan(data={"train": TEXT, "format": "text"}, eval={"interval": 10, "batches": 3})

# name: (ranks, mesh (dp_replicate, dp_shard, tp), extra --set)
PLANS = {
    "ddp4": (4, (4, 1, 1), []),
    "ddp4_zero1": (4, (4, 1, 1), ["parallel.zero=1"]),
    "ddp4_zero2": (4, (4, 1, 1), ["parallel.zero=2"]),
    "fsdp4": (4, (1, 4, 1), []),
    "fsdp4_no_reshard": (4, (1, 4, 1), ["parallel.reshard_after_forward=false"]),
    "hsdp2x2": (4, (2, 2, 1), []),
    "tp2": (2, (1, 1, 2), ["parallel.sequence_parallel=false", "parallel.loss_parallel=false"]),
    "tp2_sp": (2, (1, 1, 2), ["parallel.sequence_parallel=true", "parallel.loss_parallel=false"]),
    "tp2_sp_loss": (2, (1, 1, 2), ["parallel.sequence_parallel=true", "parallel.loss_parallel=true"]),
    "fsdp2_tp2": (4, (1, 2, 2), []),
    "hsdp2x2_tp2": (8, (2, 2, 2), []),
    # 3 ranks: unit sizes and the flat buffer do not divide by 3, so FSDP pads its shards and
    # ZeRO-1's last rank also owns the tail, ZeRO-2 pads its shards as FSDP does (global batch
    # 12 here, so that 3 divides it)
    "fsdp3_padded": (3, (1, 3, 1), ["train.global_batch_size=12"]),
    "ddp3_zero1_tail": (3, (3, 1, 1), ["parallel.zero=1", "train.global_batch_size=12"]),
    "ddp3_zero2_padded": (3, (3, 1, 1), ["parallel.zero=2", "train.global_batch_size=12"]),
}


def write_plan(d):
    path = os.path.join(str(d), "plan.json")
    with open(path, "w") as f:
        json.dump(PLAN, f)
    return path


def sets_for(d, mesh, extra):
    r, s, t = mesh
    out = []
    for kv in ["mesh.dp_replicate=%d" % r, "mesh.dp_shard=%d" % s, "mesh.tp=%d" % t,
               "log.metrics_file=%s" % os.path.join(str(d), "metrics.jsonl"),
               "checkpoint.dir=%s" % os.path.join(str(d), "ck")] + list(extra):
        out += ["--set", kv]
    return out


def read_records(d):
    with open(os.path.join(str(d), "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def read_safetensors(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, v in header.items():
        if name == "__metadata__":
            continue
        a, b = v["data_offsets"]
        out[name] = (tuple(v["shape"]), struct.unpack("<%df" % ((b - a) // 4), data[a:b]))
    return out


def run_meshrun(d, nproc, args, timeout=180):
    m = Meshrun(["--nproc_per_node=%d" % nproc, "--rdzv_conf=" + FAST_CONF, TRAINER] + args,
                env={"OMP_NUM_THREADS": "1"}, cwd=str(d))
    rc = m.wait(timeout)
    return rc, m


@pytest.fixture(scope="module")
def serial(tmp_path_factory):
    """serial(extra) -> directory of the one-process run with the same train.* overrides (the
    mesh and parallel.* keys do not change the math); each is run once per module."""
    runs = {}

    def get(extra=()):
        train = tuple(e for e in extra if e.startswith("train."))
        if train not in runs:
            d = tmp_path_factory.mktemp("serial")
            env = solo_env()
            r = subprocess.run([TRAINER, write_plan(d)] + sets_for(d, (1, 1, 1), train), cwd=str(d), env=env,
                               capture_output=True, text=True, timeout=120)
            assert r.returncode == 0, r.stderr
            runs[train] = d
        return runs[train]

    return get


def tp_missing(m):
    """The trainer's message when it refuses tensor parallelism as not built yet, else None."""
    for line in (m.err or "").splitlines() + (m.out or "").splitlines():
        if re.search(r"not (yet )?(built|implemented|supported)", line) and re.search(r"tp|tensor", line):
            return line.strip()
    return None


def compare(ref_dir, d, name):
    """Asserts losses and weights equal to the reference within TOL; returns the differences."""
    ref, got = read_records(ref_dir), read_records(d)
    key = lambda r: ("eval_loss" in r, r["step"])
    ref_l = {key(r): r.get("loss", r.get("eval_loss")) for r in ref if "step" in r}
    got_l = {key(r): r.get("loss", r.get("eval_loss")) for r in got if "step" in r}
    assert sorted(ref_l) == sorted(got_l), "%s logged other steps than the one-process run" % name
    loss_diff = max(abs(got_l[k] - ref_l[k]) / abs(ref_l[k]) for k in ref_l)

    wr = read_safetensors(os.path.join(str(ref_dir), "ck", "final.safetensors"))
    wg = read_safetensors(os.path.join(str(d), "ck", "final.safetensors"))
    assert sorted(wr) == sorted(wg), "%s saved other tensors" % name
    w_diff = w_rel = 0.0
    for t in wr:
        assert wr[t][0] == wg[t][0], "%s: %s has shape %s, one process %s" % (name, t, wg[t][0], wr[t][0])
        d = max(abs(a - b) for a, b in zip(wr[t][1], wg[t][1]))
        w_diff = max(w_diff, d)
        w_rel = max(w_rel, d / (max(abs(x) for x in wr[t][1]) or 1.0))
    print("%-18s loss: max rel diff %.2e (%d steps + evals)   weights: max abs diff %.2e (%.2e of the "
          "tensor's max)   tolerance %.0e" % (name, loss_diff, len(ref_l), w_diff, w_rel, TOL))
    assert loss_diff <= TOL, "%s: loss differs from one process by %.3e relative" % (name, loss_diff)
    assert w_diff <= TOL, "%s: final weights differ from one process by %.3e" % (name, w_diff)
    return loss_diff, w_diff


@pytest.mark.parametrize("name", list(PLANS))
def test_plan_matches_one_process(serial, tmp_path, name):
    nproc, mesh, extra = PLANS[name]
    rc, m = run_meshrun(tmp_path, nproc, [write_plan(tmp_path)] + sets_for(tmp_path, mesh, extra))
    if rc != 0 and mesh[2] > 1 and tp_missing(m):
        pytest.skip("tensor parallelism is not in the model yet: " + tp_missing(m))
    assert rc == 0, m.describe()
    first = read_records(tmp_path)[0]
    assert first["mesh"] == list(mesh) and first["world_size"] == nproc
    # several ranks: the step line says tokens/s are the job's and FLOP/s each rank's
    assert re.search(r"step 1/\d+ \|.* tok/s \(job\) \| [\d.]+ [GT]FLOP/s/rank \|", m.err), m.describe()
    compare(serial(extra), tmp_path, name)


def test_two_nodes_over_loopback(serial, tmp_path):
    """HSDP 2x2 across two meshrun processes (2 ranks each) meeting at a store on loopback."""
    port = free_port()
    plan = write_plan(tmp_path)
    nodes = []
    for node in range(2):
        args = ["--nnodes=2", "--nproc_per_node=2", "--rdzv_endpoint=127.0.0.1:%d" % port,
                "--rdzv_id=parallel2n", "--rdzv_conf=" + FAST_CONF, TRAINER, plan] + \
            sets_for(tmp_path, (2, 2, 1), [])
        nodes.append(Meshrun(args, env={"OMP_NUM_THREADS": "1"}, cwd=str(tmp_path)))
    try:
        rcs = [n.wait(180) for n in nodes]
    finally:
        for n in nodes:
            if n.proc.poll() is None:
                n.kill()
    assert rcs == [0, 0], "\n".join(n.describe() for n in nodes)
    compare(serial(), tmp_path, "2 nodes hsdp2x2")


def first_record(tmp_path, name, nproc, mesh, extra=()):
    d = tmp_path / name
    d.mkdir()
    sets = sets_for(d, mesh, extra) + ["--set", "train.steps=1", "--set", "eval.interval=0"]
    if nproc == 1:
        env = solo_env()
        r = subprocess.run([TRAINER, write_plan(d)] + sets, cwd=str(d), env=env, capture_output=True,
                           text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        return read_records(d)[0], None
    rc, m = run_meshrun(d, nproc, [write_plan(d)] + sets)
    return (read_records(d)[0] if rc == 0 else None), m


def state_bytes(rec, suffix=""):
    return rec["param_bytes" + suffix] + rec["grad_bytes" + suffix] + rec["optim_bytes" + suffix]


def test_memory_fsdp_and_tp(tmp_path):
    ddp, m = first_record(tmp_path, "ddp4", 4, (4, 1, 1))
    assert ddp, m.describe()
    fsdp, m = first_record(tmp_path, "fsdp4", 4, (1, 4, 1))
    assert fsdp, m.describe()
    ratio = state_bytes(fsdp, "_max") / state_bytes(ddp, "_max")
    print("per-rank parameters + gradients + optimizer state: ddp4 %d B, fsdp4 %d B (max over ranks), "
          "ratio %.3f (limit 0.30); fsdp4 working buffers %d B" %
          (state_bytes(ddp, "_max"), state_bytes(fsdp, "_max"), ratio, fsdp["work_bytes_max"]))
    assert ratio <= 0.30
    # Without overlap, working buffers stay at one gathered unit + one gradient buffer + a shard
    # of scratch: well under the whole model (which is what DDP holds per buffer). Overlap (the
    # default) doubles them, no more: the next unit's gather and the previous unit's reduce-scatter
    # each have a buffer of their own (on this 2-layer model the largest unit, the embedding, is
    # a quarter of the model, so that is about the whole model here).
    serial_fsdp, m = first_record(tmp_path, "fsdp4_no_overlap", 4, (1, 4, 1), ["parallel.overlap=false"])
    assert serial_fsdp, m.describe()
    print("fsdp4 working buffers: %d B with overlap, %d B without (limit 2x)" %
          (fsdp["work_bytes_max"], serial_fsdp["work_bytes_max"]))
    assert serial_fsdp["work_bytes_max"] < ddp["param_bytes"]
    assert serial_fsdp["work_bytes_max"] < fsdp["work_bytes_max"] <= 2 * serial_fsdp["work_bytes_max"]

    # ZeRO-2: gradients and moments sharded over dp (padded per unit), parameters replicated;
    # the full gradient exists only one unit at a time (working memory).
    zero2, m = first_record(tmp_path, "ddp4_zero2", 4, (4, 1, 1), ["parallel.zero=2"])
    assert zero2, m.describe()
    g_ratio = zero2["grad_bytes_max"] / ddp["grad_bytes_max"]
    o_ratio = zero2["optim_bytes_max"] / ddp["optim_bytes_max"]
    print("per-rank gradients: ddp4 %d B, zero2 over 4 %d B, ratio %.4f (limit 1/4 + 0.02); optimizer "
          "state ratio %.4f; parameters %d B vs %d B; zero2 working buffers %d B" %
          (ddp["grad_bytes_max"], zero2["grad_bytes_max"], g_ratio, o_ratio, zero2["param_bytes_max"],
           ddp["param_bytes_max"], zero2["work_bytes_max"]))
    assert g_ratio <= 1 / 4 + 0.02
    assert o_ratio <= 1 / 4 + 0.02
    assert zero2["param_bytes_max"] >= ddp["param_bytes_max"]  # replicated, not sharded

    serial, _ = first_record(tmp_path, "serial", 1, (1, 1, 1))
    tp, m = first_record(tmp_path, "tp2", 2, (1, 1, 2))
    if tp is None:
        if tp_missing(m):
            pytest.skip("tensor parallelism is not in the model yet: " + tp_missing(m))
        pytest.fail(m.describe())
    ratio = tp["param_bytes_max"] / serial["param_bytes"]
    print("parameters per rank: one process %d B, tp2 %d B, ratio %.3f (limit 0.55)" %
          (serial["param_bytes"], tp["param_bytes_max"], ratio))
    assert ratio <= 0.55


def test_init_from_weights(serial, tmp_path):
    """model.init under a mesh: every rank reads the file and keeps its part (HSDP 2x2 shards);
    3 more steps from the one-process run's final weights match one process doing the same."""
    init = os.path.join(str(serial()), "ck", "final.safetensors")
    extra = ["model.init=" + init, "train.steps=3", "eval.interval=0"]
    ref = tmp_path / "one"
    ref.mkdir()
    env = solo_env()
    r = subprocess.run([TRAINER, write_plan(ref)] + sets_for(ref, (1, 1, 1), extra), cwd=str(ref), env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    d = tmp_path / "hsdp"
    d.mkdir()
    rc, m = run_meshrun(d, 4, [write_plan(d)] + sets_for(d, (2, 2, 1), extra))
    assert rc == 0, m.describe()
    compare(ref, d, "init + hsdp2x2")


def test_diverged_loss_stops_every_rank_together(tmp_path):
    """A nan loss on ONE rank under DDP (with an async checkpoint in flight) ends every rank at the
    same step with the loss message, at once: no rank is left waiting in a collective for a comm
    timeout, and no rank reports a mere comm error. MESHRUN_COMM_TIMEOUT is 60 s here, so a
    stranded rank would show as a run of a minute. MESHRUN_FAULT_NAN makes rank 1's loss nan at
    step 3 (a test hook of the trainer)."""
    extra = ["checkpoint.interval=1", "checkpoint.async=true"]
    t0 = time.monotonic()
    m = Meshrun(["--nproc_per_node=2", "--rdzv_conf=" + FAST_CONF, TRAINER, write_plan(tmp_path)] +
                sets_for(tmp_path, (2, 1, 1), extra),
                env={"OMP_NUM_THREADS": "1", "MESHRUN_COMM_TIMEOUT": "60", "MESHRUN_FAULT_NAN": "1:3"},
                cwd=str(tmp_path))
    rc = m.wait(120)
    took = time.monotonic() - t0
    print("diverged ddp2 run ended in %.2f s with rc %d" % (took, rc))
    assert rc == 1, m.describe()
    # The ranks' own lines; meshrun's root-cause report quotes the error file's message too.
    lines = [l for l in m.err.splitlines()
             if l.startswith("[rank") and ("loss is nan at step" in l or "loss is inf at step" in l)]
    ranks = {l.split("]:")[0] for l in lines}
    assert ranks == {"[rank0", "[rank1"}, m.describe()  # both ranks name the loss, not a comm error
    steps = {l.split(" at step ")[1].split(" ")[0] for l in lines}
    assert steps == {"3"}, m.describe()  # at the same step, the faulty one
    assert took < 30, m.describe()
