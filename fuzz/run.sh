#!/usr/bin/env bash
# run.sh: runs libFuzzer targets for a bounded time and prints one table row per target.
#
#   fuzz/run.sh MODE SECONDS FUZZ_DIR TARGET...
#
# MODE ci:   each target starts from an empty scratch corpus ($FUZZ_DIR/ci/<t>, emptied first)
#            and reads the repo corpus fuzz/corpus/<t> second, so new inputs never land in the
#            repo; the committed reproducers fuzz/crashes/<t>-* are run first as plain inputs.
# MODE long: the scratch corpus $FUZZ_DIR/corpus/<t> is kept between runs (it grows).
# fuzz/<t>.dict, when present, is the target's libFuzzer dictionary.
# Crash inputs go to $FUZZ_DIR/artifacts/<t>/, each run's output to $FUZZ_DIR/logs/<t>.log.
# FUZZ_JOBS targets run at once (default 2). Exit status 1 when any target crashed.
set -u
mode=$1 seconds=$2 dir=$3
shift 3
jobs=${FUZZ_JOBS:-2}
mkdir -p "$dir/logs"

run_one() {
  local t=$1 bin="$dir/fuzz_$1" log="$dir/logs/$1.log" work art maxlen dict= rc=0
  art="$dir/artifacts/$t"
  maxlen=$(sed -n '2s|^// max_len: *||p' "fuzz/fuzz_$t.c")
  [ -f "fuzz/$t.dict" ] && dict="fuzz/$t.dict"
  if [ "$mode" = ci ]; then
    work="$dir/ci/$t"
    rm -rf "$work"
  else
    work="$dir/corpus/$t"
  fi
  mkdir -p "$work" "$art"
  : >"$log"
  touch "$dir/logs/$t.start" # crash inputs of this run are the artifacts newer than this
  local repro=(fuzz/crashes/"$t"-*)
  if [ -e "${repro[0]}" ]; then
    echo "== regression inputs: ${repro[*]}" >>"$log"
    "$bin" -rss_limit_mb=2048 -timeout=10 -artifact_prefix="$art/" "${repro[@]}" >>"$log" 2>&1 || rc=1
  fi
  if [ $rc = 0 ]; then
    echo "== fuzzing for ${seconds}s" >>"$log"
    "$bin" -max_total_time="$seconds" -print_final_stats=1 -rss_limit_mb=2048 -timeout=10 \
      ${maxlen:+-max_len=$maxlen} ${dict:+-dict=$dict} -artifact_prefix="$art/" "$work" "fuzz/corpus/$t" >>"$log" 2>&1 || rc=1
  fi
  echo "$rc" >"$dir/logs/$t.rc"
}

declare -A start
for t in "$@"; do
  while [ "$(jobs -rp | wc -l)" -ge "$jobs" ]; do wait -n; done
  start[$t]=$(date +%s.%N)
  (run_one "$t"; date +%s.%N >"$dir/logs/$t.end") &
done
wait

status=0
printf '%-12s %8s %12s %10s %8s %8s\n' target seconds execs 'exec/s' new crashes
for t in "$@"; do
  log="$dir/logs/$t.log"
  secs=$(awk -v a="${start[$t]}" -v b="$(cat "$dir/logs/$t.end")" 'BEGIN { printf "%.1f", b - a }')
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
  rate=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log" | tail -1)
  new=$(sed -n 's/^stat::new_units_added: *//p' "$log" | tail -1)
  if [ -z "$execs" ]; then # crashed: no final stats; take the last "#N" progress line
    execs=$(grep -o '^#[0-9]*' "$log" | tail -1 | tr -d '#')
  fi
  crashes=$(find "$dir/artifacts/$t" -type f -newer "$dir/logs/$t.start" | wc -l)
  rc=$(cat "$dir/logs/$t.rc")
  [ "$rc" != 0 ] && [ "$crashes" = 0 ] && crashes=1 # a committed reproducer that still fails
  printf '%-12s %8s %12s %10s %8s %8s\n' "$t" "$secs" "${execs:--}" "${rate:--}" "${new:--}" "$crashes"
  [ "$rc" != 0 ] && status=1
done
for t in "$@"; do
  if [ "$(cat "$dir/logs/$t.rc")" != 0 ]; then
    echo "---- fuzz_$t failed; end of $dir/logs/$t.log:"
    grep -v '^#[0-9]' "$dir/logs/$t.log" | tail -40
    find "$dir/artifacts/$t" -type f -newer "$dir/logs/$t.start" | sed 's|^|  crash input: |'
  fi
done
exit $status
