#!/usr/bin/env bash
# Where a non-streamed request's CPU time goes, kernel included: `perf record`
# with the software clock (no hardware counters are needed, so it works in
# VMs without a PMU) on the gateway alone on CPU 1, while `sluice bench` and a
# fixed-timing `sluice sim` on CPU 0 drive N non-streamed requests (64 in
# flight, 32 tokens). Prints the split by shared object and the top symbols
# by self time. Complements `instructions.sh` (callgrind counts instructions
# but not cache misses, clock reads' cost or the kernel).
#
#   cargo build --release && apt-get install linux-perf
#   benches/e2e/perf_profile.sh [N] [OUT]        # default 65536 requests
#   BIN=/path/to/sluice EXTRA_YAML=$'flow_control:\n  enabled: false' benches/e2e/perf_profile.sh
#   CPU_QUOTA=0.25 benches/e2e/perf_profile.sh    # the gateway capped at a quarter of CPU 1
#                                                 # (a cgroup v1 cpu group; root): saturated
set -euo pipefail
N=${1:-65536}
OUT=${2:-$(mktemp -d)/perf.data}
BIN=${BIN:-$(dirname "$0")/../../target/release/sluice}
command -v perf >/dev/null || { echo "needs perf (apt-get install linux-perf)" >&2; exit 1; }
dir=$(mktemp -d)
port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
SIM_PORT=$(port); GW_PORT=$(port); ADMIN_PORT=$(port)
printf 'telemetry:\n  access_log:\n    enabled: false\n' > "$dir/gw.yaml"
if [ -n "${EXTRA_YAML:-}" ]; then printf '%s\n' "$EXTRA_YAML" >> "$dir/gw.yaml"; fi
taskset -c 0 "$BIN" sim --listen 127.0.0.1:$SIM_PORT --profile fixed --prefill-delay 0ms \
  --token-delay 0ms --output-tokens 32 2>/dev/null & SIM=$!
RUST_LOG=warn taskset -c 1 "$BIN" serve --config "$dir/gw.yaml" --backend http://127.0.0.1:$SIM_PORT \
  --listen 127.0.0.1:$GW_PORT --admin-listen 127.0.0.1:$ADMIN_PORT 2>/dev/null & GW=$!
CG=""
cleanup() {
  kill $SIM $GW 2>/dev/null || true
  if [ -n "$CG" ]; then wait $GW 2>/dev/null || true; rmdir "$CG" 2>/dev/null || true; fi
}
trap cleanup EXIT
for _ in $(seq 120); do
  curl -sf http://127.0.0.1:$ADMIN_PORT/readyz >/dev/null && break
  sleep 0.5
done
bench() {
  taskset -c 0 "$BIN" bench --url http://127.0.0.1:$GW_PORT --model sim-model --concurrency 64 \
    --max-tokens 32 --workload fixed --prompt-tokens 50 --no-stream --quiet --json - --requests "$1"
}
bench 2000 >/dev/null   # warm: connections, series, caches
if [ -n "${CPU_QUOTA:-}" ]; then
  CG=/sys/fs/cgroup/cpu/sluice_perf_profile_$$
  mkdir "$CG"
  echo 10000 > "$CG/cpu.cfs_period_us"
  quota=$(python3 -c "print(int($CPU_QUOTA * 10000))")
  echo "$quota" > "$CG/cpu.cfs_quota_us"
  echo $GW > "$CG/cgroup.procs"   # every thread of the gateway
fi
perf record -e cpu-clock -F 4999 -g -p $GW -o "$OUT" 2>/dev/null & PERF=$!
sleep 0.5               # perf attaches before the measured requests (it reports nothing while idle)
ok=$(bench "$N" | python3 -c 'import json,sys; print(json.load(sys.stdin)["ok"])')
kill -INT $PERF; wait $PERF || true
[ "$ok" = "$N" ] || { echo "only $ok of $N requests succeeded" >&2; exit 1; }
echo "# $N non-streamed requests, $OUT"
perf report -i "$OUT" --no-children --sort dso -g none 2>/dev/null | grep -v '^#' | grep -v '^$'
echo
perf report -i "$OUT" --no-children --sort dso,sym -g none 2>/dev/null | grep -v '^#' | grep -v '^$' | head -80
