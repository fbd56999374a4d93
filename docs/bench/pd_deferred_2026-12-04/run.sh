# 2026-12-04 evening, the 2 vCPU Intel Xeon VM, 24 GiB; one benchmark or build at a time
# (/tmp/bench.lock). 2 prefill + 2 decode `sluice sim` replicas, Sluice alone (the A/B is of
# Sluice's own builds; the peers' numbers do not depend on them).
# Builds, each whole (replicas, client and gateway from the same build):
#   base = b68667d: the simulator's decode legs waiting for their KV were not reported
#          (an engine step reset the waiting gauge), and Sluice read SGLang's waiting queue only;
#   new  = this directory's commit (review fixes included: the prefills ahead of a request count
#          the requests waiting for room, not those waiting for their KV): they are reported as vLLM and SGLang do (vLLM's
#          num_requests_waiting and reason="deferred"; SGLang's num_decode_transfer_queue_reqs),
#          and Sluice reads SGLang's disaggregation queues.
# The builds alternate seed by seed; each build's own benches/e2e/pd.py (identical) runs its
# own target/release/sluice.
set -u
cd "$(git -C "$(dirname "$0")" rev-parse --show-toplevel)"
d=$PWD/docs/bench/pd_deferred_2026-12-04
root() { if [ "$1" = base ]; then echo /tmp/base_wt; else echo "$PWD"; fi; }
for s in 1 2 3; do
  for b in base new; do
    r=$(root $b)
    # (Base's seed 1 ran before the review fixes were committed, with the same base build.)
    [ -s "$d/${b}_sglang_seed$s.json" ] && continue
    python3 "$r/benches/e2e/pd.py" --workloads chat retrieval codegen agentic --seeds $s \
      --requests 400 --only sluice-pd --requests-dir "$d/rows_${b}_vllm" \
      --json "$d/${b}_vllm_seed$s.json" > "$d/${b}_vllm_seed$s.log" 2>&1
    python3 "$r/benches/e2e/pd.py" --protocol sglang --workloads chat retrieval --seeds $s \
      --requests 400 --only sluice-pd --requests-dir "$d/rows_${b}_sglang" \
      --json "$d/${b}_sglang_seed$s.json" > "$d/${b}_sglang_seed$s.log" 2>&1
  done
done
# Then agentic alone, seeds 4 and 5, the builds alternating (its p99 moved most above):
for s in 4 5; do
  for b in base new; do
    r=$(root $b)
    python3 "$r/benches/e2e/pd.py" --workloads agentic --seeds $s --only sluice-pd \
      --requests-dir "$d/rows_${b}_vllm" --json "$d/${b}_vllm_seed$s.json" > "$d/${b}_vllm_seed$s.log" 2>&1
  done
done
# (Each build's per-request rows are committed gzipped: rows_*/...jsonl.gz; summary.py reads the logs.)
