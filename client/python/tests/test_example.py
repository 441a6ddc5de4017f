"""examples/python_router end to end: mock workers publishing through vLLM's real
ZmqEventPublisher, two routers, a real kvix-server, the example's default workload
routed by kvix and by round robin.

What the routers' follow-up hit comes to depends on timing (four conversations at a
time on four workers, load-aware picks): over eleven runs of both forms on this 2-core
machine, two of them in CI beside the rest of the suite, kvix gave 0.80-0.88 and round
robin 0.54-0.62, the margin 0.19-0.35 (lowest in CI). So a test asks for kvix at 0.7 or more
and 0.1 above round robin: routing that ignored kvix lands at round robin's level and
fails both. The routers get a 1 s query deadline: the test is about where kvix sends
requests, and a busy machine can take longer than the default 2 ms to answer."""

import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT, _server_bin


def _run_example(*flags):
    try:
        import aiohttp  # noqa: F401
    except ImportError:
        pytest.fail("aiohttp is needed: run the suite in the tests' environment "
                    "($(python3 scripts/testenv.py ensure) -m pytest ...)")
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "python_router", "run.py"),
         "--server-bin", _server_bin(), "--deadline-ms", "1000", "--json", *flags],
        capture_output=True, text=True, timeout=600,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    print(out.stdout)
    return json.loads(out.stdout.strip().splitlines()[-1]), out.stdout


def _assert_kvix_routed_better(results, report):
    kvix, rr = results["kvix"], results["round_robin"]
    assert kvix["follow_up_hit"] >= 0.7, report
    assert kvix["follow_up_hit"] - rr["follow_up_hit"] >= 0.1, report
    # kvix did the routing: most requests went where it said, none failed open.
    routed = [r["routed"] for r in kvix["routers"]]
    assert all(r["kvix_failed_open"] == 0 for r in routed), report
    assert sum(r["by_kvix"] for r in routed) > sum(r["by_load"] for r in routed), report
    assert all(r["routed"]["by_kvix"] == 0 for r in rr["routers"]), report


def test_the_router_example_beats_round_robin_on_follow_up_hits():
    results, report = _run_example()
    _assert_kvix_routed_better(results, report)
    assert all(r["kvix"]["scores"] > 0 for r in results["kvix"]["routers"]), report
    # Each router reported what the workers said they reused.
    assert all(r["kvix"]["reuse_reports_sent"] > 0 for r in results["kvix"]["routers"]), report


def test_the_router_example_routes_streamed_chat_requests_by_kvix():
    """The same workload as OpenAI chat requests, streamed: routers and workers tokenize
    with one transformers tokenizer (built by run.py, no download)."""
    results, report = _run_example("--chat")
    _assert_kvix_routed_better(results, report)
    # The streamed answers' usage chunks were reported.
    assert all(r["kvix"]["reuse_reports_sent"] > 0 for r in results["kvix"]["routers"]), report


def test_a_router_that_skips_the_chat_template_is_named_and_cleared_once_fixed():
    """Router 1 tokenizes chats without the chat template (vLLM production-stack #1045):
    its token ids are not the engines', which apply transformers' chat template. kvix
    names that router (gateway_tokenization), not the other one nor any worker, from
    what the workers' usage says they reused; restarted fixed under the same name, it is
    cleared. What the mistake costs: the follow-ups it routes find nothing in kvix."""
    results, report = _run_example("--chat", "--misconfigure-router")

    def named(label):
        reuse = results[label]["reuse"]
        clients = {c["client"].split("@")[0]: c["suspect"] for c in reuse["clients"]}
        workers = {w["name"]: w["suspect"] for w in reuse["workers"] if w["suspect"]}
        return clients, workers

    clients, workers = named("kvix")
    assert clients == {"router-0": None, "router-1": None} and workers == {}, report
    clients, workers = named("kvix_misconfigured")
    assert clients == {"router-0": None, "router-1": "gateway_tokenization"}, report
    assert workers == {}, report
    clients, workers = named("kvix_fixed")
    assert clients == {"router-0": None, "router-1": None} and workers == {}, report
    healthy, wrong = results["kvix"], results["kvix_misconfigured"]
    assert wrong["follow_up_hit"] < healthy["follow_up_hit"] - 0.05, report
    assert results["kvix_fixed"]["follow_up_hit"] >= 0.7, report
