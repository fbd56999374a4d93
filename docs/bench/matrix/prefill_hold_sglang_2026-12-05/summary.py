"""The table of BENCHMARKS.md from this directory's runs: per seed, Sluice's
whole-run TTFT p99 with `hold_for_prefill: off`, with the defaults (`auto`),
and sglang-router's; the peer's over Sluice's, median and worst seed.
Usage: python3 summary.py CELL"""
import json
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def row(cell, mode, seed, name):
    with open(os.path.join(HERE, f"{cell}_{mode}_seed{seed}.json")) as f:
        return json.load(f)["cells"][cell]["runs"][name][0]


def main():
    cell = sys.argv[1]
    seeds = [s for s in range(1, 6)
             if os.path.exists(os.path.join(HERE, f"{cell}_auto_seed{s}.json"))]
    off = [row(cell, "off", s, "sluice") for s in seeds]
    auto = [row(cell, "auto", s, "sluice") for s in seeds]
    peer = [row(cell, "auto", s, "sglang-cache_aware") for s in seeds]
    print(cell, "seeds", seeds)
    print("p99 off / auto / peer:", ", ".join(
        f"{o['ttft_p99_ms']:.1f}/{a['ttft_p99_ms']:.1f}/{p['ttft_p99_ms']:.1f}"
        for o, a, p in zip(off, auto, peer)))
    for name, runs in (("off", off), ("auto", auto)):
        r = [p["ttft_p99_ms"] / x["ttft_p99_ms"] for x, p in zip(runs, peer)]
        print(f"peer / Sluice {name}: median {statistics.median(r):.2f}x, worst {min(r):.2f}x")
    r = [o["ttft_p99_ms"] / a["ttft_p99_ms"] for o, a in zip(off, auto)]
    print("off / auto per seed:", ", ".join(f"{x:.2f}" for x in r))
    print("held:", [a.get("prefill_holds") for a in auto])
    print("warm p99 auto / peer:", ", ".join(
        f"{a['warm_ttft_p99_ms']}/{p['warm_ttft_p99_ms']}" for a, p in zip(auto, peer)))
    print("hit auto / off / peer:", ", ".join(
        f"{a['prefix_hit']}/{o['prefix_hit']}/{p['prefix_hit']}" for a, o, p in zip(auto, off, peer)))
    print("busiest/mean auto, peer:", [a["busiest_over_mean"] for a in auto],
          [p["busiest_over_mean"] for p in peer])
    print("ok:", [(a["ok"], p["ok"], o["ok"]) for a, p, o in zip(auto, peer, off)])


if __name__ == "__main__":
    main()
