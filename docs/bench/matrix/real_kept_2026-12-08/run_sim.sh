#!/usr/bin/env bash
# The same change on the simulated matrix's prefix cells, where the engines keep
# almost everything routing predicts (prefix hit 95-98%): per seed the build
# before (BEFORE_BIN) and the build with the precision (AFTER_BIN), Sluice alone
# (defaults; the peers' runs at these seeds are in BENCHMARKS.md), on replicas
# speaking SGLang's metrics as the matrix's table runs them.
# Measured 2026-12-08 00:38-00:52 UTC: few_keys_tight, seeds 1-5, BEFORE_BIN a
# release build of 023cc77 (the code of 888f45a), AFTER_BIN one of 7098892.
# Table: table.py.
# Usage: run_sim.sh CELL SEEDS BEFORE_BIN AFTER_BIN
set -u
cd "$(git -C "$(dirname "$0")" rev-parse --show-toplevel)"
d=docs/bench/matrix/real_kept_2026-12-08
cell=$1 before=$3 after=$4
for seed in ${2//,/ }; do
  for which in before after; do
    bin=$before; [ $which = after ] && bin=$after
    python3 benches/e2e/matrix.py --bin "$bin" --dialect sglang --cells "$cell" --seeds $seed \
      --only sluice --json $d/${cell}_${which}_seed$seed.json >> $d/$cell.log 2>&1
  done
done
