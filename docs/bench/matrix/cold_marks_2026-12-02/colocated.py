"""Per run (rows from matrix.py --requests-dir): how many new prefixes' first requests
were placed on a replica where another prompt's cold prefill was under way
("colocated"), and how many of those had, at that moment, a replica with as few homes
(first requests placed there before) and no cold prefill under way ("avoidable": the
shared table's cold count would have sent it there). A request is cold when the engine
reported less than half its prompt cached; it is under way from its sending to its
first token. usage: python3 colocated.py FILE.jsonl[.gz] ..."""
import gzip, json, sys

total = [0, 0, 0]
for path in sys.argv[1:]:
    op = gzip.open if path.endswith(".gz") else open
    rows = sorted((json.loads(l) for l in op(path, "rt")), key=lambda r: r["sent_s"])
    rows = [r for r in rows if r.get("ttft_s") is not None]
    reps = sorted({r["replica"] for r in rows})
    first = {}
    for r in rows:
        first.setdefault(r["prefix"], r)
    cold = [r for r in rows if r["cached_tokens"] < 0.5 * r["prompt_tokens"]]

    def under_way(rep, t, me):
        return [c for c in cold if c is not me and c["replica"] == rep
                and c["sent_s"] <= t < c["sent_s"] + c["ttft_s"]]

    colocated = avoidable = 0
    for f in first.values():
        if not under_way(f["replica"], f["sent_s"], f):
            continue
        colocated += 1
        homes = {rp: sum(1 for g in first.values() if g["replica"] == rp and g["sent_s"] < f["sent_s"])
                 for rp in reps}
        fewest = min(homes.values())
        if any(homes[rp] == fewest and not under_way(rp, f["sent_s"], f) for rp in reps):
            avoidable += 1
    n = len(rows)
    k = min(n, max(1, -(-99 * n // 100)))
    p99 = sorted(r["ttft_s"] for r in rows)[k - 1] * 1e3
    name = path.rsplit("/", 1)[-1].split(".")[0]
    print(f"{name:50s} firsts {len(first):2d} colocated {colocated:2d} avoidable {avoidable} "
          f"cold {len(cold):3d} p99 {p99:6.1f} ms")
    total = [total[0] + len(first), total[1] + colocated, total[2] + avoidable]
print(f"total: {total[0]} first requests, {total[1]} colocated, {total[2]} avoidable")
