"""llama2.c and Hugging Face files written by trainer/formats/interop, loaded by PyTorch; stories260K.bin read by us.

What: interop_tool (test/tools) exports a random model of ours (untied, tied, GQA, MQA) as a
llama2.c file or an HF directory and dumps our logits on a batch; here an independent reader of
each format loads the files into a PyTorch Llama of that format's convention -- llama_ref.Llama
(Meta: adjacent RoPE pairs) for llama2.c, HFLlama below (HF names, rotate-half RoPE, no
transformers) for HF -- and the logits must agree. stories260K.bin (../shared/data, or
MESHRUN_DATA) is imported by us: its logits equal llama_ref's on the same weights, its greedy
generation from BOS scores a low loss while a random model of its dims scores about log(512),
and converting it to HF and back to llama2.c keeps it.

Tolerance: logits max|C - torch64| <= 1e-5 * max(1, max|torch64|) (C computes in fp32; the
absolute and relative differences are printed). Files written by us and read back by us are
compared bit for bit.
What not: the C round trips in detail (test/unit/test_interop.c), bf16 or sharded HF files.
"""
import json
import math
import os
import struct
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
import llama_ref  # noqa: E402

TOL = 1e-5
HERE = os.path.dirname(os.path.abspath(__file__))
BUILD = os.environ.get("MESHRUN_BUILD", os.path.join(HERE, "..", "..", "build"))
TOOL = os.path.join(BUILD, "tools", "interop_tool")
DATA = os.environ.get("MESHRUN_DATA", os.path.join(HERE, "..", "..", "..", "shared", "data"))
STORIES = os.path.join(DATA, "stories260K.bin")


def tool(*args, check=True):
    if not os.path.exists(TOOL):
        pytest.fail(f"{TOOL} not built (make {TOOL})")
    p = subprocess.run([TOOL] + [str(a) for a in args], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    if check and p.returncode != 0:
        pytest.fail(f"interop_tool {' '.join(map(str, args))} exited {p.returncode}\n{p.stdout}\n{p.stderr}")
    return p


# --------------------------------------------------------------------- independent readers

read_llama2c = llama_ref.read_llama2c


class HFLlama(torch.nn.Module):
    """LlamaForCausalLM's math with its parameter names, written here (transformers is not
    installed): RMSNorm, RoPE rotating the two halves of each head (rotate_half), GQA by
    repeating each kv head for consecutive query heads, SwiGLU (gate, up, down), lm_head."""

    def __init__(self, config, tensors, dtype=torch.float64):
        super().__init__()
        self.c = config
        self.t = {k: torch.as_tensor(np.asarray(v)).to(dtype) for k, v in tensors.items()}
        self.dtype = dtype

    def norm(self, x, name):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.c["rms_norm_eps"]) * self.t[name]

    def rope(self, x):  # x (B, T, H, D)
        _, t, _, d = x.shape
        inv = self.c["rope_theta"] ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
        ang = torch.arange(t, dtype=torch.float64)[:, None] * inv[None, :]
        ang = torch.cat((ang, ang), dim=-1)
        cos, sin = torch.cos(ang).to(x.dtype)[None, :, None, :], torch.sin(ang).to(x.dtype)[None, :, None, :]
        rot = torch.cat((-x[..., d // 2:], x[..., : d // 2]), dim=-1)
        return x * cos + rot * sin

    def forward(self, tokens):
        c, t = self.c, self.t
        tokens = torch.as_tensor(np.asarray(tokens), dtype=torch.long)
        b, n = tokens.shape
        h, kv = c["num_attention_heads"], c["num_key_value_heads"]
        d = c["hidden_size"] // h
        x = t["model.embed_tokens.weight"][tokens]
        mask = torch.ones(n, n, dtype=torch.bool).triu(1)
        for i in range(c["num_hidden_layers"]):
            p = f"model.layers.{i}."
            a = self.norm(x, p + "input_layernorm.weight")
            q = self.rope((a @ t[p + "self_attn.q_proj.weight"].T).view(b, n, h, d))
            k = self.rope((a @ t[p + "self_attn.k_proj.weight"].T).view(b, n, kv, d))
            v = (a @ t[p + "self_attn.v_proj.weight"].T).view(b, n, kv, d)
            k, v = k.repeat_interleave(h // kv, dim=2), v.repeat_interleave(h // kv, dim=2)
            q, k, v = (z.transpose(1, 2) for z in (q, k, v))
            s = (q @ k.transpose(-1, -2) / math.sqrt(d)).masked_fill(mask, float("-inf"))
            o = (torch.softmax(s, dim=-1) @ v).transpose(1, 2).reshape(b, n, h * d)
            x = x + o @ t[p + "self_attn.o_proj.weight"].T
            m = self.norm(x, p + "post_attention_layernorm.weight")
            g = F.silu(m @ t[p + "mlp.gate_proj.weight"].T) * (m @ t[p + "mlp.up_proj.weight"].T)
            x = x + g @ t[p + "mlp.down_proj.weight"].T
        x = self.norm(x, "model.norm.weight")
        head = t["model.embed_tokens.weight"] if c.get("tie_word_embeddings") else t["lm_head.weight"]
        return x @ head.T


def read_hf(d):
    with open(os.path.join(d, "config.json")) as f:
        config = json.load(f)
    tensors, meta = llama_ref.load_safetensors(os.path.join(d, "model.safetensors"))
    return config, tensors, meta


def compare(tag, c_logits, ref):
    ref = torch.as_tensor(ref, dtype=torch.float64)
    diff = (torch.as_tensor(c_logits, dtype=torch.float64) - ref).abs().max().item()
    scale = max(1.0, ref.abs().max().item())
    print(f"[{tag}] logits max|C - torch64| {diff:.3e}, relative to max|logit| {scale:.2f}: {diff / scale:.3e} "
          f"(tol {TOL:g})")
    assert diff <= TOL * scale, f"{tag}: logits differ by {diff:.3e} > {TOL * scale:.3e}"


def ref_cfg(cfg):
    return {k: cfg[k] for k in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "hidden_dim")}


CONFIGS = {
    "gqa_untied": dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab=97, hidden_dim=96, seq_len=32, t=16),
    "mqa_tied": dict(dim=48, n_layers=2, n_heads=6, n_kv_heads=1, vocab=61, hidden_dim=64, seq_len=24, t=24, tied=1),
    "mha": dict(dim=32, n_layers=1, n_heads=2, n_kv_heads=2, vocab=50, hidden_dim=40, seq_len=20, t=20, b=1),
}


# --------------------------------------------------------------------- our exports in PyTorch

@pytest.mark.parametrize("name", list(CONFIGS))
def test_llama2c_export_matches_pytorch(tmp_path, name):
    keys = [f"{k}={v}" for k, v in CONFIGS[name].items()]
    out, dump = tmp_path / "m.bin", tmp_path / "dump.safetensors"
    tool("export", "llama2c", out, dump, *keys)
    ours, _ = llama_ref.load_safetensors(str(dump))
    cfg, w, (cos, sin) = read_llama2c(str(out))
    assert cfg["shared"] == bool(CONFIGS[name].get("tied")), "llama2c: shared classifier exactly when tied"
    for k, a in w.items():
        assert np.array_equal(a, ours[k]), f"{k} differs between our model and the llama2.c file"
    ang = np.arange(cfg["seq_len"])[:, None] * 10000.0 ** (-2.0 * np.arange(cos.shape[1]) / (2 * cos.shape[1]))
    rope_diff = max(np.abs(cos - np.cos(ang)).max(), np.abs(sin - np.sin(ang)).max())
    print(f"[{name}] llama2c RoPE tables max|diff| {rope_diff:.3e} (tol 1e-6)")
    assert rope_diff <= 1e-6
    ref = llama_ref.Llama(ref_cfg(cfg), dtype=torch.float64)
    ref.load_weights(w)
    with torch.no_grad():
        compare(f"{name} llama2c", ours["logits"], ref(ours["tokens"]))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_hf_export_matches_pytorch(tmp_path, name):
    keys = [f"{k}={v}" for k, v in CONFIGS[name].items()]
    out, dump = tmp_path / "hf", tmp_path / "dump.safetensors"
    tool("export", "hf", out, dump, *keys)
    ours, _ = llama_ref.load_safetensors(str(dump))
    config, tensors, meta = read_hf(str(out))
    p = CONFIGS[name]
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    assert (config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"],
            config["num_attention_heads"], config["num_key_value_heads"], config["vocab_size"],
            config["max_position_embeddings"]) == (p["dim"], p["hidden_dim"], p["n_layers"], p["n_heads"],
                                                   p["n_kv_heads"], p["vocab"], p["seq_len"])
    assert config["tie_word_embeddings"] is False and config["torch_dtype"] == "float32"
    assert config["rms_norm_eps"] == 1e-5 and config["rope_theta"] == 10000.0
    assert meta.get("format") == "pt"
    # not permuted: everything but q/k is our tensor under its HF name
    assert np.array_equal(tensors["model.layers.0.mlp.gate_proj.weight"], ours["layers.0.feed_forward.w1.weight"])
    assert np.array_equal(tensors["model.layers.0.mlp.up_proj.weight"], ours["layers.0.feed_forward.w3.weight"])
    assert np.array_equal(tensors["model.layers.0.mlp.down_proj.weight"], ours["layers.0.feed_forward.w2.weight"])
    assert np.array_equal(tensors["lm_head.weight"], ours["output.weight"])
    assert not np.array_equal(tensors["model.layers.0.self_attn.q_proj.weight"], ours["layers.0.attention.wq.weight"])
    model = HFLlama(config, tensors)
    with torch.no_grad():
        compare(f"{name} hf", ours["logits"], model(ours["tokens"]))
        # the same weights without the permutation give other logits: the permutation matters
        unpermuted = dict(tensors)
        for layer in range(p["n_layers"]):
            unpermuted[f"model.layers.{layer}.self_attn.q_proj.weight"] = ours[f"layers.{layer}.attention.wq.weight"]
            unpermuted[f"model.layers.{layer}.self_attn.k_proj.weight"] = ours[f"layers.{layer}.attention.wk.weight"]
        off = (HFLlama(config, unpermuted)(ours["tokens"]) - torch.as_tensor(ours["logits"])).abs().max().item()
    print(f"[{name}] without the wq/wk permutation the logits would differ by {off:.3e}")
    assert off > 100 * TOL


def test_round_trips_through_files(tmp_path):
    """ours -> llama2c -> ours -> llama2c and ours -> hf -> ours -> hf: the files are byte-identical."""
    keys = [f"{k}={v}" for k, v in CONFIGS["gqa_untied"].items()]
    tool("export", "llama2c", tmp_path / "a.bin", tmp_path / "d1.safetensors", *keys)
    tool("convert", tmp_path / "a.bin", "llama2c", tmp_path / "b.bin")
    assert (tmp_path / "a.bin").read_bytes() == (tmp_path / "b.bin").read_bytes()
    tool("export", "hf", tmp_path / "a_hf", tmp_path / "d2.safetensors", *keys)
    tool("convert", tmp_path / "a_hf", "hf", tmp_path / "b_hf")
    for f in ("model.safetensors", "config.json"):
        assert (tmp_path / "a_hf" / f).read_bytes() == (tmp_path / "b_hf" / f).read_bytes(), f
    # across formats: llama2c -> hf -> llama2c
    tool("convert", tmp_path / "a.bin", "hf", tmp_path / "c_hf")
    tool("convert", tmp_path / "c_hf", "llama2c", tmp_path / "c.bin")
    assert (tmp_path / "a.bin").read_bytes() == (tmp_path / "c.bin").read_bytes()


# --------------------------------------------------------------------- bad inputs

def test_bad_inputs_one_line_errors(tmp_path):
    keys = [f"{k}={v}" for k, v in CONFIGS["mha"].items()]
    tool("export", "llama2c", tmp_path / "m.bin", tmp_path / "d.safetensors", *keys)
    raw = (tmp_path / "m.bin").read_bytes()
    cases = {"truncated.bin": (raw[:-100], "(truncated?)"),
             "header.bin": (raw[:20], "shorter than the llama2.c header"),
             "v1.bin": (struct.pack("<2i", 0x616B3432, 2) + raw[8:], "version 2 file"),
             "heads.bin": (struct.pack("<4i", 32, 40, 1, 3) + raw[16:], "dim 32 is not a multiple of n_heads 3")}
    for fname, (data, want) in cases.items():
        (tmp_path / fname).write_bytes(data)
    tool("export", "hf", tmp_path / "hf", tmp_path / "d2.safetensors", *keys)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    del config["num_attention_heads"]
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    cases["hf"] = (None, "config.json: no \"num_attention_heads\" (an integer)")
    for fname, (_, want) in cases.items():
        p = tool("logits", tmp_path / fname, tmp_path / "x.safetensors", check=False)
        err = p.stderr.strip()
        print(f"{fname}: rc {p.returncode}: {err}")
        assert p.returncode == 1
        assert err.startswith("interop error: ") and "\n" not in err and str(tmp_path / fname) in err
        assert want in err


# --------------------------------------------------------------------- stories260K.bin

def need_stories():
    if not os.path.exists(STORIES):
        pytest.skip(f"{STORIES} not found (llama2.c's stories260K.bin; set MESHRUN_DATA to its directory)")


def test_stories260k_import(tmp_path):
    need_stories()
    dump = tmp_path / "gen.safetensors"
    p = tool("logits", STORIES, dump, "gen=100")
    print(p.stdout.splitlines()[0])
    loss = float([ln for ln in p.stdout.splitlines() if ln.startswith("loss ")][0].split()[1])
    pr = tool("logits", STORIES, tmp_path / "rand.safetensors", "gen=100", "random=1")
    rloss = float([ln for ln in pr.stdout.splitlines() if ln.startswith("loss ")][0].split()[1])
    print(f"stories260K: mean loss on its own greedy 100 tokens from BOS {loss:.4f} nats (want < 1.0); "
          f"a random model of its dims {rloss:.4f} (log 512 = {math.log(512):.4f}; want > 4.5)")
    assert loss < 1.0
    assert rloss > 4.5

    ours, _ = llama_ref.load_safetensors(str(dump))
    cfg, w, _ = read_llama2c(STORIES)
    assert (cfg["dim"], cfg["hidden_dim"], cfg["n_layers"], cfg["n_heads"], cfg["n_kv_heads"], cfg["vocab_size"],
            cfg["shared"]) == (64, 172, 5, 8, 4, 512, True)
    for k, a in w.items():
        assert np.array_equal(a, ours[k]), f"{k}: our import differs from the file"
    ref = llama_ref.Llama(ref_cfg(cfg), dtype=torch.float64)
    ref.load_weights(w)
    with torch.no_grad():
        ref_logits = ref(ours["tokens"])
        compare("stories260K vs llama_ref", ours["logits"], ref_logits)
        ref_loss = F.cross_entropy(ref_logits[0, :-1], torch.as_tensor(ours["tokens"][0, 1:], dtype=torch.long))
    # the dump's tokens are the 100 inputs (BOS + 99 generated); the tool's loss also scored the 100th
    greedy = ref_logits[0].argmax(-1).numpy()
    assert np.array_equal(greedy[:-1], ours["tokens"][0, 1:]), "llama_ref's greedy choices differ from ours"
    print(f"stories260K: llama_ref loss on the first 99 targets {ref_loss.item():.4f}")

    # to HF: an HF-convention model gives the same logits; back to llama2.c: the same file
    tool("convert", STORIES, "hf", tmp_path / "hf")
    config, tensors, _ = read_hf(str(tmp_path / "hf"))
    with torch.no_grad():
        compare("stories260K as HF vs llama_ref", HFLlama(config, tensors)(ours["tokens"]), ref_logits)
    tool("convert", tmp_path / "hf", "llama2c", tmp_path / "back.bin")
    cfg2, w2, (cos2, sin2) = read_llama2c(str(tmp_path / "back.bin"))
    _, _, (cos, sin) = read_llama2c(STORIES)
    assert cfg2 == cfg
    for k in w:
        assert np.array_equal(w[k], w2[k]), k
    # the original's tables were computed in float32 (angles up to seq_len radians), ours in double
    rope = max(np.abs(cos - cos2).max(), np.abs(sin - sin2).max())
    print(f"stories260K -> hf -> llama2c: weights bit-identical, RoPE tables max|diff| {rope:.3e} vs the original "
          f"(tol 1e-5)")
    assert rope <= 1e-5
