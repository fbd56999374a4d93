"""Replays one run's per-request placements (`replay/CELL_seedN.csv.gz`: the
Sluice rows of a98249c's runs, `../seat_learning_2026-12-06/`) through the
engine model of the matrix's FAST replicas (first come, first served, running
sequences first, chunked prefill in 2,048 tokens a step, steps of 8 ms + 0.1 ms
a sequence + 0.1 ms a prefilled token, 32 tokens out), with and without a
gateway gate that holds a prompt of 256 uncached tokens or more while the
cold prefills sent to its replica before their first tokens and its own would
exceed BUDGET (0: no gate). Prints the replayed whole-run TTFT p99 and p50.
An estimate made before building the gate (the replay ignores what the gate
changes upstream: placement, holds for a prompt's own prefill).
Usage: python3 replay.py FILE [BUDGET]"""
import csv
import gzip
import sys

BUDGET = int(sys.argv[2]) if len(sys.argv) > 2 else 0
OUT, STEP_TOKENS, SEATS = 32, 2048, 64


def replica_run(reqs):
    """First tokens of one replica's requests (sorted by sending)."""
    t, waiting, running, gate, under, i = 0.0, [], [], [], 0, 0
    while i < len(reqs) or waiting or running or gate:
        while i < len(reqs) and reqs[i]["sent"] <= t:
            r = reqs[i]
            i += 1
            if r["unc"] >= 256 and BUDGET and under > 0 and under + r["unc"] > BUDGET:
                gate.append(r)
                continue
            if r["unc"] >= 256:
                under += r["unc"]
                r["gated"] = True
            waiting.append(r)
        if not waiting and not running:
            if gate:
                r = gate.pop(0)
                under += r["unc"]
                r["gated"] = True
                waiting.append(r)
                continue
            t = max(t, reqs[i]["sent"])
            continue
        budget, seqs, pre = STEP_TOKENS, 0, 0
        for s in running:
            s["step"] = min(budget, s["unc"] - s["done"]) if s["done"] < s["unc"] else 0
            budget -= s["step"]
            pre += s["step"]
            seqs += 1
        while waiting and budget > 0 and len(running) < SEATS:
            s = waiting.pop(0)
            s["step"] = min(budget, s["unc"])
            budget -= s["step"]
            pre += s["step"]
            running.append(s)
            seqs += 1
        t += 0.008 + 0.0001 * seqs + 0.0001 * pre
        still = []
        for s in running:
            if s["done"] < s["unc"]:
                s["done"] += s["step"]
                if s["done"] >= s["unc"]:
                    s["ft"], s["out"] = t, 1
                    if s.get("gated"):
                        under -= s["unc"]
                        s["gated"] = False
            else:
                s["out"] += 1
            if s["out"] < OUT:
                still.append(s)
        running = still
        while gate and (under == 0 or under + gate[0]["unc"] <= BUDGET):
            r = gate.pop(0)
            under += r["unc"]
            r["gated"] = True
            waiting.append(r)
    return [r["ft"] - r["sent"] for r in reqs]


def main():
    by_replica = {}
    with gzip.open(sys.argv[1], "rt") as f:
        for row in csv.DictReader(f):
            unc = max(1, int(row["prompt_tokens"]) - int(row["cached_tokens"]))
            by_replica.setdefault(row["replica"], []).append(
                {"sent": float(row["sent_s"]), "unc": unc, "done": 0, "out": 0})
    ttfts = []
    for reqs in by_replica.values():
        reqs.sort(key=lambda r: r["sent"])
        ttfts += replica_run(reqs)
    ttfts.sort()
    print(f"{sys.argv[1]} budget {BUDGET}: p99 {ttfts[int(len(ttfts) * 0.99)]:.3f} s,"
          f" p50 {ttfts[len(ttfts) // 2]:.3f} s")


if __name__ == "__main__":
    main()
