# 2026-12-05, the same machine, one benchmark at a time: `hold_for_prefill` off
# and on (the replicas speak vLLM's metrics, so `auto` would not hold: the
# config says `on`), Sluice alone with `off`, then Sluice with `on` beside
# sglang-router `cache_aware`, seed by seed; engine models caching a prompt
# once computed (SGLang's way, `--cache-at compute`).
# Usage: run.sh CELL ENGINE (sim or b) [ROUTERS_VENV]
set -u
cd "$(git -C "$(dirname "$0")" rev-parse --show-toplevel)"
d=docs/bench/matrix/prefill_hold_2026-12-05
cell=$1 engine=$2 venv=${3:-/tmp/routers}
bin=/tmp/sluice_hold
for seed in 1 2 3 4 5; do
  python3 benches/e2e/matrix.py --bin $bin --engine "$engine" --cells "$cell" --seeds $seed \
    --only sluice --sluice-config $d/off.yaml \
    --json $d/${cell}_${engine}_off_seed$seed.json >> $d/${cell}_${engine}.log 2>&1
  python3 benches/e2e/matrix.py --bin $bin --engine "$engine" --cells "$cell" --seeds $seed \
    --routers-venv "$venv" --only sluice sglang-cache_aware --sluice-config $d/on.yaml \
    --json $d/${cell}_${engine}_on_seed$seed.json >> $d/${cell}_${engine}.log 2>&1
done
