#!/usr/bin/env bash
# The earlier real-engine cell at this build, for the same-build comparison
# with `run.sh`: three llama.cpp servers (two slots, one thread each) sharing
# the two cores, host prompt cache off, 12 system prompts (twice the six the
# fleet keeps), one request every two seconds, 120 a run (BENCHMARKS' "same
# fleet at half the rate", 2026-11-29 at e17c599, had sglang-router only).
# Sluice (defaults), sglang-router and vllm-router `cache_aware` in the same
# run seed by seed.
# Usage: run_three.sh SEEDS
REPLICAS=3 exec bash "$(dirname "$0")/run.sh" "$1" three
