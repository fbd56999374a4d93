"""Drive a running Sluice gateway with the official OpenAI Python SDK.

Usage: python3 sdk_e2e.py BASE_URL  (e.g. http://127.0.0.1:8080/v1)
Prints one JSON object with what the SDK saw; exits non-zero on any surprise.
"""

import json
import sys

import openai
from openai import OpenAI


def main() -> None:
    base_url = sys.argv[1]
    client = OpenAI(base_url=base_url, api_key="sk-test", max_retries=0, timeout=30)
    out = {"sdk_version": openai.__version__}

    models = [m.id for m in client.models.list()]
    out["models"] = models

    resp = client.chat.completions.create(
        model="sim-model",
        messages=[{"role": "user", "content": "Say something."}],
    )
    out["chat"] = {
        "content": resp.choices[0].message.content,
        "finish_reason": resp.choices[0].finish_reason,
        "completion_tokens": resp.usage.completion_tokens,
    }

    pieces, finish, usage_chunks = [], None, 0
    for chunk in client.chat.completions.create(
        model="sim-model",
        messages=[{"role": "user", "content": "Stream something."}],
        stream=True,
    ):
        if chunk.usage is not None:
            usage_chunks += 1
        for c in chunk.choices:
            if c.delta.content:
                pieces.append(c.delta.content)
            if c.finish_reason:
                finish = c.finish_reason
    out["stream"] = {"pieces": len(pieces), "finish_reason": finish, "usage_chunks": usage_chunks}

    usage = None
    for chunk in client.chat.completions.create(
        model="sim-model",
        messages=[{"role": "user", "content": "Stream with usage."}],
        stream=True,
        stream_options={"include_usage": True},
    ):
        if chunk.usage is not None:
            usage = chunk.usage.completion_tokens
    out["stream_usage"] = usage

    comp = client.completions.create(model="sim-model", prompt="Once upon a time", max_tokens=3)
    out["completion"] = {"finish_reason": comp.choices[0].finish_reason, "tokens": comp.usage.completion_tokens}

    emb = client.embeddings.create(model="sim-model", input=["a", "b", "c"])
    out["embeddings"] = len(emb.data)

    try:
        client.chat.completions.create(model="no-such-model", messages=[])
        out["not_found"] = "no error"
    except openai.NotFoundError as e:
        out["not_found"] = e.code

    try:
        for _ in client.chat.completions.create(
            model="sim-model",
            messages=[{"role": "user", "content": "break"}],
            stream=True,
            extra_headers={"x-sim-fault": "drop=2"},
        ):
            pass
        out["mid_stream"] = "no error"
    except openai.APIError as e:
        out["mid_stream"] = type(e).__name__

    print(json.dumps(out))


if __name__ == "__main__":
    main()
