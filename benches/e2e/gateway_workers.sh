#!/usr/bin/env bash
# Gateway CPU per request at low load with N tokio worker threads, to tell
# whether cross-thread wake-ups cost anything (docs/benchmarks-log.md).
#
#   cargo build --release
#   bash benches/e2e/gateway_workers.sh 1 2 1 2     # worker counts, one run each
#
# Per run: a `sluice sim` (16 tokens, 20 ms apart), `sluice serve` in front with
# TOKIO_WORKER_THREADS=N, 200 streamed requests 4 at a time through it; prints
# the gateway's user+system CPU (from /proc, 10 ms ticks) per 1,000 requests.
# Loopback only; every process it starts is stopped by PID.
set -euo pipefail
cd "$(dirname "$0")/../.."
BIN=target/release/sluice
[ -x "$BIN" ] || { echo "build first: cargo build --release" >&2; exit 1; }
port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
conf=$(mktemp --suffix=.yaml)
printf 'telemetry:\n  access_log:\n    enabled: false\n' > "$conf"
trap 'rm -f "$conf"' EXIT
for workers in "$@"; do
  sim_port=$(port); api=$(port); admin=$(port)
  "$BIN" sim --listen "127.0.0.1:$sim_port" --profile fixed --prefill-delay 0ms \
    --token-delay 20ms --output-tokens 16 2>/dev/null & sim=$!
  TOKIO_WORKER_THREADS=$workers RUST_LOG=warn "$BIN" serve --config "$conf" \
    --backend "http://127.0.0.1:$sim_port" --listen "127.0.0.1:$api" \
    --admin-listen "127.0.0.1:$admin" 2>/dev/null & gw=$!
  for _ in $(seq 100); do
    curl -sf "http://127.0.0.1:$admin/readyz" >/dev/null && break
    sleep 0.1
  done
  run() { "$BIN" bench --url "http://127.0.0.1:$api" --model sim-model --concurrency "$1" \
    --requests "$2" --max-tokens 16 --workload fixed --quiet --json - >/dev/null; }
  run 1 5
  t0=$(awk '{print $14+$15}' "/proc/$gw/stat")
  run 4 200
  t1=$(awk '{print $14+$15}' "/proc/$gw/stat")
  echo "workers=$workers gateway CPU-s per 1000 requests: $(python3 -c "print(round(($t1-$t0)/100/200*1000, 2))")"
  kill "$gw" "$sim"
  wait "$gw" "$sim" 2>/dev/null || true
done
