exec 9>/tmp/bench.lock; flock 9
cd /work/main
for seed in 1 2; do
  for b in base new; do
    python3 benches/e2e/flow.py --bin /tmp/sluice-$b --seed $seed --capacity 56.3 --only fair_2gw_redis \
      --json /tmp/fair/${b}_s$seed.json > /tmp/fair/${b}_s$seed.out 2>&1
    echo "$b $seed $?" >> /tmp/fair/done.log
  done
done
