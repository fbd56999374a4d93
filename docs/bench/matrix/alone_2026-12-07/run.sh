#!/usr/bin/env bash
# `session_placement: auto` with one gateway and no shared table places new
# sessions by pressure (`first_open`) while the replicas' engines show no
# other sender (`upstream::company`). Measured per seed on `sessions` with
# vllm-router `consistent_hash` in the same runs, and on `sessions_3gw`
# (three gateways behind nginx: `auto` must stay `rendezvous` there, every
# turn on its session's replica).
# Usage: [TAG=name] run.sh CELL BIN "SEEDS" [ROUTERS...]   (ROUTERS default:
# sluice; TAG names the runs' files apart: CELL_TAG_seedN.json, CELL_TAG.log)
# The runs in BENCHMARKS.md: `run.sh sessions_3gw BIN "1"`, then
# `run.sh sessions BIN "1 2 3 4 5" sluice vllm-consistent_hash`; with the
# build after the review (13e9b76): `TAG=final run.sh sessions_3gw BIN "1"` and
# `TAG=final run.sh sessions BIN "5" sluice vllm-consistent_hash`; heavy-tailed
# sessions at 3026bcf: `TAG=final run.sh sessions_heavy BIN "1 2 3 5" sluice
# vllm-consistent_hash` (seed 5 stopped unfinished); with a build of
# leave_lost_history.patch (not landed): `TAG=half run.sh sessions_heavy BIN "3"`
# (`TAG=lost`: the patch without its in-flight bound). The patch landed (a
# session leaving a replica that lost its history while alone); with its build:
# `TAG=leave run.sh sessions_heavy BIN "1 2 4 5" sluice`, `TAG=leave run.sh
# sessions BIN "1 2 3 4 5" sluice`, `TAG=peer run.sh sessions_heavy BIN "5"
# vllm-consistent_hash`; `TAG=same run.sh sessions BIN "1 2 3 4 5" sluice
# vllm-consistent_hash`; `TAG=same run.sh sessions_heavy BIN "4 1" sluice
# vllm-consistent_hash` (the build of 5ef3896). A session that left stays a
# minute where it went (the build of a693ab8 with it): `TAG=moves run.sh
# sessions BIN "5"` (a693ab8 itself, every turn kept for `moves.py`), `TAG=settle
# run.sh sessions BIN "5 1 2 3 4"`, `TAG=settle run.sh sessions_heavy BIN
# "3 5 2 1 4"`, `TAG=settle_same run.sh sessions_heavy BIN "4" sluice
# vllm-consistent_hash`, `TAG=settle_same run.sh sessions BIN "3" sluice
# vllm-consistent_hash`; with the build of 023cc77: `TAG=settle_same run.sh
# sessions_heavy BIN "2 5" sluice vllm-consistent_hash`, then the same with "1"; on
# 2026-12-08 the same build: `TAG=settle_same run.sh sessions_heavy BIN "3" sluice
# vllm-consistent_hash`, then `TAG=settle_same run.sh sessions BIN "1 2 4 5" sluice
# vllm-consistent_hash`. Every turn of a run: /tmp/alone_rows/CELL_TAG/*.jsonl
# (those runs' gzipped in rows/).
set -u
cd "$(git -C "$(dirname "$0")" rev-parse --show-toplevel)"
d=docs/bench/matrix/alone_2026-12-07
cell=$1 bin=$2 seeds=$3 tag=${TAG:+_$TAG}
shift 3
only=${*:-sluice}
for seed in $seeds; do
  echo "# $cell seed $seed $(date -u +%FT%TZ) $(git rev-parse --short HEAD)" >> $d/$cell$tag.log
  python3 benches/e2e/matrix.py --bin "$bin" --routers-venv /tmp/routers --cells "$cell" \
    --seeds $seed --only $only --requests-dir /tmp/alone_rows/$cell$tag \
    --json $d/${cell}${tag}_seed$seed.json >> $d/$cell$tag.log 2>&1
done
echo "ALONE_RUN_DONE $cell $seeds" >> $d/$cell$tag.log
