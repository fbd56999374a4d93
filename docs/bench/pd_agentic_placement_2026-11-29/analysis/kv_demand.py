"""Q1 side check: KV tokens held by decoding streams per decode replica (2,048 blocks x 16 = 32,768 tokens).
Stream held from (sent+ttft) to (sent+e2e) with prompt+48 tokens. usage: python3 kv_demand.py"""
from common import *
for run in ["landed"]:
    for seed in range(1, 6):
        for n in ROUTERS:
            R = ok(load(run, n, seed))
            out = []
            for rp in sorted({r["replica"] for r in R}):
                ev = sorted([(r["sent_s"] + r["ttft_s"], r["prompt_tokens"] + 48 - 2992) for r in R if r["replica"] == rp] +
                            [(r["sent_s"] + r["e2e_s"], -(r["prompt_tokens"] + 48 - 2992)) for r in R if r["replica"] == rp])
                cur = mx = 2992  # shared 2,992-token system prefix counted once
                for _, d in ev:
                    cur += d; mx = max(mx, cur)
                out.append(mx)
            print(run, seed, SHORT[n], "max KV tokens held per decode replica", out)
