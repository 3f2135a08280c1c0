#!/usr/bin/python3
"""check_ptxas: the register and local-memory table of the cuda kernels, from ptxas's own report.

    test/tools/check_ptxas.py LOG [--arch sm_90a]

LOG is what `nvcc -Xptxas -v` wrote to stderr while it compiled one .cu file (the Makefile keeps it
beside the object as .ptxas). Lines that are not ptxas's report (compiler warnings) are passed
through to stderr. Then one row per kernel for the shown architecture: registers, shared memory,
stack frame, and the bytes spilled to local memory. A kernel that spills, for any architecture in
the log, fails the check (exit 1): a spill turns register traffic into memory traffic in exactly
the kernels we write to be bandwidth-bound. Exit 2 when the log holds no kernel at all (ptxas
did not report, so nothing was checked).
"""
import re
import subprocess
import sys

ENTRY = re.compile(r"^ptxas info\s*: Compiling entry function '([^']+)' for '(\w+)'")
FRAME = re.compile(r"^\s*(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
USED = re.compile(r"^ptxas info\s*: Used (\d+) registers(?:, used \d+ barriers)?(?:, (\d+) bytes smem)?")


def demangle(names):
    try:
        out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True, timeout=60).stdout
        plain = out.splitlines()
        return plain if len(plain) == len(names) else names
    except OSError:
        return names


def short(name):
    """'void ns::kern<float, 8>(float*, int)' -> 'kern<float, 8>'."""
    name = re.sub(r"^void ", "", name)
    depth, cut = 0, len(name)
    for i, c in enumerate(name):
        if c == "<":
            depth += 1
        elif c == ">":
            depth -= 1
        elif c == "(" and depth == 0:
            cut = i
            break
    name = name[:cut]
    if name.startswith("cub::"):  # cub's kernels: the kernel's name, not its policy templates
        return "cub " + re.sub(r"<.*", "", name).rsplit("::", 1)[-1]
    return re.sub(r"^(\w+::)+", "", name)


def parse(lines):
    kernels, cur = [], None
    for line in lines:
        m = ENTRY.match(line)
        if m:
            cur = {"name": m.group(1), "arch": m.group(2), "regs": 0, "smem": 0, "stack": 0, "st": 0, "ld": 0}
            kernels.append(cur)
            continue
        m = FRAME.match(line)
        if m and cur is not None:
            cur["stack"], cur["st"], cur["ld"] = (int(g) for g in m.groups())
            continue
        m = USED.match(line)
        if m and cur is not None:
            cur["regs"] = int(m.group(1))
            cur["smem"] = int(m.group(2) or 0)
            cur = None
    return kernels


def main(argv):
    if not argv:
        print("usage: check_ptxas.py LOG [--arch ARCH]", file=sys.stderr)
        return 2
    log, arch = argv[0], "sm_90a"
    if "--arch" in argv:
        arch = argv[argv.index("--arch") + 1]
    lines = open(log, errors="replace").read().splitlines()
    for line in lines:
        if not (line.startswith("ptxas info") or FRAME.match(line)):
            print(line, file=sys.stderr)
    kernels = parse(lines)
    if not kernels:
        print(f"check_ptxas: {log}: no kernel in ptxas's report (was it compiled with -Xptxas -v?)")
        return 2
    plain = demangle([k["name"] for k in kernels])
    for k, p in zip(kernels, plain):
        k["short"] = short(p)
    archs = sorted({k["arch"] for k in kernels})
    shown = [k for k in kernels if k["arch"] == arch] or [k for k in kernels if k["arch"] == archs[0]]
    src = log.rsplit("/", 1)[-1].rsplit(".", 1)[0]
    print(f"ptxas {src}: {len(shown)} kernels for {shown[0]['arch']} (also built: "
          f"{', '.join(a for a in archs if a != shown[0]['arch']) or 'none'})")
    print(f"  {'kernel':<58} {'regs':>4} {'smem':>6} {'stack':>5} {'spill st/ld':>11}")
    for k in sorted(shown, key=lambda k: k["short"]):
        print(f"  {k['short'][:58]:<58} {k['regs']:>4} {k['smem']:>6} {k['stack']:>5} {k['st']:>5}/{k['ld']:<5}")
    spills = [k for k in kernels if k["st"] or k["ld"]]
    for k in spills:
        print(f"check_ptxas: {k['short']} ({k['arch']}) spills {k['st']} bytes to local memory and loads "
              f"{k['ld']} back: lower its register use (fewer live values, smaller unroll) or its launch bounds")
    if spills:
        return 1
    print(f"check_ptxas: no spills ({len(kernels)} kernels in {len(archs)} architectures); most registers: "
          f"{max(shown, key=lambda k: k['regs'])['short']} with {max(k['regs'] for k in shown)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
