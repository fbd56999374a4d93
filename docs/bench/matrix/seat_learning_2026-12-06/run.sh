#!/usr/bin/env bash
# 2026-12-06, the same 2-vCPU machine, one benchmark at a time: three Sluice
# gateways sharing prefix homes in Redis (`*_3gw` cells, `sluice-shared`) on
# replicas speaking SGLang's metrics, defaults (no config file). Per seed, the
# build before this change (39655df: seats learned from any queue that
# outlives a scrape; `before`) alone, then the build with it (a queue the
# engine keeps taking in from teaches no seats; running above the learned
# seats raises them; `after`) beside sglang-router `cache_aware`; every
# request's timing, each gateway's metrics and its /admin/backends every
# 100 ms in rows/.
# Usage: run.sh CELL BEFORE_BIN AFTER_BIN [ROUTERS_VENV]
set -u
cd "$(git -C "$(dirname "$0")" rev-parse --show-toplevel)"
d=docs/bench/matrix/seat_learning_2026-12-06
cell=$1 before=$2 after=$3 venv=${4:-/tmp/routers}
for seed in 1 2 3 4 5; do
  python3 benches/e2e/matrix.py --bin "$before" --dialect sglang --cells "$cell" --seeds $seed \
    --only sluice-shared --requests-dir /tmp/seat_rows/before \
    --json $d/${cell}_before_seed$seed.json >> $d/${cell}.log 2>&1
  python3 benches/e2e/matrix.py --bin "$after" --dialect sglang --cells "$cell" --seeds $seed \
    --routers-venv "$venv" --only sluice-shared sglang-cache_aware --requests-dir /tmp/seat_rows/after \
    --json $d/${cell}_after_seed$seed.json >> $d/${cell}.log 2>&1
done
