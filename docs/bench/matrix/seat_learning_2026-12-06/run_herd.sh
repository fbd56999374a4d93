#!/usr/bin/env bash
# As run.sh, for the herd guard that came after the seat change: per seed the
# build with the seat change alone (its `after` runs above, sglang-router beside
# it) and the build with the herd guard too (`herd`) beside sglang-router again.
# Usage: run_herd.sh CELL HERD_BIN [ROUTERS_VENV]
set -u
cd "$(git -C "$(dirname "$0")" rev-parse --show-toplevel)"
d=docs/bench/matrix/seat_learning_2026-12-06
cell=$1 herd=$2 venv=${3:-/tmp/routers}
for seed in 1 2 3 4 5; do
  python3 benches/e2e/matrix.py --bin "$herd" --dialect sglang --cells "$cell" --seeds $seed \
    --routers-venv "$venv" --only sluice-shared sglang-cache_aware --requests-dir /tmp/seat_rows/herd \
    --json $d/${cell}_herd_seed$seed.json >> $d/${cell}_herd.log 2>&1
done
