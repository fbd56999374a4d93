#!/usr/bin/env bash
# The same before / after comparison through one gateway (`sluice`, no shared
# table: the herd guard does not apply, the seat change does): per seed the
# build before (39655df) alone, then the build with both changes beside
# sglang-router `cache_aware`.
# Usage: run_one_gateway.sh CELL BEFORE_BIN AFTER_BIN [ROUTERS_VENV]
set -u
cd "$(git -C "$(dirname "$0")" rev-parse --show-toplevel)"
d=docs/bench/matrix/seat_learning_2026-12-06
cell=$1 before=$2 after=$3 venv=${4:-/tmp/routers}
for seed in 1 2 3 4 5; do
  python3 benches/e2e/matrix.py --bin "$before" --dialect sglang --cells "$cell" --seeds $seed \
    --only sluice --requests-dir /tmp/seat_rows/one_before \
    --json $d/${cell}_before_seed$seed.json >> $d/${cell}.log 2>&1
  python3 benches/e2e/matrix.py --bin "$after" --dialect sglang --cells "$cell" --seeds $seed \
    --routers-venv "$venv" --only sluice sglang-cache_aware --requests-dir /tmp/seat_rows/one_after \
    --json $d/${cell}_after_seed$seed.json >> $d/${cell}.log 2>&1
done
