"""The 30 slowest requests of a prefix-cell run (rows from matrix.py --requests-dir):
why each waited. usage: python3 coldtail.py FILE.jsonl[.gz] [K]"""
import gzip, json, sys
path = sys.argv[1]; K = int(sys.argv[2]) if len(sys.argv) > 2 else 30
op = gzip.open if path.endswith(".gz") else open
rows = sorted((json.loads(l) for l in op(path, "rt")), key=lambda r: r["sent_s"])
rows = [r for r in rows if r.get("ttft_s") is not None]
first = {}
for r in rows: first.setdefault(r["prefix"], r)
cold = [r for r in rows if r["cached_tokens"] < 0.5 * r["prompt_tokens"]]
def colds_on(rep, t, me):
    return [c for c in cold if c is not me and c["replica"] == rep and c["sent_s"] <= t < c["sent_s"] + c["ttft_s"]]
top = sorted(rows, key=lambda r: -r["ttft_s"])[:K]
cats = {}
for r in sorted(top, key=lambda r: r["sent_s"]):
    if first[r["prefix"]] is r: cat = "first"
    elif r["cached_tokens"] < 0.5 * r["prompt_tokens"]:
        cat = "cold_again"
    else:
        cs = colds_on(r["replica"], r["sent_s"], r)
        same = [c for c in cs if c["prefix"] == r["prefix"]]
        cat = "behind_own_cold" if same else ("behind_other_cold" if cs else "other")
    cats[cat] = cats.get(cat, 0) + 1
    cs = colds_on(r["replica"], r["sent_s"], r)
    print(f"{r['sent_s']:7.3f}s ttft {r['ttft_s']*1e3:6.1f} p{r['prefix']:<3} {r['replica'][-5:]} cached {r['cached_tokens']:5d}/{r['prompt_tokens']} {cat:18s} colds there: {len(cs)} {[ (c['prefix'], round(c['sent_s'],2)) for c in cs]}")
n = len(rows); k = min(n, max(1, -(-99 * n // 100)))
print("p99", round(sorted(r["ttft_s"] for r in rows)[k - 1] * 1e3, 1), "ms;", cats)
reps = sorted({r["replica"] for r in rows})
print("homes (first requests) per replica:", {rp[-5:]: sum(1 for f in first.values() if f["replica"] == rp) for rp in reps})
print("cold prefills per replica in first 3 s:", {rp[-5:]: sum(1 for c in cold if c["replica"] == rp and c["sent_s"] < 3) for rp in reps})
