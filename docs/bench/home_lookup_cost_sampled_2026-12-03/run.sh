# 2026-12-03, the 2 vCPU AMD EPYC VM, 24 GiB; one benchmark at a time (/tmp/bench.lock).
# head: a release build of 5430d5b; sampled: the build that samples lookups by key, per model and
# pool (the committed change), 15:25-15:33 UTC:
for i in 1 2; do
  for b in head sampled; do
    SLUICE_BIN=/tmp/sluice-$b python3 benches/e2e/home_lookup_cost.py --rounds 3 --requests 16000 \
      --json ${i}_$b.json > ${i}_$b.txt
  done
done
python3 summary.py > summary.txt
# by_count_first_version/: the same with a first version (one new prompt in 16 by count, one
# counter per gateway), 14:46-14:53 UTC (`novel`); the machine was noisy from 14:49 on:
python3 summary.py by_count_first_version head novel > by_count_first_version/summary.txt
