#!/usr/bin/env bash
# 2026-12-05 evening, the same machine, one benchmark at a time: replicas
# speaking SGLang's metrics (`sluice sim --dialect sglang`, caching a prompt
# once computed as SGLang does), so `hold_for_prefill: auto` (the default: no
# config file) holds; per seed Sluice with `hold_for_prefill: off` alone, then
# Sluice with the defaults beside sglang-router `cache_aware`. `many_keys` ran
# 2026-12-06 02:17-02:38 and `few_keys` 03:03-03:23 (the release build of
# 40a76ed); seed 4 of `few_keys` rerun after, Sluice alone, with
# --requests-dir (few_keys_seed4_rerun_{off,auto}.json); `few_keys_tight_3gw`
# 03:33-03:48 with `--only sluice-shared sglang-cache_aware` per seed (no
# `off` run: --sluice-config applies to plain `sluice` only).
# Usage: run.sh CELL [ROUTERS_VENV]
set -u
cd "$(git -C "$(dirname "$0")" rev-parse --show-toplevel)"
d=docs/bench/matrix/prefill_hold_sglang_2026-12-05
cell=$1 venv=${2:-/tmp/routers}
bin=/tmp/sluice_hold
for seed in 1 2 3 4 5; do
  python3 benches/e2e/matrix.py --bin $bin --dialect sglang --cells "$cell" --seeds $seed \
    --only sluice --sluice-config $d/off.yaml \
    --json $d/${cell}_off_seed$seed.json >> $d/${cell}.log 2>&1
  python3 benches/e2e/matrix.py --bin $bin --dialect sglang --cells "$cell" --seeds $seed \
    --routers-venv "$venv" --only sluice sglang-cache_aware \
    --json $d/${cell}_auto_seed$seed.json >> $d/${cell}.log 2>&1
done
