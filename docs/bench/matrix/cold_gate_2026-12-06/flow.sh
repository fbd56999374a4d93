#!/usr/bin/env bash
# The overload fleet (`flow.py --fleet kv-full`: 64 seats whose KV is ~90% full
# at full batch, engines of 8,192 batched tokens a step, 1,000-token prompts
# each new: every request a cold prefill), one build per call, named NAME, per
# seed, capacity fixed at the 13.6 requests/s measured before
# (docs/BENCHMARKS.md, "Flow control"), so every build is offered the same load.
# Run for the build before the gate (`before`), the gate at 2,048 tokens, a
# quarter of these engines' budget (`gate2048`: the cost of a budget set too
# low), and at the default 8,192 (`gate8192`).
# Usage: flow.sh NAME BIN SEEDS...
set -u
cd "$(git -C "$(dirname "$0")" rev-parse --show-toplevel)"
d=docs/bench/matrix/cold_gate_2026-12-06
name=$1 bin=$2; shift 2
for seed in "$@"; do
  python3 benches/e2e/flow.py --fleet kv-full --seed $seed --capacity 13.6 \
    --only unloaded,flood,flood_off --bin "$bin" \
    --json $d/flow_kv-full_${name}_seed$seed.json >> $d/flow_kv-full.log 2>&1
done
