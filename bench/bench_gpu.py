#!/usr/bin/env python3
"""bench_gpu: training throughput of bin/trainer on one GPU beside PyTorch on the same GPU.

For each model size (a Llama of about 125M parameters and one of about 0.85B, see SIZES), trains
on synthetic tokens for --warmup + --steps steps and reports tokens/s, MFU and peak GPU memory for:
  - ours:  bin/trainer with a plan written on the fly (device cuda, bf16 mixed precision: bf16
           compute copies, fp32 master weights, gradients and AdamW, as PyTorch's autocast side);
           tokens/s from its metrics file (log.metrics_file), warmup steps skipped; with
           --profile, MESHRUN_OP_PROFILE=<last warmup step> prints where that step's time went,
           kernel by kernel (trainer/run/opprof.h), without touching the measured steps;
  - torch eager and torch.compile: a small Llama written below (the structure of
           test/integration/llama_ref.py), bf16 autocast, SDPA flash attention, AdamW fused when
           available. Skipped with "PyTorch GPU reference unavailable" when torch or its CUDA is not.
Each side runs in its own process, one after the other, so peak memory is per process: sampled
with nvidia-smi (every 0.2 s, the process's used memory, which includes the CUDA context) for
every side, plus torch.cuda.max_memory_allocated for PyTorch. Ratios are against torch.compile,
measured in the same run.

MFU = model FLOPs per token x tokens/s / the GPU's dense bf16 peak. Model FLOPs per token, after
PaLM (Chowdhery et al. 2022, appendix B):
    6 N + 12 L T d
where N is the number of parameters that take part in matrix products (every parameter except
the token embedding, whose lookup is not a product), L the layers, T the sequence length and
d the model width (= heads x head dim). 6N is the forward (2N) plus backward (4N) of the weight
products; 12 L T d the attention scores and weighted sum (QK^T and PV, 2 x 2 T d per token per
layer forward, x3 with backward), counted for the full T x T square as PaLM does, although
causal attention only needs half. Peak: a table keyed by the GPU name nvidia-smi reports.
Each row is printed as soon as it is measured and, with --results FILE, appended to FILE as one
JSON object (a GPU session's results.jsonl), so a run cut short keeps what it measured.

Not here: multi-GPU runs, activation checkpointing."""
import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import threading
import time

# Dense bf16 tensor-core peaks in FLOP/s (vendor datasheets, SXM parts; no sparsity).
PEAK_BF16 = [("H200", 989e12), ("H100", 989e12), ("A100", 312e12)]

SIZES = {
    # a dry run's (scripts/gpu-session.sh --dry-run, device cpu): the same code path in seconds
    "tiny": dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, seq=64, batch=4,
                 multiple_of=32, ffn_mult=0, theta=10000.0),
    # ~125M (GPT-2 small shape, Llama blocks): dim 768, 12 layers, 12 heads, seq 1024
    "125m": dict(dim=768, n_layers=12, n_heads=12, n_kv_heads=12, vocab_size=32000, seq=1024, batch=8,
                 multiple_of=256, ffn_mult=0, theta=10000.0),
    # Llama 3.2 1B's shape (configs/llama-1b.json): dim 2048, 16 layers, 32 heads, 8 kv heads,
    # hidden 8192, vocab 128256, rope theta 5e5; output not tied to the embedding (1.5B
    # parameters); seq 2048, 4 sequences (8192 tokens) a step
    "1b": dict(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, vocab_size=128256, seq=2048, batch=4,
               multiple_of=256, ffn_mult=1.5, theta=500000.0),
}


def hidden_dim(m):
    """The feed-forward width as the trainer computes it (plan_llama_hidden_dim)."""
    h = 8 * m["dim"] // 3
    if m["ffn_mult"] > 0:
        h = int(m["ffn_mult"] * h)
    mo = m["multiple_of"]
    return mo * ((h + mo - 1) // mo)


def param_counts(m):
    """(total, in matrix products) parameters of our Llama (untied output)."""
    d, L, V = m["dim"], m["n_layers"], m["vocab_size"]
    hd = d // m["n_heads"]
    kvd = m["n_kv_heads"] * hd
    f = hidden_dim(m)
    block = d * d * 2 + d * kvd * 2 + 3 * d * f + 2 * d
    total = V * d + L * block + d + V * d
    return total, total - V * d


def flops_per_token(m):
    _, n_mm = param_counts(m)
    return 6 * n_mm + 12 * m["n_layers"] * m["seq"] * m["dim"]


def gpu_name():
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30).stdout.strip().splitlines()
        return out[0].strip() if out else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def peak_for(name):
    for key, peak in PEAK_BF16:
        if key in name:
            return peak
    return None


class MemSampler:
    """Largest used_memory (MiB) nvidia-smi reports for one pid, sampled every 0.2 s."""

    def __init__(self, pid):
        self.pid, self.peak, self.stop = pid, 0, False
        self.t = threading.Thread(target=self.run, daemon=True)
        self.t.start()

    def run(self):
        while not self.stop:
            try:
                out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                                      "--format=csv,noheader,nounits"], capture_output=True, text=True,
                                     timeout=10).stdout
                for line in out.splitlines():
                    parts = [p.strip() for p in line.split(",")]
                    if len(parts) == 2 and parts[0] == str(self.pid) and parts[1].isdigit():
                        self.peak = max(self.peak, int(parts[1]))
            except (OSError, subprocess.SubprocessError):
                pass
            time.sleep(0.2)

    def done(self):
        self.stop = True
        self.t.join(timeout=5)
        return self.peak / 1024.0


def run_with_sampler(cmd, env=None, timeout=600):
    try:
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    except OSError as e:
        return -1, "%s: %s" % (cmd[0], e), 0.0
    s = MemSampler(p.pid)
    try:
        out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        out, _ = p.communicate()
        out += "\n(timed out after %d s)" % timeout
    return p.returncode, out, s.done()


# ---------------------------------------------------------------------------------------- ours

def run_ours(trainer, size, m, steps, warmup, workdir, dtype="bf16", profile=False, timeout=600, device="cuda",
             attention="auto", graphs="auto"):
    tag = "%s-%s-%s" % (size, attention, graphs)
    plan = {
        "device": device, "seed": 1337, "overwrite": True,
        "model": {"dim": m["dim"], "n_layers": m["n_layers"], "n_heads": m["n_heads"],
                  "n_kv_heads": m["n_kv_heads"], "vocab_size": m["vocab_size"], "max_seq_len": m["seq"],
                  "multiple_of": m["multiple_of"], "ffn_dim_multiplier": m["ffn_mult"], "rope_theta": m["theta"],
                  "attention": attention},
        "mesh": {"dp_replicate": 1, "dp_shard": 1, "tp": 1},
        "parallel": {"mixed_precision": {"param_dtype": dtype, "reduce_dtype": "fp32"}},
        "train": {"steps": warmup + steps, "seq_len": m["seq"], "micro_batch_size": m["batch"],
                  "global_batch_size": m["batch"], "lr": 3e-4, "warmup_steps": 2, "decay": "cosine",
                  "weight_decay": 0.1, "beta1": 0.9, "beta2": 0.95, "grad_clip": 1.0, "cuda_graphs": graphs},
        "data": {"train": "", "format": "synthetic"},
        "eval": {"interval": 0, "batches": 1},
        "checkpoint": {"dir": os.path.join(workdir, "ckpt-%s" % tag), "interval": 0},
        "log": {"interval": 1, "metrics_file": os.path.join(workdir, "ours-%s.jsonl" % tag)},
        "sample": {"tokens": 0},
    }
    path = os.path.join(workdir, "plan-%s.json" % tag)
    with open(path, "w") as f:
        json.dump(plan, f)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MESHRUN_STORE")}
    if profile and warmup > 0:
        env["MESHRUN_OP_PROFILE"] = str(warmup)
    rc, out, mem = run_with_sampler([trainer, path], env=env, timeout=timeout)
    if profile:  # the profile table, as the trainer printed it
        lines = out.splitlines()
        start = next((i for i, ln in enumerate(lines) if ln.startswith("op profile of step")), None)
        if start is not None:
            end = start + 1
            while end < len(lines) and lines[end].startswith("  "):
                end += 1
            print("\n".join(lines[start:end]), flush=True)
    # the trainer's "attention: ..." line: which kernel ran, or why the reference did
    att = next((ln.split("attention: ", 1)[1] for ln in out.splitlines() if "attention: " in ln), "")
    if att:
        print("  %s attention=%s: %s" % (size, attention, att), flush=True)
    for ln in out.splitlines():  # what train.cuda_graphs did
        if "cuda_graphs" in ln:
            print("  %s graphs=%s: %s" % (size, graphs, ln.split("] ", 1)[-1]), flush=True)
    if rc != 0:
        return {"error": "trainer exit %s: %s" % (rc, out.strip().splitlines()[-1] if out.strip() else ""),
                "attention": att}
    toks, ms, peak, loss, counts = 0.0, 0.0, 0, None, {}
    with open(plan["log"]["metrics_file"]) as f:
        for line in f:
            r = json.loads(line)
            if "loss" in r and r.get("step", 0) > warmup:
                toks += r["tokens_per_s"] * r["step_ms"] / 1e3
                ms += r["step_ms"]
                peak = max(peak, r.get("peak_mem_bytes", 0))
                loss = r["loss"]
                # what a step asked of the device (the trainer counts its backend's calls): the
                # last step's (it reads the values of the steps before it: one host sync); the
                # kernels of a step that ran its work or recorded it (a replay's are the host's
                # few calls around one launch: host_calls_per_step)
                counts["host_syncs_per_step"] = r.get("host_syncs")
                key = "host_calls_per_step" if r.get("graph") == "replayed" else "kernels_per_step"
                counts[key] = r.get("kernels")
                counts["graph"] = r.get("graph", "none")
    if ms <= 0:
        return {"error": "no measured steps in the metrics file"}
    return dict({"tokens_per_s": toks / (ms / 1e3), "mem_gib": mem, "alloc_gib": peak / 2**30, "loss": loss,
                 "mode": dtype + " mixed" if dtype == "bf16" else dtype, "attention": att}, **counts)


# --------------------------------------------------------------------------------------- torch

def torch_worker(args):
    """Runs in its own process; prints one JSON line."""
    import torch
    import torch.nn.functional as F

    m = SIZES[args.size]
    torch.manual_seed(1337)
    dev = "cuda"
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True

    class RMSNorm(torch.nn.Module):
        def __init__(self, d):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(d))

        def forward(self, x):
            xf = x.float()
            return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).type_as(x) * self.weight

    def rope_tables(t, d):
        i = torch.arange(d // 2, dtype=torch.float64, device=dev)
        ang = torch.arange(t, dtype=torch.float64, device=dev)[:, None] * (m["theta"] ** (-2.0 * i / d))[None, :]
        return torch.cos(ang).float()[None, :, None, :], torch.sin(ang).float()[None, :, None, :]

    def rope(x, cos, sin):  # adjacent pairs (2i, 2i+1), as llama_ref.py and our backends
        x0, x1 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2).type_as(x)

    class Attention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            d, h, kv = m["dim"], m["n_heads"], m["n_kv_heads"]
            self.h, self.kv, self.hd = h, kv, d // h
            lin = lambda i, o: torch.nn.Linear(i, o, bias=False)
            self.wq, self.wk, self.wv, self.wo = lin(d, h * self.hd), lin(d, kv * self.hd), lin(d, kv * self.hd), lin(d, d)

        def forward(self, x, cos, sin):
            b, t, _ = x.shape
            q = rope(self.wq(x).view(b, t, self.h, self.hd), cos, sin).transpose(1, 2)
            k = rope(self.wk(x).view(b, t, self.kv, self.hd), cos, sin).transpose(1, 2)
            v = self.wv(x).view(b, t, self.kv, self.hd).transpose(1, 2)
            if self.kv != self.h:
                g = self.h // self.kv
                k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.wo(y.transpose(1, 2).reshape(b, t, -1))

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            d, f = m["dim"], hidden_dim(m)
            self.attention_norm, self.ffn_norm = RMSNorm(d), RMSNorm(d)
            self.attention = Attention()
            self.w1 = torch.nn.Linear(d, f, bias=False)
            self.w2 = torch.nn.Linear(f, d, bias=False)
            self.w3 = torch.nn.Linear(d, f, bias=False)

        def forward(self, x, cos, sin):
            x = x + self.attention(self.attention_norm(x), cos, sin)
            h = self.ffn_norm(x)
            return x + self.w2(F.silu(self.w1(h)) * self.w3(h))

    class Llama(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.tok_embeddings = torch.nn.Embedding(m["vocab_size"], m["dim"])
            self.layers = torch.nn.ModuleList(Block() for _ in range(m["n_layers"]))
            self.norm = RMSNorm(m["dim"])
            self.output = torch.nn.Linear(m["dim"], m["vocab_size"], bias=False)

        def forward(self, tok, tgt, cos, sin):
            x = self.tok_embeddings(tok)
            for blk in self.layers:
                x = blk(x, cos, sin)
            logits = self.output(self.norm(x))
            return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), tgt.view(-1))

    model = Llama().to(dev)
    for p in model.parameters():
        if p.dim() == 2:
            torch.nn.init.normal_(p, std=0.02)
    try:
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
        fused = True
    except (TypeError, RuntimeError):
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)
        fused = False
    fwd = model
    if args.compile:
        fwd = torch.compile(model)
    cos, sin = rope_tables(m["seq"], m["dim"] // m["n_heads"])
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        attn_ctx = lambda: sdpa_kernel([SDPBackend.FLASH_ATTENTION])
        attn = "flash"
    except ImportError:
        import contextlib
        attn_ctx = contextlib.nullcontext
        attn = "default"
    g = torch.Generator(device=dev)
    g.manual_seed(1)

    def step():
        tok = torch.randint(0, m["vocab_size"], (m["batch"], m["seq"]), device=dev, generator=g)
        tgt = torch.randint(0, m["vocab_size"], (m["batch"], m["seq"]), device=dev, generator=g)
        with torch.autocast("cuda", dtype=torch.bfloat16), attn_ctx():
            loss = fwd(tok, tgt, cos, sin)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    for _ in range(args.warmup):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        loss = step()
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    print(json.dumps({"tokens_per_s": args.steps * m["batch"] * m["seq"] / dt, "loss": float(loss),
                      "alloc_gib": torch.cuda.max_memory_allocated() / 2**30, "fused_adamw": fused,
                      "attention": attn, "torch": torch.__version__}))


def attention_bench(args):
    """Causal attention forward + backward at a size's shape through PyTorch's SDPA backends
    (flash, cuDNN, efficient), bf16: what a tensor-core attention costs on this GPU, beside our
    attention_fwd/bwd rows of the op profile. One JSON line per backend."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    m = SIZES[args.size]
    b, t, h, d = m["batch"], m["seq"], m["n_heads"], m["dim"] // m["n_heads"]
    q, k, v = (torch.randn(b, h, t, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    dout = torch.randn(b, h, t, d, device="cuda", dtype=torch.bfloat16)
    flops = 2.0 * b * h * t * t * d * (1 + 2.5)  # the causal half: QK^T and PV forward, 2.5x that backward
    for name, be in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION),
                     ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
        try:
            with sdpa_kernel([be]):
                def once():
                    o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
                    o.backward(dout)
                for _ in range(3):
                    once()
                torch.cuda.synchronize()
                ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
                ev[0].record()
                for _ in range(10):
                    once()
                ev[1].record()
                torch.cuda.synchronize()
                ms = ev[0].elapsed_time(ev[1]) / 10
            r = {"backend": name, "ms_fwd_bwd": ms, "tflops": flops / ms * 1e-9}
        except Exception as e:  # a backend this build or GPU lacks
            r = {"backend": name, "error": str(e).splitlines()[0][:120]}
        print(json.dumps(dict(r, shape="b%d t%d h%d d%d bf16 causal" % (b, t, h, d))), flush=True)


def torch_available():
    try:
        r = subprocess.run([sys.executable, "-c", "import torch; print(torch.__version__, torch.cuda.is_available())"],
                           capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.SubprocessError):
        return False, "python could not be run"
    if r.returncode != 0:
        return False, (r.stderr.strip().splitlines() or ["import torch failed"])[-1]
    ver, ok = r.stdout.split()
    return ok == "True", "torch %s, cuda available: %s" % (ver, ok)


def run_torch(size, steps, warmup, compile_, timeout=900):
    cmd = [sys.executable, os.path.abspath(__file__), "--torch-worker", "--size", size, "--steps", str(steps),
           "--warmup", str(warmup)] + (["--compile"] if compile_ else [])
    rc, out, mem = run_with_sampler(cmd, timeout=timeout)
    for line in reversed(out.strip().splitlines()):
        if line.startswith("{"):
            r = json.loads(line)
            r["mem_gib"] = mem
            r["mode"] = "bf16 autocast" + (", compile" if compile_ else "")
            return r
    return {"error": "exit %s: %s" % (rc, (out.strip().splitlines() or [""])[-1][:120])}


# ---------------------------------------------------------------------------------------- main

def row_line(size, impl, r, fpt, peak, ref=None, ref_name="eager"):
    if "error" in r:
        return "%-6s %-14s %s" % (size, impl, "error: " + r["error"][:110])
    tps = r["tokens_per_s"]
    mfu = "%6.1f%%" % (100 * tps * fpt / peak) if peak else "    n/a"
    ratio = "%9.2fx" % (tps / ref) if ref else "       n/a"
    alloc = "%.2f" % r["alloc_gib"] if r.get("alloc_gib") is not None else "-"
    k, h = r.get("kernels_per_step"), r.get("host_syncs_per_step")
    counts = "%7s %6s" % (k if k is not None else "-", h if h is not None else "-")
    return "%-6s %-14s %-22s %12.0f %7s %9.2f %9s %10s %s" % (size, impl, r["mode"], tps, mfu, r["mem_gib"], alloc,
                                                              ratio, counts)


HEADER = "%-6s %-14s %-22s %12s %7s %9s %9s %10s %7s %6s" % ("model", "impl", "mode", "tokens/s", "MFU", "smi GiB",
                                                             "alloc GiB", "vs compile", "kernels", "syncs")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bin", default=os.environ.get("MESHRUN_BIN", os.path.join(os.path.dirname(
        os.path.dirname(os.path.abspath(__file__))), "bin")))
    ap.add_argument("--sizes", default="125m,1b")
    ap.add_argument("--steps", type=int, default=10, help="measured steps")
    ap.add_argument("--warmup", type=int, default=3, help="steps not measured")
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--no-reference", action="store_true",
                    help="no row of ours with model.attention reference (the fast path's baseline)")
    ap.add_argument("--device", default="cuda", help="our side's device (cpu: a dry run of this script)")
    ap.add_argument("--graphs-row", action="store_true",
                    help="a row of ours with train.cuda_graphs off beside the fast path (auto: recorded steps)")
    ap.add_argument("--profile", action="store_true", help="our kernel-by-kernel profile of the last warmup step")
    ap.add_argument("--results", help="append one JSON object per measured row to this file")
    ap.add_argument("--timeout", type=float, default=900, help="seconds for each run (ours, eager, compile)")
    ap.add_argument("--deadline", type=float, default=0,
                    help="a time.time() after which no further run starts (0: none); each run's timeout is cut "
                         "to end by it")
    ap.add_argument("--attention", action="store_true",
                    help="only PyTorch's SDPA attention (forward + backward) at each size's shape, per backend")
    ap.add_argument("--torch-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--size", help=argparse.SUPPRESS)
    ap.add_argument("--compile", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.torch_worker:
        return torch_worker(args)
    if args.attention:
        for size in args.sizes.split(","):
            args.size = size
            attention_bench(args)
        return 0

    name = gpu_name()
    peak = peak_for(name)
    print("bench-gpu: %s, dense bf16 peak %s; %d measured steps after %d warmup" %
          (name, "%.0f TFLOP/s" % (peak / 1e12) if peak else "unknown (no MFU)", args.steps, args.warmup))
    have_torch, why = (False, "--no-torch") if args.no_torch else torch_available()
    if not have_torch:
        print("PyTorch GPU reference unavailable (%s)" % why)
    else:
        print("PyTorch: %s" % why)
    trainer = os.path.join(args.bin, "trainer")

    def budget():
        if not args.deadline:
            return args.timeout
        return min(args.timeout, args.deadline - time.time())

    def record(size, impl, r, fpt):
        print(row_line(size, impl, r, fpt, peak), flush=True)
        if args.results:
            rec = {"check": "bench", "gpu": name, "model": size, "impl": impl, "flops_per_token": fpt}
            rec.update(r)
            if "tokens_per_s" in r and peak:
                rec["mfu"] = r["tokens_per_s"] * fpt / peak
            with open(args.results, "a") as f:
                f.write(json.dumps(rec) + "\n")

    rows = []
    print(HEADER, flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-gpu.") as work:
        for size in args.sizes.split(","):
            m = SIZES[size]
            total, _ = param_counts(m)
            fpt = flops_per_token(m)
            print("-- %s: %.0fM parameters, hidden %d, %.2f GFLOP/token (6N + 12LTd), batch %d x %d" %
                  (size, total / 1e6, hidden_dim(m), fpt / 1e9, m["batch"], m["seq"]), flush=True)
            runs = [("ours", lambda t: run_ours(trainer, size, m, args.steps, args.warmup, work,
                                                profile=args.profile, timeout=t, device=args.device))]
            if not args.no_reference:  # the reference kernels beside the fast path
                runs.append(("ours reference", lambda t: run_ours(trainer, size, m, args.steps, args.warmup, work,
                                                                  timeout=t, device=args.device,
                                                                  attention="reference")))
            if have_torch:
                if not args.no_compile:
                    runs.append(("torch compile", lambda t: run_torch(size, args.steps, args.warmup, True, t)))
                runs.append(("torch eager", lambda t: run_torch(size, args.steps, args.warmup, False, t)))
            if args.graphs_row:  # the steps run unrecorded: what the recording saves (last: the least needed)
                runs.append(("ours no graphs", lambda t: run_ours(trainer, size, m, args.steps, args.warmup, work,
                                                                  timeout=t, device=args.device, graphs="off")))
            for impl, fn in runs:
                t = budget()
                r = fn(t) if t >= 20 else {"error": "skipped: the session's time budget is spent"}
                record(size, impl, r, fpt)
                rows.append((size, impl, r, fpt))

    print()
    print(HEADER)
    for size, impl, r, fpt in rows:
        ref = next((x["tokens_per_s"] for s_, i, x, _ in rows if s_ == size and i == "torch compile"
                    and "tokens_per_s" in x), None)
        print(row_line(size, impl, r, fpt, peak, ref))
    print("MFU against the dense bf16 peak; smi GiB: nvidia-smi's used memory of the process (with the CUDA "
          "context), sampled every 0.2 s; alloc GiB: the allocator's peak (ours: the backend's; torch: "
          "max_memory_allocated)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
