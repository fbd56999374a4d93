#!/usr/bin/env bash
# A cold prefill's place in its replica's gate passes to the requests held for
# its prefill until their first tokens (issue 32): per seed the build before
# (BEFORE_BIN) alone, then the build with it (AFTER_BIN) beside sglang-router
# `cache_aware`, on replicas speaking SGLang's metrics (so requests are held
# for their prompt's prefill: `hold_for_prefill: auto`), the gate at the
# engines' 2,048 tokens (`matrix.py` sets it). Output `CELL.log`, raw data
# `CELL_{before,after}_seedN.json`, every request's timing under ROWS.
# Usage: run.sh CELL BEFORE_BIN AFTER_BIN "SEEDS" [ROUTERS_VENV] [ROWS]
set -u
cd "$(git -C "$(dirname "$0")" rev-parse --show-toplevel)"
d=docs/bench/matrix/held_share_2026-12-07
cell=$1 before=$2 after=$3 seeds=$4 venv=${5:-/tmp/routers} rows=${6:-/tmp/share_rows}
for seed in $seeds; do
  python3 benches/e2e/matrix.py --bin "$before" --dialect sglang --cells "$cell" --seeds $seed \
    --only sluice --requests-dir $rows/before \
    --json $d/${cell}_before_seed$seed.json >> $d/$cell.log 2>&1
  python3 benches/e2e/matrix.py --bin "$after" --dialect sglang --cells "$cell" --seeds $seed \
    --routers-venv "$venv" --only sluice sglang-cache_aware --requests-dir $rows/after \
    --json $d/${cell}_after_seed$seed.json >> $d/$cell.log 2>&1
done
