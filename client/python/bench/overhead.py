#!/usr/bin/env python3
"""What a query costs from Python over what it costs from the Rust client, same process,
same connection, same server, interleaved in rounds so the noise of a shared machine
falls on both sides alike.

    python3 overhead.py --server 127.0.0.1:7420 [--rounds 40] [--per-round 100]

Loads the server first (workers holding prompts of --blocks blocks, by placements),
then per round: k blocking Python queries (`Client.query_tokens` on a list of token
ids, timed with perf_counter_ns around the call), k blocking Rust queries (the same
call in Rust, timed in Rust), k asyncio queries (`await AsyncClient.query_tokens`) and
k Rust async queries (a task on the client's runtime). Prints p50 / p99 and the
Python / Rust ratios, and a JSON line with all figures.
"""

import argparse
import asyncio
import json
import random
import statistics
import time

import kvix


def quantile(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--server", default="127.0.0.1:7420")
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--per-round", type=int, default=100)
    ap.add_argument("--blocks", type=int, default=125, help="prompt length in 16-token blocks")
    ap.add_argument("--workers", type=int, default=16)
    ap.add_argument("--spin-us", type=float, default=None, help="client spin before parking")
    a = ap.parse_args()

    model = "overhead-bench"
    rng = random.Random(7)
    client = kvix.Client(a.server, name="overhead-bench", deadline_ms=50.0, spin_us=a.spin_us)
    prompts = []
    for w in range(a.workers):
        name = f"bench-worker-{w}"
        client.announce(name, feed="placements", capacity_blocks=1 << 20)
        tokens = [rng.randrange(1 << 17) for _ in range(a.blocks * 16)]
        prompts.append(tokens)
        assert client.publish_placement(name, model, tokens)
    # Placements are fire-and-forget: wait until the last one answers.
    for _ in range(1000):
        if client.query_tokens(model, prompts[-1]).outcome == "scores":
            break
        time.sleep(0.01)
    prompt = prompts[0]
    assert client.query_tokens(model, prompt).best.blocks == a.blocks, "server not loaded"

    times = {"python blocking": [], "rust blocking": [], "python asyncio": [], "rust async": []}

    async def run():
        aclient = await kvix.AsyncClient.connect(a.server, deadline_ms=50.0, spin_us=a.spin_us)
        k = a.per_round
        clock = time.perf_counter_ns
        for r in range(a.rounds + 1):
            keep = r > 0  # round 0 warms up
            pb, pa = [], []
            for _ in range(k):
                t = clock()
                client.query_tokens(model, prompt)
                pb.append(clock() - t)
            rb = client._core.rust_baseline(model, prompt, k, None)
            for _ in range(k):
                t = clock()
                await aclient.query_tokens(model, prompt)
                pa.append(clock() - t)
            ra = await aclient._core.rust_baseline(model, prompt, k, aclient._done)
            if keep:
                times["python blocking"] += pb
                times["rust blocking"] += rb
                times["python asyncio"] += pa
                times["rust async"] += ra
        aclient.close()

    asyncio.run(run())
    c = client.counters()
    assert c["failed_open"] == 0, c

    fig = {k: {"p50_us": quantile(v, 0.5) / 1e3, "p99_us": quantile(v, 0.99) / 1e3, "n": len(v)}
           for k, v in times.items()}
    fig["ratio_blocking_p50"] = fig["python blocking"]["p50_us"] / fig["rust blocking"]["p50_us"]
    fig["ratio_asyncio_p50"] = fig["python asyncio"]["p50_us"] / fig["rust async"]["p50_us"]
    fig["ratio_asyncio_over_rust_blocking_p50"] = fig["python asyncio"]["p50_us"] / fig["rust blocking"]["p50_us"]
    print(f"{'query of ' + str(a.blocks) + ' blocks':<24} {'p50 µs':>9} {'p99 µs':>9}")
    for k in times:
        print(f"{k:<24} {fig[k]['p50_us']:>9.1f} {fig[k]['p99_us']:>9.1f}")
    print(f"Python / Rust at p50: blocking {fig['ratio_blocking_p50']:.2f}x, "
          f"asyncio {fig['ratio_asyncio_p50']:.2f}x (over the Rust blocking call "
          f"{fig['ratio_asyncio_over_rust_blocking_p50']:.2f}x)")
    print(json.dumps(fig))


if __name__ == "__main__":
    main()
