#!/usr/bin/env python3
"""Capacity of one simulated replica: concurrent streams and tokens/s on one core.

The simulator is pinned to CPU 0 and the load generator to CPU 1 (taskset), so
the simulator's CPU share is its own. For each concurrency level, `sluice bench`
keeps that many streamed requests open against a `sluice sim` whose batch limit
and KV cache are raised so that every stream is in the batch; the report gives
the tokens/s delivered, the simulator's CPU use (share of one core, from
/proc/PID/stat), and the inter-token latency the client saw next to the step
time the engine profile predicts for that batch.

    cargo build --release
    python3 benches/e2e/sim_capacity.py [--seconds 15] [--json out.json]
"""

import argparse
import datetime
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from stream_overhead import free_port, wait_http  # noqa: E402  (shared helpers)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.path.join(ROOT, "target", "release", "sluice")
CLK_TCK = os.sysconf("SC_CLK_TCK")
# h100-llama3-8b: step = 7.1 ms + 0.053 ms per sequence in the batch.
STEP_BASE_MS, PER_SEQ_MS = 7.1, 0.053


def cpu_seconds(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=int, default=15)
    ap.add_argument("--levels", default="250,1000,2000,4000,8000,2000x4,2000x10",
                    help="stream counts, optionally xSPEED (engine time sped up)")
    ap.add_argument("--json")
    args = ap.parse_args()
    if not os.path.exists(BIN):
        raise SystemExit("build first: cargo build --release")
    rows = []
    for level in args.levels.split(","):
        conc, _, speed = level.partition("x")
        conc, speed = int(conc), float(speed or 1)
        port = free_port()
        sim = subprocess.Popen(
            ["taskset", "-c", "0", BIN, "sim", "--listen", f"127.0.0.1:{port}", "--speed", str(speed),
             "--profile", "h100-llama3-8b", "--max-num-seqs", str(conc + 16),
             "--num-blocks", "2000000", "--output-tokens", "100000"],
            stderr=subprocess.DEVNULL)
        try:
            wait_http(f"http://127.0.0.1:{port}/health")
            # Open every stream first (connection setup is the client's slow
            # part), then measure a steady window.
            bench = subprocess.Popen(
                ["taskset", "-c", "1", BIN, "bench", "--url", f"http://127.0.0.1:{port}",
                 "--model", "sim-model", "--concurrency", str(conc), "--workload", "fixed",
                 "--prompt-tokens", "64", "--max-tokens", "100000",
                 "--duration", f"{args.seconds + 60}s", "--json", "-", "--quiet"],
                stdout=subprocess.DEVNULL)
            deadline = time.time() + 60
            while time.time() < deadline:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics") as r:
                    if gauge(r.read().decode(), "vllm:num_requests_running") >= conc:
                        break
                time.sleep(0.5)
            time.sleep(2)
            c0, t0 = cpu_seconds(sim.pid), time.time()
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics") as r:
                m0 = r.read().decode()
            time.sleep(args.seconds)
            c1, t1 = cpu_seconds(sim.pid), time.time()
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics") as r:
                m1 = r.read().decode()
            bench.kill()
            bench.wait()
            tokens = gen_tokens(m1) - gen_tokens(m0)
            running = gauge(m1, "vllm:num_requests_running")
            rows.append({
                "concurrency": conc,
                "speed": speed,
                "running": running,
                "tokens_per_s": tokens / (t1 - t0),
                "sim_cpu_share_of_one_core": (c1 - c0) / (t1 - t0),
                "predicted_step_ms": (STEP_BASE_MS + PER_SEQ_MS * running) / speed,
                "measured_step_ms": 1000 * running / (tokens / (t1 - t0)) if tokens else None,
            })
        finally:
            sim.send_signal(signal.SIGTERM)
            sim.wait(timeout=15)
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "git": subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True).stdout.strip(),
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "results": rows}, f, indent=2)
    print(f"Run {meta['date']}, commit {meta['git']}; simulator pinned to one core.\n")
    print("| streams | speed | in batch | tokens/s | simulator CPU (1 core = 100%) | step predicted | step measured |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['concurrency']} | {r['speed']:g}x | {r['running']:.0f} | {r['tokens_per_s']:.0f} | "
              f"{100 * r['sim_cpu_share_of_one_core']:.0f}% | {r['predicted_step_ms']:.1f} ms | "
              f"{r['measured_step_ms']:.1f} ms |")


def gen_tokens(text):
    return gauge(text, "vllm:generation_tokens_total")


def gauge(text, name):
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


if __name__ == "__main__":
    main()
