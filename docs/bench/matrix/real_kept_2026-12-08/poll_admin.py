"""Poll a running Sluice gateway's /admin/backends and /admin/routing every 0.25 s.

Finds the first `sluice serve` process with `--admin-listen` (the one a benchmark
started), writes one JSON line per poll to the file named, and stops once the
gateway is gone. Usage: poll_admin.py OUT.jsonl
"""
import json, subprocess, time, urllib.request, sys
out = open(sys.argv[1], "w")
port = None
t_end = time.time() + 600
while time.time() < t_end and port is None:
    for line in subprocess.run(["pgrep", "-af", "sluice serve"], capture_output=True, text=True).stdout.splitlines():
        a = line.split()
        if "--admin-listen" in a:
            port = a[a.index("--admin-listen") + 1]
    time.sleep(0.2)
t0 = time.time()
fails = 0
while fails < 20:
    try:
        b = json.load(urllib.request.urlopen(f"http://{port}/admin/backends", timeout=2))
        r = json.load(urllib.request.urlopen(f"http://{port}/admin/routing", timeout=2))
        kept = {x["name"]: x.get("cache_kept") for x in r["replicas"]}
        out.write(json.dumps({"t": round(time.time() - t0, 2), "r": [
            {k: x.get(k) for k in ("name", "in_flight", "seats", "requests_waiting", "requests_running", "engine_queued", "metrics_age_seconds")} | {"kept": kept.get(x["name"])}
            for x in b]}) + "\n")
        out.flush()
        fails = 0
    except Exception:
        fails += 1
    time.sleep(0.25)
