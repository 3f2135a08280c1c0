"""trainer/formats/tokenizer.c against Python's `tokenizers` (Hugging Face's library, the reference).

What: tools/prepare_data.py trains two byte-level BPE tokenizers of VOCAB ids on
tinyshakespeare (GPT-2 style: ByteLevel with GPT-2's regex; and --llama3-regex: Split with
Llama 3's regex + ByteLevel(use_regex=False)) and writes llm.c shards (uint16 for one, uint32 for
the other, sharded and not). For each tokenizer, build/tools/tokenize (the C module) and the
library must give identical ids on the whole of tinyshakespeare and on a file of hard cases
(scripts, digits, emoji and ZWJ sequences, combining marks, whitespace runs, contractions in both
cases, long numbers, the special token inside text); C's decode must give back the input bytes,
as must the library's decode (special tokens kept). The shards must hold llm.c's header (magic,
version, count) and exactly [<|endoftext|>] + the library's ids of the file.

Tolerance: none; ids are compared exactly and the counts (tokens compared, mismatches) printed.
Python's tokenizers must be importable: scripts/install-deps.sh installs it and this test fails
(does not skip) without it.
What not: llama2.c's tokenizer.bin and sentencepiece-style tokenizer.json (test_sentencepiece.py,
test/unit/test_tokenizer.c), tokenizers not trained here.
"""
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

try:
    import tokenizers
    IMPORT_ERROR = None
except ImportError as e:  # reported by every test, never skipped
    tokenizers = None
    IMPORT_ERROR = e

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
BUILD = os.environ.get("MESHRUN_BUILD", os.path.join(ROOT, "build"))
TOOL = os.path.join(BUILD, "tools", "tokenize")
PREPARE = os.path.join(ROOT, "tools", "prepare_data.py")
PYTHON = "/usr/bin/python3"
VOCAB = 1536
EOT = "<|endoftext|>"


def corpus_path():
    for p in (os.path.join(ROOT, "data", "tinyshakespeare.txt"),
              os.path.join(ROOT, "..", "shared", "data", "tinyshakespeare.txt")):
        if os.path.exists(p):
            return os.path.abspath(p)
    pytest.fail("tinyshakespeare.txt is in neither data/ nor ../shared/data/")


# Each line a kind of trouble for a pre-tokenizer regex or for byte-level BPE.
HARD = (
    "Hello, World! It's can't we're they've I'm you'll he'd\n"
    "IT'S CAN'T WE'RE THEY'VE I'M YOU'LL HE'D It'S wE'Re 's 'S 'll 'LL x's X'S\n"
    "\u00dcn\u00efc\u00f6d\u00e9: na\u00efve caf\u00e9 \u0395\u03bb\u03bb\u03b7\u03bd\u03b9\u03ba\u03ac "
    "\u0420\u0443\u0441\u0441\u043a\u0438\u0439 \u0627\u0644\u0639\u0631\u0628\u064a\u0629 \u05e2\u05d1\u05e8\u05d9\u05ea "
    "\u0939\u093f\u0928\u094d\u0926\u0940 \u0e44\u0e17\u0e22 \u4e2d\u6587\u5b57\u7b26 \u65e5\u672c\u8a9e \ud55c\uad6d\uc5b4\n"
    "digits: 0 12 345 6789 1234567890123 \u0661\u0662\u0663\u0664\u0665 \u096a\u0968 \u0bf0 \u00bd \u00b2 \u216b "
    "3.14159 1,000,000 x86_64 e=mc\u00b2 21st\n"
    "emoji: \U0001F600 \U0001F44D\U0001F3FD \U0001F468\u200d\U0001F469\u200d\U0001F467\u200d\U0001F466 "
    "\U0001F3F3\ufe0f\u200d\U0001F308 \u2764\ufe0f \U0001F1EB\U0001F1F7 x\U0001F600y\n"
    "combining: e\u0301 a\u0308\u0304 Z\u0351\u0352\u0353 \u0915\u094d\u0937\n"
    "spaces:  two   three    four\ttab\t\ttabs \t mixed\n\n\nnewlines\r\nCRLF\r\n"
    "trailing spaces   \n"
    "   leading and trailing   \n"
    "special" + EOT + "inside " + EOT + " spaced " + EOT + EOT + "twice\n"
    "nbsp\u00a0here ideographic\u3000space line\u2028sep em\u2003space nel\u0085x mvs\u180e'd \u180e\u180e. a \u180e zwsp\u200bx\n"
    "punct: ... --- !!! ??? ''' \"quoted\" (parens) [brackets] {braces} @#$%^&*_+=~`|\\/<>\n"
    "long s \u017fs 's\u017f '\u017f kelvin K\u212a nul\x00byte\x0b\x0c\x1c\x1f\n"
    "      \n\n    "
)


@pytest.fixture(scope="module")
def lib():
    if tokenizers is None:
        pytest.fail("Python's tokenizers is not importable (%s): scripts/install-deps.sh installs it "
                    "(/usr/bin/python3 -m pip install --break-system-packages tokenizers)" % IMPORT_ERROR)
    return tokenizers


def run(args, **kw):
    p = subprocess.run(args, capture_output=True, timeout=120, **kw)
    if p.returncode != 0:
        pytest.fail("%s exited %d\n%s\n%s" % (" ".join(map(str, args)), p.returncode,
                                              p.stdout.decode(errors="replace"), p.stderr.decode(errors="replace")))
    return p


def c_encode(tok_json, path):
    if not os.path.exists(TOOL):
        pytest.fail("%s not built (make %s)" % (TOOL, TOOL))
    t0 = time.monotonic()
    p = run([TOOL, tok_json, path])
    return [int(x) for x in p.stdout.split()], time.monotonic() - t0, p.stderr.decode().strip()


def c_decode(tok_json, ids, tmp):
    idsfile = os.path.join(tmp, "ids.txt")
    with open(idsfile, "w") as f:
        f.write("\n".join(map(str, ids)))
    return run([TOOL, "--decode", tok_json, idsfile]).stdout


# Three prepare_data runs: GPT-2 style (uint16, val/train), Llama-3 regex (uint32 forced,
# shards of 100k), and the first tokenizer taken back with --tokenizer (uint16, shards).
RUNS = {
    "gpt2": ["--train-tokenizer", str(VOCAB)],
    "llama3": ["--train-tokenizer", str(VOCAB), "--llama3-regex", "--dtype", "uint32", "--shard-tokens", "100000"],
}


@pytest.fixture(scope="module")
def prepared(lib, tmp_path_factory):
    """kind -> (out dir, tokenizer.json, stdout of prepare_data)."""
    corpus = corpus_path()
    out = {}
    for kind, extra in RUNS.items():
        d = str(tmp_path_factory.mktemp(kind))
        p = run([PYTHON, PREPARE, "-o", d, "--prefix", "shakespeare"] + extra + [corpus])
        print(p.stdout.decode())
        out[kind] = (d, os.path.join(d, "tokenizer.json"), p.stdout.decode())
    d = str(tmp_path_factory.mktemp("reuse"))
    p = run([PYTHON, PREPARE, "-o", d, "--prefix", "shakespeare", "--tokenizer", out["gpt2"][1],
             "--shard-tokens", "150000", "--val-tokens", "50000", corpus])
    print(p.stdout.decode())
    out["reuse"] = (d, out["gpt2"][1], p.stdout.decode())
    return out


def compare(lib, tok_json, path, what, c_tok=None):
    """The library's ids of path's text under tok_json (no post-processor: no BOS added, as the C
    tokenizer adds none); fails unless C's under c_tok (default tok_json) are the same."""
    tok = lib.Tokenizer.from_file(str(tok_json))
    with open(path, encoding="utf-8", newline="") as f:
        text = f.read()
    t0 = time.monotonic()
    want = tok.encode(text, add_special_tokens=False).ids
    py_s = time.monotonic() - t0
    got, c_s, c_msg = c_encode(str(c_tok or tok_json), path)
    mism = sum(a != b for a, b in zip(want, got)) + abs(len(want) - len(got))
    print("  %-28s %8d tokens compared, %d mismatches (C %.3f s incl. printing, library %.3f s; %s)" %
          (what, len(want), mism, c_s, py_s, c_msg))
    if mism:
        i = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))
        pytest.fail("%s: first difference at token %d: library %s, C %s" %
                    (what, i, [tok.id_to_token(x) for x in want[i:i + 6]], [tok.id_to_token(x) for x in got[i:i + 6]]))
    return tok, text, want


@pytest.mark.parametrize("kind", ["gpt2", "llama3"])
def test_ids_agree_and_round_trip(lib, prepared, kind, tmp_path):
    d, tj, _ = prepared[kind]
    hard = os.path.join(str(tmp_path), "hard.txt")
    with open(hard, "w", encoding="utf-8", newline="") as f:
        f.write(HARD)
    for path, what in ((corpus_path(), "%s tinyshakespeare" % kind), (hard, "%s hard cases" % kind)):
        tok, text, ids = compare(lib, tj, path, what)
        back = c_decode(tj, ids, str(tmp_path))
        assert back == text.encode("utf-8"), "%s: C decode(encode(x)) != x" % what
        assert tok.decode(ids, skip_special_tokens=False) == text, "%s: the library's round trip differs" % what
    if kind == "gpt2":
        assert ids.count(tok.token_to_id(EOT)) == HARD.count(EOT)  # each special token found, none invented


def test_info(lib, prepared):
    for kind in ("gpt2", "llama3"):
        tj = prepared[kind][1]
        tok = lib.Tokenizer.from_file(tj)
        info = dict(line.split() for line in run([TOOL, "--info", tj]).stdout.decode().splitlines())
        eot = tok.token_to_id(EOT)
        assert int(info["vocab_size"]) == tok.get_vocab_size(with_added_tokens=True) == VOCAB
        assert int(info["bos"]) == int(info["eos"]) == eot
        cfg = json.load(open(tj))
        assert cfg["model"]["type"] == "BPE"
        pre = cfg["pre_tokenizer"]
        if kind == "llama3":
            assert [p["type"] for p in pre["pretokenizers"]] == ["Split", "ByteLevel"]
            assert pre["pretokenizers"][1]["use_regex"] is False
        else:
            assert pre["type"] == "ByteLevel" and pre["use_regex"] is True


def read_shard(path):
    raw = open(path, "rb").read()
    header = np.frombuffer(raw[:1024], dtype="<i4")
    magic, version, count = (int(x) for x in header[:3])
    dtype = {20240520: "<u2", 20240801: "<u4"}.get(magic)
    assert dtype is not None, "%s: magic %d" % (path, magic)
    assert version == {20240520: 1, 20240801: 7}[magic], "%s: version %d" % (path, version)
    tokens = np.frombuffer(raw[1024:], dtype=dtype)
    assert len(tokens) == count, "%s: header says %d tokens, the file holds %d" % (path, count, len(tokens))
    return magic, tokens


def expected_shards(kind, total):
    """The names and sizes prepare_data must write for total tokens (see RUNS)."""
    if kind == "gpt2":  # no --shard-tokens: val (32768 by default) and train
        return [("shakespeare_val.bin", 32768), ("shakespeare_train.bin", total - 32768)]
    shard, val = (100000, 100000) if kind == "llama3" else (150000, 50000)
    out = [("shakespeare_val_000000.bin", val)]
    for i, start in enumerate(range(val, total, shard)):
        out.append(("shakespeare_train_%06d.bin" % (i + 1), min(shard, total - start)))
    return out


@pytest.mark.parametrize("kind,magic", [("gpt2", 20240520), ("llama3", 20240801), ("reuse", 20240520)])
def test_shards(lib, prepared, kind, magic):
    d, tj, stdout = prepared[kind]
    tok = lib.Tokenizer.from_file(tj)
    with open(corpus_path(), encoding="utf-8", newline="") as f:
        want = np.array([tok.token_to_id(EOT)] + tok.encode(f.read()).ids, dtype=np.int64)
    shards = expected_shards(kind, len(want))
    assert sorted(n for n in os.listdir(d) if n.endswith(".bin")) == sorted(n for n, _ in shards)
    parts = []
    for n, size in shards:
        m, tokens = read_shard(os.path.join(d, n))
        assert m == magic, "%s: magic %d, want %d" % (n, m, magic)
        assert len(tokens) == size, "%s: %d tokens, want %d" % (n, len(tokens), size)
        assert n in stdout, "prepare_data did not print %s" % n
        parts.append(tokens.astype(np.int64))
    got = np.concatenate(parts)
    mism = int(np.count_nonzero(got[:len(want)] != want[:len(got)])) + abs(len(got) - len(want))
    print("  %-8s %d shards %s (magic %d): %d tokens, %d mismatches against the library" %
          (kind, len(shards), [len(p) for p in parts], magic, len(got), mism))
    assert mism == 0
