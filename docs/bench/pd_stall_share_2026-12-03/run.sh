# 2026-12-03 (night), the 2 vCPU Intel Xeon VM, 24 GiB; one benchmark or build at a time
# (/tmp/bench.lock). Agentic sessions, 32 at once, 2 prefill + 2 decode `sluice sim` replicas,
# one gateway. The question: does a larger stall allowance (routing.disaggregation.
# local_stall_share 0.009, the largest allowed (under 1% of a stream's gaps), against the default 0.005) buy TTFT p99 against vllm-router without
# costing inter-token p99? Gateway /tmp/sluice-head = 9accaff; vllm-router cache_aware in the
# same runs. The default share's runs of the same build and seeds are
# ../pd_decode_look_1gw_2026-12-03/head_seed*.json (19:17-19:34, the same machine).
cd "$(git rev-parse --show-toplevel)"
d=docs/bench/pd_stall_share_2026-12-03
for s in 1 2 3 4 5; do
  python3 benches/e2e/pd.py --routers-venv /tmp/routers --workloads agentic --seeds $s \
    --only sluice-pd vllm-pd-cache_aware --gateway-bin /tmp/sluice-head --sluice-config $d/share_0.009.yaml \
    --requests-dir $d/rows_share_0.009 --json $d/share_0.009_seed$s.json > $d/share_0.009_seed$s.log 2>&1
done
# Then: gzip -9 rows_*/*.jsonl; python3 ../pd_decode_look_2026-12-03/summary.py . > summary.txt
