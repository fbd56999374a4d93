"""The table of BENCHMARKS.md from this directory's runs: per seed, the
whole-run TTFT p99 of Sluice before the cold-prefill gate (a98249c), with it,
and sglang-router's; the peer's over Sluice's, median and worst seed.
Usage: python3 summary.py CELL (a cell run by run_peer.sh has no build before:
its "before" lines repeat the build after). RUNS=DIR reads another
directory's runs named the same way (`../held_share_2026-12-07`)."""
import json
import os
import statistics
import sys

HERE = os.environ.get("RUNS") or os.path.dirname(os.path.abspath(__file__))


def row(cell, mode, seed, name):
    """A run of `name`; "sluice": whichever Sluice variant ran (one gateway or
    three sharing the table)."""
    with open(os.path.join(HERE, f"{cell}_{mode}_seed{seed}.json")) as f:
        runs = json.load(f)["cells"][cell]["runs"]
    if name == "sluice":
        name = next(k for k in runs if k.startswith("sluice"))
    return runs[name][0]


def main():
    cell = sys.argv[1]
    b_name, a_name = sys.argv[2:4] if len(sys.argv) > 3 else ("before", "after")
    seeds = [s for s in range(1, 16)
             if os.path.exists(os.path.join(HERE, f"{cell}_{a_name}_seed{s}.json"))]
    after_only = not os.path.exists(os.path.join(HERE, f"{cell}_{b_name}_seed{seeds[0]}.json"))
    if after_only:
        # (run_peer.sh: no build before in these runs; the build after
        # stands in for it, so the before/after lines say nothing.)
        b_name = a_name
    before = [row(cell, b_name, s, "sluice") for s in seeds]
    after = [row(cell, a_name, s, "sluice") for s in seeds]
    peer = [row(cell, a_name, s, "sglang-cache_aware") for s in seeds]
    print(cell, "seeds", seeds)
    print("p99 before / after / peer:", ", ".join(
        f"{b['ttft_p99_ms']:.1f}/{a['ttft_p99_ms']:.1f}/{p['ttft_p99_ms']:.1f}"
        for b, a, p in zip(before, after, peer)))
    for name, runs in (("before", before), ("after", after)):
        r = [p["ttft_p99_ms"] / x["ttft_p99_ms"] for x, p in zip(runs, peer)]
        print(f"peer / Sluice {name}: median {statistics.median(r):.2f}x, worst {min(r):.2f}x")
    r = [b["ttft_p99_ms"] / a["ttft_p99_ms"] for b, a in zip(before, after)]
    print("before / after per seed:", ", ".join(f"{x:.2f}" for x in r))
    print("decisions before:", [b.get("decisions") for b in before])
    print("decisions after:", [a.get("decisions") for a in after])
    print("held before:", [b.get("prefill_holds") for b in before])
    print("held after:", [a.get("prefill_holds") for a in after])
    print("gated after:", [a.get("cold_gate_waits") for a in after])
    print("warm p99 before / after / peer:", ", ".join(
        f"{b['warm_ttft_p99_ms']}/{a['warm_ttft_p99_ms']}/{p['warm_ttft_p99_ms']}"
        for b, a, p in zip(before, after, peer)))
    print("hit before / after / peer:", ", ".join(
        f"{b['prefix_hit']}/{a['prefix_hit']}/{p['prefix_hit']}"
        for b, a, p in zip(before, after, peer)))
    print("busiest/mean before, after, peer:", [b["busiest_over_mean"] for b in before],
          [a["busiest_over_mean"] for a in after], [p["busiest_over_mean"] for p in peer])
    print("ok:", [(b["ok"], a["ok"], p["ok"]) for b, a, p in zip(before, after, peer)])


if __name__ == "__main__":
    main()
