#!/usr/bin/env python3
"""Shared prefixes through several gateways while their new prompts share nothing.

A gateway that meets 1,000 or more new prompts of a model in 5-10 s, none of
them homed elsewhere, looks up only one prefix in 16 in the shared routing
table (`Novelty` in src/routing/shared_table.rs). This checks what that costs
the prompts that do share a prefix: three gateways sharing the table (Redis)
in front of four `sluice sim` replicas, each gateway given a stream of
distinct prompts (`sluice bench --workload fixed`, a salt per gateway, fast
enough to start the sampling) and a stream of shared-prefix prompts over many
prefixes (`--workload shared-prefix`, the same prefixes through every
gateway, most used a few times a run: each is new to most gateways when it
comes). Measured per setting: for each prefix used more than once, the share
of its uses after the first served on the replica of its first use (the
prefix's requests meeting on one replica is what a prefix cache needs), over
the whole run and after the first `--warm` seconds (the sampling on); the
table's lookups by outcome; the requests per second and errors.

Settings (alternating each round, Redis emptied and gateways new each time):
`sampled` (this build, shared homes: the default), `every lookup` (this build
with `routing.prefix_kv.shared_homes_sampled: false`: every new prompt looked
up), `memory` (each gateway's own table: nothing shared), and with
`--unsampled-bin` `every lookup (build)` (a build from before the sampling).
`--only` runs some of them.

    cargo build --release
    python3 benches/e2e/sampled_shared.py --unsampled-bin /tmp/sluice-5430d5b --json out.json

Everything listens on 127.0.0.1 only and every process is stopped at the end.
"""

import argparse
import collections
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from home_lookup_cost import fixed_sims, gateway_cmd, home_store, redis_cli, start_gateway, start_redis  # noqa: E402
from stream_overhead import ROOT, run_meta, stop, wait_http  # noqa: E402

BIN = os.environ.get("SLUICE_BIN", os.path.join(ROOT, "target", "release", "sluice"))
GATEWAYS = 3
REPLICAS = 4

MEMORY = "routing:\n  policy: prefix_kv\n"
SHARED = ("routing:\n  policy: prefix_kv\n"
          "  sessions:\n    store: redis\n    redis: {{url: \"{redis}\"}}\n")
UNSAMPLED = SHARED + "  prefix_kv:\n    shared_homes_sampled: false\n"


def colocation(rows, after=0.0):
    """Of the prefixes used more than once: the share of their uses after the
    first (those sent from `after` seconds on) served on the replica of the
    first use, and the mean number of replicas each was served on."""
    by_prefix = collections.defaultdict(list)
    for r in rows:
        if r.get("prefix") is not None and r.get("replica"):
            by_prefix[r["prefix"]].append(r)
    same = later = 0
    spread = []
    for uses in by_prefix.values():
        if len(uses) < 2:
            continue
        uses.sort(key=lambda r: r["t"])
        first = uses[0]["replica"]
        for u in uses[1:]:
            if u["t"] >= after:
                later += 1
                same += u["replica"] == first
        spread.append(len({u["replica"] for u in uses}))
    return {"later_uses": later, "on_first_replica": round(same / later, 4) if later else None,
            "replicas_per_prefix": round(statistics.mean(spread), 3) if spread else None,
            "prefixes_reused": len(spread)}


def bench(url, out_json, *args, requests_json=None):
    cmd = [BIN, "bench", "--url", url, "--model", "sim-model", "--quiet", "--json", out_json, *args]
    if requests_json:
        cmd += ["--requests-json", requests_json]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="also write the raw results here")
    ap.add_argument("--unsampled-bin",
                    help="a build from before the sampling (5430d5b), for `every lookup (build)`")
    ap.add_argument("--only", nargs="+", metavar="SETTING",
                    help="run only these settings (sampled, 'every lookup', memory, 'every lookup (build)')")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=25.0, help="length of each run")
    ap.add_argument("--warm", type=float, default=8.0,
                    help="the sampling is on from here (1,000 new prompts in 5-10 s)")
    ap.add_argument("--distinct-rate", type=float, default=220.0,
                    help="distinct prompts a second through each gateway")
    ap.add_argument("--shared-rate", type=float, default=12.0,
                    help="shared-prefix prompts a second through each gateway")
    ap.add_argument("--prefixes", type=int, default=256)
    args = ap.parse_args()
    for b in [BIN] + ([args.unsampled_bin] if args.unsampled_bin else []):
        if not os.path.exists(b):
            raise SystemExit(f"{b} not found (cargo build --release)")
    if not shutil.which("redis-server"):
        raise SystemExit("redis-server not found (apt-get install redis-server)")
    settings = [("sampled", BIN, SHARED), ("every lookup", BIN, UNSAMPLED), ("memory", BIN, MEMORY)]
    if args.unsampled_bin:
        settings.insert(2, ("every lookup (build)", args.unsampled_bin, SHARED))
    if args.only:
        unknown = set(args.only) - {label for label, _, _ in settings}
        if unknown:
            raise SystemExit(f"--only: unknown settings {sorted(unknown)}")
        settings = [s for s in settings if s[0] in args.only]

    procs = []
    tmp = tempfile.mkdtemp(prefix="sluice-sampled-")
    runs = {label: [] for label, _, _ in settings}
    try:
        rport = start_redis(procs)
        # Answers take ~20 ms (4 tokens 5 ms apart): requests stay in flight
        # long enough for the replicas' loads to differ.
        sims = fixed_sims(procs, REPLICAS, "5ms", 4)
        for k in range(args.rounds):
            order = settings[k % len(settings):] + settings[:k % len(settings)]
            for label, binary, yaml in order:
                redis_cli(rport, "FLUSHALL")
                conf = os.path.join(tmp, "sluice.yaml")
                with open(conf, "w") as f:
                    f.write(yaml.format(redis=f"redis://127.0.0.1:{rport}"))
                gws = []
                try:
                    for _ in range(GATEWAYS):
                        cmd, port, admin = gateway_cmd(binary, conf, sims)
                        p = start_gateway(cmd)
                        procs.append(p)
                        gws.append((p, port, admin))
                    for _, _, admin in gws:
                        wait_http(f"http://127.0.0.1:{admin}/readyz")
                    loads = []
                    t0 = time.time()
                    for g, (_, port, _) in enumerate(gws):
                        url = f"http://127.0.0.1:{port}"
                        dur = f"{args.seconds:.0f}s"
                        loads.append(("distinct", g, bench(
                            url, os.path.join(tmp, f"d{g}.json"), "--workload", "fixed",
                            "--rate", str(args.distinct_rate), "--concurrency", "256", "--duration", dur,
                            "--prompt-tokens", "100", "--max-tokens", "4", "--salt", f"r{k}g{g}",
                            "--seed", str(k * 10 + g + 1))))
                        loads.append(("shared", g, bench(
                            url, os.path.join(tmp, f"s{g}.json"), "--workload", "shared-prefix",
                            "--prefixes", str(args.prefixes), "--prefix-tokens", "300", "--prompt-tokens", "20",
                            "--rate", str(args.shared_rate), "--concurrency", "64", "--duration", dur,
                            "--max-tokens", "4", "--salt", f"r{k}g{g}", "--seed", str(k * 10 + g + 1),
                            requests_json=os.path.join(tmp, f"s{g}.jsonl"))))
                    for _, _, p in loads:
                        p.wait(timeout=args.seconds + 120)
                    store = collections.Counter()
                    for _, _, admin in gws:
                        store.update(home_store(admin))
                finally:
                    for p, _, _ in gws:
                        stop([p])
                        procs.remove(p)
                rows, ok, errors, reqs = [], 0, 0, {"distinct": 0, "shared": 0}
                for kind, g, _ in loads:
                    with open(os.path.join(tmp, f"{kind[0]}{g}.json")) as f:
                        rep = json.load(f)
                    ok += rep["ok"]
                    errors += sum(rep["errors"].values())
                    reqs[kind] += rep["requests"]
                    if kind == "shared":
                        with open(os.path.join(tmp, f"s{g}.jsonl")) as f:
                            rows += [json.loads(line) for line in f]
                # Times from the first request sent through any gateway
                # (each file's `sent_s` counts from its own bench's start,
                # all started within a few ms of each other).
                for r in rows:
                    r["t"] = r["sent_s"]
                run = {"round": k + 1, "ok": ok, "errors": errors, "requests": reqs,
                       "seconds": round(time.time() - t0, 1),
                       "whole": colocation(rows), "warm": colocation(rows, args.warm),
                       "home_store": dict(store)}
                runs[label].append(run)
                print(label, json.dumps(run), file=sys.stderr, flush=True)
    finally:
        stop(procs)
        shutil.rmtree(tmp, ignore_errors=True)

    meta = run_meta(rounds=args.rounds, seconds=args.seconds, warm=args.warm, gateways=GATEWAYS,
                    replicas=REPLICAS, distinct_rate=args.distinct_rate, shared_rate=args.shared_rate,
                    prefixes=args.prefixes, unsampled_bin=args.unsampled_bin)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "runs": runs}, f, indent=2)
    print(report(meta, runs))


def report(meta, runs):
    lines = [f"Run {meta['date']} on {meta['machine']}, commit {meta['git']}; {meta['gateways']} gateways, "
             f"{meta['replicas']} replicas, per gateway {meta['distinct_rate']:.0f} distinct and "
             f"{meta['shared_rate']:g} shared-prefix prompts a second over {meta['prefixes']} prefixes, "
             f"{meta['seconds']:.0f} s a run; median (range) of {meta['rounds']} rounds.", "",
             "| routing table | uses on the first use's replica | after "
             f"{meta['warm']:.0f} s | replicas per reused prefix | home lookups (found) | not looked up "
             "| requests ok / sent | errors |",
             "|---|---|---|---|---|---|---|---|"]

    def mr(xs, fmt):
        xs = [x for x in xs if x is not None]
        if not xs:
            return "-"
        return f"{fmt(statistics.median(xs))} ({fmt(min(xs))}-{fmt(max(xs))})"

    pct = lambda x: f"{100 * x:.1f}%"  # noqa: E731
    for label, rs in runs.items():
        looked = [r["home_store"].get("place/placed", 0) + r["home_store"].get("place/found", 0) for r in rs]
        found = [r["home_store"].get("place/found", 0) for r in rs]
        novel = [r["home_store"].get("place/novel", 0) for r in rs]
        sent = [r["requests"]["distinct"] + r["requests"]["shared"] for r in rs]
        lines.append(
            f"| {label} | {mr([r['whole']['on_first_replica'] for r in rs], pct)} "
            f"| {mr([r['warm']['on_first_replica'] for r in rs], pct)} "
            f"| {mr([r['whole']['replicas_per_prefix'] for r in rs], lambda x: f'{x:.2f}')} "
            f"| {statistics.median(looked):.0f} ({statistics.median(found):.0f}) | {statistics.median(novel):.0f} "
            f"| {statistics.median(r['ok'] for r in rs):.0f} / {statistics.median(sent):.0f} "
            f"| {sum(r['errors'] for r in rs)} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
