#!/usr/bin/env python3
"""Flow control on a simulated fleet at 1.5x its capacity, with and without it.

Two `sluice sim` replicas (engine model `a100-llama3-8b`, `--max-num-seqs 48`,
so that seats, not KV, bound them) behind Sluice with two tiers: `premium`
(priority 10) and `free` (priority 0, `max_wait` 5s). Each `sluice bench` is
one tenant (its own key), Poisson arrivals, streamed chat, 128-token prompts,
64 output tokens. Runs, each on fresh replicas and a fresh gateway:

  capacity        closed loop, 2 x 16 streams: the fleet's requests/s (C)
  unloaded        premium alone at --premium-rate: its TTFT baseline
  flood           premium + one free tenant at 1.5 C - premium, flow control on
  flood-off       the same with flow_control.enabled: false
  fair            two free tenants (same band), one sending 10x the other,
                  1.5 C in all, flow control on
  fair-off        the same, off
  fair-2gw        the same through two gateways (each tenant's traffic split
                  evenly between them: a round-robin balancer)

Reported: premium TTFT p99 against unloaded; Jain's fairness index of the two
tenants' served rate over their max-min fair share; the light tenant's
share of its demand served; goodput (output tokens/s of successful requests)
against the same run without flow control; answers past the wait bound; the
gateways' routing decisions by reason (`route REASON`).

    cargo build --release
    python3 benches/e2e/flow.py --json docs/bench/flow.json
    python3 benches/e2e/flow.py --fleet kv-full --engine-priority --only unloaded,flood,flood_off

`--requests-dir DIR`: every request's timing kept (a file per run and tenant), and
premium's p99 over the requests sent after the first 5 s printed: what the run's
first seconds add (with seats learned, the engines queue until a scrape sees it).

`--engine-priority`: engines that schedule by the request's priority (vLLM's
`--scheduling-policy priority`; `sluice sim` models it), which the gateway sends
(`backends[].engine_priority: vllm`): premium is admitted first inside the engine too.

Everything listens on 127.0.0.1; every process is stopped at the end.
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
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from stream_overhead import free_port, wait_http  # noqa: E402
from agentic import Procs  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.path.join(ROOT, "target", "release", "sluice")
KEYS = {"vip": ("premium", "sk-bench-vip"), "heavy": ("free", "sk-bench-heavy"),
        "light": ("free", "sk-bench-light"), "crowd": ("free", "sk-bench-crowd")}
REPLICAS = 2

# The fleets (`--fleet`): the engine's arguments, its seats, and the requests'
# shape (prompt and output tokens).
FLEETS = {
    # Seats bind, KV is ample: A100 Llama-3.1-8B, 48 seats a replica.
    "seats": dict(engine=["--profile", "a100-llama3-8b", "--max-num-seqs", "48"], seats=48,
                  prompt=128, output=64, workload="random"),
    # Long contexts on a small cache: 64 seats whose KV cache is ~90% full when
    # all are busy (1,000-token prompts, 16 tokens out: 64 blocks a sequence,
    # 4,550 blocks), engine steps of ~330 ms at full batch.
    "kv-full": dict(engine=["--profile", "h100-llama3-8b", "--max-num-seqs", "64",
                            "--num-blocks", "4550", "--step-base", "250ms",
                            "--step-per-seq", "1ms", "--prefill-per-token", "50us"],
                    seats=64, prompt=1000, output=16, workload="fixed",
                    # As the issue found it: seats learned, not configured.
                    learned=True),
}
FLEET = FLEETS["seats"]
SEATS = FLEET["seats"]
SEED = 1


# `--requests-dir`: every request's timing, a file per run and tenant
# (`NAME_TENANT_seedN.jsonl`), and premium's p99 after the first WARM_AFTER
# seconds printed: what the run's first seconds (seats not yet learned) add.
REQUESTS_DIR = None
CURRENT = ""
WARM_AFTER = 5.0

# `--engine-priority`: the engines schedule by the request's priority (vLLM's
# `--scheduling-policy priority`) and the gateway sends it (`engine_priority: vllm`).
ENGINE_PRIORITY = False


def start_sims(procs):
    urls = []
    for _ in range(REPLICAS):
        port = free_port()
        extra = ["--scheduling-policy", "priority"] if ENGINE_PRIORITY else []
        procs.start([BIN, "sim", "--listen", f"127.0.0.1:{port}", *FLEET["engine"],
                     "--output-tokens", "4096", *extra])
        urls.append(f"http://127.0.0.1:{port}")
    for u in urls:
        wait_http(u + "/health")
    return urls


def start_redis(procs):
    port = free_port()
    procs.start(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                 "--appendonly", "no"])
    import socket
    import time
    for _ in range(100):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return f"redis://127.0.0.1:{port}"
        except OSError:
            time.sleep(0.05)
    raise SystemExit("redis-server did not start")


def config(sims, flow, tmp, learned, redis=None):
    keys = "\n".join(
        f"    - {{name: {name}, tier: {tier}, sha256: \"{hashlib.sha256(key.encode()).hexdigest()}\"}}"
        for name, (tier, key) in KEYS.items())
    seats = "" if learned or FLEET.get("learned") else f"\n    max_concurrency: {SEATS}"
    if ENGINE_PRIORITY:
        seats += "\n    engine_priority: vllm"
    backends = "\n".join(f"  - url: {s}{seats}" for s in sims)
    text = f"""
backends:
{backends}
auth:
  keys:
{keys}
tiers:
  premium: {{priority: 10}}
  free: {{priority: 0, max_wait: 5s}}
flow_control:
  enabled: {"true" if flow else "false"}
"""
    if redis:
        text += f"""rate_limits:
  store: redis
  redis:
    url: {redis}
"""
    path = os.path.join(tmp, f"sluice-{free_port()}.yaml")
    with open(path, "w") as f:
        f.write(text)
    return path


def start_gateway(procs, cfg):
    api, admin = free_port(), free_port()
    procs.start([BIN, "serve", "--config", cfg, "--listen", f"127.0.0.1:{api}",
                 "--admin-listen", f"127.0.0.1:{admin}"], env={**os.environ, "RUST_LOG": "warn"})
    wait_http(f"http://127.0.0.1:{admin}/readyz")
    return f"http://127.0.0.1:{api}", f"http://127.0.0.1:{admin}"


def flow_metrics(admins):
    """The gateways' flow-control counters: outcomes per band, and per band
    the requests that waited more than 10 ms; routing's decisions by reason."""
    out = {}
    for a in admins:
        with urllib.request.urlopen(a + "/metrics", timeout=10) as r:
            text = r.read().decode()
        for line in text.splitlines():
            if line.startswith("sluice_flow_requests_total{"):
                labels, v = line.rsplit(" ", 1)
                band = labels.split('band="')[1].split('"')[0]
                outcome = labels.split('outcome="')[1].split('"')[0]
                key = f"band {band} {outcome}"
                out[key] = out.get(key, 0) + int(float(v))
            elif line.startswith("sluice_flow_share_syncs_total{"):
                labels, v = line.rsplit(" ", 1)
                key = "share syncs " + labels.split('outcome="')[1].split('"')[0]
                out[key] = out.get(key, 0) + int(float(v))
            elif line.startswith("sluice_routing_decisions_total{"):
                labels, v = line.rsplit(" ", 1)
                key = "route " + labels.split('reason="')[1].split('"')[0]
                out[key] = out.get(key, 0) + int(float(v))
            elif line.startswith("sluice_flow_wait_seconds_bucket{") and 'le="0.01"' in line:
                labels, v = line.rsplit(" ", 1)
                band = labels.split('band="')[1].split('"')[0]
                key = f"band {band} waited_under_10ms"
                out[key] = out.get(key, 0) + int(float(v))
    return out


def bench(url, who, tmp, seconds, rate=None, concurrency=2000, seed=1, tag=None):
    out = os.path.join(tmp, f"bench-{who}-{free_port()}.json")
    args = [BIN, "bench", "--url", url, "--api-key", KEYS[who][1], "--duration", f"{seconds}s",
            "--prompt-tokens", str(FLEET["prompt"]), "--max-tokens", str(FLEET["output"]),
            "--workload", FLEET["workload"], "--concurrency", str(concurrency),
            "--seed", str(seed + 1000 * (SEED - 1)), "--quiet", "--json", out]
    if rate:
        args += ["--rate", f"{rate:.3f}"]
    if REQUESTS_DIR and CURRENT:
        # (`tag`: the tenant, and the gateway where it sends through several.)
        args += ["--requests-json", os.path.join(REQUESTS_DIR, f"{CURRENT}_{tag or who}_seed{SEED}.jsonl")]
    return subprocess.Popen(args, stdout=subprocess.DEVNULL), out


def collect(runs):
    res = {}
    for who, (p, out) in runs.items():
        p.wait(timeout=600)
        with open(out) as f:
            r = json.load(f)
        res[who] = r
    return res


def summary(r):
    return {
        "requests": r["requests"], "ok": r["ok"], "errors": r["errors"],
        "ttft_p50_ms": round(r["ttft_seconds"]["p50"] * 1e3, 1),
        "ttft_p99_ms": round(r["ttft_seconds"]["p99"] * 1e3, 1),
        "e2e_max_s": round(r["e2e_seconds"]["max"], 2),
        "output_tokens": r["output_tokens"], "duration_s": round(r["duration_seconds"], 1),
    }


def warm(path):
    """Premium's TTFT p99 (nearest rank) over the requests sent after
    WARM_AFTER s, and when the slowest 1% of the whole run were sent."""
    with open(path) as f:
        rows = [json.loads(line) for line in f]
    ok = [r for r in rows if r.get("ttft_s") is not None]
    def p99(xs):
        xs = sorted(xs)
        return xs[min(len(xs), max(1, -(-99 * len(xs) // 100))) - 1] if xs else None
    after = [r["ttft_s"] for r in ok if r["sent_s"] > WARM_AFTER]
    worst = sorted(ok, key=lambda r: -r["ttft_s"])[:max(1, len(ok) // 100)]
    return {"ttft_p99_ms": round(p99(after) * 1e3, 1) if after else None,
            "requests": len(after),
            "slowest_1pct_sent_s": [round(r["sent_s"], 2) for r in worst]}


def jain(xs):
    return sum(xs) ** 2 / (len(xs) * sum(x * x for x in xs)) if xs else 0.0


def scenario(name, seconds, tmp, flow=True, gateways=1, tenants=(), learned=False,
             pinned=(), redis=False):
    """Run tenants [(who, rate)] against fresh replicas; return per-tenant reports.
    A tenant in `pinned` sends through the first gateway only; `redis`: the
    gateways share a Redis store (and so fairness)."""
    global CURRENT
    CURRENT = name
    procs = Procs()
    try:
        sims = start_sims(procs)
        cfg = config(sims, flow, tmp, learned, start_redis(procs) if redis else None)
        gws = [start_gateway(procs, cfg) for _ in range(gateways)]
        admins = [a for _, a in gws]
        gws = [u for u, _ in gws]
        runs = {}
        for i, (who, rate, *closed) in enumerate(tenants):
            through = gws[:1] if who in pinned else gws
            for g, url in enumerate(through):
                key = who if gateways == 1 else f"{who}@{g}"
                conc = closed[0] // len(through) if closed else 2000
                runs[key] = bench(url, who, tmp, seconds, rate / len(through) if rate else None,
                                  concurrency=conc, seed=1 + i * 7 + g, tag=key.replace("@", "_gw"))
        res = collect(runs)
        gauges = flow_metrics(admins)
    finally:
        procs.stop()
    if gateways > 1:
        merged = {}
        for who, *_ in tenants:
            parts = [res[f"{who}@{g}"] for g in range(gateways) if f"{who}@{g}" in res]
            m = dict(parts[0])
            for k in ("requests", "ok", "output_tokens"):
                m[k] = sum(p[k] for p in parts)
            m["errors"] = {}
            for p in parts:
                for e, n in p["errors"].items():
                    m["errors"][e] = m["errors"].get(e, 0) + n
            m["duration_seconds"] = max(p["duration_seconds"] for p in parts)
            m["ttft_seconds"] = max((p["ttft_seconds"] for p in parts), key=lambda t: t["p99"])
            m["e2e_seconds"] = max((p["e2e_seconds"] for p in parts), key=lambda t: t["max"])
            merged[who] = m
        res = merged
    print(f"{name}: " + "; ".join(f"{w} {summary(r)}" for w, r in res.items()), flush=True)
    print(f"  gateway: {gauges}", flush=True)
    if REQUESTS_DIR and "vip" in res and gateways == 1:
        res["_vip_after_warmup"] = warm(os.path.join(REQUESTS_DIR, f"{name}_vip_seed{SEED}.jsonl"))
        print(f"  premium after the first {WARM_AFTER:.0f} s: {res['_vip_after_warmup']}", flush=True)
    res["_gateway"] = gauges
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=int, default=40)
    ap.add_argument("--premium-rate", type=float,
                    help="requests/s (default: 4 on the seats fleet, 0.4 C on kv-full)")
    ap.add_argument("--capacity", type=float, help="skip measuring it (requests/s)")
    ap.add_argument("--only", help="comma-separated runs (exploration; the verdict needs all)")
    ap.add_argument("--floor", type=lambda v: [int(x) for x in v.split(",")], default=[],
                    help="batch sizes per replica for the floor sweep, e.g. 46,32,16,8")
    ap.add_argument("--fleet", choices=list(FLEETS), default="seats")
    ap.add_argument("--seed", type=int, default=1, help="varies every tenant's arrivals")
    ap.add_argument("--engine-priority", action="store_true",
                    help="engines that schedule by priority (vLLM --scheduling-policy priority), "
                         "sent by the gateway (engine_priority: vllm)")
    ap.add_argument("--requests-dir", help="every request's timing, a file per run and tenant")
    ap.add_argument("--bin", help="the sluice binary (default target/release/sluice; "
                    "a copy lets a run outlive a rebuild, or compare two builds)")
    ap.add_argument("--json")
    args = ap.parse_args()
    global FLEET, SEATS, SEED, ENGINE_PRIORITY, REQUESTS_DIR, BIN
    if args.bin:
        BIN = os.path.abspath(args.bin)
    FLEET, SEED, ENGINE_PRIORITY = FLEETS[args.fleet], args.seed, args.engine_priority
    REQUESTS_DIR = args.requests_dir
    if REQUESTS_DIR:
        os.makedirs(REQUESTS_DIR, exist_ok=True)
    SEATS = FLEET["seats"]
    if not os.path.exists(BIN):
        raise SystemExit("build first: cargo build --release")
    tmp = tempfile.mkdtemp()
    T = args.seconds

    # Capacity: closed loop, every seat busy.
    if args.capacity:
        C = args.capacity
    else:
        procs = Procs()
        try:
            sims = start_sims(procs)
            gw, _ = start_gateway(procs, config(sims, False, tmp, False))
            run = {"crowd": bench(gw, "crowd", tmp, 20, concurrency=SEATS * REPLICAS)}
            cap = collect(run)["crowd"]
        finally:
            procs.stop()
        C = cap["ok"] / cap["duration_seconds"]
        print(f"capacity: {C:.1f} req/s ({summary(cap)})", flush=True)
    p = args.premium_rate or (4.0 if args.fleet == "seats" else round(0.4 * C, 2))
    flood = 1.5 * C - p

    light, heavy = 1.5 * C / 11, 1.5 * C * 10 / 11
    fair = [("light", light), ("heavy", heavy)]
    skew = [("light", 0.75 * C), ("heavy", 0.75 * C)]
    plan = {
        "unloaded": dict(tenants=[("vip", p)]),
        "flood": dict(tenants=[("vip", p), ("crowd", flood)]),
        "flood_off": dict(flow=False, tenants=[("vip", p), ("crowd", flood)]),
        "flood_learned": dict(learned=True, tenants=[("vip", p), ("crowd", flood)]),
        "fair": dict(tenants=fair),
        "fair_off": dict(flow=False, tenants=fair),
        "fair_2gw": dict(gateways=2, tenants=fair),
        # The same through Redis: service and seats shared (each gateway's
        # part of the seats while the tenants want more than there are).
        "fair_2gw_redis": dict(gateways=2, tenants=fair, redis=True),
        # Two equal tenants, each demanding 0.75 C; "heavy" sends through both
        # gateways, "light" through the first only. Alone, each gateway sees
        # heavy as one tenant among two (the first) or alone (the second).
        "skew_2gw": dict(gateways=2, tenants=skew, pinned=("light",)),
        "skew_2gw_redis": dict(gateways=2, tenants=skew, pinned=("light",), redis=True),
    }
    # The floor under any admission policy: the free tier as a closed loop
    # of `b` streams per replica (never waiting at the gateway: two seats per
    # replica stay free for premium), premium at its rate. What is left of
    # premium's TTFT is the engine's own: the step in progress and its own
    # step, both longer with more sequences in the batch. Goodput falls with
    # the batch; the sweep shows what a premium TTFT bound costs.
    for b in args.floor:
        plan[f"floor_{b}"] = dict(tenants=[("vip", p), ("crowd", None, b * REPLICAS)])
    rows = {"capacity_rps": round(C, 2), "premium_rate": p, "flood_rate": round(flood, 2)}
    only = args.only.split(",") if args.only else list(plan)
    if args.only:
        only += [k for k in plan if k.startswith("floor_") and k not in only]
    def fairness(res):
        # Each tenant's served rate (answers over the time to its last one)
        # against its max-min fair share of what the fleet served in all.
        res = {w: r for w, r in res.items() if not w.startswith("_")}
        served = {w: r["ok"] / r["duration_seconds"] for w, r in res.items()}
        demand = {w: r["requests"] / T for w, r in res.items()}
        total = sum(r["ok"] for r in res.values()) / max(r["duration_seconds"] for r in res.values())
        lf = min(demand["light"], total / 2)
        fair_share = {"light": lf, "heavy": total - lf}
        xs = [served[w] / fair_share[w] for w in ("light", "heavy")]
        light_r = res["light"]
        return {"jain": round(jain(xs), 3),
                "light_served_share": round(light_r["ok"] / light_r["requests"], 3),
                "light_ttft_p99_s": round(light_r["ttft_seconds"]["p99"], 3)}

    for name in only:
        rows[name] = scenario(name, T, tmp, **plan[name])
        if "light" in rows[name] and "heavy" in rows[name]:
            print(f"  fairness: {fairness(rows[name])}", flush=True)
    def goodput(res):
        res = {w: r for w, r in res.items() if not w.startswith("_")}
        return sum(r["output_tokens"] for r in res.values()) / max(
            r["duration_seconds"] for r in res.values())

    # What the runs made allow (`--only` runs a part).
    verdict = {}
    if "unloaded" in rows:
        base = rows["unloaded"]["vip"]["ttft_seconds"]["p99"]
        verdict["premium_ttft_p99_vs_unloaded"] = {
            k: round(rows[k]["vip"]["ttft_seconds"]["p99"] / base, 2)
            for k in ("flood", "flood_off", "flood_learned") if k in rows}
        verdict["premium_ttft_p99_vs_unloaded"].update({
            k: round(rows[k]["vip"]["ttft_seconds"]["p99"] / base, 2)
            for k in rows if k.startswith("floor_")})
    verdict["goodput_vs_off"] = {
        k: round(goodput(rows[k]) / goodput(rows[f"{k}_off"]), 3)
        for k in ("flood", "fair") if k in rows and f"{k}_off" in rows}
    verdict["fairness_jain_light_served"] = {
        k: fairness(v) for k, v in rows.items()
        if isinstance(v, dict) and "light" in v and "heavy" in v}
    verdict["longest_answer_s"] = {
        k: max(r["e2e_seconds"]["max"] for w, r in rows[k].items() if not w.startswith("_"))
        for k in ("flood", "fair", "fair_2gw", "fair_2gw_redis", "flood_learned") if k in rows}
    print(json.dumps(verdict, indent=2))
    if args.json:
        write(args.json, verdict, rows)


def write(path, verdict, rows):
    out = {
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.node()} {os.cpu_count()} cpus {platform.machine()}",
        "command": "python3 benches/e2e/flow.py " + " ".join(sys.argv[1:]),
        "verdict": verdict,
        "runs": {k: ({w: (r if w.startswith("_") else summary(r)) for w, r in v.items()}
                     if isinstance(v, dict) else v)
                 for k, v in rows.items()},
    }
    with open(path, "w") as f:
        json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
