#!/usr/bin/env python3
"""A healthy fleet under load for several minutes: the diagnosis names nothing.

The doctor's false-positive check (issue 13). Three `sluice sim` replicas
(`h100-llama3-8b` engine model, each with its simulated DCGM exporter) behind
`sluice serve` with the doctor's default thresholds and window, two tenants on
two tiers, and two loads at once through the gateway for --minutes:

  - coding-agent sessions (`sluice bench --workload agentic`, premium key):
    a shared system prompt, growing histories, tool results, think time;
  - shared-prefix chat, open loop (Poisson, free key, inside its limits).

Every --poll seconds the script asks `/admin/diagnose` and keeps every finding
it sees (pathology, replica or model, severity, when first and last seen). It
prints the findings and the load it carried; with --json it writes the raw
record. It exits 1 if anything was named, info notes included.

    cargo build --release
    python3 benches/e2e/healthy.py --minutes 6 --json docs/bench/healthy.json
"""

import argparse
import datetime
import hashlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from stream_overhead import free_port, stop, wait_http  # noqa: E402  (shared helpers)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.path.join(ROOT, "target", "release", "sluice")
KEYS = {"premium": "sk-healthy-premium", "free": "sk-healthy-free"}


def get_json(url):
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def get_text(url):
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


def summed(text, name):
    """The sum of every series of one metric in an exposition."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def per_replica(text, name):
    """{backend label: value} of a per-replica gauge in an exposition."""
    out = {}
    for line in text.splitlines():
        if line.startswith(name + "{") and 'backend="' in line:
            out[line.split('backend="')[1].split('"')[0]] = float(line.rsplit(" ", 1)[1])
    return out


GAUGES = {"running": "sluice_backend_requests_running",
          "waiting": "sluice_backend_requests_waiting",
          "kv": "sluice_backend_kv_cache_usage_ratio"}


def config_yaml(sims):
    keys = "".join(
        f"    - {{name: {tier}-tenant, tier: {tier}, sha256: "
        f"\"{hashlib.sha256(key.encode()).hexdigest()}\"}}\n"
        for tier, key in KEYS.items()
    )
    backends = "".join(
        f"  - url: {s}\n    dcgm_url: {s}/dcgm/metrics\n" for s in sims
    )
    return (
        "auth:\n  keys:\n" + keys
        + "tiers:\n  premium:\n    priority: 10\n"
        "  free:\n    requests_per_minute: 6000\n    tokens_per_minute: 20000000\n"
        "telemetry:\n  access_log:\n    enabled: false\n"
        "backends:\n" + backends
    )


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=6.0,
                    help="how long the load runs (the doctor's window is 5 minutes)")
    ap.add_argument("--poll", type=float, default=2.0, help="seconds between diagnoses")
    ap.add_argument("--sessions-at-once", type=int, default=24)
    ap.add_argument("--rate", type=float, default=12.0,
                    help="shared-prefix requests per second (free tier)")
    ap.add_argument("--json", help="write the raw record here")
    args = ap.parse_args()
    seconds = int(args.minutes * 60)

    procs, sims = [], []
    try:
        for _ in range(3):
            port = free_port()
            procs.append(subprocess.Popen(
                [BIN, "sim", "--listen", f"127.0.0.1:{port}", "--profile", "h100-llama3-8b",
                 "--output-tokens", "4096"], stderr=subprocess.DEVNULL))
            sims.append(f"http://127.0.0.1:{port}")
        for s in sims:
            wait_http(s + "/health")
        api, admin_port = free_port(), free_port()
        admin = f"http://127.0.0.1:{admin_port}"
        cfg = tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False)
        cfg.write(config_yaml(sims))
        cfg.close()
        procs.append(subprocess.Popen(
            [BIN, "serve", "--config", cfg.name, "--listen", f"127.0.0.1:{api}",
             "--admin-listen", f"127.0.0.1:{admin_port}"],
            stderr=subprocess.DEVNULL, env={**os.environ, "RUST_LOG": "warn"}))
        wait_http(admin + "/readyz")
        url = f"http://127.0.0.1:{api}"
        base = [BIN, "bench", "--url", url, "--model", "sim-model", "--quiet", "--json", "-",
                "--duration", f"{seconds}s"]
        agents = subprocess.Popen(
            base + ["--workload", "agentic", "--api-key", KEYS["premium"],
                    "--sessions", "100000", "--concurrency", str(args.sessions_at_once),
                    "--max-tokens", "128"],
            stdout=subprocess.PIPE, text=True)
        chat = subprocess.Popen(
            base + ["--workload", "shared-prefix", "--api-key", KEYS["free"],
                    "--prefixes", "8", "--prefix-tokens", "1000", "--prompt-tokens", "50",
                    "--max-tokens", "256", "--rate", str(args.rate), "--concurrency", "256",
                    "--seed", "7"],
            stdout=subprocess.PIPE, text=True)

        seen, polls, started = {}, 0, time.time()
        samples = {g: {} for g in GAUGES}  # gauge -> replica -> values, one per poll
        while agents.poll() is None or chat.poll() is None:
            time.sleep(args.poll)
            d = get_json(admin + "/admin/diagnose")
            polls += 1
            text = get_text(admin + "/metrics")
            for g, name in GAUGES.items():
                for r, v in per_replica(text, name).items():
                    samples[g].setdefault(r, []).append(v)
            at = round(time.time() - started, 1)
            for f in d["findings"]:
                where = f.get("backend") or f.get("model") or f.get("tier") or ""
                key = (f["pathology"], where)
                if key not in seen:
                    seen[key] = {"pathology": f["pathology"], "where": where,
                                 "severity": f["severity"], "first_seen_s": at,
                                 "evidence": f["evidence"], "cause": f["cause"]}
                    print(f"  {at:6.1f} s: {f['pathology']} on {where} ({f['severity']})",
                          flush=True)
                seen[key]["last_seen_s"] = at
        reports = {"agentic": json.loads(agents.stdout.read()),
                   "shared_prefix": json.loads(chat.stdout.read())}
        metrics = get_text(admin + "/metrics")
    finally:
        stop(procs)

    load = {
        name: {
            "requests": r["requests"], "ok": r["ok"], "errors": r["errors"],
            "requests_per_second": r["requests_per_second"],
            "ttft_p50_ms": r["ttft_seconds"]["p50"] * 1e3,
            "ttft_p99_ms": r["ttft_seconds"]["p99"] * 1e3,
        }
        for name, r in reports.items()
    }
    record = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
        "machine": f"{platform.machine()} {os.cpu_count()} CPUs, {platform.platform()}",
        "commit": subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"],
                                 capture_output=True, text=True).stdout.strip(),
        "args": vars(args),
        "polls": polls,
        "findings": list(seen.values()),
        "load": load,
        # What the replicas carried, sampled at every diagnosis.
        "replicas": {
            r: {"mean_running": sum(v) / len(v), "max_running": max(v),
                "max_waiting": max(samples["waiting"].get(r, [0])),
                "mean_kv": sum(samples["kv"].get(r, [0])) / max(1, len(samples["kv"].get(r, []))),
                "max_kv": max(samples["kv"].get(r, [0]))}
            for r, v in samples["running"].items() if v
        },
        "gateway": {
            "requests_total": summed(metrics, "sluice_requests_total"),
            "preemptions_seen": summed(metrics, "sluice_backend_engine_preemptions_total"),
        },
    }
    for name, l in load.items():
        print(f"{name}: {l['ok']} of {l['requests']} ok, {l['requests_per_second']:.1f} req/s, "
              f"TTFT p50 {l['ttft_p50_ms']:.0f} ms p99 {l['ttft_p99_ms']:.0f} ms")
    for r, x in record["replicas"].items():
        print(f"{r}: running mean {x['mean_running']:.1f} max {x['max_running']:.0f}, "
              f"waiting max {x['max_waiting']:.0f}, KV mean {x['mean_kv']:.2f} max {x['max_kv']:.2f}")
    print(f"{polls} diagnoses over {seconds} s: "
          + ("nothing named" if not seen else f"{len(seen)} finding(s)"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)
            f.write("\n")
    sys.exit(1 if seen else 0)


if __name__ == "__main__":
    main()
