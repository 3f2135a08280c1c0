"""llama_ref: a plain PyTorch Llama, the reference the C model is checked against.

What it is: the same architecture as trainer/model/model.c (RMSNorm, RoPE on adjacent pairs
(2i, 2i+1) with theta^(-2i/D) as in Meta's checkpoints, causal grouped-query attention,
SwiGLU, untied output), with parameter names identical to ours, so that
``model.state_dict()`` keys are exactly the C tensor names. Plus a safetensors reader/writer
that needs only json + numpy.

What it is not: fast, or a copy of any other implementation. Used by test_oracle_model.py and
by the training-loop oracle tests.

API:
    cfg = {"dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "hidden_dim",
           "norm_eps" (1e-5), "rope_theta" (10000)}
    model = Llama(cfg, dtype=torch.float64)
    model.load_weights({name: tensor or ndarray})      # every parameter, our names
    loss = model(tokens, targets)                       # mean CE, ignore_index=-1
    logits = model(tokens)                              # (B, T, V) without targets
    tensors, metadata = load_safetensors(path)          # {name: np.ndarray}, {str: str}
    save_safetensors(path, {name: np.ndarray}, metadata)
"""
import json
import math
import struct

import numpy as np
import torch
import torch.nn.functional as F

_DTYPES = {"F32": np.float32, "I32": np.int32, "F64": np.float64, "I64": np.int64}
_NAMES = {np.dtype(v): k for k, v in _DTYPES.items()}


def load_safetensors(path):
    """Returns ({name: np.ndarray}, {metadata key: value}); validates offsets against the file."""
    with open(path, "rb") as f:
        data = f.read()
    if len(data) < 8:
        raise ValueError(f"{path}: too short for a safetensors header")
    (hlen,) = struct.unpack("<Q", data[:8])
    if 8 + hlen > len(data):
        raise ValueError(f"{path}: header length {hlen} exceeds the file")
    header = json.loads(data[8 : 8 + hlen].decode("utf-8"))
    base = 8 + hlen
    meta = header.pop("__metadata__", {}) or {}
    out = {}
    for name, e in header.items():
        dt = np.dtype(_DTYPES[e["dtype"]])
        b0, b1 = e["data_offsets"]
        shape = tuple(e["shape"])
        if not (0 <= b0 <= b1 <= len(data) - base) or (b1 - b0) != int(np.prod(shape, dtype=np.int64)) * dt.itemsize:
            raise ValueError(f"{path}: bad data_offsets for {name}")
        out[name] = np.frombuffer(data, dtype=dt, count=(b1 - b0) // dt.itemsize, offset=base + b0).reshape(shape).copy()
    return out, meta


def save_safetensors(path, tensors, metadata=None):
    """Writes {name: np.ndarray} (float32/int32/float64/int64) as safetensors."""
    header, blobs, off = {}, [], 0
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    for name, a in tensors.items():
        a = np.ascontiguousarray(a)
        b = a.tobytes()
        header[name] = {"dtype": _NAMES[a.dtype], "shape": list(a.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    h = json.dumps(header).encode("utf-8")
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)


LAYER_KINDS = ["attention_norm", "attention.wq", "attention.wk", "attention.wv", "attention.wo", "ffn_norm",
               "feed_forward.w1", "feed_forward.w2", "feed_forward.w3"]


def read_llama2c(path):
    """(cfg, {our name: array}, rope (cos, sin)) from a version-0 llama2.c file, read here
    independently of the trainer's importer (test_interop, test_sample)."""
    raw = open(path, "rb").read()
    dim, hidden, n_layers, n_heads, n_kv, vocab, seq_len = struct.unpack("<7i", raw[:28])
    shared, vocab = vocab > 0, abs(vocab)
    d = np.frombuffer(raw, dtype="<f4", offset=28)
    hd = dim // n_heads
    kv_dim = n_kv * hd
    shapes = {"attention_norm": (dim,), "attention.wq": (dim, dim), "attention.wk": (kv_dim, dim),
              "attention.wv": (kv_dim, dim), "attention.wo": (dim, dim), "ffn_norm": (dim,),
              "feed_forward.w1": (hidden, dim), "feed_forward.w2": (dim, hidden), "feed_forward.w3": (hidden, dim)}
    at = 0

    def take(shape):
        nonlocal at
        n = int(np.prod(shape))
        a = d[at:at + n].reshape(shape)
        at += n
        return a

    w = {"tok_embeddings.weight": take((vocab, dim))}
    for k in LAYER_KINDS:
        for layer in range(n_layers):
            w[f"layers.{layer}.{k}.weight"] = take(shapes[k])
    w["norm.weight"] = take((dim,))
    cos, sin = take((seq_len, hd // 2)), take((seq_len, hd // 2))
    w["output.weight"] = w["tok_embeddings.weight"] if shared else take((vocab, dim))
    assert at == d.size, f"{path}: {d.size - at} floats left over"
    cfg = dict(dim=dim, hidden_dim=hidden, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv, vocab_size=vocab,
               seq_len=seq_len, shared=shared)
    return cfg, w, (cos, sin)


def llama_hidden_dim(dim, multiple_of=256, ffn_dim_multiplier=None):
    h = int(2 * (4 * dim) / 3)
    if ffn_dim_multiplier:
        h = int(ffn_dim_multiplier * h)
    return multiple_of * ((h + multiple_of - 1) // multiple_of)


class RMSNorm(torch.nn.Module):
    def __init__(self, dim, eps, dtype):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(dim, dtype=dtype))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope(x, theta):
    """x (B, T, H, D): rotate adjacent pairs (2i, 2i+1) by t * theta^(-2i/D)."""
    _, t, _, d = x.shape
    i = torch.arange(d // 2, dtype=torch.float64)
    freqs = theta ** (-2.0 * i / d)
    ang = torch.arange(t, dtype=torch.float64)[:, None] * freqs[None, :]  # (T, D/2)
    cos = torch.cos(ang).to(x.dtype)[None, :, None, :]
    sin = torch.sin(ang).to(x.dtype)[None, :, None, :]
    x0, x1 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2)


class Attention(torch.nn.Module):
    def __init__(self, cfg, dtype):
        super().__init__()
        c, h, kv = cfg["dim"], cfg["n_heads"], cfg.get("n_kv_heads") or cfg["n_heads"]
        self.h, self.kv, self.d, self.theta = h, kv, c // h, float(cfg.get("rope_theta", 10000.0))
        lin = lambda i, o: torch.nn.Linear(i, o, bias=False, dtype=dtype)
        self.wq, self.wk, self.wv, self.wo = lin(c, h * self.d), lin(c, kv * self.d), lin(c, kv * self.d), lin(h * self.d, c)

    def forward(self, x):
        b, t, _ = x.shape
        q = rope(self.wq(x).view(b, t, self.h, self.d), self.theta)
        k = rope(self.wk(x).view(b, t, self.kv, self.d), self.theta)
        v = self.wv(x).view(b, t, self.kv, self.d)
        g = self.h // self.kv  # query head j uses kv head j // g
        k, v = k.repeat_interleave(g, dim=2), v.repeat_interleave(g, dim=2)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))  # (B, H, T, D)
        s = q @ k.transpose(-1, -2) / math.sqrt(self.d)
        mask = torch.ones(t, t, dtype=torch.bool).triu(1)
        p = torch.softmax(s.masked_fill(mask, float("-inf")), dim=-1)
        return self.wo((p @ v).transpose(1, 2).reshape(b, t, self.h * self.d))


class FeedForward(torch.nn.Module):
    def __init__(self, cfg, dtype):
        super().__init__()
        c, f = cfg["dim"], cfg["hidden_dim"]
        self.w1 = torch.nn.Linear(c, f, bias=False, dtype=dtype)
        self.w2 = torch.nn.Linear(f, c, bias=False, dtype=dtype)
        self.w3 = torch.nn.Linear(c, f, bias=False, dtype=dtype)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(torch.nn.Module):
    def __init__(self, cfg, dtype):
        super().__init__()
        eps = float(cfg.get("norm_eps", 1e-5))
        self.attention_norm = RMSNorm(cfg["dim"], eps, dtype)
        self.attention = Attention(cfg, dtype)
        self.ffn_norm = RMSNorm(cfg["dim"], eps, dtype)
        self.feed_forward = FeedForward(cfg, dtype)

    def forward(self, x):
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(torch.nn.Module):
    def __init__(self, cfg, dtype=torch.float32):
        super().__init__()
        self.cfg = dict(cfg)
        self.tok_embeddings = torch.nn.Embedding(cfg["vocab_size"], cfg["dim"], dtype=dtype)
        self.layers = torch.nn.ModuleList(Block(cfg, dtype) for _ in range(cfg["n_layers"]))
        self.norm = RMSNorm(cfg["dim"], float(cfg.get("norm_eps", 1e-5)), dtype)
        self.output = torch.nn.Linear(cfg["dim"], cfg["vocab_size"], bias=False, dtype=dtype)

    def load_weights(self, tensors):
        """Copies every parameter from {our name: tensor/ndarray}; extra keys are ignored."""
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name not in tensors:
                    raise KeyError(f"llama_ref: weight {name} missing")
                src = torch.as_tensor(np.asarray(tensors[name]))
                if tuple(src.shape) != tuple(p.shape):
                    raise ValueError(f"llama_ref: {name} has shape {tuple(src.shape)}, want {tuple(p.shape)}")
                p.copy_(src.to(p.dtype))

    def forward(self, tokens, targets=None):
        tokens = torch.as_tensor(np.asarray(tokens), dtype=torch.long)
        x = self.tok_embeddings(tokens)
        for blk in self.layers:
            x = blk(x)
        logits = self.output(self.norm(x))
        if targets is None:
            return logits
        targets = torch.as_tensor(np.asarray(targets), dtype=torch.long)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-1)
