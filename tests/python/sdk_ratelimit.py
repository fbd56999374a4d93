"""The OpenAI Python SDK against a rate-limited Sluice tier.

Usage: python3 sdk_ratelimit.py BASE_URL API_KEY
Exhausts the key's requests-per-minute bucket, checks that the SDK raises
RateLimitError with OpenAI's error body, then that a client allowed to retry
waits the stated time and succeeds. Prints one JSON object.
"""

import json
import sys
import time

import openai
from openai import OpenAI


def main() -> None:
    base_url, key = sys.argv[1], sys.argv[2]
    out = {}
    strict = OpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=30)
    for _ in range(200):
        try:
            strict.chat.completions.create(
                model="sim-model", max_tokens=1,
                messages=[{"role": "user", "content": "hi"}],
            )
        except openai.RateLimitError as e:
            out["error_class"] = type(e).__name__
            body = e.body or {}
            out["error_type"] = body.get("type")
            out["error_code"] = body.get("code")
            out["retry_after_ms"] = float(e.response.headers.get("retry-after-ms"))
            refused_at = time.monotonic()
            break
    patient = OpenAI(base_url=base_url, api_key=key, max_retries=3, timeout=30)
    start = time.monotonic()
    resp = patient.chat.completions.create(
        model="sim-model", max_tokens=1,
        messages=[{"role": "user", "content": "hi again"}],
    )
    out["retry_seconds"] = time.monotonic() - start
    # The next slot opened retry_after_ms after the refusal: no success before.
    out["since_refusal_seconds"] = time.monotonic() - refused_at
    out["retried_ok"] = resp.choices[0].finish_reason is not None
    print(json.dumps(out))


if __name__ == "__main__":
    main()
