"""test_gpu_build_checks: the checks the cuda build runs on its kernels, on texts of their tools'
output, so that they run (and can fail) on a machine without nvcc.

check_ptxas reads `nvcc -Xptxas -v`'s report: it prints one row per kernel and fails on a kernel
that spills to local memory, for any architecture. check_sass reads `cuobjdump --dump-sass`: it
fails when sm_90a or sm_90 machine code is missing, when an 8-wide kernel lacks its 16-byte loads
or stores, or when a kernel other than the allowed one touches local memory.
"""
import os
import subprocess

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PTXAS = os.path.join(REPO, "test", "tools", "check_ptxas.py")
SASS = os.path.join(REPO, "test", "tools", "check_sass.py")


def run(tool, *args):
    return subprocess.run(["/usr/bin/python3", tool, *args], capture_output=True, text=True, timeout=60)


def ptxas_entry(name, arch, regs, spill=0):
    return (f"ptxas info    : Compiling entry function '{name}' for '{arch}'\n"
            f"ptxas info    : Function properties for {name}\n"
            f"    0 bytes stack frame, {spill} bytes spill stores, {spill} bytes spill loads\n"
            f"ptxas info    : Used {regs} registers, used 1 barriers, 128 bytes smem\n")


SWIGLU = "_Z20swiglu_fwd_x8_kernelP5uint4PKS_S2_m"
SCALE = "_Z12scale_kernelPffm"


def test_ptxas_table_and_spills(tmp_path):
    log = tmp_path / "k.ptxas"
    log.write_text("warning: something the compiler said\n" + ptxas_entry(SWIGLU, "sm_90a", 29)
                   + ptxas_entry(SCALE, "sm_90a", 12) + ptxas_entry(SWIGLU, "sm_90", 30) + ptxas_entry(SCALE, "sm_90", 12))
    r = run(PTXAS, str(log))
    print(r.stdout, r.stderr)
    assert r.returncode == 0, r.stdout
    assert "2 kernels for sm_90a (also built: sm_90)" in r.stdout
    assert any(l.split()[:2] == ["swiglu_fwd_x8_kernel", "29"] for l in r.stdout.splitlines()), r.stdout
    assert "warning: something the compiler said" in r.stderr  # passed through

    log.write_text(ptxas_entry(SWIGLU, "sm_90a", 29) + ptxas_entry(SWIGLU, "sm_90", 255, spill=64))
    r = run(PTXAS, str(log))
    print(r.stdout)
    assert r.returncode == 1
    assert "check_ptxas: swiglu_fwd_x8_kernel (sm_90) spills 64 bytes" in r.stdout

    log.write_text("nothing from ptxas\n")
    assert run(PTXAS, str(log)).returncode == 2


def sass(sections):
    """A cuobjdump --dump-sass text: sections is [(arch, {mangled: [instructions]})]."""
    out = []
    for arch, funcs in sections:
        out += ["", "Fatbin elf code:", "================", f"arch = {arch}", "code version = [1,8]", "",
                f"\tcode for {arch}"]
        for name, ins in funcs.items():
            out.append(f"\t\tFunction : {name}")
            out += [f"        /*{i * 16:04x}*/                   {x} ;  /* 0x000 */" for i, x in enumerate(ins)]
    out += ["", "Fatbin ptx code:", "================", "arch = sm_90"]
    return "\n".join(out) + "\n"


GOOD = {SWIGLU: ["LDG.E.128 R4, desc[UR4][R2.64]", "STG.E.128 desc[UR4][R6.64], R8", "EXIT"],
        SCALE: ["LDG.E R2, desc[UR4][R2.64]", "STG.E desc[UR4][R4.64], R2", "EXIT"]}


def check_dump(tmp_path, sections):
    f = tmp_path / "dump.txt"
    f.write_text(sass(sections))
    r = run(SASS, "--from-dump", str(f))
    print(r.stdout)
    return r


def test_sass_passes_good_code(tmp_path):
    r = check_dump(tmp_path, [("sm_90a", GOOD), ("sm_90", GOOD)])
    assert r.returncode == 0, r.stdout
    assert "swiglu_fwd_x8_kernel 1/1" in r.stdout
    assert "tensor-core instructions in our kernels: none" in r.stdout


def test_sass_fails_without_wide_stores(tmp_path):
    narrow = dict(GOOD, **{SWIGLU: ["LDG.E.128 R4, desc[UR4][R2.64]", "STG.E desc[UR4][R6.64], R8"]})
    r = check_dump(tmp_path, [("sm_90a", narrow), ("sm_90", GOOD)])
    assert r.returncode == 1
    assert "swiglu_fwd_x8_kernel: 1 16-byte loads and 0 16-byte stores" in r.stdout


def test_sass_fails_on_local_memory(tmp_path):
    spilled = dict(GOOD, **{SCALE: ["STL [R1], R2", "LDL R2, [R1]", "EXIT"]})
    r = check_dump(tmp_path, [("sm_90a", spilled), ("sm_90", GOOD)])
    assert r.returncode == 1
    assert "scale_kernel: 2 local-memory instructions" in r.stdout


def test_sass_fails_without_sm_90a(tmp_path):
    r = check_dump(tmp_path, [("sm_90", GOOD)])
    assert r.returncode == 1
    assert "no sm_90a machine code" in r.stdout
