"""Q2: the turns that make the TTFT tail (landed seed 5 by default).
usage: python3 tail5.py [run] [seed] [router] [k]"""
import sys
from common import *
run = sys.argv[1] if len(sys.argv) > 1 else "landed"
seed = int(sys.argv[2]) if len(sys.argv) > 2 else 5
router = sys.argv[3] if len(sys.argv) > 3 else "sluice-pd"
k = int(sys.argv[4]) if len(sys.argv) > 4 else 12
rows = load(run, router, seed)
R = ok(rows)
by = {}
for r in rows:
    by.setdefault(r["session"], {})[r["turn"]] = r
tt = sorted(r["ttft_s"] for r in R)
p99 = pct(tt, 0.99)
print(f"{run} seed {seed} {router}: {len(R)} ok turns, TTFT p99 {p99*1e3:.0f} ms (rank {tt.index(p99)+1})")

def inflight(t, key, val):
    # turns in their TTFT phase (sent .. first token) on that replica at time t
    return sum(1 for r in R if r.get(key) == val and r["sent_s"] <= t < r["sent_s"] + r["ttft_s"])

print("sess turn tool  sent_s  ttft_ms prefill_ms rest_ms | prefill_be  reason   pf_cached/prompt  prev_prompt prev_pf_be | dec  | inflight@sent: same-pf other-pf same-dec")
pbs = sorted({r["prefill_backend"] for r in R if r.get("prefill_backend")})
for r in sorted(R, key=lambda r: -r["ttft_s"])[:k]:
    prev = by[r["session"]].get(r["turn"] - 1)
    pb = r.get("prefill_backend")
    other = [p for p in pbs if p != pb]
    pm = r.get("prefill_ms") or 0
    print(f"{r['session']:4d} {r['turn']:4d} {str(r['tool'])[0]}  {r['sent_s']:7.2f} {r['ttft_s']*1e3:7.0f} {pm:9.0f} {r['ttft_s']*1e3-pm:7.0f} | "
          f"{(pb or '-')[-5:]:>6s} {str(r.get('prefill_route_reason')):12s} {str(r.get('prefill_cached_tokens')):>6s}/{r['prompt_tokens']:<6d} "
          f"{(prev or {}).get('prompt_tokens', '-')!s:>6s} {str((prev or {}).get('prefill_backend') or '-')[-5:]:>6s} | {r['replica'][-5:]} | "
          f"{inflight(r['sent_s'], 'prefill_backend', pb) if pb else '-'} {inflight(r['sent_s'], 'prefill_backend', other[0]) if other else '-'} {inflight(r['sent_s'], 'replica', r['replica'])}")
