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
import signal
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cpu_ab  # noqa: E402  (its Rig: the replica, the proxies, the caps)
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
    rig = cpu_ab.Rig()
    try:
        rig.sim(args.bin, 32, "0ms")
        rig.gateway("sluice", args.bin)
        rig.nginx()
        rig.cap("sluice_syscalls", args.cpu_quota)
        paths = rig.paths
        for k, (url, pids) in paths.items():
            so.bench(url, 64, 32, 2000, 0, False)  # warm the connections
            out_file = os.path.join(rig.tmp, f"{k}.perf")
            stat = subprocess.Popen(["perf", "stat", "-x", ",", "-e", ",".join(EVENTS), "-o", out_file,
                                     "-p", ",".join(map(str, pids))], stderr=subprocess.DEVNULL)
            time.sleep(0.5)  # perf attached
            out = so.bench(url, 64, 32, args.requests, 0, False)
            stat.send_signal(signal.SIGINT)
            stat.wait()
            if out["ok"] != args.requests:
                raise SystemExit(f"{k}: {out['ok']} of {args.requests} requests succeeded: {out['errors']}")
            print(f"{k}: {out['ok']} of {args.requests} requests, {out['requests_per_second']:.0f} req/s "
                  f"(capped at {args.cpu_quota} CPU)")
            with open(out_file) as f:
                for line in f:
                    fields = line.strip().split(",")
                    if len(fields) > 2 and fields[0].replace(".", "").isdigit():
                        print(f"  {fields[2]:34} {float(fields[0]) / args.requests:6.3f} per request")
    finally:
        rig.close()


if __name__ == "__main__":
    main()
