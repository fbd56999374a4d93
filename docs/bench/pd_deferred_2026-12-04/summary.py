"""Per workload and seed, base against new: TTFT p50/p99, warm p99, ITL p99, requests answered
and the PD decisions (python3 summary.py [DIR]; --md adds the table of docs/BENCHMARKS.md)."""
import glob
import os
import re
import sys

args = [a for a in sys.argv[1:] if not a.startswith("--")]
d = args[0] if args else os.path.dirname(os.path.abspath(__file__))
LINE = re.compile(r"^(\w+)\s+seed (\d+) (\S+)\s+TTFT p50\s+([\d.]+) p99\s+([\d.]+) warm\s+([\d.]+) "
                  r"floor\s+([\d.]+) ms \| ITL p99\s+([\d.]+) max\s+([\d.]+) ms .*?\| ok (\d+)/(\d+) "
                  r"\S+ \| (\{[^}]*\})")
rows = {}
for path in sorted(glob.glob(os.path.join(d, "*_seed*.log"))):
    build, protocol = os.path.basename(path).split("_")[:2]
    with open(path) as f:
        for line in f:
            m = LINE.match(line)
            if m:
                w, seed = m.group(1), int(m.group(2))
                rows[(protocol, w, seed, build)] = m
print(f"{'protocol':8} {'workload':9} seed  {'p99 base':>9} {'p99 new':>8} {'base/new':>8}  "
      f"{'warm base':>9} {'warm new':>8}  {'p50 base':>8} {'p50 new':>8}  ITL p99 base/new  ok  decisions new")
ratios = {}
for (protocol, w, seed, build) in sorted(rows):
    if build != "base" or (protocol, w, seed, "new") not in rows:
        continue
    b, n = rows[(protocol, w, seed, "base")], rows[(protocol, w, seed, "new")]
    r = float(b.group(5)) / float(n.group(5))
    ratios.setdefault((protocol, w), []).append(r)
    print(f"{protocol:8} {w:9} {seed:4}  {b.group(5):>9} {n.group(5):>8} {r:8.2f}x  {b.group(6):>9} "
          f"{n.group(6):>8}  {b.group(4):>8} {n.group(4):>8}  {b.group(8)}/{n.group(8)}  "
          f"{n.group(10)}/{n.group(11)}  {n.group(12)}")
for k, v in sorted(ratios.items()):
    v = sorted(v)
    print(f"{k[0]:8} {k[1]:9} base p99 / new p99 median {v[len(v) // 2]:.2f}x, range {v[0]:.2f}-{v[-1]:.2f}x")

if "--md" in sys.argv:
    groups = {}
    for (protocol, w, seed, build), m in rows.items():
        if build == "base" and (protocol, w, seed, "new") in rows:
            groups.setdefault((protocol, w), []).append((seed, m, rows[(protocol, w, seed, "new")]))
    for (protocol, w), g in sorted(groups.items(), key=lambda kv: (kv[0][0] != "vllm", kv[0][1])):
        g.sort(key=lambda x: x[0])
        per = ", ".join(f"{float(b.group(5)):,.0f} / {float(n.group(5)):,.0f}" for _, b, n in g)
        r = sorted(float(b.group(5)) / float(n.group(5)) for _, b, n in g)
        p50 = sorted(float(b.group(4)) / float(n.group(4)) for _, b, n in g)
        b50 = sorted(float(b.group(4)) for _, b, _ in g)
        n50 = sorted(float(n.group(4)) for _, _, n in g)
        itl = f"{min(float(b.group(8)) for _, b, _ in g):.2f}-{max(float(b.group(8)) for _, b, _ in g):.2f} / " \
              f"{min(float(n.group(8)) for _, _, n in g):.2f}-{max(float(n.group(8)) for _, _, n in g):.2f} ms"
        print(f"| {protocol}, {w} | {g[0][0]}-{g[-1][0]} | {per} ms | {r[len(r) // 2]:.2f}x "
              f"({r[0]:.2f}-{r[-1]:.2f}x) | {b50[len(b50) // 2]:,.0f} / {n50[len(n50) // 2]:,.0f} ms "
              f"({p50[len(p50) // 2]:.2f}x) | {itl} |")
