exec 9>/tmp/bench.lock; flock 9
cd /work/main
python3 benches/e2e/matrix.py --routers-venv /tmp/routers --cells few_keys_3gw few_keys_tight_3gw --seeds 1,2,3,4,5 \
  --only sluice-shared --bin /tmp/sluice-final --requests-dir /tmp/b9/rows --json /tmp/b9/matrix.json > /tmp/b9/matrix.log 2>&1
echo "matrix $? $(date)" >> /tmp/b9/done.log
