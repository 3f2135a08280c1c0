#!/usr/bin/python3
"""check_sass: what the cuda kernels compiled to, read from their machine code (SASS).

    test/tools/check_sass.py OBJECT_OR_BINARY
    test/tools/check_sass.py --from-dump SASS.txt     (cuobjdump --dump-sass's output, saved)

Needs cuobjdump and nvdisasm (on PATH, or CUOBJDUMP naming cuobjdump; scripts/install-deps.sh
unpacks both beside nvcc's other tools where nvcc exists). Checks, and prints one line each:
  - the file holds machine code for sm_90a and for sm_90 (the a-variant for an H100/H200, plain
    sm_90 kept for tools and drivers that do not take it);
  - every 8-wide bf16 kernel (name ending in _x8_kernel) moves its data with 16-byte global loads
    and stores (LDG.E.128 / STG.E.128), as it is written to;
  - no kernel but the allowed ones touches local memory (LDL/STL: a spill or a stack array);
  - which kernels issue tensor-core instructions (HMMA, HGMMA): none of ours is meant to; the
    matrix products run in cuBLASLt and attention in cuDNN, whose kernels are not in this file.
Exit 1 when a check fails, 2 when the tools are missing or the file holds no machine code.
"""
import os
import re
import shutil
import subprocess
import sys

# Kernels allowed to use local memory, with the reason.
LOCAL_OK = {
    "rope_table_kernel": "runs once per sequence length; double sin/cos keep their argument reduction in a stack array",
}
ARCHS = ("sm_90a", "sm_90")


def cuobjdump():
    tool = os.environ.get("CUOBJDUMP") or shutil.which("cuobjdump")
    for d in ("/usr/local/cuda/bin", "/usr/local/share/cuda-inspect/bin"):
        if not tool and os.access(os.path.join(d, "cuobjdump"), os.X_OK):
            tool = os.path.join(d, "cuobjdump")
    return tool


def base_name(mangled):
    """The kernel's own name from its mangled one (_Z14rope_x8_kernelP... -> rope_x8_kernel)."""
    m = re.match(r"_Z(?:N\w*?)?(\d+)(\w+)", mangled)
    if not m:
        return mangled
    n = int(m.group(1))
    return m.group(2)[:n]


def dump(tool, path):
    """cuobjdump --dump-sass's text for path, or (None, why)."""
    env = dict(os.environ)
    env["PATH"] = os.path.dirname(tool) + os.pathsep + env.get("PATH", "")
    r = subprocess.run([tool, "--dump-sass", path], capture_output=True, text=True, env=env, timeout=600)
    if r.returncode:
        return None, r.stderr.strip().splitlines()[-1] if r.stderr.strip() else f"exit {r.returncode}"
    return r.stdout, None


def parse(text):
    """{arch: {mangled kernel name: [SASS lines]}} of the machine code (not the PTX) in a dump."""
    archs, cur, section, funcs = {}, None, None, None
    for line in text.splitlines():
        if line.startswith("Fatbin "):
            section, funcs, cur = line.split()[1], None, None
            continue
        m = re.match(r"\s*arch = (\w+)", line)
        if m:
            funcs = archs.setdefault(m.group(1), {}) if section == "elf" else None
            continue
        m = re.search(r"Function : (\S+)", line)
        if m:
            cur = funcs.setdefault(m.group(1), []) if funcs is not None else None
        elif cur is not None and "/*" in line:
            cur.append(line)
    return archs


def count(lines, pattern):
    rx = re.compile(pattern)
    return sum(1 for l in lines if rx.search(l))


def main(argv):
    if len(argv) == 2 and argv[0] == "--from-dump":
        text = open(argv[1], errors="replace").read()
        path = argv[1]
    elif len(argv) == 1:
        path, tool = argv[0], cuobjdump()
        if not tool:
            print("check_sass: cuobjdump not found (scripts/install-deps.sh unpacks it where nvcc exists)")
            return 2
        text, why = dump(tool, path)
        if text is None:
            print(f"check_sass: cuobjdump --dump-sass {path} failed: {why}")
            return 2
    else:
        print("usage: check_sass.py OBJECT_OR_BINARY | --from-dump SASS.txt", file=sys.stderr)
        return 2
    archs = parse(text)
    have = [a for a in ARCHS if archs.get(a)]
    print(f"check_sass: {os.path.basename(path)}: machine code for {', '.join(sorted(archs)) or 'nothing'}")
    if not archs:
        return 2
    failed = 0
    for a in ARCHS:
        if a not in have:
            print(f"check_sass: no {a} machine code: the build must pass -gencode for {a}")
            failed = 1
    arch = have[0] if have else sorted(archs)[0]
    funcs = archs[arch]
    wide, tensor, local_users = [], [], []
    for mangled, lines in sorted(funcs.items(), key=lambda kv: base_name(kv[0])):
        name = base_name(mangled)
        ld128, st128 = count(lines, r"\bLDG\.E\.128\b"), count(lines, r"\bSTG\.E\.128\b")
        local = count(lines, r"\b(LDL|STL)(\.|\s)")
        mma = count(lines, r"\b(HMMA|HGMMA|IMMA|WGMMA)\b")
        if name.endswith("_x8_kernel"):
            wide.append(f"{name} {ld128}/{st128}")
            if not ld128 or not st128:
                print(f"check_sass: {name}: {ld128} 16-byte loads and {st128} 16-byte stores: an 8-wide kernel "
                      f"must move its bf16 data 16 bytes at a time")
                failed = 1
        if local:
            local_users.append(name)
            if name not in LOCAL_OK:
                print(f"check_sass: {name}: {local} local-memory instructions (LDL/STL): a spill or a stack array")
                failed = 1
        if mma:
            tensor.append(f"{name} ({mma})")
    print(f"check_sass: {len(funcs)} kernels for {arch}; 16-byte loads/stores in the 8-wide kernels: "
          f"{', '.join(wide) or 'none found'}")
    print(f"check_sass: local memory in: {', '.join(sorted(set(local_users))) or 'no kernel'} "
          f"(allowed: {', '.join(f'{k}: {v}' for k, v in LOCAL_OK.items())})")
    print(f"check_sass: tensor-core instructions in our kernels: {', '.join(tensor) or 'none'} (expected none: "
          f"matrix products run in cuBLASLt, attention in cuDNN)")
    return failed


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
