#!/usr/bin/env python3
"""System calls and context switches per non-streamed request, Sluice against
nginx, each capped at a share of CPU 1 as in `cpu_ab.py --cpu-quota`.

The same setup as `cpu_ab.py` (replica and load generator on CPU 0, each proxy
alone on CPU 1 in its own cgroup); `perf stat` counts the proxy's system calls
by kind (tracepoints, which need no hardware counters) over `--requests`
requests. Root (cgroups, tracepoints).

    sudo python3 benches/e2e/syscalls.py [--bin target/release/sluice] [--cpu-quota 0.25]
"""

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cpu_ab  # noqa: E402  (its cgroup helper)
import stream_overhead as so  # noqa: E402

EVENTS = ["raw_syscalls:sys_enter", "context-switches"] + [
    f"syscalls:sys_enter_{c}" for c in
    ("epoll_wait", "recvfrom", "sendto", "writev", "getsockopt", "read", "write", "futex")]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", default=so.BIN)
    ap.add_argument("--cpu-quota", type=float, default=0.25)
    ap.add_argument("--requests", type=int, default=16384)
    args = ap.parse_args()
    tmp = tempfile.mkdtemp()
    procs, groups = [], []
    try:
        sim = so.free_port()
        procs.append(subprocess.Popen(
            [args.bin, "sim", "--listen", f"127.0.0.1:{sim}", "--profile", "fixed", "--prefill-delay", "0ms",
             "--token-delay", "0ms", "--output-tokens", "32"], stderr=subprocess.DEVNULL, preexec_fn=so.on_cpu(0)))
        conf = os.path.join(tmp, "gw.yaml")
        with open(conf, "w") as f:
            f.write("telemetry:\n  access_log:\n    enabled: false\n")
        port, admin = so.free_port(), so.free_port()
        gw = subprocess.Popen(
            [args.bin, "serve", "--config", conf, "--backend", f"http://127.0.0.1:{sim}",
             "--listen", f"127.0.0.1:{port}", "--admin-listen", f"127.0.0.1:{admin}"],
            stderr=subprocess.DEVNULL, env={**os.environ, "RUST_LOG": "warn"}, preexec_fn=so.on_cpu(1))
        procs.append(gw)
        so.wait_http(f"http://127.0.0.1:{admin}/readyz")
        ngx_port = so.free_port()
        with open(os.path.join(tmp, "nginx.conf"), "w") as f:
            f.write(so.NGINX_CONF.format(workers=1, dir=tmp, sim_port=sim, port=ngx_port))
        nginx = shutil.which("nginx") or "/usr/sbin/nginx"
        ngx = subprocess.Popen([nginx, "-c", os.path.join(tmp, "nginx.conf"), "-p", tmp],
                               stderr=subprocess.DEVNULL, preexec_fn=so.on_cpu(1))
        procs.append(ngx)
        so.wait_http(f"http://127.0.0.1:{ngx_port}/health")
        time.sleep(0.5)  # let nginx fork its worker
        paths = {"sluice": (f"http://127.0.0.1:{port}", [gw.pid]),
                 "nginx": (f"http://127.0.0.1:{ngx_port}", [ngx.pid] + so.children(ngx.pid))}
        for k, (_, pids) in paths.items():
            groups.append(cpu_ab.capped(f"sluice_syscalls_{os.getpid()}_{k}", args.cpu_quota, pids))
        for k, (url, pids) in paths.items():
            so.bench(url, 64, 32, 2000, 0, False)  # warm the connections
            out_file = os.path.join(tmp, f"{k}.perf")
            stat = subprocess.Popen(["perf", "stat", "-x", ",", "-e", ",".join(EVENTS), "-o", out_file,
                                     "-p", ",".join(map(str, pids))], stderr=subprocess.DEVNULL)
            time.sleep(0.5)  # perf attached
            out = so.bench(url, 64, 32, args.requests, 0, False)
            stat.send_signal(signal.SIGINT)
            stat.wait()
            print(f"{k}: {out['ok']} of {args.requests} requests, {out['requests_per_second']:.0f} req/s "
                  f"(capped at {args.cpu_quota} CPU)")
            with open(out_file) as f:
                for line in f:
                    fields = line.strip().split(",")
                    if len(fields) > 2 and fields[0].replace(".", "").isdigit():
                        print(f"  {fields[2]:34} {float(fields[0]) / args.requests:6.3f} per request")
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait()
        for g in groups:
            os.rmdir(g)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
