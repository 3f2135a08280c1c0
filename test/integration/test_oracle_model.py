"""The C model's loss and every gradient against a PyTorch Llama (llama_ref.py).

model_oracle (test/tools) runs one forward + backward on the cpu backend and dumps weights,
tokens, targets, logits, loss and gradients; here PyTorch recomputes them in float64 (the
assertion) and float32 (printed, to show that our fp32 error is of fp32's size).
Tolerances: loss 1e-5 relative; logits and every gradient 1e-4 relative max error,
max|c - ref| / max|ref|.
"""
import json
import os
import subprocess
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
import llama_ref  # noqa: E402

LOSS_TOL = 1e-5
GRAD_TOL = 1e-4

BUILD = os.environ.get("MESHRUN_BUILD", os.path.join(os.path.dirname(__file__), "..", "..", "build"))
ORACLE = os.path.join(BUILD, "tools", "model_oracle")

CONFIGS = {
    # the brief's GQA config: 4 heads share 2 kv heads
    "gqa": dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab=97, multiple_of=32, b=2, t=16),
    # plain multi-head, T crosses the 64-row attention block and is a multiple of nothing
    "mha_t70": dict(dim=48, n_layers=1, n_heads=6, n_kv_heads=6, vocab=50, multiple_of=16, b=1, t=70),
    # multi-query (1 kv head), 2 threads
    "mqa_threads2": dict(dim=32, n_layers=2, n_heads=4, n_kv_heads=1, vocab=61, multiple_of=8, b=3, t=9, threads=2),
}


def rel_err(a, ref):
    a, ref = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(ref, dtype=torch.float64)
    return ((a - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def run_oracle(tmp_path, name, params):
    if not os.path.exists(ORACLE):
        pytest.fail(f"{ORACLE} not built (make {ORACLE})")
    out = tmp_path / f"{name}.safetensors"
    args = [ORACLE, str(out)] + [f"{k}={v}" for k, v in params.items()]
    env = dict(os.environ, OMP_NUM_THREADS=str(params.get("threads", 1)))
    subprocess.run(args, check=True, env=env, timeout=120)
    return llama_ref.load_safetensors(str(out))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_model_matches_pytorch(tmp_path, name):
    tensors, meta = run_oracle(tmp_path, name, CONFIGS[name])
    cfg = json.loads(meta["config"])
    c_loss = float(tensors["loss"][0])
    results = {}
    for dtype in (torch.float64, torch.float32):
        ref = llama_ref.Llama(cfg, dtype=dtype)
        ref.load_weights(tensors)
        logits = ref(tensors["tokens"])
        loss = ref(tensors["tokens"], tensors["targets"])
        loss.backward()
        results[dtype] = (loss.item(), logits.detach(), {n: p.grad.detach() for n, p in ref.named_parameters()})

    loss64, logits64, grads64 = results[torch.float64]
    loss32, logits32, grads32 = results[torch.float32]
    print(f"\n[{name}] loss C {c_loss:.9g} torch64 {loss64:.9g} torch32 {loss32:.9g}")
    loss_rel = abs(c_loss - loss64) / abs(loss64)
    print(f"[{name}] loss rel diff C vs fp64: {loss_rel:.3e} (tol {LOSS_TOL:g}); torch fp32 vs fp64: "
          f"{abs(loss32 - loss64) / abs(loss64):.3e}")
    worst = rel_err(tensors["logits"], logits64)
    print(f"[{name}] {'logits':40s} C {worst:.3e}  torch32 {rel_err(logits32, logits64):.3e}")
    failures = []
    if worst > GRAD_TOL:
        failures.append(f"logits {worst:.3e}")
    for pname, g64 in grads64.items():
        e = rel_err(tensors["grad." + pname], g64)
        print(f"[{name}] grad {pname:35s} C {e:.3e}  torch32 {rel_err(grads32[pname], g64):.3e}")
        worst = max(worst, e)
        if e > GRAD_TOL:
            failures.append(f"{pname} {e:.3e}")
    print(f"[{name}] worst relative error {worst:.3e} (tol {GRAD_TOL:g})")
    assert loss_rel < LOSS_TOL, f"loss {c_loss} vs {loss64}: rel {loss_rel:.3e}"
    assert not failures, "gradients over tolerance: " + ", ".join(failures)


def test_oracle_detects_a_wrong_gradient(tmp_path):
    """The comparison can fail: a perturbed gradient is reported."""
    tensors, meta = run_oracle(tmp_path, "gqa", CONFIGS["gqa"])
    cfg = json.loads(meta["config"])
    ref = llama_ref.Llama(cfg, dtype=torch.float64)
    ref.load_weights(tensors)
    ref(tensors["tokens"], tensors["targets"]).backward()
    g = ref.layers[1].attention.wk.weight.grad
    bad = tensors["grad.layers.1.attention.wk.weight"].copy()
    bad[0, 0] += 0.01 * float(g.abs().max())
    assert rel_err(bad, g) > GRAD_TOL
