#!/usr/bin/env python3
"""A second engine model, written apart from `sluice sim` on purpose.

A fleet decision tuned on one simulator may only hold on that simulator. This is
an independently written model of a continuous-batching engine with a prefix
cache, serving the same API and the same vLLM metric names, so that the routing
and flow-control benchmarks can be run on fleets they were not tuned on. It
shares no code with `src/sim/` and makes its own choices where engines differ:

- Tokens: every 4 bytes of the prompt's UTF-8 text is a token (sluice sim counts
  characters and adds per-message overhead), and the chat prompt is the messages'
  contents joined by newlines.
- Scheduling (vLLM V1-like): each step first gives every running sequence its
  next chunk (the rest of its prompt, or one decode token) out of a token budget,
  then admits waiting requests in arrival order while seats, budget and KV blocks
  last. A prompt is admitted only if the KV blocks of its whole prompt are free
  (cached blocks are reused, free cached blocks evicted least recently used
  first); prefill is chunked across steps. A prompt block becomes findable by
  later prompts once the step computing it ends (`--cache-at compute`, as
  SGLang's radix tree inserts after the forward pass), or as soon as that step
  is scheduled (`--cache-at schedule`, as vLLM V1 caches full blocks when it
  allocates them: a prompt admitted in the same step, or while a long prompt's
  chunks are in flight, shares them).
- KV: fixed blocks; a running sequence grows block by block; when none is free
  the most recently admitted sequence is preempted (its blocks freed, back to the
  head of the queue: recomputed later). Usage counts blocks held by sequences.
- Time: a step lasts `base + per_seq x running + per_token x prefill tokens`;
  every sequence that finished its prompt emits one token per step.
- Answers are streamed token by token as SSE chunks, with usage (and
  `prompt_tokens_details.cached_tokens`) in the last chunk when asked, or whole.

    python3 benches/e2e/engine_b.py --port 8001 --num-blocks 1024 --max-seqs 64

Serves /v1/models, /health, /metrics, POST /v1/chat/completions and
/v1/completions on 127.0.0.1 only. Standard library only.
"""

import argparse
import asyncio
import collections
import hashlib
import json
import time
import uuid


class Seq:
    def __init__(self, tokens, max_tokens, stream_q):
        self.tokens = tokens            # prompt token list (strings)
        self.max_tokens = max_tokens
        self.q = stream_q               # asyncio.Queue of events for the HTTP side
        self.blocks = []                # block ids held
        self.hashes = []                # hash of each full prompt block
        self.done_tokens = 0            # prompt tokens whose KV is computed
        self.generated = 0
        self.cached = 0                 # prompt tokens found cached at admission
        self.arrived = time.monotonic()
        self.cancelled = False

    def need(self):
        return len(self.tokens) + self.generated


class Engine:
    def __init__(self, a):
        self.a = a
        self.free = collections.OrderedDict((i, None) for i in range(a.num_blocks))  # free, uncached
        self.cached_free = collections.OrderedDict()   # hash -> block (free, holds a prefix)
        self.by_hash = {}                              # hash -> block (any state)
        self.refs = collections.Counter()              # block -> holders
        self.waiting = collections.deque()
        self.running = []
        self.wake = asyncio.Event()
        self.m = collections.Counter()

    # -- blocks ---------------------------------------------------------------
    def take_block(self):
        if self.free:
            b, _ = self.free.popitem(last=False)
            return b
        if self.cached_free:
            h, b = self.cached_free.popitem(last=False)
            del self.by_hash[h]
            return b
        return None

    def release(self, seq):
        for i, b in enumerate(seq.blocks):
            self.refs[b] -= 1
            if self.refs[b] > 0:
                continue
            del self.refs[b]
            h = seq.hashes[i] if i < len(seq.hashes) and self.by_hash.get(seq.hashes[i]) == b else None
            if h is not None:
                self.cached_free[h] = b
            else:
                self.free[b] = None
        seq.blocks = []

    def used_blocks(self):
        return self.a.num_blocks - len(self.free) - len(self.cached_free)

    def admit(self, seq):
        bs = self.a.block_size
        full = len(seq.tokens) // bs
        hashes, h = [], hashlib.blake2b(digest_size=8)
        for i in range(full):
            h.update("".join(seq.tokens[i * bs:(i + 1) * bs]).encode())
            hashes.append(h.copy().hexdigest())
        hits = []
        for hh in hashes:
            b = self.by_hash.get(hh)
            if b is None:
                break
            hits.append((hh, b))
        # Keep one token to compute, as engines do.
        if hits and len(hits) * bs >= len(seq.tokens):
            hits.pop()
        need = -(-(len(seq.tokens) + 1) // bs) - len(hits)
        avail = len(self.free) + len(self.cached_free) - sum(1 for hh, _ in hits if hh in self.cached_free)
        if need > avail:
            return False
        for hh, b in hits:
            if hh in self.cached_free:
                del self.cached_free[hh]
            self.refs[b] += 1
            seq.blocks.append(b)
        seq.hashes = hashes
        seq.cached = seq.done_tokens = len(hits) * bs
        self.m["queries"] += len(seq.tokens)
        self.m["hits"] += seq.cached
        for _ in range(need):
            b = self.take_block()
            self.refs[b] += 1
            seq.blocks.append(b)
        return True

    def grow(self, seq, upto):
        """Blocks for `upto` tokens; False if none is left."""
        while len(seq.blocks) * self.a.block_size < upto:
            b = self.take_block()
            if b is None:
                return False
            self.refs[b] += 1
            seq.blocks.append(b)
        return True

    def register(self, seq, upto):
        """Prompt blocks full within `upto` tokens become findable by later prompts."""
        bs = self.a.block_size
        for i in range(min(upto // bs, len(seq.hashes))):
            hh = seq.hashes[i]
            if hh not in self.by_hash:
                self.by_hash[hh] = seq.blocks[i]

    # -- the loop ---------------------------------------------------------------
    async def run(self):
        a = self.a
        while True:
            if not self.running and not self.waiting:
                self.wake.clear()
                await self.wake.wait()
            budget = a.max_batched_tokens
            prefill = 0
            for s in [s for s in self.running if s.cancelled]:
                self.running.remove(s)
                self.release(s)
            step = []
            for s in list(self.running):
                if s not in self.running:
                    continue
                decoding = s.done_tokens >= len(s.tokens)
                want = 1 if decoding else min(len(s.tokens) - s.done_tokens, budget)
                if want <= 0 or budget <= 0:
                    continue
                upto = len(s.tokens) + s.generated + 1 if decoding else s.done_tokens + want
                while not self.grow(s, upto):
                    # Out of blocks: the latest admitted is preempted and will
                    # recompute its prompt when admitted again.
                    victim = self.running[-1]
                    self.running.remove(victim)
                    self.release(victim)
                    victim.done_tokens = 0
                    self.waiting.appendleft(victim)
                    self.m["preemptions"] += 1
                    if victim is s:
                        break
                if s not in self.running:
                    continue
                budget -= want
                if s.done_tokens < len(s.tokens):
                    prefill += want
                    if a.cache_at == "schedule":
                        self.register(s, s.done_tokens + want)
                step.append((s, want))
            while self.waiting and len(self.running) < a.max_seqs and budget > 0:
                s = self.waiting[0]
                if s.cancelled:
                    self.waiting.popleft()
                    continue
                if not s.blocks and not self.admit(s):
                    break
                self.waiting.popleft()
                self.running.append(s)
                want = min(len(s.tokens) - s.done_tokens, budget)
                budget -= want
                prefill += want
                if a.cache_at == "schedule":
                    self.register(s, s.done_tokens + want)
                step.append((s, want))
            if not step:
                await asyncio.sleep(a.step_base)
                continue
            await asyncio.sleep(a.step_base + a.per_seq * len(self.running) + a.per_token * prefill)
            for s, want in step:
                if s not in self.running:
                    continue
                if s.done_tokens < len(s.tokens):
                    s.done_tokens += want
                    self.register(s, s.done_tokens)
                    if s.done_tokens < len(s.tokens):
                        continue
                s.generated += 1
                s.q.put_nowait(("token", s.generated))
                if s.generated >= s.max_tokens:
                    self.running.remove(s)
                    self.release(s)
                    self.m["success"] += 1
                    s.q.put_nowait(("done", s))

    def submit(self, seq):
        self.waiting.append(seq)
        self.wake.set()

    def metrics(self, model):
        lab = f'model_name="{model}"'
        used = self.used_blocks() / self.a.num_blocks
        return "".join([
            f"vllm:num_requests_running{{{lab}}} {len(self.running)}\n",
            f"vllm:num_requests_waiting{{{lab}}} {len(self.waiting)}\n",
            f"vllm:kv_cache_usage_perc{{{lab}}} {used:.4f}\n",
            f"vllm:prefix_cache_queries_total{{{lab}}} {self.m['queries']}\n",
            f"vllm:prefix_cache_hits_total{{{lab}}} {self.m['hits']}\n",
            f"vllm:num_preemptions_total{{{lab}}} {self.m['preemptions']}\n",
            f"vllm:request_success_total{{{lab},finished_reason=\"length\"}} {self.m['success']}\n",
            f"vllm:cache_config_info{{block_size=\"{self.a.block_size}\","
            f"num_gpu_blocks=\"{self.a.num_blocks}\"}} 1\n",
        ])


def tokens_of(text):
    raw = text.encode()
    return [raw[i:i + 4].decode("utf-8", "replace") for i in range(0, len(raw), 4)] or [""]


async def handle(reader, writer, eng, a):
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            method, path, _ = lines[0].split(" ", 2)
            hdrs = {k.strip().lower(): v.strip() for k, v in
                    (ln.split(":", 1) for ln in lines[1:] if ":" in ln)}
            body = await reader.readexactly(int(hdrs.get("content-length", "0")))
            if method == "GET":
                if path.startswith("/metrics"):
                    out, ctype = eng.metrics(a.model), "text/plain; version=0.0.4"
                elif path.startswith("/v1/models"):
                    out, ctype = json.dumps({"object": "list", "data": [
                        {"id": a.model, "object": "model", "owned_by": "engine-b"}]}), "application/json"
                else:
                    out, ctype = "ok", "text/plain"
                data = out.encode()
                writer.write(f"HTTP/1.1 200 OK\r\ncontent-type: {ctype}\r\ncontent-length: {len(data)}\r\n\r\n".encode() + data)
                await writer.drain()
                continue
            req = json.loads(body or b"{}")
            if "messages" in req:
                text = "\n".join(m.get("content") if isinstance(m.get("content"), str) else json.dumps(m.get("content"))
                                 for m in req["messages"])
            else:
                text = req.get("prompt", "")
            max_tokens = int(req.get("max_tokens") or req.get("max_completion_tokens") or a.output_tokens)
            max_tokens = max(1, min(max_tokens, a.output_tokens))
            q = asyncio.Queue()
            seq = Seq(tokens_of(text), max_tokens, q)
            eng.submit(seq)
            rid = "cmpl-" + uuid.uuid4().hex[:16]
            chat = "messages" in req
            obj = "chat.completion.chunk" if chat else "text_completion"
            try:
                if req.get("stream"):
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
                    include_usage = (req.get("stream_options") or {}).get("include_usage")
                    while True:
                        kind, val = await q.get()
                        if kind == "token":
                            ch = ({"index": 0, "delta": {"content": " tok"}, "finish_reason": None} if chat
                                  else {"index": 0, "text": " tok", "finish_reason": None})
                            ev = {"id": rid, "object": obj, "model": a.model, "choices": [ch]}
                            data = f"data: {json.dumps(ev)}\n\n".encode()
                            writer.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                            await writer.drain()
                            continue
                        s = val
                        ch = ({"index": 0, "delta": {}, "finish_reason": "length"} if chat
                              else {"index": 0, "text": "", "finish_reason": "length"})
                        parts = [{"id": rid, "object": obj, "model": a.model, "choices": [ch]}]
                        if include_usage:
                            parts.append({"id": rid, "object": obj, "model": a.model, "choices": [],
                                          "usage": usage(s)})
                        data = "".join(f"data: {json.dumps(p)}\n\n" for p in parts) + "data: [DONE]\n\n"
                        data = data.encode()
                        writer.write(f"{len(data):x}\r\n".encode() + data + b"\r\n0\r\n\r\n")
                        await writer.drain()
                        break
                else:
                    while True:
                        kind, val = await q.get()
                        if kind == "done":
                            break
                    msg = ({"index": 0, "message": {"role": "assistant", "content": " tok" * val.generated},
                            "finish_reason": "length"} if chat
                           else {"index": 0, "text": " tok" * val.generated, "finish_reason": "length"})
                    out = json.dumps({"id": rid, "object": "chat.completion" if chat else "text_completion",
                                      "model": a.model, "choices": [msg], "usage": usage(val)}).encode()
                    writer.write(f"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {len(out)}\r\n\r\n".encode() + out)
                    await writer.drain()
            except (ConnectionError, asyncio.CancelledError):
                seq.cancelled = True
                raise
    except (asyncio.IncompleteReadError, ConnectionError, ValueError):
        pass
    finally:
        writer.close()


def usage(s):
    return {"prompt_tokens": len(s.tokens), "completion_tokens": s.generated,
            "total_tokens": len(s.tokens) + s.generated,
            "prompt_tokens_details": {"cached_tokens": s.cached}}


async def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--model", default="sim-model")
    ap.add_argument("--num-blocks", type=int, default=1024)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-seqs", type=int, default=64)
    ap.add_argument("--max-batched-tokens", type=int, default=2048)
    ap.add_argument("--step-base-ms", type=float, default=8.0)
    ap.add_argument("--per-seq-ms", type=float, default=0.1)
    ap.add_argument("--per-token-ms", type=float, default=0.1)
    ap.add_argument("--output-tokens", type=int, default=4096)
    ap.add_argument("--cache-at", choices=["compute", "schedule"], default="compute",
                    help="when a prompt block becomes a prefix-cache hit: once computed, "
                         "or once the step computing it is scheduled (vLLM V1)")
    a = ap.parse_args()
    a.step_base, a.per_seq, a.per_token = a.step_base_ms / 1e3, a.per_seq_ms / 1e3, a.per_token_ms / 1e3
    eng = Engine(a)
    asyncio.get_running_loop().create_task(eng.run())
    server = await asyncio.start_server(lambda r, w: handle(r, w, eng, a), "127.0.0.1", a.port,
                                        backlog=1024, limit=1 << 24)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        pass
