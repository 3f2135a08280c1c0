#!/usr/bin/env bash
# Launcher benchmarks (start/exit, failover, 64 nodes), meshrun beside torchrun when present.
# See bench/bench_launcher.py for what is measured. Arguments pass through (--reps N, --no-torchrun).
exec /usr/bin/python3 "$(dirname "$0")/bench_launcher.py" "$@"
