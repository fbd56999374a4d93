#!/usr/bin/env python3
"""Each stream stalled over 100 ms (pd.py stalled_streams) with the local prefills on its decode
replica while its gap ended: python3 stalls_by_prefill.py rows_look2_3gw/*sluice*.jsonl.gz"""
import gzip
import json,sys
import os; sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '../../../benches/e2e'))
from pd import stalled_streams
for path in sys.argv[1:]:
    rows=[json.loads(l) for l in (gzip.open(path, 'rt') if path.endswith('.gz') else open(path))]
    print(path.split('/')[-1])
    for r, during in stalled_streams(rows):
        start = r["sent_s"] + (r["ttft_s"] or 0)
        for x in during:
            print(f"  stream gw{r.get('gateway')} first token {start:7.2f} gap {r['itl_max_s']*1e3:5.0f} ms ends {r['itl_max_end_s']:7.2f} | local {x['pd']:18s} gw{x.get('gateway')} sent {x['sent_s']:7.2f} ttft {x['ttft_s']*1e3:5.0f} ms uncached {x['prompt_tokens']-(x['cached_tokens'] or 0):6d} started {'BEFORE' if start < x['sent_s'] else 'after'}")
