"""examples/python_router end to end: mock workers publishing through vLLM's real
ZmqEventPublisher, two routers, a real kvix-server; kvix must beat round robin on the
follow-up cache hit by at least 0.25 on the example's default workload. The routers get a
1 s query deadline: the test is about where kvix sends requests, and a machine busy with
the rest of the test suite can take longer than the default 2 ms to answer."""

import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT, _server_bin


def test_the_router_example_beats_round_robin_on_follow_up_hits():
    try:
        import aiohttp  # noqa: F401
    except ImportError:
        if os.environ.get("CI") == "true":
            pytest.fail("aiohttp is needed (pip install aiohttp)")
        pytest.skip("aiohttp is not installed (pip install aiohttp)")
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "python_router", "run.py"),
         "--server-bin", _server_bin(), "--deadline-ms", "1000", "--json"],
        capture_output=True, text=True, timeout=600,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    print(out.stdout)
    results = json.loads(out.stdout.strip().splitlines()[-1])
    kvix, rr = results["kvix"], results["round_robin"]
    assert kvix["follow_up_hit"] - rr["follow_up_hit"] >= 0.25, out.stdout
    # kvix did the routing: most requests went where it said, none failed open.
    routed = [r["routed"] for r in kvix["routers"]]
    assert all(r["kvix_failed_open"] == 0 for r in routed), out.stdout
    assert sum(r["by_kvix"] for r in routed) > sum(r["by_load"] for r in routed)
    assert all(r["kvix"]["scores"] > 0 for r in kvix["routers"])
    assert all(r["routed"]["by_kvix"] == 0 for r in rr["routers"])


def test_the_router_example_routes_streamed_chat_requests_by_kvix():
    """The same workload as OpenAI chat requests, streamed: routers and workers tokenize
    with one transformers tokenizer (built by run.py, no download); kvix must beat round
    robin on follow-up hits. Five runs on this 2-core machine gave kvix 0.80-0.84 and
    round robin 0.57-0.61 (margin 0.19-0.27, the low one in CI beside other tests), so the
    test asks for a margin of 0.1 and kvix at 0.7 or more: routing that ignored kvix
    lands at round robin's level and fails both."""
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "python_router", "run.py"),
         "--server-bin", _server_bin(), "--deadline-ms", "1000", "--json", "--chat"],
        capture_output=True, text=True, timeout=600,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    results = json.loads(out.stdout.strip().splitlines()[-1])
    kvix, rr = results["kvix"], results["round_robin"]
    assert kvix["follow_up_hit"] - rr["follow_up_hit"] >= 0.1, out.stdout
    assert kvix["follow_up_hit"] >= 0.7, out.stdout
    routed = [r["routed"] for r in kvix["routers"]]
    assert all(r["kvix_failed_open"] == 0 for r in routed), out.stdout
    assert sum(r["by_kvix"] for r in routed) > sum(r["by_load"] for r in routed)
