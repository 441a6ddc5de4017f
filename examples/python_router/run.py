#!/usr/bin/env python3
"""The point of kvix in one command: N mock workers, 2 routers and a kvix server, the
same multi-turn chat workload routed twice, by kvix and round robin, and the share of
follow-up prompts found in the chosen worker's cache each way.

    python3 examples/python_router/run.py [--workers 4] [--conversations 48] [--turns 4]

Needs the kvix package (`pip install ./client/python`), aiohttp, and a kvix-server
binary (--server-bin, else target/release or target/debug of this checkout: `cargo
build --release -p kvix-server`). The workers publish their KV events through vLLM's
real ZmqEventPublisher (fetched once by scripts/engines.py). Each policy starts on
empty caches. Every turn of a conversation goes through the other router than the turn
before: two gateways that share nothing but kvix.
"""

import argparse
import asyncio
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile

import aiohttp

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
BLOCK = 16


def server_bin(given):
    if given:
        return given
    for profile in ("release", "debug"):
        p = os.path.join(ROOT, "target", profile, "kvix-server")
        if os.path.exists(p):
            return p
    raise SystemExit("no kvix-server binary: `cargo build --release -p kvix-server`, or pass --server-bin")


class Procs:
    """Child processes that print "ready" (or an address) once serving; all killed at exit."""

    def __init__(self):
        self.procs = []

    def start(self, args, wait_for="ready", env=None):
        p = subprocess.Popen(args, stdout=subprocess.PIPE, text=True, env=env)
        self.procs.append(p)
        for line in p.stdout:
            if wait_for in line:
                return p, line
        raise SystemExit(f"{args[0:3]} exited before it was ready")

    def stop(self, p):
        p.kill()
        p.wait()
        self.procs.remove(p)

    def stop_all(self):
        for p in list(self.procs):
            self.stop(p)


def workload(a):
    """Conversations: one of 4 system prompts (512 tokens), a document of its own,
    then turns of a user message each; a follow-up prompt is the previous prompt, the
    answer to it and the new message."""
    rng = random.Random(a.seed)
    toks = lambda n: [rng.randrange(50_000) for _ in range(n)]  # noqa: E731
    systems = [toks(512) for _ in range(4)]
    return [(rng.choice(systems) + toks(a.document_tokens), [toks(a.message_tokens) for _ in range(a.turns)])
            for _ in range(a.conversations)]


def make_tokenizer(directory):
    """A word-level tokenizer ("w<id>" is token id; role markers its own) with a chat
    template, saved as a transformers tokenizer directory (no hub download)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    words = ["[UNK]", "<|system|>", "<|user|>", "<|assistant|>"] + [f"w{i}" for i in range(50_000)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")
    hf.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    hf.save_pretrained(directory)


def words(tokens):
    return " ".join(f"w{t}" for t in tokens)


async def chat_turn(http, url, a, messages):
    """One streamed chat request: (the reply's text, its usage)."""
    body = {"model": a.model, "messages": messages, "max_tokens": a.answer_tokens,
            "stream": True, "stream_options": {"include_usage": True}}
    text, usage = [], None
    async with http.post(url + "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.content:
            line = line.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            for c in chunk["choices"]:
                text.append(c["delta"].get("content", ""))
            usage = chunk.get("usage") or usage
    return "".join(text), usage


async def drive(routers, convs, a):
    """Runs every conversation; returns (first-turn, follow-up) (cached, prompt) sums."""
    first, follow = [0, 0], [0, 0]
    gate = asyncio.Semaphore(a.concurrency)
    pause = random.Random(a.seed)
    async with aiohttp.ClientSession() as http:
        async def chat(i, head, messages):
            async with gate:
                system, document = head[:512], head[512:]
                chat = [{"role": "system", "content": words(system)}]
                for turn, msg in enumerate(messages):
                    content = words(document + msg if turn == 0 else msg)
                    chat.append({"role": "user", "content": content})
                    reply, u = await chat_turn(http, routers[(i + turn) % len(routers)], a, chat)
                    acc = first if turn == 0 else follow
                    acc[0] += u["prompt_tokens_details"]["cached_tokens"]
                    acc[1] += u["prompt_tokens"]
                    chat.append({"role": "assistant", "content": reply})
                    await asyncio.sleep(pause.uniform(0, 2 * a.think_ms) / 1000)

        async def conversation(i, head, messages):
            if a.chat:
                return await chat(i, head, messages)
            async with gate:
                prompt = list(head)
                for turn, msg in enumerate(messages):
                    prompt = prompt + msg
                    url = routers[(i + turn) % len(routers)] + "/v1/completions"
                    async with http.post(url, json={"model": a.model, "prompt": prompt,
                                                    "max_tokens": a.answer_tokens}) as r:
                        r.raise_for_status()
                        body = await r.json()
                    u = body["usage"]
                    acc = first if turn == 0 else follow
                    acc[0] += u["prompt_tokens_details"]["cached_tokens"]
                    acc[1] += u["prompt_tokens"]
                    prompt = prompt + body["choices"][0]["token_ids"]
                    # The user reads and types: a varying pause, so the conversations do
                    # not move in lockstep (which would line round robin up with them).
                    await asyncio.sleep(pause.uniform(0, 2 * a.think_ms) / 1000)

        await asyncio.gather(*[conversation(i, h, m) for i, (h, m) in enumerate(convs)])
        stats = [await (await http.get(r + "/stats")).json() for r in routers]
    return first, follow, stats


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--capacity-blocks", type=int, default=1500, help="each worker's KV cache, blocks")
    ap.add_argument("--conversations", type=int, default=48)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--document-tokens", type=int, default=768)
    ap.add_argument("--message-tokens", type=int, default=96)
    ap.add_argument("--answer-tokens", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=8, help="conversations at a time")
    ap.add_argument("--think-ms", type=float, default=20.0, help="mean pause between a conversation's turns")
    ap.add_argument("--model", default="demo")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--server-bin", default=None)
    ap.add_argument("--deadline-ms", type=float, default=2.0,
                    help="the routers' kvix query deadline (a loaded machine may need more)")
    ap.add_argument("--json", action="store_true", help="print one JSON line of results at the end")
    ap.add_argument("--chat", action="store_true",
                    help="the same conversations as streamed OpenAI chat requests: routers and workers "
                         "tokenize with one transformers tokenizer (needs transformers)")
    ap.add_argument("--misconfigure-router", action="store_true",
                    help="with --chat: the kvix pass, then one with router 1 tokenizing without the chat "
                         "template, then one with it fixed (no round robin): what kvix's reuse verdicts "
                         "say after each (GET /reuse on its metrics port), and what the mistake costs")
    a = ap.parse_args()
    if a.misconfigure_router and not a.chat:
        ap.error("--misconfigure-router needs --chat")

    py = sys.executable
    procs = Procs()
    tokenizer = []
    if a.chat:
        tokenizer = ["--tokenizer", tempfile.mkdtemp(prefix="kvix-example-tokenizer-")]
        make_tokenizer(tokenizer[1])
    try:
        server, line = procs.start([server_bin(a.server_bin), "--listen", "127.0.0.1:0", "--unix", "",
                                    "--metrics", "127.0.0.1:0", "--cores", "1", "--pin", "false"],
                                   wait_for="listening on tcp://", env={**os.environ, "KVIX_LOG": "warn"})
        kvix_addr = line.split("listening on tcp://")[1].split()[0]
        metrics = next(line for line in server.stdout if "metrics on " in line)
        metrics = metrics.split("metrics on ")[1].split()[0].removesuffix("/metrics")
        workers = []
        for i in range(a.workers):
            # The engine binds its PUB socket (vLLM's "tcp://*:0": any free port, printed
            # once bound); kvix connects to it.
            _, line = procs.start([py, os.path.join(HERE, "worker.py"),
                                   "--capacity-blocks", str(a.capacity_blocks), "--name", f"w{i}",
                                   *tokenizer])
            url, events, replay = line.split()[1:4]
            workers.append((f"w{i}", url, events, "" if replay == "-" else replay))
        convs = workload(a)
        results = {}
        # (pass, policy, the misconfigured router's index)
        passes = [("kvix", "kvix", None), ("round_robin", "round_robin", None)]
        if a.misconfigure_router:
            passes = [("kvix", "kvix", None), ("kvix_misconfigured", "kvix", 1), ("kvix_fixed", "kvix", None)]
        for label, policy, wrong in passes:
            asyncio.run(reset(workers))
            routers, started = [], []
            for i in range(2):
                args = [py, os.path.join(HERE, "router.py"), "--kvix", kvix_addr,
                        "--model", a.model, "--policy", policy, "--deadline-ms", str(a.deadline_ms),
                        "--client-name", f"router-{i}", *tokenizer]
                if i == wrong:
                    args.append("--skip-chat-template")
                for name, url, events, replay in workers:
                    args += ["--worker", f"{name}={url},{events},{replay}"]
                p, line = procs.start(args)
                started.append(p)
                routers.append(line.split()[1])
            first, follow, stats = asyncio.run(drive(routers, convs, a))
            results[label] = {"first_turn_hit": first[0] / first[1], "follow_up_hit": follow[0] / follow[1],
                              "routers": stats}
            if policy == "kvix":
                results[label]["reuse"] = asyncio.run(verdicts(routers, metrics))
            for p in started:
                procs.stop(p)
    finally:
        procs.stop_all()
        if tokenizer:
            shutil.rmtree(tokenizer[1], ignore_errors=True)

    print(f"{a.workers} workers, 2 routers, {a.conversations} {'chat ' if a.chat else ''}conversations "
          f"of {a.turns} turns")
    width = 20 if a.misconfigure_router else 12
    print(f"{'policy':<{width}} {'first-turn hit':>15} {'follow-up hit':>14}"
          + ("  reuse verdicts" if a.misconfigure_router else ""))
    for label, r in results.items():
        named = [f"{c['client']}: {c['suspect']}" for c in r.get("reuse", {}).get("clients", []) if c["suspect"]]
        named += [f"worker {w['name']}: {w['suspect']}" for w in r.get("reuse", {}).get("workers", [])
                  if w["suspect"]]
        print(f"{label:<{width}} {r['first_turn_hit']:>15.2f} {r['follow_up_hit']:>14.2f}"
              + (f"  {', '.join(named) or '-'}" if a.misconfigure_router else ""))
    if "round_robin" in results:
        k, rr = results["kvix"], results["round_robin"]
        print(f"follow-up hit with kvix {k['follow_up_hit']:.2f} vs round robin {rr['follow_up_hit']:.2f}: "
              f"{k['follow_up_hit'] - rr['follow_up_hit']:+.2f}")
    if a.json:
        print(json.dumps(results))


async def verdicts(routers, metrics):
    """kvix's reuse verdicts (GET /reuse on its metrics port) once every report the
    routers sent is in: each answered request is reported (fire and forget, batched)."""
    async with aiohttp.ClientSession() as http:
        for _ in range(300):
            stats = [await (await http.get(r + "/stats")).json() for r in routers]
            routed = sum(s["routed"]["by_kvix"] + s["routed"]["by_load"] for s in stats)
            if sum(s["kvix"]["reuse_reports_sent"] for s in stats) >= routed:
                return await (await http.get(metrics + "/reuse")).json()
            await asyncio.sleep(0.1)
    raise SystemExit("the routers' reuse reports did not all reach kvix within 30 s")


async def reset(workers):
    """Empties every worker's cache (each publishes AllBlocksCleared)."""
    async with aiohttp.ClientSession() as http:
        for _, url, _, _ in workers:
            async with http.post(url + "/reset") as r:
                r.raise_for_status()


if __name__ == "__main__":
    main()
