"""Q2: prefill replicas over time through Sluice (landed seed 5 by default): per 4 s window and
replica, turns sent, uncached prompt tokens sent (prompt - prefill_cached_tokens, = prefill work
at 0.1 ms/token), evicted histories (same replica as previous turn but cached < 50% of previous
prompt), rehomes, sessions homed (most turns) among those under way, and the worst TTFT.
usage: python3 prefill_load.py [run] [seed] [window_s]"""
import sys
from common import *
run = sys.argv[1] if len(sys.argv) > 1 else "landed"
seed = int(sys.argv[2]) if len(sys.argv) > 2 else 5
W = float(sys.argv[3]) if len(sys.argv) > 3 else 4.0
rows = load(run, "sluice-pd", seed)
R = [r for r in ok(rows)]
by = {}
for r in rows:
    by.setdefault(r["session"], {})[r["turn"]] = r
pbs = sorted({r["prefill_backend"] for r in R if r.get("prefill_backend")})
def evicted(r):
    p = by[r["session"]].get(r["turn"] - 1)
    return (p is not None and p.get("prefill_backend") == r.get("prefill_backend") and r.get("prefill_cached_tokens") is not None
            and r["prefill_cached_tokens"] < 0.5 * p["prompt_tokens"])
span = {}
for s, t in by.items():
    ts = [r["sent_s"] for r in t.values()]
    on = {}
    for r in t.values():
        if r.get("prefill_backend"): on[r["prefill_backend"]] = on.get(r["prefill_backend"], 0) + 1
    span[s] = (min(ts), max(ts), max(on, key=on.get) if on else None)
tot = {pb: [0, 0, 0, 0] for pb in pbs}
print(f"{run} seed {seed} sluice-pd, prefill replicas {[p[-5:] for p in pbs]}")
print("  t_s  | per replica: turns, uncached ktok (=s of prefill), evicted, rehome, sessions homed | worst TTFT ms")
end = max(r["sent_s"] for r in R)
t = 0.0
while t < end:
    cells = []
    for pb in pbs:
        w = [r for r in R if t <= r["sent_s"] < t + W and r.get("prefill_backend") == pb]
        unc = sum(r["prompt_tokens"] - (r.get("prefill_cached_tokens") or 0) for r in w)
        ev = sum(1 for r in w if evicted(r)); rh = sum(1 for r in w if r.get("prefill_route_reason") == "rehome")
        homed = sum(1 for a, b, h in span.values() if a <= t + W and b >= t and h == pb)
        cells.append(f"{len(w):3d} {unc/1e3:5.1f} {ev:2d} {rh:2d} {homed:2d}")
        for i, v in enumerate((len(w), unc, ev, rh)): tot[pb][i] += v
    worst = max((r["ttft_s"] for r in R if t <= r["sent_s"] < t + W), default=0)
    print(f"{t:5.0f}  | " + "  ||  ".join(cells) + f" | {worst*1e3:6.0f}")
    t += W
for pb in pbs:
    print(pb[-5:], "totals: turns %d, uncached tokens %d, evicted %d, rehome %d" % tuple(tot[pb]))
n = sum(1 for r in R if by[r["session"]].get(r["turn"] - 1, {}).get("prefill_backend") == r.get("prefill_backend") and r["turn"] > 0)
print(f"evicted histories: {sum(1 for r in R if evicted(r))} of {n} turns whose previous turn was prefilled on the same replica")
