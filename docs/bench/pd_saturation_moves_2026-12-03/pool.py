#!/usr/bin/env python3
"""The prefill pool under saturation, from `pd.py --requests-dir` rows (Sluice's).

Per run: the prefill legs' route reasons (`rehome`: a session moved), where the 12 slowest
turns were prefilled, and per 10-s window and prefill replica the remote legs (n), the
sessions they belonged to (s), the uncached prompt tokens they prefilled there (unc), the
turns after a session's first that found at most the shared 2,992-token system prompt
cached there (lost: their history evicted) and the legs' median time (ms). Then the mean
over the windows 10-90 s of |median leg time of one replica - the other's| (imbalance).

    python3 pool.py rows/*.jsonl.gz
"""
import collections
import gzip
import json
import statistics
import sys

for path in sys.argv[1:]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        rows = [json.loads(line) for line in f]
    remote = [r for r in rows if r["pd"] == "remote"]
    slow = sorted(rows, key=lambda r: -(r["ttft_s"] or 0))[:12]
    print(f"== {path}: {len(rows)} turns, {len(remote)} remote,",
          dict(collections.Counter(r["prefill_route_reason"] for r in remote)))
    print("  12 slowest:", dict(collections.Counter((r["pd"], r.get("prefill_backend")) for r in slow)))
    backends = sorted({r["prefill_backend"] for r in remote})
    gaps, lost_all, later_all = [], 0, 0
    for t0 in range(0, int(max(r["sent_s"] for r in rows)) + 1, 10):
        cells, meds = [], []
        for b in backends:
            w = [r for r in remote if r["prefill_backend"] == b and t0 <= r["sent_s"] < t0 + 10]
            unc = sum(r["prompt_tokens"] - (r["prefill_cached_tokens"] or 0) for r in w)
            later = [r for r in w if r["turn"] > 0]
            lost = sum(1 for r in later if (r["prefill_cached_tokens"] or 0) <= 2992)
            lost_all, later_all = lost_all + lost, later_all + len(later)
            med = statistics.median([r["prefill_ms"] for r in w]) if w else 0
            meds.append(med)
            cells.append(f"n={len(w):3d} s={len({r['session'] for r in w}):2d} "
                         f"unc={unc / 1000:6.1f}k lost={lost:3d} med={med:5.0f}")
        if 10 <= t0 < 90 and len(meds) == 2:
            gaps.append(abs(meds[0] - meds[1]))
        print(f"  {t0:3d}-{t0 + 10:3d} s  " + " | ".join(cells))
    print(f"  imbalance 10-90 s: {statistics.mean(gaps):.0f} ms; history lost in "
          f"{lost_all}/{later_all} later turns ({100 * lost_all / max(later_all, 1):.0f}%)")
