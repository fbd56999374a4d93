#!/usr/bin/env python3
"""What makes the agentic TTFT tail through Sluice, from `pd.py --requests-dir` rows.

For each rows file: the 12 slowest turns (their PD decision and prefill replica); the
remote prefill legs' time per prefill replica in 10-s windows of the run (median and max,
ms: a replica whose queue is longer for tens of seconds makes the tail); and the local
prefills under running streams (`local_stall_budget`): how many, the tokens the decode
replica lacked by its own count (quartiles, max) and the 2,048-token chunks they made.

    python3 tail.py rows/*.jsonl[.gz]
"""
import collections
import gzip
import json
import statistics
import sys


def rows_of(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return [json.loads(line) for line in f]


for path in sys.argv[1:]:
    rows = rows_of(path)
    print(f"== {path}: {len(rows)} turns")
    slow = sorted(rows, key=lambda r: -(r["ttft_s"] or 0))[:12]
    print("  12 slowest:", dict(collections.Counter((r["pd"], r.get("prefill_backend")) for r in slow)))
    remote = [r for r in rows if r["pd"] == "remote"]
    for t0 in range(0, int(max(r["sent_s"] for r in rows)) + 1, 10):
        cells = []
        for b in sorted({r["prefill_backend"] for r in remote}):
            ms = [r["prefill_ms"] for r in remote if r["prefill_backend"] == b and t0 <= r["sent_s"] < t0 + 10]
            med = statistics.median(ms) if ms else 0
            cells.append(f"{b}: n={len(ms):3d} median {med:6.0f} max {max(ms, default=0):6.0f}")
        print(f"  {t0:3d}-{t0 + 10:3d} s  " + " | ".join(cells))
    local = [r for r in rows if r["pd"] == "local_stall_budget"]
    if local:
        lacked = sorted(r["prompt_tokens"] - r["cached_tokens"] for r in local)
        q = lambda f: lacked[int(f * (len(lacked) - 1))]
        chunks = sum(-(-u // 2048) for u in lacked)
        print(f"  local_stall_budget: {len(local)}, tokens lacked q1/median/q3/max "
              f"{q(0.25)}/{q(0.5)}/{q(0.75)}/{lacked[-1]}, over 2,048: "
              f"{sum(u > 2048 for u in lacked)}, chunks {chunks}")
