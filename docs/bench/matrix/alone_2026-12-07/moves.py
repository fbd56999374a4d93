#!/usr/bin/env python3
"""Where sessions moved in a run of the agentic workload, from the per-turn
rows `sluice bench --requests-json` writes (`matrix.py --requests-dir`; one
JSON line a turn: its session, number, replica, timing, cached tokens).

Usage: moves.py ROWS.jsonl[.gz] ...

Per run: the turns that follow a turn of their session, how many went to
another replica than that turn's (moves; stickiness is the rest), how many
sessions moved once, twice, more; of the second and later moves, how long
after the session's move before and how many went back to the replica it
had left; the TTFT of the moved turns; and of the run's slowest 1% of turns,
how many had moved and how many stayed on a replica that had lost their
history (cached tokens no more than the session's shared prefix).
"""
import collections
import gzip
import json
import sys

# The agentic workload's shared prefix (`--prefix-tokens 3000`) as the
# engines cache it: whole blocks of 16 tokens.
SHARED = 3000 // 16 * 16


def rows(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return [json.loads(line) for line in f]


def pct(v, q):
    v = sorted(v)
    return v[min(len(v) - 1, int(q * len(v)))] if v else float("nan")


def report(path):
    turns = [r for r in rows(path) if "session" in r]
    by = collections.defaultdict(list)
    for r in turns:
        by[r["session"]].append(r)
    later = moves = back = 0
    per_session = collections.Counter()
    gaps, moved_ttft, moved_ids = [], [], set()
    for ts in by.values():
        ts.sort(key=lambda r: r["turn"])
        prev, last_move = None, None
        for r in ts:
            if r["error"] or r["replica"] is None:
                prev = None
                continue
            if prev is not None:
                later += 1
                if r["replica"] != prev:
                    moves += 1
                    per_session[r["session"]] += 1
                    if last_move is not None:
                        gaps.append(r["sent_s"] - last_move[0])
                        back += r["replica"] == last_move[1]
                    last_move = (r["sent_s"], prev)
                    if r["ttft_s"] is not None:
                        moved_ttft.append(r["ttft_s"])
                    moved_ids.add(r["i"])
            prev = r["replica"]
    done = [r for r in turns if r["ttft_s"] is not None]
    slow = sorted(done, key=lambda r: -r["ttft_s"])[: max(1, len(done) // 100)]
    slow_moved = sum(r["i"] in moved_ids for r in slow)
    slow_lost = sum(r["i"] not in moved_ids and r["turn"] > 0
                    and (r["cached_tokens"] or 0) <= SHARED for r in slow)
    dist = sorted(collections.Counter(per_session.values()).items())
    print(f"{path}")
    print(f"  turns {len(turns)}, following a turn {later}, moved {moves} "
          f"(sticky {100 * (1 - moves / later):.1f}%), TTFT p99 {pct([r['ttft_s'] for r in done], 0.99):.2f} s")
    print(f"  sessions moved: {len(per_session)}; by moves: "
          + ", ".join(f"{n}x {c}" for n, c in dist))
    print(f"  second or later moves: {len(gaps)}, back to the replica left {back}, "
          f"after the move before: " + (f"{min(gaps):.1f}-{max(gaps):.1f} s, median {pct(gaps, 0.5):.1f} s" if gaps else "-"))
    if moved_ttft:
        print(f"  moved turns' TTFT p50 {pct(moved_ttft, 0.5):.2f} s, p90 {pct(moved_ttft, 0.9):.2f} s, "
              f"max {max(moved_ttft):.2f} s")
    print(f"  slowest 1% ({len(slow)} turns): moved {slow_moved}, stayed with their history lost {slow_lost}")


if __name__ == "__main__":
    for p in sys.argv[1:]:
        report(p)
