#!/usr/bin/env python3
"""Disaggregated serving on a simulated fleet: Sluice against vllm-router's and sglang-router's PD modes.

Four `sluice sim` replicas, restarted for every run (cold caches): two with
`--role prefill` and two with `--role decode`, behind (`--protocol vllm`, the default:
a one-token prefill leg whose `kv_transfer_params` go with the decode request)

  sluice-pd              Sluice, `backends[].role` prefill/decode (plans each request)
  vllm-pd-cache_aware    vllm-router --vllm-pd-disaggregation --policy cache_aware
  vllm-pd-power_of_two   vllm-router --vllm-pd-disaggregation --policy power_of_two
  sluice-mixed           the same four replicas as `mixed` behind Sluice (no disaggregation)

or (`--protocol sglang`: both legs sent at once, paired by a bootstrap room; the prefill
replicas' bootstrap port is their own HTTP port in the simulator)

  sluice-pd              Sluice, `routing.disaggregation.protocol: sglang`
  sglang-pd-cache_aware  sglang-router --pd-disaggregation --policy cache_aware
  sglang-pd-power_of_two sglang-router --pd-disaggregation --policy power_of_two
  sluice-mixed

Workloads (`--workloads`):
  chat        16 shared system prompts of ~1,500 tokens, a short question, 64 tokens out
  retrieval   long prompts (~6,000 tokens, 8 documents reused), 32 tokens out
  codegen     ~600-token prompts over 4 prefixes, 512 tokens out (long decodes)
  agentic     coding-agent sessions (`sluice bench --workload agentic`, 100 sessions)

Engine: steps of 8 ms + 0.1 ms a running sequence, prefill 0.1 ms a token, 64 seats,
2,048 batched tokens, 2,048 KV blocks; KV transfers at 25 GB/s of 128 KiB a token.
Reported per run: TTFT and inter-token p50/p99, the warm TTFT p99 (of the requests
sent after the first 5 s: the cold start over; with Sluice, the PD decisions of the
requests that make it, from its access log), the floor the cold start sets under any
router's p99 on the same arrivals (`cold_floor`), errors, and Sluice's decisions
(`sluice_pd_decisions_total`: remote prefills against local ones, and why; and the
decode replicas' `sluice_routing_decisions_total` by reason), and the machine's TCP
retransmissions over the run (`tcp`: a ~200 ms gap in a loopback stream would be a
retransmission timeout), and the streams with an inter-token gap over 100 ms, how many of
them under a local prefill on their decode replica (`stalls`).

    cargo build --release
    python3 -m venv /tmp/routers && /tmp/routers/bin/pip install vllm-router sglang-router
    python3 benches/e2e/pd.py --routers-venv /tmp/routers --seeds 1,2,3 --json docs/bench/pd_DATE.json
    python3 benches/e2e/pd.py --routers-venv /tmp/routers --protocol sglang --json docs/bench/pd_sglang_DATE.json

`--kill-prefill-after 10` kills one of the two prefill replicas (SIGKILL) 10 s into
every run: the failure drill (no request may be lost or hang; `errors` counts them).
`--prefill-blocks N` gives the prefill replicas N KV blocks (caches that hold the agentic
sessions' histories: what placement buys when the cache is not the limit).
`--agentic-concurrency N` runs N agentic sessions at once instead of 32 (at 32 the
prefill pool is saturated and its queue sets every router's TTFT). On the agentic
sessions each run also reports which turns make the TTFT p99 (`tail_turns`: a
session's first turn, one answering a tool result, any other; through Sluice with its
PD decision) and, through Sluice, how evenly the sessions sat on the prefill replicas
(`prefill_sessions`). `--requests-dir DIR` keeps every request's (every turn's) timing,
joined with Sluice's access log.

Everything listens on 127.0.0.1; every process is stopped at the end of its run.
"""

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from stream_overhead import free_port, wait_http  # noqa: E402
from agentic import ADMINS, Procs, gateway_counts, sim_counts, start_lb  # noqa: E402
# The warm p99: of the requests sent after the first 5 s (at 400 requests a
# run's p99 is its 5th slowest, and on code generation four are each prefix's
# first, prefilled cold whatever the router).
from matrix import WARM_AFTER, start_redis, warm_p99  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.path.join(ROOT, "target", "release", "sluice")
# The gateway's binary (`--gateway-bin`: another build, for A/B runs of a
# routing change; the simulated replicas and the client stay BIN's).
GATEWAY_BIN = BIN
ENGINE = ["--profile", "h100-llama3-8b", "--output-tokens", "4096", "--num-blocks", "2048",
          "--step-base", "8ms", "--step-per-seq", "100us", "--prefill-per-token", "100us",
          "--max-num-seqs", "64", "--max-num-batched-tokens", "2048"]

WORKLOADS = {
    "chat": ["--workload", "shared-prefix", "--prefixes", "16", "--prefix-tokens", "1500",
             "--prompt-tokens", "20", "--max-tokens", "64", "--rate", "20"],
    "retrieval": ["--workload", "shared-prefix", "--prefixes", "8", "--prefix-tokens", "6000",
                  "--prompt-tokens", "50", "--max-tokens", "32", "--rate", "6"],
    "codegen": ["--workload", "shared-prefix", "--prefixes", "4", "--prefix-tokens", "600",
                "--prompt-tokens", "30", "--max-tokens", "512", "--rate", "6"],
    "agentic": ["--workload", "agentic", "--sessions", "100", "--concurrency", "32",
                "--turns", "8", "--prefix-tokens", "3000", "--prompt-tokens", "100",
                "--max-tokens", "48", "--tool-tokens", "3000", "--tool-share", "0.2",
                "--think-time", "1s"],
}


# The first prefill replica's process, for `--kill-prefill-after`.
PREFILL_PROCS = []
# `--prefill-blocks`: the prefill replicas' KV blocks, if not the engine's 2,048.
PREFILL_BLOCKS = None


def start_sims(procs, roles):
    out = []
    PREFILL_PROCS.clear()
    for role in roles:
        port = free_port()
        engine = list(ENGINE)
        if role == "prefill" and PREFILL_BLOCKS:
            engine[engine.index("--num-blocks") + 1] = str(PREFILL_BLOCKS)
        p = procs.start([BIN, "sim", "--listen", f"127.0.0.1:{port}", "--role", role, *engine])
        if role == "prefill":
            PREFILL_PROCS.append(p)
        out.append((f"http://127.0.0.1:{port}", role))
    for u, _ in out:
        wait_http(u + "/health")
    return out


# `--sluice-config`: more top-level config for the Sluice gateways (experiments).
EXTRA = ""
# The Sluice gateway's access log of the run (a file), joined into the
# per-request data: each request's PD decision, prefill replica and time.
ACCESS_LOG = []


def start_sluice(procs, sims, pd, protocol, redis=None):
    api, admin = free_port(), free_port()
    ADMINS.append(f"http://127.0.0.1:{admin}")
    lines = ["backends:"]
    for url, role in sims:
        lines.append(f"  - url: {url}")
        lines.append(f"    role: {role if pd else 'mixed'}")
        if pd and protocol == "sglang" and role == "prefill":
            lines.append(f"    bootstrap_port: {url.rsplit(':', 1)[1]}")
    routing = []
    if pd and protocol == "sglang":
        routing += ["  disaggregation:", "    protocol: sglang"]
    if redis:
        # A routing table shared through Redis: sessions and prefix homes.
        routing += ["  sessions:", "    store: redis", f"    redis: {{url: \"{redis}\"}}"]
    if routing:
        lines += ["routing:", *routing]
    log = tempfile.NamedTemporaryFile(suffix=".jsonl", delete=False).name
    ACCESS_LOG.append(log)
    lines += ["telemetry:", "  access_log:", "    target: file", f"    path: {log}"]
    cfg = tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False)
    cfg.write("\n".join(lines) + "\n" + EXTRA)
    cfg.close()
    procs.start([GATEWAY_BIN, "serve", "--config", cfg.name, "--listen", f"127.0.0.1:{api}",
                 "--admin-listen", f"127.0.0.1:{admin}"], env={**os.environ, "RUST_LOG": "warn"})
    wait_http(f"http://127.0.0.1:{admin}/readyz")
    return f"http://127.0.0.1:{api}"


def start_vllm_pd(procs, venv, policy, sims):
    port = free_port()
    args = [os.path.join(venv, "bin", "vllm-router"), "--host", "127.0.0.1", "--port", str(port),
            "--vllm-pd-disaggregation", "--policy", policy]
    for url, role in sims:
        args += (["--prefill", url] if role == "prefill" else ["--decode", url])
    procs.start(args)
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/v1/models", timeout=60)
    return url


def start_sglang_pd(procs, venv, policy, sims):
    port = free_port()
    args = [os.path.join(venv, "bin", "python"), "-m", "sglang_router.launch_router",
            "--host", "127.0.0.1", "--port", str(port), "--pd-disaggregation", "--policy", policy]
    for url, role in sims:
        args += (["--prefill", url, url.rsplit(":", 1)[1]] if role == "prefill" else ["--decode", url])
    procs.start(args)
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/v1/models", timeout=60)
    return url


def cold_floor(path):
    """The least p99 any router could have had on these arrivals (ms), or None.

    Each prefix's first request is prefilled cold wherever it goes, and so
    is, or waits for that prefill, any request of the same prefix sent before
    the first could be done: its TTFT is at least the first's send time plus
    a cold prefill's TTFT (the fastest such first request of the run) less
    its own send time. The p99 (nearest rank, as `sluice bench` counts it) of
    those bounds is a floor set by the arrivals alone, the same for every
    router given the same seed. Warm requests' bounds are 0.
    """
    with open(path) as f:
        rows = sorted((json.loads(line) for line in f), key=lambda r: r["sent_s"])
    if not rows or any(r.get("prefix") is None for r in rows):
        return None
    first = {}
    for r in rows:
        first.setdefault(r["prefix"], r)
    cold = min((r["ttft_s"] for r in first.values() if r["ttft_s"] is not None), default=None)
    if cold is None:
        return None
    bounds = sorted(max(0.0, first[r["prefix"]]["sent_s"] + cold - r["sent_s"]) for r in rows)
    rank = min(len(bounds), max(1, -(-99 * len(bounds) // 100)))
    return round(bounds[rank - 1] * 1e3, 1)


def stalled_streams(rows, over=0.1):
    """The streams whose longest gap between tokens exceeded `over` seconds,
    longest first, each with the requests prefilled on its decode replica
    (`pd` not `remote`) while the gap ended: from when such a request was
    sent to 50 ms past its first token (the step carrying its last chunk).
    What a local prefill costs the streams decoding beside it
    (`docs/bench/pd_itl_gap_2026-12-03/`)."""
    local = [r for r in rows if r.get("pd") not in (None, "remote") and r.get("ttft_s") is not None]
    out = []
    for r in sorted(rows, key=lambda r: -(r.get("itl_max_s") or 0)):
        if (r.get("itl_max_s") or 0) <= over:
            break
        end = r["itl_max_end_s"]
        out.append((r, [x for x in local if x.get("backend") == r.get("backend") and x["i"] != r["i"]
                        and x["sent_s"] <= end <= x["sent_s"] + x["ttft_s"] + 0.05]))
    return out


def stalls(per_request):
    """How many streams stalled over 100 ms ([`stalled_streams`]), how many of
    them under a local prefill, and how many under another gateway's only."""
    with open(per_request) as f:
        rows = [json.loads(line) for line in f]
    out = {"streams": 0, "under_local_prefill": 0, "by_another_gateway": 0}
    for r, during in stalled_streams(rows):
        out["streams"] += 1
        if during:
            out["under_local_prefill"] += 1
            if "gateway" in r and all(x.get("gateway") != r["gateway"] for x in during):
                out["by_another_gateway"] += 1
    return out


def join_access_log(per_request, logs, warm):
    """Add each request's line of the gateway's access log (by the
    `x-request-id` `sluice bench` sent) to its per-request row: the PD
    decision (`pd`), the decode and prefill replicas, the remote prefill's
    time; with several gateways, which one served it (`gateway`, 0-based).
    Returns the decisions of the warm requests at or above the warm p99
    `warm` (seconds): what the warm p99 is made of."""
    keep = ("pd", "backend", "route_reason", "prefill_backend", "prefill_route_reason",
            "prefill_cached_tokens", "prefill_ms")
    by_id = {}
    for g, path in enumerate(logs):
        with open(path) as f:
            for line in f:
                try:
                    e = json.loads(line)
                except ValueError:
                    continue
                by_id[e.get("request_id")] = {k: e.get(k) for k in keep}
                if len(logs) > 1:
                    by_id[e.get("request_id")]["gateway"] = g
        os.unlink(path)
    with open(per_request) as f:
        rows = [json.loads(line) for line in f]
    for r in rows:
        r.update(by_id.get(r.get("request_id"), {}))
    with open(per_request, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    tail = [r for r in rows if warm is not None and r["sent_s"] > WARM_AFTER
            and r["ttft_s"] is not None and r["ttft_s"] >= warm]
    out = {}
    for r in tail:
        out[r.get("pd") or "-"] = out.get(r.get("pd") or "-", 0) + 1
    return out


def agentic_tail(per_request, p99):
    """What the agentic p99 is made of: the turns at or above it (seconds),
    counted by kind (a session's first turn, a turn answering a tool
    result, any other) and, through Sluice, the PD decision."""
    out = {}
    with open(per_request) as f:
        for line in f:
            r = json.loads(line)
            if r["ttft_s"] is None or r["ttft_s"] < p99:
                continue
            kind = "first" if r.get("turn") == 0 else "tool" if r.get("tool") else "other"
            key = kind + (f"/{r['pd']}" if r.get("pd") else "")
            out[key] = out.get(key, 0) + 1
    return out


def prefill_sessions(per_request):
    """How evenly the agentic sessions sat on the prefill replicas (through
    Sluice: its access log names each turn's prefill replica): every 5 s, the
    sessions under way (between their first and last turn) per prefill
    replica, by the replica most of their turns were prefilled on. Returns
    the largest gap between the busiest and the least busy replica, and the
    busiest's mean share of the sessions under way."""
    spans = {}
    with open(per_request) as f:
        for line in f:
            r = json.loads(line)
            s = spans.setdefault(r.get("session"), {"t": [], "on": {}})
            s["t"].append(r["sent_s"])
            if r.get("prefill_backend"):
                s["on"][r["prefill_backend"]] = s["on"].get(r["prefill_backend"], 0) + 1
    spans = {k: (min(v["t"]), max(v["t"]), max(v["on"], key=v["on"].get))
             for k, v in spans.items() if v["on"]}
    names = sorted({home for _, _, home in spans.values()})
    if len(names) < 2:
        return None
    gap, shares = 0, []
    end = max(b for _, b, _ in spans.values())
    t = 5.0
    while t < end:
        n = [sum(1 for a, b, h in spans.values() if a <= t <= b and h == name) for name in names]
        gap = max(gap, max(n) - min(n))
        if sum(n):
            shares.append(max(n) / sum(n))
        t += 5.0
    return {"most_apart": gap, "busiest_share": round(statistics.mean(shares), 3) if shares else None}


def tcp_counters():
    """The machine's TCP retransmissions and retransmission timeouts so far
    (/proc/net/snmp, /proc/net/netstat): a gap of ~200 ms in a loopback
    stream is Linux's minimum retransmission timeout when a segment was
    dropped. Machine-wide: only meaningful with nothing else on the network."""
    out = {}
    for path in ("/proc/net/snmp", "/proc/net/netstat"):
        try:
            with open(path) as f:
                lines = f.read().splitlines()
        except OSError:
            continue
        for head, vals in zip(lines[::2], lines[1::2]):
            for k, v in zip(head.split()[1:], vals.split()[1:]):
                if k in ("RetransSegs", "TCPTimeouts", "TCPLossProbes", "TCPBacklogDrop", "ListenDrops"):
                    out[k] = int(v)
    return out


def run(name, workload, args, seed):
    procs = Procs()
    ADMINS.clear()
    ACCESS_LOG.clear()
    try:
        sims = start_sims(procs, ["prefill", "prefill", "decode", "decode"])
        if name == "sluice-pd":
            url = start_sluice(procs, sims, True, args.protocol)
        elif name.startswith("sluice-pd-") and "gw" in name:
            # Several gateways behind nginx (round robin), each planning
            # alone: its own legs counted live, the others' only at its
            # scrapes (what several gateways cost); `-shared`: sharing a
            # routing table in Redis (sessions and prefix homes).
            n = int(name[len("sluice-pd-"):].split("gw")[0])
            redis = start_redis(procs) if name.endswith("-shared") else None
            url = start_lb(procs, [start_sluice(procs, sims, True, args.protocol, redis)
                                   for _ in range(n)])
        elif name == "sluice-mixed":
            url = start_sluice(procs, sims, False, args.protocol)
        elif name.startswith("sglang-pd"):
            url = start_sglang_pd(procs, args.routers_venv, name.split("-", 2)[2], sims)
        else:
            url = start_vllm_pd(procs, args.routers_venv, name.split("-", 2)[2], sims)
        time.sleep(2)
        out = tempfile.NamedTemporaryFile(suffix=".json", delete=False).name
        cmd = [BIN, "bench", "--url", url, "--model", "sim-model", "--seed", str(seed),
               "--quiet", "--json", out, *WORKLOADS[workload]]
        if workload != "agentic":
            cmd += ["--concurrency", "512", "--requests", str(args.requests)]
        # Every request's timing, for the warm p99, the cold start's floor
        # and (agentic) which turns make the tail: kept with `--requests-dir`.
        d = args.requests_dir or tempfile.mkdtemp()
        os.makedirs(d, exist_ok=True)
        per_request = os.path.join(d, f"{workload}_{name}_seed{seed}.jsonl")
        cmd += ["--requests-json", per_request]
        tcp_before = tcp_counters()
        bench = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
        killed_at = None
        if args.kill_prefill_after is not None:
            # A prefill replica dies mid-run (SIGKILL: no goodbye, its
            # connections reset, its KV gone): every request must still be
            # answered, by the other prefill replica or a local prefill.
            try:
                bench.wait(timeout=args.kill_prefill_after)
            except subprocess.TimeoutExpired:
                PREFILL_PROCS[0].kill()
                killed_at = args.kill_prefill_after
        if bench.wait(timeout=1800) != 0:
            raise RuntimeError(f"sluice bench failed ({bench.returncode})")
        with open(out) as f:
            r = json.load(f)
        row = {
            "seed": seed, "ok": r["ok"], "requests": r["requests"], "errors": r["errors"],
            "ttft_p50_ms": round(r["ttft_seconds"]["p50"] * 1e3, 1),
            "ttft_p99_ms": round(r["ttft_seconds"]["p99"] * 1e3, 1),
            "itl_p50_ms": round(r["inter_token_seconds"]["p50"] * 1e3, 2),
            "itl_p99_ms": round(r["inter_token_seconds"]["p99"] * 1e3, 2),
            "itl_max_ms": round(r["inter_token_seconds"]["max"] * 1e3, 1),
            "tcp": {k: v - tcp_before.get(k, 0) for k, v in tcp_counters().items()},
        }
        if workload == "agentic":
            warm = None
        else:
            warm = warm_p99(per_request)
            row["warm_ttft_p99_ms"] = round(warm * 1e3, 1) if warm is not None else None
            row["cold_floor_p99_ms"] = cold_floor(per_request)
        if killed_at is not None:
            row["prefill_killed_at_s"] = killed_at
        # Each decode replica's share of the tokens generated (the balance
        # of the decode pool: its busiest replica sets the inter-token p99).
        decode = [u for u, role in sims if role == "decode"]
        try:
            gen = sim_counts(decode, "vllm:generation_tokens_total")
            row["decode_generation_share"] = [round(g / max(sum(gen), 1.0), 3) for g in gen]
        except OSError:
            pass
        if ADMINS:
            row["decisions"] = {k.split('reason="')[1].rstrip('"}'): v for k, v in gateway_counts(
                ADMINS, ["sluice_pd_decisions_total"]).items() if v}
            # Looks at a decode engine before a local prefill, by outcome
            # (builds from 2026-12-03 evening on).
            row["looks"] = {k.split('outcome="')[1].rstrip('"}'): v for k, v in gateway_counts(
                ADMINS, ["sluice_pd_decode_looks_total"]).items() if v}
            # The decode replicas' routing decisions, by reason.
            routes = {}
            for k, v in gateway_counts(ADMINS, ["sluice_routing_decisions_total"]).items():
                reason = k.split('reason="')[1].split('"')[0]
                routes[reason] = routes.get(reason, 0.0) + v
            row["routes"] = {k: v for k, v in routes.items() if v}
        if ACCESS_LOG:
            procs.stop()  # the access log is whole once the gateway is gone
            tail = join_access_log(per_request, ACCESS_LOG, warm)
            if workload != "agentic":
                row["warm_tail_pd"] = tail
        if ACCESS_LOG:
            row["stalls"] = stalls(per_request)
        if workload == "agentic":
            row["tail_turns"] = agentic_tail(per_request, r["ttft_seconds"]["p99"])
            if ACCESS_LOG:
                row["prefill_sessions"] = prefill_sessions(per_request)
        if not args.requests_dir:
            os.unlink(per_request)
        return row
    finally:
        procs.stop()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--routers-venv")
    ap.add_argument("--workloads", nargs="*", default=list(WORKLOADS), choices=list(WORKLOADS))
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--requests", type=int, default=1200)
    ap.add_argument("--only", nargs="*")
    ap.add_argument("--protocol", choices=["vllm", "sglang"], default="vllm",
                    help="the engines' disaggregation protocol (and so the peers)")
    ap.add_argument("--kill-prefill-after", type=float,
                    help="kill one prefill replica this many seconds into each run (failure drill)")
    ap.add_argument("--sluice-config", help="extra config for the Sluice gateways (experiments)")
    ap.add_argument("--prefill-blocks", type=int,
                    help="KV blocks of the prefill replicas (default: the engine's 2,048)")
    ap.add_argument("--requests-dir", help="keep every request's timing here (JSON lines)")
    ap.add_argument("--agentic-concurrency", type=int,
                    help="sessions at once in the agentic workload (default 32: the prefill pool "
                         "saturated)")
    ap.add_argument("--gateway-bin",
                    help="run the Sluice gateways from this build (A/B runs of a routing change; "
                         "the replicas and the client stay target/release/sluice)")
    ap.add_argument("--gateways", type=int, default=1,
                    help="also run `sluice-pd-Ngw`: the disaggregated fleet through N Sluice "
                         "gateways behind nginx (round robin), and `sluice-pd-Ngw-shared`: the "
                         "same gateways sharing a routing table in Redis")
    ap.add_argument("--cache-at", choices=["compute", "schedule"], default="compute",
                    help="when a prompt block becomes a prefix hit on the simulated replicas: "
                    "once computed (SGLang's radix tree, the default) or once scheduled "
                    "(vLLM V1, which shares a prompt still being prefilled)")
    ap.add_argument("--json")
    args = ap.parse_args()
    global EXTRA, PREFILL_BLOCKS, GATEWAY_BIN
    if args.cache_at != "compute":  # (older builds lack the flag)
        ENGINE.extend(["--cache-at", args.cache_at])
    if args.gateway_bin:
        GATEWAY_BIN = os.path.abspath(args.gateway_bin)
    if args.agentic_concurrency:
        a = WORKLOADS["agentic"]
        a[a.index("--concurrency") + 1] = str(args.agentic_concurrency)
    if args.sluice_config:
        with open(args.sluice_config) as f:
            EXTRA = f.read()
    PREFILL_BLOCKS = args.prefill_blocks
    names = ["sluice-pd", "sluice-mixed"]
    if args.gateways > 1:
        names[1:1] = [f"sluice-pd-{args.gateways}gw", f"sluice-pd-{args.gateways}gw-shared"]
    if args.routers_venv:
        names[1:1] = [f"{args.protocol}-pd-cache_aware", f"{args.protocol}-pd-power_of_two"]
    names = [n for n in names if not args.only or n in args.only]
    out = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
           "machine": f"{platform.machine()} {os.cpu_count()} CPUs, {platform.platform()}",
           "commit": subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"],
                                    capture_output=True, text=True).stdout.strip(),
           "engine": ENGINE, "args": vars(args), "workloads": {}}
    for w in args.workloads:
        runs = {n: [] for n in names}
        for seed in [int(s) for s in args.seeds.split(",")]:
            for n in names:
                row = run(n, w, args, seed)
                runs[n].append(row)
                print(f"{w:10s} seed {seed} {n:22s} TTFT p50 {row['ttft_p50_ms']:8.1f} p99 {row['ttft_p99_ms']:8.1f}"
                      f" warm {row.get('warm_ttft_p99_ms') or 0:7.1f} floor {row.get('cold_floor_p99_ms') or 0:6.1f} ms"
                      f" | ITL p99 {row['itl_p99_ms']:6.2f} max {row['itl_max_ms']:6.1f} ms | tcp {row['tcp']} | ok {row['ok']}/{row['requests']} {row['errors']}"
                      f" | {row.get('decisions', '')} {row.get('routes', '')}"
                      f"{' | warm tail ' + str(row['warm_tail_pd']) if row.get('warm_tail_pd') else ''}"
                      f"{' | tail ' + str(row['tail_turns']) if row.get('tail_turns') else ''}"
                      f"{' | stalls ' + str(row['stalls']) if row.get('stalls', {}).get('streams') else ''}"
                      f"{' | looks ' + str(row['looks']) if row.get('looks') else ''}"
                      f"{' | prefill sessions ' + str(row['prefill_sessions']) if row.get('prefill_sessions') else ''}", flush=True)
        summary = {n: {k: statistics.median([r[k] for r in rows]) for k in
                       ("ttft_p50_ms", "ttft_p99_ms", "warm_ttft_p99_ms", "itl_p99_ms", "itl_max_ms")
                       if all(r.get(k) is not None for r in rows)}
                   for n, rows in runs.items()}
        out["workloads"][w] = {"runs": runs, "summary": summary}
        print(f"== {w}: {json.dumps(summary)}", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
