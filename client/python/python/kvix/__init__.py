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
    Pick,
    ProtocolError,
    TlsError,
    QueryResult,
    RejectedError,
    RequestTimeoutError,
    Score,
    Stats,
    __version__,
    pick,
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
    "Pick",
    "ProtocolError",
    "TlsError",
    "QueryResult",
    "RejectedError",
    "RequestTimeoutError",
    "Score",
    "PrometheusCollector",
    "Stats",
    "pick",
]

KeyspaceLike = Union[Keyspace, str]
Worker = Union[str, int]

_TOKENS, _TEXT, _CHAIN = 0, 1, 2


def _servers(servers: Union[str, Sequence[str]]) -> list:
    if isinstance(servers, str):
        return [s for s in servers.split(",") if s.strip()]
    return list(servers)


def _encode(tokenizer: Any, text: Union[str, bytes]) -> Any:
    """Token ids of `text` as the engine's tokenizer makes them: a transformers
    tokenizer's `encode` (a list of ints, with the special tokens the engine adds too) or
    a tokenizers `Tokenizer.encode` (an `Encoding`: its `.ids`)."""
    if not hasattr(tokenizer, "encode"):
        raise TypeError("tokenizer: an object with encode(text) (transformers, tokenizers)")
    if isinstance(text, bytes):
        text = text.decode()
    ids = tokenizer.encode(text)
    return getattr(ids, "ids", ids)


def _chat_ids(tokenizer: Any, messages: Any, add_generation_prompt: bool) -> Any:
    """Token ids of a chat as the engine builds its prompt: the tokenizer's chat template
    applied to `messages` ([{"role": ..., "content": ...}, ...]) with the generation
    prompt, as vLLM's and SGLang's OpenAI servers do."""
    if not hasattr(tokenizer, "apply_chat_template"):
        raise TypeError(
            "tokenizer: an object with apply_chat_template(messages) (a transformers tokenizer) "
            "for chat messages")
    if isinstance(messages, (str, bytes)):
        raise TypeError("messages: a list of {'role': ..., 'content': ...} dicts, not a string")
    ids = tokenizer.apply_chat_template(
        list(messages), tokenize=True, add_generation_prompt=add_generation_prompt)
    # transformers may hand back a BatchEncoding (a dict) rather than a list.
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return ids


def _prompt(token_ids: Any, text: Any, messages: Any, tokenizer: Any,
            add_generation_prompt: bool = True) -> tuple:
    """(prompt kind, prompt) from exactly one of token ids, text or chat messages: text
    with a tokenizer and messages (which need one) become token ids."""
    given = [n for n, v in (("token_ids", token_ids), ("text", text), ("messages", messages))
             if v is not None]
    if len(given) != 1:
        raise TypeError(f"give one of token_ids, text or messages, not {given or 'none'}")
    if messages is not None:
        if tokenizer is None:
            raise TypeError("messages need the engine's tokenizer (tokenizer=...)")
        return _TOKENS, _chat_ids(tokenizer, messages, add_generation_prompt)
    if text is not None:
        if tokenizer is not None:
            return _TOKENS, _encode(tokenizer, text)
        return _TEXT, text
    return _TOKENS, token_ids


class _Closed:
    """Stands in for the Rust client after `close()`."""

    def __getattr__(self, name: str) -> Any:
        raise KvixError("this kvix client is closed")


class _Base:
    """What both clients share: the calls that never wait."""

    _core: _Core

    def publish_placement(
        self, worker: Worker, keyspace: KeyspaceLike, token_ids: Any = None, *,
        text: Union[str, bytes, None] = None, messages: Any = None, tokenizer: Any = None,
    ) -> bool:
        """Records that the request for this prompt went to `worker` (name or id), so
        later queries see it there. Never blocks: queued and sent in the background.
        False, counted, when the placement was dropped: the queue was full
        (`placement_drops`), or `worker` is a name no client announced on the server
        as far as this client has learnt (`unknown_workers`; the server is asked for
        that name at once, so a worker announced a moment ago is placed on the next
        call). Any client's workers can be named: a gateway need not announce them.
        Give one of `token_ids`, `text` (with `tokenizer`: as its token ids, else in the
        byte keyspace) or chat `messages` (with `tokenizer`), as the query was given."""
        kind, prompt = _prompt(token_ids, text, messages, tokenizer)
        return self._core.publish_placement(worker, keyspace, kind, prompt)

    def report_reuse(self, worker: Worker, model: str, *, predicted_tokens: Optional[int],
                     cached_tokens: Optional[int], prompt_tokens: int) -> bool:
        """Reports what the engine said it reused for a request routed to `worker`
        (`usage.prompt_tokens_details.cached_tokens` of its response), against the reuse
        the answer predicted for it in tokens (`Score.blocks` times the token block;
        None when `worker` was not in the answer). The server judges the reports and
        names a worker, or this gateway, whose figures disagree (docs/operations.md,
        "Reuse verdicts"); answers then flag the worker (`Score.suspect`). Never blocks:
        batched and sent in the background, no prompt text. `cached_tokens` None (the
        response carried no usage figure) is no report, never 0: False, counted
        (`reuse_unreported`); False too when the queue is full (`reuse_drops`)."""
        return self._core.report_reuse(worker, model, predicted_tokens, cached_tokens,
                                       prompt_tokens)

    def chain(self, keyspace: KeyspaceLike, token_ids: Any = None, *,
              text: Union[str, bytes, None] = None, messages: Any = None,
              tokenizer: Any = None) -> list:
        """The prompt's chain of block hashes as the server indexes it (the prompt given
        as in `publish_placement`)."""
        kind, prompt = _prompt(token_ids, text, messages, tokenizer)
        return self._core.chain(keyspace, kind, prompt)

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
        stale_answers (answers of a replica behind its log; the query went on to the
        next server), and latency_p50_us / p99 / max over all queries."""
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
    tier_weights: (cpu, storage), what reuse from CPU memory and from storage is worth
      against reuse from GPU, each in [0, 1] ((0.75, 0.25), Dynamo's): answers are ranked
      by it and each `Score.reuse` (what `pick` weighs) is weighed by it.
    tls_ca: PEM file of the CA a server's certificate is signed by: TLS to the servers
      at TCP addresses (kvix-server --tls-cert; Unix sockets stay plain).
      tls_server_name: the name the certificate must hold (default: each address's
      host). tls_cert, tls_key: this client's certificate and key (PEM), for a server
      with --tls-client-ca.

    Raises ConfigError for a configuration that cannot work, RejectedError when a
    server refuses the handshake (auth, block size) and TlsError when TLS fails (an
    untrusted certificate, a port without TLS). A server that is down is not an
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
        candidates: Optional[Iterable[Worker]] = None, top_k: int = 0, tokenizer: Any = None,
    ) -> QueryResult:
        """`query_tokens` for a prompt given as text. With `tokenizer` (the engine's:
        anything with `encode`, from transformers or tokenizers) the text is queried as
        its token ids, which engine events fill. Without, in the keyspace's byte kind (for
        gateways that do not tokenize; placements must then be published as text too).
        Tokenizing is the caller's time, before the deadline starts."""
        kind, prompt = _prompt(None, text, None, tokenizer)
        return self._core.query(keyspace, kind, prompt, deadline_ms, candidates, top_k, None)

    def query_chat(
        self, keyspace: KeyspaceLike, messages: Any, tokenizer: Any,
        deadline_ms: Optional[float] = None, candidates: Optional[Iterable[Worker]] = None,
        top_k: int = 0, add_generation_prompt: bool = True,
    ) -> QueryResult:
        """`query_tokens` for an OpenAI chat request's `messages`, tokenized as the
        engine's OpenAI server does: `tokenizer.apply_chat_template(messages,
        add_generation_prompt=True)` (a transformers tokenizer of the served model)."""
        prompt = _chat_ids(tokenizer, messages, add_generation_prompt)
        return self._core.query(keyspace, _TOKENS, prompt, deadline_ms, candidates, top_k, None)

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
        candidates: Optional[Iterable[Worker]] = None, top_k: int = 0, tokenizer: Any = None,
    ) -> Awaitable[QueryResult]:
        """See `Client.query_text`."""
        kind, prompt = _prompt(None, text, None, tokenizer)
        return self._core.query(keyspace, kind, prompt, deadline_ms, candidates, top_k, self._done)

    def query_chat(
        self, keyspace: KeyspaceLike, messages: Any, tokenizer: Any,
        deadline_ms: Optional[float] = None, candidates: Optional[Iterable[Worker]] = None,
        top_k: int = 0, add_generation_prompt: bool = True,
    ) -> Awaitable[QueryResult]:
        """See `Client.query_chat`."""
        prompt = _chat_ids(tokenizer, messages, add_generation_prompt)
        return self._core.query(keyspace, _TOKENS, prompt, deadline_ms, candidates, top_k, self._done)

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


# Keys of `counters()` that are gauges (the rest are Prometheus counters).
_GAUGES = ("latency_p50_us", "latency_p99_us", "latency_max_us")


class PrometheusCollector:
    """A client's counters for `prometheus_client`:

        prometheus_client.REGISTRY.register(kvix.PrometheusCollector(client))

    Each counter of `counters()` becomes `PREFIX_<name>_total` (refused fire-and-forget
    writes as `PREFIX_writes_refused_total{code=...}`), the latency quantiles
    `PREFIX_latency_us{quantile="0.5"|"0.99"|"1"}`. `labels` are added to every series
    (e.g. {"gateway": "router-3"}). Read at each scrape, from Rust: no Python objects
    are kept per query."""

    def __init__(self, client: "_Base", prefix: str = "kvix_client",
                 labels: Optional[dict] = None) -> None:
        self._client = client
        self._prefix = prefix
        self._labels = dict(labels or {})

    def describe(self) -> list:
        # Nothing up front: the registry then collects once to learn the names, which
        # needs no server (the counters are the client's own).
        return []

    def collect(self) -> Iterable[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        c = self._client.counters()
        names, values = list(self._labels), list(self._labels.values())
        refused = CounterMetricFamily(
            f"{self._prefix}_writes_refused",
            "fire-and-forget writes (placements, retires) a server refused, by error code",
            labels=names + ["code"])
        latency = GaugeMetricFamily(
            f"{self._prefix}_latency_us", "query latency quantiles since start, microseconds",
            labels=names + ["quantile"])
        for key, value in c.items():
            if key.startswith("writes_refused."):
                refused.add_metric(values + [key.split(".", 1)[1]], value)
            elif key in _GAUGES:
                q = {"latency_p50_us": "0.5", "latency_p99_us": "0.99", "latency_max_us": "1"}[key]
                latency.add_metric(values + [q], value)
            elif key != "writes_refused":
                family = CounterMetricFamily(
                    f"{self._prefix}_{key}", f"kvix client counter {key} (see Client.counters)",
                    labels=names)
                family.add_metric(values, value)
                yield family
        yield refused
        yield latency
