# 2026-12-03 (night), the 2 vCPU Intel Xeon VM, 24 GiB; one benchmark or build at a time (/tmp/bench.lock).
# A trickle of shared prefixes while the gateways sample (issue 32): per gateway 220 distinct
# prompts a second (the sampling on after ~5 s) and 0.2 shared-prefix prompts a second over 16
# prefixes, 45 s a run, six rounds. `sampled`: target/release/sluice (9accaff, also the load
# generator and the replicas); `every lookup`: 5430d5b, the build before the sampling
# (/tmp/sluice-5430d5b); `memory`: each gateway's own table.
cd "$(git rev-parse --show-toplevel)"
d=docs/bench/sampled_trickle_2026-12-03
python3 benches/e2e/sampled_shared.py --unsampled-bin /tmp/sluice-5430d5b --rounds 6 --seconds 45 \
  --shared-rate 0.2 --prefixes 16 --json $d/sampled_trickle.json > $d/sampled_trickle.txt 2> $d/sampled_trickle.log
# Then the switch itself: this build with routing.prefix_kv.shared_homes_sampled: false
# (`every lookup`) against the default (`sampled`), the same workload, six rounds (20:31 on;
# target/release/sluice built from the commit that adds the switch):
python3 benches/e2e/sampled_shared.py --only sampled "every lookup" --rounds 6 --seconds 45 \
  --shared-rate 0.2 --prefixes 16 --json $d/switch.json > $d/switch.txt 2> $d/switch.log
