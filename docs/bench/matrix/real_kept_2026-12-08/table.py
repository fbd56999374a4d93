#!/usr/bin/env python3
"""Before/after per seed for `run_sim.sh`'s cells and `run.sh`'s real-engine runs.

Usage: table.py   (reads the JSON files beside it and ../real_two_2026-12-07/two_*.json)
"""
import glob
import json
import os
import re
import statistics

here = os.path.dirname(os.path.abspath(__file__))


def sim():
    cells = {}
    for f in sorted(glob.glob(os.path.join(here, "*_seed*.json"))):
        m = re.match(r"(.+)_(before|after)_seed(\d+)\.json", os.path.basename(f))
        if not m:
            continue
        cell, which, seed = m.group(1), m.group(2), int(m.group(3))
        run = json.load(open(f))["cells"][cell]["runs"]["sluice"][0]
        cells.setdefault(cell, {}).setdefault(seed, {})[which] = run
    for cell, seeds in cells.items():
        print(f"{cell}: TTFT p99 before / after ms (hit, busiest)")
        ratios = []
        for seed, r in sorted(seeds.items()):
            if {"before", "after"} <= r.keys():
                b, a = r["before"], r["after"]
                ratios.append(b["ttft_p99_ms"] / a["ttft_p99_ms"])
                print(f"  seed {seed}: {b['ttft_p99_ms']:7.1f} / {a['ttft_p99_ms']:7.1f}"
                      f"  hit {b['prefix_hit']:.4f} / {a['prefix_hit']:.4f}"
                      f"  busiest {b['busiest_over_mean']:.2f} / {a['busiest_over_mean']:.2f}")
        if ratios:
            print(f"  before/after p99: median {statistics.median(ratios):.2f}x,"
                  f" range {min(ratios):.2f}-{max(ratios):.2f}x")


def real():
    def runs(pattern):
        out = {}
        for f in sorted(glob.glob(pattern)):
            for name, rs in json.load(open(f))["runs"].items():
                for r in rs:
                    out.setdefault(name, {}).setdefault(r["seed"], []).append(r)
        return out
    before = runs(os.path.join(here, "..", "real_two_2026-12-07", "two_*.json"))
    for seed, rs in runs(os.path.join(here, "..", "real_two_2026-12-07", "diag_*.json")).get(
            "sluice", {}).items():
        before["sluice"].setdefault(seed, []).extend(rs)
    after = runs(os.path.join(here, "alone_*.json"))
    print("real engine (two llama.cpp servers): TTFT p99 ms, Sluice before (12-07 runs) /"
          " after; the peers as run on 12-07")
    for seed in sorted(set(before.get("sluice", {})) | set(after.get("sluice", {}))):
        def p99(d, name):
            return "/".join(f"{r['ttft_p99_ms']:.0f}" for r in d.get(name, {}).get(seed, [])) or "-"
        print(f"  seed {seed}: {p99(before, 'sluice'):>6} / {p99(after, 'sluice'):>6}"
              f"   sglang {p99(before, 'sglang-cache_aware'):>6}  vllm {p99(before, 'vllm-cache_aware'):>6}")


sim()
real()
