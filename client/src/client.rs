//! The async client: connections, failover, re-announce, queries, placements.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvix_wire::chain::{byte_chain, token_chain};
use kvix_wire::{
    encode, Announce, Answer, Body, ChunkKind, Echo, ErrorCode, ErrorReply, Feed, Hello, Keyspace,
    Kind, Lane, Placement, Query, Retire, Stats, StatsRequest, WorkerId, BYTE_CHUNK, FLAG_NO_REPLY,
};
use tokio::runtime::RuntimeFlavor;
use tokio::sync::{mpsc, oneshot, watch};

use crate::conn::{dial, Conn, FrameReader, Reply};
use crate::counters::{Counters, CountersSnapshot};
use crate::{Addr, ClientConfig, ClientError};

/// tokio's timers tick in whole milliseconds and round up: the client parks until this
/// long before a deadline and checks the last stretch by yielding, so a query never
/// returns later than its deadline because of timer rounding.
const TIMER_SLACK: Duration = Duration::from_millis(1);

/// A worker named by the id the server gave it or by its announced name.
///
/// Names are stable across server restarts and across servers; ids are the ones the
/// *primary* server (the first one up) assigned, and may change when it restarts.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum WorkerRef {
    /// An id, as the primary server numbers workers.
    Id(WorkerId),
    /// The name the worker was announced under.
    Name(Arc<str>),
}

impl From<WorkerId> for WorkerRef {
    fn from(id: WorkerId) -> Self {
        WorkerRef::Id(id)
    }
}

impl From<&str> for WorkerRef {
    fn from(name: &str) -> Self {
        WorkerRef::Name(name.into())
    }
}

impl From<String> for WorkerRef {
    fn from(name: String) -> Self {
        WorkerRef::Name(name.into())
    }
}

impl From<&String> for WorkerRef {
    fn from(name: &String) -> Self {
        WorkerRef::Name(name.as_str().into())
    }
}

/// A prompt to query by.
#[derive(Debug, Clone, Copy)]
pub enum Prompt<'a> {
    /// Token ids: hashed in the keyspace's token kind, `token_block` tokens per block.
    Tokens(&'a [u32]),
    /// Prompt bytes (a string prompt): hashed in the byte kind, [`BYTE_CHUNK`] per block.
    Bytes(&'a [u8]),
    /// A chain already hashed by the caller; the keyspace is used as given.
    Chain(&'a [u64]),
}

/// Options of one query.
#[derive(Debug, Clone, Default)]
pub struct QueryOptions {
    /// Only these workers are scored; empty = all. Names and ids that the answering
    /// server does not know are left out; if none is known the answer is `Empty`.
    pub candidates: Vec<WorkerRef>,
    /// At most this many scores, best first; 0 = all.
    pub top_k: u32,
    /// This query's deadline instead of the configured one.
    pub deadline: Option<Duration>,
}

/// One worker's joint reusable prefix.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerScore {
    /// The worker's id on the server that answered.
    pub worker: WorkerId,
    /// Its name, when this client announced it (or learnt it otherwise).
    pub name: Option<Arc<str>>,
    /// Reusable prefix, in keyspace blocks.
    pub blocks: u32,
}

/// What a query came to. Every variant but `Scores` means "route without the index".
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum QueryOutcome {
    /// Workers that can reuse part of the prompt, best first.
    Scores(Vec<WorkerScore>),
    /// The server answered: no worker can reuse any of it.
    Empty,
    /// No answer within the deadline (failed open).
    Timeout,
    /// No connection was up, or it was lost before the answer (failed open).
    Disconnected,
    /// The server refused the query (or the client could not form it: code `BadFrame`).
    Rejected(ErrorReply),
}

impl QueryOutcome {
    /// The best worker, if any scored.
    pub fn best(&self) -> Option<&WorkerScore> {
        match self {
            QueryOutcome::Scores(s) => s.first(),
            _ => None,
        }
    }

    /// A short name of the variant, for logs and metric labels.
    pub fn kind(&self) -> &'static str {
        match self {
            QueryOutcome::Scores(_) => "scores",
            QueryOutcome::Empty => "empty",
            QueryOutcome::Timeout => "timeout",
            QueryOutcome::Disconnected => "disconnected",
            QueryOutcome::Rejected(_) => "rejected",
        }
    }
}

#[derive(Default, Clone)]
struct IdMap {
    by_name: HashMap<Arc<str>, WorkerId>,
    by_id: HashMap<WorkerId, Arc<str>>,
}

impl IdMap {
    fn insert(&mut self, name: Arc<str>, id: WorkerId) {
        if let Some(old) = self.by_name.insert(name.clone(), id) {
            self.by_id.remove(&old);
        }
        self.by_id.insert(id, name);
    }

    fn remove(&mut self, name: &str) {
        if let Some(id) = self.by_name.remove(name) {
            self.by_id.remove(&id);
        }
    }
}

struct Slot {
    addr: Addr,
    conn: Mutex<Option<Arc<Conn>>>,
    ids: Mutex<IdMap>,
    tried: AtomicBool,
    refusal: Mutex<Option<ErrorReply>>,
}

impl Slot {
    fn live(&self) -> Option<Arc<Conn>> {
        let c = self.conn.lock().ok()?.clone()?;
        (!c.is_closed()).then_some(c)
    }
}

struct PlacementReq {
    worker: WorkerRef,
    keyspace: Keyspace,
    chain: Vec<u64>,
}

struct Shared {
    cfg: ClientConfig,
    slots: Vec<Slot>,
    /// Every worker this client announced and has not retired, in announce order.
    registry: Mutex<Vec<Announce>>,
    counters: Arc<Counters>,
    placements: mpsc::Sender<PlacementReq>,
    /// Bumped whenever a connection comes up or goes, or a first attempt ends.
    changed: watch::Sender<u64>,
    shutdown: watch::Sender<bool>,
}

/// Signals shutdown when the last [`Client`] handle goes.
struct Guard(Arc<Shared>);

impl Drop for Guard {
    fn drop(&mut self) {
        self.0.shutdown.send_replace(true);
        for s in &self.0.slots {
            if let Some(c) = s.live() {
                c.close();
            }
        }
    }
}

/// A kvix client: one multiplexed connection per configured server, kept up in the
/// background. Cheap to clone; the connections close when the last clone is dropped.
///
/// Made with [`Client::connect`] inside a tokio runtime (its tasks run there); for
/// plain threads use [`crate::blocking::BlockingClient`].
#[derive(Clone)]
pub struct Client {
    shared: Arc<Shared>,
    _guard: Arc<Guard>,
}

enum Waited {
    Reply(Reply),
    Closed,
    TimedOut,
}

impl Client {
    /// Starts the client and waits (up to `connect_timeout`) for the first connection
    /// attempt to every server, or for the first server to come up.
    ///
    /// Returns `Ok` when a server is up, and also when none could be reached: the client
    /// then fails queries open (`Disconnected`) and keeps reconnecting with backoff.
    /// Errs on a bad configuration, or when no server is up and one refused the
    /// handshake (wrong block size, bad auth): that needs an operator, not a retry.
    pub async fn connect(config: ClientConfig) -> Result<Client, ClientError> {
        config.validate()?;
        let (ptx, prx) = mpsc::channel(config.placement_queue);
        let slots = config
            .servers
            .iter()
            .map(|a| Slot {
                addr: a.clone(),
                conn: Mutex::new(None),
                ids: Mutex::new(IdMap::default()),
                tried: AtomicBool::new(false),
                refusal: Mutex::new(None),
            })
            .collect();
        let shared = Arc::new(Shared {
            cfg: config,
            slots,
            registry: Mutex::new(Vec::new()),
            counters: Arc::new(Counters::new()),
            placements: ptx,
            changed: watch::channel(0).0,
            shutdown: watch::channel(false).0,
        });
        for i in 0..shared.slots.len() {
            tokio::spawn(supervise(shared.clone(), i));
        }
        tokio::spawn(pump_placements(shared.clone(), prx));
        let client = Client {
            _guard: Arc::new(Guard(shared.clone())),
            shared,
        };
        let wait = client.shared.cfg.connect_timeout + Duration::from_millis(100);
        let mut rx = client.shared.changed.subscribe();
        let sh = &client.shared;
        let _ = tokio::time::timeout(
            wait,
            rx.wait_for(|_| {
                sh.slots[0].live().is_some()
                    || sh.slots.iter().all(|s| s.tried.load(Ordering::Acquire))
            }),
        )
        .await;
        if client.is_connected() {
            return Ok(client);
        }
        for s in &sh.slots {
            if let Some(reply) = s.refusal.lock().ok().and_then(|r| r.clone()) {
                return Err(ClientError::Refused {
                    addr: s.addr.clone(),
                    reply,
                });
            }
        }
        Ok(client)
    }

    /// The configuration the client runs with.
    pub fn config(&self) -> &ClientConfig {
        &self.shared.cfg
    }

    /// Whether some server connection is up now.
    pub fn is_connected(&self) -> bool {
        self.shared.slots.iter().any(|s| s.live().is_some())
    }

    /// The address of the server queries go to now (the first one up).
    pub fn primary(&self) -> Option<Addr> {
        self.shared
            .primary()
            .map(|(i, _)| self.shared.slots[i].addr.clone())
    }

    /// Waits until some server is up (workers re-announced), at most `timeout`.
    /// Returns whether one is.
    pub async fn wait_connected(&self, timeout: Duration) -> bool {
        self.shared.wait_connected(timeout).await
    }

    /// Waits until the server at `addr` is up, at most `timeout`; false when it is not
    /// one of the configured servers or did not come up in time.
    pub async fn wait_server(&self, addr: &Addr, timeout: Duration) -> bool {
        let Some(slot) = self.shared.slots.iter().find(|s| &s.addr == addr) else {
            return false;
        };
        let mut rx = self.shared.changed.subscribe();
        let r = tokio::time::timeout(timeout, rx.wait_for(|_| slot.live().is_some())).await;
        matches!(r, Ok(Ok(_)))
    }

    /// The id the primary server gave the worker `name`.
    pub fn worker_id(&self, name: &str) -> Option<WorkerId> {
        let (i, _) = self.shared.primary()?;
        self.shared.slots[i]
            .ids
            .lock()
            .ok()?
            .by_name
            .get(name)
            .copied()
    }

    /// The name of the primary server's worker `id`, if this client announced it.
    pub fn worker_name(&self, id: WorkerId) -> Option<Arc<str>> {
        let (i, _) = self.shared.primary()?;
        self.shared.slots[i]
            .ids
            .lock()
            .ok()?
            .by_id
            .get(&id)
            .cloned()
    }

    /// The workers this client announced and will re-announce on every reconnect.
    pub fn announced(&self) -> Vec<Announce> {
        self.shared
            .registry
            .lock()
            .map(|r| r.clone())
            .unwrap_or_default()
    }

    /// A snapshot of the counters.
    pub fn counters(&self) -> CountersSnapshot {
        self.shared.counters.snapshot()
    }

    /// Clears the latency histogram (the other counters are monotonic).
    pub fn reset_latency(&self) {
        self.shared.counters.reset_latency();
    }

    /// The chain of a token prompt in `keyspace` (its kind taken as tokens), as queries
    /// and placements use it.
    pub fn token_chain(&self, keyspace: &Keyspace, tokens: &[u32]) -> Vec<u64> {
        let block = self.shared.cfg.token_block;
        let mut ks = keyspace.clone();
        ks.kind = ChunkKind::Tokens;
        token_chain(ks.seed(block), block, tokens)
    }

    /// The chain of a string prompt in `keyspace` (its kind taken as bytes).
    pub fn byte_chain(&self, keyspace: &Keyspace, bytes: &[u8]) -> Vec<u64> {
        let mut ks = keyspace.clone();
        ks.kind = ChunkKind::Bytes;
        byte_chain(ks.seed(self.shared.cfg.token_block), BYTE_CHUNK, bytes)
    }

    /// Queries by token ids. See [`Client::query`].
    pub async fn query_tokens(
        &self,
        keyspace: &Keyspace,
        tokens: &[u32],
        opts: &QueryOptions,
    ) -> QueryOutcome {
        self.query(keyspace, Prompt::Tokens(tokens), opts).await
    }

    /// Queries by a string prompt, in the byte kind of `keyspace`. See [`Client::query`].
    pub async fn query_bytes(
        &self,
        keyspace: &Keyspace,
        prompt: impl AsRef<[u8]>,
        opts: &QueryOptions,
    ) -> QueryOutcome {
        self.query(keyspace, Prompt::Bytes(prompt.as_ref()), opts)
            .await
    }

    /// Queries by a chain the caller hashed. See [`Client::query`].
    pub async fn query_chain(
        &self,
        keyspace: &Keyspace,
        chain: &[u64],
        opts: &QueryOptions,
    ) -> QueryOutcome {
        self.query(keyspace, Prompt::Chain(chain), opts).await
    }

    /// Asks the primary server which workers can reuse how much of `prompt`.
    ///
    /// Never waits past the deadline (`opts.deadline` or the configured one) and never
    /// fails: with no server up it answers `Disconnected` at once, and a lost or
    /// misbehaving connection answers `Disconnected` to the queries it carried. The
    /// keyspace's kind is set from the prompt (tokens or bytes), except for a chain.
    pub async fn query(
        &self,
        keyspace: &Keyspace,
        prompt: Prompt<'_>,
        opts: &QueryOptions,
    ) -> QueryOutcome {
        let start = Instant::now();
        let until = start + opts.deadline.unwrap_or(self.shared.cfg.deadline);
        let outcome = self.query_inner(keyspace, prompt, opts, until).await;
        self.shared.counters.record_query(&outcome, start.elapsed());
        outcome
    }

    async fn query_inner(
        &self,
        keyspace: &Keyspace,
        prompt: Prompt<'_>,
        opts: &QueryOptions,
        until: Instant,
    ) -> QueryOutcome {
        let sh = &self.shared;
        let Some((slot, conn)) = sh.primary() else {
            return QueryOutcome::Disconnected;
        };
        let mut candidates = Vec::with_capacity(opts.candidates.len());
        for c in &opts.candidates {
            if let Some(id) = sh.id_on(slot, c) {
                candidates.push(id);
            }
        }
        if !opts.candidates.is_empty() && candidates.is_empty() {
            return QueryOutcome::Empty;
        }
        let (keyspace, chain) = match prompt {
            Prompt::Tokens(t) => {
                let ks = Keyspace {
                    kind: ChunkKind::Tokens,
                    ..keyspace.clone()
                };
                let chain = self.token_chain(&ks, t);
                (ks, chain)
            }
            Prompt::Bytes(b) => {
                let ks = Keyspace {
                    kind: ChunkKind::Bytes,
                    ..keyspace.clone()
                };
                let chain = self.byte_chain(&ks, b);
                (ks, chain)
            }
            Prompt::Chain(c) => (keyspace.clone(), c.to_vec()),
        };
        let q = Query {
            keyspace,
            chain,
            candidates,
            top_k: opts.top_k,
            want_runs: false,
        };
        let reply = match sh.call(&conn, &q, Kind::Answer, until).await {
            Ok(Waited::Reply(r)) => r,
            Ok(Waited::Closed) => return QueryOutcome::Disconnected,
            Ok(Waited::TimedOut) => return QueryOutcome::Timeout,
            Err(ClientError::Encode(m)) => {
                return QueryOutcome::Rejected(ErrorReply {
                    code: ErrorCode::BadFrame,
                    message: m,
                })
            }
            Err(_) => return QueryOutcome::Disconnected,
        };
        match reply {
            Reply::Answer(a) => self.outcome(slot, a),
            Reply::Error(e) => QueryOutcome::Rejected(e),
            _ => QueryOutcome::Disconnected,
        }
    }

    fn outcome(&self, slot: usize, a: Answer) -> QueryOutcome {
        let c = &self.shared.counters.n.unscorable;
        c.fetch_add(u64::from(a.unscorable), Ordering::Relaxed);
        if a.scores.is_empty() {
            return QueryOutcome::Empty;
        }
        let ids = self.shared.slots[slot].ids.lock().ok();
        QueryOutcome::Scores(
            a.scores
                .iter()
                .map(|s| WorkerScore {
                    worker: s.worker,
                    name: ids.as_ref().and_then(|m| m.by_id.get(&s.worker).cloned()),
                    blocks: s.blocks,
                })
                .collect(),
        )
    }

    /// Announces a worker with its lane roster to every server, and remembers it: it is
    /// re-announced on every reconnect, before anything else. Returns the primary
    /// server's id for it.
    ///
    /// With no server up it waits (up to `request_timeout`) for one; the worker stays
    /// remembered even if that times out.
    pub async fn announce(
        &self,
        name: impl Into<String>,
        lanes: Vec<Lane>,
        feed: Feed,
    ) -> Result<WorkerId, ClientError> {
        self.announce_worker(Announce {
            name: name.into(),
            lanes,
            feed,
            source: None,
        })
        .await
    }

    /// [`Client::announce`] with every field of the message (an event source, say).
    pub async fn announce_worker(&self, announce: Announce) -> Result<WorkerId, ClientError> {
        let sh = &self.shared;
        let until = Instant::now() + sh.cfg.request_timeout;
        let name: Arc<str> = announce.name.as_str().into();
        let conns = {
            let mut reg = sh.registry.lock().map_err(|_| ClientError::Disconnected)?;
            match reg.iter_mut().find(|a| a.name == announce.name) {
                Some(a) => *a = announce.clone(),
                None => reg.push(announce.clone()),
            }
            sh.live_conns()
        };
        let conns = if conns.is_empty() {
            // A connection that comes up now announces it during its own setup.
            if !sh.wait_until_connected(until).await {
                return Err(ClientError::NotConnected);
            }
            if let Some(id) = self.worker_id(&name) {
                return Ok(id);
            }
            sh.live_conns()
        } else {
            conns
        };
        // Pipelined: every frame out, then every reply.
        let mut waits = Vec::new();
        for (slot, conn) in conns {
            let id = conn.next_id();
            let r = sh.send_request(&conn, id, &announce, 0, Some(Kind::Announced));
            waits.push((slot, conn, id, r));
        }
        let mut results = Vec::new();
        for (slot, conn, id, rx) in waits {
            results.push(match rx {
                Ok(Some(mut rx)) => match wait_reply(&mut rx, until, None).await {
                    Waited::Reply(Reply::Announced(a)) => {
                        sh.adopt(slot, &conn, name.clone(), a.worker);
                        Ok(a.worker)
                    }
                    Waited::Reply(Reply::Error(e)) => Err(ClientError::Rejected(e)),
                    Waited::Reply(_) | Waited::Closed => Err(ClientError::Disconnected),
                    Waited::TimedOut => {
                        conn.forget(id);
                        Err(ClientError::Timeout)
                    }
                },
                Ok(None) => Err(ClientError::Disconnected),
                Err(e) => Err(e),
            });
        }
        // The first server (in order) that took it; else the first server's error.
        let res = match results.iter().position(|r| r.is_ok()) {
            Some(i) => results.swap_remove(i),
            None if !results.is_empty() => results.swap_remove(0),
            None => Err(ClientError::NotConnected),
        };
        if let Err(ClientError::Rejected(e)) = &res {
            if !matches!(e.code, ErrorCode::Overloaded | ErrorCode::Internal) {
                // Refused for what it is: do not re-announce it forever.
                if let Ok(mut reg) = sh.registry.lock() {
                    reg.retain(|a| a.name != announce.name);
                }
            }
        }
        res
    }

    /// Retires a worker on every server and stops re-announcing it. Returns once the
    /// primary server acknowledged it.
    pub async fn retire(&self, worker: impl Into<WorkerRef>) -> Result<(), ClientError> {
        let sh = &self.shared;
        let worker = worker.into();
        let until = Instant::now() + sh.cfg.request_timeout;
        let name = sh.name_of(&worker);
        let conns = {
            let mut reg = sh.registry.lock().map_err(|_| ClientError::Disconnected)?;
            if let Some(n) = &name {
                reg.retain(|a| *a.name != **n);
            }
            sh.live_conns()
        };
        let Some(&(primary, _)) = conns.first() else {
            return Err(ClientError::NotConnected);
        };
        let mut wait = None;
        for (slot, conn) in conns {
            let Some(id) = sh.id_on(slot, &worker) else {
                continue;
            };
            if let Some(n) = &name {
                if let Ok(mut m) = sh.slots[slot].ids.lock() {
                    m.remove(n);
                }
            }
            let rid = conn.next_id();
            if slot == primary {
                let rx = sh.send_request(&conn, rid, &Retire { worker: id }, 0, Some(Kind::Ack))?;
                wait = rx.map(|rx| (conn, rid, rx));
            } else {
                let _ = sh.send_request(&conn, rid, &Retire { worker: id }, FLAG_NO_REPLY, None);
            }
        }
        let Some((conn, rid, mut rx)) = wait else {
            return Err(ClientError::Rejected(ErrorReply {
                code: ErrorCode::UnknownWorker,
                message: format!("worker {worker:?} is not known to this client"),
            }));
        };
        match wait_reply(&mut rx, until, None).await {
            Waited::Reply(Reply::Ack) => Ok(()),
            Waited::Reply(Reply::Error(e)) => Err(ClientError::Rejected(e)),
            Waited::Reply(_) | Waited::Closed => Err(ClientError::Disconnected),
            Waited::TimedOut => {
                conn.forget(rid);
                Err(ClientError::Timeout)
            }
        }
    }

    /// Queues a placement (a request for `chain` was sent to `worker`) for every server
    /// that is up. Never blocks: when the queue is full the placement is dropped and
    /// counted, and `false` is returned.
    pub fn publish_placement(
        &self,
        worker: impl Into<WorkerRef>,
        keyspace: &Keyspace,
        chain: Vec<u64>,
    ) -> bool {
        let req = PlacementReq {
            worker: worker.into(),
            keyspace: keyspace.clone(),
            chain,
        };
        match self.shared.placements.try_send(req) {
            Ok(()) => true,
            Err(_) => {
                Counters::bump(&self.shared.counters.n.placement_drops);
                false
            }
        }
    }

    /// The primary server's counters.
    pub async fn stats(&self) -> Result<Stats, ClientError> {
        match self.control(&StatsRequest {}, Kind::Stats).await? {
            Reply::Stats(s) => Ok(s),
            _ => Err(ClientError::Disconnected),
        }
    }

    /// Sends `payload` and gets `reply_len` bytes back: the transport's latency floor.
    /// Waits like a query does (spin option included), up to `request_timeout`.
    pub async fn echo(&self, payload: Vec<u8>, reply_len: u32) -> Result<Vec<u8>, ClientError> {
        match self
            .control(&Echo { payload, reply_len }, Kind::Echo)
            .await?
        {
            Reply::Echo(p) => Ok(p),
            _ => Err(ClientError::Disconnected),
        }
    }

    async fn control<M: Body>(&self, msg: &M, want: Kind) -> Result<Reply, ClientError> {
        let sh = &self.shared;
        let until = Instant::now() + sh.cfg.request_timeout;
        let (_, conn) = sh.primary().ok_or(ClientError::NotConnected)?;
        match sh.call(&conn, msg, want, until).await? {
            Waited::Reply(Reply::Error(e)) => Err(ClientError::Rejected(e)),
            Waited::Reply(r) => Ok(r),
            Waited::Closed => Err(ClientError::Disconnected),
            Waited::TimedOut => Err(ClientError::Timeout),
        }
    }
}

impl Shared {
    /// The first server, in configured order, that is up.
    fn primary(&self) -> Option<(usize, Arc<Conn>)> {
        self.slots
            .iter()
            .enumerate()
            .find_map(|(i, s)| s.live().map(|c| (i, c)))
    }

    fn live_conns(&self) -> Vec<(usize, Arc<Conn>)> {
        self.slots
            .iter()
            .enumerate()
            .filter_map(|(i, s)| s.live().map(|c| (i, c)))
            .collect()
    }

    async fn wait_connected(&self, timeout: Duration) -> bool {
        self.wait_until_connected(Instant::now() + timeout).await
    }

    async fn wait_until_connected(&self, until: Instant) -> bool {
        let mut rx = self.changed.subscribe();
        let ok = tokio::time::timeout_at(
            until.into(),
            rx.wait_for(|_| self.slots.iter().any(|s| s.live().is_some())),
        )
        .await;
        matches!(ok, Ok(Ok(_)))
    }

    fn name_of(&self, w: &WorkerRef) -> Option<Arc<str>> {
        match w {
            WorkerRef::Name(n) => Some(n.clone()),
            WorkerRef::Id(id) => {
                let (p, _) = self.primary()?;
                self.slots[p].ids.lock().ok()?.by_id.get(id).cloned()
            }
        }
    }

    /// The id `w` has on server `slot`: names are looked up there; ids are the primary's,
    /// translated through the worker's name for the other servers.
    fn id_on(&self, slot: usize, w: &WorkerRef) -> Option<WorkerId> {
        match w {
            WorkerRef::Name(n) => self.slots[slot].ids.lock().ok()?.by_name.get(n).copied(),
            WorkerRef::Id(id) => {
                if self.primary().map(|(p, _)| p) == Some(slot) {
                    return Some(*id);
                }
                let name = self.name_of(w)?;
                self.slots[slot]
                    .ids
                    .lock()
                    .ok()?
                    .by_name
                    .get(&name)
                    .copied()
            }
        }
    }

    /// Records `name → id` for server `slot`, if `conn` is still its connection.
    fn adopt(&self, slot: usize, conn: &Arc<Conn>, name: Arc<str>, id: WorkerId) {
        let s = &self.slots[slot];
        let current = s.conn.lock().ok().and_then(|c| c.clone());
        if current.is_some_and(|c| Arc::ptr_eq(&c, conn)) {
            if let Ok(mut m) = s.ids.lock() {
                m.insert(name, id);
            }
        }
    }

    /// Encodes and writes one request; registers a waiter when `want` is given.
    fn send_request<M: Body>(
        &self,
        conn: &Conn,
        id: u64,
        msg: &M,
        flags: u8,
        want: Option<Kind>,
    ) -> Result<Option<oneshot::Receiver<Reply>>, ClientError> {
        let frame = encode(msg, id, flags).map_err(|e| ClientError::Encode(e.to_string()))?;
        if frame.len() > conn.max_frame() as usize {
            return Err(ClientError::Encode(format!(
                "{} frame of {} bytes exceeds the server's limit of {}",
                M::KIND.name(),
                frame.len(),
                conn.max_frame()
            )));
        }
        let rx = want.map(|k| conn.register(id, k)).transpose()?;
        if let Err(e) = conn.send(&frame) {
            conn.forget(id);
            return Err(e);
        }
        Ok(rx)
    }

    /// One request, waited for until `until` with the configured spin.
    async fn call<M: Body>(
        &self,
        conn: &Conn,
        msg: &M,
        want: Kind,
        until: Instant,
    ) -> Result<Waited, ClientError> {
        let id = conn.next_id();
        let Some(mut rx) = self.send_request(conn, id, msg, 0, Some(want))? else {
            return Err(ClientError::Disconnected);
        };
        let w = wait_reply(&mut rx, until, self.cfg.spin_before_park).await;
        if matches!(w, Waited::TimedOut) {
            conn.forget(id);
        }
        Ok(w)
    }

    fn bump_changed(&self) {
        self.changed.send_modify(|v| *v += 1);
    }
}

/// Waits for a reply until `until`: first spinning on it for up to `spin`, then parked
/// on a timer, and the last [`TIMER_SLACK`] by yielding.
///
/// The spin is a busy loop where another thread can deliver the reply meanwhile: outside
/// any task (the blocking client's caller thread) or on a multi-thread runtime with more
/// than one worker. Where the reader may need this very thread (a current-thread
/// runtime, or a single worker), it spins by yielding to the runtime instead.
async fn wait_reply(
    rx: &mut oneshot::Receiver<Reply>,
    until: Instant,
    spin: Option<Duration>,
) -> Waited {
    use oneshot::error::TryRecvError;
    let poll = |rx: &mut oneshot::Receiver<Reply>| match rx.try_recv() {
        Ok(r) => Some(Waited::Reply(r)),
        Err(TryRecvError::Closed) => Some(Waited::Closed),
        Err(TryRecvError::Empty) => None,
    };
    let busy_ok = match tokio::runtime::Handle::try_current() {
        Err(_) => true,
        Ok(h) => {
            tokio::task::try_id().is_none()
                || (h.runtime_flavor() == RuntimeFlavor::MultiThread
                    && h.metrics().num_workers() > 1)
        }
    };
    if let Some(spin) = spin {
        let spin_end = (Instant::now() + spin).min(until);
        loop {
            if let Some(w) = poll(rx) {
                return w;
            }
            if Instant::now() >= spin_end {
                break;
            }
            if busy_ok {
                std::hint::spin_loop();
            } else {
                tokio::task::yield_now().await;
            }
        }
    }
    if let Some(park_until) = until.checked_sub(TIMER_SLACK) {
        if Instant::now() < park_until {
            match tokio::time::timeout_at(park_until.into(), &mut *rx).await {
                Ok(Ok(r)) => return Waited::Reply(r),
                Ok(Err(_)) => return Waited::Closed,
                Err(_) => {}
            }
        }
    }
    loop {
        if let Some(w) = poll(rx) {
            return w;
        }
        if Instant::now() >= until {
            return Waited::TimedOut;
        }
        tokio::task::yield_now().await;
    }
}

/// Keeps server `idx` connected: connect, handshake, re-announce, publish, wait for the
/// loss, back off exponentially, again; until the client is dropped.
async fn supervise(sh: Arc<Shared>, idx: usize) {
    let mut shutdown = sh.shutdown.subscribe();
    let mut backoff = sh.cfg.reconnect_min;
    let mut had_conn = false;
    let slot = &sh.slots[idx];
    loop {
        if *shutdown.borrow() {
            return;
        }
        let attempt = tokio::select! {
            r = tokio::time::timeout(sh.cfg.connect_timeout, establish(&sh, idx)) => r,
            _ = shutdown.wait_for(|s| *s) => return,
        };
        match attempt {
            Ok(Ok(conn)) => {
                Counters::bump(&sh.counters.n.connects);
                if had_conn {
                    Counters::bump(&sh.counters.n.reconnects);
                }
                had_conn = true;
                backoff = sh.cfg.reconnect_min;
                if let Ok(mut r) = slot.refusal.lock() {
                    *r = None;
                }
                slot.tried.store(true, Ordering::Release);
                sh.bump_changed();
                tracing::info!(server = %slot.addr, "connected");
                tokio::select! {
                    _ = conn.closed() => {}
                    _ = shutdown.wait_for(|s| *s) => { conn.close(); return; }
                }
                if let Ok(mut c) = slot.conn.lock() {
                    if c.as_ref().is_some_and(|c| Arc::ptr_eq(c, &conn)) {
                        *c = None;
                    }
                }
                Counters::bump(&sh.counters.n.connection_losses);
                tracing::warn!(server = %slot.addr, "connection lost; reconnecting");
            }
            Ok(Err(ClientError::Refused { reply, .. })) => {
                Counters::bump(&sh.counters.n.handshake_refusals);
                tracing::warn!(server = %slot.addr, code = ?reply.code, "handshake refused: {}", reply.message);
                if let Ok(mut r) = slot.refusal.lock() {
                    *r = Some(reply);
                }
            }
            Ok(Err(e)) => {
                Counters::bump(&sh.counters.n.connect_failures);
                tracing::debug!(server = %slot.addr, "connect failed: {e}");
            }
            Err(_) => {
                Counters::bump(&sh.counters.n.connect_failures);
                tracing::debug!(server = %slot.addr, "connect timed out");
            }
        }
        slot.tried.store(true, Ordering::Release);
        sh.bump_changed();
        tokio::select! {
            _ = tokio::time::sleep(backoff) => {}
            _ = shutdown.wait_for(|s| *s) => return,
        }
        backoff = (backoff * 2).min(sh.cfg.reconnect_max);
    }
}

/// Closes a connection that did not make it through setup.
struct CloseUnlessKept(Option<Arc<Conn>>);

impl Drop for CloseUnlessKept {
    fn drop(&mut self) {
        if let Some(c) = self.0.take() {
            c.close();
        }
    }
}

/// Connect, Hello → Welcome, re-announce every registered worker (pipelined, before any
/// other frame), then publish the connection with the fresh id map.
async fn establish(sh: &Arc<Shared>, idx: usize) -> Result<Arc<Conn>, ClientError> {
    let slot = &sh.slots[idx];
    let (rd, wr) = dial(&slot.addr).await?;
    let conn = Conn::new(slot.addr.clone(), wr);
    let mut guard = CloseUnlessKept(Some(conn.clone()));
    tokio::spawn(conn.clone().write_loop());
    let hello = Hello {
        client: sh.cfg.name.clone(),
        token_block: sh.cfg.token_block,
        auth: sh.cfg.auth.clone(),
    };
    let frame = encode(&hello, 0, 0).map_err(|e| ClientError::Encode(e.to_string()))?;
    conn.send(&frame)?;
    let mut reader = FrameReader::new(rd, sh.cfg.max_frame);
    let welcome = handshake(&mut reader, sh, &slot.addr).await?;
    if welcome.token_block != sh.cfg.token_block {
        return Err(ClientError::Refused {
            addr: slot.addr.clone(),
            reply: ErrorReply {
                code: ErrorCode::BlockSizeMismatch,
                message: format!(
                    "server hashes {}-token blocks, this client {}",
                    welcome.token_block, sh.cfg.token_block
                ),
            },
        });
    }
    if welcome.byte_chunk != BYTE_CHUNK {
        return Err(ClientError::Protocol(format!(
            "server cuts {}-byte chunks, this client {BYTE_CHUNK}",
            welcome.byte_chunk
        )));
    }
    conn.set_max_frame(welcome.max_frame);
    tokio::spawn(conn.clone().read_loop(reader, sh.counters.clone()));

    let mut ids = IdMap::default();
    let mut done: HashSet<String> = HashSet::new();
    loop {
        let todo: Vec<Announce> = {
            let reg = sh.registry.lock().map_err(|_| ClientError::Disconnected)?;
            let todo: Vec<Announce> = reg
                .iter()
                .filter(|a| !done.contains(&a.name))
                .cloned()
                .collect();
            if todo.is_empty() {
                // Publish under the registry lock: an announce that registers after
                // this sees the connection and sends on it itself.
                let live: HashSet<&str> = reg.iter().map(|a| a.name.as_str()).collect();
                for gone in done.iter().filter(|n| !live.contains(n.as_str())) {
                    if let Some(&worker) = ids.by_name.get(gone.as_str()) {
                        let id = conn.next_id();
                        let _ = sh.send_request(&conn, id, &Retire { worker }, FLAG_NO_REPLY, None);
                    }
                    ids.remove(gone);
                }
                if let Ok(mut m) = slot.ids.lock() {
                    *m = ids;
                }
                if let Ok(mut c) = slot.conn.lock() {
                    *c = Some(conn.clone());
                }
                guard.0 = None;
                return Ok(conn);
            }
            todo
        };
        let mut waits = Vec::with_capacity(todo.len());
        for a in &todo {
            let id = conn.next_id();
            let rx = sh.send_request(&conn, id, a, 0, Some(Kind::Announced))?;
            waits.push((a.name.clone(), rx));
        }
        for (name, rx) in waits {
            let Some(rx) = rx else { continue };
            match rx.await {
                Ok(Reply::Announced(a)) => ids.insert(name.as_str().into(), a.worker),
                Ok(Reply::Error(e)) => {
                    tracing::warn!(server = %slot.addr, worker = %name, code = ?e.code,
                        "re-announce refused: {}", e.message);
                }
                Ok(_) | Err(_) => return Err(ClientError::Disconnected),
            }
            done.insert(name);
        }
    }
}

async fn handshake(
    reader: &mut FrameReader,
    sh: &Shared,
    addr: &Addr,
) -> Result<kvix_wire::Welcome, ClientError> {
    use crate::conn::ReadError;
    let malformed = |m: String| {
        Counters::bump(&sh.counters.n.malformed_replies);
        ClientError::Protocol(m)
    };
    match reader.ready().await {
        Ok(()) => {}
        Err(ReadError::Eof) => return Err(ClientError::Disconnected),
        Err(ReadError::Io(e)) => return Err(e.into()),
        Err(ReadError::Malformed(m)) => return Err(malformed(m)),
    }
    let frame = reader.frame().ok_or_else(|| malformed("no frame".into()))?;
    let len = frame.len;
    let msg = frame.message().map_err(|e| malformed(e.to_string()))?;
    let out = match msg {
        kvix_wire::MessageRef::Welcome(w) => Ok(kvix_wire::to_native::<kvix_wire::Welcome>(w)),
        kvix_wire::MessageRef::ErrorReply(e) => Err(ClientError::Refused {
            addr: addr.clone(),
            reply: kvix_wire::to_native::<ErrorReply>(e),
        }),
        other => Err(malformed(format!(
            "{} frame in answer to Hello",
            other.kind().name()
        ))),
    };
    reader.consume(len);
    out
}

/// Sends queued placements to every server that is up, fire-and-forget.
async fn pump_placements(sh: Arc<Shared>, mut rx: mpsc::Receiver<PlacementReq>) {
    let mut shutdown = sh.shutdown.subscribe();
    loop {
        let req = tokio::select! {
            r = rx.recv() => match r { Some(r) => r, None => return },
            _ = shutdown.wait_for(|s| *s) => return,
        };
        let mut msg = Placement {
            worker: 0,
            keyspace: req.keyspace,
            chain: req.chain,
        };
        let mut sent = false;
        for (slot, conn) in sh.live_conns() {
            let Some(worker) = sh.id_on(slot, &req.worker) else {
                continue;
            };
            msg.worker = worker;
            let id = conn.next_id();
            if sh
                .send_request(&conn, id, &msg, FLAG_NO_REPLY, None)
                .is_ok()
            {
                Counters::bump(&sh.counters.n.placements_sent);
                sent = true;
            }
        }
        if !sent {
            Counters::bump(&sh.counters.n.placements_unsent);
        }
    }
}
