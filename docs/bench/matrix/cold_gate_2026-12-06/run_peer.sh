#!/usr/bin/env bash
# The cells the gate was not made for, as a check: per seed the build with the
# gate beside sglang-router `cache_aware` only (their earlier builds' runs are
# in BENCHMARKS.md), on replicas speaking SGLang's metrics; with ENGINE=b on
# the second engine model instead (vLLM's metrics; runs named `b_after`).
# Usage: [ENGINE=b] run_peer.sh CELL AFTER_BIN [ROUTERS_VENV]
set -u
cd "$(git -C "$(dirname "$0")" rev-parse --show-toplevel)"
d=docs/bench/matrix/cold_gate_2026-12-06
cell=$1 after=$2 venv=${3:-/tmp/routers}
case $cell in *_3gw) me=sluice-shared ;; *) me=sluice ;; esac
if [ "${ENGINE:-sim}" = b ]; then
  model=(--engine b) tag=b_ log=${cell}_b.log
else
  model=(--dialect sglang) tag= log=${cell}.log
fi
for seed in 1 2 3 4 5; do
  python3 benches/e2e/matrix.py --bin "$after" "${model[@]}" --cells "$cell" --seeds $seed \
    --routers-venv "$venv" --only $me sglang-cache_aware --requests-dir /tmp/gate_rows/${tag}peer \
    --json $d/${cell}_${tag}after_seed$seed.json >> $d/$log 2>&1
done
