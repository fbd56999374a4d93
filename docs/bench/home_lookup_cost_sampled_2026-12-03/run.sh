# 2026-12-03 14:46-15:00 UTC, the 2 vCPU AMD EPYC VM, 24 GiB; one benchmark at a time.
# head: a release build of 5430d5b; novel: the build that samples lookups (this change).
for i in 1 2; do
  for b in head novel; do
    SLUICE_BIN=/tmp/sluice-$b python3 benches/e2e/home_lookup_cost.py --rounds 3 --requests 16000 \
      --json ${i}_$b.json > ${i}_$b.txt
  done
done
python3 summary.py > summary.txt
