"""test_backend_names: the shared files name no backend (test/tools/check_backend_names.py, run by
`make test`).

The repository passes it: outside a backend's own files and the registries, no code or string
names cuda, nccl or their libraries. A tree where a shared file does (an #ifdef on CUDA, a
backend's function, a message naming nccl) fails it, each line printed with its file and number,
while the same words in the backend's own files, in the registries and in comments pass.
"""
import os
import subprocess

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHECK = os.path.join(REPO, "test", "tools", "check_backend_names.py")

REGISTRY = "#define BACKENDS(X) \\\n  X(cpu)            \\\n  X(cuda)\n"


def check(root):
    return subprocess.run(["/usr/bin/python3", CHECK, str(root)], capture_output=True, text=True, timeout=60)


def write(root, files):
    for path, text in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text)


def test_the_repository_names_no_backend_in_shared_files():
    r = check(REPO)
    print(r.stdout.strip())
    assert r.returncode == 0 and "no shared file names a backend" in r.stdout, r.stdout
    assert "registered: cpu, cuda, nccl, staged" in r.stdout, r.stdout


def test_a_shared_file_naming_a_backend_fails(tmp_path):
    write(tmp_path, {
        "trainer/backend/registry.c": REGISTRY + "const void *r[] = {&backend_entry_cuda};\n",
        "trainer/backend/backend_cuda.cu": "#include <cuda_runtime.h>\nint n = cudaGetDeviceCount(0);\n",
        "trainer/backend/backend_cuda_absent.c": 'const char *why = "built without nvcc";\n',
        "trainer/comm/comm_nccl.c": "#include <nccl.h>\n",
        "common/gpus_cuda.c": 'const char *env = "CUDA_VISIBLE_DEVICES";\n',
        "trainer/run/ok.c": "/* on cuda, nccl; the NVIDIA driver */\nint x = 1; // cuda\n"
                            'const char *s = "a /* not a comment: nccl */";\n',
        "trainer/run/device.c": "/* fine: cuda */\nint a;\n#ifdef MESHRUN_HAVE_CUDA\n"
                                "int b = backend_cuda_create(0);\n#endif\n"
                                'const char *m = "needs NCCL" /* cuda */;\n',
        "launcher/cli.c": "static int c = '\"'; /* cuda */ int d = is_nvidia_minor(\"x\");\n",
    })
    r = check(tmp_path)
    print(r.stdout)
    assert r.returncode == 1, r.stdout
    assert r.stdout.splitlines()[:-1] == [
        "check_backend_names: launcher/cli.c:1: nvidia: static int c = '\"'; /* cuda */ int d = is_nvidia_minor(\"x\");",
        "check_backend_names: trainer/run/device.c:3: cuda: #ifdef MESHRUN_HAVE_CUDA",
        "check_backend_names: trainer/run/device.c:4: cuda: int b = backend_cuda_create(0);",
        "check_backend_names: trainer/run/device.c:6: nccl: const char *m = \"needs NCCL\" /* cuda */;",
        "check_backend_names: trainer/run/ok.c:3: nccl: const char *s = \"a /* not a comment: nccl */\";",
    ], r.stdout
    assert r.stdout.splitlines()[-1] == ("check_backend_names: 5 lines in 3 shared files name a backend (cublas, "
                                         "cuda, cudnn, nccl, nvcc, nvidia): launcher/cli.c trainer/run/device.c "
                                         "trainer/run/ok.c")
