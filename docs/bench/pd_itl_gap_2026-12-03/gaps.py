#!/usr/bin/env python3
"""Which streams had an inter-token gap over 100 ms, and what their decode
replica was doing then: the requests prefilled locally on that replica
(`pd` not `remote`) whose prefill (sent to first token) spans the gap's end.

    python3 gaps.py ROWS.jsonl[.gz] ...   (rows of `pd.py --requests-dir`, written
                                           by a `sluice bench` that records itl_max_s)
"""
import gzip
import json
import sys


def rows(path):
    op = gzip.open if path.endswith(".gz") else open
    with op(path, "rt") as f:
        return [json.loads(line) for line in f]


for path in sys.argv[1:]:
    rs = rows(path)
    local = [r for r in rs if r.get("pd") not in (None, "remote") and r.get("ttft_s") is not None]
    print(f"{path}: {len(rs)} requests, {len(local)} prefilled on their decode replica")
    for r in sorted(rs, key=lambda r: -(r.get("itl_max_s") or 0)):
        if (r.get("itl_max_s") or 0) < 0.1:
            break
        end = r["itl_max_end_s"]
        during = [x for x in local if x.get("backend") == r.get("backend") and x["i"] != r["i"]
                  and x["sent_s"] <= end <= x["sent_s"] + x["ttft_s"] + 0.05]
        gw = lambda x: f" via gateway {x['gateway']}" if "gateway" in x else ""  # noqa: E731
        print(f"  request {r['i']} ({r.get('pd')}{gw(r)}) on {r.get('backend')}: gap {r['itl_max_s'] * 1e3:.1f} ms "
              f"ending at {end:.3f} s; local prefills there then: "
              + (", ".join(f"{x['i']} ({x['pd']}{gw(x)}, {x['prompt_tokens'] - (x.get('cached_tokens') or 0)} "
                           f"uncached tokens, {x['sent_s']:.3f}-{x['sent_s'] + x['ttft_s']:.3f} s)"
                           for x in during) or "none"))
