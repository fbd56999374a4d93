exec 9>/tmp/bench.lock; flock 9
cd /work/main
for b in base new2; do
python3 benches/e2e/pd.py --workloads chat --seeds 1,2 --requests 400 --only sluice-pd --gateway-bin /tmp/sluice-$b \
  --json /tmp/pdgw/itl_$b.json > /tmp/pdgw/itl_$b.log 2>&1
echo "itl $b $?" >> /tmp/b3.log
done
