#!/usr/bin/env python3
"""The pd.py runs of a directory (this one, or the one given), one line each
(python3 summary.py [DIR] > DIR/summary.txt):
build and setting, seed, router, TTFT p50 / p99 and inter-token p99 (ms), streams
stalled over 100 ms (and how many under another gateway's local prefill), the local
prefills by reason, the looks by outcome; then per setting the medians and Sluice's
ratios to vllm-router's run of the same seed where one ran beside it."""
import glob
import json
import os
import statistics
import sys

here = sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.abspath(__file__))
rows = []
for path in sorted(glob.glob(os.path.join(here, "*.json"))):
    name = os.path.basename(path)[:-5]
    setting = name.split("_seed")[0]
    with open(path) as f:
        runs = json.load(f)["workloads"]["agentic"]["runs"]
    for router, rs in runs.items():
        for r in rs:
            rows.append((setting, r["seed"], router, r))
print(f"{'setting':10s} seed {'router':22s} {'p50':>7s} {'p99':>7s} {'ITL p99':>7s}  stalled  local_idle/stall_budget  looks")
for setting, seed, router, r in sorted(rows, key=lambda x: (x[0], x[1], x[2])):
    d = r.get("decisions") or {}
    st = r.get("stalls") or {}
    print(f"{setting:10s} {seed:4d} {router:22s} {r['ttft_p50_ms']:7.0f} {r['ttft_p99_ms']:7.0f} {r['itl_p99_ms']:7.2f}"
          f"  {st.get('streams', '-'):>3} ({st.get('by_another_gateway', '-')})"
          f"  {d.get('local_idle', 0):.0f}/{d.get('local_stall_budget', 0):.0f}  {r.get('looks') or ''}")
print()
for setting in sorted({s for s, _, _, _ in rows}):
    mine = {seed: r for s, seed, router, r in rows if s == setting and router.startswith("sluice")}
    peer = {seed: r for s, seed, router, r in rows if s == setting and router.startswith("vllm")}
    med = lambda k: statistics.median(r[k] for r in mine.values())  # noqa: E731
    stalled = statistics.median(r["stalls"]["streams"] for r in mine.values())
    line = (f"{setting:10s} seeds {sorted(mine)}: Sluice median p50 {med('ttft_p50_ms'):.0f}, p99 {med('ttft_p99_ms'):.0f},"
            f" ITL p99 {med('itl_p99_ms'):.2f} ms, stalled streams {stalled:.0f}")
    both = [s for s in mine if s in peer]
    if both:
        p99 = [peer[s]["ttft_p99_ms"] / mine[s]["ttft_p99_ms"] for s in both]
        p50 = [peer[s]["ttft_p50_ms"] / mine[s]["ttft_p50_ms"] for s in both]
        itl = [mine[s]["itl_p99_ms"] / peer[s]["itl_p99_ms"] for s in both]
        line += (f"; against vllm-router (seeds {sorted(both)}): p50 {min(p50):.2f}-{max(p50):.2f}x lower"
                 f" (median {statistics.median(p50):.2f}x), p99 {min(p99):.2f}-{max(p99):.2f}x (median"
                 f" {statistics.median(p99):.2f}x), ITL p99 {min(itl):.2f}-{max(itl):.2f}x vllm-router's")
    print(line)
