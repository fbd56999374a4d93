# 2026-12-03, at b46e3d7 (the build was copied to /tmp/sluice-b46), after the first run of
# home_lookup_cost.py; one benchmark at a time (/tmp/bench.lock).
python3 benches/e2e/pd.py --routers-venv /tmp/routers --workloads agentic --seeds 1,2 --requests 400 --gateways 3 \
  --only sluice-pd sluice-pd-3gw-shared --gateway-bin /tmp/sluice-b46 \
  --requests-dir /tmp/b1/rows --json pd_agentic.json > pd_agentic.log 2>&1
# 06:52-06:54 UTC, the build of b46e3d7 plus the uncommitted `sluice bench` change of f10a035
# (pd_gap.json says b46e3d7: the commit it ran on, not the tree) (`sluice bench` rows now carry each stream's longest gap and when it ended):
python3 benches/e2e/pd.py --routers-venv /tmp/routers --workloads agentic --seeds 1 --requests 400 --gateways 3 \
  --only sluice-pd-3gw-shared --requests-dir /tmp/b1/rows3 --json pd_gap.json > pd_gap.log 2>&1
python3 gaps.py agentic_sluice-pd-3gw-shared_seed1.jsonl.gz > gaps.txt
# 07:13-07:17 UTC, the same build, pd.py now recording which gateway served each request (`gateway`):
python3 benches/e2e/pd.py --routers-venv /tmp/routers --workloads agentic --seeds 1,2 --requests 400 --gateways 3 \
  --only sluice-pd-3gw-shared --requests-dir /tmp/b1/rows4 --json by_gateway.json > by_gateway.log 2>&1
python3 gaps.py by_gateway_seed1.jsonl.gz by_gateway_seed2.jsonl.gz > by_gateway_gaps.txt
