#!/usr/bin/env python3
"""Streaming overhead: direct to the simulator vs through Sluice vs through nginx.

Runs, in one go, for each scenario: `sluice bench` straight at a `sluice sim`
replica, then through the Sluice gateway and through nginx (proxy_buffering
off) as the pass-through floor, `--rounds` times each (alternating which goes
first; the tables show medians, the JSON every round). Scenarios: one idle
stream, paced streams, a replica bursting tokens (several events per read),
one write per token, and non-streamed requests (`sluice bench --no-stream`). Reports the client-side TTFT and inter-token
percentiles of each path, the latency each proxy adds over the direct path, and
the CPU-seconds each proxy process used per 1,000 streamed requests (from
/proc/PID/stat, so only the proxy's own CPU counts).

    cargo build --release
    python3 benches/e2e/stream_overhead.py            # prints a Markdown table
    python3 benches/e2e/stream_overhead.py --json out.json
    python3 benches/e2e/stream_overhead.py --pin      # proxy alone on its own core
    python3 benches/e2e/stream_overhead.py --pin --rounds 3 --only non-streamed
    python3 benches/e2e/stream_overhead.py --tls      # both proxies terminate TLS

With `--tls`, Sluice (`server.tls`) and nginx (`listen ... ssl`) serve HTTPS with
the same ECDSA P-256 certificate from a CA made for the run (openssl), TLS 1.3
only, and `sluice bench` connects over TLS trusting that CA (`--ca-file`); the
replica stays plain HTTP, the direct path too.

Needs nginx on PATH (Debian: apt-get install nginx-light). Everything listens on
127.0.0.1 only and every process is stopped at the end.
"""

import argparse
import datetime
import json
import os
import platform
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.path.join(ROOT, "target", "release", "sluice")
CLK_TCK = os.sysconf("SC_CLK_TCK")

SCENARIOS = [
    # name, concurrency, tokens, token delay, requests, streamed
    ("1 stream x 16 tokens @ 20 ms/token (no load)", 1, 16, "20ms", 100, True),
    ("128 streams x 64 tokens @ 20 ms/token", 128, 64, "20ms", 1536, True),
    # The replica writes bursts of 16 tokens: several events per upstream read.
    ("64 streams x 128 tokens @ no delay", 64, 128, "0ms", 3072, True),
    # Every token in a write of its own.
    ("64 streams x 128 tokens @ 1 ms/token (one write per token)", 64, 128, "1ms", 1536, True),
    # Whole answers: requests per second with the proxy on one core (--pin).
    ("non-streamed, 64 concurrent, 32 tokens", 64, 32, "0ms", 32768, False),
]

NGINX_CONF = """
worker_processes {workers};
daemon off;
pid {dir}/nginx.pid;
error_log {dir}/error.log warn;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    client_body_temp_path {dir}/body;
    proxy_temp_path {dir}/proxy;
    fastcgi_temp_path {dir}/fastcgi;
    uwsgi_temp_path {dir}/uwsgi;
    scgi_temp_path {dir}/scgi;
    upstream sim {{
        server 127.0.0.1:{sim_port};
        keepalive 512;
    }}
    server {{
        listen 127.0.0.1:{port}{ssl};
        {tls}
        location / {{
            proxy_pass http://sim;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_cache off;
            proxy_read_timeout 300s;
        }}
    }}
}}
"""


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop(procs):
    """Stops every process still running (SIGTERM, then SIGKILL after 15 s)."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=15)
        except subprocess.TimeoutExpired:
            p.kill()


def run_meta(**extra):
    """When, where and at which commit a run was made, with `extra`."""
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine(),
        "git": subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True).stdout.strip(),
        **extra,
    }


def cpu_seconds(pids):
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime + stime
        except FileNotFoundError:
            pass
    return total / CLK_TCK


def children(pid):
    try:
        out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
        return [int(p) for p in out.split()]
    except FileNotFoundError:
        return []


def wait_http(url, timeout=20):
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            ctx = ssl.create_default_context(cafile=CA_FILE) if url.startswith("https") else None
            with urllib.request.urlopen(url, timeout=1, context=ctx) as r:
                if r.status == 200:
                    return
        except Exception:
            time.sleep(0.05)
    raise SystemExit(f"{url} did not come up")


def overhead_buckets(admin_url):
    """Sluice's own `sluice_gateway_overhead_seconds` histogram: {le: cumulative count}."""
    with urllib.request.urlopen(f"{admin_url}/metrics", timeout=5) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("sluice_gateway_overhead_seconds_bucket{"):
            le = line.split('le="', 1)[1].split('"', 1)[0]
            out[float(le)] = out.get(float(le), 0) + float(line.rsplit(" ", 1)[1])
    return out


def bucket_quantile(before, after, q):
    """The upper bound of the bucket holding quantile q of the observations between two scrapes."""
    delta = sorted((le, after.get(le, 0) - before.get(le, 0)) for le in after)
    total = delta[-1][1] if delta else 0
    for le, n in delta:
        if total and n >= q * total:
            return le
    return None


def on_cpu(cpu):
    """A preexec_fn pinning the child to one CPU (None: leave it to the scheduler)."""
    if cpu is None:
        return None
    return lambda: os.sched_setaffinity(0, {cpu})


# With --tls: the CA `sluice bench` trusts.
CA_FILE = None


def make_certificates(tmp):
    """A CA and a server certificate for localhost and 127.0.0.1 (ECDSA P-256),
    with openssl: (ca, cert, key)."""
    ca, ca_key = os.path.join(tmp, "ca.pem"), os.path.join(tmp, "ca.key")
    cert, key, csr = (os.path.join(tmp, n) for n in ("server.pem", "server.key", "server.csr"))
    ext = os.path.join(tmp, "san.ext")
    with open(ext, "w") as f:
        f.write("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    quiet = dict(check=True, capture_output=True)
    subprocess.run(["openssl", "req", "-x509", *ec, "-keyout", ca_key, "-out", ca, "-days", "2",
                    "-subj", "/CN=bench CA"], **quiet)
    subprocess.run(["openssl", "req", *ec, "-keyout", key, "-out", csr, "-subj", "/CN=localhost"], **quiet)
    subprocess.run(["openssl", "x509", "-req", "-in", csr, "-CA", ca, "-CAkey", ca_key, "-CAcreateserial",
                    "-out", cert, "-days", "2", "-extfile", ext], **quiet)
    return ca, cert, key


def bench(url, concurrency, tokens, requests, cpu=None, streamed=True):
    tls = ["--ca-file", CA_FILE] if CA_FILE and url.startswith("https") else []
    out = subprocess.run(
        [BIN, "bench", "--url", url, "--model", "sim-model", "--concurrency", str(concurrency),
         "--requests", str(requests), "--max-tokens", str(tokens), "--workload", "fixed", "--prompt-tokens", "50",
         "--json", "-", "--quiet"] + tls + ([] if streamed else ["--no-stream"]),
        capture_output=True, text=True, check=True, preexec_fn=on_cpu(cpu),
    ).stdout
    return json.loads(out)


def median(xs):
    xs = sorted(xs)
    n = len(xs)
    return xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="also write the raw results here")
    ap.add_argument("--scale", type=float, default=1.0, help="multiply request counts (e.g. 0.1 for a smoke run)")
    ap.add_argument("--rounds", type=int, default=2,
                    help="measure each proxy this many times per scenario, alternating which goes first; "
                         "the tables show medians, the JSON every round")
    ap.add_argument("--only", help="run only the scenarios whose name contains this")
    ap.add_argument("--pin", action="store_true",
                    help="client and replica on CPU 0, each proxy alone on CPU 1 (one nginx worker, one "
                         "Sluice worker thread): the added latency is the proxy's own, not contention "
                         "with the load generator")
    ap.add_argument("--tls", action="store_true",
                    help="both proxies terminate TLS (the same certificate, TLS 1.3); the replica stays plain")
    args = ap.parse_args()
    if args.pin and os.cpu_count() < 2:
        raise SystemExit("--pin needs two CPUs")
    load_cpu, proxy_cpu = (0, 1) if args.pin else (None, None)
    if not os.path.exists(BIN):
        raise SystemExit("build first: cargo build --release")
    nginx = shutil.which("nginx") or "/usr/sbin/nginx"
    if not os.path.exists(nginx):
        raise SystemExit("nginx not found (apt-get install nginx-light)")

    procs = []
    results = []
    tmp = tempfile.mkdtemp(prefix="sluice-bench-")
    global CA_FILE
    scheme = "http"
    if args.tls:
        CA_FILE, cert, key = make_certificates(tmp)
        scheme = "https"
    try:
        for name, conc, tokens, delay, requests, streamed in SCENARIOS:
            if args.only and args.only not in name:
                continue
            requests = max(conc, 10, int(requests * args.scale))
            sim_port, gw_port, admin_port, ngx_port = (free_port() for _ in range(4))
            sim = subprocess.Popen(
                [BIN, "sim", "--listen", f"127.0.0.1:{sim_port}", "--profile", "fixed", "--prefill-delay", "0ms",
                 "--token-delay", delay, "--output-tokens", str(tokens)],
                stderr=subprocess.DEVNULL, preexec_fn=on_cpu(load_cpu))
            procs.append(sim)
            # Like nginx's `access_log off`: the access log is measured separately
            # (benches/e2e/telemetry_overhead.py).
            gw_conf = os.path.join(tmp, "sluice.yaml")
            with open(gw_conf, "w") as f:
                f.write("telemetry:\n  access_log:\n    enabled: false\n")
                if args.tls:
                    f.write(f"server:\n  tls:\n    cert_file: {cert}\n    key_file: {key}\n    admin: false\n")
            gw = subprocess.Popen(
                [BIN, "serve", "--config", gw_conf, "--backend", f"http://127.0.0.1:{sim_port}",
                 "--listen", f"127.0.0.1:{gw_port}", "--admin-listen", f"127.0.0.1:{admin_port}"],
                stderr=subprocess.DEVNULL, env={**os.environ, "RUST_LOG": "warn"}, preexec_fn=on_cpu(proxy_cpu))
            procs.append(gw)
            conf = os.path.join(tmp, "nginx.conf")
            with open(conf, "w") as f:
                workers = 1 if args.pin else os.cpu_count()
                tls = (f"ssl_certificate {cert}; ssl_certificate_key {key}; ssl_protocols TLSv1.3;"
                       if args.tls else "")
                f.write(NGINX_CONF.format(workers=workers, dir=tmp, sim_port=sim_port, port=ngx_port,
                                          ssl=" ssl" if args.tls else "", tls=tls))
            ngx = subprocess.Popen([nginx, "-c", conf, "-p", tmp], stderr=subprocess.DEVNULL,
                                   preexec_fn=on_cpu(proxy_cpu))
            procs.append(ngx)
            wait_http(f"http://127.0.0.1:{sim_port}/health")
            wait_http(f"http://127.0.0.1:{admin_port}/readyz")
            wait_http(f"{scheme}://127.0.0.1:{ngx_port}/health")
            time.sleep(0.5)  # let nginx fork its workers

            row = {"scenario": name, "concurrency": conc, "tokens": tokens, "token_delay": delay,
                   "requests": requests, "streamed": streamed, "rounds": {}}
            admin_url = f"http://127.0.0.1:{admin_port}"
            paths = {
                "direct": (f"http://127.0.0.1:{sim_port}", []),
                "sluice": (f"{scheme}://127.0.0.1:{gw_port}", [gw.pid]),
                "nginx": (f"{scheme}://127.0.0.1:{ngx_port}", [ngx.pid] + children(ngx.pid)),
            }
            # Warm every path's connection pool once, then measure: the direct
            # path once, the proxies `--rounds` times each, alternating which
            # goes first (the machine drifts; a fixed order would favour one).
            for label, (url, _) in paths.items():
                bench(url, conc, tokens, conc, load_cpu, streamed)
            order = ["direct"]
            for r in range(args.rounds):
                order += ["sluice", "nginx"] if r % 2 == 0 else ["nginx", "sluice"]
            for label in order:
                url, pids = paths[label]
                own_before = overhead_buckets(admin_url) if label == "sluice" else None
                before = cpu_seconds(pids)
                rep = bench(url, conc, tokens, requests, load_cpu, streamed)
                cpu = cpu_seconds(pids) - before
                if own_before is not None:
                    own_after = overhead_buckets(admin_url)
                    row["sluice_own_overhead_ms"] = {
                        "p50_at_most": bucket_quantile(own_before, own_after, 0.5) * 1e3,
                        "p99_at_most": bucket_quantile(own_before, own_after, 0.99) * 1e3,
                    }
                row["rounds"].setdefault(label, []).append({
                    "ok": rep["ok"], "errors": rep["errors"],
                    "ttft_p50_ms": rep["ttft_seconds"]["p50"] * 1e3,
                    "ttft_p99_ms": rep["ttft_seconds"]["p99"] * 1e3,
                    "itl_p50_ms": rep["inter_token_seconds"]["p50"] * 1e3,
                    "itl_p99_ms": rep["inter_token_seconds"]["p99"] * 1e3,
                    "e2e_p50_ms": rep["e2e_seconds"]["p50"] * 1e3,
                    "req_per_s": rep["requests_per_second"],
                    "cpu_s_per_1000": cpu / rep["requests"] * 1000 if pids else None,
                })
            for label, runs in row["rounds"].items():
                row[label] = {k: (median([x[k] for x in runs]) if k != "errors" and runs[0][k] is not None
                                  else runs[0][k] if k != "errors" else {e: n for x in runs for e, n in x[k].items()})
                              for k in runs[0]}
                row[label]["ok"] = sum(x["ok"] for x in runs)
            if row["nginx"]["cpu_s_per_1000"]:
                row["cpu_ratio_per_round"] = [
                    s["cpu_s_per_1000"] / n["cpu_s_per_1000"]
                    for s, n in zip(row["rounds"]["sluice"], row["rounds"]["nginx"])]
            results.append(row)
            for p in (ngx, gw, sim):
                p.send_signal(signal.SIGTERM)
            for p in (ngx, gw, sim):
                p.wait(timeout=15)
            procs.clear()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        shutil.rmtree(tmp, ignore_errors=True)

    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine(),
        "git": subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True).stdout.strip(),
        "nginx": subprocess.run([nginx, "-v"], capture_output=True, text=True).stderr.strip(),
        "pinned": args.pin,
        "tls": args.tls,
        "rounds": args.rounds,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=2)
    print(report(meta, results))


def machine():
    model = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{os.cpu_count()} vCPU {model}, {mem:.0f} GiB, {platform.system()} {platform.release()}"


def report(meta, results):
    pinned = " Pinned: client and replica on CPU 0, proxy on CPU 1." if meta.get("pinned") else ""
    if meta.get("tls"):
        pinned += " Both proxies terminate TLS 1.3 (the same ECDSA P-256 certificate)."
    lines = [f"Run {meta['date']} on {meta['machine']}, commit {meta['git']}, {meta['nginx']}.{pinned}", ""]
    for r in results:
        d, s, n = r["direct"], r["sluice"], r["nginx"]
        rounds = len(r.get("rounds", {}).get("sluice", [])) or 1
        lines += [
            f"**{r['scenario']}**, {r['requests']} requests per path and round, "
            f"medians of {rounds} round{'s' if rounds > 1 else ''} (direct: one)",
            "",
            "| path | ok | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 | req/s | proxy CPU-s / 1000 req |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for label, x in (("direct", d), ("sluice", s), ("nginx", n)):
            cpu = "-" if x["cpu_s_per_1000"] is None else f"{x['cpu_s_per_1000']:.2f}"
            lines.append(
                f"| {label} | {x['ok']} | {x['ttft_p50_ms']:.2f} ms | {x['ttft_p99_ms']:.2f} ms | "
                f"{x['itl_p50_ms']:.2f} ms | {x['itl_p99_ms']:.2f} ms | {x['req_per_s']:.1f} | {cpu} |")
        lines += [
            "",
            f"Added over direct: Sluice TTFT p50 {s['ttft_p50_ms'] - d['ttft_p50_ms']:+.2f} ms, "
            f"p99 {s['ttft_p99_ms'] - d['ttft_p99_ms']:+.2f} ms, ITL p99 {s['itl_p99_ms'] - d['itl_p99_ms']:+.2f} ms; "
            f"nginx TTFT p50 {n['ttft_p50_ms'] - d['ttft_p50_ms']:+.2f} ms, p99 {n['ttft_p99_ms'] - d['ttft_p99_ms']:+.2f} ms, "
            f"ITL p99 {n['itl_p99_ms'] - d['itl_p99_ms']:+.2f} ms. "
            f"CPU ratio Sluice/nginx: {s['cpu_s_per_1000'] / n['cpu_s_per_1000']:.2f}x"
            + (f" (per round: {', '.join(f'{x:.2f}' for x in r['cpu_ratio_per_round'])})"
               if r.get("cpu_ratio_per_round") else "")
            + f"; req/s ratio {s['req_per_s'] / n['req_per_s']:.2f}x.",
        ]
        own = r.get("sluice_own_overhead_ms")
        if own:
            lines.append(
                f"Sluice's own time per request (its `sluice_gateway_overhead_seconds`, bucket bounds): "
                f"p50 <= {own['p50_at_most']:g} ms, p99 <= {own['p99_at_most']:g} ms.")
        lines += [
            "",
        ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
