#!/usr/bin/env python3
"""Routing over a matrix of fleets and seeds, with the peer routers in the same run.

A routing result is a distribution, not a draw: each cell below is a fleet and a
workload; each is run for several seeds, and for each seed every router gets the
same fresh replicas (restarted, cold caches) and the same requests. Reported per
cell: each router's TTFT p50/p99, the busiest replica's requests over the mean,
the prefix-cache hit rate (the engines' own counters), stickiness for sessions;
then the median over seeds, and over cells the worst and the median of Sluice's
p99 against the best peer's.

Cells (`--cells`, default all):

  few_keys        the issue's fleet: 4 replicas of 64 seats, 2,048 batched tokens,
                  1,024 KV blocks of 16 tokens, prefill 0.1 ms a token, steps of
                  8 ms + 0.1 ms a running sequence; cold caches; 16 system prompts
                  of ~1,500 tokens used uniformly, a ~20-token question, 32 tokens
                  out, Poisson 40 requests/s
  few_keys_tight  the same with 512 KV blocks a replica: the 16 prompts do not fit
                  the fleet twice over (cache pressure on)
  few_keys_3gw, few_keys_tight_3gw  `few_keys`, `few_keys_tight` through three Sluice
                  gateways behind nginx (round robin): do the gateways agree on new
                  prefix homes? Each alone, and as `sluice-shared` (below)
  few_keys_slow   slow engine steps: 24 ms + 0.3 ms a sequence, prefill 0.3 ms a
                  token, 13 requests/s (the same load relative to capacity)
  many_keys       64 prompts of ~1,500 tokens on 4 replicas of 2,048 blocks (more
                  keys than the fleet caches), 40 requests/s
  many_keys_3gw   `many_keys` through three Sluice gateways (as `few_keys_3gw`)
  sessions        200 coding-agent sessions, 48 at once (`sluice bench --workload
                  agentic`: a shared 3,000-token system prompt, growing histories,
                  3,000-token tool results in 20% of turns, 1 s think time), on the
                  issue's fleet with 4,096 blocks a replica
  sessions_heavy  the same with heavy-tailed session lengths (Pareto, at most 8x)
  sessions_3gw    `sessions` through three Sluice gateways behind nginx (round robin);
                  the peers' runs of `sessions` (same seeds) compare, or a peer named
                  in `--only` runs here (one router, the same sessions)
  sessions_heavy_3gw  `sessions_heavy` through three Sluice gateways; likewise

`--engine b` runs the replicas on `engine_b.py`, a second engine model written apart
from `sluice sim` (same API and metric names, its own tokenizer, scheduler, cache and
preemption): a decision tuned on one model must hold on the other.

`--cache-at schedule` gives either engine model vLLM V1's prefix caching: a prompt
block is a cache hit as soon as the step computing it is scheduled, so requests
for a prompt that is being prefilled share its blocks (by default, `compute`, only
once that step has ended, as SGLang's radix tree does).

`--dialect sglang` has the `sluice sim` replicas speak SGLang's metrics instead of
vLLM's, so Sluice takes them for SGLang engines (what it reads of their queue and
cache changes with it, and `hold_for_prefill: auto` holds); the prefix hit is then
each replica's hit-rate gauge weighted by its prompt tokens.

Routers: Sluice (defaults, no config) and, from `--routers-venv`, sglang-router
`cache_aware` and vllm-router `cache_aware` (prefix cells) or `consistent_hash`
(session cells, hashing `x-session-id`). On session cells Sluice also runs as its
docs say to deploy it where new sessions should be placed by pressure: through one
gateway `sluice-first_open` (`routing.prefix_kv.session_placement: first_open`).
Through several gateways (any cell) Sluice also runs as `sluice-shared`: the
gateways share a routing table in a `redis-server` started for the run
(`routing.sessions.store: redis`: sessions, whose `auto` placement is then
`first_open`, and new prefixes' homes). Other variants by name (`--only`): `sluice-PLACEMENT`,
`sluice-shared-PLACEMENT`.

    cargo build --release
    python3 -m venv /tmp/routers && /tmp/routers/bin/pip install sglang-router vllm-router
    python3 benches/e2e/matrix.py --routers-venv /tmp/routers --seeds 1,2,3,4,5 \\
        --json docs/bench/matrix/routing_DATE.json

Everything listens on 127.0.0.1; every process is stopped at the end of its run.
"""

import argparse
import datetime
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from stream_overhead import free_port, wait_http  # noqa: E402
import agentic  # noqa: E402
from agentic import (ADMINS, Procs, gateway_counts, sim_counts, start_lb,  # noqa: E402
                     start_router, start_sluice)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.path.join(ROOT, "target", "release", "sluice")

# The issue's engine: steps of 8 ms + 0.1 ms a running sequence, prefill 0.1 ms
# a token, 64 seats, 2,048 batched tokens. (Milliseconds.)
FAST = dict(base=8.0, per_seq=0.1, per_token=0.1, seats=64, batched=2048)
SLOW = dict(base=24.0, per_seq=0.3, per_token=0.3, seats=64, batched=2048)
HERE = os.path.dirname(os.path.abspath(__file__))


def engine_args(kind, e, blocks, port):
    """The command of one replica: `sluice sim`, or the second engine model
    (`engine_b.py`, written apart from it)."""
    if kind == "b":
        return [sys.executable, os.path.join(HERE, "engine_b.py"), "--port", str(port),
                "--num-blocks", str(blocks), "--max-seqs", str(e["seats"]),
                "--max-batched-tokens", str(e["batched"]), "--step-base-ms", str(e["base"]),
                "--per-seq-ms", str(e["per_seq"]), "--per-token-ms", str(e["per_token"]),
                *cache_at()]
    return [BIN, "sim", "--listen", f"127.0.0.1:{port}", "--profile", "h100-llama3-8b",
            "--output-tokens", "4096", "--num-blocks", str(blocks),
            "--step-base", f"{e['base'] * 1000:.0f}us", "--step-per-seq", f"{e['per_seq'] * 1000:.0f}us",
            "--prefill-per-token", f"{e['per_token'] * 1000:.0f}us",
            "--max-num-seqs", str(e["seats"]), "--max-num-batched-tokens", str(e["batched"]),
            *cache_at(), *(["--dialect", DIALECT] if DIALECT != "vllm" else [])]


def cache_at():
    """The engines' `--cache-at`, when not the default (older builds lack it)."""
    return [] if CACHE_AT == "compute" else ["--cache-at", CACHE_AT]


CELLS = {
    "few_keys": dict(kind="prefix", engine=FAST, blocks=1024, prefixes=16, rate=40.0),
    "few_keys_tight": dict(kind="prefix", engine=FAST, blocks=512, prefixes=16, rate=40.0),
    "few_keys_slow": dict(kind="prefix", engine=SLOW, blocks=1024, prefixes=16, rate=13.0),
    "many_keys": dict(kind="prefix", engine=FAST, blocks=2048, prefixes=64, rate=40.0),
    "sessions": dict(kind="sessions", engine=FAST, blocks=4096),
    "sessions_heavy": dict(kind="sessions", engine=FAST, blocks=4096, heavy=True),
    "few_keys_3gw": dict(kind="prefix", engine=FAST, blocks=1024, prefixes=16, rate=40.0,
                         gateways=3),
    "few_keys_tight_3gw": dict(kind="prefix", engine=FAST, blocks=512, prefixes=16, rate=40.0,
                               gateways=3),
    "many_keys_3gw": dict(kind="prefix", engine=FAST, blocks=2048, prefixes=64, rate=40.0,
                          gateways=3),
    "sessions_3gw": dict(kind="sessions", engine=FAST, blocks=4096, gateways=3),
    "sessions_heavy_3gw": dict(kind="sessions", engine=FAST, blocks=4096, heavy=True, gateways=3),
}


ENGINE = "sim"
# When a prompt block becomes a prefix-cache hit (`--cache-at`).
CACHE_AT = "compute"
# The metrics the simulated replicas speak (`--dialect`): which engine Sluice
# sees, e.g. `routing.prefix_kv.hold_for_prefill: auto` holds on SGLang's.
DIALECT = "vllm"
# A config file for the Sluice gateways (experiments: `--sluice-config`).
SLUICE_CONFIG = None
# `--cold-prefill-tokens`.
COLD_PREFILL_TOKENS = "engine"


def start_fleet(procs, cell, n=4):
    urls = []
    for _ in range(n):
        port = free_port()
        procs.start(engine_args(ENGINE, cell["engine"], cell["blocks"], port))
        urls.append(f"http://127.0.0.1:{port}")
    for u in urls:
        wait_http(u + "/health")
    return urls


def peers(cell):
    if cell["kind"] == "prefix":
        return ["sglang-cache_aware", "vllm-cache_aware"]
    return ["sglang-cache_aware", "vllm-consistent_hash"]


def routers(cell, venv, only=None):
    out = ["sluice"]
    if cell.get("gateways", 1) > 1:
        out.append("sluice-shared")
    elif cell["kind"] == "sessions":
        out.append("sluice-first_open")
    if venv:
        if cell.get("gateways", 1) == 1:
            out += peers(cell)
        else:
            # Several gateways are Sluice's case: by default the peers' runs of the
            # one-gateway cell (same seeds) compare. Named in --only, a peer runs
            # here too, one router on the same sessions, interleaved with Sluice
            # seed by seed (the same hour's machine for both).
            out += [p for p in peers(cell) if only and p in only]
    return out


def start_redis(procs):
    port = free_port()
    procs.start(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                 "--appendonly", "no"])
    deadline = time.time() + 10
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return f"redis://127.0.0.1:{port}"
        except OSError:
            if time.time() > deadline:
                raise
            time.sleep(0.05)


def sluice_config(procs, name, cell):
    """The config file of a Sluice variant (`None`: defaults). As an operator
    sets it, `routing.prefix_kv.cold_prefill_tokens` is the engines' prefill
    tokens per step (`--cold-prefill-tokens engine`, the default; `none` for
    builds before it)."""
    if SLUICE_CONFIG:
        if name != "sluice":
            raise SystemExit("--sluice-config runs with plain `sluice` only (--only sluice)")
        return SLUICE_CONFIG
    parts = name.split("-")[1:]
    body = "routing:\n"
    if parts and parts[0] == "shared":
        parts = parts[1:]
        body += ("  sessions:\n    store: redis\n"
                 f"    redis: {{url: \"{start_redis(procs)}\"}}\n")
    prefix_kv = []
    if parts:
        prefix_kv.append(f"session_placement: {parts[0]}")
    if COLD_PREFILL_TOKENS == "engine":
        prefix_kv.append(f"cold_prefill_tokens: {cell['engine']['batched']}")
    elif COLD_PREFILL_TOKENS != "none":
        prefix_kv.append(f"cold_prefill_tokens: {int(COLD_PREFILL_TOKENS)}")
    if prefix_kv:
        body += "  prefix_kv:\n" + "".join(f"    {line}\n" for line in prefix_kv)
    if body == "routing:\n":
        return None
    f = tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False)
    f.write(body)
    f.close()
    return f.name


def start(procs, name, sims, cell, venv):
    ADMINS.clear()
    if name.startswith("sluice"):
        config = sluice_config(procs, name, cell)
        extra = ["--config", config] if config else []
        if cell.get("gateways", 1) > 1:
            return start_lb(procs, [start_sluice(procs, sims, extra) for _ in range(cell["gateways"])])
        return start_sluice(procs, sims, extra)
    kind, policy = name.split("-", 1)
    return start_router(procs, venv, kind, policy, sims)


def bench(url, cell, args, seed):
    out = tempfile.NamedTemporaryFile(suffix=".json", delete=False).name
    cmd = [BIN, "bench", "--url", url, "--model", "sim-model", "--seed", str(seed), "--quiet",
           "--json", out]
    if cell["kind"] == "prefix":
        cmd += ["--workload", "shared-prefix", "--prefixes", str(cell["prefixes"]),
                "--prefix-tokens", "1500", "--prompt-tokens", "20", "--max-tokens", "32",
                "--rate", str(cell["rate"]), "--concurrency", "1024",
                "--requests", str(args.requests)]
        # Every request's timing: kept with `--requests-dir`, else read for
        # the warm p99 and dropped.
        d = args.requests_dir or tempfile.mkdtemp()
        os.makedirs(d, exist_ok=True)
        per_request = os.path.join(d, f"{args.current}_{ENGINE}_seed{seed}.jsonl")
        cmd += ["--requests-json", per_request]
    else:
        cmd += ["--workload", "agentic", "--sessions", "200", "--concurrency", "48",
                "--turns", "12", "--prefix-tokens", "3000", "--prompt-tokens", "100",
                "--max-tokens", "48", "--tool-tokens", "3000", "--tool-share", "0.2",
                "--think-time", "1s"]
        if cell.get("heavy"):
            cmd.append("--heavy-sessions")
        if args.requests_dir:
            # Every turn (its session, number, replica, timing) with
            # `--requests-dir`: where sessions moved and what it cost.
            os.makedirs(args.requests_dir, exist_ok=True)
            cmd += ["--requests-json", os.path.join(
                args.requests_dir, f"{args.current}_{ENGINE}_seed{seed}.jsonl")]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    with open(out) as f:
        r = json.load(f)
    os.unlink(out)
    if cell["kind"] == "prefix":
        r["warm_ttft_p99"] = warm_p99(per_request)
        if not args.requests_dir:
            os.unlink(per_request)
    return r


# The cold start: every prefix's first prompts are prefilled cold, and at 3,000
# requests the run's p99 is its 30 slowest requests, which for every router are
# among the first ~70 (per-request data in the benchmark log). The warm p99 is
# that of the requests sent after the first WARM_AFTER seconds.
WARM_AFTER = 5.0


def warm_p99(path):
    with open(path) as f:
        rows = [json.loads(line) for line in f]
    v = sorted(r["ttft_s"] for r in rows if r["sent_s"] > WARM_AFTER and r["ttft_s"] is not None)
    return v[min(len(v) - 1, int(0.99 * len(v)))] if v else None


def watch_gateways(args, seed):
    """With `--requests-dir`: each gateway's view of the replicas
    (`/admin/backends`) every 100 ms until the returned event is set, one JSON
    line per look (`t`: seconds since the first)."""
    if not (ADMINS and args.requests_dir):
        return None
    stop = threading.Event()
    os.makedirs(args.requests_dir, exist_ok=True)
    path = os.path.join(args.requests_dir, f"{args.current}_{ENGINE}_seed{seed}_backends.jsonl")
    admins = list(ADMINS)

    def run():
        t0 = time.time()
        with open(path, "w") as f:
            while not stop.wait(0.1):
                for k, admin in enumerate(admins):
                    try:
                        with urllib.request.urlopen(admin + "/admin/backends", timeout=2) as r:
                            f.write(json.dumps({"t": round(time.time() - t0, 3), "gateway": k,
                                                "backends": json.loads(r.read())}) + "\n")
                    except OSError:
                        pass
    threading.Thread(target=run, daemon=True).start()
    return stop


def run_one(name, cell, args, seed):
    args.current = f"{args.cell_name}_{name}"
    procs = Procs()
    try:
        sims = start_fleet(procs, cell)
        url = start(procs, name, sims, cell, args.routers_venv)
        time.sleep(2)  # health checks and the first metrics scrapes
        watch = watch_gateways(args, seed)
        try:
            r = bench(url, cell, args, seed)
        finally:
            if watch:
                watch.set()
        if DIALECT == "sglang":
            # SGLang's metrics have no hit counter: its hit-rate gauge (the
            # whole run's, in the simulator) weighs each replica's prompt tokens.
            served = sim_counts(sims, "sglang:num_requests_total")
            prompts = sim_counts(sims, "sglang:prompt_tokens_total")
            rates = sim_counts(sims, "sglang:cache_hit_rate")
            hits, queries = sum(r * p for r, p in zip(rates, prompts)), sum(prompts)
        else:
            served = sim_counts(sims, "vllm:request_success_total")
            hits = sum(sim_counts(sims, "vllm:prefix_cache_hits_total"))
            queries = sum(sim_counts(sims, "vllm:prefix_cache_queries_total"))
        total = sum(served) or 1
        row = {
            "ok": r["ok"], "requests": r["requests"],
            "ttft_p50_ms": round(r["ttft_seconds"]["p50"] * 1e3, 1),
            "ttft_p99_ms": round(r["ttft_seconds"]["p99"] * 1e3, 1),
            "warm_ttft_p99_ms": (round(r["warm_ttft_p99"] * 1e3, 1)
                                 if r.get("warm_ttft_p99") is not None else None),
            "itl_p99_ms": round(r["inter_token_seconds"]["p99"] * 1e3, 2),
            "shares": [round(x / total, 3) for x in served],
            "busiest_over_mean": round(max(served) / (total / len(served)), 3),
            "prefix_hit": round(hits / queries, 4) if queries else None,
        }
        if r.get("sessions"):
            s = r["sessions"]
            row["sticky"] = round(s["stickiness"], 4)
            row["second_turn_sticky"] = round(s["second_turn_stickiness"], 4)
            row["engine_hit"] = round(s["prefix_hit"], 4)
            row["ideal_hit"] = round(s["ideal_prefix_hit"], 4)
        if ADMINS and args.requests_dir:
            # Each gateway's own metrics at the run's end, beside its requests.
            for k, admin in enumerate(ADMINS):
                path = os.path.join(args.requests_dir,
                                    f"{args.current}_{ENGINE}_seed{seed}_gateway{k}.prom")
                with urllib.request.urlopen(admin + "/metrics", timeout=10) as resp, \
                        open(path, "wb") as f:
                    f.write(resp.read())
        if ADMINS:
            row["decisions"] = {k.split('reason="')[1].rstrip('"}'): v for k, v in gateway_counts(
                ADMINS, ["sluice_routing_decisions_total"]).items() if v}
            # Flow control's admissions: `waited` means a request was held at
            # the gateway (every replica's seats known and taken).
            row["admissions"] = {}
            for k, v in gateway_counts(ADMINS, ["sluice_flow_requests_total"]).items():
                if v and 'outcome="' in k:
                    o = k.split('outcome="')[1].split('"')[0]
                    row["admissions"][o] = row["admissions"].get(o, 0) + v
            # Requests held for a prefill of their prompt under way
            # (`routing.prefix_kv.hold_for_prefill`), by outcome, and
            # those held for another gateway's prefill apart (`shared_*`).
            row["prefill_holds"] = {}
            for k, v in gateway_counts(ADMINS, ["sluice_routing_prefill_holds_total"]).items():
                if v and 'outcome="' in k:
                    o = k.split('outcome="')[1].split('"')[0]
                    if 'prefill="shared"' in k:
                        o = "shared_" + o
                    row["prefill_holds"][o] = row["prefill_holds"].get(o, 0) + v
            # Cold prefills that waited for room in their replica's gate
            # (`routing.prefix_kv.cold_prefill_tokens`), by outcome.
            row["cold_gate_waits"] = {}
            for k, v in gateway_counts(ADMINS, ["sluice_routing_cold_gate_waits_total"]).items():
                if v and 'outcome="' in k:
                    o = k.split('outcome="')[1].split('"')[0]
                    row["cold_gate_waits"][o] = row["cold_gate_waits"].get(o, 0) + v
            # Whether each gateway saw only its own requests at the engines
            # at the run's end (`sluice_routing_alone`: `session_placement:
            # auto` then places new sessions by pressure), where the build
            # exports it.
            alone = []
            for admin in ADMINS:
                with urllib.request.urlopen(admin + "/metrics", timeout=5) as resp:
                    alone += [int(float(line.split()[1])) for line in resp.read().decode().splitlines()
                              if line.startswith("sluice_routing_alone ")]
            if alone:
                row["alone"] = alone
        return row
    finally:
        procs.stop()


def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--routers-venv", help="virtualenv with sglang-router and vllm-router")
    ap.add_argument("--cells", nargs="*", default=list(CELLS), choices=list(CELLS))
    ap.add_argument("--seeds", default="1,2,3,4,5")
    ap.add_argument("--only", nargs="*", help="run only these routers")
    ap.add_argument("--requests", type=int, default=3000, help="prefix cells: requests a run")
    ap.add_argument("--engine", choices=["sim", "b"], default="sim",
                    help="the replicas: `sluice sim`, or engine_b.py (the second engine model)")
    ap.add_argument("--cache-at", choices=["compute", "schedule"], default="compute",
                    help="the engines' prefix caching: blocks hit once computed, or once "
                         "scheduled (vLLM V1)")
    ap.add_argument("--dialect", choices=["vllm", "sglang"], default="vllm",
                    help="`sluice sim` replicas: whose metrics they speak (which engine "
                         "Sluice takes them for)")
    ap.add_argument("--sluice-config", help="a config file for the Sluice gateways (experiments)")
    ap.add_argument("--requests-dir", help="prefix cells: every request's timing, a file a run; "
                    "through Sluice also each gateway's /metrics at the end and its "
                    "/admin/backends every 100 ms")
    ap.add_argument("--bin", help="the sluice binary for replicas, gateways and load (default "
                    "target/release/sluice; a copy lets a long run outlive a rebuild)")
    ap.add_argument("--cold-prefill-tokens", default="engine",
                    help="Sluice's routing.prefix_kv.cold_prefill_tokens: `engine` (the default: the "
                         "replicas' batched tokens a step, as an operator sets it), a number, or `none` "
                         "(not set: builds before it)")
    ap.add_argument("--json")
    args = ap.parse_args()
    global ENGINE, SLUICE_CONFIG, BIN, CACHE_AT, DIALECT, COLD_PREFILL_TOKENS
    ENGINE, SLUICE_CONFIG, CACHE_AT = args.engine, args.sluice_config, args.cache_at
    COLD_PREFILL_TOKENS = args.cold_prefill_tokens
    DIALECT = args.dialect
    if DIALECT != "vllm" and ENGINE != "sim":
        raise SystemExit("--dialect is a `sluice sim` knob: engine b speaks vLLM's metrics")
    if args.bin:
        BIN = agentic.BIN = os.path.abspath(args.bin)
    if not os.path.exists(BIN):
        raise SystemExit("build first: cargo build --release")
    seeds = [int(s) for s in args.seeds.split(",")]
    out = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
        "machine": f"{platform.machine()} {os.cpu_count()} CPUs, {platform.platform()}",
        "commit": subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"],
                                 capture_output=True, text=True).stdout.strip(),
        "args": vars(args), "cells": {},
    }

    def save():
        if args.json:
            os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
            with open(args.json, "w") as f:
                json.dump(out, f, indent=2)

    for cname in args.cells:
        cell = CELLS[cname]
        args.cell_name = cname
        names = [r for r in routers(cell, args.routers_venv, args.only) if not args.only or r in args.only]
        # Sluice's other variants, by name (`sluice-PLACEMENT`, `sluice-shared-PLACEMENT`).
        names += [r for r in args.only or [] if r.startswith("sluice-") and r not in names]
        runs = {n: [] for n in names}
        for seed in seeds:
            # Routers interleaved seed by seed: whatever the shared machine does
            # meanwhile falls on all of them alike.
            for n in names:
                row = run_one(n, cell, args, seed)
                row["seed"] = seed
                runs[n].append(row)
                extra = (f" sticky {row['sticky']*100:.1f}%" if "sticky" in row else "")
                print(f"{cname:15s} seed {seed} {n:22s} p50 {row['ttft_p50_ms']:7.1f} "
                      f"p99 {row['ttft_p99_ms']:8.1f} warm {row['warm_ttft_p99_ms'] or 0:7.1f} ms | busiest {row['busiest_over_mean']:.2f}x | "
                      f"hit {row['prefix_hit'] if row['prefix_hit'] is not None else '-'}{extra} | "
                      f"ok {row['ok']}/{row['requests']} | {row.get('decisions', '')}"
                      f"{' held ' + str(row['prefill_holds']) if row.get('prefill_holds') else ''}"
                      f"{' gated ' + str(row['cold_gate_waits']) if row.get('cold_gate_waits') else ''}"
                      f"{' alone ' + str(row['alone']) if 'alone' in row else ''}", flush=True)
            out["cells"][cname] = {"cell": cell, "engine": args.engine,
                                   "cache_at": args.cache_at, "dialect": args.dialect,
                                   "runs": runs}
            save()
        summary = {}
        for n, rows in runs.items():
            summary[n] = {k: median([r.get(k) for r in rows]) for k in
                          ("ttft_p50_ms", "ttft_p99_ms", "warm_ttft_p99_ms", "itl_p99_ms", "busiest_over_mean",
                           "prefix_hit", "sticky")}
        peers = [n for n in names if not n.startswith("sluice")]
        if peers:
            # Per seed: each Sluice variant's p99 against the best peer's in that seed.
            for v in [n for n in names if n.startswith("sluice")]:
                ratios = []
                for i in range(len(seeds)):
                    best = min(runs[p][i]["ttft_p99_ms"] for p in peers)
                    ratios.append(round(best / runs[v][i]["ttft_p99_ms"], 3))
                key = "best_peer_p99_over_" + v.replace("-", "_")
                summary[key] = {"per_seed": ratios, "median": median(ratios), "worst": min(ratios)}
            if cell["kind"] == "prefix" and "sluice" in runs:
                warm = []
                for i in range(len(seeds)):
                    best = min(runs[p][i]["warm_ttft_p99_ms"] for p in peers)
                    warm.append(round(best / runs["sluice"][i]["warm_ttft_p99_ms"], 3))
                summary["best_peer_warm_p99_over_sluice"] = {
                    "per_seed": warm, "median": median(warm), "worst": min(warm)}
        out["cells"][cname]["summary"] = summary
        print(f"== {cname}: {json.dumps(summary)}", flush=True)
        save()
    save()


if __name__ == "__main__":
    main()
