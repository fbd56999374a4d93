#!/usr/bin/env bash
# The closed loop's precision in routing's predictions (`routing::load`,
# `Load::kept`): the two-engine real fleet of `../real_two_2026-12-07/run.sh`
# (two llama.cpp servers, two slots, host cache off, 8 prompts, 0.5 req/s, 120
# a run) with the same arrivals seed by seed, Sluice alone (defaults); the build
# before and the peers are in `../real_two_2026-12-07/two_*.json`. Measured
# 2026-12-08 00:17-00:34 UTC on a release build of 7098892 (the experiment,
# reverted in the commit after it): `alone_7098892.json`, `alone.log`; seed 3
# twice more with the access log (`../real_two_2026-12-07/access_log.yaml`) and
# `poll_admin.py` polling `/admin/backends` and `/admin/routing` every 0.25 s
# (`alone_seed3_access_{a,b}.json`, `alone_seed3_*_b.jsonl.gz`). The JSON is
# named after HEAD at run time: rename it to the build measured.
# With ROUTERS=1, sglang-router and vllm-router `cache_aware` in the same runs.
# Usage: [ROUTERS=1] run.sh SEEDS [TAG]   (the runs above: run.sh 1,2,4,5)
set -u
cd "$(git -C "$(dirname "$0")" rev-parse --show-toplevel)"
d=docs/bench/matrix/real_kept_2026-12-08
tag=${2:-alone}
only=(sluice)
[ "${ROUTERS:-0}" = 1 ] && only=(sluice sglang-cache_aware vllm-cache_aware)
python3 benches/e2e/real_fleet.py --llama-venv /tmp/engine --routers-venv /tmp/routers \
  --seeds "$1" --requests 120 --rate 0.5 --replicas 2 --prefixes 8 --cache-ram 0 \
  --only "${only[@]}" \
  --json $d/${tag}_$(git rev-parse --short HEAD).json >> $d/${tag}.log 2>&1
