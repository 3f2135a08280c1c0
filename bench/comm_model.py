#!/usr/bin/env python3
"""comm_model: expected tokens/s per GPU of the 8B plan at scale, on paper (docs/gpu.md).

An alpha-beta model: each collective of S bytes over n ranks in a ring costs
    (n - 1) * alpha + (n - 1) / n * S / busbw          (all-gather, reduce-scatter)
    2 (n - 1) * alpha + 2 (n - 1) / n * S / busbw      (all-reduce)
with busbw the bus bandwidth of the slowest link the ring crosses: NVLink inside a node of 8,
InfiniBand between nodes. The compute of one GPU's step comes from the single-GPU step measured
on an H200 (docs/gpu.md: matmuls at the measured cuBLASLt rate, attention at our kernels' or at
cuDNN's measured rate, the memory-bound kernels scaled from the 1B profile by the bytes they move
and by H100/H200 memory bandwidth). What overlaps: FSDP's all-gathers and reduce-scatters run
under the layers' compute (prefetch one unit ahead, reduce-scatter behind the backward), so only
the first all-gather, the last reduce-scatter and any excess of comm over compute are exposed;
tensor-parallel collectives sit on the critical path (not overlapped). HSDP's cross-node
all-reduce overlaps the backward like DDP's buckets.

    bench/comm_model.py            # the table of docs/gpu.md
    bench/comm_model.py --busbw-ib 25 --alpha-ib 30   # other fabric figures (GB/s, us)

Every figure the model takes is an argument; defaults are NVIDIA's published link rates with
NCCL's usual efficiency (see --help), to be replaced by nccl-tests measured on the cluster."""
import argparse

# Measured on one H200 (docs/gpu.md, bench 1b of call 4, the op profile of one step): its parts.
MM_RATE = 640.2e12          # cuBLASLt bf16, all the step's matmuls together (FLOP/s; call 3: 690.8)
ATTN_RATE_REFERENCE = 11.7e12  # our SIMT reference attention, fwd + bwd (causal FLOPs; calls 1-2)
ATTN_RATE_CUDNN = 219.6e12  # cuDNN's fused attention in our step: 17.52 ms fwd + bwd for 3.85 TFLOP
MEM_ACT_1B = 15.4e-3        # s: swiglu, rmsnorm, rope, cross-entropy, embedding for 8192 tokens
MEM_OPT_1B = 22.6e-3        # s: AdamW, grad-norm sums, bf16 copies for 1.50e9 parameters
H100_MEM_FACTOR = 4.8 / 3.35  # memory-bound time on an H100 vs the H200 it was measured on
PEAK = 989e12


def model_8b():
    d, L, h, kv, V, T = 4096, 32, 32, 8, 128256, 2048
    F = 14336  # 8 d / 3 x 1.3, rounded up to 1024 (configs/llama-8b.json)
    hd = d // h
    layer = d * d * 2 + 2 * d * kv * hd + 3 * d * F + 2 * d
    N = V * d * 2 + L * layer + d
    n_mm = N - V * d
    return dict(d=d, L=L, V=V, T=T, F=F, N=N, n_mm=n_mm, layer=layer)


def compute_s(m, tokens, params_local, attn_rate, tp=1):
    """One GPU's compute for `tokens` tokens of its (data-parallel) batch; tp divides the work."""
    f_mm = 6 * m["n_mm"] * tokens / tp
    f_attn = 2 * 2 * m["L"] * m["T"] / 2 * m["d"] * tokens * 3.5 / tp  # causal half, fwd + 2.5x bwd
    act_1b = 16 * (2048 + 8192)  # L (d + F) of the 1B the profile measured
    mem_act = MEM_ACT_1B * (m["L"] * (m["d"] + m["F"]) / act_1b) * tokens / 8192 / tp
    mem_opt = MEM_OPT_1B * params_local / 1.50e9
    return f_mm / MM_RATE + f_attn / attn_rate + (mem_act + mem_opt) * H100_MEM_FACTOR


def ring(n, size, bw, alpha, allreduce=False):
    if n <= 1:
        return 0.0
    k = 2 if allreduce else 1
    return k * ((n - 1) * alpha + (n - 1) / n * size / bw)


def plan_step(kind, gpus, m, a, attn_rate, tokens_per_gpu):
    node = 8
    nv, ib = a.busbw_nvlink * 1e9, a.busbw_ib * 1e9
    anv, aib = a.alpha_nvlink * 1e-6, a.alpha_ib * 1e-6
    N, L = m["N"], m["L"]
    units = L + 2  # layers, plus the embedding and the output as units of their own
    bw, al = (nv, anv) if gpus <= node else (ib, aib)
    if kind == "FSDP":
        t_c = compute_s(m, tokens_per_gpu, N / gpus, attn_rate)
        per_unit = [ring(gpus, 2 * N / units, bw, al), ring(gpus, 2 * N / units, bw, al),
                    ring(gpus, 4 * N / units, bw, al)]  # bf16 gathers fwd and bwd, fp32 reduce-scatter
        comm = units * sum(per_unit)
        edge = per_unit[0] + per_unit[2]
        exposed = edge + max(0.0, comm - edge - t_c)
        tp_s = 0.0
    elif kind == "HSDP":
        shard, rep = min(node, gpus), max(1, gpus // node)
        t_c = compute_s(m, tokens_per_gpu, N / shard, attn_rate)
        per_unit = [ring(shard, 2 * N / units, nv, anv), ring(shard, 2 * N / units, nv, anv),
                    ring(shard, 4 * N / units, nv, anv)]
        ar = ring(rep, 4 * N / shard, ib, aib, allreduce=True)  # the shard's gradients across nodes
        comm = units * sum(per_unit) + ar
        edge = per_unit[0] + per_unit[2] + ar / units
        exposed = edge + max(0.0, comm - edge - t_c)
        tp_s = 0.0
    else:  # FSDP x TP: tp 8 inside a node (sequence parallel), FSDP over the nodes
        tp, dp = min(node, gpus), max(1, gpus // node)
        group_tokens = tokens_per_gpu * tp  # the TP group's batch: the same tokens per GPU
        t_c = compute_s(m, group_tokens, N / tp / dp, attn_rate, tp=tp)
        act = group_tokens * m["d"] * 2  # bf16 activations of the group's batch
        # per layer: all-gather + reduce-scatter around attention and around the MLP, fwd and bwd
        tp_s = L * 8 * ring(tp, act, nv, anv)
        per_unit = [ring(dp, 2 * N / tp / units, ib, aib), ring(dp, 2 * N / tp / units, ib, aib),
                    ring(dp, 4 * N / tp / units, ib, aib)]
        fsdp = units * sum(per_unit)
        comm = fsdp + tp_s
        edge = per_unit[0] + per_unit[2]
        exposed = tp_s + edge + max(0.0, fsdp - edge - t_c)
    step = t_c + exposed
    return dict(compute=t_c, comm=comm, hidden=comm - exposed, exposed=exposed, step=step,
                tps=tokens_per_gpu / step, mfu=tokens_per_gpu / step * (6 * m["n_mm"] + 12 * L * m["T"] * m["d"]) / PEAK)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--busbw-nvlink", type=float, default=360.0,
                    help="GB/s: all-gather/reduce-scatter bus bandwidth inside an H100 node (NVLink 4, 450 GB/s "
                         "a direction, ~80%% of it in nccl-tests)")
    ap.add_argument("--busbw-ib", type=float, default=45.0,
                    help="GB/s per GPU between nodes (one 400 Gb/s NDR port a GPU = 50 GB/s, ~90%% of it)")
    ap.add_argument("--alpha-nvlink", type=float, default=8.0, help="us per ring step inside a node")
    ap.add_argument("--alpha-ib", type=float, default=20.0, help="us per ring step between nodes")
    ap.add_argument("--tokens", type=int, default=8192, help="tokens per GPU per step (4 x 2048)")
    a = ap.parse_args()
    m = model_8b()
    print("8B (dim %d, %d layers, hidden %d, vocab %d): %.2fB parameters, %.1f GFLOP/token; %d tokens per GPU a "
          "step; H100 SXM, 8 per node; busbw NVLink %.0f GB/s, IB %.0f GB/s; alpha %.0f / %.0f us" %
          (m["d"], m["L"], m["F"], m["V"], m["N"] / 1e9, (6 * m["n_mm"] + 12 * m["L"] * m["T"] * m["d"]) / 1e9,
           a.tokens, a.busbw_nvlink, a.busbw_ib, a.alpha_nvlink, a.alpha_ib))
    print("%-22s %-6s %5s %10s %9s %9s %9s %9s %11s %6s" % ("attention", "plan", "GPUs", "compute ms", "comm ms",
                                                           "hidden", "exposed", "step ms", "tok/s/GPU", "MFU"))
    for label, rate in (("reference attention", ATTN_RATE_REFERENCE), ("cuDNN (model default)", ATTN_RATE_CUDNN)):
        for kind in ("FSDP", "HSDP", "FSDPxTP"):
            for gpus in (8, 64, 1024):
                r = plan_step(kind, gpus, m, a, rate, a.tokens)
                print("%-22s %-6s %5d %10.1f %9.1f %9.1f %9.1f %9.1f %11.0f %5.1f%%" %
                      (label, kind, gpus, r["compute"] * 1e3, r["comm"] * 1e3, r["hidden"] * 1e3,
                       r["exposed"] * 1e3, r["step"] * 1e3, r["tps"], 100 * r["mfu"]))


if __name__ == "__main__":
    main()
