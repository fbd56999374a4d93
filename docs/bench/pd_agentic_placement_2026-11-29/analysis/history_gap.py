"""How far a session turn's cached prefill tokens fall short of its earlier turn's prompt,
on the prefill replica that served both (reason `session`), Sluice's rows, all seeds of a run:
the gaps in 16-token blocks. Gaps of 0-2 blocks are the earlier prompt's partial last block
and the chat template's join, not evictions.
usage: python3 history_gap.py [landed|lost|active|slack|ahead]"""
import collections, sys
from common import *

run = sys.argv[1] if len(sys.argv) > 1 else "landed"
gaps = collections.Counter()
for seed in range(1, 6):
    by = collections.defaultdict(list)
    for r in ok(load(run, "sluice-pd", seed)):
        by[r["session"]].append(r)
    for rs in by.values():
        rs.sort(key=lambda r: r["turn"])
        for a, b in zip(rs, rs[1:]):
            if b.get("prefill_route_reason") == "session" and b.get("prefill_cached_tokens") is not None:
                gaps[min((a["prompt_tokens"] - b["prefill_cached_tokens"]) // 16, 20)] += 1
n = sum(gaps.values())
small = sum(v for k, v in gaps.items() if k <= 2)
print(f"{run}: {n} turns; gap in blocks (20 = 20 or more): {sorted(gaps.items())}")
print(f"0-2 blocks: {small} ({100 * small / n:.1f}%); 3+ blocks: {n - small}")
