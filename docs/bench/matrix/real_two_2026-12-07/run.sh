#!/usr/bin/env bash
# The real-engine fleet with one engine a core: two llama.cpp servers (Gemma 3
# 270M Q4_K_M, two slots and one thread each) on this two-core machine, where
# the earlier runs had three engines share two cores. The host prompt cache off
# (`--cache-ram 0`: a replica keeps only what its two slots last served, four
# prompts in the fleet) and twice as many system prompts (8) as the fleet
# keeps, as the three-engine cell had (12 for 6); one request every two
# seconds, 120 a run, as there. Sluice (defaults), sglang-router and
# vllm-router `cache_aware` in the same run seed by seed. REPLICAS=3 runs the
# three-engine cell (`run_three.sh`).
# Usage: [REPLICAS=N] run.sh SEEDS [TAG]   (e.g. run.sh 1,2,3,4,5)
set -u
cd "$(git -C "$(dirname "$0")" rev-parse --show-toplevel)"
d=docs/bench/matrix/real_two_2026-12-07
n=${REPLICAS:-2}
tag=${2:-two}
python3 benches/e2e/real_fleet.py --llama-venv /tmp/engine --routers-venv /tmp/routers \
  --seeds "$1" --requests 120 --rate 0.5 --replicas "$n" --prefixes $((4 * n)) --cache-ram 0 \
  --only sluice sglang-cache_aware vllm-cache_aware \
  --json $d/${tag}_$(git rev-parse --short HEAD).json > $d/${tag}.log 2>&1
