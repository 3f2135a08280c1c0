"""`trainer export --format hf` folders, loaded by Hugging Face's transformers as a user loads them.

What: two models go out as HF folders -- stories260K.bin (llama2.c, ../shared/data or
MESHRUN_DATA; no tokenizer known) and a model trained here (untied, GQA, vocab 528 over a
512-token BPE tokenizer that tools/prepare_data.py trains on a slice of tinyshakespeare, on
shards of three short documents so that it learns to end them with <|endoftext|>). Then:
- AutoModelForCausalLM.from_pretrained(folder) finds every tensor under its name, none left
  over, in float32 (torch_dtype "auto": the config's); its logits on random tokens equal our C
  model's on the same folder (interop_tool) and a float64 llama_ref's on the source weights, read
  independently; its loss on a greedy sequence equals the C model's.
- AutoTokenizer.from_pretrained(folder) (gpt2-style and Llama-3-regex tokenizers, and llama2.c's
  tokenizer.bin of a sentencepiece-style BPE, which export converts) encodes a passage past the
  training slice plus test_tokenizer's hard cases into the same ids as our C tokenizer
  (build/tools/tokenize; for the converted one, on the .bin too) and as `tokenizers`, decodes them
  back to the text, and names the BOS and EOS ids that config.json and generation_config.json
  record.
- AutoTokenizer's tok(text), as users call it, gives input_ids and attention_mask only (no
  token_type_ids, which generate refuses) and puts BOS first, as `trainer sample` does with a
  prompt (also through GPT-2's ByteLevel post_processor); README.md's transformers example, run as
  written, prints what its `trainer sample` line prints.
- generate, greedy: stories260K from BOS gives the ids `trainer sample` gives at temperature 0;
  the trained model from a text prompt gives the ids `trainer sample` draws and stops at EOS where
  `trainer sample` stops, the same text; through the converted tokenizer.json, `trainer sample`
  prints the text of the ids transformers draws.

Tolerance: logits max|HF - torch64| <= 1e-5 * max(1, max|torch64|) (HF computes in float32, as
test_interop allows C), max|HF - C| <= 2e-5 * that (both float32); losses within 1e-5 *
max(1, loss); ids and text exactly. Each difference is printed.
transformers must be importable (scripts/install-deps.sh installs 4.49.0); without it these
tests skip.
What not: bf16 or sharded folders, transformers' training, Unigram tokenizers.
"""
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
import llama_ref  # noqa: E402
from test_interop import tool as interop_tool  # noqa: E402
from test_sample import STORIES, TRAINER, need_stories, run, sample_ids  # noqa: E402
from test_tokenizer import HARD, PREPARE, PYTHON, TOOL, c_decode, corpus_path  # noqa: E402
from test_tokenizer import run as run_checked  # noqa: E402
from test_sentencepiece import train_spm, write_llama2c  # noqa: E402

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

TOL = 1e-5
SLICE = 150_000  # bytes of tinyshakespeare the tokenizers are trained on
DOCS = ["To be, or not to be: that is the question.",
        "All the world's a stage, and all the men and women merely players.",
        "Now is the winter of our discontent."]
PROMPT = "All the"
README = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "README.md")


def export(weights, out, cwd, *sets):
    r = run(["export", "--format", "hf", "--weights", weights, "--out", out] + list(sets), cwd)
    assert r.returncode == 0, r.stderr
    return out


def load_model(folder):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(str(folder), torch_dtype="auto",
                                                                     output_loading_info=True)
    assert not any(info.values()), f"{folder}: loading info {info}"
    assert model.dtype == torch.float32
    return model.eval()


def generate(model, prompt, n):
    """Greedy ids after prompt. synced_gpus=False: left to itself, generate asks whether the model
    is FSDP-wrapped by importing torch.distributed.fsdp, which Debian's torch 1.13 cannot import
    under Python 3.11 (a dataclass error)."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=n, do_sample=False, synced_gpus=False)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def stories(tmp_path_factory):
    need_stories()
    d = tmp_path_factory.mktemp("stories")
    return export(STORIES, d / "hf", d)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A model of ours trained to end each document with EOS, exported with its tokenizer
    ("hf") and with the Llama-3-regex one ("hf_llama3"). Returns a dict of paths."""
    d = tmp_path_factory.mktemp("trained")
    with open(corpus_path(), "rb") as f:
        (d / "shk.txt").write_bytes(f.read(SLICE))
    for kind, extra in (("gpt2", []), ("llama3", ["--llama3-regex"])):
        run_checked([PYTHON, PREPARE, "--train-tokenizer", "512", "-o", str(d / kind)] + extra + [str(d / "shk.txt")])
    (d / "docs").mkdir()
    for i in range(60):
        (d / "docs" / f"d{i:02d}.txt").write_text(DOCS[i % len(DOCS)])
    run_checked([PYTHON, PREPARE, "--tokenizer", str(d / "gpt2" / "tokenizer.json"), "-o", str(d / "data"),
                 "--prefix", "docs", "--val-tokens", "0", str(d / "docs" / "*.txt")])
    plan = {"device": "cpu", "seed": 3,
            "model": {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 528, "max_seq_len": 64,
                      "multiple_of": 32},
            "train": {"steps": 100, "seq_len": 32, "micro_batch_size": 8, "lr": 1e-2, "warmup_steps": 5},
            "data": {"train": str(d / "data" / "docs_train.bin"), "tokenizer": str(d / "gpt2" / "tokenizer.json")},
            "eval": {"interval": 0}, "checkpoint": {"dir": str(d / "ck")}, "sample": {"tokens": 0}}
    (d / "plan.json").write_text(json.dumps(plan))
    t = run([d / "plan.json"], d)
    assert t.returncode == 0, t.stderr
    weights = d / "ck" / "final.safetensors"
    export(weights, d / "hf", d)  # the tokenizer from the weights' metadata plan
    export(weights, d / "hf_llama3", d, "--set", f"data.tokenizer={d / 'llama3' / 'tokenizer.json'}")
    # the same tokenizer with GPT-2's post_processor (ByteLevel), which export keeps beside BOS
    gpt2 = json.loads((d / "gpt2" / "tokenizer.json").read_text())
    gpt2["post_processor"] = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    (d / "bytelevel.json").write_text(json.dumps(gpt2, ensure_ascii=False))
    export(weights, d / "hf_bytelevel", d, "--set", f"data.tokenizer={d / 'bytelevel.json'}")
    # llama2.c's tokenizer.bin of a sentencepiece-style BPE: export converts it to tokenizer.json
    spm = train_spm(tokenizers, (d / "shk.txt").read_text(), 512, d / "spm.json")
    l2c = write_llama2c(spm, d / "tokenizer.bin")
    export(weights, d / "hf_l2c", d, "--set", f"data.tokenizer={l2c}")
    return {"dir": d, "plan": d / "plan.json", "weights": weights, "model": plan["model"], "hf": d / "hf",
            "gpt2": d / "hf", "llama3": d / "hf_llama3", "l2c": d / "hf_l2c", "l2c_bin": l2c,
            "bytelevel": d / "hf_bytelevel"}


def reference(name, stories, trained):
    """(HF folder, float64 llama_ref of the source weights, read here)."""
    if name == "stories260K":
        cfg, w, _ = llama_ref.read_llama2c(STORIES)
        folder = stories
    else:
        w, _ = llama_ref.load_safetensors(trained["weights"])
        cfg = dict(trained["model"], hidden_dim=w["layers.0.feed_forward.w1.weight"].shape[0])
        folder = trained["hf"]
    ref = llama_ref.Llama({k: cfg[k] for k in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "hidden_dim")},
                          dtype=torch.float64)
    ref.load_weights({k: np.array(v) for k, v in w.items()})
    return folder, ref


def max_diff(a, b):
    return (torch.as_tensor(a, dtype=torch.float64) - torch.as_tensor(b, dtype=torch.float64)).abs().max().item()


# --------------------------------------------------------------------- weights

@pytest.mark.parametrize("name", ["stories260K", "trained"])
def test_logits_and_loss_match(name, request, tmp_path):
    stories = request.getfixturevalue("stories") if name == "stories260K" else None
    trained = request.getfixturevalue("trained") if name == "trained" else None
    folder, ref = reference(name, stories, trained)
    model = load_model(folder)
    # logits on random tokens: C (the folder through our importer), HF, torch64 (the source)
    interop_tool("logits", folder, tmp_path / "c.safetensors", "b=2", "t=48", "seed=7")
    dump, _ = llama_ref.load_safetensors(tmp_path / "c.safetensors")
    tokens = dump["tokens"].astype(np.int64)
    with torch.no_grad():
        hf = model(torch.as_tensor(tokens)).logits
        want = ref(tokens)
    scale = max(1.0, want.abs().max().item())
    d_ref, d_c = max_diff(hf, want), max_diff(hf, dump["logits"])
    print(f"[{name}] logits on {tokens.shape} random tokens: max|HF - torch64| {d_ref:.3e}, max|HF - C| {d_c:.3e}, "
          f"max|logit| {scale:.2f} (tol {TOL * scale:.3e} and {2 * TOL * scale:.3e})")
    assert d_ref <= TOL * scale and d_c <= 2 * TOL * scale
    # the loss of a 48-token greedy sequence from id 1, as interop_tool computes it (next-token targets)
    out = interop_tool("logits", folder, tmp_path / "g.safetensors", "gen=48").stdout
    lines = dict(line.split(" ", 1) for line in out.splitlines() if line.startswith(("tokens ", "loss ")))
    seq = torch.tensor([[int(x) for x in lines["tokens"].split()]])
    c_loss = float(lines["loss"])
    with torch.no_grad():
        hf_loss = model(seq, labels=seq).loss.item()
        ref_loss = torch.nn.functional.cross_entropy(ref(seq[:, :-1].numpy())[0], seq[0, 1:]).item()
    tol = TOL * max(1.0, ref_loss)
    print(f"[{name}] loss on {seq.shape[1]} greedy tokens: HF {hf_loss:.6f}, C {c_loss:.6f}, torch64 {ref_loss:.6f}; "
          f"|HF - C| {abs(hf_loss - c_loss):.2e}, |HF - torch64| {abs(hf_loss - ref_loss):.2e} (tol {tol:.1e})")
    assert abs(hf_loss - c_loss) <= tol and abs(hf_loss - ref_loss) <= tol


# --------------------------------------------------------------------- tokenizer

@pytest.mark.parametrize("kind", ["gpt2", "llama3", "l2c"])
def test_tokenizer_agrees(kind, trained, tmp_path):
    folder = trained[kind]
    with open(corpus_path(), "rb") as f:
        f.seek(SLICE)
        text = f.read(20_000).decode("utf-8") + HARD  # past the slice the tokenizer learned from
    path = tmp_path / "text.txt"
    path.write_bytes(text.encode("utf-8"))
    at = transformers.AutoTokenizer.from_pretrained(str(folder))
    assert at.is_fast
    hf = at.encode(text, add_special_tokens=False)
    lib = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json")).encode(text, add_special_tokens=False).ids
    c = [int(x) for x in run_checked([TOOL, str(folder / "tokenizer.json"), str(path)]).stdout.split()]
    first = next((i for i, (a, b, x) in enumerate(zip(hf, lib, c)) if not a == b == x), None)
    print(f"[{kind}] {len(text)} characters: {len(hf)} ids from AutoTokenizer, {len(lib)} from tokenizers, {len(c)} "
          f"from C; {'identical' if first is None else 'first difference at %d' % first}")
    assert hf == lib == c
    if kind == "l2c":  # the converted JSON gives the tokenizer.bin's ids
        c_bin = [int(x) for x in run_checked([TOOL, str(trained["l2c_bin"]), str(path)]).stdout.split()]
        print(f"[{kind}] C on llama2.c's tokenizer.bin: {len(c_bin)} ids, {'the same' if c_bin == c else 'DIFFERENT'}")
        assert c_bin == c
        assert at.encode(text)[0] == at.bos_token_id, "the converted tokenizer.json does not put BOS first"
    assert at.decode(hf) == text, "AutoTokenizer's decode(encode(x)) != x"
    assert c_decode(str(folder / "tokenizer.json"), hf, str(tmp_path)) == text.encode("utf-8")
    # BOS and EOS: transformers' tokenizer, the C tokenizer, and what the model's files record
    info = dict(ln.split() for ln in run_checked([TOOL, "--info", str(folder / "tokenizer.json")]).stdout.decode()
                .splitlines())
    config = json.loads((folder / "config.json").read_text())
    gen = transformers.GenerationConfig.from_pretrained(str(folder))
    print(f"[{kind}] BOS {at.bos_token!r} {at.bos_token_id}, EOS {at.eos_token!r} {at.eos_token_id}; C {info}; "
          f"config.json {config['bos_token_id']} {config['eos_token_id']}; generation_config.json "
          f"{gen.bos_token_id} {gen.eos_token_id}")
    assert at.bos_token_id == int(info["bos"]) == config["bos_token_id"] == gen.bos_token_id
    assert at.eos_token_id == int(info["eos"]) == config["eos_token_id"] == gen.eos_token_id
    assert at.model_max_length == config["max_position_embeddings"] == trained["model"]["max_seq_len"]


# --------------------------------------------------------------------- generate

def test_generate_stories260k(stories, tmp_path):
    n = 200
    model = load_model(stories)
    hf = generate(model, [1], n)
    r = run(["sample", "--weights", stories, "--set", "sample.temperature=0", "--set", 'sample.prompt="1"',
             "--set", f"sample.tokens={n}"], tmp_path)
    _, ours = sample_ids(r)
    first = next((i for i, (a, b) in enumerate(zip(hf, ours)) if a != b), None)
    print(f"stories260K greedy from BOS, {n} tokens: transformers generate vs trainer sample: "
          f"{len(hf)} and {len(ours)} ids, {'identical' if first is None else 'first difference at %d' % first}")
    assert hf == ours and len(hf) == n  # no EOS known: neither stops early


def test_generate_stops_at_eos(trained, tmp_path):
    n = 60
    folder = trained["hf"]
    at = transformers.AutoTokenizer.from_pretrained(str(folder))
    prompt = [at.bos_token_id] + at.encode(PROMPT, add_special_tokens=False)
    hf = generate(load_model(folder), prompt, n)
    # ours: the ids without a tokenizer (a plan file whose data has no tokenizer: no stop), then
    # the text from the folder (its tokenizer.json: BOS first, stops at EOS)
    ids = run(["sample", trained["plan"], "--weights", trained["weights"], "--set", 'data.tokenizer=""',
               "--set", "sample.temperature=0", "--set", f"sample.tokens={n}",
               "--set", f'sample.prompt="{" ".join(map(str, prompt))}"'], tmp_path)
    p, ours = sample_ids(ids)
    assert p == prompt
    text = run(["sample", "--weights", folder, "--set", "sample.temperature=0", "--set", f"sample.tokens={n}",
                "--set", f'sample.prompt="{PROMPT}"'], tmp_path, binary=True)
    assert text.returncode == 0, text.stderr
    eos = at.eos_token_id
    print(f"prompt {PROMPT!r} = {prompt}: transformers {hf}; trainer {ours}; text {text.stdout!r}")
    assert eos in ours, "the trained model never draws EOS: nothing to check the stop against"
    stop = ours.index(eos) + 1
    print(f"EOS ({eos}) after {stop - 1} new tokens: transformers stopped after {len(hf)} ids")
    assert hf == ours[:stop]
    assert text.stdout == (PROMPT + at.decode(hf, skip_special_tokens=True) + "\n").encode("utf-8")


def test_generate_llama2c_tokenizer(trained, tmp_path):
    """The folder exported with llama2.c's tokenizer.bin: our sample reads its converted
    tokenizer.json and prints the text transformers decodes from the ids its generate draws."""
    n = 40
    folder = trained["l2c"]
    at = transformers.AutoTokenizer.from_pretrained(str(folder))
    prompt = [at.bos_token_id] + at.encode(PROMPT, add_special_tokens=False)
    hf = generate(load_model(folder), prompt, n)
    text = run(["sample", "--weights", folder, "--set", "sample.temperature=0", "--set", f"sample.tokens={n}",
                "--set", f'sample.prompt="{PROMPT}"'], tmp_path, binary=True)
    assert text.returncode == 0, text.stderr
    # The model learned other ids, so its draws may be bytes that are not UTF-8, which transformers'
    # decode replaces by U+FFFD and ours prints as they are: the bytes the tokenizer's pieces name
    # (decoder: "▁" a space, <0xNN> its byte, the first space stripped; BOS not printed), and
    # transformers' decode
    # itself whenever that is valid UTF-8.
    pieces = at.convert_ids_to_tokens(prompt[1:] + hf)
    want = b"".join(bytes([int(p[3:5], 16)]) if len(p) == 6 and p.startswith("<0x") else
                    p.replace("\u2581", " ").encode("utf-8") for p in pieces)  # a drawn <unk> prints as such
    want = want[1:] if want.startswith(b" ") else want
    print(f"prompt {PROMPT!r} = {prompt}: transformers {len(hf)} ids, {want!r}; trainer sample {text.stdout!r}")
    assert text.stdout == want + b"\n"
    try:
        valid = want.decode("utf-8")
    except UnicodeDecodeError:
        valid = None
    if valid is not None:
        assert valid == at.decode(prompt[1:] + hf)


# --------------------------------------------------------------------- as users call it

@pytest.mark.parametrize("kind", ["gpt2", "llama3", "l2c", "bytelevel"])
def test_tokenizer_call_gives_model_inputs(kind, trained):
    """tok(text) gives what a Llama takes, so generate(**tok(text)) runs: PreTrainedTokenizerFast
    adds token_type_ids unless tokenizer_config.json names model_input_names, and generate refuses
    them ("model_kwargs are not used by the model")."""
    folder = trained[kind]
    at = transformers.AutoTokenizer.from_pretrained(str(folder))
    enc = at(PROMPT, return_tensors="pt")
    print(f"[{kind}] tok({PROMPT!r}) gives {list(enc)}")
    assert list(enc) == ["input_ids", "attention_mask"]
    with torch.no_grad():
        out = load_model(folder).generate(**enc, max_new_tokens=4, do_sample=False, synced_gpus=False)
    assert out.shape[1] > enc["input_ids"].shape[1]


@pytest.mark.parametrize("kind", ["gpt2", "llama3", "l2c", "bytelevel"])
def test_tokenizer_call_puts_bos_first(kind, trained, tmp_path):
    """tok(text) gives the ids `trainer sample` feeds for the prompt text: the tokenizer's BOS, then
    the text's ids (the C tokenizer's; test_generate_stops_at_eos checks that the text sample
    continues those ids)."""
    folder = trained[kind]
    at = transformers.AutoTokenizer.from_pretrained(str(folder))
    path = tmp_path / "prompt.txt"
    path.write_text(PROMPT)
    c = [int(x) for x in run_checked([TOOL, str(folder / "tokenizer.json"), str(path)]).stdout.split()]
    info = dict(ln.split() for ln in run_checked([TOOL, "--info", str(folder / "tokenizer.json")]).stdout.decode()
                .splitlines())
    want = [int(info["bos"])] + c
    hf = at(PROMPT)["input_ids"]
    print(f"[{kind}] {PROMPT!r}: tok() {hf}, trainer sample {want}")
    assert hf == want
    assert at.decode(hf, skip_special_tokens=True) == PROMPT


def readme_example():
    """README.md's transformers example: (its python block, the README's only one; the sh block
    just before it)."""
    blocks, lang, lines = [], None, []
    with open(README, encoding="utf-8") as f:
        for line in f:
            if line.startswith("```"):
                if lang is None:
                    lang, lines = line[3:].strip(), []
                else:
                    blocks.append((lang, "".join(lines)))
                    lang = None
            elif lang is not None:
                lines.append(line)
    at = [i for i, (lang, _) in enumerate(blocks) if lang == "python"]
    assert len(at) == 1 and at[0] > 0 and blocks[at[0] - 1][0] == "sh", \
        "README.md: no python block after an sh block, or more than one python block"
    return blocks[at[0] - 1][1], blocks[at[0]][1]


def test_readme_example(trained, tmp_path):
    """README.md's export and sample lines, then its transformers lines, run as written in a
    folder where bin/ is ours and out/stories/final.safetensors the trained model: both print
    the same text, longer than the prompt."""
    sh, py = readme_example()
    (tmp_path / "bin").symlink_to(os.path.dirname(os.path.abspath(TRAINER)))
    (tmp_path / "out" / "stories").mkdir(parents=True)
    (tmp_path / "out" / "stories" / "final.safetensors").symlink_to(trained["weights"])
    env = dict(os.environ, OMP_NUM_THREADS="1")
    ours = subprocess.run(["bash", "-euo", "pipefail", "-c", sh], cwd=str(tmp_path), env=env, capture_output=True,
                          timeout=120)
    assert ours.returncode == 0, ours.stderr.decode(errors="replace")
    hf = subprocess.run([sys.executable, "-c", py], cwd=str(tmp_path), env=env, capture_output=True, timeout=300)
    print(f"README: trainer sample printed {ours.stdout!r}; the transformers lines {hf.stdout!r}")
    assert hf.returncode == 0, hf.stderr.decode(errors="replace")[-3000:]
    prompt = re.search(r'sample\.prompt="([^"]*)"', sh).group(1)
    assert ours.stdout.startswith(prompt.encode()) and len(ours.stdout) > len(prompt) + 1
    assert hf.stdout == ours.stdout
