"""bench_model_vs_torch: forward + backward time of our C model vs PyTorch CPU, same threads.

Run by hand (not collected by pytest):
    MESHRUN_BUILD=$PWD/build /usr/bin/python3 bench/bench_model_vs_torch.py [threads] [iters]
Model: dim 384, 6 layers, 6 heads, vocab 256, hidden 1024 (~10.8M params), B=8, T=256, fp32.
OPENBLAS_CORETYPE and the like are inherited by both sides, so both use the same sgemm kernels.
PyTorch runs llama_ref.Llama (eager, explicit softmax attention) and, for reference, the same
model with F.scaled_dot_product_attention (torch >= 2.0 only). Prints median ms per fwd+bwd and the ratio.
"""
import os
import re
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "test", "integration"))  # llama_ref, the PyTorch Llama
import llama_ref  # noqa: E402

CFG = dict(dim=384, n_layers=6, n_heads=6, n_kv_heads=6, vocab_size=256, hidden_dim=1024)
B, T = 8, 256


def torch_time(threads, iters, sdpa):
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    m = llama_ref.Llama(CFG, dtype=torch.float32)
    if sdpa:
        def fwd(self, x):
            b, t, _ = x.shape
            q = llama_ref.rope(self.wq(x).view(b, t, self.h, self.d), self.theta).transpose(1, 2)
            k = llama_ref.rope(self.wk(x).view(b, t, self.kv, self.d), self.theta).transpose(1, 2)
            v = self.wv(x).view(b, t, self.kv, self.d).transpose(1, 2)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.h != self.kv)
            return self.wo(o.transpose(1, 2).reshape(b, t, -1))
        for blk in m.layers:
            blk.attention.forward = fwd.__get__(blk.attention)
    tok = torch.randint(0, CFG["vocab_size"], (B, T))
    tgt = torch.randint(0, CFG["vocab_size"], (B, T))
    times = []
    for i in range(iters + 1):
        t0 = time.perf_counter()
        m.zero_grad(set_to_none=False)
        m(tok, tgt).backward()
        if i:
            times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def c_time(threads, iters):
    exe = os.path.join(os.environ.get("MESHRUN_BUILD", "build"), "tools", "model_bench")
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    args = [exe, f"threads={threads}", f"iters={iters}", f"b={B}", f"t={T}"] + [
        f"{k}={v}" for k, v in (("dim", CFG["dim"]), ("n_layers", CFG["n_layers"]), ("n_heads", CFG["n_heads"]),
                                ("n_kv_heads", CFG["n_kv_heads"]), ("vocab", CFG["vocab_size"]), ("hidden", CFG["hidden_dim"]))]
    out = subprocess.run(args, env=env, check=True, capture_output=True, text=True).stdout
    return float(re.search(r"median_ms ([0-9.]+)", out).group(1))


def torch_time_subprocess(threads, iters, sdpa):
    """PyTorch in a fresh process whose BLAS pool has the same size: Debian's torch calls
    OpenBLAS (pthread build), which ignores torch.set_num_threads and otherwise starts one
    thread per core on top of torch's OpenMP threads."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), OPENBLAS_NUM_THREADS=str(threads))
    code = (f"import sys; sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r}); "
            f"import bench_model_vs_torch as b; print(b.torch_time({threads}, {iters}, {sdpa}))")
    out = subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True, text=True).stdout
    return float(out.split()[-1])


def main():
    threads = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    iters = int(sys.argv[2]) if len(sys.argv) > 2 else 5
    c = c_time(threads, iters)
    te = torch_time_subprocess(threads, iters, sdpa=False)
    ts = torch_time_subprocess(threads, iters, sdpa=True) if hasattr(F, "scaled_dot_product_attention") else None
    print(f"{'impl':28s} {'threads':>7s} {'ms/step':>9s} {'vs C':>6s}")
    print(f"{'meshrun cpu (C)':28s} {threads:7d} {c:9.1f} {1.0:6.2f}")
    print(f"{'torch eager (llama_ref)':28s} {threads:7d} {te:9.1f} {te / c:6.2f}")
    if ts is not None:
        print(f"{'torch sdpa':28s} {threads:7d} {ts:9.1f} {ts / c:6.2f}")


if __name__ == "__main__":
    main()
