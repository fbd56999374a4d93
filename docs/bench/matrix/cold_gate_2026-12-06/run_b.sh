#!/usr/bin/env bash
# As run.sh on the second engine model (`--engine b`, written apart from
# `sluice sim`; vLLM's metrics, so no hold for a prompt's own prefill): per
# seed the build before the gate alone, then the build with it beside
# sglang-router `cache_aware`. Runs are named `b_before`, `b_after`.
# (`matrix.py` sets `cold_prefill_tokens` to the engines' 2,048 batched tokens a
# step for the build after, as an operator would; the build before has no such key.)
# Usage: run_b.sh CELL BEFORE_BIN AFTER_BIN [ROUTERS_VENV]
set -u
cd "$(git -C "$(dirname "$0")" rev-parse --show-toplevel)"
d=docs/bench/matrix/cold_gate_2026-12-06
cell=$1 before=$2 after=$3 venv=${4:-/tmp/routers}
case $cell in *_3gw) me=sluice-shared ;; *) me=sluice ;; esac
for seed in 1 2 3 4 5; do
  python3 benches/e2e/matrix.py --bin "$before" --engine b --cells "$cell" --seeds $seed --cold-prefill-tokens none \
    --only $me --requests-dir /tmp/gate_rows/b_before \
    --json $d/${cell}_b_before_seed$seed.json >> $d/${cell}_b.log 2>&1
  python3 benches/e2e/matrix.py --bin "$after" --engine b --cells "$cell" --seeds $seed \
    --routers-venv "$venv" --only $me sglang-cache_aware --requests-dir /tmp/gate_rows/b_after \
    --json $d/${cell}_b_after_seed$seed.json >> $d/${cell}_b.log 2>&1
done
