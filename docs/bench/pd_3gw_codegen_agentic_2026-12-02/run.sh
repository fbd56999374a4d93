exec 9>/tmp/bench.lock; flock 9
cd /work/main
for w in codegen agentic; do
python3 benches/e2e/pd.py --routers-venv /tmp/routers --workloads $w --seeds 1,2,3 --requests 400 --gateways 3 \
  --only sluice-pd sluice-pd-3gw-shared vllm-pd-cache_aware --gateway-bin /tmp/sluice-cold \
  --requests-dir /tmp/b10/rows --json /tmp/b10/pd_$w.json > /tmp/b10/pd_$w.log 2>&1
echo "pd $w $? $(date)" >> /tmp/b10/done.log
done
