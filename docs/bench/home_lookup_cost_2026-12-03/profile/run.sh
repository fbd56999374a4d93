#!/usr/bin/env bash
# Where a gateway with shared prefix homes spends its CPU on all-distinct prompts: perf
# (software clock, call graphs) on the gateway for 6 s while `sluice bench` drives it;
# 2026-12-03 ~07:21 UTC, a build whose routing code is b46e3d7's (run from this directory).
#   BIN=/path/to/sluice bash run.sh; then perf report -i perf.data --children --sort sym --stdio -g none
BIN=${BIN:-target/release/sluice}
redis-server --port 16399 --bind 127.0.0.1 --save "" --appendonly no > /dev/null & R=$!
$BIN sim --listen 127.0.0.1:16401 --profile fixed --prefill-delay 0ms --token-delay 0ms --output-tokens 16 2>/dev/null & S1=$!
$BIN sim --listen 127.0.0.1:16402 --profile fixed --prefill-delay 0ms --token-delay 0ms --output-tokens 16 2>/dev/null & S2=$!
printf 'routing:\n  policy: prefix_kv\n  sessions:\n    store: redis\n    redis: {url: "redis://127.0.0.1:16399"}\ntelemetry:\n  access_log: {enabled: false}\n' > gw.yaml
sleep 1
RUST_LOG=warn $BIN serve --config gw.yaml --backend http://127.0.0.1:16401 --backend http://127.0.0.1:16402 --listen 127.0.0.1:16410 --admin-listen 127.0.0.1:16411 2>/dev/null & G=$!
for i in $(seq 50); do curl -sf http://127.0.0.1:16411/readyz >/dev/null && break; sleep 0.1; done
perf record -F 2000 -g -p $G -o perf.data -- sleep 6 > perf.log 2>&1 &
P=$!
$BIN bench --url http://127.0.0.1:16410 --model sim-model --concurrency 32 --requests 60000 --max-tokens 16 --workload fixed --prompt-tokens 200 --quiet --json bench.json
wait $P
kill $G $S1 $S2 $R
echo done > done
