#!/usr/bin/env bash
# Installs the Debian packages that building, testing and the demo need.
# A no-op (no apt-get at all) when every package is already present.
# The CUDA toolkit is not installed here: the cuda backend builds only where nvcc exists.
set -euo pipefail

pkgs=(
  build-essential pkg-config
  libuv1-dev        # launcher event loop, store server
  libcjson-dev      # plan parsing
  libopenblas-dev   # cpu backend GEMMs
  libcmocka-dev     # C unit tests
  nettle-dev        # Nettle (static): HMAC-SHA256 for the store's job secret, base64 for etcd
  libpcre2-dev      # the tokenizer's pre-tokenizer regexes (\p{L}, \p{N}, lookahead) as HF's use them
  libprotobuf-c-dev protobuf-c-compiler  # TensorBoard's event records (protoc-c compiles our .proto at build time)
  python3-pip       # PyPI's tokenizers, transformers and tensorboard for /usr/bin/python3 (below)
  etcd-server       # etcd for the etcd rendezvous tests (test_etcd)
  clang libclang-rt-dev  # libFuzzer for the fuzz targets (make fuzz; short runs in make test)
  python3-pytest    # integration tests (real processes on loopback)
  python3-numpy python3-torch  # numerical oracle
  python3-matplotlib           # tools/plot_metrics.py
  procps iproute2
)

missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "install-deps: installing ${missing[*]}" >&2
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  export DEBIAN_FRONTEND=noninteractive
  $sudo apt-get update -qq
  $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# PyPI packages for Debian's python3, which the tests run under (Debian has neither; pip installs
# them system-wide: CI machines are throwaway, and --break-system-packages is pip's word for that
# on Debian 12):
# - tokenizers (Hugging Face's own BPE): tools/prepare_data.py trains and applies tokenizers
#   with it, and test_tokenizer checks the C tokenizer's ids against it;
# - transformers: test_hf_transformers loads `trainer export --format hf` folders with it
#   (weights, tokenizer, generate). Pinned to 4.49.0, the newest that runs on Debian 12's torch
#   1.13: 4.50 and later import torch.distributed.tensor (torch 2), 4.52 and later disable torch
#   below 2.1. It does not depend on torch, so pip leaves python3-torch and python3-numpy alone;
#   it takes tokenizers 0.21.x and huggingface_hub below 1.0 (test_tokenizer agrees with 0.21);
# - tensorboard: test_tensorboard reads log.tensorboard_dir's event files with TensorBoard's own
#   reader (no TensorFlow needed). It asks numpy >= 1.12 only, so Debian's python3-numpy stays;
#   it brings PyPI's protobuf, grpcio, werkzeug and their like, none of which torch imports.
# One pip call, so that pip picks the tokenizers that transformers accepts.
if ! /usr/bin/python3 -c "import tokenizers, transformers, tensorboard" 2>/dev/null; then
  echo "install-deps: installing PyPI tokenizers, transformers 4.49.0 and tensorboard for /usr/bin/python3" >&2
  pip_sudo=""
  [ "$(id -u)" -eq 0 ] || pip_sudo="sudo"
  $pip_sudo /usr/bin/python3 -m pip install -q --break-system-packages tokenizers "transformers==4.49.0" tensorboard
fi

# cudnn-frontend (NVIDIA's header-only C++ API over cuDNN's graph API), for the cuda backend's
# cuDNN flash attention (trainer/backend/attention_cudnn.cpp): only where nvcc builds the cuda
# backend. Its PyPI wheel carries the headers; they are unpacked to the folder the Makefile reads
# (CUDNN_FE_INC). cuDNN itself (cudnn.h) comes with the CUDA toolkit here, and libcudnn.so.9 is
# opened at run time on the GPU machine, so nothing else is installed.
cudnn_fe=/usr/local/share/cudnn-frontend
cudnn_fe_version=1.32.0
if { command -v nvcc >/dev/null 2>&1 || [ -x /usr/local/cuda/bin/nvcc ]; } &&
   ! grep -qs "$cudnn_fe_version" "$cudnn_fe/VERSION"; then
  echo "install-deps: unpacking cudnn-frontend $cudnn_fe_version's headers to $cudnn_fe" >&2
  fe_tmp=$(mktemp -d)
  /usr/bin/python3 -m pip download -q --no-deps --only-binary=:all: -d "$fe_tmp" \
    "nvidia-cudnn-frontend==$cudnn_fe_version"
  fe_sudo=""
  [ "$(id -u)" -eq 0 ] || fe_sudo="sudo"
  $fe_sudo /usr/bin/python3 - "$fe_tmp" "$cudnn_fe" "$cudnn_fe_version" <<'PY'
import glob, os, sys, zipfile
tmp, dest, version = sys.argv[1:]
wheel = glob.glob(os.path.join(tmp, "*.whl"))[0]
with zipfile.ZipFile(wheel) as z:
    z.extractall(dest, [n for n in z.namelist() if n.startswith("include/")])
with open(os.path.join(dest, "VERSION"), "w") as f:
    f.write(version + "\n")
PY
  rm -rf "$fe_tmp"
fi

# cuobjdump and nvdisasm (NVIDIA's PyPI wheels), for test/tools/check_sass.py, which reads the
# built kernels' machine code (16-byte accesses, local memory, tensor-core instructions): only
# where nvcc builds the cuda backend and the toolkit lacks them. Unpacked to the folder the
# Makefile looks in (CUOBJDUMP).
cuda_inspect=/usr/local/share/cuda-inspect
cuda_inspect_version=13.5.37
if { command -v nvcc >/dev/null 2>&1 || [ -x /usr/local/cuda/bin/nvcc ]; } &&
   ! command -v cuobjdump >/dev/null 2>&1 && [ ! -x /usr/local/cuda/bin/cuobjdump ] &&
   ! grep -qs "$cuda_inspect_version" "$cuda_inspect/VERSION"; then
  echo "install-deps: unpacking cuobjdump and nvdisasm $cuda_inspect_version to $cuda_inspect/bin" >&2
  ci_tmp=$(mktemp -d)
  /usr/bin/python3 -m pip download -q --no-deps --only-binary=:all: -d "$ci_tmp" \
    "nvidia-cuda-cuobjdump==$cuda_inspect_version" "nvidia-cuda-nvdisasm==$cuda_inspect_version"
  ci_sudo=""
  [ "$(id -u)" -eq 0 ] || ci_sudo="sudo"
  $ci_sudo /usr/bin/python3 - "$ci_tmp" "$cuda_inspect" "$cuda_inspect_version" <<'PY'
import glob, os, sys, zipfile
tmp, dest, version = sys.argv[1:]
os.makedirs(os.path.join(dest, "bin"), exist_ok=True)
for wheel in glob.glob(os.path.join(tmp, "*.whl")):
    with zipfile.ZipFile(wheel) as z:
        for n in z.namelist():
            if n.endswith(("/bin/cuobjdump", "/bin/nvdisasm")):
                out = os.path.join(dest, "bin", os.path.basename(n))
                with z.open(n) as src, open(out, "wb") as dst:
                    dst.write(src.read())
                os.chmod(out, 0o755)
with open(os.path.join(dest, "VERSION"), "w") as f:
    f.write(version + "\n")
PY
  rm -rf "$ci_tmp"
fi
