# 2026-12-03 08:47-10:35 UTC, the 2 vCPU AMD EPYC VM, 24 GiB; one benchmark or build at a time
# (/tmp/bench.lock). Every JSON says commit 227c9e0: the commit the tree was on, not the tree.
# Agentic sessions, 32 at once, 2 prefill + 2 decode `sluice sim` replicas, one gateway.
# Builds of the tree as the change grew (each copied before its runs):
#   1_  local prefills under running streams within `local_stall_share` (0.005), spent first come
#   2_  ... spent only on prompts bound for a prefill replica whose predicted wait is at least the
#       pool's mean (the session's prefill home counted, not the shortest wait)
#   3_  ... and a local prefill that was larger than predicted (the engine's cached tokens) owes
#       its extra chunks' stalls
#   4_evicting_gate  ... and only a prompt the decode replica lacks at most one chunk of, on a
#       replica not found evicting lately (seed 1 only, stopped: 10 decisions, no gain)
#   4_final  ... one chunk at most, without the evicting check (the committed version, but for
#       a fix after these runs: a decode replica where no stream is seen is `local_idle`'s case)
# 1_untargeted (with vllm-router in the same run) and 1_off (the same build, `off.yaml`: share 0,
# the behaviour before):
python3 benches/e2e/pd.py --routers-venv /tmp/routers --workloads agentic --seeds 1,2,3 --only sluice-pd vllm-pd-cache_aware \
  --requests-dir rows_on --json 1_untargeted.json > 1_untargeted.log
python3 benches/e2e/pd.py --routers-venv /tmp/routers --workloads agentic --seeds 1,2,3 --only sluice-pd \
  --sluice-config off.yaml --requests-dir rows_off --json 1_off.json > 1_off.log
# 2_targeted, 3_owe (+ seed 3 again, and share 0.002), 4_evicting_gate (seed 1), 4_final:
# each build with --gateway-bin, as
python3 benches/e2e/pd.py --routers-venv /tmp/routers --workloads agentic --seeds 1,2,3 --only sluice-pd vllm-pd-cache_aware \
  --gateway-bin /tmp/sluice-X --requests-dir rows_X --json X.json > X.log
python3 benches/e2e/pd.py --routers-venv /tmp/routers --workloads agentic --seeds 1,2,3 --only sluice-pd \
  --gateway-bin /tmp/sluice-owe --sluice-config share0.002.yaml --json 3_owe_share0.002.json > 3_owe_share0.002.log
# The other workloads with build 3 (stopped after its first half: no `local_stall_budget`
# decision in any of its six runs, so the setting changes nothing there):
python3 benches/e2e/pd.py --routers-venv /tmp/routers --workloads chat retrieval codegen --seeds 1,2 --requests 400 \
  --only sluice-pd --gateway-bin /tmp/sluice-owe --json 3_owe_chat_retrieval_codegen.json > 3_owe_chat_retrieval_codegen.log
# What makes the tail, per run (rows/ holds Sluice's rows of runs 1 seed 1, 3 and 4_final):
python3 tail.py rows/*.jsonl.gz > tail.txt
