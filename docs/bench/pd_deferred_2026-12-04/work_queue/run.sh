# 2026-12-04 17:25 on, the same machine, one benchmark at a time (/tmp/bench.lock).
# Agentic sessions (vLLM protocol), Sluice alone, the replicas and client from the variant's
# build (the simulator is the same in both), the gateway from:
#   new     = /tmp/sluice_new, da44a3c (the routing code of this directory's parent commit):
#             a decode leg weighed by this gateway's in flight plus the engine's waiting
#             requests (least_loaded::work), pulls included;
#   variant = the same plus least_loaded::work adding the engine's queue (requests waiting
#             for room) instead: a leg pulling its KV is counted once, in flight.
# Alternating seed by seed.
set -u
cd "$(git -C "$(dirname "$0")" rev-parse --show-toplevel)"
d=$PWD/docs/bench/pd_deferred_2026-12-04/work_queue
for s in 1 2 3 4 5; do
  for b in new variant; do
    python3 benches/e2e/pd.py --workloads agentic --seeds $s --only sluice-pd \
      --gateway-bin /tmp/sluice_$b --requests-dir "$d/rows_$b" \
      --json "$d/${b}_vllm_seed$s.json" > "$d/${b}_vllm_seed$s.log" 2>&1
  done
done
# Rows committed gzipped (rows_*/...jsonl.gz).
