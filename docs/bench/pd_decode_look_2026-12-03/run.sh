# 2026-12-03 evening, the 2 vCPU Intel Xeon VM, 24 GiB; one benchmark or build at a time
# (/tmp/bench.lock). Agentic sessions, 32 at once, 2 prefill + 2 decode `sluice sim` replicas.
# Builds: /tmp/sluice-base = 7c8d9f4 (the last scrape counts the decode replica's streams);
# /tmp/sluice-look = 7c8d9f4 plus the look at the decode engine before a local prefill past
# local_max_tokens (this directory's commit). Both with the default config
# (local_stall_share 0.005, local_when_idle on). vllm-router cache_aware in the same runs.
cd "$(git rev-parse --show-toplevel)"
d=docs/bench/pd_decode_look_2026-12-03
pd() { python3 benches/e2e/pd.py --routers-venv /tmp/routers --workloads agentic --seeds 1,2,3 "$@"; }
# Three gateways sharing the routing table behind nginx:
pd --gateways 3 --only sluice-pd-3gw-shared vllm-pd-cache_aware --gateway-bin /tmp/sluice-look \
  --requests-dir $d/rows_look_3gw --json $d/look_3gw.json > $d/look_3gw.log 2>&1
pd --gateways 3 --only sluice-pd-3gw-shared --gateway-bin /tmp/sluice-base \
  --requests-dir $d/rows_base_3gw --json $d/base_3gw.json > $d/base_3gw.log 2>&1
# One gateway:
pd --only sluice-pd vllm-pd-cache_aware --gateway-bin /tmp/sluice-look \
  --requests-dir $d/rows_look_1gw --json $d/look_1gw.json > $d/look_1gw.log 2>&1
pd --only sluice-pd --gateway-bin /tmp/sluice-base \
  --requests-dir $d/rows_base_1gw --json $d/base_1gw.json > $d/base_1gw.log 2>&1
# The runs above used a first build of the look whose allowance could also be spent after a
# refused `local_idle` look on a prompt not bound for one of the pool's longer queues (fixed
# before committing). Again with that fix (/tmp/sluice-look2: commit 9911ae7), seeds 1-5, and the
# base build for seeds 4-5 (17:40-18:08; base seeds 4 and 5 at 17:55 and 18:01):
for s in 1 2 3 4 5; do
  python3 benches/e2e/pd.py --routers-venv /tmp/routers --workloads agentic --seeds $s --gateways 3 \
    --only sluice-pd-3gw-shared vllm-pd-cache_aware --gateway-bin /tmp/sluice-look2 \
    --requests-dir $d/rows_look2_3gw --json $d/look2_3gw_seed$s.json > $d/look2_3gw_seed$s.log 2>&1
  if [ $s -ge 4 ]; then
    python3 benches/e2e/pd.py --routers-venv /tmp/routers --workloads agentic --seeds $s --gateways 3 \
      --only sluice-pd-3gw-shared --gateway-bin /tmp/sluice-base \
      --requests-dir $d/rows_base_3gw --json $d/base_3gw_seed$s.json > $d/base_3gw_seed$s.log 2>&1
  fi
done
# And through one gateway (the committed build; vllm-router ran beside the first build above):
python3 benches/e2e/pd.py --routers-venv /tmp/routers --workloads agentic --seeds 1,2,3 \
  --only sluice-pd --gateway-bin /tmp/sluice-look2 \
  --requests-dir $d/rows_look2_1gw --json $d/look2_1gw.json > $d/look2_1gw.log 2>&1
# Rows are committed gzipped (rows_*/...jsonl.gz); stalls_by_prefill.py lists each stalled stream with the local prefills under it.
# After the review: other gateways' requests counted as the engine's running plus waiting beyond
# this gateway's in flight at the look (their queued decode legs start within a step or a KV
# transfer), a failed look standing for 1 s. That build (/tmp/sluice-look3, the final commit),
# three gateways, seeds 1-3, 18:33 on:
python3 benches/e2e/pd.py --routers-venv /tmp/routers --workloads agentic --seeds 1,2,3 --gateways 3 \
  --only sluice-pd-3gw-shared --gateway-bin /tmp/sluice-look3 \
  --requests-dir $d/rows_look3_3gw --json $d/look3_3gw.json > $d/look3_3gw.log 2>&1
