# 2026-12-03 13:45-15:06 UTC, the 2 vCPU AMD EPYC VM, 24 GiB; one benchmark or build at a time
# (/tmp/bench.lock). Every JSON says commit 5430d5b: the commit the tree was on.
# Agentic sessions, 32 at once, 2 prefill + 2 decode `sluice sim` replicas, one gateway.
# A build of 5430d5b plus `escape_tried.patch` (a session's prefill leg also leaves a prefill
# home that queues and keeps evicting while every prefill replica queues, for one with far
# fewer prompt tokens ahead; the margin chosen at start by SLUICE_EXP_ESCAPE):
#   whole  the other's tokens ahead plus the turn's whole prompt under the home's tokens ahead
#   half   the other's tokens ahead under half the home's
#   off    the rule off: 5430d5b's behaviour (no peer in that run)
for mode in whole half off; do
  only="sluice-pd vllm-pd-cache_aware"
  [ $mode = off ] && only="sluice-pd"
  SLUICE_EXP_ESCAPE=$mode python3 benches/e2e/pd.py --routers-venv /tmp/routers --workloads agentic --seeds 1,2,3 --only $only \
    --gateway-bin /tmp/sluice-esc --requests-dir rows_$mode --json $mode.json > $mode.log
done
# 5430d5b itself (target/release/sluice rebuilt from 5430d5b after the runs above), vllm-router in
# the same runs, 14:21-14:34. Meant as the three-gateway run, but `--only sluice-pd` keeps only the
# one-gateway setting (the three-gateway ones are named sluice-pd-3gw[-shared]): one gateway.
python3 benches/e2e/pd.py --routers-venv /tmp/routers --workloads agentic --seeds 1,2,3 --only sluice-pd vllm-pd-cache_aware \
  --gateways 3 --requests-dir rows_3gw --json head_again.json > head_again.log
# Rows are committed gzipped as rows/<build>_sluice_seedN.jsonl.gz (three_gateways_*: the
# sluice-pd-3gw-shared rows). The prefill pool per 10-s window, the 12 slowest turns, the
# imbalance and the histories lost:
python3 pool.py rows/*.jsonl.gz > pool.txt
# The stall allowance through three gateways sharing the routing table (5430d5b's build as
# the gateways; 14:53-15:06):
python3 benches/e2e/pd.py --routers-venv /tmp/routers --workloads agentic --seeds 1,2,3 --only sluice-pd-3gw-shared vllm-pd-cache_aware \
  --gateways 3 --gateway-bin /tmp/sluice-head --requests-dir rows_3gw --json three_gateways.json > three_gateways.log
