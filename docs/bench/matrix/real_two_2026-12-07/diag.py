"""Join a `real_fleet.py` run of Sluice with its access log (by the
`x-request-id` the benchmark sends: each request's number): each request's
route reason and replica beside its TTFT and the cached tokens the engine
reported; the decisions' counts; the requests routed for a prefix routing
counted cached (`affinity`) that found it cached (over 100 tokens); and the
requests sent in a window of seconds.
Usage: python3 diag.py RUN.json ACCESS.jsonl[.gz] [FROM TO]
(the run of this directory: diag_seed3_access_81bb6c7.json
diag_seed3_access.jsonl.gz 172 190)"""
import collections
import gzip
import json
import sys

run = json.load(open(sys.argv[1]))["runs"]["sluice"][0]["per_request"]
opener = gzip.open if sys.argv[2].endswith(".gz") else open
log = {int(line["request_id"]): line for line in map(json.loads, opener(sys.argv[2], "rt"))}
lo, hi = (float(sys.argv[3]), float(sys.argv[4])) if len(sys.argv) > 4 else (0.0, -1.0)
print("decisions:", dict(collections.Counter(e["route_reason"] for e in log.values())))
affinity = [i for i, e in log.items() if e["route_reason"] == "affinity"]
print(f"affinity: {len(affinity)}, found cached: "
      f"{sum(1 for i in affinity if (run[i]['cached'] or 0) > 100)}")
replicas = {}
for i, r in enumerate(run):
    e = log.get(i, {})
    n = replicas.setdefault(e.get("backend"), len(replicas))
    if lo <= r["sent_s"] <= hi:
        print(f"{i:4d} sent {r['sent_s']:8.3f} s  prefix {r['prefix']}  replica {n}  "
              f"{e.get('route_reason')}  TTFT {r['ttft_ms']} ms  cached {r['cached']}")
