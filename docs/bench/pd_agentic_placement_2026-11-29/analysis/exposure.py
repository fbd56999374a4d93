"""Q1: how many inter-token gaps can contain a new arrival's work.
For each run: per decode replica, at each decode leg's start (first token), the other streams
decoding on that replica; fleet-wide, at each turn's send, the streams decoding anywhere.
Expressed as a share of all gaps (p99 = the slowest 1% of gaps). Correlated with ITL p99 over runs.
usage: python3 exposure.py"""
import bisect, statistics as st
from common import *
from itl_conc import analyse, conc_fn

def exposure(rows):
    R = ok(rows)
    gaps = GAPS * len(R)
    same, fleet = 0, 0
    allf = conc_fn([(r["sent_s"] + r["ttft_s"], r["sent_s"] + r["e2e_s"]) for r in R])
    per = {}
    for rp in {r["replica"] for r in R}:
        per[rp] = conc_fn([(r["sent_s"] + r["ttft_s"], r["sent_s"] + r["e2e_s"]) for r in R if r["replica"] == rp])
    for r in R:
        t = r["sent_s"] + r["ttft_s"]
        same += per[r["replica"]][3](t - 1e-6)      # others already decoding there
        fleet += allf[3](r["sent_s"])
    return same / gaps * 100, fleet / gaps * 100

def corr(x, y):
    mx, my = st.mean(x), st.mean(y)
    return sum((a-mx)*(b-my) for a, b in zip(x, y)) / (sum((a-mx)**2 for a in x) * sum((b-my)**2 for b in y)) ** .5

if __name__ == "__main__":
    pts = []
    print("run    seed router  ITLp99 | tok_conc pred_p99(model 8+0.1n) | same-replica arrivals hit % of gaps | fleet sends hit %")
    for run in ("landed", "lost", "active"):
        sm = summary(run)
        for seed in range(1, 6):
            for n in ROUTERS:
                rows = load(run, n, seed)
                o = analyse(rows)
                a, b = exposure(rows)
                p = sm[n][seed]["itl_p99_ms"]
                pts.append((n, p, o["tok_conc_mean"], a, b, o["pred_p99"]))
                print(f"{run:6s} {seed}  {SHORT[n]:6s} {p:6.2f} | {o['tok_conc_mean']:.2f}  {o['pred_p99']:.2f} | {a:.2f} | {b:.2f}")
    for lab, i in (("tok_conc", 2), ("same-replica hit%", 3), ("fleet hit%", 4)):
        print(f"corr(ITL p99, {lab}) all runs {corr([p[1] for p in pts], [p[i] for p in pts]):+.2f}",
              " | within sluice", f"{corr([p[1] for p in pts if p[0]==ROUTERS[0]], [p[i] for p in pts if p[0]==ROUTERS[0]]):+.2f}",
              " | within vllm", f"{corr([p[1] for p in pts if p[0]==ROUTERS[1]], [p[i] for p in pts if p[0]==ROUTERS[1]]):+.2f}")
    for n in ROUTERS:
        print(n, "mean ITL p99 over 15 runs", round(st.mean(p[1] for p in pts if p[0] == n), 3))
    d = [pts[i][1] - pts[i + 1][1] for i in range(0, len(pts), 2)]
    print("paired sluice-vllm ITL p99 diffs (ms):", [round(x, 2) for x in d])
    print(f"mean {st.mean(d):+.3f} sd {st.stdev(d):.3f} sluice higher in {sum(x > 0 for x in d)}/{len(d)}")
    v = {}
    for run in ("landed", "lost", "active"):
        for seed in range(1, 6): v.setdefault(seed, []).append(summary(run)[ROUTERS[1]][seed]["itl_p99_ms"])
    print("vllm-router alone, same seed over the 3 run sets (ms):", {s: x for s, x in v.items()})
