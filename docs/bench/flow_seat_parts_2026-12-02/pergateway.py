#!/usr/bin/env python3
"""Per gateway and tenant, from flow.py --requests-dir rows (plain or .gz):
served / sent in 5-s windows, and TTFT quantiles after the first 5 s.

    python3 pergateway.py DIR RUN SEED      e.g. . skew_2gw 1
"""
import collections
import glob
import gzip
import json
import os
import sys

d, run, seed = sys.argv[1], sys.argv[2], sys.argv[3]
for path in sorted(glob.glob(os.path.join(d, f"{run}_*_seed{seed}.jsonl*"))):
    who = os.path.basename(path)[len(run) + 1:].split("_seed")[0]
    if who.startswith("redis_"):  # skew_2gw_redis_* when run is skew_2gw
        continue
    op = gzip.open if path.endswith(".gz") else open
    with op(path, "rt") as f:
        rows = [json.loads(line) for line in f]
    served, sent = collections.Counter(), collections.Counter()
    for r in rows:
        w = int(r["sent_s"] // 5)
        sent[w] += 1
        served[w] += r.get("ttft_s") is not None
    ttft = sorted(r["ttft_s"] for r in rows if r.get("ttft_s") is not None and r["sent_s"] > 5)
    q = (lambda p: ttft[min(len(ttft) - 1, int(p * len(ttft)))]) if ttft else (lambda p: float("nan"))
    print(f"{who:10} served {sum(served.values())}/{len(rows)}  by 5 s: "
          + " ".join(f"{served[w]}/{sent[w]}" for w in sorted(sent))
          + f"  | TTFT after 5 s p10 {q(.1):.2f} p50 {q(.5):.2f} p90 {q(.9):.2f} s")
