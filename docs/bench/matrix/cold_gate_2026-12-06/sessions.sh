#!/usr/bin/env bash
# Coding-agent sessions (a workload the gate was not made for: 3,000-token tool
# results and evicted histories are cold prefills there, on engines that queue
# for room), Sluice alone (the peers' runs of this cell take 9+ minutes each):
# one run a seed, named NAME, with `cold_prefill_tokens` TOKENS (`engine`, the
# engines' 2,048, by default; 0: off).
# Usage: sessions.sh CELL BIN "SEEDS" NAME [TOKENS]
# The runs in BENCHMARKS.md: per seed `gate_off` (0) then `gate_on` with the
# build 11395b8, then `pressed` with the build that stands aside on a full engine.
set -u
cd "$(git -C "$(dirname "$0")" rev-parse --show-toplevel)"
d=docs/bench/matrix/cold_gate_2026-12-06
cell=$1 bin=$2 name=$4 tokens=${5:-engine}
for seed in $3; do
  python3 benches/e2e/matrix.py --bin "$bin" --cells "$cell" --seeds $seed \
    --cold-prefill-tokens $tokens --only sluice --requests-dir /tmp/gate_rows/sessions_$name \
    --json $d/${cell}_${name}_seed$seed.json >> $d/${cell}.log 2>&1
done
