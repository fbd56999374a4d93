#!/usr/bin/env python3
"""The allowance's mispredicted local prefills (issue 34): prompts prefilled on a busy decode
replica under `local_stall_budget` (routing's index predicted at most one 2,048-token chunk
uncached there) that the engine prefilled longer (its history evicted). Two candidate signals:
(1) a per-session memory: was the session's previous turn such a prefill on the same replica?
(2) the session's idle gap (from its previous turn's end to this turn): how many mispredicted
ones a gap threshold would catch and how many good local prefills it would send to the pool.

    python3 mispredicted.py ../pd_decode_look_2026-12-03/rows_look2_3gw/*sluice*.jsonl.gz
"""
import collections
import gzip
import json
import sys

CHUNK = 2048
mis, ok = [], []
prev_mis = 0
for path in sys.argv[1:]:
    with gzip.open(path, "rt") if path.endswith(".gz") else open(path) as f:
        rows = [json.loads(line) for line in f]
    sessions = collections.defaultdict(list)
    for r in rows:
        sessions[r["session"]].append(r)
    for turns in sessions.values():
        turns.sort(key=lambda r: r["turn"])
        for prev, r in zip(turns, turns[1:]):
            if r.get("pd") != "local_stall_budget":
                continue
            uncached = r["prompt_tokens"] - (r["cached_tokens"] or 0)
            gap = r["sent_s"] - (prev["sent_s"] + prev["e2e_s"])
            if uncached > CHUNK:
                mis.append(gap)
                prev_uncached = prev["prompt_tokens"] - (prev["cached_tokens"] or 0)
                if (prev.get("pd") or "").startswith("local") and prev["backend"] == r["backend"] \
                        and prev_uncached > CHUNK:
                    prev_mis += 1
            else:
                ok.append(gap)
print(f"local_stall_budget prefills of a session's later turns: {len(mis)} mispredicted, {len(ok)} as predicted")
print(f"(1) mispredicted whose session's previous turn was one too, on the same replica: {prev_mis} of {len(mis)}")
print("(2) idle gap threshold: mispredicted caught / as-predicted sent to the pool")
for t in (0.5, 1.0, 1.5, 2.0, 3.0):
    print(f"    > {t:.1f} s: {sum(g > t for g in mis)} of {len(mis)} / {sum(g > t for g in ok)} of {len(ok)}")
