"""test_sample: `trainer sample` and `trainer export` on any weights, as a user runs them.

- stories260K.bin (llama2.c, ../shared/data or MESHRUN_DATA) samples with no plan: the shape comes
  from its header; greedy (temperature 0) from BOS gives, over 120 tokens, exactly the ids that a
  float64 PyTorch Llama (llama_ref) picks by full forwards -- the trainer decodes with its KV cache,
  so this checks the cache against an independent full forward (tolerance: identical ids); the
  output repeats run to run and does not depend on the seed at temperature 0, while temperature 1
  repeats under a seed and changes with it; top_k=1 gives the greedy ids. The same from its HF
  export, and with a plan of the right shape; a 64-token context slides (the first 63 tokens are
  those of the 512-token context).
- export llama2c -> hf -> llama2c: the weights come back bit-identical, the RoPE tables within
  1e-5 (the original's were computed in float32, ours in double; max|diff| printed); ours -> hf ->
  llama2c -> hf gives the same model.safetensors bytes.
- A tokenizer (a byte-level BPE tokenizer.json written here: the 256 byte symbols, four merges and
  <|endoftext|>): a model trained with data.tokenizer samples text with no plan (the tokenizer from
  its file's metadata), the text equal to the ids of the same draw without a tokenizer, decoded here
  (BOS first, stopping at EOS); `export --format hf` writes tokenizer.json (the same but for a
  post-processor that puts BOS first), a tokenizer_config.json naming BOS, EOS and the model's
  inputs, and their id in config.json and generation_config.json
  (config.json says null where no tokenizer is known); the HF folder then samples the same text;
  exported again without a tokenizer, the folder's old tokenizer files are removed (a warning each).
  Where transformers is installed its AutoTokenizer and LlamaForCausalLM load the folder too
  (test_hf_transformers checks such folders in transformers in full).
- Checkpoint step folders: the shared tiny Llama trained 4 steps on 2 ranks under meshrun (fsdp2
  and tp2), checkpoints every 2 steps. `sample --weights ck/step-4` at temperature 0 prints exactly
  what final.safetensors of the same run prints (the same weights), as does `--weights ck` (its
  newest intact checkpoint, named in one log line) and the training plan given; `export` of the step
  folder and of the directory gives HF tensors byte-identical to final.safetensors' export (and the
  same config.json and llama2.c file), step-2's differs. Errors, exit 2 and one line: a folder of
  neither kind (what was expected), a shard with a flipped bit (the loader's checksum message;
  `--weights ck` falls back to step-2), no intact checkpoint left, a plan or --set of another shape;
  a step folder as model.init (checkpoint.resume's, named).
- Values that are not numbers: one NaN or infinity in tok_embeddings.weight of our file, a llama2.c
  file and an HF folder is refused by sample, export (nothing written) and model.init (one process
  and fsdp2), exit 2 and one line naming the file, the tensor and the element.
- Bad inputs: a missing file, a file of no known format, a truncated safetensors, an HF folder
  without weights, a plan of another shape, --set model.* against the file, a tokenizer larger than
  the vocabulary, a missing tokenizer, an unknown export format, an unwritable output: each a
  one-line message naming the cause and exit 1 or 2, never a crash.
"""
import json
import os
import shutil
import struct
import subprocess
import sys

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
import llama_ref  # noqa: E402
from conftest import FAST_CONF, Meshrun  # noqa: E402
from conftest import tiny_plan as shared_tiny_plan  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
BIN = os.environ.get("MESHRUN_BIN", os.path.join(REPO, "bin"))
TRAINER = os.path.join(BIN, "trainer")
DATA = os.environ.get("MESHRUN_DATA", os.path.join(REPO, "..", "shared", "data"))
STORIES = os.path.join(DATA, "stories260K.bin")
ROPE_TOL = 1e-5


def run(args, cwd, timeout=120, binary=False):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(k, None)
    if binary:
        return subprocess.run([TRAINER] + [str(a) for a in args], cwd=str(cwd), env=env, capture_output=True,
                              timeout=timeout)
    return subprocess.run([TRAINER] + [str(a) for a in args], cwd=str(cwd), env=env, capture_output=True, text=True,
                          errors="replace", timeout=timeout)


def last_line(r):
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert lines, "no message on stderr"
    return lines[-1]


def need_stories():
    if not os.path.exists(STORIES):
        pytest.skip(f"{STORIES} not found (llama2.c's stories260K.bin; set MESHRUN_DATA to its directory)")


def sample_ids(r):
    """(prompt ids, generated ids) of an id sample "p1 p2 | g1 g2 ...\\n"."""
    assert r.returncode == 0, r.stderr
    head, _, tail = r.stdout.partition("|")
    return [int(w) for w in head.split()], [int(w) for w in tail.split()]


GREEDY = ["--set", "sample.temperature=0", "--set", 'sample.prompt="1"', "--set", "sample.tokens=120"]


def read_llama2c(path):
    """(header ints, weights floats, rope floats, classifier floats) of a version-0 file."""
    raw = open(path, "rb").read()
    h = struct.unpack("<7i", raw[:28])
    dim, hidden, n_layers, n_heads, n_kv, vocab, seq_len = h
    hd, kv = dim // n_heads, n_kv * (dim // n_heads)
    n = abs(vocab) * dim + n_layers * (2 * dim + dim * dim + 2 * kv * dim + dim * dim + 3 * hidden * dim) + dim
    f = np.frombuffer(raw, dtype="<f4", offset=28)
    rope = seq_len * hd
    return h, f[:n], f[n:n + rope], f[n + rope:]


def stories_weights():
    cfg, w, _ = llama_ref.read_llama2c(STORIES)
    return {k: cfg[k] for k in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "hidden_dim")}, w


# --------------------------------------------------------------------- stories260K, no plan

def test_stories260k_greedy_matches_full_forward(tmp_path):
    need_stories()
    r = run(["sample", "--weights", STORIES] + GREEDY, tmp_path)
    prompt, ids = sample_ids(r)
    assert prompt == [1] and len(ids) == 120 and all(0 <= i < 512 for i in ids)
    # an independent full forward each step, float64
    cfg, w = stories_weights()
    ref = llama_ref.Llama(cfg, dtype=torch.float64)
    ref.load_weights(w)
    seq = [1]
    with torch.no_grad():
        for _ in range(120):
            seq.append(int(ref(np.array([seq]))[0, -1].argmax()))
    first = next((k for k, (a, b) in enumerate(zip(ids, seq[1:])) if a != b), None)
    print(f"stories260K greedy from BOS, 120 tokens: trainer (KV cache) vs llama_ref full forwards (float64): "
          f"{'identical' if first is None else 'first difference at token %d' % first} (tolerance: identical)")
    print("ids:", " ".join(map(str, ids)))
    assert ids == seq[1:]
    # deterministic; the seed does not matter at temperature 0, top_k=1 is greedy
    assert run(["sample", "--weights", STORIES] + GREEDY, tmp_path).stdout == r.stdout
    assert run(["sample", "--weights", STORIES, "--set", "seed=99"] + GREEDY, tmp_path).stdout == r.stdout
    k1 = run(["sample", "--weights", STORIES] + GREEDY + ["--set", "sample.temperature=1", "--set", "sample.top_k=1"],
             tmp_path)
    assert k1.stdout == r.stdout
    hot = GREEDY + ["--set", "sample.temperature=1"]
    a = run(["sample", "--weights", STORIES, "--set", "seed=5"] + hot, tmp_path)
    b = run(["sample", "--weights", STORIES, "--set", "seed=5"] + hot, tmp_path)
    c = run(["sample", "--weights", STORIES, "--set", "seed=6"] + hot, tmp_path)
    assert a.stdout == b.stdout and a.stdout != c.stdout and a.stdout != r.stdout


def test_stories260k_hf_plan_and_window(tmp_path):
    need_stories()
    base = run(["sample", "--weights", STORIES] + GREEDY, tmp_path)
    assert base.returncode == 0, base.stderr
    # its HF export samples the same (no plan: the shape from config.json)
    e = run(["export", "--format", "hf", "--weights", STORIES, "--out", tmp_path / "hf"], tmp_path)
    assert e.returncode == 0, e.stderr
    assert run(["sample", "--weights", tmp_path / "hf"] + GREEDY, tmp_path).stdout == base.stdout
    assert run(["sample", "--weights", tmp_path / "hf" / "config.json"] + GREEDY, tmp_path).stdout == base.stdout
    # a plan of the right shape gives the same (its data synthetic: ids)
    plan = {"model": {"dim": 64, "n_layers": 5, "n_heads": 8, "n_kv_heads": 4, "vocab_size": 512,
                      "hidden_dim": 172, "max_seq_len": 512},
            "train": {"seq_len": 64}, "data": {"format": "synthetic", "train": ""}}
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    assert run(["sample", tmp_path / "plan.json", "--weights", STORIES] + GREEDY, tmp_path).stdout == base.stdout
    # a 64-token context: the first 63 new tokens as with 512, then the window slides on (the
    # embedded plan's train.seq_len 128 must fit in it too)
    w = run(["sample", "--weights", STORIES, "--set", "model.max_seq_len=64", "--set", "train.seq_len=64"] + GREEDY,
            tmp_path)
    _, ids = sample_ids(w)
    _, ids512 = sample_ids(base)
    same = sum(a == b for a, b in zip(ids, ids512))
    print(f"context 64 vs 512: first 63 tokens equal: {ids[:63] == ids512[:63]}; {same} of 120 equal overall")
    assert len(ids) == 120 and ids[:63] == ids512[:63]


# --------------------------------------------------------------------- export round trips

def train_ours(tmp_path):
    """Trains a tiny untied model (dim 32, vocab 300, synthetic data) for 2 steps as planned in
    tmp_path/p.json; returns its final weights, tmp_path/ck/final.safetensors."""
    plan = {"device": "cpu", "seed": 3,
            "model": {"dim": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 300, "max_seq_len": 32,
                      "multiple_of": 16},
            "train": {"steps": 2, "seq_len": 16, "micro_batch_size": 2, "lr": 1e-2},
            "data": {"format": "synthetic", "train": ""}, "eval": {"interval": 0},
            "checkpoint": {"dir": str(tmp_path / "ck")}, "sample": {"tokens": 0}}
    (tmp_path / "p.json").write_text(json.dumps(plan))
    t = run([tmp_path / "p.json"], tmp_path)
    assert t.returncode == 0, t.stderr
    return tmp_path / "ck" / "final.safetensors"


def test_export_round_trips(tmp_path):
    need_stories()
    hf, back = tmp_path / "hf", tmp_path / "back.bin"
    r = run(["export", "--format", "hf", "--weights", STORIES, "--out", hf], tmp_path)
    assert r.returncode == 0, r.stderr
    assert sorted(os.listdir(hf)) == ["config.json", "model.safetensors"]  # no tokenizer known
    cfg = json.loads((hf / "config.json").read_text())
    assert cfg["bos_token_id"] is None and cfg["eos_token_id"] is None  # not LlamaConfig's 1 and 2
    r = run(["export", "--format", "llama2c", "--weights", hf, "--out", back], tmp_path)
    assert r.returncode == 0, r.stderr
    h0, w0, rope0, cls0 = read_llama2c(STORIES)
    h1, w1, rope1, cls1 = read_llama2c(back)
    diff = float(np.abs(rope0 - rope1).max())
    print(f"stories260K -> hf -> llama2c: header {h1 == h0}, weights bit-identical {np.array_equal(w0, w1)}, "
          f"RoPE tables max|diff| {diff:.3e} (tolerance {ROPE_TOL})")
    assert h1 == h0 and np.array_equal(w0, w1) and cls0.size == 0 and cls1.size == 0
    assert diff <= ROPE_TOL
    # ours (a short training run's weights, untied) -> hf -> llama2c -> hf: the same HF files
    ours = train_ours(tmp_path)
    for args in (["hf", ours, tmp_path / "a"], ["llama2c", tmp_path / "a", tmp_path / "a.bin"],
                 ["hf", tmp_path / "a.bin", tmp_path / "b"]):
        r = run(["export", "--format", args[0], "--weights", args[1], "--out", args[2]], tmp_path)
        assert r.returncode == 0, r.stderr
    for name in ("config.json", "model.safetensors"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    # and the three sample alike (ids: synthetic data in our file's plan, and a vocabulary above 256)
    outs = [run(["sample", "--weights", w, "--set", "sample.tokens=20", "--set", "sample.temperature=0.9"],
                tmp_path) for w in (ours, tmp_path / "a", tmp_path / "a.bin")]
    assert all(o.returncode == 0 for o in outs), [o.stderr for o in outs]
    assert outs[0].stdout == outs[1].stdout == outs[2].stdout and "|" in outs[0].stdout


# --------------------------------------------------------------------- a tokenizer

def byte_symbols():
    """GPT-2's byte -> printable character table (byte-level BPE)."""
    bs = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


MERGES = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("e", "r")]
EOT = 260


def write_tokenizer(path):
    sym = byte_symbols()
    vocab = {sym[b]: b for b in range(256)}
    for i, (a, b) in enumerate(MERGES):
        vocab[a + b] = 256 + i
    vocab["<|endoftext|>"] = EOT
    tok = {"version": "1.0", "truncation": None, "padding": None,
           "added_tokens": [{"id": EOT, "content": "<|endoftext|>", "single_word": False, "lstrip": False,
                             "rstrip": False, "normalized": False, "special": True}],
           "normalizer": None,
           "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
           "post_processor": None,
           "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
           "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                     "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                     "vocab": vocab, "merges": [f"{a} {b}" for a, b in MERGES]}}
    path.write_text(json.dumps(tok, ensure_ascii=False, indent=1))


def decode(ids):
    """The bytes of ids under write_tokenizer's vocabulary, stopping at EOS (ids past it print nothing)."""
    inv = {v: k for k, v in byte_symbols().items()}
    out = b""
    for i in ids:
        if i == EOT:
            break
        if i < 256:
            out += bytes([i])
        elif i < 260:
            a, b = MERGES[i - 256]
            out += bytes(inv[ch] for ch in a + b)
    return out


def tiny_plan(tmp_path, tokenizer, vocab=264):
    plan = {"device": "cpu", "seed": 3,
            "model": {"dim": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "vocab_size": vocab,
                      "max_seq_len": 32, "multiple_of": 16},
            "train": {"steps": 2, "seq_len": 16, "micro_batch_size": 2, "lr": 1e-2},
            "data": {"format": "synthetic", "train": "", "tokenizer": str(tokenizer)}, "eval": {"interval": 0},
            "checkpoint": {"dir": str(tmp_path / "ck")}, "sample": {"tokens": 0}}
    path = tmp_path / "tok_plan.json"
    path.write_text(json.dumps(plan))
    return path


def test_tokenizer_sample_and_export(tmp_path):
    tok = tmp_path / "tokenizer.json"
    write_tokenizer(tok)
    plan = tiny_plan(tmp_path, tok)
    t = run([plan], tmp_path)
    assert t.returncode == 0, t.stderr
    ours = tmp_path / "ck" / "final.safetensors"
    # The same draw twice: without the tokenizer, from the prompt's ids (BOS, "t", "he") by hand,
    # then with it, from the text. A near-uniform draw (temperature 100) of 300 tokens; the first
    # seed whose ids hold a merged token and, after it, EOS is used, so that decoding merges and
    # stopping at EOS are both exercised.
    for seed in range(11, 61):
        hot = ["--set", "sample.temperature=100", "--set", "sample.tokens=300", "--set", f"seed={seed}",
               "--set", 'sample.prompt="the"']
        ids = run(["sample", plan, "--weights", ours, "--set", 'data.tokenizer=""'] + hot +
                  ["--set", f'sample.prompt="{EOT} 116 257"'], tmp_path)
        prompt, gen = sample_ids(ids)
        assert prompt == [EOT, 116, 257]
        merged = [k for k, i in enumerate(gen) if 256 <= i < EOT]
        if EOT in gen and merged and merged[0] < gen.index(EOT):
            break
    else:
        pytest.fail("no seed in 11..60 drew a merged token before EOS")
    text = run(["sample", "--weights", ours] + hot, tmp_path, binary=True)  # no plan: its metadata's tokenizer
    assert text.returncode == 0, text.stderr
    want = b"the" + decode(gen) + b"\n"
    print(f"seed {seed}: ids {gen[:gen.index(EOT) + 1]} (EOS at {gen.index(EOT)}, merged tokens at {merged}); "
          f"text {text.stdout!r}")
    assert text.stdout == want
    # export to HF: the tokenizer goes along, and the folder samples the same text
    hf = tmp_path / "hf"
    e = run(["export", "--format", "hf", "--weights", ours, "--out", hf], tmp_path)
    assert e.returncode == 0, e.stderr
    assert sorted(os.listdir(hf)) == ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                                      "tokenizer_config.json"]
    src, out = json.loads(tok.read_text()), json.loads((hf / "tokenizer.json").read_text())
    pp = out.pop("post_processor")
    print("tokenizer.json's post_processor:", src.pop("post_processor"), "->", pp)
    assert out == src
    assert pp["single"][0] == {"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}}
    assert pp["special_tokens"]["<|endoftext|>"]["ids"] == [EOT]
    tc = json.loads((hf / "tokenizer_config.json").read_text())
    print("tokenizer_config.json:", tc)
    assert tc["bos_token"] == "<|endoftext|>" and tc["eos_token"] == "<|endoftext|>"
    assert tc["model_input_names"] == ["input_ids", "attention_mask"]
    assert tc["tokenizer_class"] == "PreTrainedTokenizerFast" and tc["model_max_length"] == 32
    cfg = json.loads((hf / "config.json").read_text())
    gen = json.loads((hf / "generation_config.json").read_text())
    print("config.json token ids:", cfg["bos_token_id"], cfg["eos_token_id"], "generation_config.json:", gen)
    assert cfg["vocab_size"] == 264 and cfg["model_type"] == "llama"
    assert cfg["bos_token_id"] == cfg["eos_token_id"] == gen["bos_token_id"] == gen["eos_token_id"] == EOT
    assert run(["sample", "--weights", hf] + hot, tmp_path, binary=True).stdout == text.stdout
    # to llama2.c no tokenizer is written; with data.tokenizer it samples the same text again
    b = run(["export", "--format", "llama2c", "--weights", hf, "--out", tmp_path / "m.bin"], tmp_path)
    assert b.returncode == 0, b.stderr
    again = run(["sample", "--weights", tmp_path / "m.bin", "--set", f"data.tokenizer={tok}"] + hot, tmp_path,
                binary=True)
    assert again.stdout == text.stdout
    # re-exported without a tokenizer (the llama2.c file has none), a folder loses the old one
    stale = tmp_path / "stale"
    shutil.copytree(hf, stale)
    r = run(["export", "--format", "hf", "--weights", tmp_path / "m.bin", "--out", stale], tmp_path)
    assert r.returncode == 0, r.stderr
    print(r.stderr.strip())
    assert sorted(os.listdir(stale)) == ["config.json", "model.safetensors"]  # generation_config.json too
    assert r.stderr.count("left by an earlier export") == 2
    try:
        import transformers  # noqa: F401
    except ImportError:
        print("transformers is not installed: the HF folder's files were checked by content only")
        return
    from transformers import AutoTokenizer, LlamaForCausalLM
    at = AutoTokenizer.from_pretrained(str(hf))
    assert at.encode("the", add_special_tokens=False) == [116, 257]
    model = LlamaForCausalLM.from_pretrained(str(hf))
    assert model.config.vocab_size == 264


# --------------------------------------------------------------------- bad inputs

def bad(r, code, *needles):
    line = last_line(r)
    print(f"exit {r.returncode}: {line}")
    assert r.returncode == code, r.stderr
    assert "Traceback" not in r.stderr and "Segmentation" not in r.stderr
    for n in needles:
        assert n in line, line


def test_bad_inputs(tmp_path):
    need_stories()
    bad(run(["sample", "--weights", tmp_path / "nope.bin"], tmp_path), 1, "nope.bin", "No such file")
    (tmp_path / "notes.txt").write_text("hello, these are not weights\n" * 10)
    bad(run(["sample", "--weights", tmp_path / "notes.txt"], tmp_path), 2, "notes.txt",
        "is not our safetensors, a Hugging Face folder or a llama2.c")
    bad(run(["export", "--format", "hf", "--weights", tmp_path / "notes.txt", "--out", tmp_path / "x"], tmp_path), 2,
        "notes.txt")
    # a truncated safetensors (our HF export's weights, cut short) and an HF folder without weights
    run(["export", "--format", "hf", "--weights", STORIES, "--out", tmp_path / "hf"], tmp_path)
    raw = (tmp_path / "hf" / "model.safetensors").read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(raw[:len(raw) // 2])
    bad(run(["sample", "--weights", tmp_path / "cut.safetensors"], tmp_path), 2, "cut.safetensors")
    (tmp_path / "empty").mkdir()
    shutil.copy(tmp_path / "hf" / "config.json", tmp_path / "empty" / "config.json")
    bad(run(["sample", "--weights", tmp_path / "empty"], tmp_path), 2, "model.safetensors")
    # shapes: a plan of another shape, --set against the file
    plan = {"model": {"dim": 64, "n_layers": 5, "n_heads": 8, "n_kv_heads": 2, "vocab_size": 512,
                      "hidden_dim": 172, "max_seq_len": 512}, "train": {"seq_len": 64},
            "data": {"format": "synthetic", "train": ""}}
    (tmp_path / "p.json").write_text(json.dumps(plan))
    bad(run(["sample", tmp_path / "p.json", "--weights", STORIES], tmp_path), 2,
        "n_kv_heads 4 but the plan says 2 (set model.n_kv_heads=4)")
    bad(run(["export", "--format", "hf", tmp_path / "p.json", "--weights", STORIES, "--out", tmp_path / "o"],
            tmp_path), 2, "n_kv_heads 4 but the plan says 2")
    assert not (tmp_path / "o").exists()
    bad(run(["sample", "--weights", STORIES, "--set", "model.n_layers=4"], tmp_path), 2,
        "n_layers 5 but the plan says 4")
    # tokenizers: missing, larger than the vocabulary (sample and export)
    bad(run(["sample", "--weights", STORIES, "--set", f"data.tokenizer={tmp_path / 'none.json'}"], tmp_path), 1,
        "none.json")
    tok = tmp_path / "tokenizer.json"
    write_tokenizer(tok)
    plan = tiny_plan(tmp_path, tok, vocab=256)
    bad(run(["sample", "--weights", STORIES, "--set", f"data.tokenizer={tok}", "--set", "model.vocab_size=256"],
            tmp_path), 2, "vocab_size 512 but the plan says 256")
    t = run([plan, "--set", 'data.tokenizer=""'], tmp_path)
    assert t.returncode == 0, t.stderr
    ours = tmp_path / "ck" / "final.safetensors"
    bad(run(["sample", "--weights", ours, "--set", f"data.tokenizer={tok}"], tmp_path), 2,
        "has 261 tokens, more than the model's vocab_size 256")
    bad(run(["export", "--format", "hf", "--weights", ours, "--set", f"data.tokenizer={tok}", "--out",
             tmp_path / "o2"], tmp_path), 2, "has 261 tokens, more than the model's vocab_size 256")
    assert not (tmp_path / "o2").exists()
    # export: an unknown format, an output that cannot be written
    bad(run(["export", "--format", "gguf", "--weights", STORIES, "--out", tmp_path / "g"], tmp_path), 2, "gguf")
    (tmp_path / "file").write_text("x")
    bad(run(["export", "--format", "llama2c", "--weights", STORIES, "--out", tmp_path / "file" / "m.bin"], tmp_path),
        1, "m.bin")


# --------------------------------------------------------------------- checkpoint step folders

CK_STEPS = 4  # the run's last step: its final checkpoint and final.safetensors hold the same weights
CK_LAYOUTS = {"fsdp2": (2, {"dp_shard": 2, "tp": 1}), "tp2": (2, {"dp_shard": 1, "tp": 2})}


@pytest.fixture(scope="module")
def ck_run(tmp_path_factory):
    """ck_run(name) -> the directory of a CK_STEPS-step run of the shared tiny Llama on 2 ranks
    (fsdp2 or tp2) under meshrun, checkpoints every 2 steps, all kept: ck/step-2, ck/step-4 and
    ck/final.safetensors (each run once per module)."""
    runs = {}

    def get(name):
        if name not in runs:
            nproc, mesh = CK_LAYOUTS[name]
            d = tmp_path_factory.mktemp("ck_" + name)
            plan = shared_tiny_plan(mesh=dict({"dp_replicate": 1}, **mesh), eval={"interval": 0})
            plan["train"]["steps"] = CK_STEPS
            plan["checkpoint"] = {"dir": str(d / "ck"), "interval": 2, "keep": 0}
            (d / "plan.json").write_text(json.dumps(plan))
            m = Meshrun([f"--nproc_per_node={nproc}", "--rdzv_conf=" + FAST_CONF, TRAINER, str(d / "plan.json")],
                        env={"OMP_NUM_THREADS": "1"}, cwd=str(d))
            assert m.wait(120) == 0, m.describe()
            assert sorted(os.listdir(d / "ck")) == ["final.safetensors", "latest", "step-2", "step-4"]
            runs[name] = d
        return runs[name]

    return get


CK_GREEDY = ["--set", "sample.temperature=0", "--set", "sample.tokens=40"]


@pytest.mark.parametrize("name", sorted(CK_LAYOUTS))
def test_checkpoint_step_samples_like_final(ck_run, tmp_path, name):
    d = ck_run(name)
    final = run(["sample", "--weights", d / "ck" / "final.safetensors"] + CK_GREEDY, tmp_path)
    assert final.returncode == 0, final.stderr
    step = run(["sample", "--weights", d / "ck" / f"step-{CK_STEPS}"] + CK_GREEDY, tmp_path)
    print(f"{name}: final.safetensors: {final.stdout.strip()}")
    print(f"{name}: step-{CK_STEPS}:          {step.stdout.strip()}")
    assert step.returncode == 0, step.stderr
    assert step.stdout == final.stdout and "|" in final.stdout
    # the checkpoint directory: its newest intact checkpoint, named in the log
    auto = run(["sample", "--weights", d / "ck"] + CK_GREEDY, tmp_path)
    assert auto.returncode == 0, auto.stderr
    assert auto.stdout == final.stdout
    picked = [ln for ln in auto.stderr.splitlines() if "newest intact checkpoint" in ln]
    print(f"{name}: {picked}")
    assert len(picked) == 1 and f"step-{CK_STEPS}" in picked[0], auto.stderr
    # with the plan the run was trained with (its mesh of 2 ranks, resolved for one process):
    # checked against the checkpoint, the same text; and export takes it too
    planned = run(["sample", d / "plan.json", "--weights", d / "ck" / f"step-{CK_STEPS}"] + CK_GREEDY, tmp_path)
    assert planned.returncode == 0, planned.stderr
    assert planned.stdout == final.stdout
    r = run(["export", "--format", "llama2c", d / "plan.json", "--weights", d / "ck", "--out", tmp_path / "p.bin"],
            tmp_path)
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("name", sorted(CK_LAYOUTS))
def test_checkpoint_step_exports_like_final(ck_run, tmp_path, name):
    d = ck_run(name)
    outs = {}
    for label, weights in [("final", d / "ck" / "final.safetensors"), ("step", d / "ck" / f"step-{CK_STEPS}"),
                           ("dir", d / "ck"), ("early", d / "ck" / "step-2")]:
        for fmt, out in [("hf", tmp_path / f"{label}_hf"), ("llama2c", tmp_path / f"{label}.bin")]:
            r = run(["export", "--format", fmt, "--weights", weights, "--out", out], tmp_path)
            assert r.returncode == 0, r.stderr
        outs[label] = llama_ref.load_safetensors(tmp_path / f"{label}_hf" / "model.safetensors")[0]
    ref = outs["final"]
    for label in ("step", "dir"):
        got = outs[label]
        same = [k for k in ref if k in got and ref[k].dtype == got[k].dtype and ref[k].shape == got[k].shape
                and ref[k].tobytes() == got[k].tobytes()]
        print(f"{name}: HF export of {label} vs final.safetensors: {len(same)} of {len(ref)} tensors byte-identical "
              f"(tolerance: identical)")
        assert sorted(got) == sorted(ref) and len(same) == len(ref)
        assert (tmp_path / f"{label}_hf" / "config.json").read_bytes() == (tmp_path / "final_hf" /
                                                                           "config.json").read_bytes()
        assert (tmp_path / f"{label}.bin").read_bytes() == (tmp_path / "final.bin").read_bytes()
    # step-2 is another model: what the step folder names is what is read
    early = outs["early"]
    assert any(early[k].tobytes() != ref[k].tobytes() for k in ref)


def test_checkpoint_weights_errors(ck_run, tmp_path):
    d = ck_run("fsdp2")
    # a folder that is neither an HF folder nor a checkpoint
    (tmp_path / "empty").mkdir()
    for cmd in (["sample"], ["export", "--format", "hf", "--out", tmp_path / "o"]):
        bad(run(cmd + ["--weights", tmp_path / "empty"], tmp_path), 2, "empty",
            "neither a Hugging Face folder", "nor a checkpoint")
    assert not (tmp_path / "o").exists()
    # damaged: one shard of step-4 with a flipped bit; the step folder is refused with the loader's
    # message, the checkpoint directory falls back to step-2 (a warning, then the pick)
    ck = tmp_path / "ck"
    shutil.copytree(d / "ck", ck)
    shard = ck / f"step-{CK_STEPS}" / "shard-1.safetensors"
    with open(shard, "r+b") as f:
        f.seek(os.path.getsize(shard) - 5)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x10]))
    for cmd in (["sample"], ["export", "--format", "hf", "--out", tmp_path / "o"]):
        bad(run(cmd + ["--weights", ck / f"step-{CK_STEPS}"], tmp_path), 2, "checkpoint error",
            "shard-1.safetensors", "checksum mismatch")
    back = run(["sample", "--weights", ck] + CK_GREEDY, tmp_path)
    assert back.returncode == 0, back.stderr
    picked = [ln for ln in back.stderr.splitlines() if "newest intact checkpoint" in ln]
    print(f"step-{CK_STEPS} damaged: {picked}")
    assert len(picked) == 1 and "step-2" in picked[0], back.stderr
    # every checkpoint damaged: one line, the loader's (the files were named in its warnings)
    (ck / "step-2" / "metadata.json").write_text("{}")
    r = run(["sample", "--weights", ck], tmp_path)
    bad(r, 2, "checkpoint error", "no intact checkpoint in")
    assert "step-2/metadata.json" in r.stderr and "shard-1.safetensors" in r.stderr
    # the model: a plan of another shape, --set model.* against the checkpoint's
    plan = json.loads((d / "plan.json").read_text())
    plan["model"]["n_layers"] = 3
    (tmp_path / "p3.json").write_text(json.dumps(plan))
    step = d / "ck" / f"step-{CK_STEPS}"
    bad(run(["sample", tmp_path / "p3.json", "--weights", step], tmp_path), 2,
        "n_layers 2 but the plan says 3 (set model.n_layers=2)")
    bad(run(["export", "--format", "hf", tmp_path / "p3.json", "--weights", step, "--out", tmp_path / "o"], tmp_path),
        2, "n_layers 2 but the plan says 3")
    bad(run(["sample", "--weights", d / "ck", "--set", "model.dim=128"], tmp_path), 2, "dim 64 but the plan says 128")
    assert not (tmp_path / "o").exists()
    # model.init takes weights; a checkpoint is checkpoint.resume's
    bad(run([d / "plan.json", "--set", f"model.init={step}", "--set", "mesh.dp_shard=1", "--set",
             f"checkpoint.dir={tmp_path / 'ck_init'}"], tmp_path), 2, f"model.init {step} is a checkpoint",
        "checkpoint.resume")


# --------------------------------------------------------------------- values that are not numbers

NAN_AT = 37  # an element of tok_embeddings.weight (row 1, column 5 of dim 32): the same index in every format


def poison_safetensors(path, name, index, value):
    """Writes value (float32) over element `index` of tensor `name` of the safetensors file path."""
    with open(path, "r+b") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        begin = json.loads(f.read(n))[name]["data_offsets"][0]
        f.seek(8 + n + begin + 4 * index)
        f.write(struct.pack("<f", value))


def test_nonfinite_weights_refused(tmp_path):
    """One NaN or infinity in tok_embeddings.weight of a weights file of each format (ours: nan,
    llama2.c: -inf, HF: inf) stops every reader: `sample`, `export` (nothing written) and training
    from it as model.init (one process, and fsdp2 under meshrun, whose ranks all read it: no
    restart spent, no final weights) exit 2 with one line naming the file, the tensor and the
    element. Before the check all of them exited 0, and the value went on into the output."""
    good = train_ours(tmp_path)
    for fmt, out in (("llama2c", tmp_path / "good.bin"), ("hf", tmp_path / "good_hf")):
        r = run(["export", "--format", fmt, "--weights", good, "--out", out], tmp_path)
        assert r.returncode == 0, r.stderr
    ours, l2c, hf = tmp_path / "nan.safetensors", tmp_path / "ninf.bin", tmp_path / "inf_hf"
    shutil.copy(good, ours)
    poison_safetensors(ours, "tok_embeddings.weight", NAN_AT, float("nan"))
    shutil.copy(tmp_path / "good.bin", l2c)
    with open(l2c, "r+b") as f:  # the embedding is the first tensor after the 7-int header
        f.seek(28 + 4 * NAN_AT)
        f.write(struct.pack("<f", float("-inf")))
    shutil.copytree(tmp_path / "good_hf", hf)
    poison_safetensors(hf / "model.safetensors", "model.embed_tokens.weight", NAN_AT, float("inf"))

    for path, what in ((ours, "nan"), (l2c, "-inf"), (hf, "inf")):
        want = f"weights error: {path}: tensor tok_embeddings.weight element {NAN_AT} is {what} (not a finite number)"
        bad(run(["sample", "--weights", path, "--set", "sample.tokens=4"], tmp_path), 2, want)
        for fmt in ("llama2c", "hf"):
            out = tmp_path / f"out_{path.name}_{fmt}"
            bad(run(["export", "--format", fmt, "--weights", path, "--out", out], tmp_path), 2, want)
            assert not out.exists()
        d = tmp_path / f"init_{path.name}"
        d.mkdir()
        r = run([tmp_path / "p.json", "--set", f"model.init={path}", "--set", f"checkpoint.dir={d / 'ck'}"], d)
        bad(r, 2, want)
        assert not (d / "ck" / "final.safetensors").exists()

    # fsdp2: every rank reads model.init and refuses it alike; exit 2 is not restarted
    d = tmp_path / "init_fsdp2"
    d.mkdir()
    m = Meshrun(["--nproc_per_node=2", "--max_restarts=2", "--rdzv_conf=" + FAST_CONF, TRAINER, str(tmp_path / "p.json"),
                 "--set", "mesh.dp_shard=2", "--set", f"model.init={hf}", "--set", f"checkpoint.dir={d / 'ck'}"],
                env={"OMP_NUM_THREADS": "1"}, cwd=str(d))
    rc = m.wait(120)
    want = f"weights error: {hf}: tensor tok_embeddings.weight element {NAN_AT} is inf (not a finite number)"
    lines = [ln for ln in m.err.splitlines() if want in ln]
    print(f"fsdp2 model.init: meshrun rc {rc}; {len(lines)} lines name it, e.g. {lines[:1]}")
    assert rc == 2 and "no restart tried" in m.err, m.describe()
    assert {ln.split("]:")[0] for ln in lines if ln.startswith("[rank")} == {"[rank0", "[rank1"}, m.describe()
    assert not (d / "ck" / "final.safetensors").exists()
