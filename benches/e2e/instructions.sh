#!/usr/bin/env bash
# User-space instructions per non-streamed request, counted by callgrind: a
# deterministic measure of the gateway's own work on that path (no noise from
# the shared machine), to compare commits. The replica (`sluice sim`) and the
# load generator run natively; only the gateway runs under valgrind.
#
#   benches/e2e/instructions.sh [REQUESTS] [OUT]
#   PACED=1 benches/e2e/instructions.sh [REQUESTS] [OUT]
#
# PACED=1: streamed requests instead, 32 at a time, 64 tokens at 20 ms each
# (the paced scenario of stream_overhead.py at a quarter of its streams),
# counted per token: the per-event work of the relay, hyper and tokio.
#
# NGINX=1: count nginx (one process, `master_process off`, the configuration
# of stream_overhead.py) in the gateway's place, for the floor's own figure.
#
# HTTP1=hyper: the gateway's API listener on hyper's HTTP/1.1 server
# (`server.http1: hyper`) instead of its own, to compare the two.
#
# EXTRA_YAML='...': more of the gateway's configuration, appended to its file
# (top-level keys other than `telemetry` and `server`), e.g. the features off:
#   EXTRA_YAML=$'routing:\n  policy: round_robin\n  sessions:\n    enabled: false\nflow_control:\n  enabled: false\n'
#
# CACHE=1: also simulate the caches (callgrind's cache model: a 32 KiB 8-way L1
# for instructions and one for data, and a 512 KiB 8-way last level standing for
# these EPYC cores' private L2) and print the misses per request. A model: it
# sees no hardware prefetch and not the kernel's writes into the read buffers,
# so read misses on freshly received bytes are counted that the machine does
# not take. Ratios between builds, and against nginx, are what it is for.
#
# LOCKS=1: also count the locked instructions the gateway executes per request
# (`lock`-prefixed and `xchg`: atomics, reference counts, mutexes), by function,
# from callgrind's per-instruction counts and the binary's disassembly
# (objdump). nginx's worker executes next to none; each costs tens of cycles
# and waits for the stores before it.
#
# Needs valgrind (`apt-get install valgrind`) and a release build. Prints the
# count per request and the functions of the request path by inclusive cost
# (per request); the full profile is left in OUT (callgrind_annotate OUT).
set -euo pipefail
PACED=${PACED:-0}
if [ "$PACED" = 1 ]; then N=${1:-96}; else N=${1:-5000}; fi
OUT=${2:-$(mktemp -d)/callgrind.out}
mkdir -p "$(dirname "$OUT")"
BIN=${BIN:-$(dirname "$0")/../../target/release/sluice}
command -v valgrind >/dev/null || { echo "needs valgrind (apt-get install valgrind)" >&2; exit 1; }
dir=$(mktemp -d)
port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
SIM_PORT=$(port); GW_PORT=$(port); ADMIN_PORT=$(port)
VG_CACHE=()
if [ "${CACHE:-0}" = 1 ]; then VG_CACHE=(--cache-sim=yes --I1=32768,8,64 --D1=32768,8,64 --LL=524288,8,64); fi
if [ "${LOCKS:-0}" = 1 ]; then VG_CACHE+=(--dump-instr=yes); fi
printf 'telemetry:\n  access_log:\n    enabled: false\n' > "$dir/gw.yaml"
if [ -n "${HTTP1:-}" ]; then printf 'server:\n  http1: %s\n' "$HTTP1" >> "$dir/gw.yaml"; fi
if [ -n "${EXTRA_YAML:-}" ]; then printf '%s\n' "$EXTRA_YAML" >> "$dir/gw.yaml"; fi
"$BIN" sim --listen 127.0.0.1:$SIM_PORT --profile fixed --prefill-delay 0ms --token-delay 0ms \
  --output-tokens 32 2>/dev/null & SIM=$!
if [ "$PACED" = 1 ]; then
  kill $SIM; wait $SIM 2>/dev/null || true
  "$BIN" sim --listen 127.0.0.1:$SIM_PORT --profile fixed --prefill-delay 0ms --token-delay 20ms \
    --output-tokens 64 2>/dev/null & SIM=$!
fi
if [ "${NGINX:-0}" = 1 ]; then
  mkdir -p "$dir/ngx"
  python3 - "$dir/ngx" "$SIM_PORT" "$GW_PORT" "$(dirname "$0")" > "$dir/ngx/nginx.conf" <<'PY'
import sys
sys.path.insert(0, sys.argv[4])
from stream_overhead import NGINX_CONF
d, sim, port = sys.argv[1:4]
print("master_process off;\n" + NGINX_CONF.format(workers=1, dir=d, sim_port=sim, port=port))
PY
  valgrind --tool=callgrind "${VG_CACHE[@]}" --callgrind-out-file="$OUT" "$(command -v nginx || echo /usr/sbin/nginx)" \
    -c "$dir/ngx/nginx.conf" -p "$dir/ngx" 2>"$dir/valgrind.err" & VG=$!
  ready=http://127.0.0.1:$GW_PORT/v1/models
else
  RUST_LOG=warn valgrind --tool=callgrind "${VG_CACHE[@]}" --callgrind-out-file="$OUT" "$BIN" serve --config "$dir/gw.yaml" \
    --backend http://127.0.0.1:$SIM_PORT --listen 127.0.0.1:$GW_PORT \
    --admin-listen 127.0.0.1:$ADMIN_PORT 2>"$dir/valgrind.err" & VG=$!
  ready=http://127.0.0.1:$ADMIN_PORT/readyz
fi
trap 'kill $SIM $VG 2>/dev/null || true' EXIT
for _ in $(seq 120); do
  curl -sf "$ready" >/dev/null && break
  sleep 0.5
done
bench() {
  if [ "$PACED" = 1 ]; then
    "$BIN" bench --url http://127.0.0.1:$GW_PORT --model sim-model --concurrency 32 --max-tokens 64 \
      --workload fixed --prompt-tokens 50 --quiet --json - --requests "$1"
  else
    "$BIN" bench --url http://127.0.0.1:$GW_PORT --model sim-model --concurrency 64 --max-tokens 32 \
      --workload fixed --prompt-tokens 50 --no-stream --quiet --json - --requests "$1"
  fi
}
if [ "$PACED" = 1 ]; then bench 32 >/dev/null; else bench 500 >/dev/null; fi   # warm: connections, series, caches
callgrind_control -z $VG >/dev/null       # count from here
ok=$(bench "$N" | python3 -c 'import json,sys; print(json.load(sys.stdin)["ok"])')
callgrind_control -d $VG >/dev/null       # dump the measured requests
kill -TERM $VG; wait $VG || true
profile=$(ls -t "$OUT".* | head -1)
python3 - "$profile" "$N" "$ok" "$PACED" <<'PY'
import re, subprocess, sys
path, n, ok, paced = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
assert ok == n, f"only {ok} of {n} requests succeeded"
summary = next(l.split()[1:] for l in open(path) if l.startswith(("summary:", "totals:")))
events = next(l.split()[1:] for l in open(path) if l.startswith("events:"))
total = int(summary[0])
unit = "token" if paced else "request"
if paced:
    n *= 64  # figures per token from here on
print(f"{total / n:.0f} instructions per {unit} ({sys.argv[2]} requests, {path})")
if "I1mr" in events:
    per = {e: int(v) / n for e, v in zip(events, summary)}
    print(f"misses per {unit}: " + ", ".join(
        f"{e} {per[e]:.1f}" for e in ("I1mr", "D1mr", "D1mw", "ILmr", "DLmr", "DLmw")))
out = subprocess.run(["callgrind_annotate", "--threshold=100", "--inclusive=yes", path],
                     capture_output=True, text=True).stdout
seen = set()
for line in out.splitlines():
    m = re.match(r"\s*([\d,]+) .*?:(sluice::[^\s\[]+)", line)
    if m and m.group(2) not in seen and int(m.group(1).replace(",", "")) / n >= (100 if paced else 400):
        seen.add(m.group(2))
        print(f"{int(m.group(1).replace(',', '')) / n:8.0f}  {m.group(2)}")
PY
if [ "${LOCKS:-0}" = 1 ] && [ "${NGINX:-0}" != 1 ]; then
  objdump -d --no-show-raw-insn "$BIN" | awk '/^ +[0-9a-f]+:\t(lock |xchg )/ { sub(":", "", $1); print $1 }' \
    > "$dir/locked.txt"
  python3 - "$profile" "$N" "$dir/locked.txt" <<'PY'
import collections, re, sys
path, n, locked = sys.argv[1], int(sys.argv[2]), sys.argv[3]
locks = {int(a, 16) for a in open(locked)}
names, objs = {}, {}
def name(table, v):
    m = re.match(r"\((\d+)\)(?: (.*))?$", v)
    if not m:
        return v
    if m.group(2):
        table[m.group(1)] = m.group(2)
    return table.get(m.group(1), v)
fn = ob = None
addr, after_call, per_fn = 0, False, collections.Counter()
for line in open(path):
    line = line.rstrip("\n")
    if line.startswith("ob="):
        ob = name(objs, line[3:])
    elif line.startswith("cob="):
        name(objs, line[4:])
    elif line.startswith("fn="):
        fn = name(names, line[3:])
    elif line.startswith("cfn="):
        name(names, line[4:])
    elif line.startswith("calls="):
        after_call = True  # the next cost line is the call's, inclusive
    elif line and line[0] in "0123456789+-*":
        parts = line.split()
        if len(parts) < 3:
            continue
        a = parts[0]
        if a.startswith("0x"):
            addr = int(a, 16)
        elif a[0] in "+-":
            addr += int(a, 0) if a[0] == "-" else int(a[1:], 0)
        if after_call:
            after_call = False
        elif ob and "sluice" in ob and addr in locks:
            per_fn[fn] += int(parts[2])
total = sum(per_fn.values())
print(f"locked instructions per request: {total / n:.0f} (in the binary; by function:)")
for f, c in per_fn.most_common(20):
    print(f"{c / n:8.1f}  {f[:110]}")
PY
fi
