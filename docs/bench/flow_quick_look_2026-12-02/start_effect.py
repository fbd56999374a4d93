#!/usr/bin/env python3
"""Premium's TTFT in the flood with seats learned, per build and seed, from the
rows in rows/ (flow.py --requests-dir): the requests sent in the first 5 s (the
start, before the gate knows the engines' seats) and the slowest two after.
`*_flood_learned_*`: the seats-bound fleet; `*_kvfull_flood_*`: the KV-full fleet
(seats learned in every run there).

    python3 start_effect.py
"""
import glob
import gzip
import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))
for path in sorted(glob.glob(os.path.join(HERE, "rows", "*_flood_learned_vip_seed*.jsonl.gz"))
                   + glob.glob(os.path.join(HERE, "rows", "*_kvfull_flood_vip_seed*.jsonl.gz"))):
    with gzip.open(path, "rt") as f:
        rows = [json.loads(line) for line in f]
    ok = [r for r in rows if r.get("ttft_s") is not None]
    early = [r["ttft_s"] * 1e3 for r in ok if r["sent_s"] < 5]
    late = sorted(r["ttft_s"] * 1e3 for r in ok if r["sent_s"] >= 5)
    print(f"{os.path.basename(path)[:-9]:32} first 5 s: {len(early):2} requests, mean {sum(early) / len(early):4.0f} ms,"
          f" max {max(early):4.0f} ms | after: slowest {late[-1]:4.0f}, second {late[-2]:4.0f} ms")
