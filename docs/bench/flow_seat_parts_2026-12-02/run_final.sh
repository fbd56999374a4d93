exec 9>/tmp/bench.lock; flock 9
cd /work/main
for seed in 1 2 3; do
  python3 benches/e2e/flow.py --bin /tmp/sluice-new2 --seed $seed --capacity 56.3 --only skew_2gw_redis \
    --requests-dir /tmp/skew/new2_s$seed --json /tmp/skew/new2_s$seed.json > /tmp/skew/new2_s$seed.out 2>&1
  echo "skew new2 $seed $?" >> /tmp/b3.log
done
for seed in 1 2; do
  python3 benches/e2e/flow.py --bin /tmp/sluice-new2 --seed $seed --capacity 56.3 --only fair_2gw_redis \
    --json /tmp/fair/new2_s$seed.json > /tmp/fair/new2_s$seed.out 2>&1
  echo "fair new2 $seed $?" >> /tmp/b3.log
done
python3 benches/e2e/pd.py --routers-venv /tmp/routers --workloads chat --seeds 1,2,3,4,5 --requests 400 \
  --gateways 3 --only sluice-pd sluice-pd-3gw vllm-pd-cache_aware --gateway-bin /tmp/sluice-new2 \
  --json /tmp/pdgw/chat.json > /tmp/pdgw/chat.log 2>&1
echo "pd chat $?" >> /tmp/b3.log
python3 benches/e2e/pd.py --routers-venv /tmp/routers --workloads retrieval --seeds 1,2,3 --requests 400 \
  --gateways 3 --only sluice-pd sluice-pd-3gw vllm-pd-cache_aware --gateway-bin /tmp/sluice-new2 \
  --json /tmp/pdgw/retrieval.json > /tmp/pdgw/retrieval.log 2>&1
echo "pd retrieval $?" >> /tmp/b3.log
