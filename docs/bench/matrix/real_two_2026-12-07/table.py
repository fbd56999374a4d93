"""The real-engine runs of this directory as BENCHMARKS' table: per seed each
router's TTFT p99, warm p99, cache hit and busiest replica; the best peer's p99
over Sluice's (above 1: Sluice lower), its median and worst seed.
Usage: python3 table.py FILE.json"""
import json
import statistics
import sys



def p95(run):
    """The run's TTFT p95 from its requests (nearest rank below, as `real_fleet.py`'s p99)."""
    t = sorted(x["ttft_ms"] for x in run["per_request"] if x["ttft_ms"] is not None)
    return t[min(len(t) - 1, int(0.95 * len(t)))]


d = json.load(open(sys.argv[1]))
runs = d["runs"]
peers = [n for n in runs if n != "sluice"]
seeds = [r["seed"] for r in runs["sluice"]]
print(d["date"], d["machine"], json.dumps({k: v for k, v in d["args"].items() if k != "json"}))
print("| seed | TTFT p99 " + " / ".join(runs) + " (ms) | best peer / Sluice | warm p99 (ms) | "
      "TTFT p95 (ms) | cache hit (%) | busiest / mean | TTFT p50 (ms) |")
ratios, hit_gaps = [], []
for i, seed in enumerate(seeds):
    row = {n: runs[n][i] for n in runs if i < len(runs[n])}
    if len(row) < len(runs):
        continue
    best = min(row[p]["ttft_p99_ms"] for p in peers)
    ratio = best / row["sluice"]["ttft_p99_ms"]
    ratios.append(ratio)
    hit_gaps.append(100 * (row["sluice"]["cache_hit"] - max(row[p]["cache_hit"] for p in peers)))
    for r in row.values():
        r["ttft_p95_ms"] = p95(r)
    f = lambda k, scale=1, fmt="{:,.0f}": " / ".join(fmt.format(row[n][k] * scale) for n in runs)
    print(f"| {seed} | {f('ttft_p99_ms')} | {ratio:.2f}x | {f('warm_ttft_p99_ms')} | "
          f"{f('ttft_p95_ms')} | {f('cache_hit', 100, '{:.1f}')} | {f('busiest_over_mean', 1, '{:.2f}')} | {f('ttft_p50_ms')} |")
if ratios:
    print(f"best peer / Sluice: median {statistics.median(ratios):.2f}x, worst {min(ratios):.2f}x; "
          f"Sluice's hit minus the best peer's: median {statistics.median(hit_gaps):+.1f}, "
          f"worst {min(hit_gaps):+.1f} points; answered: "
          + ", ".join(f"{n} {sum(r['ok'] for r in runs[n])}/{sum(r['requests'] for r in runs[n])}"
                      for n in runs))
