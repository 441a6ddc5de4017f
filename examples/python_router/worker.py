#!/usr/bin/env python3
"""A mock inference worker for the router example: an OpenAI-style completions endpoint
over token ids, an LRU prefix cache of 16-token KV blocks, and its KV cache events
published through vLLM's own `ZmqEventPublisher` (vLLM 0.34.0's kv_events.py, taken
unmodified from its wheel by scripts/engines.py), the way a real vLLM worker started
with `--kv-events-config` publishes them.

    python3 worker.py --port 8101 --events 'tcp://*:5601' --capacity-blocks 1500

POST /v1/completions {"prompt": [token ids], "max_tokens": n} answers n generated
tokens and `usage.prompt_tokens_details.cached_tokens`: how much of the prompt was
already in this worker's cache. With --tokenizer (a transformers tokenizer directory),
POST /v1/chat/completions {"messages": [...], "stream": bool} builds the prompt with the
tokenizer's chat template (and the generation prompt), as vLLM's OpenAI server does,
and answers as OpenAI does (server-sent events when streaming; usage in the last chunk
with stream_options.include_usage). POST /reset empties the cache (AllBlocksCleared).
Prints "ready HTTP_URL EVENTS_ENDPOINT REPLAY_ENDPOINT" once serving: with the
defaults (--port 0, --events and --replay 'tcp://*:0') the ports are the ones the system
gave it.
"""

import argparse
import asyncio
import hashlib
import json
import os
import sys
import time
from collections import OrderedDict

from aiohttp import web

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import engines  # noqa: E402  (the engines' real publishers)

BLOCK = 16
RELEASE = "vllm-0.34.0"


def block_hash(parent, tokens):
    """A block's id as the engine would make it: its parent's and its own tokens."""
    h = hashlib.blake2b(digest_size=8)
    h.update((parent or 0).to_bytes(8, "little"))
    for t in tokens:
        h.update(t.to_bytes(4, "little"))
    return int.from_bytes(h.digest(), "little")


class PrefixCache:
    """Blocks by hash, least recently used first. A request touches its blocks from the
    last to the first, so a prompt's tail is evicted before its head (as vLLM frees)."""

    def __init__(self, capacity):
        self.capacity = capacity
        self.blocks = OrderedDict()  # hash -> None

    def hashes(self, tokens):
        out, parent = [], None
        for i in range(len(tokens) // BLOCK):
            parent = block_hash(parent, tokens[i * BLOCK:(i + 1) * BLOCK])
            out.append(parent)
        return out

    def hit(self, hashes):
        n = 0
        for h in hashes:
            if h not in self.blocks:
                break
            n += 1
        return n

    def admit(self, hashes, tokens, events, mod, one_per_event=False):
        """Stores what is missing of `hashes` (evicting the oldest to make room), appends
        the engine's events for it, touches everything."""
        first = self.hit(hashes)
        for h in reversed(hashes[:first]):
            self.blocks.move_to_end(h)
        new = hashes[first:]
        evicted = []
        while self.blocks and len(self.blocks) + len(new) > self.capacity:
            evicted.append(self.blocks.popitem(last=False)[0])
        if evicted:
            events.append(engines.build_event(mod, {
                "type": "BlockRemoved", "block_hashes": evicted, "medium": "GPU", "group_idx": 0}))
        groups = [[i] for i in range(first, len(hashes))] if one_per_event else [list(range(first, len(hashes)))]
        for g in groups:
            if not g:
                continue
            events.append(engines.build_event(mod, {
                "type": "BlockStored",
                "block_hashes": [hashes[i] for i in g],
                "parent_block_hash": hashes[g[0] - 1] if g[0] > 0 else None,
                "token_ids": tokens[g[0] * BLOCK:(g[-1] + 1) * BLOCK],
                "block_size": BLOCK, "lora_id": None, "medium": "GPU", "lora_name": None,
                "group_idx": 0, "kv_cache_spec_kind": "full_attention",
            }))
        for h in reversed(hashes[first:]):
            self.blocks[h] = None
        return first


def generated(prompt, n):
    """The tokens this mock 'generates': deterministic in the prompt."""
    seed = block_hash(len(prompt), prompt[-BLOCK:])
    return [(seed >> (i % 48) ^ (i * 2654435761)) % 50_000 for i in range(n)]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--port", type=int, default=0, help="HTTP port (0: any free port)")
    ap.add_argument("--events", default="tcp://*:0",
                    help="ZMQ PUB endpoint of the KV events: tcp://*:PORT binds (vLLM's way); "
                         "port 0 binds any free port on VLLM_HOST_IP (default 127.0.0.1)")
    ap.add_argument("--replay", default="tcp://*:0",
                    help="ZMQ ROUTER replay endpoint: kvix asks it for what it missed (batches "
                         "published before it subscribed, or while it was away); '' for none")
    ap.add_argument("--capacity-blocks", type=int, default=1500)
    ap.add_argument("--name", default="worker")
    ap.add_argument("--tokenizer", default=None,
                    help="a transformers tokenizer directory: serves /v1/chat/completions")
    a = ap.parse_args()

    mod = engines.load_real(RELEASE)
    pub = mod.ZmqEventPublisher(endpoint=a.events, replay_endpoint=a.replay or None, topic="",
                                data_parallel_rank=0)
    cache = PrefixCache(a.capacity_blocks)

    def publish(events):
        if events:
            pub.publish(mod.KVEventBatch(ts=time.time(), events=events))

    tok = None
    if a.tokenizer:
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(a.tokenizer)

    def run(prompt, out):
        """Prefill `prompt` and decode `out`: the cache and its events; the blocks hit."""
        events = []
        hit = cache.admit(cache.hashes(prompt), prompt, events, mod)
        # Decode: each block filled by generated tokens is stored on its own event,
        # as vLLM sends them.
        seq = prompt + out
        cache.admit(cache.hashes(seq), seq, events, mod, one_per_event=True)
        publish(events)
        return {"prompt_tokens": len(prompt), "completion_tokens": len(out),
                "total_tokens": len(prompt) + len(out),
                "prompt_tokens_details": {"cached_tokens": hit * BLOCK}}

    async def completions(request):
        body = await request.json()
        prompt = body.get("prompt")
        if not isinstance(prompt, list) or not all(isinstance(t, int) and 0 <= t < 2 ** 32 for t in prompt):
            return web.json_response({"error": {"message": "prompt must be a list of token ids"}}, status=400)
        out = generated(prompt, int(body.get("max_tokens", 16)))
        usage = run(prompt, out)
        return web.json_response({
            "object": "text_completion", "model": body.get("model", ""),
            "choices": [{"index": 0, "text": "", "token_ids": out, "finish_reason": "length"}],
            "usage": usage,
        }, headers={"x-worker": a.name})

    async def chat(request):
        if tok is None:
            return web.json_response({"error": {"message": "start the worker with --tokenizer"}}, status=400)
        body = await request.json()
        ids = tok.apply_chat_template(body["messages"], tokenize=True, add_generation_prompt=True)
        prompt = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        # Generated tokens are the prompt's own (any id decodes, and the reply, sent
        # back in the next turn, tokenizes to the same ids).
        out = [prompt[g % len(prompt)] for g in generated(prompt, int(body.get("max_tokens", 16)))]
        usage = run(prompt, out)
        text = tok.decode(out)
        head = {"id": "chat-1", "model": body.get("model", ""), "created": int(time.time())}
        if not body.get("stream"):
            return web.json_response({
                **head, "object": "chat.completion",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                             "finish_reason": "length"}],
                "usage": usage,
            }, headers={"x-worker": a.name})
        resp = web.StreamResponse(headers={"content-type": "text/event-stream", "x-worker": a.name})
        await resp.prepare(request)

        async def event(obj):
            await resp.write(f"data: {json.dumps({**head, 'object': 'chat.completion.chunk', **obj})}\n\n".encode())

        for i, word in enumerate(text.split(" ")):
            delta = {"content": word if i == 0 else " " + word}
            if i == 0:
                delta["role"] = "assistant"
            await event({"choices": [{"index": 0, "delta": delta, "finish_reason": None}]})
        await event({"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]})
        if (body.get("stream_options") or {}).get("include_usage"):
            await event({"choices": [], "usage": usage})
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def reset(_request):
        cache.blocks.clear()
        publish([engines.build_event(mod, {"type": "AllBlocksCleared"})])
        return web.json_response({"ok": True})

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_post("/reset", reset)
    try:
        # The publisher's resolved endpoints (port 0 bound), as a subscriber dials them.
        config = pub.get_publisher_config()
        events = config.endpoint.replace("*", "127.0.0.1")
        replay = (config.replay_endpoint or "").replace("*", "127.0.0.1")
        asyncio.run(serve(app, a.port, events, replay))
    finally:
        pub.shutdown()


async def serve(app, port, events, replay):
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    host, port = runner.addresses[0][:2]
    print(f"ready http://{host}:{port} {events} {replay or '-'}", flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    main()
