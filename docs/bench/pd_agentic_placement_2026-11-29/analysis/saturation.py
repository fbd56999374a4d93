"""The 32-session agentic runs: prompt tokens offered, the part no cache could save (each
turn's tokens beyond its previous turn's prompt: the last answer and the new message or
tool result; a first turn's beyond the 3,000-token shared prompt), and, through Sluice,
the prefill legs' uncached tokens, each per second of the run and against the prefill
pool's compute (two replicas doing 2,048-token chunks at 8 ms + 0.1 ms a token).
usage: python3 saturation.py"""
import gzip, json

POOL = 2 * 2048 / (0.008 + 2048 * 1e-4)  # tokens/s


def load(d, router, seed):
    return [json.loads(l) for l in gzip.open(f"../{d}/agentic_{router}_seed{seed}.jsonl.gz")]


for d, seeds in (("rows_sticky_full_c32", (1, 2, 3)), ("rows_lost_c32", (1, 2))):
    for router in ("sluice-pd", "vllm-pd-cache_aware"):
        for s in seeds:
            rows = [r for r in load(d, router, s) if r.get("ttft_s") is not None]
            by = {}
            for r in rows:
                by.setdefault(r["session"], {})[r["turn"]] = r
            unav = sum(max(r["prompt_tokens"] - (by[r["session"]][r["turn"] - 1]["prompt_tokens"]
                                                if r["turn"] - 1 in by[r["session"]] else 3000), 0)
                       for r in rows)
            tot = sum(r["prompt_tokens"] for r in rows)
            dur = max(r["sent_s"] + r["e2e_s"] for r in rows) - min(r["sent_s"] for r in rows)
            line = (f"{d[5:]:16s} {router[:6]} seed {s}: {len(rows)} turns in {dur:5.1f} s, prompt "
                    f"{tot / dur:6.0f} tok/s, unavoidable {unav / dur:5.0f} tok/s ({unav / dur / POOL:.0%} "
                    f"of the pool's {POOL:.0f})")
            if router == "sluice-pd":
                unc = sum(r["prompt_tokens"] - (r.get("prefill_cached_tokens") or 0)
                          for r in rows if r.get("pd") == "remote")
                line += f", uncached prefills {unc / dur:6.0f} tok/s ({unc / dur / POOL:.0%})"
            ttft = sorted(r["ttft_s"] for r in rows)
            print(line + f", TTFT mean {sum(ttft) / len(ttft):.2f} s")
