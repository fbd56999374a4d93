# 2026-12-04 17:53 on, the same machine, one benchmark at a time (/tmp/bench.lock): agentic
# sessions (32 at once), 2 prefill + 2 decode `sluice sim` replicas reporting their decode
# legs' pulls, Sluice at 870ad78 (a replica's least work by the engine's queue) and
# vllm-router PD `cache_aware` in the same runs, seeds 1-5.
set -u
cd "$(git -C "$(dirname "$0")" rev-parse --show-toplevel)"
d=$PWD/docs/bench/pd_deferred_2026-12-04/agentic_vs_vllm
python3 benches/e2e/pd.py --routers-venv /tmp/routers --workloads agentic --seeds 1,2,3,4,5 \
  --only sluice-pd vllm-pd-cache_aware --requests-dir "$d/rows" --json "$d/agentic.json" \
  > "$d/agentic.log" 2>&1
# Rows committed gzipped (rows/...jsonl.gz).
