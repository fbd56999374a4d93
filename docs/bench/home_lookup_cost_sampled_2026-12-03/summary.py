#!/usr/bin/env python3
"""Per round, the shared homes' setting against `shared_homes: false` (the same Redis table
without prefix homes, run in the same round): throughput ratio, gateway and Redis CPU per
request added, TTFT p50 added at 500 req/s; then per build the medians and ranges.

    python3 summary.py [DIR] [BUILD ...]   (reads DIR/{1,2}_{BUILD}.json; default: here,
                                           head sampled)
"""
import json
import os
import statistics
import sys

HERE = sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.abspath(__file__))
BUILDS = sys.argv[2:] or ["head", "sampled"]
S, H = "redis, sessions only", "redis, shared homes (default)"
NAMES = ["throughput vs shared_homes: false", "gateway CPU us / request added",
         "Redis CPU us / request added", "TTFT p50 at 500 req/s added, ms", "lookups a round"]
for build in BUILDS:
    rows = []
    for run in (1, 2):
        with open(os.path.join(HERE, f"{run}_{build}.json")) as f:
            r = json.load(f)["runs"]
        for h, s in zip(r[H], r[S]):
            rows.append((h["req_per_s"] / s["req_per_s"],
                         1000 * (h["gateway_cpu_s_per_1000"] - s["gateway_cpu_s_per_1000"]),
                         1000 * (h["redis_cpu_s_per_1000"] - s["redis_cpu_s_per_1000"]),
                         h["paced_ttft_p50_ms"] - s["paced_ttft_p50_ms"],
                         sum(v for k, v in h["home_store"].items()
                             if k.startswith("place/") and k != "place/novel")))
    print(f"== {build}: {len(rows)} rounds")
    for j, name in enumerate(NAMES):
        xs = [row[j] for row in rows]
        print(f"  {name}: median {statistics.median(xs):.2f}, range {min(xs):.2f} to {max(xs):.2f}; "
              + " ".join(f"{x:.2f}" for x in xs))
