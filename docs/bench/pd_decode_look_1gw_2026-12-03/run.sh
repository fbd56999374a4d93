# 2026-12-03 (night), the 2 vCPU Intel Xeon VM, 24 GiB; one benchmark or build at a time
# (/tmp/bench.lock). Agentic sessions, 32 at once, 2 prefill + 2 decode `sluice sim` replicas,
# ONE gateway. The question (last note's Left 3): does the look at the decode engine before a
# local prefill cost stalled streams through one gateway? Builds alternated seed by seed:
# /tmp/sluice-base = 7c8d9f4 (the last scrape counts the decode replica's streams);
# /tmp/sluice-head = 9accaff (the look). Default config. Sims and the load generator: 9accaff.
cd "$(git rev-parse --show-toplevel)"
d=docs/bench/pd_decode_look_1gw_2026-12-03
for s in 1 2 3 4 5; do
  for b in base head; do
    python3 benches/e2e/pd.py --routers-venv /tmp/routers --workloads agentic --seeds $s \
      --only sluice-pd --gateway-bin /tmp/sluice-$b \
      --requests-dir $d/rows_$b --json $d/${b}_seed$s.json > $d/${b}_seed$s.log 2>&1
  done
done
# Then: gzip -9 rows_*/*.jsonl; python3 ../pd_decode_look_2026-12-03/summary.py . > summary.txt;
# python3 ../pd_decode_look_2026-12-03/stalls_by_prefill.py rows_*/*.jsonl.gz (the stalls under local prefills);
# python3 mispredicted.py ROWS... (the allowance's mispredicted prefills; over every rows directory here and in
# ../pd_decode_look_2026-12-03/).
