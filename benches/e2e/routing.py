#!/usr/bin/env python3
"""Routing on a simulated fleet: round_robin vs least_loaded vs prefix_kv.

Four `sluice sim` replicas (engine model `h100-llama3-8b`, KV cache cut to
--num-blocks so that the working set of prefixes exceeds one replica's cache but
fits the fleet's) behind `sluice serve`, and `sluice bench` through the gateway.

Scenarios:
  shared   shared-prefix traffic near saturation (open loop): client TTFT p50/p99,
           throughput, and the replicas' own prefix-cache hit rate, per policy;
  hotspot  one prefix carries half of the traffic (prefix_kv): the replicas' KV
           usage sampled every 200 ms; the claim is that no replica sits above
           95% while another is below 70%;
  slow     four equal replicas (prefix_kv); at t=10 s one starts stalling 2 s in
           every answer (/sim/control); its share of new requests (prompt tokens
           admitted) per 2 s window, before and after.

    cargo build --release
    python3 benches/e2e/routing.py [--seconds 30] [--json out.json]
"""

import argparse
import datetime
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from stream_overhead import free_port, wait_http  # noqa: E402  (shared helpers)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.path.join(ROOT, "target", "release", "sluice")


def get(url):
    with urllib.request.urlopen(url, timeout=5) as r:
        return r.read().decode()


def value(text, name):
    total, seen = 0.0, False
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
            seen = True
    return total if seen else None


class Fleet:
    def __init__(self, policy, blocks, slow_one=False, extra_yaml=""):
        self.procs, self.sims = [], []
        for i in range(4):
            port = free_port()
            profile = "a100-llama3-8b" if (slow_one and i == 0) else "h100-llama3-8b"
            args = [BIN, "sim", "--listen", f"127.0.0.1:{port}", "--profile", profile,
                    "--num-blocks", str(blocks), "--output-tokens", "4096"]
            self.procs.append(subprocess.Popen(args, stderr=subprocess.DEVNULL))
            self.sims.append(f"http://127.0.0.1:{port}")
        for s in self.sims:
            wait_http(s + "/health")
        self.api, admin = free_port(), free_port()
        self.admin = f"http://127.0.0.1:{admin}"
        cfg = tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False)
        cfg.write(f"routing:\n  policy: {policy}\n{extra_yaml}")
        cfg.close()
        args = [BIN, "serve", "--config", cfg.name, "--listen", f"127.0.0.1:{self.api}",
                "--admin-listen", f"127.0.0.1:{admin}"]
        for s in self.sims:
            args += ["--backend", s]
        self.procs.append(subprocess.Popen(args, stderr=subprocess.DEVNULL,
                                           env={**os.environ, "RUST_LOG": "warn"}))
        wait_http(self.admin + "/readyz")
        time.sleep(1.5)  # health checks of all four, first metrics scrapes

    def url(self):
        return f"http://127.0.0.1:{self.api}"

    def sim_metric(self, name):
        return [value(get(s + "/metrics"), name) for s in self.sims]

    def stop(self):
        for p in self.procs:
            p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()


def bench(url, extra):
    out = subprocess.run([BIN, "bench", "--url", url, "--model", "sim-model", "--json", "-",
                          "--quiet"] + extra, capture_output=True, text=True, check=True).stdout
    return json.loads(out)


def tuning(args):
    return f"  prefix_kv:\n    load_factor: {args.load_factor}\n"


def shared(args, policy):
    f = Fleet(policy, args.num_blocks, extra_yaml=tuning(args))
    try:
        rep = bench(f.url(), ["--workload", "shared-prefix", "--prefixes", str(args.prefixes),
                              "--prefix-tokens", "2000", "--prompt-tokens", "50",
                              "--max-tokens", "64", "--rate", str(args.rate),
                              "--concurrency", "512", "--duration", f"{args.seconds}s"])
        hits = sum(x or 0 for x in f.sim_metric("vllm:prefix_cache_hits_total"))
        queries = sum(x or 0 for x in f.sim_metric("vllm:prefix_cache_queries_total"))
        routed = get(f.admin + "/metrics")
        reasons = {}
        for line in routed.splitlines():
            if line.startswith("sluice_routing_decisions_total{"):
                r = line.split('reason="')[1].split('"')[0]
                reasons[r] = float(line.rsplit(" ", 1)[1])
        return {
            "policy": policy,
            "ok": rep["ok"], "errors": rep["errors"],
            "ttft_p50_ms": rep["ttft_seconds"]["p50"] * 1e3,
            "ttft_p99_ms": rep["ttft_seconds"]["p99"] * 1e3,
            "itl_p50_ms": rep["inter_token_seconds"]["p50"] * 1e3,
            "req_per_s": rep["requests_per_second"],
            "output_tok_per_s": rep["output_tokens_per_second"],
            "prefix_hit_rate": hits / queries if queries else None,
            "reasons": reasons,
        }
    finally:
        f.stop()


def hotspot(args):
    """Half the traffic on one prefix, at 80% of --rate (near, not over, capacity)."""
    rate = args.rate * 0.8
    f = Fleet("prefix_kv", args.num_blocks, extra_yaml=tuning(args))
    samples, stop = [], threading.Event()

    def sample():
        while not stop.is_set():
            kv = f.sim_metric("vllm:kv_cache_usage_perc")
            samples.append([k or 0.0 for k in kv])
            time.sleep(0.2)

    t = threading.Thread(target=sample)
    t.start()
    try:
        # Two bench streams at once: one on a single hot prefix, one spread over many.
        hot = subprocess.Popen([BIN, "bench", "--url", f.url(), "--model", "sim-model",
                                "--workload", "shared-prefix", "--prefixes", "1", "--prefix-tokens", "2000",
                                "--prompt-tokens", "50", "--max-tokens", "128", "--rate", str(rate / 2),
                                "--concurrency", "512", "--duration", f"{args.seconds}s", "--quiet",
                                "--json", "-"], stdout=subprocess.PIPE, text=True)
        rest = bench(f.url(), ["--workload", "shared-prefix", "--prefixes", str(args.prefixes),
                               "--prefix-tokens", "2000", "--prompt-tokens", "50", "--max-tokens", "128",
                               "--rate", str(rate / 2), "--concurrency", "512", "--seed", "7",
                               "--duration", f"{args.seconds}s"])
        hot_rep = json.loads(hot.communicate()[0])
    finally:
        stop.set()
        t.join()
        f.stop()
    bad = sum(1 for s in samples if max(s) > 0.95 and min(s) < 0.70)
    return {
        "samples": len(samples),
        "samples_one_above_95_while_one_below_70": bad,
        "max_kv_seen": max(max(s) for s in samples),
        "mean_kv_per_replica": [sum(s[i] for s in samples) / len(samples) for i in range(4)],
        "hot_ok": hot_rep["ok"], "rest_ok": rest["ok"],
        "ttft_p99_ms_hot": hot_rep["ttft_seconds"]["p99"] * 1e3,
        "ttft_p99_ms_rest": rest["ttft_seconds"]["p99"] * 1e3,
    }


def slow(args):
    """All replicas equal until t=10 s, then replica 0 stalls 2 s in every answer."""
    f = Fleet("prefix_kv", args.num_blocks, extra_yaml=tuning(args))
    windows = []
    try:
        b = subprocess.Popen([BIN, "bench", "--url", f.url(), "--model", "sim-model",
                              "--workload", "shared-prefix", "--prefixes", str(args.prefixes),
                              "--prefix-tokens", "2000", "--prompt-tokens", "50", "--max-tokens", "64",
                              "--rate", str(args.rate), "--concurrency", "512",
                              "--duration", f"{args.seconds}s", "--quiet"],
                             stdout=subprocess.DEVNULL)
        last = [0.0] * 4
        start = time.time()
        slowed = False
        while b.poll() is None:
            time.sleep(2)
            t = time.time() - start
            if not slowed and t >= 10:
                req = urllib.request.Request(f.sims[0] + "/sim/control", method="PUT",
                                             data=json.dumps({"faults": "stall=8:2s", "fault_rate": 1.0}).encode())
                urllib.request.urlopen(req, timeout=5).read()
                slowed = True
            # Prompt tokens are counted when a request is admitted: new work.
            now = [x or 0.0 for x in f.sim_metric("vllm:prompt_tokens_total")]
            got = [now[i] - last[i] for i in range(4)]
            last = now
            total = sum(got)
            if total and t <= args.seconds:
                windows.append({"t": round(t), "slow_share": got[0] / total, "stalled": slowed})
        b.wait()
    finally:
        f.stop()
    before = [w["slow_share"] for w in windows if w["t"] <= 10]
    after = [w["slow_share"] for w in windows if w["t"] >= 16]
    return {
        "windows": windows,
        "share_before": sum(before) / len(before) if before else None,
        "share_from_6s_after": sum(after) / len(after) if after else None,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=int, default=40)
    ap.add_argument("--rate", type=float, default=50.0, help="requests/s offered to the fleet")
    ap.add_argument("--prefixes", type=int, default=48)
    ap.add_argument("--num-blocks", type=int, default=2500, help="KV blocks per replica")
    ap.add_argument("--only", default="shared,hotspot,slow")
    ap.add_argument("--load-factor", type=float, default=2.0)
    ap.add_argument("--json")
    args = ap.parse_args()
    res = {"meta": {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "git": subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True).stdout.strip(),
        "args": vars(args)}}
    only = args.only.split(",")
    if "shared" in only:
        res["shared"] = [shared(args, p) for p in ("round_robin", "least_loaded", "prefix_kv")]
    if "hotspot" in only:
        res["hotspot"] = hotspot(args)
    if "slow" in only:
        res["slow"] = slow(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
