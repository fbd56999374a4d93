exec 9>/tmp/bench.lock; flock 9
cd /work/main
python3 benches/e2e/matrix.py --routers-venv /tmp/routers --cells few_keys_tight_3gw few_keys_3gw --seeds 1,2,3,4,5 \
  --only sluice-shared sglang-cache_aware --bin /tmp/sluice-new --json /tmp/b7/matrix.json > /tmp/b7/matrix.log 2>&1
echo "matrix $? $(date)" >> /tmp/b7/done.log
for w in chat retrieval; do
python3 benches/e2e/pd.py --routers-venv /tmp/routers --workloads $w --seeds 1,2,3 --requests 400 --gateways 3 \
  --only sluice-pd sluice-pd-3gw-shared vllm-pd-cache_aware --gateway-bin /tmp/sluice-new \
  --requests-dir /tmp/b7/rows --json /tmp/b7/pd_$w.json > /tmp/b7/pd_$w.log 2>&1
echo "pd $w $? $(date)" >> /tmp/b7/done.log
done
python3 benches/e2e/matrix.py --cells few_keys_3gw --seeds 1,2,3 --only sluice --bin /tmp/sluice-new \
  --json /tmp/b7/matrix_alone.json > /tmp/b7/matrix_alone.log 2>&1
echo "alone $? $(date)" >> /tmp/b7/done.log
