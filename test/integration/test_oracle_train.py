"""test_oracle_train: 20 optimizer steps of the trainer against the same training in PyTorch.

The trainer runs a tiny grouped-query Llama (6 heads, 2 kv heads) for 20 steps with linear
warmup then cosine decay, weight decay, gradient accumulation (2 micro-batches per step) and
gradient clipping that bites (grad_clip 0.5 against norms of about 1-3), writing
  --dump-init FILE     its initial weights (safetensors, our tensor names),
  --dump-batches FILE  every micro-batch's tokens then targets (int32), in training order,
  log.metrics_file     the loss, grad norm and lr of every step.
PyTorch then repeats the run in float64 from the same weights on the same batches: the
llama_ref.py model, torch.optim.AdamW with the plan's betas/eps and weight decay on the same
tensors (not on norms or the embedding: the plan's defaults), global-norm clipping
(scale = min(1, clip / norm), the trainer's rule; torch's clip_grad_norm_ adds 1e-6 to the norm),
and the schedule of trainer/model/optim.h re-implemented below. Every step's loss must agree within
1e-4 relative; the lr must agree within 1e-8 relative (the metrics file keeps 9 digits) and the gradient
norm within 5e-3 relative. The grad-norm bound is wider because the norm is the most rounding-sensitive
figure of fp32 training: PyTorch's own fp32 run of this test drifts 1.5e-3 from its float64 run, and ours
has been seen between 4e-4 and 1.2e-3 from float64. The observed maxima are printed.
"""
import json
import math
import os
import subprocess

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import llama_ref  # noqa: E402  (test/integration is on sys.path under pytest)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.environ.get("MESHRUN_BIN", os.path.join(REPO, "bin"))
TEXT = os.path.join(REPO, "data", "tinyshakespeare.txt")

PLAN = {
    "device": "cpu",
    "seed": 2024,
    "model": {"dim": 48, "n_layers": 2, "n_heads": 6, "n_kv_heads": 2, "vocab_size": 256,
              "max_seq_len": 32, "multiple_of": 16, "init_std": 0.05},
    "train": {"steps": 20, "seq_len": 32, "micro_batch_size": 4, "global_batch_size": 8,
              "lr": 1e-2, "min_lr": 1e-3, "warmup_steps": 5, "decay": "cosine",
              "weight_decay": 0.1, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "grad_clip": 0.5},
    "data": {"train": TEXT, "format": "text", "val_fraction": 0.1},
    "eval": {"interval": 0},
    "log": {"interval": 5},
    "sample": {"tokens": 0},
}
LOSS_RTOL, LR_RTOL, GNORM_RTOL = 1e-4, 1e-8, 5e-3


def schedule(t, s):
    """trainer/model/optim.h: lr of optimizer step s (0-based)."""
    if s < t["warmup_steps"]:
        return t["lr"] * (s + 1) / t["warmup_steps"]
    p = min(1.0, (s - t["warmup_steps"]) / (t["steps"] - t["warmup_steps"]))
    return t["min_lr"] + (t["lr"] - t["min_lr"]) * 0.5 * (1 + math.cos(math.pi * p))


def run_trainer(tmp_path):
    plan_path = tmp_path / "oracle.json"
    plan_path.write_text(json.dumps(PLAN))
    init, batches, metrics = tmp_path / "init.safetensors", tmp_path / "batches.i32", tmp_path / "m.jsonl"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run([os.path.join(BIN, "trainer"), str(plan_path), "--dump-init", str(init),
                        "--dump-batches", str(batches), "--set", f"log.metrics_file={metrics}",
                        "--set", f"checkpoint.dir={tmp_path / 'ck'}"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    with open(metrics) as f:
        recs = [json.loads(l) for l in f if l.strip()]
    return init, batches, recs[0], [x for x in recs if "loss" in x]


def torch_training(init, batches, resolved):
    m, t = resolved["model"], resolved["train"]
    cfg = {k: m[k] for k in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "hidden_dim",
                             "norm_eps", "rope_theta")}
    model = llama_ref.Llama(cfg, dtype=torch.float64)
    weights, meta = llama_ref.load_safetensors(str(init))
    assert "plan" in meta
    model.load_weights(weights)

    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (no_decay if name.endswith("norm.weight") or name.startswith("tok_embeddings") else decay).append(p)
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": t["weight_decay"]},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=t["lr"], betas=(t["beta1"], t["beta2"]), eps=t["eps"])

    B, T, G = t["micro_batch_size"], t["seq_len"], t["global_batch_size"]
    accum = G // B
    data = np.fromfile(batches, dtype=np.int32).reshape(t["steps"], accum, 2, B, T)
    losses, norms, lrs = [], [], []
    for s in range(t["steps"]):
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for k in range(accum):
            loss = model(data[s, k, 0], data[s, k, 1])
            (loss / accum).backward()
            total += loss.item()
        grads = [p.grad for p in model.parameters()]
        norm = math.sqrt(sum(float((g * g).sum()) for g in grads))
        scale = min(1.0, t["grad_clip"] / norm)
        for g in grads:
            g.mul_(scale)
        lr = schedule(t, s)
        for grp in opt.param_groups:
            grp["lr"] = lr
        opt.step()
        losses.append(total / accum)
        norms.append(norm)
        lrs.append(lr)
    return losses, norms, lrs


def test_twenty_adamw_steps_match_pytorch(tmp_path):
    torch.set_num_threads(1)
    init, batches, first, steps = run_trainer(tmp_path)
    resolved = first["plan"]
    assert len(steps) == 20
    ref_loss, ref_norm, ref_lr = torch_training(init, batches, resolved)

    rel_loss = [abs(s["loss"] - r) / abs(r) for s, r in zip(steps, ref_loss)]
    rel_norm = [abs(s["grad_norm"] - r) / r for s, r in zip(steps, ref_norm)]
    d_lr = [abs(s["lr"] - r) / r for s, r in zip(steps, ref_lr)]
    print("\nstep   trainer loss   pytorch loss   rel diff   grad norm (ours / torch)   lr")
    for i, s in enumerate(steps):
        print(f"{s['step']:4d}   {s['loss']:12.7f}   {ref_loss[i]:12.7f}   {rel_loss[i]:.1e}   "
              f"{s['grad_norm']:9.5f} / {ref_norm[i]:9.5f}   {s['lr']:.3e}")
    clipped = sum(n > PLAN["train"]["grad_clip"] for n in ref_norm)
    print(f"max relative loss difference {max(rel_loss):.2e} (tolerance {LOSS_RTOL:g}); "
          f"max relative grad-norm difference {max(rel_norm):.2e} (tolerance {GNORM_RTOL:g}); "
          f"max relative lr difference {max(d_lr):.1e} (tolerance {LR_RTOL:g}, 9 digits in the file); clipping active on {clipped}/20 steps; "
          f"loss {ref_loss[0]:.4f} -> {ref_loss[-1]:.4f}")
    # The run must exercise what it claims to: clipping on most steps, the loss moving.
    assert clipped >= 10
    assert ref_loss[-1] < ref_loss[0] - 0.5
    assert max(d_lr) <= LR_RTOL
    assert max(rel_norm) <= GNORM_RTOL
    assert max(rel_loss) <= LOSS_RTOL
