"""The slowest requests of two runs side by side (each request's timing, as
`matrix.py --requests-dir` writes it): when each was sent, its TTFT, the
tokens the engine had cached for it (1,488 of 1,526: a prompt cached there,
so either held for its prompt's prefill or queued behind another's; 0: a cold
prefill). Usage: python3 slowest.py BEFORE.jsonl AFTER.jsonl [N]"""
import json
import sys


def slowest(path, n):
    rows = [json.loads(line) for line in open(path)]
    rows.sort(key=lambda r: -r["ttft_s"])
    return [f"#{r['i']:<4} sent {r['sent_s']:6.3f} s  TTFT {1000 * r['ttft_s']:7.1f} ms  "
            f"cached {r['cached_tokens']:5}" for r in rows[:n]]


def main():
    n = int(sys.argv[3]) if len(sys.argv) > 3 else 32
    print(f"{'before':50}| after")
    for a, b in zip(slowest(sys.argv[1], n), slowest(sys.argv[2], n)):
        print(f"{a:50}| {b}")


if __name__ == "__main__":
    main()
