#!/usr/bin/env python3
"""Per document: which prefill replicas prefilled it, the prefill legs' cache hit
and cold prefills, from pd.py --requests-dir rows (plain or .gz).

    python3 prefill_homes.py FILE...
"""
import collections
import gzip
import json
import sys

for path in sys.argv[1:]:
    op = gzip.open if path.endswith(".gz") else open
    with op(path, "rt") as f:
        rows = [json.loads(line) for line in f]
    remote = [r for r in rows if r.get("pd") == "remote"]
    by = collections.defaultdict(collections.Counter)
    for r in remote:
        by[r["prefix"]][r["prefill_backend"]] += 1
    hit = sum(r.get("prefill_cached_tokens") or 0 for r in remote) / max(1, sum(r["prompt_tokens"] for r in remote))
    cold = sum(1 for r in remote if (r.get("prefill_cached_tokens") or 0) < 1000)
    print(f"{path}: prefill hit {hit:.3f}, cold prefills {cold} of {len(remote)}, "
          f"prefill reasons {dict(collections.Counter(r.get('prefill_route_reason') for r in rows))}")
    for p in sorted(by):
        print(f"  document {p}: {dict(by[p])}")
