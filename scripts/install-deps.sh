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
  etcd-server       # etcd for the etcd rendezvous tests (test_etcd)
  clang libclang-rt-dev  # libFuzzer for the fuzz targets (make fuzz; short runs in make test)
  python3-pytest    # integration tests (real processes on loopback)
  python3-numpy python3-torch  # numerical oracle
  python3-matplotlib           # scripts/plot_metrics.py
  procps iproute2
)

missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi
echo "install-deps: installing ${missing[*]}" >&2
sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq
$sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
