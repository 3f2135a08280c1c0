"""Real text end to end: text trained through data.tokenizer, the story plans, the resolved plan
printed without training, and a resume over a changed dataset named.

- Text through a tokenizer: a plan whose data.train is a text file and whose data.tokenizer is
  the shipped 512-token BPE (data/tinyshakespeare-bpe512.json) trains on the tokenizer's ids: the
  run's train + val tokens (data_tokens + val_tokens in its records) equal the C tokenizer tool's count and PyPI tokenizers' count of the same
  text (tolerance 0), the start line names the tokenizer, and the sample prints text, not ids.
- configs/stories.json (what `make stories` runs) trains on shards that tools/prepare_data.py
  writes with a tokenizer it trains, and samples text through it; configs/stories260K.json
  fine-tunes llama2.c's stories260K on tinyshakespeare's tokens (not synthetic ones).
- --print-plan prints the resolved plan as JSON and trains nothing; the printed plan, run again,
  prints itself (a fixed point); WORLD_SIZE resolves the mesh, and a rank other than 0 prints
  nothing; a missing input still prints the plan, then exits 2 naming the file.
- A checkpoint records the dataset's size in tokens; a resume over another size warns (once,
  naming both sizes), a resume over the same data does not.
OMP_NUM_THREADS=1 everywhere (2 shared cores).
"""
import json
import os
import subprocess

import pytest

from conftest import bin_dir, tiny_plan
from test_data_paths import env, records, write_json

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRAINER = os.path.join(bin_dir(), "trainer")
TEXT = os.path.join(REPO, "data", "tinyshakespeare.txt")
BPE512 = os.path.join(REPO, "data", "tinyshakespeare-bpe512.json")
PYTHON = "/usr/bin/python3"
TOKENIZE = os.path.join(os.environ.get("MESHRUN_BUILD", os.path.join(REPO, "build")), "tools", "tokenize")


def trainer(args, cwd, timeout=180, **extra):
    return subprocess.run([TRAINER] + list(args), cwd=str(cwd), env=dict(env(), **extra), capture_output=True,
                          text=True, errors="replace",  # an untrained model may print bytes that are not UTF-8
                          timeout=timeout)


def header_record(path):
    return next(r for r in records(path) if "data_tokens" in r)


def test_text_through_the_tokenizer(tmp_path):
    text = open(TEXT, "rb").read()[:60000]
    (tmp_path / "part.txt").write_bytes(text)
    plan = tiny_plan(data={"train": "part.txt", "format": "text", "tokenizer": BPE512, "val_fraction": 0.1},
                     log={"interval": 1, "metrics_file": "m.jsonl"},
                     sample={"tokens": 24, "temperature": 0, "prompt": "KING"})
    plan["model"]["vocab_size"] = 512
    plan["train"]["steps"] = 3
    r = trainer([write_json(tmp_path / "p.json", plan)], tmp_path)
    assert r.returncode == 0, r.stderr
    head = header_record(tmp_path / "m.jsonl")
    got = head["data_tokens"] + head["val_tokens"]

    tool = subprocess.run([TOKENIZE, BPE512, str(tmp_path / "part.txt")],
                          capture_output=True, text=True, timeout=60)
    assert tool.returncode == 0, tool.stderr
    c_count = len(tool.stdout.split())
    counts = {"C tokenize tool": c_count}
    try:
        import tokenizers
        counts["PyPI tokenizers"] = len(tokenizers.Tokenizer.from_file(BPE512).encode(text.decode()).ids)
    except ImportError:
        pass
    print("train + val tokens %d for %d bytes; %s" % (got, len(text), ", ".join("%s %d" % kv for kv in counts.items())))
    assert all(v == got for v in counts.values())
    assert got < 0.6 * len(text)  # merged tokens, not bytes

    start = [l for l in r.stderr.splitlines() if "parameters" in l and "text data" in l][0]
    print(start)
    assert "encoded by %s" % BPE512 in start
    out = r.stdout.strip()
    print("sample: %r" % out)
    assert out.startswith("KING") and " | " not in out  # decoded text, not "id | id" lines

    # a model smaller than the tokenizer is refused before training, naming both sizes
    plan["model"]["vocab_size"] = 500
    plan["overwrite"] = True  # the first run's outputs are in the same folder
    r = trainer([write_json(tmp_path / "p2.json", plan)], tmp_path)
    print(r.stderr.strip().splitlines()[-1])
    assert r.returncode == 2 and "has 512 tokens, more than the model's vocab_size 500" in r.stderr


def test_stories_plan_on_prepared_shards(tmp_path):
    (tmp_path / "corpus.txt").write_bytes(open(TEXT, "rb").read()[:200000])
    prep = subprocess.run([PYTHON, os.path.join(REPO, "tools", "prepare_data.py"), "--train-tokenizer", "400",
                           "--val-tokens", "4096", "-o", "data", "corpus.txt"],
                          cwd=str(tmp_path), capture_output=True, text=True, timeout=120)
    if prep.returncode != 0 and "No module named 'tokenizers'" in prep.stderr:
        pytest.skip("PyPI tokenizers is not installed (scripts/install-deps.sh installs it)")
    assert prep.returncode == 0, prep.stderr
    d = tmp_path / "data"
    r = trainer([os.path.join(REPO, "configs", "stories.json"), "--set", "train.steps=2", "--set", "eval.interval=0",
                 "--set", "model.vocab_size=400", "--set", "model.n_layers=1", "--set", "sample.tokens=16",
                 "--set", "data.train=%s" % (d / "corpus_train.bin"), "--set", "data.val=%s" % (d / "corpus_val.bin"),
                 "--set", "data.tokenizer=%s" % (d / "tokenizer.json")], tmp_path)
    assert r.returncode == 0, r.stderr
    assert "step 2/2" in r.stderr and "llmc data" in r.stderr
    out = r.stdout.strip()
    print("sample: %r" % out)
    assert out.startswith("ROMEO:") and " | " not in out
    assert (tmp_path / "out" / "stories" / "metrics.jsonl").is_file()


def test_stories260k_finetunes_on_text(tmp_path):
    # the config reads data/stories260K.bin, which is not shipped (README: Other formats); the
    # development copy beside the repository stands in for it
    weights = os.path.join(REPO, "..", "shared", "data", "stories260K.bin")
    if not os.path.exists(weights):
        pytest.skip("no ../shared/data/stories260K.bin")
    r = trainer([os.path.join(REPO, "configs", "stories260K.json"), "--set", "model.init=%s" % weights, "--set",
                 "train.steps=2", "--set", "eval.interval=0", "--set", "sample.tokens=8", "--set", "checkpoint.dir=ck"],
                tmp_path)
    assert r.returncode == 0, r.stderr
    start = [l for l in r.stderr.splitlines() if "parameters" in l and "data" in l][0]
    print(start)
    assert "text data %s encoded by %s" % (os.path.realpath(TEXT), os.path.realpath(BPE512)) in start
    assert r.stdout.strip().startswith("ROMEO:")


def test_print_plan(tmp_path):
    r = trainer([os.path.join(REPO, "configs", "tiny.json"), "--print-plan", "--set", "train.steps=7"], tmp_path)
    assert r.returncode == 0, r.stderr
    first = json.loads(r.stdout)
    assert first["train"]["steps"] == 7 and first["data"]["train"] == os.path.realpath(TEXT)
    # indented for a person: a line per key, nested keys deeper (was one line)
    lines = r.stdout.splitlines()
    print("--print-plan: %d lines; %r" % (len(lines), lines[:3]))
    assert len(lines) > 50 and any(l.startswith("\t\t\"steps\"") for l in lines)
    assert "step" not in r.stderr and not (tmp_path / "out").exists()  # nothing trained, nothing written
    again = trainer([write_json(tmp_path / "printed.json", first), "--print-plan"], tmp_path)
    assert again.returncode == 0, again.stderr
    second = json.loads(again.stdout)
    differ = sorted(k for k in set(first) | set(second) if first.get(k) != second.get(k))
    print("printed plan re-read: sections that differ: %s" % differ)
    assert differ == []

    r = trainer([os.path.join(REPO, "configs", "fsdp.json"), "--print-plan"], tmp_path, WORLD_SIZE="4")
    assert r.returncode == 0, r.stderr
    mesh = json.loads(r.stdout)["mesh"]
    print("fsdp.json at WORLD_SIZE=4: mesh %s" % mesh)
    assert mesh["dp_shard"] * mesh["dp_replicate"] * mesh["tp"] * mesh.get("pp", 1) == 4
    # under meshrun every rank resolves the plan; rank 0 alone prints it
    r = trainer([os.path.join(REPO, "configs", "fsdp.json"), "--print-plan"], tmp_path, WORLD_SIZE="4", RANK="3")
    print("RANK=3: exit %d, %d bytes on stdout" % (r.returncode, len(r.stdout)))
    assert r.returncode == 0 and r.stdout == ""

    r = trainer([os.path.join(REPO, "configs", "tiny.json"), "--print-plan", "--set", "data.train=missing.txt"],
                tmp_path)
    print(r.stderr.strip())
    assert r.returncode == 2 and json.loads(r.stdout)["data"]["train"].endswith("missing.txt")
    assert "plan error: data.train:" in r.stderr and "No such file" in r.stderr


def test_resume_over_another_dataset_warns(tmp_path):
    data = open(TEXT, "rb").read()
    (tmp_path / "a.txt").write_bytes(data[:50000])
    (tmp_path / "b.txt").write_bytes(data[:70000])
    plan = tiny_plan(data={"train": "a.txt", "format": "text"},
                     checkpoint={"dir": "ck", "interval": 2, "resume": "auto"})
    plan["train"]["steps"] = 4
    path = write_json(tmp_path / "p.json", plan)
    r = trainer([path, "--stop-after", "2"], tmp_path)
    assert r.returncode == 0, r.stderr
    same = trainer([path, "--set", "checkpoint.dir=ck2", "--set", "checkpoint.resume=%s" % (tmp_path / "ck" / "step-2")],
                   tmp_path)
    assert same.returncode == 0, same.stderr
    assert "resumed from" in same.stderr and "dataset of" not in same.stderr
    other = trainer([path, "--set", "data.train=b.txt", "--set", "checkpoint.dir=ck3",
                     "--set", "checkpoint.resume=%s" % (tmp_path / "ck" / "step-2")], tmp_path)
    assert other.returncode == 0, other.stderr
    warn = [l for l in other.stderr.splitlines() if "dataset of" in l]
    print(warn)
    assert len(warn) == 1 and "of 50000 tokens, this run's has 70000" in warn[0]
