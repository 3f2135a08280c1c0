#!/usr/bin/python3
"""prepare_data: text files -> a byte-level BPE tokenizer and llm.c-layout token shards.

    tools/prepare_data.py --train-tokenizer 2048 -o out/shakespeare data/tinyshakespeare.txt
    tools/prepare_data.py --tokenizer gpt2/tokenizer.json --shard-tokens 100000000 'fineweb/*.txt'

Tokenizer: --train-tokenizer VOCAB trains one on the input files with Hugging Face's
`tokenizers` (GPT-2 style: ByteLevel pre-tokenizer with GPT-2's regex, all 256 bytes in the
alphabet, ByteLevel decoder, the special token <|endoftext|> as id 0) and writes
OUT/tokenizer.json; --llama3-regex makes its pre-tokenizer Llama 3's instead,
Sequence[Split(Llama 3's regex, Isolated), ByteLevel(use_regex=False)]. --tokenizer PATH takes
an existing tokenizer.json (or a folder holding one). Both are what trainer/formats/tokenizer.c reads.

Tokens: each input file is one document, encoded whole (pre-tokenization sees its whitespace
runs entire) and preceded by <|endoftext|> when the tokenizer has it (--no-eot: not), as llm.c's
shards are. Shards have llm.c's layout: 256 little-endian int32 (header[0] magic, header[1]
version, header[2] token count), then the tokens, uint16 with llm.c's GPT-2 header (magic
20240520, version 1) when every id fits in 16 bits, else uint32 with its Llama 3 header (magic
20240801, version 7); --dtype forces one. Names:
    without --shard-tokens:  PREFIX_val.bin (the first --val-tokens tokens), PREFIX_train.bin
    with --shard-tokens N:   PREFIX_val_000000.bin (the first --val-tokens, default N), then
                             PREFIX_train_000001.bin, ... of N tokens each (the last may be short)
as llm.c's tinyshakespeare and FineWeb scripts name theirs. --val-tokens 0 writes no val shard.
Runs offline; prints every file it wrote.
"""
import argparse
import glob
import os
import sys
import time

import numpy as np

try:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
except ImportError:
    sys.exit("prepare_data: the Python package `tokenizers` is missing: scripts/install-deps.sh installs it "
             "(/usr/bin/python3 -m pip install --break-system-packages tokenizers)")

EOT = "<|endoftext|>"
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")
HEADER_INTS = 256
FORMATS = {"uint16": (20240520, 1, np.uint16), "uint32": (20240801, 7, np.uint32)}


def input_files(patterns):
    """Each argument is a file, or a glob (expanded and sorted) that must match."""
    files = []
    for p in patterns:
        if any(c in p for c in "*?["):
            hits = sorted(glob.glob(p))
            if not hits:
                sys.exit("prepare_data: %s matches no file" % p)
            files += hits
        elif os.path.isfile(p):
            files.append(p)
        else:
            sys.exit("prepare_data: %s: no such file" % p)
    return files


def train_tokenizer(files, vocab_size, llama3_regex):
    tok = Tokenizer(models.BPE())
    if llama3_regex:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train(files, trainer)
    return tok


def load_tokenizer(path):
    if os.path.isdir(path):
        path = os.path.join(path, "tokenizer.json")
    try:
        return Tokenizer.from_file(path)
    except Exception as e:  # the library raises plain Exceptions with its message
        sys.exit("prepare_data: %s: %s" % (path, e))


def write_shard(path, tokens, dtype):
    magic, version, npdt = FORMATS[dtype]
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[0], header[1], header[2] = magic, version, len(tokens)
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(tokens.astype(np.dtype(npdt).newbyteorder("<"), copy=False).tobytes())
    print("  %-48s %10d tokens  %s  %d bytes" % (path, len(tokens), dtype, os.path.getsize(path)))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("inputs", nargs="+", metavar="FILE", help="text files or globs (quoted), one document each")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--train-tokenizer", type=int, metavar="VOCAB",
                     help="train a byte-level BPE tokenizer of VOCAB ids (>= 257) on the inputs")
    src.add_argument("--tokenizer", metavar="PATH", help="use this tokenizer.json (or a folder holding one)")
    ap.add_argument("--llama3-regex", action="store_true",
                    help="with --train-tokenizer: Llama 3's Split regex + ByteLevel(use_regex=False) as pre-tokenizer")
    ap.add_argument("-o", "--out-dir", default=".", help="where tokenizer.json and the shards go (default .)")
    ap.add_argument("--prefix", help="shard name prefix (default: the first input's name without extension)")
    ap.add_argument("--dtype", choices=["auto", "uint16", "uint32"], default="auto",
                    help="token type in the shards (default auto: uint16 when every id < 65536)")
    ap.add_argument("--shard-tokens", type=int, metavar="N", help="split into shards of N tokens")
    ap.add_argument("--val-tokens", type=int, metavar="N",
                    help="tokens in the val shard (default 32768, or N with --shard-tokens; 0: no val shard)")
    ap.add_argument("--no-eot", action="store_true", help="do not put <|endoftext|> before each document")
    a = ap.parse_args()

    if a.llama3_regex and a.train_tokenizer is None:
        ap.error("--llama3-regex goes with --train-tokenizer")
    if a.train_tokenizer is not None and a.train_tokenizer < 257:
        ap.error("--train-tokenizer: VOCAB must be at least 257 (256 bytes and <|endoftext|>)")
    if a.shard_tokens is not None and a.shard_tokens <= 0:
        ap.error("--shard-tokens must be positive")
    if a.val_tokens is not None and a.val_tokens < 0:
        ap.error("--val-tokens must not be negative")
    files = input_files(a.inputs)
    os.makedirs(a.out_dir, exist_ok=True)
    prefix = a.prefix or os.path.splitext(os.path.basename(files[0]))[0]

    t0 = time.monotonic()
    if a.train_tokenizer is not None:
        tok = train_tokenizer(files, a.train_tokenizer, a.llama3_regex)
        tpath = os.path.join(a.out_dir, "tokenizer.json")
        tok.save(tpath)
        print("prepare_data: trained a %s tokenizer of %d ids on %d file(s) in %.1f s: %s" %
              ("Llama-3-regex" if a.llama3_regex else "GPT-2-style", tok.get_vocab_size(), len(files),
               time.monotonic() - t0, tpath))
    else:
        tok = load_tokenizer(a.tokenizer)
    vocab = tok.get_vocab_size(with_added_tokens=True)
    eot = None if a.no_eot else tok.token_to_id(EOT)

    t0 = time.monotonic()
    parts, nbytes = [], 0
    for path in files:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        nbytes += len(text.encode("utf-8"))
        if eot is not None:
            parts.append(np.array([eot], dtype=np.uint32))
        parts.append(np.array(tok.encode(text).ids, dtype=np.uint32))
    tokens = np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint32)
    print("prepare_data: %d file(s), %d bytes -> %d tokens (vocab %d%s) in %.1f s" %
          (len(files), nbytes, len(tokens), vocab, ", %s before each document" % EOT if eot is not None else "",
           time.monotonic() - t0))

    top = int(tokens.max()) if len(tokens) else 0
    dtype = a.dtype
    if dtype == "auto":
        dtype = "uint16" if max(vocab - 1, top) < 1 << 16 else "uint32"
    if dtype == "uint16" and top >= 1 << 16:
        sys.exit("prepare_data: --dtype uint16: id %d does not fit in 16 bits" % top)

    print("prepare_data: wrote")
    if a.shard_tokens is None:
        nval = 32768 if a.val_tokens is None else a.val_tokens
        nval = min(nval, len(tokens))
        if nval:
            write_shard(os.path.join(a.out_dir, "%s_val.bin" % prefix), tokens[:nval], dtype)
        write_shard(os.path.join(a.out_dir, "%s_train.bin" % prefix), tokens[nval:], dtype)
    else:
        n = a.shard_tokens
        nval = min(n if a.val_tokens is None else a.val_tokens, len(tokens))
        index = 0
        if nval:
            write_shard(os.path.join(a.out_dir, "%s_val_%06d.bin" % (prefix, index)), tokens[:nval], dtype)
            index += 1
        for start in range(nval, len(tokens), n):
            write_shard(os.path.join(a.out_dir, "%s_train_%06d.bin" % (prefix, index)), tokens[start:start + n], dtype)
            index += 1


if __name__ == "__main__":
    main()
