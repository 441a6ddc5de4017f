"""kvix.Client and kvix.AsyncClient against real kvix-server processes.

No test times anything: deadlines are checked by counting outcomes, and every wait is
for a condition (with a bound on the number of tries).
"""

import array
import asyncio
import json
import os
import threading
import time

import pytest

import kvix

MODEL = "test-model"


def tokens(n_blocks, salt=0):
    return [(salt * 1_000_003 + i) % (1 << 31) for i in range(16 * n_blocks)]


# Queries in these tests are not about the deadline unless they say so: a debug build on
# a loaded machine may take longer than the default 2 ms.
SLOW = 2000


def wait_until(pred, what, tries=500):
    for _ in range(tries):
        if pred():
            return
        time.sleep(0.01)
    raise AssertionError(f"never happened: {what}")


def placed(client, worker, prompt, blocks):
    """Publishes a placement and waits until the server shows it."""
    assert client.publish_placement(worker, MODEL, prompt)
    wait_until(lambda: any(s.worker == worker and s.blocks >= blocks
                           for s in client.query_tokens(MODEL, prompt).scores),
               f"{worker} holds {blocks} blocks")


def placement_worker(client, name):
    return client.announce(name, feed="placements", capacity_blocks=100_000)


def test_blocking_client_announces_places_queries_and_retires(server):
    c = kvix.Client(server.addr, name="pytest", deadline_ms=SLOW)
    assert c.is_connected and c.primary == server.addr
    a = placement_worker(c, "a")
    b = placement_worker(c, "b")
    assert a != b and c.worker_id("a") == a and c.worker_id("nobody") is None
    assert placement_worker(c, "a") == a  # same roster: same id

    p = tokens(8, salt=1)
    placed(c, "a", p[:16 * 8], 8)
    placed(c, "b", p[:16 * 3], 3)
    r = c.query_tokens(MODEL, p)
    assert r.outcome == "scores" and not r.failed_open and r.error is None
    assert [(s.worker, s.worker_id, s.blocks) for s in r.scores] == [("a", a, 8), ("b", b, 3)]
    assert r.best == r.scores[0] and len(r) == 2
    # Placements have no engine history to lose.
    assert not any(s.history_lost for s in r.scores)

    # A longer prompt reuses what is held; an unrelated one nothing.
    assert c.query_tokens(MODEL, p + tokens(2, salt=9)).best.blocks == 8
    assert c.query_tokens(MODEL, tokens(4, salt=2)).outcome == "empty"
    # Another keyspace shares nothing; a Keyspace object names the same one as a str.
    assert c.query_tokens("other-model", p).outcome == "empty"
    assert c.query_tokens(kvix.Keyspace(MODEL), p).best.blocks == 8
    assert c.query_tokens(kvix.Keyspace(MODEL, lora="adapter"), p).outcome == "empty"
    # A chain hashed once answers like the tokens.
    assert c.query_chain(MODEL, c.chain(MODEL, p)).scores == r.scores

    st = c.stats()
    assert st.workers == 2 and st.blocks == 8 and st.memberships == 11

    c.retire("b")
    wait_until(lambda: [s.worker for s in c.query_tokens(MODEL, p).scores] == ["a"], "b gone")
    c.retire(a)  # by id
    wait_until(lambda: c.query_tokens(MODEL, p).outcome == "empty", "a gone")

    n = c.counters()
    assert n["scores"] >= 4 and n["empty"] >= 4 and n["failed_open"] == 0
    assert n["queries"] == n["scores"] + n["empty"] + n["timeouts"] + n["disconnected"] + n["rejected"]
    assert n["placements_sent"] == 2 and n["placement_drops"] == 0 and n["connects"] == 1
    assert n["latency_p50_us"] > 0


def test_candidates_and_top_k_limit_the_answer(server):
    c = kvix.Client(server.addr, deadline_ms=SLOW)
    p = tokens(6, salt=3)
    for i, name in enumerate(["w0", "w1", "w2"]):
        placement_worker(c, name)
        placed(c, name, p[:16 * (i + 2)], i + 2)
    full = c.query_tokens(MODEL, p)
    assert [(s.worker, s.blocks) for s in full.scores] == [("w2", 4), ("w1", 3), ("w0", 2)]
    assert [s.worker for s in c.query_tokens(MODEL, p, top_k=1).scores] == ["w2"]
    only = c.query_tokens(MODEL, p, candidates=["w0", c.worker_id("w1")])
    assert [s.worker for s in only.scores] == ["w1", "w0"]
    # Names the server does not know are left out; none known: empty.
    assert c.query_tokens(MODEL, p, candidates=["ghost"]).outcome == "empty"
    # Plain mistakes raise, naming the argument: a string is not read as the workers
    # "w" and "0", and a negative top_k is no OverflowError.
    with pytest.raises(TypeError, match="candidates"):
        c.query_tokens(MODEL, p, candidates="w0")
    with pytest.raises(ValueError, match="top_k"):
        c.query_tokens(MODEL, p, top_k=-1)


# A gateway process: announces nothing, queries the prompts given, places one prompt
# on a worker another process announced and one on a name nobody announced.
GATEWAY = r"""
import json, sys, kvix
addr, model, prompts, extra = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), json.loads(sys.argv[4])
g = kvix.Client(addr, deadline_ms=2000)
answers = [[[s.worker, s.worker_id, s.blocks] for s in g.query_tokens(model, p).scores]
           for p in prompts]
placed = g.publish_placement("w1", model, extra)
ghost = g.publish_placement("ghost", model, extra)
# Placements go out from the client's own thread: a process that exits at once may
# leave its last one unsent, so wait (bounded) until it is on the wire.
import time
for _ in range(500):
    if g.counters()["placements_sent"] >= 1:
        break
    time.sleep(0.01)
print(json.dumps({"answers": answers, "placed": placed, "ghost": ghost,
                  "unknown": g.counters()["unknown_workers"]}))
"""


def test_a_gateway_process_that_announced_nothing_routes_as_the_announcing_one(server):
    import subprocess
    import sys
    c = kvix.Client(server.addr, deadline_ms=SLOW)
    prompts = [tokens(i + 2, salt=40 + i) for i in range(4)]
    for i, p in enumerate(prompts):
        placement_worker(c, f"w{i}")
        placed(c, f"w{i}", p, i + 2)
    # Two workers share a prefix: the answer ranks both.
    placed(c, "w3", prompts[2][:16], 1)
    mine = [[[s.worker, s.worker_id, s.blocks] for s in c.query_tokens(MODEL, p).scores]
            for p in prompts]
    extra = tokens(3, salt=77)
    run = subprocess.run(
        [sys.executable, "-c", GATEWAY, server.addr, MODEL, json.dumps(prompts), json.dumps(extra)],
        capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    theirs = json.loads(run.stdout)
    assert theirs["answers"] == mine
    assert all(score[0] is not None for answer in mine for score in answer)
    assert theirs["placed"] is True
    assert theirs["ghost"] is False and theirs["unknown"] == 1
    # The gateway's placement landed on the announcing process's worker.
    wait_until(lambda: [(s.worker, s.blocks) for s in c.query_tokens(MODEL, extra).scores]
               == [("w1", 3)], "the gateway's placement on w1")


def _in_forked_child(parent_client, addr, prompt):
    """What a fork's child sees: every call on the parent's client raises KvixError,
    a client made in the child works. Runs in the child."""
    seen = {}
    calls = {
        "query": lambda: parent_client.query_tokens(MODEL, prompt),
        "publish": lambda: parent_client.publish_placement("f0", MODEL, prompt),
        "is_connected": lambda: parent_client.is_connected,
        "stats": lambda: parent_client.stats(),
    }
    for name, call in calls.items():
        try:
            call()
            seen[name] = "no error"
        except kvix.KvixError as e:
            seen[name] = str(e)
    parent_client.close()  # harmless in the child
    with kvix.Client(addr, deadline_ms=SLOW) as fresh:
        seen["fresh"] = [[s.worker, s.blocks] for s in fresh.query_tokens(MODEL, prompt).scores]
    return seen


def _read_child(fd, pid, timeout_s=60):
    """The child's JSON from the pipe, or a failure naming the hang (the child is killed)."""
    import select
    import signal
    data = b""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        ready, _, _ = select.select([fd], [], [], 0.5)
        if ready:
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                break
            data += chunk
    else:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        raise AssertionError(f"the forked child hung (got {data!r})")
    os.waitpid(pid, 0)
    return json.loads(data)


def test_a_client_made_before_fork_raises_in_the_child_and_a_new_one_works(server):
    c = kvix.Client(server.addr, deadline_ms=SLOW)
    placement_worker(c, "f0")
    p = tokens(2, salt=61)
    placed(c, "f0", p, 2)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            os.close(r)
            os.write(w, json.dumps(_in_forked_child(c, server.addr, p)).encode())
        except BaseException:
            code = 1
        finally:
            os._exit(code)
    os.close(w)
    seen = _read_child(r, pid)
    os.close(r)
    for call in ("query", "publish", "is_connected", "stats"):
        assert "before it forked" in seen[call], (call, seen[call])
    assert seen["fresh"] == [["f0", 2]]
    # The parent's client is untouched by the child's.
    assert [(s.worker, s.blocks) for s in c.query_tokens(MODEL, p).scores] == [("f0", 2)]
    assert c.publish_placement("f0", MODEL, p)


_POOL_ADDR = None


def _pool_query(prompt):
    """A multiprocessing worker: its own client, made in the worker."""
    with kvix.Client(_POOL_ADDR, deadline_ms=SLOW) as c:
        return [[s.worker, s.blocks] for s in c.query_tokens(MODEL, prompt).scores]


def test_multiprocessing_fork_workers_make_their_own_clients(server):
    import multiprocessing
    global _POOL_ADDR
    _POOL_ADDR = server.addr
    c = kvix.Client(server.addr, deadline_ms=SLOW)  # made before the pool forks
    placement_worker(c, "m0")
    prompts = [tokens(i + 1, salt=70 + i) for i in range(4)]
    for i, p in enumerate(prompts):
        placed(c, "m0", p, i + 1)
    with multiprocessing.get_context("fork").Pool(2) as pool:
        got = pool.map_async(_pool_query, prompts).get(timeout=60)
    assert got == [[["m0", i + 1]] for i in range(4)]
    assert c.query_tokens(MODEL, prompts[0]).best.worker == "m0"


def test_text_prompts_use_the_byte_keyspace(server):
    c = kvix.Client(server.addr, deadline_ms=SLOW)
    placement_worker(c, "t")
    text = "You are a helpful assistant. " * 40  # 1,160 bytes: 4 whole 256-byte chunks
    assert c.publish_placement("t", MODEL, text=text)
    wait_until(lambda: c.query_text(MODEL, text).outcome == "scores", "text placement")
    assert c.query_text(MODEL, text).best.blocks == 4
    assert c.query_text(MODEL, text.encode()).best.blocks == 4
    assert c.chain(MODEL, text=text) == c.chain(MODEL, text=text.encode())
    # The same bytes as token ids are another keyspace kind: nothing shared.
    assert c.query_tokens(MODEL, list(text.encode())).outcome == "empty"


def test_uint32_buffers_and_lists_hash_alike(server):
    c = kvix.Client(server.addr, deadline_ms=SLOW)
    p = tokens(5, salt=4)
    assert c.chain(MODEL, p) == c.chain(MODEL, array.array("I", p)) == c.chain(MODEL, tuple(p))
    assert len(c.chain(MODEL, p + [1, 2, 3])) == 5  # a partial block is not hashed
    for bad in ([1, -1], [2 ** 32], ["x"], [1.5], None):
        with pytest.raises(TypeError):
            c.chain(MODEL, bad)
    with pytest.raises(TypeError):
        c.query_tokens(MODEL, [-1])
    with pytest.raises(TypeError):
        c.query_tokens(42, p)  # keyspace neither str nor Keyspace


def test_hybrid_lanes_are_announced_and_bad_ones_are_value_errors(server):
    c = kvix.Client(server.addr, deadline_ms=SLOW)
    c.announce("hybrid", ["full_attention@16", "sliding_window:64@16"])
    with pytest.raises(ValueError, match="lane"):
        c.announce("bad", ["no_such_kind@16"])
    with pytest.raises(ValueError, match="feed"):
        c.announce("bad", feed="rumours")
    with pytest.raises(ValueError, match="capacity_blocks"):
        c.announce("bad", feed="placements")
    assert c.stats().workers == 1


def test_control_errors_are_typed_exceptions_with_the_rust_message(server, dead_addr):
    c = kvix.Client(server.addr, deadline_ms=SLOW)
    with pytest.raises(kvix.RejectedError) as e:
        c.retire("never-announced")
    assert e.value.code == "UnknownWorker" and "never-announced" in str(e.value)
    assert "Name(" not in str(e.value), str(e.value)
    with pytest.raises(kvix.ConfigError, match="neither host:port nor a socket path"):
        kvix.Client("no-port-here")
    # The form the server prints works; other schemes and bad ports are refused at
    # once (they were taken for socket paths, or accepted, and failed open for ever).
    assert kvix.Client("tcp://" + server.addr, deadline_ms=SLOW).stats() is not None
    with pytest.raises(kvix.ConfigError, match="http://"):
        kvix.Client("http://" + server.addr)
    with pytest.raises(kvix.ConfigError, match="99999"):
        kvix.Client("127.0.0.1:99999")
    with pytest.raises(kvix.ConfigError, match="token_block"):
        kvix.Client(server.addr, token_block=0)
    with pytest.raises(ValueError, match="deadline_ms"):
        kvix.Client(server.addr, deadline_ms=0)
    with pytest.raises(TypeError, match="deadline"):
        kvix.Client(server.addr, deadline=2)  # not an option: deadline_ms is
    # A block size the server does not use is refused at the handshake.
    with pytest.raises(kvix.RejectedError, match="refused the handshake"):
        kvix.Client(server.addr, token_block=32)
    # No server: control calls raise, queries do not.
    down = kvix.Client(dead_addr, connect_timeout_ms=50, request_timeout_ms=50)
    with pytest.raises(kvix.NotConnectedError):
        down.stats()
    with pytest.raises(kvix.NotConnectedError):
        down.announce("w")
    assert issubclass(kvix.NotConnectedError, kvix.KvixError)


def test_clients_close_and_say_how_they_are_made(server):
    with kvix.Client(server.addr, deadline_ms=SLOW) as c:
        assert c.stats() is not None
    with pytest.raises(kvix.KvixError, match="closed"):
        c.stats()
    # The constructor is not the way to an AsyncClient: say which is.
    with pytest.raises(TypeError, match="AsyncClient.connect"):
        kvix.AsyncClient(server.addr)


def test_a_wrong_auth_token_is_refused(start_server, tmp_path):
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    token.chmod(0o600)
    s = start_server("--auth-token-file", str(token))
    with pytest.raises(kvix.RejectedError, match="refused the handshake"):
        kvix.Client(s.addr, auth="wrong")
    assert kvix.Client(s.addr, auth="s3cret").stats().workers == 0


def test_queries_fail_open_at_once_when_no_server_is_up(dead_addr):
    c = kvix.Client(dead_addr, connect_timeout_ms=50)
    assert not c.is_connected and c.primary is None
    results = [c.query_tokens(MODEL, tokens(4)) for _ in range(100)]
    assert {r.outcome for r in results} == {"disconnected"}
    assert all(r.failed_open and r.best is None for r in results)
    n = c.counters()
    assert n["disconnected"] == 100 and n["failed_open"] == 100 and n["scores"] == 0
    # Placements are queued, not refused; with no server they are counted unsent.
    assert c.publish_placement("w", MODEL, tokens(2))
    wait_until(lambda: c.counters()["placements_unsent"] == 1, "placement counted unsent")


def test_a_stopped_server_times_out_every_query_and_the_client_recovers(server):
    c = kvix.Client(server.addr, deadline_ms=5)
    placement_worker(c, "w")
    p = tokens(4, salt=5)
    placed(c, "w", p, 4)
    # On a busy machine a query of `placed`'s wait may have timed out too: count from here.
    before = c.counters()["timeouts"]
    server.pause()
    try:
        results = [c.query_tokens(MODEL, p) for _ in range(50)]
    finally:
        server.resume()
    assert {r.outcome for r in results} == {"timeout"}
    assert c.counters()["timeouts"] - before == 50
    # The late replies arrive after their deadlines and are dropped, counted: one for
    # every query that timed out.
    wait_until(lambda: c.query_tokens(MODEL, p).outcome == "scores", "answers again")
    wait_until(lambda: c.counters()["late_replies"] == c.counters()["timeouts"],
               "a late reply counted for every timeout")


def test_the_gil_is_released_while_a_blocking_call_waits(server):
    c = kvix.Client(server.addr, deadline_ms=SLOW)
    placement_worker(c, "w")
    p = tokens(2, salt=6)
    placed(c, "w", p, 2)
    server.pause()
    entered, outcome = threading.Event(), []

    def waiting_query():
        entered.set()
        # Cannot finish before the server resumes (or 30 s pass).
        outcome.append(c.query_tokens(MODEL, p, deadline_ms=30_000).outcome)

    t = threading.Thread(target=waiting_query)
    t.start()
    entered.wait()
    # This thread runs Python while the other one waits inside the call: had the call
    # kept the GIL, we would only get here after it returned.
    still_waiting = t.is_alive() and not outcome
    server.resume()
    t.join()
    assert still_waiting
    assert outcome == ["scores"]


def test_two_servers_the_second_answers_when_the_first_dies(start_server):
    first, second = start_server(), start_server()
    c = kvix.Client([first.addr, second.addr], deadline_ms=SLOW)
    wait_until(lambda: c.wait_connected(100) and c.counters()["connects"] == 2, "both connected")
    placement_worker(c, "w")  # independent servers: announced on both
    p = tokens(3, salt=7)
    assert c.publish_placement("w", MODEL, p)
    for s in (first, second):
        only = kvix.Client(s.addr, deadline_ms=SLOW)
        wait_until(lambda: only.query_tokens(MODEL, p).outcome == "scores", f"placed on {s.addr}")
    assert c.primary == first.addr
    first.kill()
    wait_until(lambda: c.primary == second.addr, "the second is primary")
    r = c.query_tokens(MODEL, p)
    assert r.outcome == "scores" and r.best.worker == "w" and r.best.blocks == 3
    # Replicas mode and a hedge delay are accepted (replicas are tested in Rust).
    kvix.Client([second.addr], replicas=True, hedge_after_ms=0.5)
    kvix.Client([second.addr], hedge_after_ms=float("inf"))


def test_async_client_does_what_the_blocking_one_does(server, dead_addr):
    async def main():
        c = await kvix.AsyncClient.connect(server.addr, name="pytest-async", deadline_ms=SLOW)
        assert c.is_connected and await c.wait_connected(100)
        w = await c.announce("aw", feed="placements", capacity_blocks=1000)
        assert c.worker_id("aw") == w
        p = tokens(5, salt=8)
        assert c.publish_placement("aw", MODEL, p)
        for _ in range(500):
            r = await c.query_tokens(MODEL, p)
            if r.outcome == "scores":
                break
            await asyncio.sleep(0.01)
        assert [(s.worker, s.blocks) for s in r.scores] == [("aw", 5)]
        assert (await c.query_chain(MODEL, c.chain(MODEL, p))).scores == r.scores
        assert (await c.query_text(MODEL, "x" * 600)).outcome == "empty"
        assert (await c.stats()).workers == 1
        # Spinning for the reply (blocking the loop up to spin_us) answers the same.
        # (These clients did not announce "aw": they know its id, not its name.)
        ids = [(s.worker_id, s.blocks) for s in r.scores]
        async with await kvix.AsyncClient.connect(server.addr, deadline_ms=SLOW, spin_us=500) as sp:
            assert [(s.worker_id, s.blocks) for s in (await sp.query_tokens(MODEL, p)).scores] == ids
        spin = kvix.Client(server.addr, deadline_ms=SLOW, spin_us=500)
        assert [(s.worker_id, s.blocks) for s in spin.query_tokens(MODEL, p).scores] == ids
        # Many at once on one loop: every one completes, answers agree.
        many = await asyncio.gather(*[c.query_tokens(MODEL, p, top_k=1, deadline_ms=10_000)
                                      for _ in range(500)])
        assert all(m.scores == r.scores for m in many)
        with pytest.raises(kvix.RejectedError):
            await c.retire("ghost")
        await c.retire("aw")
        assert (await c.stats()).workers == 0
        c.close()
        c.close()  # twice is harmless
        with pytest.raises(kvix.KvixError, match="closed"):
            await c.query_tokens(MODEL, p)
        async with await kvix.AsyncClient.connect(server.addr, deadline_ms=SLOW) as scoped:
            assert (await scoped.stats()).workers == 0
        with pytest.raises(kvix.KvixError, match="closed"):
            scoped.counters()

        down = await kvix.AsyncClient.connect(dead_addr, connect_timeout_ms=50)
        rs = await asyncio.gather(*[down.query_tokens(MODEL, p) for _ in range(50)])
        assert {x.outcome for x in rs} == {"disconnected"}
        with pytest.raises(kvix.NotConnectedError):
            await down.stats()
        down.close()

    asyncio.run(main())


def test_async_queries_to_a_stopped_server_time_out_and_cancelled_ones_are_harmless(server):
    async def main():
        c = await kvix.AsyncClient.connect(server.addr, deadline_ms=5)
        await c.announce("w", feed="placements", capacity_blocks=1000)
        p = tokens(2, salt=10)
        server.pause()
        try:
            rs = await asyncio.gather(*[c.query_tokens(MODEL, p) for _ in range(100)])
            # Cancelled by the caller before its (long) deadline: nothing breaks.
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(c.query_tokens(MODEL, p, deadline_ms=10_000), 0.05)
        finally:
            server.resume()
        assert {r.outcome for r in rs} == {"timeout"}
        assert c.counters()["timeouts"] == 100
        assert (await c.query_tokens(MODEL, p, deadline_ms=1000)).outcome in ("empty", "scores")
        c.close()

    asyncio.run(main())


def test_scores_equal_the_rust_clients():
    """server/tests/python.rs loads a server and writes the Rust client's answers to
    $KVIX_RUST_ANSWERS; the same queries from Python must answer the same."""
    path = os.environ.get("KVIX_RUST_ANSWERS")
    if not path:
        reason = "KVIX_RUST_ANSWERS is unset (run by `cargo test -p kvix-server --test python`)"
        if os.environ.get("CI") == "true":
            pytest.fail(reason)
        pytest.skip(reason)
    with open(path) as f:
        case = json.load(f)
    c = kvix.Client(case["server"], deadline_ms=SLOW)
    for w in case["workers"]:  # the same roster: the server keeps the ids
        c.announce(w, feed="placements", capacity_blocks=case["capacity_blocks"])

    def mine(r):
        return [[s.worker, s.blocks] for s in r.scores]

    async def async_answers():
        a = await kvix.AsyncClient.connect(case["server"], deadline_ms=SLOW)
        for w in case["workers"]:
            await a.announce(w, feed="placements", capacity_blocks=case["capacity_blocks"])
        out = await asyncio.gather(*[
            a.query_tokens(case["model"], q["tokens"], candidates=q["candidates"] or None, top_k=q["top_k"])
            for q in case["queries"]])
        counted = a.counters()
        a.close()
        return out, counted

    asynced, counted = asyncio.run(async_answers())
    assert len(case["queries"]) >= 100
    for q, ar in zip(case["queries"], asynced):
        r = c.query_tokens(case["model"], q["tokens"], candidates=q["candidates"] or None, top_k=q["top_k"])
        assert r.outcome == q["outcome"], q
        assert mine(r) == q["scores"], q
        assert ar.outcome == q["outcome"] and mine(ar) == q["scores"], (q, counted)


def test_big_endian_buffers_int_subclasses_and_2d_arrays(server):
    """A big-endian uint32 buffer (NumPy's `>u4`) hashes as its values (pyo3 took it
    for native order: wrong hashes, no error); ints that are not exactly `int` (NumPy
    integers, subclasses) are read, not refused; a 2-D buffer is refused by name
    instead of being flattened."""
    import ctypes
    c = kvix.Client(server.addr, deadline_ms=SLOW)
    p = tokens(3, salt=5)
    want = c.chain(MODEL, p)
    be = (ctypes.c_uint32.__ctype_be__ * len(p))(*p)
    assert memoryview(be).format == ">I"
    assert c.chain(MODEL, be) == want

    class Token(int):
        pass

    assert c.chain(MODEL, [Token(t) for t in p]) == want
    import numpy as np
    assert c.chain(MODEL, np.array(p, dtype=">u4")) == want
    assert c.chain(MODEL, np.array(p, dtype="<u4")) == want
    assert c.chain(MODEL, [np.int64(t) for t in p]) == want
    with pytest.raises(TypeError, match="one-dimensional"):
        c.chain(MODEL, np.array(p, dtype=np.uint32).reshape(3, 16))
    two_d = memoryview(array.array("I", p)).cast("B").cast("I", [3, 16])
    with pytest.raises(TypeError, match="one-dimensional"):
        c.chain(MODEL, two_d)
    placement_worker(c, "be0")
    placed(c, "be0", p, 3)
    chain_be = (ctypes.c_uint64.__ctype_be__ * len(want))(*want)
    assert [(s.worker, s.blocks) for s in c.query_chain(MODEL, chain_be).scores] == [("be0", 3)]


class _Interrupted(Exception):
    pass


def test_ctrl_c_interrupts_a_blocking_control_call(server):
    """SIGINT during a control call that waits on a stopped server ends the wait at once
    (it waited for the whole request timeout, then raised)."""
    import signal

    def interrupted(*_):
        raise _Interrupted()

    c = kvix.Client(server.addr, request_timeout_ms=20_000)
    old = signal.signal(signal.SIGINT, interrupted)
    server.pause()
    try:
        timer = threading.Timer(0.3, lambda: os.kill(os.getpid(), signal.SIGINT))
        timer.start()
        with pytest.raises(_Interrupted) as caught:
            c.stats()
        timer.join()
    finally:
        signal.signal(signal.SIGINT, old)
        server.resume()
    # Raised by the handler while waiting, not after the request timed out.
    assert caught.value.__context__ is None, repr(caught.value.__context__)
    assert c.stats().workers == 0


def test_closing_an_async_client_fails_its_pending_calls(server):
    """close() fails what is still pending with KvixError (those awaits hung forever)."""

    async def main():
        c = await kvix.AsyncClient.connect(server.addr, request_timeout_ms=60_000)
        server.pause()
        try:
            pending = c.stats()
            c.close()
            with pytest.raises(kvix.KvixError, match="closed before the reply"):
                await asyncio.wait_for(pending, 30)
        finally:
            server.resume()

    asyncio.run(main())


def test_pick_weighs_reuse_against_load(server, dead_addr):
    c = kvix.Client(server.addr, deadline_ms=SLOW)
    p = tokens(8, salt=90)
    for name in ("p0", "p1"):
        placement_worker(c, name)
    placed(c, "p0", p, 8)
    placed(c, "p1", p[:16 * 2], 2)
    r = c.query_tokens(MODEL, p)

    def chosen(loads, **kw):
        pk = kvix.pick(r, loads, **kw)
        return pk.worker, pk.blocks

    assert chosen({"p0": 0, "p1": 0, "idle": 0}) == ("p0", 8)
    # Placements are GPU blocks: every tier's depth is the joint one.
    best = r.best
    assert (best.gpu, best.cpu, best.storage, best.reuse) == (8, 8, 8, 8.0)
    assert best.suspect is None
    assert kvix.pick(r, {"p0": 0}).reuse == 8.0
    # p0: 8 - 7 = 1 < p1: 2 - 0; with alpha 0.1 reuse wins again; pairs work as a dict.
    assert chosen({"p0": 7, "p1": 0}) == ("p1", 2)
    assert chosen([("p0", 7), ("p1", 0)], alpha=0.1) == ("p0", 8)
    # Load alone decides when nothing is reusable or the query failed open.
    assert chosen({"p0": 9, "p1": 9, "idle": 1}, alpha=2.0) == ("idle", 0)
    with kvix.Client(dead_addr) as dead:
        failed = dead.query_tokens(MODEL, p)
    assert failed.failed_open
    assert kvix.pick(failed, {"p0": 3, "p1": 1}).worker == "p1"
    # Equal workers share the work.
    seen = {kvix.pick(failed, {"a": 0, "b": 0, "c": 0}).worker for _ in range(60)}
    assert seen == {"a", "b", "c"}
    with pytest.raises(ValueError, match="no workers"):
        kvix.pick(r, {})
    with pytest.raises(ValueError, match="alpha"):
        kvix.pick(r, {"p0": 0}, alpha=-1)
    with pytest.raises(TypeError, match="loads"):
        kvix.pick(r, 3)


def _tokenizers():
    """The engine's tokenizer, built here (no hub download): a word-level `tokenizers`
    Tokenizer, and the same wrapped by transformers with a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    words = ["[UNK]", "<|user|>", "<|assistant|>"] + [f"w{i}" for i in range(400)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")
    hf.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    return tok, hf


def _ids(x):
    return list(x["input_ids"] if hasattr(x, "keys") else x)


def test_text_and_chat_prompts_are_tokenized_as_the_engine_does(server):
    tok, hf = _tokenizers()
    c = kvix.Client(server.addr, deadline_ms=SLOW)
    placement_worker(c, "t0")
    text = " ".join(f"w{i}" for i in range(40))
    ids = tok.encode(text).ids
    assert len(ids) == 40
    assert c.chain(MODEL, text=text, tokenizer=tok) == c.chain(MODEL, ids)
    assert c.chain(MODEL, text=text, tokenizer=hf) == c.chain(MODEL, ids)
    # Stored as the engine's token ids: found by the text tokenized, not by its bytes.
    placed(c, "t0", ids, 2)
    assert c.query_text(MODEL, text, tokenizer=tok).best.blocks == 2
    assert c.query_text(MODEL, text).outcome == "empty"

    turn1 = [{"role": "user", "content": " ".join(f"w{i}" for i in range(100, 150))}]
    chat1 = _ids(hf.apply_chat_template(turn1, tokenize=True, add_generation_prompt=True))
    assert c.chain(MODEL, messages=turn1, tokenizer=hf) == c.chain(MODEL, chat1)
    assert c.publish_placement("t0", MODEL, messages=turn1, tokenizer=hf)
    wait_until(lambda: c.query_chat(MODEL, turn1, hf).best is not None, "the chat placement")
    assert c.query_chat(MODEL, turn1, hf).best.blocks == len(chat1) // 16
    # A follow-up reuses the first turn's whole blocks.
    turn2 = turn1 + [{"role": "assistant", "content": "w1 w2 w3"},
                     {"role": "user", "content": "w4 w5"}]
    assert c.query_chat(MODEL, turn2, hf).best.blocks == len(chat1) // 16

    async def in_asyncio():
        async with await kvix.AsyncClient.connect(server.addr, deadline_ms=SLOW) as a:
            return (await a.query_chat(MODEL, turn1, hf)).best.blocks, \
                (await a.query_text(MODEL, text, tokenizer=tok)).best.blocks
    assert asyncio.run(in_asyncio()) == (len(chat1) // 16, 2)

    with pytest.raises(TypeError, match="apply_chat_template"):
        c.query_chat(MODEL, turn1, tok)
    with pytest.raises(TypeError, match="messages"):
        c.query_chat(MODEL, "hello", hf)
    with pytest.raises(TypeError, match="tokenizer"):
        c.publish_placement("t0", MODEL, messages=turn1)
    with pytest.raises(TypeError, match="one of"):
        c.chain(MODEL, ids, text=text)


def test_the_prometheus_collector_exports_the_counters(server):
    from prometheus_client import CollectorRegistry, generate_latest
    c = kvix.Client(server.addr, deadline_ms=SLOW)
    c.query_tokens(MODEL, tokens(1))
    assert c.publish_placement(10**6, MODEL, tokens(1))  # an id the server refuses
    wait_until(lambda: c.counters().get("writes_refused.UnknownWorker") == 1, "the refusal")
    reg = CollectorRegistry()
    reg.register(kvix.PrometheusCollector(c, labels={"gateway": "g1"}))
    text = generate_latest(reg).decode()
    n = c.counters()
    assert f'kvix_client_queries_total{{gateway="g1"}} {float(n["queries"])}' in text
    assert f'kvix_client_placements_sent_total{{gateway="g1"}} {float(n["placements_sent"])}' in text
    assert 'kvix_client_writes_refused_total{code="UnknownWorker",gateway="g1"} 1.0' in text
    assert 'kvix_client_latency_us{gateway="g1",quantile="0.99"}' in text
    assert "kvix_client_writes_refused_total{gateway=\"g1\"} " not in text


def test_tls_to_a_tls_port_and_a_clear_error_for_an_untrusted_certificate(start_server, tls_dir):
    d = tls_dir  # server/tests/python.rs makes the certificates (rcgen)
    s = start_server("--tls-cert", os.path.join(d, "server.pem"),
                     "--tls-key", os.path.join(d, "server.key"))
    c = kvix.Client(s.addr, tls_ca=os.path.join(d, "ca.pem"), deadline_ms=SLOW)
    c.announce("a", feed="placements", capacity_blocks=100)
    p = tokens(4, salt=7)
    placed(c, "a", p, 4)
    assert c.query_tokens(MODEL, p).best.blocks == 4
    c.close()
    with pytest.raises(kvix.TlsError, match="certificate"):
        kvix.Client(s.addr, tls_ca=os.path.join(d, "other-ca.pem"))
    with pytest.raises(ValueError, match="tls_cert and tls_key"):
        kvix.Client(s.addr, tls_ca=os.path.join(d, "ca.pem"), tls_cert=os.path.join(d, "server.pem"))


def test_tier_weights_are_checked(server):
    with kvix.Client(server.addr, tier_weights=(0.5, 0.1)) as c:
        assert c.wait_connected()
    with pytest.raises(kvix.ConfigError, match="tier_weights"):
        kvix.Client(server.addr, tier_weights=(2.0, 0.0))
    with pytest.raises(TypeError, match="tier_weights"):
        kvix.Client(server.addr, tier_weights="heavy")


def test_reuse_reports_flag_a_worker_the_engine_contradicts(server):
    with kvix.Client(server.addr, name="pytest-reuse", deadline_ms=SLOW) as c:
        a = placement_worker(c, "a")
        p = tokens(8, salt=3)
        placed(c, "a", p, 8)
        held = 8 * 16
        # No usage figure in the response: no report.
        assert not c.report_reuse("a", MODEL, predicted_tokens=held, cached_tokens=None,
                                  prompt_tokens=len(p) + 5)
        # The engine keeps reusing 2 blocks where kvix predicts 8: its placements outlive
        # what it holds. Sixteen such reports name it. (Reusing nothing at all, 4 times
        # in a row, is an engine that lost its cache: its placements are dropped instead.)
        for _ in range(16):
            assert c.report_reuse(a, MODEL, predicted_tokens=held, cached_tokens=2 * 16,
                                  prompt_tokens=len(p) + 5)
        wait_until(lambda: c.query_tokens(MODEL, p).best.suspect == "EventsLagging",
                   "a flagged")
        for _ in range(4):
            assert c.report_reuse(a, MODEL, predicted_tokens=held, cached_tokens=0,
                                  prompt_tokens=len(p) + 5)
        wait_until(lambda: c.query_tokens(MODEL, p).best is None, "a's placements dropped")
        n = c.counters()
        assert n["reuse_reports_sent"] == 20 and n["reuse_unreported"] == 1
