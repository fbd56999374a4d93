#!/usr/bin/env bash
# The overload fleet whose seats are learned (`flow.py --fleet kv-full`: 64 seats
# whose KV is ~90% full at full batch), before and after this change, per seed,
# capacity fixed at the 13.6 requests/s measured before (docs/BENCHMARKS.md,
# "Flow control"), so both builds are offered the same load.
# Usage: flow.sh BEFORE_BIN AFTER_BIN SEEDS...
set -u
cd "$(git -C "$(dirname "$0")" rev-parse --show-toplevel)"
d=docs/bench/matrix/seat_learning_2026-12-06
before=$1 after=$2; shift 2
for seed in "$@"; do
  for mode in before after; do
    bin=$before; [ $mode = after ] && bin=$after
    python3 benches/e2e/flow.py --fleet kv-full --seed $seed --capacity 13.6 \
      --only unloaded,flood,flood_off --bin "$bin" \
      --json $d/flow_kv-full_${mode}_seed$seed.json >> $d/flow_kv-full.log 2>&1
  done
done
