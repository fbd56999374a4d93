import gzip, json, os
BASE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
RUNS = {"landed": "rows_landed_c12", "lost": "rows_lost_c12", "active": "rows_active_c12_seeds1-5",
        "slack": "rows_slack_c12", "ahead": "rows_ahead_c12",
        "ahead2": "rows_ahead2_c12", "ahead3": "rows_ahead3_c12", "ahead4": "rows_ahead4_c12",
        "tokens": "rows_tokens_c12", "tokens2": "rows_tokens2_c12"}
ROUTERS = ["sluice-pd", "vllm-pd-cache_aware"]
SHORT = {"sluice-pd": "sluice", "vllm-pd-cache_aware": "vllm"}
GAPS = 47  # 48 tokens out (--max-tokens 48), 47 inter-token gaps per turn

def load(run, router, seed):
    p = os.path.join(BASE, RUNS[run], f"agentic_{router}_seed{seed}.jsonl.gz")
    return [json.loads(l) for l in gzip.open(p)]

def ok(rows):
    return [r for r in rows if r.get("error") is None and r.get("ttft_s") is not None]

def pct(xs, q):
    # nearest rank, as sluice bench
    xs = sorted(xs)
    if not xs: return float("nan")
    k = min(len(xs), max(1, -(-round(q * 100) * len(xs) // 100)))
    return xs[k - 1]

def summary(run):
    with open(os.path.join(BASE, {"landed": "landed_c12_174b475.json", "lost": "lost_c12.json",
                                  "active": "active_c12_seeds1-5.json",
                                  "slack": "slack_c12_4801dde.json",
                                  "ahead": "ahead_c12_a8ac7d0.json",
                                  "ahead2": "ahead2_c12_a8ac7d0.json",
                                  "ahead3": "ahead3_c12_a8ac7d0.json",
                                  "ahead4": "ahead4_c12_a8ac7d0.json",
                                  "tokens": "tokens_c12.json",
                                  "tokens2": "tokens2_c12.json"}[run])) as f:
        j = json.load(f)
    return {n: {r["seed"]: r for r in rs} for n, rs in j["workloads"]["agentic"]["runs"].items()}
