"""kvix for Python gateways: ask a kvix server which inference worker already holds the
longest reusable prefix of a prompt's KV cache, inside a deadline.

Every call goes to the Rust client (kvix-client); nothing of the protocol is in Python.

    import kvix

    client = kvix.Client(["127.0.0.1:7420"])
    client.announce("worker-0")
    result = client.query_tokens("llama-3-8b", token_ids)
    if result.best:
        send_to(result.best.worker)
        client.publish_placement(result.best.worker, "llama-3-8b", token_ids)

`AsyncClient` is the same for asyncio (`await client.query_tokens(...)`). Queries never
raise for the server's sake: they return a `QueryResult` whose `failed_open` is true when
the server was down or slow (route without the index then). Control calls (announce,
retire, stats) raise `KvixError` subclasses with the Rust error's message.

Forks: a client made before `os.fork()` (gunicorn `--preload`, multiprocessing's fork)
raises `KvixError` at its first call in the child; make each process's client in that
process (a client made in the child works).
"""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Iterable, Optional, Sequence, Union

from ._kvix import (
    Completer as _Completer,
    ConfigError,
    Core as _Core,
    DisconnectedError,
    EventSource,
    Keyspace,
    KvixError,
    NotConnectedError,
    ProtocolError,
    QueryResult,
    RejectedError,
    RequestTimeoutError,
    Score,
    Stats,
)

__all__ = [
    "AsyncClient",
    "Client",
    "ConfigError",
    "DisconnectedError",
    "EventSource",
    "Keyspace",
    "KvixError",
    "NotConnectedError",
    "ProtocolError",
    "QueryResult",
    "RejectedError",
    "RequestTimeoutError",
    "Score",
    "Stats",
]

KeyspaceLike = Union[Keyspace, str]
Worker = Union[str, int]

_TOKENS, _TEXT, _CHAIN = 0, 1, 2


def _servers(servers: Union[str, Sequence[str]]) -> list:
    if isinstance(servers, str):
        return [s for s in servers.split(",") if s.strip()]
    return list(servers)


class _Closed:
    """Stands in for the Rust client after `close()`."""

    def __getattr__(self, name: str) -> Any:
        raise KvixError("this kvix client is closed")


class _Base:
    """What both clients share: the calls that never wait."""

    _core: _Core

    def publish_placement(
        self, worker: Worker, keyspace: KeyspaceLike, token_ids: Any = None, *,
        text: Union[str, bytes, None] = None,
    ) -> bool:
        """Records that the request for this prompt went to `worker` (name or id), so
        later queries see it there. Never blocks: queued and sent in the background.
        False, counted, when the placement was dropped: the queue was full
        (`placement_drops`), or `worker` is a name no client announced on the server
        as far as this client has learnt (`unknown_workers`; the server is asked for
        that name at once, so a worker announced a moment ago is placed on the next
        call). Any client's workers can be named: a gateway need not announce them.
        Give either `token_ids` or `text`."""
        if text is not None:
            return self._core.publish_placement(worker, keyspace, _TEXT, text)
        return self._core.publish_placement(worker, keyspace, _TOKENS, token_ids)

    def chain(self, keyspace: KeyspaceLike, token_ids: Any = None, *,
              text: Union[str, bytes, None] = None) -> list:
        """The prompt's chain of block hashes as the server indexes it."""
        if text is not None:
            return self._core.chain(keyspace, _TEXT, text)
        return self._core.chain(keyspace, _TOKENS, token_ids)

    @property
    def is_connected(self) -> bool:
        """Whether some server connection is up now."""
        return self._core.is_connected()

    @property
    def primary(self) -> Optional[str]:
        """The server queries go to now (the first one up), or None."""
        return self._core.primary()

    def worker_id(self, name: str) -> Optional[int]:
        """The id the primary server gave the worker `name`, announced by any client
        (None until this client has learnt it: its roster is fetched at connect and
        every second)."""
        return self._core.worker_id(name)

    def counters(self) -> dict:
        """This client's counters: query outcomes (scores, empty, timeouts,
        disconnected, rejected, failed_open), placements (sent, drops, unsent),
        unknown_workers (placements and candidates naming a worker the server does not
        know),
        connections, hedges, failovers (queries sent again after a lost connection),
        and latency_p50_us / p99 / max over all queries."""
        return self._core.counters()


class Client(_Base):
    """A blocking kvix client. Each call blocks the calling thread with the GIL
    released; one background thread (shared by all clients) keeps the connections up,
    reconnecting with backoff and re-announcing this client's workers.

    servers: "host:port", "tcp://host:port" or "unix:/path", a list or a comma-separated string, in order of
      preference; queries go to the first one up.

    Options (keywords; the Rust client's defaults):
    token_block: tokens per block (16); must match the server's (`--block-size`).
    deadline_ms: what a query may take in all (2.0); past it the query fails open.
    replicas: the servers are replicas of one log (`kvix-server --log`): writes go to the
      primary only. Otherwise (False) every server is sent every write.
    hedge_after_ms: with several servers, a query the primary has not answered after
      this long also goes to the next one; None: the client's own p95 (at most half the
      deadline); float("inf"): never.
    spin_us: spin this long for a reply before parking the thread (lower latency, one
      core busy meanwhile; asyncio: the loop is blocked meanwhile); None: park at once.
    auth: the server's shared token (--auth-token). name: this client in the server's
      logs ("kvix-python"). connect_timeout_ms, request_timeout_ms: limits on a
      connection attempt and on control calls (1000). placement_queue: placements
      waiting to be sent before new ones are dropped and counted (4096).

    Raises ConfigError for a configuration that cannot work and RejectedError when a
    server refuses the handshake (auth, block size). A server that is down is not an
    error: the client keeps trying, and queries fail open meanwhile.
    """

    def __init__(self, servers: Union[str, Sequence[str]] = "127.0.0.1:7420", **options: Any) -> None:
        self._core = _Core.open(_servers(servers), options, None)

    def query_tokens(
        self, keyspace: KeyspaceLike, token_ids: Any, deadline_ms: Optional[float] = None,
        candidates: Optional[Iterable[Worker]] = None, top_k: int = 0,
    ) -> QueryResult:
        """Which workers can reuse how much of the prompt given as token ids (a list of
        ints, an array('I') or a NumPy uint32 array). Never raises for the server's
        sake and never takes longer than the deadline. `candidates`: only these workers
        (names or ids); `top_k`: at most this many scores (0: all)."""
        return self._core.query(keyspace, _TOKENS, token_ids, deadline_ms, candidates, top_k, None)

    def query_text(
        self, keyspace: KeyspaceLike, text: Union[str, bytes], deadline_ms: Optional[float] = None,
        candidates: Optional[Iterable[Worker]] = None, top_k: int = 0,
    ) -> QueryResult:
        """`query_tokens` for a prompt given as text, in the keyspace's byte kind (for
        gateways that do not tokenize; placements must then be published as text too)."""
        return self._core.query(keyspace, _TEXT, text, deadline_ms, candidates, top_k, None)

    def query_chain(
        self, keyspace: KeyspaceLike, chain: Any, deadline_ms: Optional[float] = None,
        candidates: Optional[Iterable[Worker]] = None, top_k: int = 0,
    ) -> QueryResult:
        """`query_tokens` for a chain of block hashes from `chain()`."""
        return self._core.query(keyspace, _CHAIN, chain, deadline_ms, candidates, top_k, None)

    def announce(
        self, name: str, lanes: Optional[Sequence[str]] = None, *, feed: str = "events",
        capacity_blocks: int = 0, ttl_ms: int = 0, source: Optional[EventSource] = None,
    ) -> int:
        """Registers a worker (and re-registers it on every reconnect); returns its id
        on the primary server. `lanes`: "kind@block_tokens" strings for hybrid models
        (e.g. ["full_attention@16", "sliding_window:4096@16"]); default one full lane.
        `feed`: "events" (the worker's engine publishes KV events; give `source` to have
        the server subscribe to them) or "placements" (learnt from publish_placement,
        capped at `capacity_blocks`, expiring after `ttl_ms`, 0 = never)."""
        return self._core.announce(name, lanes, feed, capacity_blocks, ttl_ms, source, None)

    def retire(self, worker: Worker) -> None:
        """Removes a worker (name or id) and everything it held."""
        self._core.retire(worker, None)

    def stats(self) -> Stats:
        """The primary server's counters."""
        return self._core.stats(None)

    def wait_connected(self, timeout_ms: float = 1000.0) -> bool:
        """Waits until some server is up (at most `timeout_ms`); whether one is."""
        return self._core.wait_connected(timeout_ms, None)

    def close(self) -> None:
        """Closes the client: its connections go and later calls raise KvixError. Also
        what leaving `with client:` does."""
        self._core = _Closed()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *_exc: Any) -> None:
        self.close()


class AsyncClient(_Base):
    """The asyncio twin of `Client`: the same calls, awaited. Make one with
    `await AsyncClient.connect(...)` (same arguments as `Client`) inside the event loop
    that will use it. Replies are delivered to that loop (through a descriptor it
    watches); the loop is never blocked waiting, and the client's I/O thread never
    waits for the GIL."""

    def __init__(self, core: Any, done: Optional[_Completer] = None,
                 loop: Optional[asyncio.AbstractEventLoop] = None) -> None:
        if not isinstance(core, _Core) or done is None or loop is None:
            raise TypeError(
                "an AsyncClient is made inside its event loop with "
                "`await kvix.AsyncClient.connect(servers, ...)`"
            )
        self._core = core
        self._done = done
        self._loop = loop

    @classmethod
    async def connect(cls, servers: Union[str, Sequence[str]] = "127.0.0.1:7420",
                      **options: Any) -> "AsyncClient":
        """Connects; the same servers and options as `Client`."""
        loop = asyncio.get_running_loop()
        done = _Completer(loop)
        loop.add_reader(done.fileno(), done.drain)
        try:
            return cls(await _Core.open(_servers(servers), options, done), done, loop)
        except BaseException:
            loop.remove_reader(done.fileno())
            raise

    def close(self) -> None:
        """Closes the client: its connections go, calls still pending raise KvixError
        ("closed before the reply"), later calls raise KvixError. Also what leaving
        `async with client:` does."""
        if not isinstance(self._core, _Closed):
            self._loop.remove_reader(self._done.fileno())
            self._done.close()
            self._core = _Closed()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *_exc: Any) -> None:
        self.close()

    def query_tokens(
        self, keyspace: KeyspaceLike, token_ids: Any, deadline_ms: Optional[float] = None,
        candidates: Optional[Iterable[Worker]] = None, top_k: int = 0,
    ) -> Awaitable[QueryResult]:
        """See `Client.query_tokens`."""
        return self._core.query(keyspace, _TOKENS, token_ids, deadline_ms, candidates, top_k, self._done)

    def query_text(
        self, keyspace: KeyspaceLike, text: Union[str, bytes], deadline_ms: Optional[float] = None,
        candidates: Optional[Iterable[Worker]] = None, top_k: int = 0,
    ) -> Awaitable[QueryResult]:
        """See `Client.query_text`."""
        return self._core.query(keyspace, _TEXT, text, deadline_ms, candidates, top_k, self._done)

    def query_chain(
        self, keyspace: KeyspaceLike, chain: Any, deadline_ms: Optional[float] = None,
        candidates: Optional[Iterable[Worker]] = None, top_k: int = 0,
    ) -> Awaitable[QueryResult]:
        """See `Client.query_chain`."""
        return self._core.query(keyspace, _CHAIN, chain, deadline_ms, candidates, top_k, self._done)

    def announce(
        self, name: str, lanes: Optional[Sequence[str]] = None, *, feed: str = "events",
        capacity_blocks: int = 0, ttl_ms: int = 0, source: Optional[EventSource] = None,
    ) -> Awaitable[int]:
        """See `Client.announce`."""
        return self._core.announce(name, lanes, feed, capacity_blocks, ttl_ms, source, self._done)

    def retire(self, worker: Worker) -> Awaitable[None]:
        """See `Client.retire`."""
        return self._core.retire(worker, self._done)

    def stats(self) -> Awaitable[Stats]:
        """See `Client.stats`."""
        return self._core.stats(self._done)

    def wait_connected(self, timeout_ms: float = 1000.0) -> Awaitable[bool]:
        """See `Client.wait_connected`."""
        return self._core.wait_connected(timeout_ms, self._done)
