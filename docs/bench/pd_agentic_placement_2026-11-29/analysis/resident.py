"""Q2: history tokens each prefill replica is asked to keep (sum over sessions under way of the last
prompt prefilled there, shared 2,992-token prefix counted once) vs its KV (2,048 x 16 = 32,768 tokens),
every 2 s; plus rehomes and sessions rehomed more than once.
usage: python3 resident.py [run] [seed]"""
import sys
from common import *
run = sys.argv[1] if len(sys.argv) > 1 else "landed"
seed = int(sys.argv[2]) if len(sys.argv) > 2 else 5
rows = sorted(ok(load(run, "sluice-pd", seed)), key=lambda r: r["sent_s"])
pbs = sorted({r["prefill_backend"] for r in rows if r.get("prefill_backend")})
last_turn = {}
for r in rows: last_turn[r["session"]] = max(last_turn.get(r["session"], 0), r["sent_s"])
t, end = 2.0, rows[-1]["sent_s"]
print("t_s   " + "   ".join(f"{p[-5:]}: sessions hist_ktok" for p in pbs))
while t <= end + 2:
    where = {}
    for r in rows:
        if r["sent_s"] > t: break
        if r.get("prefill_backend"): where[r["session"]] = (r["prefill_backend"], r["prompt_tokens"])
    cells = []
    for p in pbs:
        ss = [(s, n) for s, (b, n) in where.items() if b == p and last_turn[s] >= t - 1.0]
        cells.append(f"{len(ss):2d} {(sum(n - 2992 for _, n in ss) + 2992)/1e3:6.1f}")
    print(f"{t:5.0f}  " + "        ".join(cells))
    t += 4.0
reh = [r for r in rows if r.get("prefill_route_reason") == "rehome"]
per = {}
for r in reh: per[r["session"]] = per.get(r["session"], 0) + 1
print(f"rehomes {len(reh)}; sessions rehomed {len(per)}, of which more than once {sum(1 for v in per.values() if v > 1)}; "
      f"rehomed turns re-prefilled >=50% of history: {sum(1 for r in reh if (r.get('prefill_cached_tokens') or 0) < 0.5 * r['prompt_tokens'])}")
