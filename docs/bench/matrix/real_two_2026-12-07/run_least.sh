#!/usr/bin/env bash
# `run.sh`'s fleet and arrivals with Sluice's `least_loaded` policy (no prefix
# affinity: the fewest requests waiting on the engine plus in flight from the
# gateway), Sluice alone: what spreading every burst gives on this fleet,
# against `prefix_kv` and the peers of `run.sh`'s runs.
# Usage: run_least.sh SEEDS
set -u
cd "$(git -C "$(dirname "$0")" rev-parse --show-toplevel)"
d=docs/bench/matrix/real_two_2026-12-07
python3 benches/e2e/real_fleet.py --llama-venv /tmp/engine \
  --seeds "$1" --requests 120 --rate 0.5 --replicas 2 --prefixes 8 --cache-ram 0 \
  --only sluice --sluice-config $d/least_loaded.yaml \
  --json $d/least_loaded_$(git rev-parse --short HEAD).json > $d/least_loaded.log 2>&1
