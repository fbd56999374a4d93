"""Q1: decode-leg concurrency per decode replica and per-turn ITL, Sluice vs vllm-router.
usage: python3 itl_conc.py [landed|lost|active ...]"""
import sys, bisect, statistics as st
from common import *

def streams(rows):
    # decode leg of a turn: first token .. last token, on its decode replica
    return [(r["sent_s"] + r["ttft_s"], r["sent_s"] + r["e2e_s"], r["replica"], r) for r in ok(rows)]

def conc_fn(iv):
    ev = sorted([(a, 1) for a, b in iv] + [(b, -1) for a, b in iv])
    ts, ns, n = [], [], 0
    for t, d in ev:
        n += d; ts.append(t); ns.append(n)
    def at(t):
        i = bisect.bisect_right(ts, t) - 1
        return ns[i] if i >= 0 else 0
    return ev, ts, ns, at

def tw(ts, ns, t0, t1):
    tot = 0.0
    for i in range(len(ts) - 1):
        a, b = max(ts[i], t0), min(ts[i + 1], t1)
        if b > a: tot += ns[i] * (b - a)
    return tot / (t1 - t0)

def analyse(rows):
    S = streams(rows)
    reps = sorted({s[2] for s in S})
    t0 = min(s[0] for s in S); t1 = max(s[1] for s in S)
    fn = {}
    for rp in reps:
        fn[rp] = conc_fn([(a, b) for a, b, r, _ in S if r == rp])
    allf = conc_fn([(a, b) for a, b, _, _ in S])
    # ttft-phase (prefill+transfer) concurrency, fleet-wide: a CPU/load proxy
    pf = conc_fn([(r["sent_s"], r["sent_s"] + r["ttft_s"]) for r in ok(rows)])
    out = {"dur": t1 - t0, "reps": {}}
    # time-weighted, per replica; imbalance = |n0-n1| time-weighted
    for rp in reps:
        _, ts, ns, at = fn[rp]
        out["reps"][rp] = {"tw_mean": tw(ts, ns, t0, t1), "max": max(ns), "turns": sum(1 for s in S if s[2] == rp)}
    # busy-time-weighted: mean streams on a replica while it has any
    for rp in reps:
        _, ts, ns, at = fn[rp]
        busy = sum(ts[i+1]-ts[i] for i in range(len(ts)-1) if ns[i] > 0)
        out["reps"][rp]["busy_mean"] = tw(ts, ns, t0, t1) * (t1 - t0) / busy
    # sampled imbalance over time, 10ms grid
    grid = [t0 + i * 0.01 for i in range(int((t1 - t0) / 0.01))]
    ats = [fn[rp][3] for rp in reps]
    diffs = [abs(ats[0](t) - ats[-1](t)) for t in grid] if len(reps) == 2 else [0]
    out["imb_mean"] = st.mean(diffs); out["imb_p99"] = pct(diffs, 0.99)
    out["tot_tw"] = tw(allf[1], allf[2], t0, t1); out["tot_max"] = max(allf[2])
    # token-weighted: per modelled gap, the streams on that replica (model: 8ms + 0.1ms*n)
    pred, seen, excess, per_turn = [], [], [], []
    for a, b, rp, r in S:
        at = fn[rp][3]
        g = (b - a) / GAPS
        ns = [at(a + (k + 0.5) * g) for k in range(GAPS)]
        seen += ns
        pred += [8.0 + 0.1 * n for n in ns]
        obs = g * 1e3
        pm = 8.0 + 0.1 * st.mean(ns)
        excess.append(obs - pm)
        per_turn.append((obs, rp, r, st.mean(ns), pf[3]((a + b) / 2)))
    out["tok_conc_mean"] = st.mean(seen)
    out["pred_p99"] = pct(pred, 0.99); out["pred_mean"] = st.mean(pred)
    out["turn_itl_mean"] = st.mean(p[0] for p in per_turn)
    out["turn_itl_p99"] = pct([p[0] for p in per_turn], 0.99)
    out["excess_mean"] = st.mean(excess)
    out["per_turn"] = per_turn
    out["rep_turn_p99"] = [pct([p[0] for p in per_turn if p[1] == rp], 0.99) for rp in reps]
    out["ttft_phase_tw"] = tw(pf[1], pf[2], t0, t1)
    return out

if __name__ == "__main__":
    for run in sys.argv[1:] or ["landed"]:
        sm = summary(run)
        print(f"== {run}")
        print("seed router ITLp50 ITLp99 | dur_s  per replica: tw_mean/busy_mean(max,turns)   | imb_mean imb_p99 | tok_conc model_mean model_p99 | turn-mean-ITL mean, p99 per replica, obs-model | ttft-phase tw")
        for seed in range(1, 6):
            for n in ROUTERS:
                o = analyse(load(run, n, seed))
                reps = " ".join(f"{v['tw_mean']:.2f}/{v['busy_mean']:.2f}({v['max']},{v['turns']}t)" for v in o["reps"].values())
                print(f"{seed}  {SHORT[n]:6s} {sm[n][seed]['itl_p50_ms']:6.2f} {sm[n][seed]['itl_p99_ms']:6.2f} | {o['dur']:5.1f}  {reps:40s} | {o['imb_mean']:.2f}  {o['imb_p99']:3d} | "
                      f"{o['tok_conc_mean']:.2f}  {o['pred_mean']:.3f} {o['pred_p99']:.2f} | {o['turn_itl_mean']:.3f} {'/'.join(f'{x:.2f}' for x in o['rep_turn_p99'])} {o['excess_mean']:+.3f} | {o['ttft_phase_tw']:.2f}")
