"""The official Anthropic and OpenAI Python SDKs, unmodified, through Sluice's
/v1/messages and /v1/responses (tests/it/protocols.rs runs this).

Usage: python3 sdk_protocols.py MODE GATEWAY_URL ADMIN_URL API_KEY
  messages   Anthropic SDK: messages streamed and not, count_tokens, a stream
             cut mid-way by the replica (x-sim-fault: drop=3).
  responses  OpenAI SDK: responses streamed and not, chained with
             previous_response_id, a stream cut mid-way.
  messages_429  Anthropic SDK against a tier of 20 requests/minute: the
             strict client gets RateLimitError, a patient one waits and succeeds.
After every request the gateway's token counters for that endpoint are read
from ADMIN_URL/metrics, so usage is compared request by request. Prints one
JSON object.
"""

import json
import re
import sys
import time
import urllib.request

SYSTEM = "You are a careful coding agent. " * 20


def counters(admin: str, endpoint: str) -> dict:
    """The gateway's token and timing counters for one endpoint."""
    text = urllib.request.urlopen(f"{admin}/metrics", timeout=10).read().decode()
    out = {}
    for name in (
        "sluice_prompt_tokens_total",
        "sluice_prompt_tokens_cached_total",
        "sluice_generation_tokens_total",
        "sluice_inter_token_latency_seconds_count",
        "sluice_time_to_first_token_seconds_count",
    ):
        total = 0.0
        pat = re.compile(
            r"^" + re.escape(name) + r"\{([^}]*)\} (\S+)$", re.M
        )
        for labels, value in pat.findall(text):
            if f'endpoint="{endpoint}"' in labels:
                total += float(value)
        out[name] = total
    return out


def delta(before: dict, after: dict) -> dict:
    return {k: after[k] - before[k] for k in after}


def messages(base: str, admin: str, key: str) -> dict:
    import anthropic

    client = anthropic.Anthropic(base_url=base, api_key=key, max_retries=0, timeout=30)
    out = {"requests": []}
    convo = [{"role": "user", "content": "Fix the failing test in src/lib.rs."}]
    for i in range(3):
        before = counters(admin, "messages")
        msg = client.messages.create(
            model="sim-model", max_tokens=12, system=SYSTEM, messages=convo
        )
        after = counters(admin, "messages")
        u = msg.usage
        out["requests"].append({
            "stream": False,
            "sdk_prompt": u.input_tokens + (u.cache_read_input_tokens or 0)
            + (u.cache_creation_input_tokens or 0),
            "sdk_cached": u.cache_read_input_tokens or 0,
            "sdk_output": u.output_tokens,
            "stop_reason": msg.stop_reason,
            "gateway": delta(before, after),
        })
        convo = convo + [
            {"role": "assistant", "content": msg.content[0].text},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": f"t{i}", "content": "ok " * 30}
            ]},
        ]
        before = counters(admin, "messages")
        deltas = 0
        with client.messages.stream(
            model="sim-model", max_tokens=20, system=SYSTEM, messages=convo
        ) as stream:
            for ev in stream:
                if ev.type == "content_block_delta" and getattr(ev.delta, "text", ""):
                    deltas += 1
            final = stream.get_final_message()
        after = counters(admin, "messages")
        u = final.usage
        out["requests"].append({
            "stream": True,
            "deltas": deltas,
            "sdk_prompt": u.input_tokens + (u.cache_read_input_tokens or 0)
            + (u.cache_creation_input_tokens or 0),
            "sdk_cached": u.cache_read_input_tokens or 0,
            "sdk_output": u.output_tokens,
            "stop_reason": final.stop_reason,
            "gateway": delta(before, after),
        })
        convo = convo + [
            {"role": "assistant", "content": final.content[0].text},
            {"role": "user", "content": "Now run the suite."},
        ]
    counted = client.messages.count_tokens(model="sim-model", system=SYSTEM, messages=convo)
    out["count_tokens"] = counted.input_tokens
    # The replica drops the connection after 3 tokens: the SDK must raise
    # (an error event ended the stream), not hang or end quietly.
    try:
        with client.messages.stream(
            model="sim-model", max_tokens=20, messages=convo,
            extra_headers={"x-sim-fault": "drop=3"},
        ) as stream:
            for _ in stream:
                pass
        out["cut_stream"] = "ended quietly"
    except anthropic.APIStatusError as e:
        out["cut_stream"] = type(e).__name__
        out["cut_stream_body"] = e.body
    except anthropic.APIError as e:
        out["cut_stream"] = type(e).__name__
        out["cut_stream_body"] = getattr(e, "body", None)
    # An unknown model: Anthropic's error shape, raised as NotFoundError.
    try:
        client.messages.create(model="no-such-model", max_tokens=5, messages=convo)
    except anthropic.NotFoundError as e:
        out["unknown_model"] = e.body
    return out


def responses(base: str, admin: str, key: str) -> dict:
    import openai

    client = openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=30)
    out = {"requests": []}
    prev = None
    for i in range(4):
        stream = i % 2 == 1
        before = counters(admin, "responses")
        args = dict(
            model="sim-model", instructions=SYSTEM, max_output_tokens=16,
            input=f"Turn {i}: what next?",
        )
        if prev is not None:
            args["previous_response_id"] = prev
        deltas = 0
        errors = 0
        if stream:
            final = None
            for ev in client.responses.create(stream=True, **args):
                if ev.type == "response.output_text.delta" and ev.delta:
                    deltas += 1
                if ev.type in ("response.completed", "response.incomplete"):
                    final = ev.response
                if ev.type == "error":
                    errors += 1
            resp = final
        else:
            resp = client.responses.create(**args)
        after = counters(admin, "responses")
        u = resp.usage
        out["requests"].append({
            "stream": stream,
            "deltas": deltas,
            "errors": errors,
            "id": resp.id,
            "previous": prev,
            "status": resp.status,
            "sdk_prompt": u.input_tokens,
            "sdk_cached": (u.input_tokens_details.cached_tokens
                           if u.input_tokens_details else 0),
            "sdk_output": u.output_tokens,
            "gateway": delta(before, after),
        })
        prev = resp.id
    # The stored response is reachable by id through the gateway.
    got = client.responses.retrieve(prev)
    out["retrieved"] = got.id
    # A stream cut by the replica ends with the protocol's error event.
    events = []
    for ev in client.responses.create(
        stream=True, model="sim-model", input="again", max_output_tokens=20,
        extra_headers={"x-sim-fault": "drop=3"},
    ):
        events.append(ev.type)
    out["cut_stream_events"] = events
    return out


def messages_429(base: str, admin: str, key: str) -> dict:
    import anthropic

    out = {}
    strict = anthropic.Anthropic(base_url=base, api_key=key, max_retries=0, timeout=30)
    refused_at = None
    for _ in range(200):
        try:
            strict.messages.create(
                model="sim-model", max_tokens=1,
                messages=[{"role": "user", "content": "hi"}],
            )
        except anthropic.RateLimitError as e:
            out["error_class"] = type(e).__name__
            out["body"] = e.body
            out["retry_after"] = e.response.headers.get("retry-after")
            out["ratelimit_headers"] = sorted(
                h for h in e.response.headers.keys() if h.startswith("anthropic-ratelimit-")
            )
            refused_at = time.monotonic()
            break
    patient = anthropic.Anthropic(base_url=base, api_key=key, max_retries=4, timeout=30)
    resp = patient.messages.create(
        model="sim-model", max_tokens=1,
        messages=[{"role": "user", "content": "hi again"}],
    )
    out["since_refusal_seconds"] = time.monotonic() - refused_at
    out["retried_ok"] = resp.stop_reason is not None
    return out


def main() -> None:
    mode, base, admin, key = sys.argv[1:5]
    run = {"messages": messages, "responses": responses, "messages_429": messages_429}[mode]
    print(json.dumps(run(base, admin, key), default=str))


if __name__ == "__main__":
    main()
