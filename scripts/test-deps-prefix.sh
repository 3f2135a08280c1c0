#!/usr/bin/env bash
# test-deps-prefix: proves the other way to a GPU machine: building there from .debs unpacked into
# a prefix (make DEPS_PREFIX=DIR), with no -dev package installed. As root, in a private mount
# namespace, the system's headers and link-time libraries of libuv, cJSON, OpenBLAS, cmocka,
# Nettle, PCRE2 and protobuf-c, and protobuf-c's compiler protoc-c, are covered (empty directories,
# /dev/null files); the build must then take everything from the prefix (protoc-c runs from
# there with the prefix's libprotoc), and a few unit tests run against the prefix's libraries.
#
#   scripts/test-deps-prefix.sh [DEBDIR]   # default: download the .debs (apt-get download) into
#                                          # build/debs; unpacked into build/deps
# Closing line: "test-deps-prefix: N passed, N failed".
set -u
root=$(cd "$(dirname "$0")/.." && pwd)
debs=${1:-$root/build/debs}
prefix=$root/build/deps
pkgs=(libuv1-dev libuv1 libcjson-dev libcjson1 libopenblas-dev libopenblas0-pthread libopenblas-pthread-dev
      libopenblas0 libcmocka-dev libcmocka0 nettle-dev libnettle8
      libprotobuf-c-dev libprotobuf-c1 protobuf-c-compiler libprotoc32 libprotobuf32
      libpcre2-dev libpcre2-8-0)

if [ "${MESHRUN_DEPS_HIDDEN:-}" != 1 ]; then
  [ "$(id -u)" -eq 0 ] || { echo "test-deps-prefix: needs root (a private mount namespace)"; echo "test-deps-prefix: 0 passed, 1 failed"; exit 1; }
  if [ ! -d "$debs" ] || [ -z "$(ls "$debs"/*.deb 2>/dev/null)" ]; then
    mkdir -p "$debs" && (cd "$debs" && apt-get download "${pkgs[@]}" >/dev/null 2>&1) ||
      { echo "test-deps-prefix: apt-get download failed"; echo "test-deps-prefix: 0 passed, 1 failed"; exit 1; }
  fi
  rm -rf "$prefix" && mkdir -p "$prefix"
  for d in "$debs"/*.deb; do dpkg -x "$d" "$prefix"; done
  exec unshare --mount --propagation private env MESHRUN_DEPS_HIDDEN=1 bash "$0" "$debs"
fi

# --- inside the namespace: cover the system's copies.
empty=$(mktemp -d)
for d in /usr/include/uv /usr/include/cjson /usr/include/nettle /usr/include/protobuf-c \
         /usr/include/x86_64-linux-gnu/openblas-pthread /usr/lib/x86_64-linux-gnu/openblas-pthread; do
  [ -d "$d" ] && mount --bind "$empty" "$d"
done
for f in /usr/include/uv.h /usr/include/cmocka.h /usr/include/cblas.h /usr/include/x86_64-linux-gnu/cblas.h \
         /usr/include/pcre2.h /usr/lib/x86_64-linux-gnu/libpcre2-8.a \
         /usr/lib/x86_64-linux-gnu/{libuv,libcjson,libcmocka,libopenblas}.so \
         /usr/lib/x86_64-linux-gnu/{libuv_a,libnettle,libprotobuf-c}.a /usr/lib/x86_64-linux-gnu/libprotobuf-c.so \
         /usr/bin/protoc-c; do
  [ -e "$f" ] && mount --bind /dev/null "$(readlink -f "$f")"
done

pass=0; fail=0
# Negative control: without the prefix, the covered headers must be gone.
if printf '#include <uv.h>\n#include <cjson/cJSON.h>\n#include <cblas.h>\n#include <nettle/hmac.h>\n#include <protobuf-c/protobuf-c.h>\n#define PCRE2_CODE_UNIT_WIDTH 8\n#include <pcre2.h>\n' |
   cc -E -I/usr/include/x86_64-linux-gnu/openblas-pthread - >/dev/null 2>&1; then
  echo "   FAIL: the system's headers are still visible"; fail=$((fail+1))
else
  echo "   PASS: without DEPS_PREFIX the headers are not found"; pass=$((pass+1))
fi
out=$root/build/deps-prefix
rm -rf "$out"
if make -C "$root" -j"$(nproc)" --no-print-directory DEPS_PREFIX="$prefix" BUILD="$out" BIN="$out/bin" all \
     >"$out.log" 2>&1; then
  echo "   PASS: make DEPS_PREFIX=$prefix all"; pass=$((pass+1))
else
  echo "   FAIL: make DEPS_PREFIX (log: $out.log)"; tail -5 "$out.log"; fail=$((fail+1))
fi
export LD_LIBRARY_PATH=$prefix/usr/lib/x86_64-linux-gnu:$prefix/usr/lib/x86_64-linux-gnu/openblas-pthread
for t in test_env test_store test_plan test_backend_cpu test_tensorboard; do
  if [ -x "$out/test/$t" ] && (cd "$root" && "$out/test/$t") >"$out/$t.log" 2>&1; then
    echo "   PASS: $t"; pass=$((pass+1))
  else
    echo "   FAIL: $t (log: $out/$t.log)"; fail=$((fail+1))
  fi
done
echo "test-deps-prefix: $pass passed, $fail failed"
[ "$fail" -eq 0 ]
