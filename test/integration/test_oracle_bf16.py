"""bf16 mixed precision against PyTorch: the C model's bf16 forward and backward from the same
initial weights as a float64 PyTorch Llama (llama_ref.py).

model_oracle dtype=bf16 computes with bf16 compute copies of the weights and bf16 activations
(fp32 statistics, fp32 gradient accumulation) and dumps the fp32 master weights and the fp32
gradients; PyTorch recomputes loss and gradients in float64 from those same master weights.
Tolerances (the issue's, of llm.c's order for bf16): the loss within 1e-2 relative, every gradient
within 5e-2 relative max error, max|c - ref| / max|ref|. For scale, the same numbers for PyTorch's
own bf16 (CPU autocast(bfloat16) of a float32 model) are printed beside ours, and the fp32 C model
is checked to be far closer than the bf16 one, so the comparison sees the bf16 path at all.
"""
import json
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
import llama_ref  # noqa: E402
from test_oracle_model import CONFIGS, rel_err, run_oracle  # noqa: E402

LOSS_TOL = 1e-2
GRAD_TOL = 5e-2


def reference(tensors, cfg):
    """float64 loss and gradients, and PyTorch's CPU autocast(bfloat16) ones, from the masters."""
    out = {}
    for mode in ("fp64", "autocast"):
        ref = llama_ref.Llama(cfg, dtype=torch.float64 if mode == "fp64" else torch.float32)
        ref.load_weights(tensors)
        if mode == "fp64":
            loss = ref(tensors["tokens"], tensors["targets"])
        else:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = ref(tensors["tokens"], tensors["targets"])
        loss.backward()
        out[mode] = (loss.item(), {n: p.grad.detach() for n, p in ref.named_parameters()})
    return out


@pytest.mark.parametrize("name", list(CONFIGS))
def test_bf16_model_matches_pytorch_fp64(tmp_path, name):
    params = dict(CONFIGS[name], dtype="bf16")
    tensors, meta = run_oracle(tmp_path, name + "_bf16", params)
    cfg = json.loads(meta["config"])
    assert cfg["dtype"] == "bf16"
    ref = reference(tensors, cfg)
    loss64, grads64 = ref["fp64"]
    loss_ac, grads_ac = ref["autocast"]
    c_loss = float(tensors["loss"][0])
    loss_rel = abs(c_loss - loss64) / abs(loss64)
    print(f"\n[{name}] loss bf16 C {c_loss:.7g} torch fp64 {loss64:.7g} torch autocast(bf16) {loss_ac:.7g}")
    print(f"[{name}] loss rel diff vs fp64: C bf16 {loss_rel:.3e} (tol {LOSS_TOL:g}), torch autocast "
          f"{abs(loss_ac - loss64) / abs(loss64):.3e}")
    worst, failures = 0.0, []
    for pname, g64 in grads64.items():
        e = rel_err(tensors["grad." + pname], g64)
        print(f"[{name}] grad {pname:35s} C bf16 {e:.3e}  torch autocast {rel_err(grads_ac[pname], g64):.3e}")
        worst = max(worst, e)
        if e > GRAD_TOL:
            failures.append(f"{pname} {e:.3e}")
    print(f"[{name}] worst gradient relative error {worst:.3e} (tol {GRAD_TOL:g})")
    assert loss_rel < LOSS_TOL, f"bf16 loss {c_loss} vs fp64 {loss64}: rel {loss_rel:.3e}"
    assert not failures, "bf16 gradients over tolerance: " + ", ".join(failures)


def test_bf16_is_really_bf16(tmp_path):
    """The fp32 run of the same model is ~1e-6 from fp64 and the bf16 run ~1e-3: bf16 arithmetic
    happened (a bf16 path that silently computed fp32 would fail here)."""
    t32, meta = run_oracle(tmp_path, "gqa_fp32", dict(CONFIGS["gqa"], dtype="fp32"))
    t16, _ = run_oracle(tmp_path, "gqa_bf16", dict(CONFIGS["gqa"], dtype="bf16"))
    cfg = json.loads(meta["config"])
    _, grads64 = reference(t32, cfg)["fp64"]
    e32 = max(rel_err(t32["grad." + n], g) for n, g in grads64.items())
    e16 = max(rel_err(t16["grad." + n], g) for n, g in grads64.items())
    print(f"\nworst gradient error vs fp64: fp32 {e32:.3e}, bf16 {e16:.3e}")
    assert e16 > 20 * e32, f"bf16 error {e16:.3e} is not clearly above fp32's {e32:.3e}"
    assert (t32["loss"] != t16["loss"]).any()
