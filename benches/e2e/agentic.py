#!/usr/bin/env python3
"""Routing against the best peer routers on a simulated fleet, in one run:
coding-agent sessions (`--scenario agentic`, the default) or shared-prefix
traffic (`--scenario shared`).

Four `sluice sim` replicas (engine model `h100-llama3-8b`), restarted fresh for
each router so no one inherits another's cache. Then `sluice bench --workload
agentic` (sessions sharing one long system + tools prompt, growing histories,
long tool results in a share of turns, think time) through:

  sluice                 one gateway, defaults (no configuration)
  sluice-3gw             three gateway processes behind nginx, round robin
  sluice-no-id           one gateway, the client sends no session id
  sluice-least-loaded    one gateway, `session_placement: least_loaded`: each new
                         session on the replica that served the fewest session
                         turns lately, then kept there (the issue's idealised router)
  sglang-cache_aware     sglang-router (PyPI) --policy cache_aware
  vllm-consistent_hash   vllm-router (PyPI) --policy consistent_hash (hashes x-session-id)

Reports client TTFT percentiles, stickiness (turns on the previous turn's
replica), replicas per session, the engines' prefix-cache hit rate (from
`usage.prompt_tokens_details.cached_tokens`) against the ideal (sessions kept
whole), and the busiest replica's share over the mean.

`--scenario shared`: 16 system prompts of ~1,500 tokens, each request one of
them and a short question, Poisson arrivals at `--rate`, through Sluice (one
gateway), sglang-router cache_aware and round robin (sglang-router); the
replicas' KV cut to `--num-blocks` (default 1000 here: ~10 prompts per
replica, all 16 fit the fleet). Reports TTFT, each replica's share of the
requests (from the replicas' own counters) and their prefix-cache hit rate.

    cargo build --release
    python3 -m venv /tmp/routers && /tmp/routers/bin/pip install sglang-router vllm-router
    python3 benches/e2e/agentic.py --routers-venv /tmp/routers --json docs/bench/agentic.json

Everything listens on 127.0.0.1; every process is stopped at the end.
"""

import argparse
import atexit
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from stream_overhead import free_port, wait_http  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.path.join(ROOT, "target", "release", "sluice")

NGINX_LB = """
worker_processes 1;
daemon off;
pid {dir}/nginx.pid;
error_log {dir}/error.log warn;
events {{ worker_connections 8192; }}
http {{
    access_log off;
    client_body_temp_path {dir}/body;
    proxy_temp_path {dir}/proxy;
    fastcgi_temp_path {dir}/fastcgi;
    uwsgi_temp_path {dir}/uwsgi;
    scgi_temp_path {dir}/scgi;
    upstream gateways {{
{servers}
        keepalive 256;
    }}
    server {{
        listen 127.0.0.1:{port};
        client_max_body_size 64m;
        client_body_buffer_size 64m;
        proxy_request_buffering off;
        location / {{
            proxy_pass http://gateways;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_read_timeout 600s;
        }}
    }}
}}
"""


class Procs:
    def __init__(self):
        self.procs = []

    def start(self, args, **kw):
        p = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, **kw)
        self.procs.append(p)
        return p

    def stop(self):
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
        self.procs = []


# `--cache-at`: when a prompt block becomes a prefix hit on the replicas.
CACHE_AT = "compute"


def start_sims(procs, n, blocks):
    urls = []
    for _ in range(n):
        port = free_port()
        args = [BIN, "sim", "--listen", f"127.0.0.1:{port}", "--profile", "h100-llama3-8b",
                "--output-tokens", "4096"]
        if blocks:
            args += ["--num-blocks", str(blocks)]
        if CACHE_AT != "compute":  # (older builds lack the flag)
            args += ["--cache-at", CACHE_AT]
        procs.start(args)
        urls.append(f"http://127.0.0.1:{port}")
    for u in urls:
        wait_http(u + "/health")
    return urls


# The admin URLs of the gateways started for the current run (their routing
# decisions and session moves are read after it).
ADMINS = []


def start_sluice(procs, sims, extra=()):
    api, admin = free_port(), free_port()
    ADMINS.append(f"http://127.0.0.1:{admin}")
    args = [BIN, "serve", "--listen", f"127.0.0.1:{api}", "--admin-listen", f"127.0.0.1:{admin}"]
    for s in sims:
        args += ["--backend", s]
    procs.start(list(args) + list(extra), env={**os.environ, "RUST_LOG": "warn"})
    wait_http(f"http://127.0.0.1:{admin}/readyz")
    return f"http://127.0.0.1:{api}"


def start_router(procs, venv, kind, policy, sims):
    port = free_port()
    if kind == "sglang":
        args = [os.path.join(venv, "bin", "sglang-router"), "launch", "--host", "127.0.0.1",
                "--port", str(port), "--policy", policy, "--worker-urls", *sims]
    else:
        args = [os.path.join(venv, "bin", "vllm-router"), "--host", "127.0.0.1",
                "--port", str(port), "--policy", policy, "--worker-urls", *sims]
    procs.start(args)
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/v1/models", timeout=60)
    return url


def start_lb(procs, gateways):
    tmp = tempfile.mkdtemp()
    port = free_port()
    servers = "\n".join(f"        server {g.split('//')[1]};" for g in gateways)
    conf = os.path.join(tmp, "nginx.conf")
    with open(conf, "w") as f:
        f.write(NGINX_LB.format(dir=tmp, servers=servers, port=port))
    nginx = shutil.which("nginx") or "/usr/sbin/nginx"
    procs.start([nginx, "-c", conf, "-p", tmp])
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/v1/models")
    return url


def bench(url, args, no_id=False):
    out = tempfile.NamedTemporaryFile(suffix=".json", delete=False).name
    cmd = [BIN, "bench", "--url", url, "--model", "sim-model", "--workload", "agentic",
           "--sessions", str(args.sessions), "--concurrency", str(args.concurrency),
           "--turns", str(args.turns), "--prefix-tokens", str(args.shared_tokens),
           "--prompt-tokens", "100", "--max-tokens", str(args.max_tokens),
           "--tool-tokens", str(args.tool_tokens), "--tool-share", str(args.tool_share),
           "--think-time", args.think, "--seed", str(args.seed), "--quiet", "--json", out]
    if no_id:
        cmd.append("--no-session-id")
    if args.heavy_sessions:
        cmd.append("--heavy-sessions")
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    with open(out) as f:
        return json.load(f)


def gateway_counts(admins, names):
    """Sum of each labelled series of `names` over the gateways: {"name{labels}": value}."""
    out = {}
    for u in admins:
        with urllib.request.urlopen(u + "/metrics", timeout=5) as r:
            for line in r.read().decode().splitlines():
                if line.startswith(tuple(n + "{" for n in names)):
                    key, value = line.rsplit(" ", 1)
                    out[key] = out.get(key, 0.0) + float(value)
    return out


def sim_counts(sims, name):
    out = []
    for u in sims:
        total = 0.0
        with urllib.request.urlopen(u + "/metrics", timeout=5) as r:
            for line in r.read().decode().splitlines():
                if line.startswith(name + "{") or line.startswith(name + " "):
                    total += float(line.rsplit(" ", 1)[1])
        out.append(total)
    return out


def shared(args):
    runs = ["sluice", "round_robin"]
    if args.routers_venv:
        runs.insert(1, "sglang-cache_aware")
    if args.only:
        runs = [r for r in runs if r in args.only]
    results = {}
    for name in runs:
        procs = Procs()
        try:
            sims = start_sims(procs, 4, args.num_blocks or 1000)
            if name == "sluice":
                url = start_sluice(procs, sims, ["--config", args.sluice_config] if args.sluice_config else [])
            elif name == "sglang-cache_aware":
                url = start_router(procs, args.routers_venv, "sglang", "cache_aware", sims)
            else:
                url = start_router(procs, args.routers_venv, "sglang", "round_robin", sims) \
                    if args.routers_venv else start_sluice(procs, sims, ["--policy", "round-robin"])
            time.sleep(2)
            out = tempfile.NamedTemporaryFile(suffix=".json", delete=False).name
            subprocess.run([BIN, "bench", "--url", url, "--model", "sim-model", "--workload", "shared-prefix",
                            "--prefixes", "16", "--prefix-tokens", "1500", "--prompt-tokens", "50",
                            "--max-tokens", "64", "--rate", str(args.rate), "--concurrency", "1024",
                            "--duration", args.duration, "--seed", str(args.seed), "--quiet", "--json", out],
                           check=True, stdout=subprocess.DEVNULL)
            with open(out) as f:
                r = json.load(f)
            served = sim_counts(sims, "vllm:request_success_total")
            hits = sum(sim_counts(sims, "vllm:prefix_cache_hits_total"))
            queries = sum(sim_counts(sims, "vllm:prefix_cache_queries_total"))
            total = sum(served) or 1
            r["shares"] = [round(x / total, 3) for x in served]
            r["busiest_over_mean"] = round(max(served) / (total / len(served)), 3)
            r["prefix_hit"] = hits / queries if queries else None
            results[name] = r
            t = r["ttft_seconds"]
            print(f"{name:22s} TTFT p50 {t['p50']*1e3:7.1f} p99 {t['p99']*1e3:8.1f} ms | shares {r['shares']} "
                  f"busiest {r['busiest_over_mean']:.2f}x | hit {r['prefix_hit']*100:5.1f}% | "
                  f"{r['requests_per_second']:.1f} req/s | ok {r['ok']}/{r['requests']}", flush=True)
        finally:
            procs.stop()
    return results


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--routers-venv", help="virtualenv with sglang-router and vllm-router")
    ap.add_argument("--only", nargs="*", help="run only these routers")
    ap.add_argument("--sessions", type=int, default=200)
    ap.add_argument("--concurrency", type=int, default=48)
    ap.add_argument("--turns", type=int, default=12)
    ap.add_argument("--shared-tokens", type=int, default=3000)
    ap.add_argument("--tool-tokens", type=int, default=3000)
    ap.add_argument("--tool-share", type=float, default=0.2)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--think", default="1s")
    ap.add_argument("--num-blocks", type=int, default=0, help="KV blocks per replica (0: the profile's)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--heavy-sessions", action="store_true",
                    help="heavy-tailed session lengths (Pareto, about the same mean)")
    ap.add_argument("--scenario", choices=["agentic", "shared"], default="agentic")
    ap.add_argument("--rate", type=float, default=40.0, help="shared: requests per second")
    ap.add_argument("--duration", default="40s", help="shared: how long")
    ap.add_argument("--sluice-config", help="a config file for the Sluice gateways (tuning runs)")
    ap.add_argument("--cache-at", choices=["compute", "schedule"], default="compute",
                    help="when a prompt block becomes a prefix hit on the simulated replicas: "
                    "once computed (SGLang's radix tree, the default) or once scheduled "
                    "(vLLM V1, which shares a prompt still being prefilled)")
    ap.add_argument("--json")
    args = ap.parse_args()
    global CACHE_AT
    CACHE_AT = args.cache_at
    if args.scenario == "shared":
        results = shared(args)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({
                    "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
                    "machine": f"{platform.machine()} {os.cpu_count()} CPUs, {platform.platform()}",
                    "args": vars(args),
                    "results": results,
                }, f, indent=2)
        return

    runs = ["sluice", "sluice-3gw", "sluice-no-id", "sluice-least-loaded"]
    if args.routers_venv:
        runs += ["sglang-cache_aware", "vllm-consistent_hash"]
    if args.only:
        runs = [r for r in runs if r in args.only]
    if args.sluice_config and "sluice-least-loaded" in runs:
        # Its own configuration is the point of that run.
        print("--sluice-config: sluice-least-loaded not run (it has its own configuration)", flush=True)
        runs = [r for r in runs if r != "sluice-least-loaded"]
    results = {}
    for name in runs:
        procs = Procs()
        try:
            sims = start_sims(procs, 4, args.num_blocks)
            ADMINS.clear()
            extra = ["--config", args.sluice_config] if args.sluice_config else []
            if name == "sluice" or name == "sluice-no-id":
                url = start_sluice(procs, sims, extra)
            elif name == "sluice-least-loaded":
                conf = os.path.join(tempfile.mkdtemp(), "least_loaded.yaml")
                atexit.register(shutil.rmtree, os.path.dirname(conf), True)
                with open(conf, "w") as f:
                    f.write("routing:\n  prefix_kv:\n    session_placement: least_loaded\n")
                url = start_sluice(procs, sims, ["--config", conf])
            elif name == "sluice-3gw":
                url = start_lb(procs, [start_sluice(procs, sims, extra) for _ in range(3)])
            elif name == "sglang-cache_aware":
                url = start_router(procs, args.routers_venv, "sglang", "cache_aware", sims)
            else:
                url = start_router(procs, args.routers_venv, "vllm", "consistent_hash", sims)
            time.sleep(2)  # first metrics scrapes and health checks
            t0 = time.time()
            r = bench(url, args, no_id=(name == "sluice-no-id"))
            r["wall_seconds"] = round(time.time() - t0, 1)
            if ADMINS:
                # Why each request went where it did, and why sessions moved.
                r["gateway"] = gateway_counts(
                    ADMINS, ["sluice_routing_decisions_total", "sluice_routing_session_moves_total"])
            results[name] = r
            s, t = r["sessions"], r["ttft_seconds"]
            print(f"{name:22s} TTFT p50 {t['p50']*1e3:7.1f} p99 {t['p99']*1e3:8.1f} ms | "
                  f"sticky {s['stickiness']*100:5.1f}% (2nd {s['second_turn_stickiness']*100:5.1f}%) | "
                  f"{s['replicas_per_session']:.2f} repl/sess | hit {s['prefix_hit']*100:5.1f}% "
                  f"(ideal {s['ideal_prefix_hit']*100:5.1f}%) | busiest {s['busiest_over_mean']:.2f}x | "
                  f"ok {r['ok']}/{r['requests']}", flush=True)
        finally:
            procs.stop()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({
                "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
                "machine": f"{platform.machine()} {os.cpu_count()} CPUs, {platform.platform()}",
                "args": vars(args),
                "results": results,
            }, f, indent=2)


if __name__ == "__main__":
    main()
