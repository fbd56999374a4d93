#!/usr/bin/env python3
"""What the shared routing table costs on prompts that share nothing.

With `routing.sessions.store: redis` a gateway looks up, before routing, every
prompt whose prefix it holds nowhere (`routing.prefix_kv.shared_homes`, on by
default) and places it in Redis when it is new. On a workload whose prompts
share nothing every request is such a prompt. This measures what that costs
against the same gateway with each gateway's own table (`memory`) and with
the Redis table holding sessions only (`shared_homes: false`).

Two `sluice sim` replicas (a choice to make: with one replica nothing is
looked up) answer instantly, so the run is CPU-bound and the gateway's own
cost shows. Each round starts every setting afresh (a new gateway, Redis
emptied: nothing is held yet, as on a gateway meeting new prompts) and runs
`sluice bench --workload fixed` (every prompt distinct) through it; the
settings alternate, their order rotating each round. Reported per setting:
the client's requests/s and TTFT, the gateway's CPU per 1,000 requests (from
/proc/PID/stat), Redis's CPU per 1,000 requests (INFO cpu), and the table's
lookups (`sluice_routing_home_store_total`). Then, from a fresh gateway and an
empty Redis again, an open loop well under capacity (`--rate`, 500 requests/s)
gives the latency a lookup adds to a request when nothing queues.

    cargo build --release
    python3 benches/e2e/home_lookup_cost.py --json out.json --rounds 5

Everything listens on 127.0.0.1 only and every process is stopped at the end.
"""

import argparse
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from stream_overhead import ROOT, cpu_seconds, free_port, run_meta, stop, wait_http  # noqa: E402

BIN = os.environ.get("SLUICE_BIN", os.path.join(ROOT, "target", "release", "sluice"))

SETTINGS = [
    ("memory", "routing:\n  policy: prefix_kv\n"),
    ("redis, sessions only",
     "routing:\n  policy: prefix_kv\n  prefix_kv: {{shared_homes: false}}\n"
     "  sessions:\n    store: redis\n    redis: {{url: \"{redis}\"}}\n"),
    ("redis, shared homes (default)",
     "routing:\n  policy: prefix_kv\n"
     "  sessions:\n    store: redis\n    redis: {{url: \"{redis}\"}}\n"),
]


def redis_cli(port, *args):
    return subprocess.run(["redis-cli", "-p", str(port)] + list(args), capture_output=True, text=True,
                          check=True).stdout


def start_redis(procs):
    """A Redis server on a free loopback port (added to `procs`), once it accepts: its port."""
    port = free_port()
    procs.append(subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                   "--appendonly", "no"], stdout=subprocess.DEVNULL))
    deadline = time.time() + 10
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return port
        except OSError:
            if time.time() > deadline:
                raise
            time.sleep(0.05)


def fixed_sims(procs, n, token_delay, output_tokens):
    """`n` load-independent `sluice sim` replicas (added to `procs`), once up: their URLs."""
    sims = []
    for _ in range(n):
        port = free_port()
        procs.append(subprocess.Popen(
            [BIN, "sim", "--listen", f"127.0.0.1:{port}", "--profile", "fixed", "--prefill-delay", "0ms",
             "--token-delay", token_delay, "--output-tokens", str(output_tokens)], stderr=subprocess.DEVNULL))
        wait_http(f"http://127.0.0.1:{port}/health")
        sims.append(f"http://127.0.0.1:{port}")
    return sims


def gateway_cmd(binary, conf, sims):
    """`sluice serve` with `conf` in front of `sims` on free loopback ports: (command, port, admin port)."""
    port, admin = free_port(), free_port()
    cmd = [binary, "serve", "--config", conf, "--listen", f"127.0.0.1:{port}", "--admin-listen",
           f"127.0.0.1:{admin}"]
    for s in sims:
        cmd += ["--backend", s]
    return cmd, port, admin


def start_gateway(cmd):
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "RUST_LOG": "warn"})


def redis_cpu(port):
    info = redis_cli(port, "INFO", "cpu")
    vals = dict(line.strip().split(":", 1) for line in info.splitlines() if ":" in line)
    return float(vals["used_cpu_sys"]) + float(vals["used_cpu_user"])


def home_store(admin):
    """The table's calls by op/outcome: homes as `op/outcome`, sessions as `session:op/outcome`."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{admin}/metrics", timeout=5).read().decode()
    out = {}
    for m in re.finditer(r'^sluice_routing_(home|session)_store_total\{([^}]*)\} (\S+)$', text, re.M):
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
        key = "" if m.group(1) == "home" else "session:"
        out[f"{key}{labels.get('op')}/{labels.get('outcome')}"] = float(m.group(3))
    return out


def bench(url, requests, seed, concurrency=None, rate=None):
    load = ["--concurrency", str(concurrency)] if rate is None else ["--rate", str(rate), "--concurrency", "256"]
    out = subprocess.run(
        [BIN, "bench", "--url", url, "--model", "sim-model", *load,
         "--requests", str(requests), "--max-tokens", "16", "--workload", "fixed", "--prompt-tokens", "200",
         "--seed", str(seed), "--json", "-", "--quiet"],
        capture_output=True, text=True, check=True).stdout
    return json.loads(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="also write the raw results here")
    ap.add_argument("--rounds", type=int, default=5, help="alternating rounds")
    ap.add_argument("--requests", type=int, default=4000, help="requests per setting and round")
    ap.add_argument("--concurrency", type=int, default=32, help="closed loop: requests at once")
    ap.add_argument("--rate", type=float, default=500.0,
                    help="then an open loop at this many requests/s (0: skip)")
    ap.add_argument("--paced-seconds", type=float, default=8.0, help="length of the open loop")
    args = ap.parse_args()
    if not os.path.exists(BIN):
        raise SystemExit("build first: cargo build --release")
    if not shutil.which("redis-server"):
        raise SystemExit("redis-server not found (apt-get install redis-server)")

    procs = []
    tmp = tempfile.mkdtemp(prefix="sluice-homecost-")
    runs = {label: [] for label, _ in SETTINGS}
    try:
        rport = start_redis(procs)
        sims = fixed_sims(procs, 2, "0ms", 16)
        for k in range(args.rounds):
            order = SETTINGS[k % len(SETTINGS):] + SETTINGS[:k % len(SETTINGS)]
            for label, yaml in order:
                redis_cli(rport, "FLUSHALL")
                conf = os.path.join(tmp, "sluice.yaml")
                with open(conf, "w") as f:
                    f.write(yaml.format(redis=f"redis://127.0.0.1:{rport}"))
                cmd, port, admin = gateway_cmd(BIN, conf, sims)
                gw = start_gateway(cmd)
                procs.append(gw)
                try:
                    wait_http(f"http://127.0.0.1:{admin}/readyz")
                    cpu0, rcpu0 = cpu_seconds([gw.pid]), redis_cpu(rport)
                    url = f"http://127.0.0.1:{port}"
                    rep = bench(url, args.requests, k + 1, concurrency=args.concurrency)
                    cpu, rcpu = cpu_seconds([gw.pid]) - cpu0, redis_cpu(rport) - rcpu0
                    store = home_store(admin)
                    # Then at a steady rate well under capacity: the latency a
                    # lookup adds to each request (prompts new again: the
                    # bench numbers them from 0, so Redis is emptied and the
                    # gateway's index would hold them; a new seed does not
                    # change them, hence a fresh gateway below).
                    steady = None
                    if args.rate:
                        gw.send_signal(signal.SIGTERM)
                        gw.wait(timeout=15)
                        procs.remove(gw)
                        redis_cli(rport, "FLUSHALL")
                        gw = start_gateway(cmd)
                        procs.append(gw)
                        wait_http(f"http://127.0.0.1:{admin}/readyz")
                        steady = bench(url, int(args.rate * args.paced_seconds), k + 1, rate=args.rate)
                finally:
                    if gw in procs:
                        gw.send_signal(signal.SIGTERM)
                        gw.wait(timeout=15)
                        procs.remove(gw)
                n = rep["requests"]
                runs[label].append({
                    "round": k + 1, "ok": rep["ok"], "errors": sum(rep["errors"].values()),
                    "req_per_s": rep["requests_per_second"],
                    "ttft_p50_ms": rep["ttft_seconds"]["p50"] * 1e3,
                    "ttft_p99_ms": rep["ttft_seconds"]["p99"] * 1e3,
                    "gateway_cpu_s_per_1000": cpu / n * 1000,
                    "redis_cpu_s_per_1000": rcpu / n * 1000,
                    "home_store": store,
                })
                if steady:
                    runs[label][-1].update({
                        "paced_ok": steady["ok"], "paced_errors": sum(steady["errors"].values()),
                        "paced_ttft_p50_ms": steady["ttft_seconds"]["p50"] * 1e3,
                        "paced_ttft_p99_ms": steady["ttft_seconds"]["p99"] * 1e3,
                    })
                print(label, json.dumps(runs[label][-1]), file=sys.stderr)
    finally:
        stop(procs)
        shutil.rmtree(tmp, ignore_errors=True)

    meta = run_meta(requests=args.requests, concurrency=args.concurrency, rounds=args.rounds,
                    rate=args.rate, paced_seconds=args.paced_seconds)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "runs": runs}, f, indent=2)
    print(report(meta, runs))


def paced(rs, key):
    xs = [r[key] for r in rs if key in r]
    return f"{statistics.median(xs):.2f} ms" if xs else "-"


def report(meta, runs):
    lines = [f"Run {meta['date']} on {meta['machine']}, commit {meta['git']}; {meta['requests']} distinct "
             f"prompts per round at concurrency {meta['concurrency']}, medians of {meta['rounds']} rounds.", "",
             "| routing table | req/s | vs memory | TTFT p50 | TTFT p99 | gateway CPU-s / 1000 req "
             "| Redis CPU-s / 1000 req | home lookups a round (placed) | session calls a round | errors "
             f"| TTFT p50 / p99 at {meta['rate']:.0f} req/s |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    base = statistics.median(r["req_per_s"] for r in runs["memory"])
    for label, rs in runs.items():
        def med(k):
            return statistics.median(r[k] for r in rs)
        looked = statistics.median(r["home_store"].get("place/placed", 0) + r["home_store"].get("place/found", 0)
                                   for r in rs)
        placed = statistics.median(r["home_store"].get("place/placed", 0) for r in rs)
        sessions = statistics.median(sum(v for key, v in r["home_store"].items() if key.startswith("session:"))
                                     for r in rs)
        lines.append(
            f"| {label} | {med('req_per_s'):.0f} | {med('req_per_s') / base:.2f}x | {med('ttft_p50_ms'):.2f} ms "
            f"| {med('ttft_p99_ms'):.2f} ms | {med('gateway_cpu_s_per_1000'):.3f} | "
            f"{med('redis_cpu_s_per_1000'):.3f} | {looked:.0f} ({placed:.0f}) | {sessions:.0f} | {sum(r['errors'] + r.get('paced_errors', 0) for r in rs)} "
            f"| {paced(rs, 'paced_ttft_p50_ms')} / {paced(rs, 'paced_ttft_p99_ms')} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
