#!/usr/bin/env bash
# make-kit: everything the GPU machine needs to run meshrun's GPU tests and benchmark, in one
# folder to carry there (that machine has CUDA, cuBLAS and PyTorch with NCCL in its wheels, but
# no network and no libuv, cJSON, OpenBLAS, cmocka or Nettle headers).
#
#   scripts/make-kit.sh [KIT]        # default KIT = build/kit (ignored by git), under 60 MiB
#
# The kit holds binaries built here (nvcc and NCCL exist here; the CUDA major version is the
# GPU machine's, 13) and the shared libraries they need that a bare machine lacks, beside them:
#
#   KIT/bin/          meshrun, trainer (debug info stripped)
#   KIT/test-gpu/     the GPU test binaries (test/gpu/*.c)
#   KIT/test/         the C unit tests that link no CUDA library (a check that the kit's
#                     libraries load there)
#   KIT/lib/          libcjson, libopenblas (+ libgfortran, libquadmath), libcmocka,
#                     libgomp: whatever ldd resolves outside glibc and CUDA (libuv and Nettle are linked statically)
#   KIT/env.sh        source it: sets LD_LIBRARY_PATH to KIT/lib, then the CUDA libraries and
#                     NCCL (a system libnccl, or the one in PyTorch's nvidia/nccl wheel), and
#                     MESHRUN_BIN / MESHRUN_KIT; prints what it found
#   KIT/MANIFEST      every file with its size, and where each library came from
#
# CUDA's own libraries (cudart, cublas, cublasLt) are not carried: they are the GPU machine's
# (same major version), and NCCL is found there by env.sh. The kit is proven to work without
# the system's copies by scripts/test-kit.sh.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
kit=${1:-$root/build/kit}
case "$kit" in /*) ;; *) kit=$PWD/$kit ;; esac
obj=$root/build/kit-obj
cd "$root"

command -v nvcc >/dev/null 2>&1 || { echo "make-kit: nvcc not found: the kit carries the cuda backend, build it where nvcc exists" >&2; exit 1; }

jobs=$(nproc 2>/dev/null || echo 2)
make -j"$jobs" --no-print-directory BUILD="$obj" BIN="$obj/bin" all >&2

rm -rf "$kit"
mkdir -p "$kit/bin" "$kit/test-gpu" "$kit/test" "$kit/lib"
install -m 755 "$obj/bin/meshrun" "$obj/bin/trainer" "$kit/bin/"
for t in "$obj"/test-gpu/test_*; do [ -x "$t" ] && install -m 755 "$t" "$kit/test-gpu/"; done
# The cpu unit tests that need no CUDA library: enough to show the carried libraries load there.
# Those that link the cuda backend (about 1.7 MB of kernels each, 17 MB in all) stay behind; they
# run here in make test, and test-gpu checks the same kernels on the GPU.
# (ldd's whole output first: `ldd | grep -q` under pipefail fails when grep's early exit cuts
# ldd off, and a CUDA-linked test was once carried that way.)
for t in "$obj"/test/test_*; do
  [ -x "$t" ] || continue
  libs=$(ldd "$t")
  case "$libs" in *libcudart*|*libcublas*) ;; *) install -m 755 "$t" "$kit/test/" ;; esac
done
[ -n "$(ls "$kit/test-gpu")" ] || { echo "make-kit: no GPU test binaries were built" >&2; exit 1; }
strip --strip-debug "$kit"/bin/* "$kit"/test-gpu/* "$kit"/test/*

# Libraries: what ldd resolves for every binary, less glibc's own (always there, and must match
# the machine's loader) and CUDA's (the GPU machine's toolkit). Symlinks are resolved: the kit
# holds each library under its soname, as the loader asks for it.
: >"$kit/MANIFEST.libs"
for b in "$kit"/bin/* "$kit"/test-gpu/* "$kit"/test/*; do
  ldd "$b" | awk '$2 == "=>" && $3 ~ /^\// {print $1, $3}'
done | sort -u | while read -r soname path; do
  case "$soname" in
    libc.so.*|libm.so.*|libpthread.so.*|libdl.so.*|librt.so.*|ld-linux*|libgcc_s.so.*|libstdc++.so.*) continue ;;
    libcuda.so.*|libcudart.so.*|libcublas.so.*|libcublasLt.so.*|libnccl.so.*|libnvidia*) continue ;;
  esac
  cp -L "$path" "$kit/lib/$soname"
  echo "$soname <- $(readlink -f "$path")" >>"$kit/MANIFEST.libs"
done
# OpenBLAS built with gfortran needs these two, which ldd lists only through libopenblas itself.
for l in libgfortran.so.5 libquadmath.so.0; do
  if [ ! -e "$kit/lib/$l" ]; then
    p=$(ldconfig -p | awk -v l="$l" '$1 == l && $NF ~ /^\// {print $NF; exit}')
    [ -n "$p" ] && cp -L "$p" "$kit/lib/$l" && echo "$l <- $(readlink -f "$p")" >>"$kit/MANIFEST.libs"
  fi
done

cat >"$kit/env.sh" <<'EOF'
# Source me: . KIT/env.sh   (sets the library path for the kit's binaries; prints what it found)
# CUDA's libraries (cudart, cublas, cublasLt: the soname the binaries ask for, .so.13) and NCCL
# are the machine's own. Each one the loader does not already know is looked for beside nvcc,
# under /usr/local/cuda, and in the Python wheels of site-packages/nvidia (CUDA 13 wheels put
# cuBLAS and cudart in nvidia/cu13/lib, CUDA 12 ones in nvidia/cublas/lib; NCCL in
# nvidia/nccl/lib); the first folder holding it joins LD_LIBRARY_PATH.
MESHRUN_KIT=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
export MESHRUN_KIT MESHRUN_BIN=$MESHRUN_KIT/bin
export LD_LIBRARY_PATH=$MESHRUN_KIT/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
_dirs=()
_nvcc=$(command -v nvcc 2>/dev/null || true)
[ -n "$_nvcc" ] && _dirs+=("$(dirname "$_nvcc")/../lib64" "$(dirname "$_nvcc")/../lib")
_dirs+=(/usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib)
for _sp in $(python3 -c 'import site; print(" ".join(site.getsitepackages()))' 2>/dev/null); do
  for _d in "$_sp"/nvidia/cu13/lib "$_sp"/nvidia/*/lib; do [ -d "$_d" ] && _dirs+=("$_d"); done
done
for _so in $(ldd "$MESHRUN_BIN/trainer" 2>/dev/null | awk '$2 == "=>" && $3 == "not" {print $1}'); do
  _hit=""
  for _d in "${_dirs[@]}"; do
    if [ -e "$_d/$_so" ]; then _hit=$(cd "$_d" && pwd); break; fi
  done
  if [ -n "$_hit" ]; then
    case ":$LD_LIBRARY_PATH:" in *":$_hit:"*) ;; *) LD_LIBRARY_PATH=$LD_LIBRARY_PATH:$_hit ;; esac
    echo "kit: $_so from $_hit" >&2
  fi
done
# cuDNN (libcudnn.so.9) is opened at run time, so ldd does not ask for it: where the loader's
# cache and LD_LIBRARY_PATH lack it, the same folders are searched (PyTorch's nvidia/cudnn/lib).
_hit=""
for _d in ${LD_LIBRARY_PATH//:/ }; do [ -e "$_d/libcudnn.so.9" ] && _hit=$_d && break; done
if [ -z "$_hit" ] && ! ldconfig -p 2>/dev/null | grep -q 'libcudnn\.so\.9 '; then
  for _d in "${_dirs[@]}"; do
    if [ -e "$_d/libcudnn.so.9" ]; then _hit=$(cd "$_d" && pwd); break; fi
  done
  if [ -n "$_hit" ]; then
    LD_LIBRARY_PATH=$LD_LIBRARY_PATH:$_hit
    echo "kit: libcudnn.so.9 (opened at run time) from $_hit" >&2
  else
    echo "kit: libcudnn.so.9 not found: attention runs the reference kernel (model.attention auto)" >&2
  fi
fi
export LD_LIBRARY_PATH
echo "kit: $MESHRUN_KIT; LD_LIBRARY_PATH=$LD_LIBRARY_PATH" >&2
_missing=$(ldd "$MESHRUN_BIN/trainer" 2>/dev/null | grep 'not found' || true)
[ -z "$_missing" ] || echo "kit: trainer is missing libraries (searched ${_dirs[*]}): $_missing" >&2
unset _dirs _nvcc _sp _d _so _hit _missing
EOF

{
  echo "meshrun kit, built $(date -u +%Y-%m-%dT%H:%M:%SZ) from $(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo '?')"
  echo "nvcc: $(nvcc --version | tail -1); cc: $(${CC:-cc} --version | head -1)"
  cat "$kit/MANIFEST.libs"
  (cd "$kit" && find . -type f ! -name MANIFEST ! -name MANIFEST.libs -printf '%s %p\n' | sort -k2)
} >"$kit/MANIFEST"
rm -f "$kit/MANIFEST.libs"
size=$(du -sm "$kit" | cut -f1)
echo "make-kit: $kit, ${size} MiB" >&2
if [ "$size" -ge 60 ]; then echo "make-kit: the kit is over 60 MiB" >&2; exit 1; fi
