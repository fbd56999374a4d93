exec 9>/tmp/bench.lock; flock 9
cd /work/main
python3 benches/e2e/matrix.py --routers-venv /tmp/routers --cells few_keys_3gw few_keys_tight_3gw --seeds 1,2,3,4,5 \
  --only sluice-shared sglang-cache_aware --bin /tmp/sluice-cold --requests-dir /tmp/b8/rows --json /tmp/b8/matrix.json > /tmp/b8/matrix.log 2>&1
echo "matrix $? $(date)" >> /tmp/b8/done.log
