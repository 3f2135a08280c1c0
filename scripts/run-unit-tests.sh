#!/usr/bin/env bash
# Runs each C unit test binary in its own process and prints one closing line:
# "unit: N passed, N failed". Exits non-zero if any binary failed.
set -u
# The comm layer writes a flight-recorder dump on each timeout the tests provoke: into a folder of
# this run, removed at the end, not the machine's /tmp/meshrun-dumps-UID.
MESHRUN_DUMP_DIR=$(mktemp -d /tmp/unit-dumps.XXXXXX)
export MESHRUN_DUMP_DIR
trap 'rm -rf "$MESHRUN_DUMP_DIR"' EXIT
pass=0; fail=0; failed=()
for t in "$@"; do
  if "$t"; then pass=$((pass+1)); else fail=$((fail+1)); failed+=("$(basename "$t")"); fi
done
[ $fail -eq 0 ] || echo "failed unit tests: ${failed[*]}"
echo "unit: $pass passed, $fail failed"
[ $fail -eq 0 ]
