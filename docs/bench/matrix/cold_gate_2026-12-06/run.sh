#!/usr/bin/env bash
# Cold prefills paced per replica (`routing.prefix_kv.cold_prefill_tokens`):
# per seed the build before it (a98249c, the default config) alone, then the
# build with the gate (at 2,048 tokens, the engines' budget) beside
# sglang-router `cache_aware`, on replicas speaking SGLang's metrics. CELL's
# name says one gateway (`sluice`) or three sharing the table (`*_3gw`:
# `sluice-shared`). With ENGINE=b, on the second engine model instead
# (`--engine b`, written apart from `sluice sim`; vLLM's metrics, so no hold
# for a prompt's own prefill), the runs named `b_before`, `b_after`.
# (`matrix.py` sets `cold_prefill_tokens` to the engines' 2,048 batched tokens a
# step for the build after, as an operator would; the build before has no such key.)
# BEFORE_BIN `none`: no build before (`run_peer.sh`: the gate's build beside the peer).
# Usage: [ENGINE=b] run.sh CELL BEFORE_BIN AFTER_BIN [ROUTERS_VENV]
set -u
cd "$(git -C "$(dirname "$0")" rev-parse --show-toplevel)"
d=docs/bench/matrix/cold_gate_2026-12-06
cell=$1 before=$2 after=$3 venv=${4:-/tmp/routers}
case $cell in *_3gw) me=sluice-shared ;; *) me=sluice ;; esac
if [ "${ENGINE:-sim}" = b ]; then
  model=(--engine b) tag=b_ log=${cell}_b.log
else
  model=(--dialect sglang) tag= log=${cell}.log
fi
for seed in 1 2 3 4 5; do
  [ "$before" = none ] || python3 benches/e2e/matrix.py --bin "$before" "${model[@]}" --cells "$cell" --seeds $seed \
    --cold-prefill-tokens none --only $me --requests-dir /tmp/gate_rows/${tag}before \
    --json $d/${cell}_${tag}before_seed$seed.json >> $d/$log 2>&1
  python3 benches/e2e/matrix.py --bin "$after" "${model[@]}" --cells "$cell" --seeds $seed \
    --routers-venv "$venv" --only $me sglang-cache_aware --requests-dir /tmp/gate_rows/${tag}after \
    --json $d/${cell}_${tag}after_seed$seed.json >> $d/$log 2>&1
done
