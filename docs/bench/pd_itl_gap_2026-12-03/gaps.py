#!/usr/bin/env python3
"""Which streams had an inter-token gap over 100 ms, and what their decode
replica was doing then: the requests prefilled locally on that replica
(`pd` not `remote`) whose prefill spans the gap's end (`stalled_streams` in
benches/e2e/pd.py, which also reports their counts per run).

    python3 gaps.py ROWS.jsonl[.gz] ...   (rows of `pd.py --requests-dir`, written
                                           by a `sluice bench` that records itl_max_s)
"""
import gzip
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "benches", "e2e"))
from pd import stalled_streams  # noqa: E402


def rows(path):
    op = gzip.open if path.endswith(".gz") else open
    with op(path, "rt") as f:
        return [json.loads(line) for line in f]


def via(x):
    return f" via gateway {x['gateway']}" if "gateway" in x else ""


for path in sys.argv[1:]:
    rs = rows(path)
    local = [r for r in rs if r.get("pd") not in (None, "remote") and r.get("ttft_s") is not None]
    print(f"{path}: {len(rs)} requests, {len(local)} prefilled on their decode replica")
    for r, during in stalled_streams(rs):
        print(f"  request {r['i']} ({r.get('pd')}{via(r)}) on {r.get('backend')}: gap {r['itl_max_s'] * 1e3:.1f} ms "
              f"ending at {r['itl_max_end_s']:.3f} s; local prefills there then: "
              + (", ".join(f"{x['i']} ({x['pd']}{via(x)}, {x['prompt_tokens'] - (x.get('cached_tokens') or 0)} "
                           f"uncached tokens, {x['sent_s']:.3f}-{x['sent_s'] + x['ttft_s']:.3f} s)"
                           for x in during) or "none"))
