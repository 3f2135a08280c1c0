#!/usr/bin/env bash
# test-kit: proves on this machine that a kit made by scripts/make-kit.sh runs without the
# system's copies of the libraries it carries. In a private mount namespace (unshare, as root)
# every system copy of those libraries is covered by /dev/null, so the loader fails on any that
# the kit does not supply. Then:
#   1. negative control: the trainer without the kit's env.sh must fail to load;
#   2. with env.sh: ldd resolves every carried library inside the kit;
#   3. every C unit test of the kit passes (cpu; they exercise libuv, cJSON, OpenBLAS, cmocka,
#      Nettle, OpenMP);
#   4. a two-step training smoke test on the cpu backend, alone and as fsdp2 under the kit's meshrun.
#
#   scripts/test-kit.sh [KIT] [LOGDIR]    # default build/kit; logs to LOGDIR (default: a temp dir)
# Closing line: "test-kit: N passed, N failed".
set -u
root=$(cd "$(dirname "$0")/.." && pwd)
kit=${1:-$root/build/kit}
logs=${2:-$(mktemp -d /tmp/test-kit.XXXXXX)}
case "$kit" in /*) ;; *) kit=$PWD/$kit ;; esac
mkdir -p "$logs"
[ -x "$kit/bin/trainer" ] || { echo "test-kit: no kit at $kit (run scripts/make-kit.sh first)"; echo "test-kit: 0 passed, 1 failed"; exit 1; }

if [ "${MESHRUN_KIT_HIDDEN:-}" != 1 ]; then
  [ "$(id -u)" -eq 0 ] || { echo "test-kit: needs root (a private mount namespace)"; echo "test-kit: 0 passed, 1 failed"; exit 1; }
  exec unshare --mount --propagation private env MESHRUN_KIT_HIDDEN=1 bash "$0" "$kit" "$logs"
fi

# --- inside the namespace: cover the system's copies of every carried library.
hidden=0
for l in "$kit"/lib/*; do
  so=$(basename "$l")
  for p in $(ldconfig -p | awk -v s="$so" '$1 == s {print $NF}'); do
    r=$(readlink -f "$p")
    for f in "$p" "$r"; do
      [ -e "$f" ] && mount --bind /dev/null "$f" && hidden=$((hidden+1))
    done
  done
done
echo "test-kit: covered $hidden system library files with /dev/null" | tee "$logs/hidden.log"

pass=0; fail=0
ok()  { echo "   PASS: $1"; pass=$((pass+1)); }
bad() { echo "   FAIL: $1"; fail=$((fail+1)); }

# 1. negative control
if "$kit/bin/trainer" --version >"$logs/control.log" 2>&1; then
  bad "the trainer loads without the kit: the system's libraries were not hidden"
else
  ok "without env.sh the trainer fails to load ($(head -c 120 "$logs/control.log" | tr '\n' ' '))"
fi

# shellcheck disable=SC1091
. "$kit/env.sh" 2>"$logs/env.log"

# 2. every carried library resolves inside the kit
ldd "$kit/bin/trainer" "$kit/bin/meshrun" >"$logs/ldd.log" 2>&1
if grep -q 'not found' "$logs/ldd.log"; then
  bad "ldd: $(grep 'not found' "$logs/ldd.log" | head -3 | tr '\n' ' ')"
else
  outside=$(for l in "$kit"/lib/*; do grep -F "$(basename "$l") =>" "$logs/ldd.log"; done | grep -v -F "$kit/lib/" || true)
  if [ -n "$outside" ]; then bad "carried libraries resolved outside the kit: $outside"; else ok "ldd: every carried library from $kit/lib"; fi
fi

# 3. the unit tests
for t in "$kit"/test/test_*; do
  n=$(basename "$t")
  if (cd "$root" && timeout 300 "$t") >"$logs/$n.log" 2>&1; then ok "$n"; else bad "$n (log: $logs/$n.log)"; fi
done

# 4. training smoke tests, cpu
smoke="--set train.steps=2 --set log.interval=1 --set eval.interval=0 --set sample.tokens=0 --set checkpoint.dir=$logs/ckpt"
if (cd "$root" && timeout 120 "$kit/bin/trainer" configs/tiny.json $smoke) >"$logs/smoke.log" 2>&1 && grep -q 'step 2/2' "$logs/smoke.log"; then
  ok "two-step training smoke test (cpu)"
else
  bad "two-step training smoke test (log: $logs/smoke.log)"
fi
if (cd "$root" && timeout 180 "$kit/bin/meshrun" --standalone --nproc_per_node=2 "$kit/bin/trainer" configs/tiny.json \
      $smoke --set mesh.dp_shard=2 --set checkpoint.dir="$logs/ckpt2") >"$logs/smoke-fsdp2.log" 2>&1 &&
   grep -q 'step 2/2' "$logs/smoke-fsdp2.log"; then
  ok "fsdp2 under the kit's meshrun (cpu)"
else
  bad "fsdp2 under the kit's meshrun (log: $logs/smoke-fsdp2.log)"
fi

echo "test-kit: logs in $logs"
echo "test-kit: $pass passed, $fail failed"
[ "$fail" -eq 0 ]
