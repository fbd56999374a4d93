#!/usr/bin/env python3
"""Rate limiting: what admission costs, and how exact it is across gateways.

1. Latency: the same closed-loop load (8 in flight, 1-token answers from a
   `sluice sim --profile fixed` with no delays) through a gateway without limits,
   with the memory store and with Redis (a local `redis-server`); client TTFT
   p50/p99 side by side, and the gateway's own Redis round-trip histogram.
2. Accuracy: two gateway processes sharing one Redis, one key on a tier of
   600 requests per minute (burst 600, then 10/s), both driven above the limit
   for --seconds; admitted requests over what the limit allows
   (600 + 10/s x elapsed).

    cargo build --release
    python3 benches/e2e/ratelimit.py [--seconds 30] [--json out.json]
"""

import argparse
import datetime
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from stream_overhead import free_port, wait_http  # noqa: E402  (shared helpers)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.path.join(ROOT, "target", "release", "sluice")
KEY = "sk-bench-key"


def wait_port(port, timeout=10):
    deadline = time.time() + timeout
    while time.time() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise SystemExit(f"port {port} did not open")


def config(sim, limits, redis_port=None, rpm=1_000_000):
    text = f"backends:\n  - url: {sim}\n"
    if limits:
        digest = hashlib.sha256(KEY.encode()).hexdigest()
        text += (f"auth:\n  keys:\n    - {{name: bench, tier: t, sha256: \"{digest}\"}}\n"
                 f"tiers:\n  t:\n    requests_per_minute: {rpm}\n")
    if redis_port:
        text += f"rate_limits:\n  store: redis\n  redis:\n    url: redis://127.0.0.1:{redis_port}\n"
    f = tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False)
    f.write(text)
    f.close()
    return f.name


def gateway(cfg):
    api, admin = free_port(), free_port()
    p = subprocess.Popen([BIN, "serve", "--config", cfg, "--listen", f"127.0.0.1:{api}",
                          "--admin-listen", f"127.0.0.1:{admin}"], stderr=subprocess.DEVNULL,
                         env={**os.environ, "RUST_LOG": "warn"})
    wait_http(f"http://127.0.0.1:{admin}/readyz")
    return p, f"http://127.0.0.1:{api}", f"http://127.0.0.1:{admin}"


def bench(url, extra):
    out = subprocess.run([BIN, "bench", "--url", url, "--model", "sim-model", "--api-key", KEY,
                          "--workload", "fixed", "--prompt-tokens", "20", "--max-tokens", "1",
                          "--json", "-", "--quiet"] + extra,
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out)


def quantile_from_histogram(text, name, q):
    buckets = []
    for line in text.splitlines():
        if line.startswith(name + "_bucket"):
            le = line.split('le="')[1].split('"')[0]
            buckets.append((float("inf") if le == "+Inf" else float(le), float(line.rsplit(" ", 1)[1])))
    if not buckets or buckets[-1][1] == 0:
        return None
    total = buckets[-1][1]
    for le, c in buckets:
        if c >= q * total:
            return le
    return None


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=int, default=30)
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--json")
    args = ap.parse_args()
    procs = []
    res = {"meta": {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "git": subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True).stdout.strip()}}
    try:
        sim_port, redis_port = free_port(), free_port()
        procs.append(subprocess.Popen([BIN, "sim", "--listen", f"127.0.0.1:{sim_port}", "--profile", "fixed",
                                       "--prefill-delay", "0ms", "--token-delay", "0ms"],
                                      stderr=subprocess.DEVNULL))
        procs.append(subprocess.Popen(["redis-server", "--port", str(redis_port), "--bind", "127.0.0.1",
                                       "--save", "", "--appendonly", "no"], stdout=subprocess.DEVNULL))
        sim = f"http://127.0.0.1:{sim_port}"
        wait_http(sim + "/health")
        wait_port(redis_port)

        latency = []
        for label, cfg in [("no limits", config(sim, False)), ("memory store", config(sim, True)),
                           ("redis store", config(sim, True, redis_port))]:
            g, api, admin = gateway(cfg)
            try:
                bench(api, ["--concurrency", "8", "--requests", "200"])  # warm-up
                rep = bench(api, ["--concurrency", "8", "--requests", str(args.requests)])
                m = urllib.request.urlopen(admin + "/metrics").read().decode()
                latency.append({
                    "config": label, "ok": rep["ok"], "errors": rep["errors"],
                    "ttft_p50_ms": rep["ttft_seconds"]["p50"] * 1e3,
                    "ttft_p99_ms": rep["ttft_seconds"]["p99"] * 1e3,
                    "redis_rtt_p50_le_ms": (quantile_from_histogram(m, "sluice_ratelimit_store_seconds", 0.5) or 0) * 1e3,
                    "redis_rtt_p99_le_ms": (quantile_from_histogram(m, "sluice_ratelimit_store_seconds", 0.99) or 0) * 1e3,
                })
            finally:
                g.send_signal(signal.SIGTERM)
                g.wait(timeout=15)
        res["latency"] = latency

        # Accuracy: a fresh Redis key space (new prefix via a new bucket name is
        # simpler: flush), two gateways, both pushing above the limit.
        subprocess.run(["redis-cli", "-p", str(redis_port), "FLUSHALL"], stdout=subprocess.DEVNULL)
        cfg = config(sim, True, redis_port, rpm=600)
        g1, api1, _ = gateway(cfg)
        g2, api2, _ = gateway(cfg)
        try:
            start = time.time()
            b = [subprocess.Popen([BIN, "bench", "--url", u, "--model", "sim-model", "--api-key", KEY,
                                   "--workload", "fixed", "--prompt-tokens", "20", "--max-tokens", "1",
                                   "--rate", "40", "--concurrency", "64", "--duration", f"{args.seconds}s",
                                   "--json", "-", "--quiet"], stdout=subprocess.PIPE, text=True)
                 for u in (api1, api2)]
            reps = [json.loads(p.communicate()[0]) for p in b]
            elapsed = time.time() - start
        finally:
            for g in (g1, g2):
                g.send_signal(signal.SIGTERM)
                g.wait(timeout=15)
        admitted = sum(r["ok"] for r in reps)
        sent = sum(r["requests"] for r in reps)
        allowed = 600 + 10 * elapsed
        res["accuracy"] = {"sent": sent, "admitted": admitted, "elapsed_s": elapsed,
                           "allowed": allowed, "admitted_over_allowed": admitted / allowed,
                           "rejected_429": sum(r["errors"].get("http_429", 0) for r in reps)}
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
            p.wait(timeout=15)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
