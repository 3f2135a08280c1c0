#!/usr/bin/env python3
"""make-corpus: writes the seed corpus fuzz/corpus/<target>/ (small valid inputs, a few near misses).

    fuzz/make-corpus.py [--ckpt-seed DIR] [--trainer-ckpt STEP_DIR] [TARGET...]

Seeds are built here from the formats' definitions (safetensors, llama2.c, llm.c, store frames),
copied from configs/ (plans), or taken from files the real writers made:
  --ckpt-seed DIR      metadata.json + shard-0.safetensors dumped by fuzz_ckpt_meta
                       (MESHRUN_FUZZ_SEED_DIR=DIR build/fuzz/fuzz_ckpt_meta -runs=1)
  --trainer-ckpt DIR   a step directory saved by the trainer, world size 1 (its metadata.json;
                       also the plan it records, as a plan seed)
Checkpoint seeds carry fuzz_ckpt_meta's placeholders (@BYTES@, @CRC@, @METACRC) instead of the
checksums, so that the fuzzer's changes are not all stopped by a checksum mismatch.
Re-running rewrites the seeds of the named targets (default: all that need no argument). The
corpus directories also hold inputs the fuzzer found (files named by their SHA-1, added by
`make fuzz-merge`); this script leaves those alone."""
import argparse
import glob
import json
import os
import re
import shutil
import struct

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORPUS = os.path.join(ROOT, "fuzz", "corpus")


def out(target, name, data):
    d = os.path.join(CORPUS, target)
    os.makedirs(d, exist_ok=True)
    if isinstance(data, str):
        data = data.encode()
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)


def floats(n, start=0.0):
    return struct.pack("<%df" % n, *[start + 0.01 * i for i in range(n)])


def safetensors(tensors, meta=None):
    """tensors: list of (name, dtype, shape, bytes); returns the file's bytes."""
    hdr, off, body = {}, 0, b""
    if meta:
        hdr["__metadata__"] = meta
    for name, dtype, shape, data in tensors:
        hdr[name] = {"dtype": dtype, "shape": shape, "data_offsets": [off, off + len(data)]}
        off += len(data)
        body += data
    h = json.dumps(hdr, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    return struct.pack("<Q", len(h)) + h + body


def seeds_plan():
    for p in sorted(glob.glob(os.path.join(ROOT, "configs", "*.json"))):
        shutil.copy(p, os.path.join(CORPUS, "plan", os.path.basename(p)))
    tiny = open(os.path.join(ROOT, "configs", "tiny.json")).read()
    out("plan", "tiny-sets", tiny + "\0model.dim=128\0mesh.tp=2\0parallel.tp_plan.output=replicate\0train.lr=1e-3")
    out("plan", "empty-sets", "{}\0data.format=synthetic\0model.hidden_dim=96\0checkpoint.resume=auto")
    out("plan", "bad-type", '{"model": {"dim": "wide"}}')


def seeds_safetensors():
    w = floats(6)
    ids = struct.pack("<4i", 0, -1, 96, 2147483647)
    out("safetensors", "valid", safetensors(
        [("w", "F32", [2, 3], w), ("ids", "I32", [4], ids), ("scalar", "F32", [], floats(1))],
        {"format": "pt", "note": "seed"}))
    out("safetensors", "empty-header", safetensors([]))
    out("safetensors", "zero-size", safetensors([("e", "F32", [0, 3], b"")]))
    out("safetensors", "bf16", safetensors([("h", "BF16", [2], b"\0\0\0\0")]))


# llama2.c: a tiny model, its header and float arrays in the file's order.
L2C = dict(dim=8, hidden=16, layers=2, heads=2, kv=1, vocab=16, seq=4)


def llama2c(shared=True, **kw):
    c = dict(L2C, **kw)
    C, F, L, H, KV, V, T = c["dim"], c["hidden"], c["layers"], c["heads"], c["kv"], c["vocab"], c["seq"]
    D = C // H
    n = V * C + L * (C + C * C + 2 * KV * D * C + C * C + C + 3 * F * C) + C + T * D
    if not shared:
        n += V * C
    return struct.pack("<7i", C, F, L, H, KV, V if shared else -V, T) + floats(n)


def hf_dir(tie=False, layers=1):
    C, F, H, KV, V = 8, 16, 2, 1, 16
    D = C // H
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": C,
           "intermediate_size": F, "num_hidden_layers": layers, "num_attention_heads": H,
           "num_key_value_heads": KV, "head_dim": D, "vocab_size": V, "max_position_embeddings": 32,
           "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "rope_scaling": None, "hidden_act": "silu",
           "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": tie, "torch_dtype": "float32"}
    ts = [("model.embed_tokens.weight", [V, C])]
    for i in range(layers):
        p = "model.layers.%d." % i
        ts += [(p + "input_layernorm.weight", [C]), (p + "self_attn.q_proj.weight", [C, C]),
               (p + "self_attn.k_proj.weight", [KV * D, C]), (p + "self_attn.v_proj.weight", [KV * D, C]),
               (p + "self_attn.o_proj.weight", [C, C]), (p + "post_attention_layernorm.weight", [C]),
               (p + "mlp.gate_proj.weight", [F, C]), (p + "mlp.down_proj.weight", [C, F]),
               (p + "mlp.up_proj.weight", [F, C])]
    ts.append(("model.norm.weight", [C]))
    if not tie:
        ts.append(("lm_head.weight", [V, C]))
    st = safetensors([(n, "F32", s, floats(s[0] * (s[1] if len(s) > 1 else 1))) for n, s in ts], {"format": "pt"})
    return json.dumps(cfg, indent=2).encode() + b"\0" + st


def seeds_llama2c():
    out("llama2c", "shared", llama2c(True))
    out("llama2c", "unshared", llama2c(False))
    out("llama2c", "gqa", llama2c(True, heads=4, kv=2, layers=1))
    out("llama2c", "truncated", llama2c(True)[:-12])
    out("llama2c", "version1-magic", struct.pack("<Ii", 0x616B3432, 1) + b"\0" * 248)  # "ak42" as llama2.c writes it
    out("llama2c", "hf", hf_dir(False))
    out("llama2c", "hf-tied", hf_dir(True, 2))
    out("llama2c", "hf-config-only", hf_dir(False).split(b"\0")[0])


def llmc(tokens, magic=20240520, version=1, count=None):
    hdr = [0] * 256
    hdr[0], hdr[1], hdr[2] = magic, version, len(tokens) if count is None else count
    return struct.pack("<256i", *hdr) + struct.pack("<%dH" % len(tokens), *tokens)


def seeds_llmc():
    out("llmc", "valid", llmc([(i * 7919) % 50257 for i in range(120)]))
    out("llmc", "gpt2-eot", llmc([50256] + list(range(1000, 1099))))
    out("llmc", "short-count", llmc(list(range(40)), count=41))
    out("llmc", "too-short", llmc([1, 2, 3])[:600])


# store frames (common/store_proto.h): u32 length, magic 'M', version, op, 0, payload.
OPS = dict(HELLO=1, SET=2, GET=3, GET_NOWAIT=4, ADD=5, CAS=6, WAIT=7, CHECK=8, DELETE=9, MULTI_GET=10,
           MULTI_SET=11, NUM_KEYS=12, AUTH=13)


def frame(op, payload=b"", version=2):
    return struct.pack(">IBBBB", 8 + len(payload), 0x4D, version, OPS[op], 0) + payload


def b(s):
    s = s.encode() if isinstance(s, str) else s
    return struct.pack(">I", len(s)) + s


def i64(v):
    return struct.pack(">q", v)


def keys(*ks):
    return struct.pack(">I", len(ks)) + b"".join(b(k) for k in ks)


def seeds_store():
    # HELLO: banner, run id, 32-byte client nonce; an open store (no secret) is ready after it
    hello = frame("HELLO", b("meshrun-store") + b("job-1") + b(bytes(range(32))))
    out("store", "hello", hello)
    out("store", "hello-empty-run-id", frame("HELLO", b("meshrun-store") + b("") + b(bytes(32))) +
        frame("NUM_KEYS"))
    out("store", "auth-unneeded", hello + frame("AUTH", b(bytes(32))) + frame("NUM_KEYS"))
    out("store", "set-get", hello + frame("SET", b("k") + b("v")) + frame("GET", b("k") + i64(0)))
    out("store", "get-nowait", hello + frame("GET_NOWAIT", b("absent")))
    out("store", "get-timeout", hello + frame("GET", b("later") + i64(5)))
    out("store", "add", hello + frame("ADD", b("n") + i64(5)) + frame("ADD", b("n") + i64(-7)))
    out("store", "cas", hello + frame("CAS", b("c") + b"\x01" + b("") + b("one")) +
        frame("CAS", b("c") + b"\x00" + b("one") + b("two")))
    out("store", "wait", hello + frame("SET", b("a") + b("1")) + frame("WAIT", i64(5) + keys("a", "b")))
    out("store", "check", hello + frame("CHECK", keys("a", "b")))
    out("store", "delete", hello + frame("SET", b("d") + b("x")) + frame("DELETE", b("d")))
    out("store", "multi", hello + frame("MULTI_SET", struct.pack(">I", 2) + b("x") + b("1") + b("y") + b("2")) +
        frame("MULTI_GET", i64(5) + keys("x", "y")) + frame("NUM_KEYS"))
    out("store", "wrong-version", frame("HELLO", b("meshrun-store") + b("job-1") + b(bytes(32)), version=1))
    out("store", "big-preauth", struct.pack(">IBBBB", 8192, 0x4D, 2, 1, 0) + b"\0" * 100)
    out("store", "no-hello", frame("SET", b("k") + b("v")))


def seeds_ckpt(seed_dir, trainer_dir):
    if seed_dir:
        meta = open(os.path.join(seed_dir, "metadata.json")).read()
        shard = open(os.path.join(seed_dir, "shard-0.safetensors"), "rb").read()
        out("ckpt_meta", "writer-verbatim", meta)
        ph = placeholders(meta)
        out("ckpt_meta", "writer", ph)
        out("ckpt_meta", "writer-with-shard", ph.encode() + b"\0" + shard)
        chunks = "param w 4 3 0 4 0 3 0 12\nparam b 3 1 0 3 0 1 0 3\n"
        own = safetensors([("param/w#0", "F32", [12], floats(12)), ("param/b#1", "F32", [3], floats(3))],
                          {"meshrun.format": "meshrun-checkpoint", "meshrun.step": "1", "meshrun.chunks": chunks})
        out("ckpt_meta", "writer-own-shard", ph.encode() + b"\0" + own)
    if trainer_dir:
        # a one-rank run: its files list names only shard-0, which fuzz_ckpt_meta provides
        meta = open(os.path.join(trainer_dir, "metadata.json")).read()
        out("ckpt_meta", "trainer", placeholders(meta))
        # its "plan" is plan_to_json's output: every key, as the trainer resolved it
        plan = json.loads(meta).get("plan")
        if isinstance(plan, dict):
            out("plan", "trainer-resolved", json.dumps(plan, separators=(",", ":")))


def placeholders(meta):
    """The writer's metadata.json with its checksums replaced by fuzz_ckpt_meta's placeholders."""
    meta = re.sub(r'^\{"metadata_crc32c": "0x[0-9a-f]{8}"', '{"metadata_crc32c": "0x@METACRC"', meta)
    meta = re.sub(r'("bytes":\s*)\d+', r"\1@BYTES@", meta)
    return re.sub(r'("crc32c":\s*)"0x[0-9a-f]{8}"', r'\1"@CRC@"', meta)


def l2c_tokenizer(pieces, byte_tokens=True, max_len=16):
    """llama2.c's tokenizer.bin: <unk> <s> </s>, the byte tokens, then (piece, score) pairs."""
    head = [("<unk>", 0.0), ("\n<s>\n", 0.0), ("\n</s>\n", 0.0)]
    body = [("<0x%02X>" % b, 0.0) for b in range(256)] if byte_tokens else []
    data = struct.pack("<i", max_len)
    for s, score in head + body + pieces:
        e = s.encode("utf-8")
        data += struct.pack("<fi", score, len(e)) + e
    return data


def seeds_tokenizer():
    """Byte-level (GPT-2 style) and sentencepiece-style tokenizer.json files, each with a text
    after a NUL; llama2.c tokenizer.bin files with and without byte tokens."""
    g = "\u0120"
    byte_level = {"added_tokens": [{"id": 8, "content": "<|endoftext|>", "special": True}],
                  "normalizer": None,
                  "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "use_regex": True},
                  "decoder": {"type": "ByteLevel"},
                  "model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "c": 2, g: 3, "ab": 4, g + "ab": 5, "'": 6,
                                                     "s": 7},
                            "merges": ["a b", g + " ab"]}}
    meta = "\u2581"
    spm = {"added_tokens": [{"id": 0, "content": "<unk>", "special": True, "normalized": False},
                            {"id": 1, "content": "<s>", "special": True, "normalized": False}],
           "normalizer": {"type": "Sequence", "normalizers": [
               {"type": "Prepend", "prepend": meta},
               {"type": "Replace", "pattern": {"String": " "}, "content": meta}]},
           "pre_tokenizer": None,
           "decoder": {"type": "Sequence", "decoders": [
               {"type": "Replace", "pattern": {"String": meta}, "content": " "}, {"type": "ByteFallback"},
               {"type": "Fuse"}, {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
           "model": {"type": "BPE", "unk_token": "<unk>", "fuse_unk": True, "byte_fallback": True,
                     "vocab": {"<unk>": 0, "<s>": 1, "<0x21>": 2, meta: 3, "a": 4, "b": 5, meta + "a": 6, "ab": 7},
                     "merges": [["a", "b"], [meta, "a"]]}}
    metaspace = dict(spm, normalizer=None,
                     pre_tokenizer={"type": "Metaspace", "replacement": meta, "prepend_scheme": "first",
                                    "split": True},
                     decoder={"type": "Metaspace", "replacement": meta, "prepend_scheme": "first"})
    for name, j in (("byte_level", byte_level), ("spm", spm), ("metaspace", metaspace)):
        out("tokenizer", name + ".json", json.dumps(j, ensure_ascii=False).encode() + b"\0ab ab's <s>a!\xc3\xa9")
    pieces = [(" ", -1.0), ("a", -1.0), ("b", -1.0), ("ab", -2.0), (" ab", -3.0), ("\u00e9", -1.0)]
    out("tokenizer", "llama2c.bin", l2c_tokenizer(pieces))
    out("tokenizer", "llama2c_nobytes.bin", l2c_tokenizer(pieces, byte_tokens=False))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ckpt-seed")
    ap.add_argument("--trainer-ckpt")
    ap.add_argument("targets", nargs="*")
    a = ap.parse_args()
    gens = dict(plan=seeds_plan, safetensors=seeds_safetensors, llama2c=seeds_llama2c, llmc=seeds_llmc,
                store=seeds_store, tokenizer=seeds_tokenizer)
    os.makedirs(os.path.join(CORPUS, "plan"), exist_ok=True)
    for t in a.targets or list(gens):
        if t in gens:
            gens[t]()
    if a.ckpt_seed or a.trainer_ckpt:
        seeds_ckpt(a.ckpt_seed, a.trainer_ckpt)


if __name__ == "__main__":
    main()
