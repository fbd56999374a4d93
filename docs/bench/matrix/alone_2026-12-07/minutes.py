"""Per minute of a run, from the gateway's backend snapshots (`--requests-dir`
writes `*_backends.jsonl`, one `/admin/backends` a tenth of a second): per
replica the mean requests in flight from the gateway, the engine's mean
waiting requests, and the share of snapshots in which its engine was pressed
(queue outlived a scrape, or preempting). Usage: python3 minutes.py FILE
(the files are too large to commit; this script's output for seed 3 of
`sessions_heavy` at 3026bcf and with the patch is `minutes_seed3.txt`)."""
import collections
import json
import sys


def main():
    rows = [json.loads(line) for line in open(sys.argv[1])]
    n = len(rows[0]["backends"])
    win = collections.defaultdict(lambda: [[0.0] * n, [0.0] * n, [0.0] * n, 0])
    for i, r in enumerate(rows):
        a = win[i // 600]
        for j, b in enumerate(r["backends"]):
            a[0][j] += b["in_flight"]
            a[1][j] += b["requests_waiting"] or 0
            a[2][j] += 1 if b.get("engine_queued") or b.get("preempting") else 0
        a[3] += 1
    print("minute | in flight per replica | waiting | share pressed")
    for w in sorted(win):
        f, q, p, k = win[w]
        print(w, " ".join(f"{x / k:5.1f}" for x in f), "|",
              " ".join(f"{x / k:4.1f}" for x in q), "|",
              " ".join(f"{x / k:4.2f}" for x in p))


if __name__ == "__main__":
    main()
