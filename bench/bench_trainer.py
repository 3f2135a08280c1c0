#!/usr/bin/python3
"""bench_trainer: full training-step throughput of our trainer (cpu backend) vs PyTorch on CPU.

    MESHRUN_BIN=$PWD/bin /usr/bin/python3 bench/bench_trainer.py [--threads N] [--steps N] [--warmup N]

Both sides run the same model and batch at the same thread count, in this one run:
Llama dim 384, 6 layers, 6 heads / 2 kv heads, hidden 1024, vocab 256 (~9.6M parameters),
micro batch 8 x seq 256 = 2048 tokens per step, fp32. A step is everything an optimizer step
costs: batch, forward, backward, global-norm clipping, AdamW.
  ours:    bin/trainer on tinyshakespeare with eval, sampling and logging off; step times come
           from its metrics file (step_ms of each optimizer step).
  pytorch: test/integration/llama_ref.py's Llama (eager), torch.optim.AdamW (default
           implementation), clip_grad_norm_, torch.set_num_threads(N); timed with perf_counter.
The first --warmup steps of each side are excluded; the table shows the median step time,
tokens/s from it, and the ratio ours / pytorch (> 1: we are faster).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "test", "integration"))

MODEL = {"dim": 384, "n_layers": 6, "n_heads": 6, "n_kv_heads": 2, "vocab_size": 256, "max_seq_len": 256,
         "multiple_of": 256}
B, T = 8, 256
TEXT = os.path.join(REPO, "data", "tinyshakespeare.txt")


def bench_ours(trainer, threads, steps, warmup):
    with tempfile.TemporaryDirectory() as tmp:
        plan = {"device": "cpu", "seed": 1, "model": MODEL,
                "train": {"steps": warmup + steps, "seq_len": T, "micro_batch_size": B, "lr": 1e-3,
                          "warmup_steps": 2, "grad_clip": 1.0},
                "data": {"train": TEXT, "format": "text", "val_fraction": 0.1},
                "eval": {"interval": 0}, "sample": {"tokens": 0},
                "checkpoint": {"dir": tmp},
                "log": {"interval": 1000000, "metrics_file": os.path.join(tmp, "m.jsonl")}}
        path = os.path.join(tmp, "bench.json")
        with open(path, "w") as f:
            json.dump(plan, f)
        env = dict(os.environ, OMP_NUM_THREADS=str(threads))
        r = subprocess.run([trainer, path], env=env, capture_output=True, text=True)
        if r.returncode != 0:
            sys.exit(f"bench_trainer: trainer failed:\n{r.stderr}")
        with open(os.path.join(tmp, "m.jsonl")) as f:
            recs = [json.loads(l) for l in f if l.strip()]
    params = recs[0]["num_params"]
    ms = [x["step_ms"] for x in recs if "step_ms" in x][warmup:]
    return params, ms


def bench_torch(threads, steps, warmup, autocast_bf16=False):
    """PyTorch's step times; with autocast_bf16 the forward and loss run under CPU
    autocast(bfloat16) (matmuls in bf16; parameters, gradients and AdamW in fp32). Raises
    RuntimeError when the last loss is not finite."""
    import contextlib

    import numpy as np
    import torch
    import llama_ref

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    cfg = dict(MODEL, hidden_dim=llama_ref.llama_hidden_dim(MODEL["dim"], MODEL["multiple_of"]))
    model = llama_ref.Llama(cfg, dtype=torch.float32)
    decay = [p for n, p in model.named_parameters() if p.dim() == 2 and not n.startswith("tok_")]
    other = [p for n, p in model.named_parameters() if not (p.dim() == 2 and not n.startswith("tok_"))]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
                            lr=1e-3, betas=(0.9, 0.95), eps=1e-8)
    data = np.frombuffer(open(TEXT, "rb").read(), dtype=np.uint8).astype(np.int64)
    rng = np.random.default_rng(0)
    ms = []
    for s in range(warmup + steps):
        t0 = time.perf_counter()
        offs = rng.integers(0, len(data) - T - 1, size=B)
        win = np.stack([data[o:o + T + 1] for o in offs])
        tok, tgt = torch.from_numpy(win[:, :-1]), torch.from_numpy(win[:, 1:])
        opt.zero_grad(set_to_none=True)
        amp = torch.autocast("cpu", dtype=torch.bfloat16) if autocast_bf16 else contextlib.nullcontext()
        with amp:
            loss = model(tok, tgt)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        ms.append((time.perf_counter() - t0) * 1e3)
    if not torch.isfinite(loss):
        raise RuntimeError("pytorch: loss is %s" % loss.item())
    return sum(p.numel() for p in model.parameters()), ms[warmup:], torch.__version__


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS") or os.cpu_count()))
    ap.add_argument("--steps", type=int, default=8, help="timed steps per side (default 8)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    args = ap.parse_args()
    trainer = os.path.join(os.environ.get("MESHRUN_BIN", os.path.join(REPO, "bin")), "trainer")

    p_ours, ours = bench_ours(trainer, args.threads, args.steps, args.warmup)
    p_torch, ref, tv = bench_torch(args.threads, args.steps, args.warmup)
    if p_ours != p_torch:
        sys.exit(f"bench_trainer: parameter counts differ: ours {p_ours}, pytorch {p_torch}")

    print(f"training step: Llama dim {MODEL['dim']}, {MODEL['n_layers']} layers, {MODEL['n_heads']} heads / "
          f"{MODEL['n_kv_heads']} kv, vocab {MODEL['vocab_size']}, {p_ours / 1e6:.2f}M params; "
          f"batch {B} x {T} = {B * T} tokens; fp32; {args.threads} threads; "
          f"{args.steps} timed steps after {args.warmup} warmup")
    rows = [("meshrun trainer (cpu)", ours), (f"pytorch {tv} eager", ref)]
    ref_med = statistics.median(ref)
    print(f"{'implementation':<24} {'median ms':>10} {'min ms':>9} {'max ms':>9} {'tokens/s':>10} {'ratio':>7}")
    for name, ms in rows:
        med = statistics.median(ms)
        print(f"{name:<24} {med:>10.1f} {min(ms):>9.1f} {max(ms):>9.1f} {B * T / med * 1e3:>10,.0f} "
              f"{ref_med / med:>7.2f}")
    print("ratio: pytorch median step time / this row's (> 1.00: faster than pytorch)")


if __name__ == "__main__":
    main()
