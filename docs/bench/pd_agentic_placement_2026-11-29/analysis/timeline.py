"""Q2: every turn sent through Sluice in a time window (landed seed 5, 44-60 s by default), by prefill replica:
send time, prefill leg done (sent+prefill_ms), uncached tokens, evicted flag, reason, TTFT.
usage: python3 timeline.py [run] [seed] [t0] [t1]"""
import sys
from common import *
run = sys.argv[1] if len(sys.argv) > 1 else "landed"
seed = int(sys.argv[2]) if len(sys.argv) > 2 else 5
t0 = float(sys.argv[3]) if len(sys.argv) > 3 else 44; t1 = float(sys.argv[4]) if len(sys.argv) > 4 else 60
rows = load(run, "sluice-pd", seed)
by = {}
for r in rows: by.setdefault(r["session"], {})[r["turn"]] = r
for r in sorted(ok(rows), key=lambda r: (r.get("prefill_backend") or "", r["sent_s"])):
    if not (t0 <= r["sent_s"] < t1): continue
    p = by[r["session"]].get(r["turn"] - 1, {})
    unc = r["prompt_tokens"] - (r.get("prefill_cached_tokens") or 0)
    ev = "EVICTED" if p and r.get("prefill_cached_tokens") is not None and r["prefill_cached_tokens"] < 0.5 * p["prompt_tokens"] else ""
    print(f"{(r.get('prefill_backend') or 'local')[-5:]:>6s} s{r['session']:<3d} t{r['turn']:<2d} sent {r['sent_s']:6.2f} done {r['sent_s'] + (r.get('prefill_ms') or 0)/1e3:6.2f} "
          f"uncached {unc:6d} ({r.get('prefill_cached_tokens')}/{r['prompt_tokens']}, prev {p.get('prompt_tokens','-')} on {(p.get('prefill_backend') or '-')[-5:]}) "
          f"{str(r.get('prefill_route_reason')):11s} ttft {r['ttft_s']*1e3:5.0f} {ev}")
