#!/usr/bin/env python3
"""CPU per request of two Sluice builds and nginx, interleaved in one run.

For an optimisation's before/after on a shared, noisy machine: the same
replica (`sluice sim`, fixed timing) and load generator (`sluice bench`, closed
loop) on CPU 0; a gateway of each build and one nginx worker (`proxy_buffering
off`) each alone on CPU 1, measured in turn, the order rotated every round.
CPU is the proxy process's user+system time from `/proc/PID/stat`. Reports
microseconds per request and, per round, each build's ratio to nginx and the
new build's to the old one, with medians: the machine drifts between rounds,
and ratios taken within a round cancel most of it.

    cargo build --release                       # the new build: target/release/sluice
    python3 benches/e2e/cpu_ab.py --base /path/to/old/sluice --rounds 9
    python3 benches/e2e/cpu_ab.py --base OLD --stream --tokens 128 --token-delay 1ms \\
        --requests 768 --rounds 6
    sudo python3 benches/e2e/cpu_ab.py --base OLD --cpu-quota 0.25   # capacity: req/s, proxy bound

With `--cpu-quota`, each proxy gets that share of CPU 1 (a cgroup each), so
the requests per second it passes are its capacity on that share of a core,
and their ratio is the one "req/s on one core" asks for; without it, the load
generator and the replica on CPU 0 bound them.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import stream_overhead as so  # noqa: E402  (its helpers and nginx config)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="the build to compare against (a sluice binary)")
    ap.add_argument("--new", default=so.BIN, help="the new build (default: target/release/sluice)")
    ap.add_argument("--base-http1", choices=["own", "hyper"],
                    help="run the base with this `server.http1` (e.g. --base target/release/sluice "
                         "--base-http1 hyper compares the two servers of one build)")
    ap.add_argument("--base-yaml", default="",
                    help="more configuration for the base, appended to its file (top-level keys other "
                         "than telemetry and server), e.g. the per-request features off")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--requests", type=int, default=16384, help="per proxy and round")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--token-delay", default="0ms")
    ap.add_argument("--stream", action="store_true", help="streamed requests (default: non-streamed)")
    ap.add_argument("--cpu-quota", type=float,
                    help="cap each proxy at this share of a CPU (e.g. 0.25), each in its own cgroup "
                         "(v1 cpu controller, a 10 ms period), so that it, not the load generator, "
                         "bounds the requests per second: the proxies' capacity on that share of a core")
    ap.add_argument("--json", help="write every round's figures here")
    args = ap.parse_args()
    if os.cpu_count() < 2:
        raise SystemExit("needs two CPUs (the proxy alone on CPU 1)")

    rig = Rig()
    try:
        rig.sim(args.new, args.tokens, args.token_delay)
        for label, binary in (("new", args.new), ("base", args.base)):
            extra = ""
            if label == "base" and args.base_http1:
                extra += f"server:\n  http1: {args.base_http1}\n"
            if label == "base" and args.base_yaml:
                extra += args.base_yaml.rstrip("\n") + "\n"
            rig.gateway(label, binary, extra)
        rig.nginx()
        paths = rig.paths
        if args.cpu_quota:
            rig.cap("sluice_cpu_ab", args.cpu_quota)

        def run(url, n):
            return so.bench(url, args.concurrency, args.tokens, n, 0, args.stream)

        for url, _ in paths.values():  # warm each path's connections
            run(url, max(args.concurrency * 2, 500))
        us = {k: [] for k in paths}
        # The same split into user and kernel time (the kernel's share is
        # mostly loopback TCP, which no user-space cut reaches).
        user_us = {k: [] for k in paths}
        system_us = {k: [] for k in paths}
        # Requests per second as the load generator saw them. Without
        # --cpu-quota the load generator and the replica sharing CPU 0 bound
        # them, not the proxy (recorded to show that, not to rank the
        # proxies); with it, the capped proxy does: its capacity.
        rps = {k: [] for k in paths}
        labels = list(paths)
        for r in range(args.rounds):
            for k in labels[r % 3:] + labels[:r % 3]:
                url, pids = paths[k]
                user0, system0 = cpu_split(pids)
                out = run(url, args.requests)
                if out["ok"] != args.requests:
                    raise SystemExit(f"{k}: {out['ok']} of {args.requests} requests succeeded: {out['errors']}")
                user1, system1 = cpu_split(pids)
                user_us[k].append((user1 - user0) / args.requests * 1e6)
                system_us[k].append((system1 - system0) / args.requests * 1e6)
                us[k].append(user_us[k][-1] + system_us[k][-1])
                rps[k].append(out.get("requests_per_second", 0.0))
    finally:
        rig.close()

    def ratios(a, b, of=us):
        return [x / y for x, y in zip(of[a], of[b])]

    summary = {
        "new_over_nginx": ratios("new", "nginx"),
        "base_over_nginx": ratios("base", "nginx"),
        "new_over_base": ratios("new", "base"),
    }
    what = "streamed" if args.stream else "non-streamed"
    print(f"{what}, {args.concurrency} in flight, {args.tokens} tokens @ {args.token_delay}, "
          f"{args.requests} requests per proxy and round, {args.rounds} rounds")
    for k, v in us.items():
        print(f"  {k:5} CPU us/request: median {statistics.median(v):.1f} ({' '.join(f'{x:.1f}' for x in v)})")
    for k in us:
        print(f"  {k:5} of which user {statistics.median(user_us[k]):.1f}, "
              f"kernel {statistics.median(system_us[k]):.1f} (medians)")
    for k, v in summary.items():
        print(f"  {k}: median {statistics.median(v):.2f}x ({' '.join(f'{x:.2f}' for x in v)})")
    bound = "proxy bound: the capped proxy's capacity" if args.cpu_quota else "load-generator bound"
    for k, v in rps.items():
        print(f"  {k:5} req/s ({bound}): median {statistics.median(v):.0f}")
    if args.cpu_quota:
        for a, b in (("new", "nginx"), ("base", "nginx"), ("new", "base")):
            r = ratios(a, b, of=rps)
            summary[f"rps_{a}_over_{b}"] = r
            print(f"  req/s {a}/{b}: median {statistics.median(r):.2f}x ({' '.join(f'{x:.2f}' for x in r)})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": so.machine(), "args": vars(args), "cpu_us_per_request": us,
                       "user_us_per_request": user_us, "system_us_per_request": system_us,
                       "requests_per_second": rps,
                       "ratios_per_round": summary,
                       "medians": {k: statistics.median(v) for k, v in summary.items()}}, f, indent=1)


class Rig:
    """The benchmark's processes: one replica (`sluice sim`, fixed timing) on
    CPU 0, and proxies each alone on CPU 1 (Sluice builds, one nginx worker),
    each optionally capped by a cgroup of its own. `paths` maps each proxy's
    label to its URL and PIDs. Shared by `cpu_ab.py` and `syscalls.py`."""

    def __init__(self):
        self.tmp = tempfile.mkdtemp()
        self.procs = []
        self.groups = []
        self.paths = {}
        self.sim_port = None

    def sim(self, binary, tokens, token_delay):
        self.sim_port = so.free_port()
        self.procs.append(subprocess.Popen(
            [binary, "sim", "--listen", f"127.0.0.1:{self.sim_port}", "--profile", "fixed", "--prefill-delay",
             "0ms", "--token-delay", token_delay, "--output-tokens", str(tokens)],
            stderr=subprocess.DEVNULL, preexec_fn=so.on_cpu(0)))
        so.wait_http(f"http://127.0.0.1:{self.sim_port}/health")

    def gateway(self, label, binary, extra_yaml=""):
        """A gateway of `binary` (access log off, `extra_yaml` appended) in
        front of the replica, once ready."""
        conf = os.path.join(self.tmp, f"{label}.yaml")
        with open(conf, "w") as f:
            f.write("telemetry:\n  access_log:\n    enabled: false\n" + extra_yaml)
        port, admin = so.free_port(), so.free_port()
        gw = subprocess.Popen(
            [binary, "serve", "--config", conf, "--backend", f"http://127.0.0.1:{self.sim_port}",
             "--listen", f"127.0.0.1:{port}", "--admin-listen", f"127.0.0.1:{admin}"],
            stderr=subprocess.DEVNULL, env={**os.environ, "RUST_LOG": "warn"}, preexec_fn=so.on_cpu(1))
        self.procs.append(gw)
        so.wait_http(f"http://127.0.0.1:{admin}/readyz")
        self.paths[label] = (f"http://127.0.0.1:{port}", [gw.pid])

    def nginx(self):
        """One nginx worker (`proxy_buffering off`) in front of the replica."""
        port = so.free_port()
        conf = os.path.join(self.tmp, "nginx.conf")
        with open(conf, "w") as f:
            f.write(so.NGINX_CONF.format(workers=1, dir=self.tmp, sim_port=self.sim_port, port=port))
        ngx = subprocess.Popen([shutil.which("nginx") or "/usr/sbin/nginx", "-c", conf, "-p", self.tmp],
                               stderr=subprocess.DEVNULL, preexec_fn=so.on_cpu(1))
        self.procs.append(ngx)
        so.wait_http(f"http://127.0.0.1:{port}/health")
        time.sleep(0.5)  # let nginx fork its worker
        self.paths["nginx"] = (f"http://127.0.0.1:{port}", [ngx.pid] + so.children(ngx.pid))

    def cap(self, prefix, share):
        """Each proxy in a cgroup of its own, allowed `share` of a CPU."""
        for label, (_, pids) in self.paths.items():
            self.groups.append(capped(f"{prefix}_{os.getpid()}_{label}", share, pids))

    def close(self):
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            p.wait()
        for g in self.groups:
            os.rmdir(g)
        shutil.rmtree(self.tmp, ignore_errors=True)


def cpu_split(pids):
    """User and kernel CPU seconds of `pids` (`/proc/PID/stat`; their sum is
    `stream_overhead.cpu_seconds`)."""
    user = system = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            user, system = user + int(fields[11]), system + int(fields[12])
        except FileNotFoundError:
            pass
    tick = os.sysconf("SC_CLK_TCK")
    return user / tick, system / tick


def capped(name, share, pids):
    """A cgroup (v1 cpu controller) allowed `share` of one CPU, holding the
    processes `pids` and every thread they start; its path, to remove."""
    root = "/sys/fs/cgroup/cpu"
    if not os.path.exists(os.path.join(root, "cpu.cfs_quota_us")):
        raise SystemExit("--cpu-quota needs the cgroup v1 cpu controller at /sys/fs/cgroup/cpu (and root)")
    path = os.path.join(root, name)
    os.mkdir(path)
    period = 10_000
    for key, value in (("cpu.cfs_period_us", period), ("cpu.cfs_quota_us", int(share * period))):
        with open(os.path.join(path, key), "w") as f:
            f.write(str(value))
    for pid in pids:
        # cgroup.procs moves every thread of the process.
        with open(os.path.join(path, "cgroup.procs"), "w") as f:
            f.write(str(pid))
    return path


if __name__ == "__main__":
    main()
