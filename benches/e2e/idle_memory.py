#!/usr/bin/env python3
"""Memory of idle streams, and whether it is given back: the gateway's RSS
before, during and after waves of idle streams.

For each wave, N clients open a streamed chat request through the gateway to
a `sluice sim` replica that sends one token and then nothing for minutes, wait
for that first token (the stream is open and idle), hold it, then all close.
The script reads the gateway's RSS (/proc/PID/status VmRSS) before the first
wave, at each wave's peak (all N open), and after each wave once RSS stops
falling: `--settle` seconds, 15 by default). Reports KiB per idle stream (peak - before) / N, and what
is left after the wave (after - before).

    cargo build --release
    python3 benches/e2e/idle_memory.py                    # 3 waves of 5,000
    python3 benches/e2e/idle_memory.py --streams 2000 --waves 2 --json out.json
    python3 benches/e2e/idle_memory.py --bin target/release/sluice-other  # another build
    python3 benches/e2e/idle_memory.py --nginx            # nginx in the same run

Everything listens on 127.0.0.1 and every process is stopped at the end.
Needs a file-descriptor limit above 3 x N (this script raises its own soft
limit to the hard one).
"""

import argparse
import asyncio
import datetime
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from stream_overhead import BIN, NGINX_CONF, free_port, wait_http  # noqa: E402

BODY = json.dumps(
    {
        "model": "sim-model",
        "stream": True,
        "messages": [{"role": "user", "content": "hold"}],
    }
).encode()


def rss_kib(pids):
    total = 0
    for pid in pids:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
    return total


async def hold_stream(port, ready, release):
    """Open one stream, wait for its first token, hold it until released."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        + f"content-length: {len(BODY)}\r\n\r\n".encode()
        + BODY
    )
    await writer.drain()
    buf = b""
    while b'"content"' not in buf:
        chunk = await reader.read(4096)
        if not chunk:
            raise RuntimeError(f"stream closed before its first token: {buf[:300]!r}")
        buf += chunk
    ready()
    await release.wait()
    writer.close()
    try:
        await writer.wait_closed()
    except Exception:
        pass


async def wave(port, n, pids, settle):
    release = asyncio.Event()
    opened = 0
    all_open = asyncio.Event()

    def ready():
        nonlocal opened
        opened += 1
        if opened == n:
            all_open.set()

    tasks = []
    for i in range(n):
        tasks.append(asyncio.create_task(hold_stream(port, ready, release)))
        if i % 200 == 199:
            await asyncio.sleep(0.05)  # pace the connects (the accept backlog)
    await asyncio.wait_for(all_open.wait(), timeout=120)
    peak = rss_kib(pids)
    release.set()
    await asyncio.gather(*tasks)
    # RSS after: allocators give memory back lazily; read it after `settle`.
    await asyncio.sleep(settle)
    after = rss_kib(pids)
    return peak, after


def measure(label, port, pids, streams, waves, settle):
    before = rss_kib(pids)
    rows = []
    for w in range(waves):
        peak, after = asyncio.run(wave(port, streams, pids, settle))
        rows.append(
            {
                "wave": w + 1,
                "peak_kib": peak,
                "after_kib": after,
                "kib_per_stream": round((peak - before) / streams, 1),
                "left_after_kib": after - before,
            }
        )
        print(
            f"{label} wave {w + 1}: before {before / 1024:.1f} MiB, peak {peak / 1024:.1f} MiB "
            f"({(peak - before) / streams:.1f} KiB/stream), after {after / 1024:.1f} MiB "
            f"(+{(after - before) / 1024:.1f} MiB)",
            flush=True,
        )
    return {"before_kib": before, "waves": rows}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--streams", type=int, default=5000)
    ap.add_argument("--waves", type=int, default=3)
    ap.add_argument("--settle", type=float, default=15.0,
                    help="seconds to wait after a wave before reading RSS")
    ap.add_argument("--bin", default=BIN, help="the sluice binary to measure")
    ap.add_argument("--label", default=None, help="name of this build in the output")
    ap.add_argument("--nginx", action="store_true", help="measure nginx too (the floor)")
    ap.add_argument("--json", help="write the raw results here")
    args = ap.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    if hard < 3 * args.streams + 100:
        raise SystemExit(f"the file-descriptor limit ({hard}) is too low for {args.streams} streams")

    procs = []
    out = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
        "machine": f"{platform.machine()} {os.cpu_count()} CPUs, {platform.platform()}",
        "streams": args.streams,
        "results": {},
    }
    try:
        sim_port = free_port()
        procs.append(
            subprocess.Popen(
                [args.bin, "sim", "--listen", f"127.0.0.1:{sim_port}", "--profile", "fixed",
                 "--prefill-delay", "1ms", "--token-delay", "600s", "--output-tokens", "3"],
                stderr=subprocess.DEVNULL,
            )
        )
        wait_http(f"http://127.0.0.1:{sim_port}/v1/models")
        gw_port, admin_port = free_port(), free_port()
        gw = subprocess.Popen(
            [args.bin, "serve", "--backend", f"http://127.0.0.1:{sim_port}",
             "--listen", f"127.0.0.1:{gw_port}", "--admin-listen", f"127.0.0.1:{admin_port}"],
            stdout=subprocess.DEVNULL,  # the access log
            stderr=subprocess.DEVNULL,
        )
        procs.append(gw)
        wait_http(f"http://127.0.0.1:{admin_port}/readyz")
        label = args.label or os.path.basename(args.bin)
        out["results"][label] = measure(label, gw_port, [gw.pid], args.streams, args.waves, args.settle)
        if args.nginx:
            nginx = shutil.which("nginx") or "/usr/sbin/nginx"
            tmp = tempfile.mkdtemp()
            port = free_port()
            conf = os.path.join(tmp, "nginx.conf")
            # Enough connections for every stream twice (client and upstream).
            text = NGINX_CONF.format(workers=1, dir=tmp, sim_port=sim_port, port=port)
            text = text.replace("worker_connections 4096;", f"worker_connections {3 * args.streams};")
            text = f"worker_rlimit_nofile {3 * args.streams + 100};\n" + text
            with open(conf, "w") as f:
                f.write(text)
            ng = subprocess.Popen([nginx, "-c", conf, "-p", tmp], stderr=subprocess.DEVNULL)
            procs.append(ng)
            time.sleep(0.5)
            children = subprocess.run(["pgrep", "-P", str(ng.pid)], capture_output=True, text=True)
            pids = [ng.pid] + [int(p) for p in children.stdout.split()]
            out["results"]["nginx"] = measure("nginx", port, pids, args.streams, args.waves, args.settle)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
