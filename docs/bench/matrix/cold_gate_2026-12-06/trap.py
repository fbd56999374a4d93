"""Where the `sessions` cell's sessions sat: from the gateway's backend
snapshots of a run (`--requests-dir` writes `*_backends.jsonl`, one
`/admin/backends` a tenth of a second), per replica the mean requests in
flight from the gateway and in the engine's queue, and the share of the run
during which one replica's engine queued 10 or more while another ran
nothing. Usage: python3 trap.py FILE... (the runs of sessions.sh: under
/tmp/gate_rows/sessions_{gate_off,pressed}/; too large to commit, this
script's output is `trap.txt`)"""
import json
import sys


def main():
    for path in sys.argv[1:]:
        rows = [json.loads(line) for line in open(path)]
        n = len(rows[0]["backends"])
        flight = [0.0] * n
        queue = [0.0] * n
        trapped = 0
        live = [r for r in rows if any(b["in_flight"] for b in r["backends"])]
        for r in live:
            bs = r["backends"]
            for i, b in enumerate(bs):
                flight[i] += b["in_flight"]
                queue[i] += b["requests_waiting"] or 0
            if (max(b["requests_waiting"] or 0 for b in bs) >= 10
                    and min(b["requests_running"] or 0 for b in bs) == 0):
                trapped += 1
        k = len(live)
        share = max(flight) / sum(flight)
        print(f"{path.split('/')[-2]:18} {path.split('/')[-1].split('_backends')[0]:28} "
              f"in flight {' '.join(f'{f / k:5.1f}' for f in flight)} | "
              f"queue {' '.join(f'{q / k:5.1f}' for q in queue)} | "
              f"busiest's share of in-flight {share:.2f} | one queues >= 10 while another runs "
              f"nothing: {trapped / k:.0%} of {rows[-1]['t']:.0f} s")


if __name__ == "__main__":
    main()
