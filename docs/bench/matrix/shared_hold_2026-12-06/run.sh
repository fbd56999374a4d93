#!/usr/bin/env bash
# 2026-12-06, the same 2-vCPU machine, one benchmark at a time: three Sluice
# gateways sharing prefix homes in Redis (`*_3gw` cells, `sluice-shared`) on
# replicas speaking SGLang's metrics (`--dialect sglang`: `hold_for_prefill:
# auto` holds), defaults (no config file). Per seed, the build before this
# change (ee0b092: each gateway holds only for its own prefills; `before`)
# alone, then the build with it (1fc37c4: a gateway also holds for another
# gateway's cold prefill; `after`) beside sglang-router `cache_aware`.
# Usage: run.sh CELL BEFORE_BIN AFTER_BIN [ROUTERS_VENV]
set -u
cd "$(git -C "$(dirname "$0")" rev-parse --show-toplevel)"
d=docs/bench/matrix/shared_hold_2026-12-06
cell=$1 before=$2 after=$3 venv=${4:-/tmp/routers}
for seed in 1 2 3 4 5; do
  python3 benches/e2e/matrix.py --bin "$before" --dialect sglang --cells "$cell" --seeds $seed \
    --only sluice-shared \
    --json $d/${cell}_before_seed$seed.json >> $d/${cell}.log 2>&1
  python3 benches/e2e/matrix.py --bin "$after" --dialect sglang --cells "$cell" --seeds $seed \
    --routers-venv "$venv" --only sluice-shared sglang-cache_aware \
    --json $d/${cell}_after_seed$seed.json >> $d/${cell}.log 2>&1
done
