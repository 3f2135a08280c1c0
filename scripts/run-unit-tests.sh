#!/usr/bin/env bash
# Runs each C unit test binary in its own process and prints one closing line:
# "unit: N passed, N failed". Exits non-zero if any binary failed.
set -u
pass=0; fail=0; failed=()
for t in "$@"; do
  if "$t"; then pass=$((pass+1)); else fail=$((fail+1)); failed+=("$(basename "$t")"); fi
done
[ $fail -eq 0 ] || echo "failed unit tests: ${failed[*]}"
echo "unit: $pass passed, $fail failed"
[ $fail -eq 0 ]
