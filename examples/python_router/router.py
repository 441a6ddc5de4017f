#!/usr/bin/env python3
"""A small OpenAI-compatible router in front of inference workers, routing by kvix.

    python3 router.py --port 8001 --kvix 127.0.0.1:7420 --model demo \\
        --worker w0=http://127.0.0.1:8101,tcp://127.0.0.1:5601,tcp://127.0.0.1:5602 ...

A prompt of token ids is asked of kvix by its tokens; a text prompt by its bytes
(kvix's byte keyspace, which only placements fill: use --feed placements for text).
With --tokenizer (the served model's transformers tokenizer directory) it also serves
POST /v1/chat/completions, streaming or not: the messages are tokenized with the chat
template as the engine will (`query_chat`), and the worker's answer is passed through
as it comes. Per request it asks kvix which worker can reuse the most
of the prompt (--deadline-ms, 2 by default, then fail open) and picks with `kvix.pick`:
the most reusable prefix less --alpha blocks per block of prompts in flight on the
worker (Dynamo's default cost), forwards the request, (with --feed placements)
publishes the placement, and reports to kvix what the worker says it reused (its
answer's usage.prompt_tokens_details.cached_tokens, whole or from a stream's usage
chunk; text prompts, hashed as bytes, are not reported) against the reuse kvix predicted: kvix names a worker, or this
router, whose figures disagree (docs/operations.md, "Reuse verdicts").

At start it announces every worker to kvix with the worker's KV event endpoint (and its
replay endpoint, which kvix asks for batches it missed) as its source, so kvix
subscribes to the worker's own event stream (--feed events, the default), or as a
placements-fed worker. --policy round_robin ignores kvix: the
baseline. GET /stats shows how requests were routed.
"""

import argparse
import asyncio
import itertools
import json
import os

import aiohttp
from aiohttp import web

import kvix

# The token block kvix's client hashes with (its default): a score's blocks x BLOCK tokens.
BLOCK = 16


def parse_worker(text):
    """NAME=URL[,EVENTS_ENDPOINT[,REPLAY_ENDPOINT]]: (name, url, events, replay)."""
    name, _, rest = text.partition("=")
    url, _, endpoints = rest.partition(",")
    events, _, replay = endpoints.partition(",")
    if not name or not url.startswith("http"):
        raise argparse.ArgumentTypeError(
            f"--worker NAME=URL[,EVENTS_ENDPOINT[,REPLAY_ENDPOINT]], not {text!r}")
    return name, url.rstrip("/"), events or None, replay or ""


class Router:
    def __init__(self, a):
        self.a = a
        self.workers = {name: url for name, url, _, _ in a.worker}
        self.names = list(self.workers)
        self.turn = itertools.cycle(self.names)
        self.kvix = None
        self.http = None
        # Blocks of the prompts each worker is serving now: the load kvix.pick weighs.
        self.inflight = {name: 0 for name in self.names}
        self.routed = {"by_kvix": 0, "by_load": 0, "kvix_failed_open": 0}
        self.tok = None
        if a.tokenizer:
            from transformers import AutoTokenizer
            self.tok = AutoTokenizer.from_pretrained(a.tokenizer)
            if a.skip_chat_template:
                self.tok = WithoutChatTemplate(self.tok)

    async def start(self, _app):
        self.http = aiohttp.ClientSession()
        if self.a.policy != "kvix":
            return
        self.kvix = await kvix.AsyncClient.connect(self.a.kvix, name=self.a.client_name or f"router-{os.getpid()}",
                                                   deadline_ms=self.a.deadline_ms)
        for name, _, events, replay in self.a.worker:
            if self.a.feed == "placements":
                await self.kvix.announce(name, feed="placements", capacity_blocks=self.a.capacity_blocks)
            else:
                if not events:
                    raise SystemExit(f"worker {name} has no event endpoint (NAME=URL,tcp://...)")
                source = kvix.EventSource(events, self.a.model, replay=replay)
                await self.kvix.announce(name, source=source)

    async def stop(self, _app):
        await self.http.close()
        if self.kvix:
            self.kvix.close()

    async def pick(self, prompt=None, messages=None):
        """The worker for this prompt (or chat), whether reuse (not load alone) chose it, and
        the reuse kvix predicted for it in tokens (None: not in the answer)."""
        if self.kvix is None:
            return next(self.turn), False, None
        if messages is not None:
            r = await self.kvix.query_chat(self.a.model, messages, self.tok, candidates=self.names)
        elif isinstance(prompt, str):
            r = await self.kvix.query_text(self.a.model, prompt, candidates=self.names)
        else:
            r = await self.kvix.query_tokens(self.a.model, prompt, candidates=self.names)
        if r.failed_open:
            self.routed["kvix_failed_open"] += 1
        chosen = kvix.pick(r, self.inflight, alpha=self.a.alpha)
        scored = any(s.worker == chosen.worker for s in r.scores)
        return chosen.worker, chosen.blocks > 0, chosen.blocks * BLOCK if scored else None

    def report(self, worker, predicted, answer):
        """Tells kvix what the engine says it reused (its usage's cached_tokens) against
        what kvix predicted; a response without the figure is no report."""
        usage = answer.get("usage") if isinstance(answer, dict) else None
        if self.kvix is None or not usage:
            return
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        self.kvix.report_reuse(worker, self.a.model, predicted_tokens=predicted,
                               cached_tokens=cached, prompt_tokens=usage.get("prompt_tokens", 0))

    async def completions(self, request):
        body = await request.json()
        prompt = body.get("prompt")
        if not isinstance(prompt, (list, str)):
            return web.json_response({"error": {"message": "prompt must be token ids or text"}}, status=400)
        worker, by_kvix, predicted = await self.pick(prompt)
        self.routed["by_kvix" if by_kvix else "by_load"] += 1
        blocks = max(1, len(prompt.encode()) // 256 if isinstance(prompt, str) else len(prompt) // 16)
        self.inflight[worker] += blocks
        try:
            async with self.http.post(self.workers[worker] + "/v1/completions", json=body) as resp:
                answer = await resp.json()
                status = resp.status
        finally:
            self.inflight[worker] -= blocks
        if status == 200 and not isinstance(prompt, str):
            self.report(worker, predicted, answer)
        if self.kvix is not None and self.a.feed == "placements" and status == 200:
            if isinstance(prompt, str):
                self.kvix.publish_placement(worker, self.a.model, text=prompt)
            else:
                self.kvix.publish_placement(worker, self.a.model, prompt)
        return web.json_response(answer, status=status,
                                 headers={"x-worker": worker, "x-routed-by": "kvix" if by_kvix else "load"})

    async def chat(self, request):
        if self.tok is None:
            return web.json_response({"error": {"message": "start the router with --tokenizer"}}, status=400)
        body = await request.json()
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return web.json_response({"error": {"message": "messages must be a non-empty list"}}, status=400)
        worker, by_kvix, predicted = await self.pick(messages=messages)
        self.routed["by_kvix" if by_kvix else "by_load"] += 1
        blocks = max(1, len(self.kvix.chain(self.a.model, messages=messages, tokenizer=self.tok))
                     if self.kvix else 1)
        self.inflight[worker] += blocks
        headers = {"x-worker": worker, "x-routed-by": "kvix" if by_kvix else "load"}
        try:
            async with self.http.post(self.workers[worker] + "/v1/chat/completions", json=body) as up:
                if body.get("stream") and up.status == 200:
                    # Server-sent events: each chunk goes on as it comes; the usage chunk
                    # (sent when the client asked for stream_options.include_usage) is
                    # read on the way for the reuse report.
                    resp = web.StreamResponse(status=200, headers={
                        **headers, "content-type": up.headers.get("content-type", "text/event-stream")})
                    await resp.prepare(request)
                    usage, pending = None, b""
                    async for chunk in up.content.iter_any():
                        await resp.write(chunk)
                        usage, pending = stream_usage(pending + chunk, usage)
                    await resp.write_eof()
                    self.report(worker, predicted, {"usage": usage})
                else:
                    answer = await up.json()
                    if up.status == 200:
                        self.report(worker, predicted, answer)
                    resp = web.json_response(answer, status=up.status, headers=headers)
                status = up.status
        finally:
            self.inflight[worker] -= blocks
        if self.kvix is not None and self.a.feed == "placements" and status == 200:
            self.kvix.publish_placement(worker, self.a.model, messages=messages, tokenizer=self.tok)
        return resp

    async def stats(self, _request):
        out = {"policy": self.a.policy, "routed": self.routed}
        if self.kvix:
            out["kvix"] = self.kvix.counters()
        return web.json_response(out)


class WithoutChatTemplate:
    """A tokenizer that tokenizes a chat's messages without the chat template: the
    mistake of a gateway that forgets it (vLLM production-stack #1045), made on purpose
    (--skip-chat-template) to show kvix naming it. Its token ids are not the engine's,
    so kvix finds none of its prompts."""

    def __init__(self, tok):
        self.tok = tok

    def apply_chat_template(self, messages, tokenize=True, add_generation_prompt=True, **_):
        text = " ".join(m["content"] for m in messages)
        return self.tok.encode(text, add_special_tokens=False) if tokenize else text


def stream_usage(data, usage):
    """The usage of the server-sent events' complete lines in data (else usage as it
    was), and the incomplete last line to keep for the next chunk."""
    *lines, rest = data.split(b"\n")
    for line in lines:
        line = line.strip()
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            continue
        try:
            found = json.loads(line[len(b"data: "):]).get("usage")
        except (ValueError, AttributeError):
            continue
        usage = found or usage
    return usage, rest


async def serve(a):
    r = Router(a)
    app = web.Application()
    app.on_startup.append(r.start)
    app.on_cleanup.append(r.stop)
    app.router.add_post("/v1/completions", r.completions)
    app.router.add_post("/v1/chat/completions", r.chat)
    app.router.add_get("/stats", r.stats)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", a.port).start()
    host, port = runner.addresses[0][:2]
    print(f"ready http://{host}:{port}", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--port", type=int, default=0,
                    help="HTTP port (0: any free port; the bound one is printed after \"ready\")")
    ap.add_argument("--kvix", default="127.0.0.1:7420", help="kvix server(s), comma-separated")
    ap.add_argument("--model", default="demo", help="the keyspace's model name")
    ap.add_argument("--worker", action="append", type=parse_worker, required=True,
                    metavar="NAME=URL[,EVENTS[,REPLAY]]",
                    help="a worker (repeat); EVENTS: its ZMQ PUB endpoint, REPLAY: its replay endpoint")
    ap.add_argument("--policy", choices=["kvix", "round_robin"], default="kvix")
    ap.add_argument("--tokenizer", default=None,
                    help="the served model's transformers tokenizer directory: serves /v1/chat/completions")
    ap.add_argument("--skip-chat-template", action="store_true",
                    help="misconfigured on purpose: tokenize chats without the chat template, as a "
                         "gateway that forgets it does (kvix names this router: gateway_tokenization)")
    ap.add_argument("--client-name", default=None,
                    help="the name kvix knows this router by (default router-PID); kvix keys its "
                         "reuse verdicts by it, so a router restarted under the same name keeps them")
    ap.add_argument("--feed", choices=["events", "placements"], default="events")
    ap.add_argument("--capacity-blocks", type=int, default=1500,
                    help="with --feed placements: blocks a worker is assumed to keep")
    ap.add_argument("--deadline-ms", type=float, default=2.0,
                    help="what a kvix query may take before the request is routed in turn")
    ap.add_argument("--alpha", type=float, default=1.0,
                    help="blocks of reuse that one block of prompts in flight on a worker outweighs "
                         "(kvix.pick; 1 is Dynamo's default cost)")
    asyncio.run(serve(ap.parse_args()))


if __name__ == "__main__":
    main()
