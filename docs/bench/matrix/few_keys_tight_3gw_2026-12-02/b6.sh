exec 9>/tmp/bench.lock; flock 9
cd /work/main
python3 benches/e2e/matrix.py --cells few_keys_tight few_keys_tight_3gw --seeds 1,2 --only sluice \
  --bin /tmp/sluice-new2 --json /tmp/mx3/matrix.json > /tmp/mx3/matrix.log 2>&1
echo "mx3 $?" >> /tmp/b3.log
