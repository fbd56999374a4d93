"""The official OpenAI Python SDK against a gateway serving HTTPS with a
certificate from a CA of the test's own (`server.tls`).

Usage: python3 sdk_tls.py BASE_URL CA_FILE  (e.g. https://localhost:8443/v1)
Prints one JSON object with what the SDK saw.
"""

import json
import ssl
import sys

import openai
from openai import DefaultHttpx2Client, OpenAI


def main() -> None:
    base_url, ca_file = sys.argv[1], sys.argv[2]
    # The SDK's own HTTP client, trusting the CA (as an application behind a
    # private CA configures it).
    trusting = DefaultHttpx2Client(verify=ssl.create_default_context(cafile=ca_file), timeout=30)
    client = OpenAI(base_url=base_url, api_key="sk-test", max_retries=0, http_client=trusting)
    out = {}
    resp = client.chat.completions.create(
        model="sim-model",
        messages=[{"role": "user", "content": "Say something."}],
    )
    out["chat"] = {
        "finish_reason": resp.choices[0].finish_reason,
        "completion_tokens": resp.usage.completion_tokens,
    }
    pieces = 0
    finish = None
    for chunk in client.chat.completions.create(
        model="sim-model",
        messages=[{"role": "user", "content": "Stream something."}],
        stream=True,
    ):
        if chunk.choices and chunk.choices[0].delta.content:
            pieces += 1
        if chunk.choices and chunk.choices[0].finish_reason:
            finish = chunk.choices[0].finish_reason
    out["stream"] = {"pieces": pieces, "finish_reason": finish}
    # A client that does not trust the CA (the system's store only) is refused.
    plain = OpenAI(base_url=base_url, api_key="sk-test", max_retries=0, timeout=10)
    try:
        plain.models.list()
        out["untrusted"] = "served"
    except openai.APIConnectionError as e:
        cause = e.__cause__
        out["untrusted"] = type(e).__name__
        out["untrusted_cause"] = repr(cause)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
