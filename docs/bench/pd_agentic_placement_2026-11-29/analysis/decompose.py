"""Q1: split the extra streams a token shares its decode replica with into 'more overlap' (fleet total)
and 'imbalance' (split between the two decode replicas). Token-weighted streams per replica =
integral(n0^2+n1^2)/integral(n0+n1); balanced counterfactual uses ceil/floor(N/2).
Also: share of busy time with |n0-n1|>=3. usage: python3 decompose.py [run...]"""
import sys
from common import *

def run1(rows):
    R = ok(rows)
    reps = sorted({r["replica"] for r in R})
    ev = sorted([(r["sent_s"] + r["ttft_s"], reps.index(r["replica"]), 1) for r in R] +
                [(r["sent_s"] + r["e2e_s"], reps.index(r["replica"]), -1) for r in R])
    n = [0, 0]; last = ev[0][0]
    I = {"N": 0.0, "sq": 0.0, "bal": 0.0, "busy": 0.0, "imb3": 0.0, "tN": 0.0}
    for t, i, d in ev:
        dt = t - last; N = n[0] + n[1]
        if dt > 0 and N > 0:
            a, b = -(-N // 2), N // 2
            I["N"] += N * dt; I["sq"] += (n[0]**2 + n[1]**2) * dt; I["bal"] += (a*a + b*b) * dt
            I["busy"] += dt; I["imb3"] += dt if abs(n[0]-n[1]) >= 3 else 0
        last = t; n[i] += d
    dur = ev[-1][0] - ev[0][0]
    return I["N"] / dur, I["sq"] / I["N"], I["bal"] / I["N"], I["imb3"] / I["busy"] * 100

if __name__ == "__main__":
    for run in sys.argv[1:] or ["landed", "lost"]:
        print(f"== {run}: fleet streams (time mean) | token-weighted streams on own replica: actual, if balanced | % busy time |n0-n1|>=3")
        for seed in range(1, 6):
            line = []
            for n in ROUTERS:
                a, b, c, d = run1(load(run, n, seed))
                line.append(f"{SHORT[n]:6s} {a:.2f} | {b:.2f} {c:.2f} | {d:4.1f}%")
            print(seed, "   ".join(line))
