#!/usr/bin/env python3
"""Telemetry overhead: the gateway with tracing and the access log off, on with
their defaults, and on with every trace kept.

For each scenario the same `sluice sim` replica is put behind one gateway per
telemetry setting, and `sluice bench` drives each in turn, in alternating rounds
(so drift in the machine hits every setting alike). Reported per setting: the
client's throughput and latency percentiles, and the gateway's own CPU-seconds
per 1,000 requests (from /proc/PID/stat). Traces go over OTLP/HTTP to a small
receiver in this script that counts what arrives (its CPU is not the gateway's).

Metrics cannot be turned off (routing reads them); their per-request cost is
the criterion benchmark `cargo bench --bench hot_path -- metrics`.

    cargo build --release
    python3 benches/e2e/telemetry_overhead.py            # prints a Markdown table
    python3 benches/e2e/telemetry_overhead.py --json out.json --rounds 3

Everything listens on 127.0.0.1 only and every process is stopped at the end.
"""

import argparse
import datetime
import http.server
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from stream_overhead import BIN, ROOT, bench, cpu_seconds, free_port, machine, wait_http  # noqa: E402

SCENARIOS = [
    # name, concurrency, tokens, token delay, requests per round
    ("128 streams x 64 tokens @ 20 ms/token", 128, 64, "20ms", 2048),
    ("64 streams x 128 tokens @ no delay (CPU-bound)", 64, 128, "0ms", 8192),
]

SETTINGS = [
    # name, YAML telemetry section (the trace endpoint is filled in)
    ("off", "telemetry:\n  access_log: {{enabled: false}}\n  tracing: {{enabled: false}}\n"),
    ("on (defaults)",
     "telemetry:\n  access_log: {{enabled: true, target: file, path: {log}}}\n"
     "  tracing: {{enabled: true, protocol: http/protobuf, endpoint: 'http://127.0.0.1:{otlp}'}}\n"),
    ("on, every trace kept",
     "telemetry:\n  access_log: {{enabled: true, target: file, path: {log}}}\n"
     "  tracing:\n    enabled: true\n    protocol: http/protobuf\n    endpoint: 'http://127.0.0.1:{otlp}'\n"
     "    sampling: {{ratio: 1.0, max_per_second: 0}}\n"),
]


class Receiver(http.server.BaseHTTPRequestHandler):
    """Accepts OTLP/HTTP trace exports; answers an empty ExportTraceServiceResponse."""
    exports = 0
    bytes = 0
    lock = threading.Lock()

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("content-length", 0)))
        with Receiver.lock:
            Receiver.exports += 1
            Receiver.bytes += len(body)
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="also write the raw results here")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds per scenario")
    ap.add_argument("--scale", type=float, default=1.0, help="multiply request counts (e.g. 0.1 for a smoke run)")
    args = ap.parse_args()
    if not os.path.exists(BIN):
        raise SystemExit("build first: cargo build --release")

    otlp = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Receiver)
    threading.Thread(target=otlp.serve_forever, daemon=True).start()
    procs = []
    results = []
    tmp = tempfile.mkdtemp(prefix="sluice-telemetry-")
    try:
        for n, (name, conc, tokens, delay, requests) in enumerate(SCENARIOS):
            requests = max(conc, 10, int(requests * args.scale))
            sim_port = free_port()
            sim = subprocess.Popen(
                [BIN, "sim", "--listen", f"127.0.0.1:{sim_port}", "--profile", "fixed", "--prefill-delay", "0ms",
                 "--token-delay", delay, "--output-tokens", str(tokens)],
                stderr=subprocess.DEVNULL)
            procs.append(sim)
            wait_http(f"http://127.0.0.1:{sim_port}/health")
            gateways = []
            for i, (label, yaml) in enumerate(SETTINGS):
                conf = os.path.join(tmp, f"sluice-{n}-{i}.yaml")
                log = os.path.join(tmp, f"access-{n}-{i}.log")
                with open(conf, "w") as f:
                    f.write(yaml.format(log=log, otlp=otlp.server_address[1]))
                port, admin = free_port(), free_port()
                gw = subprocess.Popen(
                    [BIN, "serve", "--config", conf, "--backend", f"http://127.0.0.1:{sim_port}",
                     "--listen", f"127.0.0.1:{port}", "--admin-listen", f"127.0.0.1:{admin}"],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, "RUST_LOG": "warn"})
                procs.append(gw)
                wait_http(f"http://127.0.0.1:{admin}/readyz")
                gateways.append((label, f"http://127.0.0.1:{port}", gw, log))
            for label, url, gw, _ in gateways:
                bench(url, conc, tokens, conc)  # warm the pools
            runs = {label: [] for label, *_ in gateways}
            exports_before = Receiver.exports
            for k in range(args.rounds):
                # Rotate the order each round: no setting always runs first.
                for label, url, gw, _ in gateways[k % len(gateways):] + gateways[:k % len(gateways)]:
                    before = cpu_seconds([gw.pid])
                    rep = bench(url, conc, tokens, requests)
                    cpu = cpu_seconds([gw.pid]) - before
                    runs[label].append({
                        "ok": rep["ok"], "errors": sum(rep["errors"].values()),
                        "req_per_s": rep["requests_per_second"],
                        "ttft_p50_ms": rep["ttft_seconds"]["p50"] * 1e3,
                        "ttft_p99_ms": rep["ttft_seconds"]["p99"] * 1e3,
                        "itl_p99_ms": rep["inter_token_seconds"]["p99"] * 1e3,
                        "cpu_s_per_1000": cpu / rep["requests"] * 1000,
                    })
            row = {"scenario": name, "requests_per_round": requests, "rounds": args.rounds, "settings": {}}
            for label, url, gw, log in gateways:
                rs = runs[label]
                med = {k: statistics.median(r[k] for r in rs) for k in rs[0] if k not in ("ok", "errors")}
                med["ok"] = sum(r["ok"] for r in rs)
                med["errors"] = sum(r["errors"] for r in rs)
                med["access_log_lines"] = sum(1 for _ in open(log)) if os.path.exists(log) else 0
                row["settings"][label] = med
            row["otlp_exports"] = Receiver.exports - exports_before
            results.append(row)
            for _, _, gw, _ in gateways:
                gw.send_signal(signal.SIGTERM)
            sim.send_signal(signal.SIGTERM)
            for p in procs:
                p.wait(timeout=15)
            procs.clear()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        otlp.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)

    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine(),
        "git": subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True).stdout.strip(),
        "otlp_bytes": Receiver.bytes,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=2)
    print(report(meta, results))


def report(meta, results):
    lines = [f"Run {meta['date']} on {meta['machine']}, commit {meta['git']}; medians of "
             f"{results[0]['rounds']} alternating rounds.", ""]
    for r in results:
        s = r["settings"]
        off = s["off"]
        lines += [
            f"**{r['scenario']}**, {r['requests_per_round']} requests per round; "
            f"{r['otlp_exports']} OTLP export calls received",
            "",
            "| telemetry | ok | errors | req/s | TTFT p50 | TTFT p99 | ITL p99 | gateway CPU-s / 1000 req | vs off | access log lines |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for label, x in s.items():
            lines.append(
                f"| {label} | {x['ok']} | {x['errors']} | {x['req_per_s']:.1f} | {x['ttft_p50_ms']:.2f} ms | "
                f"{x['ttft_p99_ms']:.2f} ms | {x['itl_p99_ms']:.2f} ms | {x['cpu_s_per_1000']:.3f} | "
                f"{(x['cpu_s_per_1000'] / off['cpu_s_per_1000'] - 1) * 100:+.1f}% CPU, "
                f"{(x['req_per_s'] / off['req_per_s'] - 1) * 100:+.1f}% req/s | {x['access_log_lines']} |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
