"""Every routing cell this directory holds, with the gate's build beside
sglang-router `cache_aware` (the runs named `after`, `b_after` on the second
engine model): one line a cell, the table at the top of BENCHMARKS.md's
routing section. Usage: python3 table.py"""
import glob
import json
import os
import re
import statistics

HERE = os.path.dirname(os.path.abspath(__file__))


def runs(path, cell):
    with open(path) as f:
        r = json.load(f)["cells"][cell]["runs"]
    me = next(k for k in r if k.startswith("sluice"))
    return r[me][0], r["sglang-cache_aware"][0]


def main():
    cells = {}
    for p in sorted(glob.glob(os.path.join(HERE, "*_after_seed*.json"))):
        m = re.match(r"(.+?)_(b_)?after_seed(\d)\.json", os.path.basename(p))
        cell, b, seed = m.group(1), m.group(2), int(m.group(3))
        cells.setdefault((cell, bool(b)), {})[seed] = runs(p, cell)
    print("| cell | engine | seeds | TTFT p99 Sluice / peer, median (ms) | peer / Sluice: median (worst seed) "
          "| warm p99 Sluice / peer, median (ms) | busiest / mean, worst seed: Sluice / peer "
          "| prefix hit, median: Sluice / peer | answered |")
    print("|---|---|---|---|---|---|---|---|---|")
    for (cell, b), seeds in sorted(cells.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        s = [seeds[k][0] for k in sorted(seeds)]
        p = [seeds[k][1] for k in sorted(seeds)]
        med = lambda xs: statistics.median(xs)
        ratio = [y["ttft_p99_ms"] / x["ttft_p99_ms"] for x, y in zip(s, p)]
        ok = sum(x["ok"] for x in s), sum(x["requests"] for x in s)
        print(f"| `{cell}` | {'b' if b else 'sim (SGLang metrics)'} | {','.join(map(str, sorted(seeds)))} "
              f"| {med([x['ttft_p99_ms'] for x in s]):.0f} / {med([x['ttft_p99_ms'] for x in p]):.0f} "
              f"| **{med(ratio):.2f}x** ({min(ratio):.2f}x) "
              f"| {med([x['warm_ttft_p99_ms'] for x in s]):.1f} / {med([x['warm_ttft_p99_ms'] for x in p]):.1f} "
              f"| {max(x['busiest_over_mean'] for x in s):.2f}x / {max(x['busiest_over_mean'] for x in p):.2f}x "
              f"| {100 * med([x['prefix_hit'] for x in s]):.1f}% / {100 * med([x['prefix_hit'] for x in p]):.1f}% "
              f"| {ok[0]} of {ok[1]} |")


if __name__ == "__main__":
    main()
