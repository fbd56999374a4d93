#!/usr/bin/env python3
"""Generate the Messages and Responses stream corpus (tests/corpus/PROTOCOLS.md).

    python3 tests/corpus/gen_protocol_streams.py

Rewrites tests/corpus/messages/ and tests/corpus/responses/ from scratch,
deterministically (fixed seed). Each NNN-name.sse is a stream as a server
sends it; NNN-name.json is what a reader must make of it, computed by the
reference reader below from the bytes (not from how they were built), and
checked against what the builder intended.
"""

import json
import os
import random
import shutil

ROOT = os.path.dirname(os.path.abspath(__file__))
rng = random.Random(20261124)
WORDS = ["the", " model", " token", " cache", " é", " 漢字", ' "q"', "\\n", " \u2028", " x"]


def sse(name, data, crlf=False, nospace=False, split=False, noevent=False):
    """One event's bytes."""
    nl = "\r\n" if crlf else "\n"
    body = json.dumps(data, ensure_ascii=False)
    prefix = "data:" if nospace else "data: "
    if split and len(body) > 20:
        # Two data lines: SSE joins them with \n, which JSON tolerates as whitespace
        # only between tokens, so cut after a comma between members.
        cut = body.find(", ")
        if cut > 0:
            lines = prefix + body[: cut + 1] + nl + prefix + body[cut + 2:]
        else:
            lines = prefix + body
    else:
        lines = prefix + body
    head = "" if noevent else f"event: {name}{nl}"
    return (head + lines + nl + nl).encode()


# ---------------------------------------------------------------- reference reader

def events_of(raw: bytes):
    """Complete events' data payloads (joined), and whether bytes were left over."""
    text = raw.decode("utf-8")
    norm = text.replace("\r\n", "\n")
    parts = norm.split("\n\n")
    complete, rest = parts[:-1], parts[-1]
    out = []
    for ev in complete:
        datas = []
        for line in ev.split("\n"):
            if line.startswith("data:"):
                v = line[5:]
                datas.append(v[1:] if v.startswith(" ") else v)
        if datas:
            out.append("\n".join(datas))
    return out, rest != ""


def non_empty(v):
    return v is not None and v not in ("", [], {})


def read_messages(raw: bytes):
    payloads, leftover = events_of(raw)
    usage, seen_usage = {}, False
    outputs, finish, outcome = 0, None, None
    stop_map = {"end_turn": "stop", "stop_sequence": "stop", "max_tokens": "length",
                "tool_use": "tool_calls", "refusal": "content_filter"}
    for p in payloads:
        e = json.loads(p)
        t = e.get("type")
        if t == "message_start":
            u = (e.get("message") or {}).get("usage")
            if u is not None:
                seen_usage = True
                usage.update({k: v for k, v in u.items() if v is not None})
        elif t == "content_block_delta":
            d = e.get("delta") or {}
            if any(non_empty(d.get(k)) for k in ("text", "thinking", "partial_json")):
                outputs += 1
        elif t == "message_delta":
            u = e.get("usage")
            if u is not None:
                seen_usage = True
                usage.update({k: v for k, v in u.items() if v is not None})
            sr = (e.get("delta") or {}).get("stop_reason")
            if sr is not None:
                finish = stop_map.get(sr, "other")
        elif t == "message_stop":
            outcome = outcome or "complete"
        elif t == "error":
            outcome = "failed"
    if outcome is None:
        outcome = "truncated"
    u = None
    if seen_usage:
        g = lambda k: usage.get(k) or 0
        u = {"prompt_tokens": g("input_tokens") + g("cache_read_input_tokens")
             + g("cache_creation_input_tokens"),
             "completion_tokens": g("output_tokens"),
             "cached_tokens": usage.get("cache_read_input_tokens")}
    if outcome == "complete" and leftover:
        outcome = "complete"
    return {"usage": u, "output_events": outputs, "finish_reason": finish,
            "outcome": outcome, "response_id": None}


def read_responses(raw: bytes):
    payloads, _ = events_of(raw)
    outputs, finish, outcome, usage, rid, tool = 0, None, None, None, None, False
    for p in payloads:
        e = json.loads(p)
        t = e.get("type", "")
        if t.endswith(".delta") and isinstance(e.get("delta"), str) and e["delta"] != "":
            outputs += 1
        if t.startswith("response.function_call_arguments."):
            tool = True
        r = e.get("response")
        if t == "response.created" and r and rid is None:
            rid = r.get("id")
        if t in ("response.completed", "response.incomplete", "response.failed"):
            if rid is None and r:
                rid = r.get("id")
            u = (r or {}).get("usage")
            usage = None if u is None else {
                "prompt_tokens": u.get("input_tokens") or 0,
                "completion_tokens": u.get("output_tokens") or 0,
                "cached_tokens": (u.get("input_tokens_details") or {}).get("cached_tokens"),
            }
            if t == "response.completed":
                finish, outcome = ("tool_calls" if tool else "stop"), outcome or "complete"
            elif t == "response.incomplete":
                why = ((r or {}).get("incomplete_details") or {}).get("reason")
                finish = {"max_output_tokens": "length", "content_filter": "content_filter"}.get(why, "other")
                outcome = outcome or "complete"
            else:
                outcome = "failed"
        if t == "error":
            outcome = "failed"
    return {"usage": usage, "output_events": outputs, "finish_reason": finish,
            "outcome": outcome or "truncated", "response_id": rid}


# ---------------------------------------------------------------- builders

def words(n):
    return [rng.choice(WORDS) for _ in range(n)]


def messages_stream(v):
    """Events of one Messages stream, and what they should read as."""
    ev = []
    cached = v.get("cached", 0)
    inp = v.get("input", 100)
    start_usage = {"input_tokens": inp, "output_tokens": 1}
    if v.get("cache_fields", True):
        start_usage["cache_read_input_tokens"] = cached
        start_usage["cache_creation_input_tokens"] = v.get("creation", 0)
    msg = {"id": f"msg_{rng.getrandbits(64):016x}", "type": "message", "role": "assistant",
           "model": "claude-like", "content": [], "stop_reason": None, "stop_sequence": None,
           "usage": start_usage}
    if not v.get("no_start_usage"):
        ev.append(("message_start", {"type": "message_start", "message": msg}))
    else:
        m = dict(msg)
        m.pop("usage")
        ev.append(("message_start", {"type": "message_start", "message": m}))
    outputs = 0
    index = 0
    if v.get("thinking"):
        ev.append(("content_block_start", {"type": "content_block_start", "index": index,
                                           "content_block": {"type": "thinking", "thinking": ""}}))
        for w in words(v["thinking"]):
            ev.append(("content_block_delta", {"type": "content_block_delta", "index": index,
                                               "delta": {"type": "thinking_delta", "thinking": w}}))
            outputs += 1
        ev.append(("content_block_delta", {"type": "content_block_delta", "index": index,
                                           "delta": {"type": "signature_delta", "signature": "c2ln"}}))
        ev.append(("content_block_stop", {"type": "content_block_stop", "index": index}))
        index += 1
    ev.append(("content_block_start", {"type": "content_block_start", "index": index,
                                       "content_block": {"type": "text", "text": ""}}))
    if v.get("ping"):
        ev.append(("ping", {"type": "ping"}))
    n = v.get("text", 5)
    for i, w in enumerate(words(n)):
        if v.get("empty_every") and i % v["empty_every"] == 0:
            ev.append(("content_block_delta", {"type": "content_block_delta", "index": index,
                                               "delta": {"type": "text_delta", "text": ""}}))
        if v.get("huge") and i == 0:
            w = "y" * 100_000
        ev.append(("content_block_delta", {"type": "content_block_delta", "index": index,
                                           "delta": {"type": "text_delta", "text": w}}))
        outputs += 1
        if v.get("ping") and i % 7 == 3:
            ev.append(("ping", {"type": "ping"}))
        if v.get("error_after") == i:
            ev.append(("error", {"type": "error", "error": {"type": v.get("error_type", "overloaded_error"),
                                                            "message": "Overloaded"}}))
            return ev, outputs
    ev.append(("content_block_stop", {"type": "content_block_stop", "index": index}))
    for t in range(v.get("tools", 0)):
        index += 1
        ev.append(("content_block_start", {"type": "content_block_start", "index": index,
                                           "content_block": {"type": "tool_use", "id": f"toolu_{t}",
                                                             "name": "run", "input": {}}}))
        for piece in ["", '{"cmd": ', '"ls -la"', "}"]:
            ev.append(("content_block_delta", {"type": "content_block_delta", "index": index,
                                               "delta": {"type": "input_json_delta", "partial_json": piece}}))
            outputs += piece != ""
        ev.append(("content_block_stop", {"type": "content_block_stop", "index": index}))
    if v.get("unknown"):
        ev.append(("future_event", {"type": "future_event", "x": 1}))
    delta_usage = {"output_tokens": v.get("output", n)}
    if v.get("delta_input") is not None:
        delta_usage["input_tokens"] = v["delta_input"]
        delta_usage["cache_read_input_tokens"] = v.get("delta_cached", cached)
    ev.append(("message_delta", {"type": "message_delta",
                                 "delta": {"stop_reason": v.get("stop", "end_turn"), "stop_sequence": None},
                                 "usage": delta_usage}))
    ev.append(("message_stop", {"type": "message_stop"}))
    return ev, outputs


def responses_stream(v):
    ev = []
    seq = [0]

    def add(t, data):
        data = dict(data)
        data["type"] = t
        data["sequence_number"] = seq[0]
        seq[0] += 1
        ev.append((t, data))

    rid = f"resp_{rng.getrandbits(64):016x}"
    base = {"id": rid, "object": "response", "created_at": 1795000000, "model": "m",
            "status": "in_progress", "output": [], "usage": None}
    if not v.get("no_created"):
        add("response.created", {"response": base})
        add("response.in_progress", {"response": base})
    outputs = 0
    if v.get("reasoning"):
        add("response.output_item.added", {"output_index": 0, "item": {"type": "reasoning", "id": "rs_1"}})
        kind = v.get("reasoning_kind", "response.reasoning_summary_text.delta")
        for w in words(v["reasoning"]):
            add(kind, {"item_id": "rs_1", "output_index": 0, "delta": w})
            outputs += 1
    add("response.output_item.added", {"output_index": 1, "item": {"type": "message", "id": "msg_1",
                                                                  "role": "assistant", "content": []}})
    n = v.get("text", 5)
    delta_kind = "response.refusal.delta" if v.get("refusal") else "response.output_text.delta"
    text = ""
    for i, w in enumerate(words(n)):
        if v.get("empty_every") and i % v["empty_every"] == 0:
            add(delta_kind, {"item_id": "msg_1", "output_index": 1, "content_index": 0, "delta": ""})
        if v.get("huge") and i == 0:
            w = "z" * 100_000
        add(delta_kind, {"item_id": "msg_1", "output_index": 1, "content_index": 0, "delta": w,
                         "logprobs": []})
        text += w
        outputs += 1
        if v.get("keepalive") and i % 5 == 0:
            ev.append((None, None))
        if v.get("error_after") == i:
            add("error", {"code": "server_error", "message": "boom", "param": None})
            return ev, outputs, rid
    add("response.output_text.done", {"item_id": "msg_1", "output_index": 1, "content_index": 0, "text": text})
    for t in range(v.get("tools", 0)):
        add("response.output_item.added", {"output_index": 2 + t, "item": {"type": "function_call",
                                                                           "id": f"fc_{t}", "name": "run"}})
        for piece in ['{"cmd":', ' "ls"', "}"]:
            add("response.function_call_arguments.delta", {"item_id": f"fc_{t}", "output_index": 2 + t,
                                                           "delta": piece})
            outputs += 1
        add("response.function_call_arguments.done", {"item_id": f"fc_{t}", "output_index": 2 + t,
                                                      "arguments": '{"cmd": "ls"}'})
    if v.get("unknown"):
        add("response.future_thing", {"x": 1})
    usage = None if v.get("no_usage") else {
        "input_tokens": v.get("input", 100),
        "input_tokens_details": {"cached_tokens": v.get("cached", 0)} if not v.get("no_details") else None,
        "output_tokens": v.get("output", n),
        "output_tokens_details": {"reasoning_tokens": v.get("reasoning", 0)},
        "total_tokens": v.get("input", 100) + v.get("output", n),
    }
    if usage and usage["input_tokens_details"] is None:
        del usage["input_tokens_details"]
    end = v.get("end", "completed")
    final = dict(base, status=end, usage=usage, output=[{"type": "message", "id": "msg_1"}])
    if end == "incomplete":
        final["incomplete_details"] = {"reason": v.get("why", "max_output_tokens")}
        add("response.incomplete", {"response": final})
    elif end == "failed":
        final["error"] = {"code": "server_error", "message": "engine died"}
        add("response.failed", {"response": final})
    else:
        add("response.completed", {"response": final})
    return ev, outputs, rid


def render(ev, v):
    out = b""
    for i, (name, data) in enumerate(ev):
        if name is None:
            out += b": keep-alive\n\n"
            continue
        if v.get("comments") and i % 4 == 0:
            out += b": ping\n\n"
        out += sse(name, data, crlf=v.get("crlf", False), nospace=v.get("nospace", False),
                   split=v.get("split", False) and i % 3 == 1,
                   noevent=v.get("noevent", False) and i % 2 == 0)
    return out


def cut(raw: bytes, v):
    """Truncate: after `events` whole events, or in the middle of one."""
    if "cut_events" in v:
        sep = b"\r\n\r\n" if v.get("crlf") else b"\n\n"
        pos, k = 0, 0
        while k < v["cut_events"]:
            nxt = raw.find(sep, pos)
            if nxt < 0:
                break
            pos = nxt + len(sep)
            k += 1
        raw = raw[:pos]
        if v.get("mid_event"):
            nxt = raw  # keep, then add half of the next event below
    return raw


def variants_messages():
    vs = []
    for n in (1, 2, 5, 40, 300):
        vs.append({"name": f"text-{n}", "text": n})
    vs += [
        {"name": "cached-most", "text": 8, "input": 12, "cached": 2980},
        {"name": "cached-some", "text": 8, "input": 1500, "cached": 1500, "creation": 64},
        {"name": "no-cache-fields", "text": 6, "cache_fields": False},
        {"name": "thinking-then-text", "thinking": 12, "text": 9},
        {"name": "thinking-only-long", "thinking": 120, "text": 1},
        {"name": "tool-use", "text": 3, "tools": 1, "stop": "tool_use"},
        {"name": "parallel-tools", "text": 2, "tools": 3, "stop": "tool_use"},
        {"name": "max-tokens", "text": 16, "stop": "max_tokens"},
        {"name": "stop-sequence", "text": 4, "stop": "stop_sequence"},
        {"name": "refusal", "text": 3, "stop": "refusal"},
        {"name": "pause-turn", "text": 3, "stop": "pause_turn"},
        {"name": "pings-everywhere", "text": 30, "ping": True},
        {"name": "empty-deltas", "text": 10, "empty_every": 2},
        {"name": "usage-updated-in-delta", "text": 7, "delta_input": 4000, "delta_cached": 3500},
        {"name": "usage-input-only-in-delta", "text": 7, "no_start_usage": True, "delta_input": 90},
        {"name": "huge-counts", "text": 3, "input": 1_500_000, "cached": 400_000, "output": 2_000_000},
        {"name": "error-overloaded", "text": 6, "error_after": 3},
        {"name": "error-api-first", "text": 6, "error_after": 0, "error_type": "api_error"},
        {"name": "crlf", "text": 9, "crlf": True},
        {"name": "data-no-space", "text": 9, "nospace": True},
        {"name": "multi-line-data", "text": 9, "split": True},
        {"name": "no-event-lines", "text": 9, "noevent": True},
        {"name": "comments", "text": 9, "comments": True},
        {"name": "unknown-event", "text": 5, "unknown": True},
        {"name": "huge-delta", "text": 3, "huge": True},
        {"name": "crlf-thinking-tools", "crlf": True, "thinking": 4, "text": 4, "tools": 2, "stop": "tool_use"},
    ]
    for k in (1, 2, 4, 7):
        vs.append({"name": f"truncated-after-{k}", "text": 10, "cut_events": k})
    vs.append({"name": "truncated-before-stop", "text": 10, "cut_events": 14})
    for k in (3, 6):
        vs.append({"name": f"truncated-mid-event-{k}", "text": 10, "cut_events": k, "mid_event": True})
    while len(vs) < 64:
        i = len(vs)
        vs.append({"name": f"mixed-{i}", "text": rng.randint(1, 60), "thinking": rng.choice([0, 0, 5]),
                   "tools": rng.choice([0, 0, 1, 2]), "ping": rng.random() < 0.5,
                   "crlf": rng.random() < 0.3, "input": rng.randint(1, 9000),
                   "cached": rng.randint(0, 9000), "empty_every": rng.choice([0, 3]),
                   "stop": rng.choice(["end_turn", "max_tokens", "tool_use", "stop_sequence"])})
    return vs


def variants_responses():
    vs = []
    for n in (1, 2, 5, 40, 300):
        vs.append({"name": f"text-{n}", "text": n})
    vs += [
        {"name": "cached", "text": 8, "input": 3000, "cached": 2944},
        {"name": "no-details", "text": 8, "no_details": True},
        {"name": "reasoning-summary", "reasoning": 10, "text": 6},
        {"name": "reasoning-text", "reasoning": 10, "reasoning_kind": "response.reasoning_text.delta", "text": 4},
        {"name": "function-call", "text": 2, "tools": 1},
        {"name": "parallel-calls", "text": 1, "tools": 3},
        {"name": "incomplete-max-output", "text": 16, "end": "incomplete"},
        {"name": "incomplete-content-filter", "text": 4, "end": "incomplete", "why": "content_filter"},
        {"name": "incomplete-other", "text": 4, "end": "incomplete", "why": "something_new"},
        {"name": "failed", "text": 4, "end": "failed"},
        {"name": "failed-no-usage", "text": 4, "end": "failed", "no_usage": True},
        {"name": "no-usage", "text": 5, "no_usage": True},
        {"name": "refusal", "text": 5, "refusal": True},
        {"name": "error-event", "text": 8, "error_after": 4},
        {"name": "error-event-first", "text": 8, "error_after": 0},
        {"name": "empty-deltas", "text": 10, "empty_every": 3},
        {"name": "keepalives", "text": 20, "keepalive": True},
        {"name": "huge-counts", "text": 3, "input": 1_999_999, "cached": 1_000_000, "output": 2_000_000},
        {"name": "crlf", "text": 9, "crlf": True},
        {"name": "data-no-space", "text": 9, "nospace": True},
        {"name": "multi-line-data", "text": 9, "split": True},
        {"name": "no-event-lines", "text": 9, "noevent": True},
        {"name": "comments", "text": 9, "comments": True},
        {"name": "unknown-event", "text": 5, "unknown": True},
        {"name": "huge-delta", "text": 3, "huge": True},
        {"name": "no-created-event", "text": 4, "no_created": True},
    ]
    for k in (1, 2, 4, 9):
        vs.append({"name": f"truncated-after-{k}", "text": 10, "cut_events": k})
    vs.append({"name": "truncated-before-completed", "text": 10, "cut_events": 14})
    for k in (3, 8):
        vs.append({"name": f"truncated-mid-event-{k}", "text": 10, "cut_events": k, "mid_event": True})
    while len(vs) < 64:
        i = len(vs)
        vs.append({"name": f"mixed-{i}", "text": rng.randint(1, 60), "reasoning": rng.choice([0, 0, 6]),
                   "tools": rng.choice([0, 0, 1, 2]), "crlf": rng.random() < 0.3,
                   "keepalive": rng.random() < 0.3, "input": rng.randint(1, 9000),
                   "cached": rng.randint(0, 9000), "empty_every": rng.choice([0, 4]),
                   "end": rng.choice(["completed", "completed", "incomplete"])})
    return vs


def write(dirname, variants, build, read):
    d = os.path.join(ROOT, dirname)
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    for i, v in enumerate(variants):
        built = build(v)
        ev, outputs = built[0], built[1]
        raw = render(ev, v)
        full = raw
        raw = cut(raw, v)
        if v.get("mid_event"):
            rest = full[len(raw):]
            nxt = rest.find(b"\n\n")
            raw += rest[: max(1, nxt // 2)]
        want = read(raw)
        # The builder's intent, where it is unambiguous.
        if "cut_events" not in v:
            assert want["output_events"] == outputs, (v, want, outputs)
            if v.get("error_after") is not None or v.get("end") == "failed":
                assert want["outcome"] == "failed", (v, want)
            else:
                assert want["outcome"] == "complete", (v, want)
        else:
            assert want["outcome"] == "truncated", (v, want)
        if dirname == "responses" and "cut_events" not in v and not v.get("no_created"):
            assert want["response_id"] == built[2], (v, want)
        want = {"protocol": dirname, "description": v["name"], **want}
        base = os.path.join(d, f"{i:03d}-{v['name']}")
        with open(base + ".sse", "wb") as f:
            f.write(raw)
        with open(base + ".json", "w") as f:
            json.dump(want, f, indent=1, ensure_ascii=False)
            f.write("\n")
    return len(variants)


def main():
    n = write("messages", variants_messages(), messages_stream, read_messages)
    m = write("responses", variants_responses(), lambda v: responses_stream(v), read_responses)
    print(f"messages: {n} streams, responses: {m} streams")


if __name__ == "__main__":
    main()
