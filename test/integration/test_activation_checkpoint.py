"""test_activation_checkpoint: parallel.activation_checkpoint changes memory, never the bits.

Each plan runs twice (or three times) on the tiny Llama of conftest.tiny_plan deepened to 4
layers, 6 steps with an evaluation at step 3: with activation_checkpoint "none", then "full"
(and, serially, "selective" with activation_checkpoint_every 2: blocks 1 and 3 checkpointed).
Checked against the "none" run of the same plan, tolerance none:
  - the loss and gradient norm of every step and the loss of every eval, bit for bit (the
    records hold %.9g, which round-trips a float32);
  - the final weights: the tensor bytes of final.safetensors identical (the metadata differs: it
    holds the plan).
Plans: one process, fsdp4, tp2 with sequence and loss parallel, fsdp2 x tp2.

The memory test runs one step at a model where activations dominate (dim 64, 4 layers, seq 128,
micro-batch 2) and reads the first metrics record: act_block_bytes (the transformer blocks' part
of the activation arena, as allocated) under "full" is at most 1/n_layers + 0.1 of "none"'s;
"selective" lies between; every figure is printed.
"""
import json
import os
import struct
import subprocess

import pytest

from conftest import FAST_CONF, Meshrun, bin_dir, solo_env, tiny_plan

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRAINER = os.path.join(bin_dir(), "trainer")
TEXT = os.path.join(REPO, "data", "tinyshakespeare.txt")


def plan(**model):
    p = tiny_plan(data={"train": TEXT, "format": "text"}, eval={"interval": 3, "batches": 2})
    p["model"]["n_layers"] = 4
    p["model"].update(model)
    p["train"]["steps"] = 6
    return p


# name: (ranks, mesh (dp_replicate, dp_shard, tp), extra --set)
PLANS = {
    "serial": (1, (1, 1, 1), []),
    "fsdp4": (4, (1, 4, 1), []),
    "tp2_sp_loss": (2, (1, 1, 2), ["parallel.sequence_parallel=true", "parallel.loss_parallel=true"]),
    "fsdp2_tp2": (4, (1, 2, 2), []),
}


def run(d, p, nproc, mesh, extra):
    os.makedirs(str(d), exist_ok=True)
    path = os.path.join(str(d), "plan.json")
    with open(path, "w") as f:
        json.dump(p, f)
    r, s, t = mesh
    args = []
    for kv in ["mesh.dp_replicate=%d" % r, "mesh.dp_shard=%d" % s, "mesh.tp=%d" % t,
               "log.metrics_file=%s" % os.path.join(str(d), "metrics.jsonl"),
               "checkpoint.dir=%s" % os.path.join(str(d), "ck")] + list(extra):
        args += ["--set", kv]
    if nproc == 1:
        env = solo_env()
        r = subprocess.run([TRAINER, path] + args, cwd=str(d), env=env, capture_output=True, text=True,
                           timeout=180)
        assert r.returncode == 0, r.stderr
    else:
        m = Meshrun(["--nproc_per_node=%d" % nproc, "--rdzv_conf=" + FAST_CONF, TRAINER, path] + args,
                    env={"OMP_NUM_THREADS": "1"}, cwd=str(d))
        rc = m.wait(180)
        assert rc == 0, m.err
    with open(os.path.join(str(d), "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def losses(records):
    return [(k, r["step"], r[k]) for r in records for k in ("loss", "grad_norm", "eval_loss") if k in r]


def tensor_bytes(d):
    with open(os.path.join(str(d), "ck", "final.safetensors"), "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    header.pop("__metadata__", None)
    return {k: (v["shape"], data[v["data_offsets"][0]:v["data_offsets"][1]]) for k, v in header.items()}


@pytest.mark.parametrize("name", sorted(PLANS))
def test_same_bits_as_none(tmp_path, name):
    nproc, mesh, extra = PLANS[name]
    modes = [("none", []), ("full", [])]
    if nproc == 1:
        modes.append(("selective", ["parallel.activation_checkpoint_every=2"]))
    ref_dir = tmp_path / "none"
    ref = run(ref_dir, plan(), nproc, mesh, extra + ["parallel.activation_checkpoint=none"])
    ref_losses, ref_weights = losses(ref), tensor_bytes(ref_dir)
    assert len([x for x in ref_losses if x[0] == "loss"]) == 6 and any(x[0] == "eval_loss" for x in ref_losses)
    for mode, more in modes[1:]:
        d = tmp_path / mode
        got = run(d, plan(), nproc, mesh, extra + ["parallel.activation_checkpoint=" + mode] + more)
        got_losses, got_weights = losses(got), tensor_bytes(d)
        diff = [(a, b) for a, b in zip(ref_losses, got_losses) if a != b]
        wdiff = sorted(k for k in ref_weights if ref_weights[k] != got_weights.get(k))
        print("%s %s vs none: %d values (loss, grad_norm, eval_loss), %d differ in any bit; %d tensors, %d differ (tolerance: none); "
              "act_bytes rank 0 %d vs %d" % (name, mode, len(ref_losses), len(diff), len(ref_weights),
                                             len(wdiff), got[0]["act_bytes"], ref[0]["act_bytes"]))
        assert len(got_losses) == len(ref_losses) and not diff, diff[:3]
        assert set(got_weights) == set(ref_weights) and not wdiff, wdiff[:3]
        assert got[0]["act_bytes"] < ref[0]["act_bytes"]


def test_activation_memory(tmp_path):
    p = plan(max_seq_len=128)
    p["train"].update({"steps": 1, "seq_len": 128, "global_batch_size": 2})
    p["eval"] = {"interval": 0}
    rec = {}
    for mode in ("none", "full", "selective"):
        rec[mode] = run(tmp_path / mode, p, 1, (1, 1, 1), ["parallel.activation_checkpoint=" + mode])[0]
    L = p["model"]["n_layers"]
    for mode in rec:
        print("dim 64, %d layers, seq 128, batch 2, %-9s: act_bytes %9d, act_block_bytes %9d" %
              (L, mode, rec[mode]["act_bytes"], rec[mode]["act_block_bytes"]))
    ratio = rec["full"]["act_block_bytes"] / rec["none"]["act_block_bytes"]
    print("full / none: blocks %.3f (bound 1/%d + 0.1 = %.3f), all activations %.3f" %
          (ratio, L, 1.0 / L + 0.1, rec["full"]["act_bytes"] / rec["none"]["act_bytes"]))
    assert ratio <= 1.0 / L + 0.1
    assert rec["full"]["act_block_bytes"] < rec["selective"]["act_block_bytes"] < rec["none"]["act_block_bytes"]
    for mode in rec:
        assert rec[mode]["act_bytes_max"] == rec[mode]["act_bytes"]  # one rank
