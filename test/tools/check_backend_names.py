#!/usr/bin/python3
"""check_backend_names: the shared files of the product code name no backend a build may lack.

    test/tools/check_backend_names.py [REPO]

Variants are files (docs/ARCHITECTURE.md, "Adding one"): a backend's code lives in files named
after it, the build picks them, and shared logic asks the registries (trainer/backend/registry.c,
trainer/comm/registry.c, and trainer/backend/attention_registry.c for the attention kernels' names)
instead of naming a backend.

A file belongs to a backend when a part of its name between underscores is a registered backend's
name or one of WORDS (backend_cuda.cu, backend_cuda_absent.c, comm_nccl.h, common/gpus_cuda.c);
the registries belong to every backend. Every other .c, .h and .cu file under common/, launcher/
and trainer/ is shared, and its code and string literals (comments are not read: they may tell
what the variants do) must not contain, in any case, a word of WORDS or the name of a backend that
a build may lack (one with a stand-in, <kind>_<name>_absent.c), except in a plan key of KEYS.

Prints each hit as "path:line: word: the line", then a summary, and exits 1 when there is one;
0 and the files read otherwise.
"""
import os
import re
import sys

from csource import blank

# The toolkits and libraries of the optional backends, and their vendor's device files.
WORDS = ("cuda", "nccl", "cublas", "cudnn", "nvcc", "nvidia")
# Plan keys users know by the vendor's word (train.cuda_graphs, as PyTorch's torch.cuda.graphs):
# the spelling, matched whole, is taken out of a line before it is read; what the key does lives
# behind the backend table (graph_begin), not in the shared file that parses it.
KEYS = re.compile(r"\bcuda_graphs\b")
REGISTRIES = ("trainer/backend/registry.c", "trainer/comm/registry.c", "trainer/backend/attention_registry.c")
REGISTERED = re.compile(r"^\s*X\((\w+)\)", re.M)


def sources(repo):
    for top in ("common", "launcher", "trainer"):
        for dirpath, _, files in os.walk(os.path.join(repo, top)):
            for f in sorted(files):
                if f.endswith((".c", ".h", ".cu")):
                    yield os.path.relpath(os.path.join(dirpath, f), repo)


def registered(repo):
    names = set()
    for path in REGISTRIES:
        full = os.path.join(repo, path)
        if os.path.exists(full):
            with open(full, errors="replace") as fh:
                names.update(REGISTERED.findall(fh.read()))
    return names


def check(repo):
    names = registered(repo)
    owners = names | set(WORDS)
    files = list(sources(repo))
    optional = {m.group(1) for f in files for m in [re.search(r"_([a-z0-9]+)_absent\.c$", f)] if m}
    words = sorted(set(WORDS) | optional)
    pattern = re.compile("|".join(map(re.escape, words)), re.I)
    hits, shared = [], []
    for path in files:
        stem = os.path.basename(path).split(".")[0]
        if path in REGISTRIES or owners & set(stem.split("_")):
            continue
        shared.append(path)
        with open(os.path.join(repo, path), errors="replace") as fh:
            text = fh.read()
        lines = text.split("\n")
        # comments blanked, strings kept: a message that names a backend counts too
        for k, line in enumerate(blank(text, strings=False).split("\n")):
            for m in pattern.finditer(KEYS.sub("", line)):
                hits.append("%s:%d: %s: %s" % (path, k + 1, m.group(0).lower(), lines[k].strip()))
    return hits, shared, words, sorted(names)


def main():
    repo = sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))))
    hits, shared, words, names = check(repo)
    for h in hits:
        print("check_backend_names: " + h)
    if hits:
        files = sorted({h.split(":")[0] for h in hits})
        print("check_backend_names: %d lines in %d shared files name a backend (%s): %s" % (
            len(hits), len(files), ", ".join(words), " ".join(files)))
        return 1
    print("check_backend_names: no shared file names a backend (%d shared files read; words: %s; "
          "registered: %s)" % (len(shared), ", ".join(words), ", ".join(names) or "none"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
