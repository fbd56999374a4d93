# 2026-12-05 on, the same machine, one benchmark at a time (/tmp/bench.lock): agentic
# sessions (32 at once), 2 prefill + 2 decode `sluice sim` replicas caching prompt blocks
# as vLLM V1 does (`--cache-at schedule`), Sluice (the routing code of 870ad78/d187489,
# the release build of f9a8e10) and vllm-router PD `cache_aware` in the same runs, seeds 1-5.
set -u
cd "$(git -C "$(dirname "$0")" rev-parse --show-toplevel)"
d=$PWD/docs/bench/pd_cache_at_2026-12-05/agentic_vs_vllm
python3 benches/e2e/pd.py --routers-venv /tmp/routers --workloads agentic --seeds 1,2,3,4,5 \
  --cache-at schedule --only sluice-pd vllm-pd-cache_aware --requests-dir "$d/rows" \
  --json "$d/agentic.json" > "$d/agentic.log" 2>&1
# Rows committed gzipped (rows/...jsonl.gz).
