exec 9>/tmp/bench.lock; flock 9
cd /work/main
python3 benches/e2e/pd.py --workloads retrieval --seeds 2 --requests 400 --gateways 3 --only sluice-pd sluice-pd-3gw \
  --requests-dir /tmp/pdgw/rows --json /tmp/pdgw/rows.json > /tmp/pdgw/rows.log 2>&1
echo "rows $?" >> /tmp/b3.log
