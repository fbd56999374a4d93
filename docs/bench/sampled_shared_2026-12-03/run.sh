# 2026-12-03 evening, the 2 vCPU Intel Xeon VM, 24 GiB; one benchmark or build at a time (/tmp/bench.lock).
# `sampled`: this directory's commit (target/release/sluice, also the load generator and the
# replicas); `every lookup`: 5430d5b, the build before the sampling (/tmp/sluice-5430d5b).
cd "$(git rev-parse --show-toplevel)"
python3 benches/e2e/sampled_shared.py --unsampled-bin /tmp/sluice-5430d5b --rounds 3 \
  --json docs/bench/sampled_shared_2026-12-03/sampled_shared.json > docs/bench/sampled_shared_2026-12-03/sampled_shared.txt 2> docs/bench/sampled_shared_2026-12-03/sampled_shared.log
