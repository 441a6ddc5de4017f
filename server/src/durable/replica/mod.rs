//! Replicas over a Redis (or Valkey) Stream (`--log redis://HOST:PORT/KEY`): the stream
//! is the one order of every write, and every replica applies it in that order, so all
//! of them hold the same index. No consensus of our own: Redis orders the appends.
//!
//! A write a client sends to any replica is appended (XADD, [`appender`]) and applied
//! when this replica's [`follower`] reads it back, like everybody else's; the client's
//! reply waits for that, so it sees its write in its next query on that replica. The
//! follower hands each record to the executor that applies it ([`LogJob`]); announces
//! and retires are barriers (the records after them wait), the rest are pipelined in
//! order per worker. Both talk to Redis from the executors ([`resp`]): the appender on
//! each, the follower on executor 0.
//!
//! The log has an identity, its generation (`KEY:generation`, a random id the first
//! replica to start on an empty key sets): snapshots record it with their position, and
//! every read checks it. A log flushed, restarted without persistence or recreated has
//! another (or none): running replicas stop following it (their ids would mean other
//! workers than the new log's), and a replica started on it ignores snapshots of the old
//! one, so every replica of the new log numbers workers from the same start.
//!
//! Snapshots carry the stream position they cover and are also stored in Redis
//! (`KEY:snapshot`), so a new replica starts from the newest one and replays the stream
//! from there; the stream is trimmed below the oldest position still needed
//! ([`store::trim`]). Engine event streams are ingested by one replica each, under a
//! lease ([`lease`]) whose epoch fences a deposed holder's late appends.

pub mod appender;
pub mod follower;
mod recover;
pub mod start;
pub mod store;
pub mod url;

pub use url::{BadLogUrl, LogUrl};
pub mod lease;
pub mod link;
pub mod resp;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::channel::{mpsc, oneshot};

use crate::durable::snapshot::{Part, ServerImage};
use crate::exposition::Exposition;
use crate::exposition::Kind::Gauge;
use crate::failure::Failure;
use crate::write::record::{Outcome, Write};
use kvix_wire::WorkerId;

pub use link::{Link, LogServer};

/// How long a Redis command may take before the link counts as down.
pub const IO_TIMEOUT: Duration = Duration::from_secs(2);

pub type Waiter = oneshot::Sender<Result<Outcome, Failure>>;

/// What the follower hands an executor, in stream order.
// Nearly every job is an `Apply`: boxing its write would cost an allocation per record
// to save bytes on the rare `Export`.
#[allow(clippy::large_enum_variant)]
pub enum LogJob {
    /// A write read from the stream; `waiter`: this replica's client waiting for it;
    /// `barrier`: the follower waits until it is applied (announces and retires).
    Apply {
        write: Write,
        waiter: Option<Waiter>,
        barrier: Option<oneshot::Sender<()>>,
    },
    /// The executor's snapshot part after everything handed over before.
    Export { reply: oneshot::Sender<Part> },
    /// Answered once every record handed to this executor before is applied on every
    /// executor: what a heal waits for before it restores.
    Drain { done: oneshot::Sender<()> },
    /// The executor's state replaced by the snapshot's (a replica healing in place,
    /// after a `Drain` on every executor).
    Restore {
        image: Arc<ServerImage>,
        done: oneshot::Sender<Result<(), RestoreError>>,
    },
}

/// Why an executor's state was not replaced by a snapshot's.
#[derive(Debug, thiserror::Error)]
pub enum RestoreError {
    #[error(transparent)]
    State(#[from] crate::error::StartError),
    #[error("the executor's write queue did not run it: {0}")]
    Queue(#[from] crate::failure::Failure),
}

/// A lost log's new base, made by the replica chosen to rebuild it: its state as a
/// snapshot at the new generation's start, and each ingest stream's epoch.
pub struct Base {
    pub snapshot: Vec<u8>,
    pub epochs: Vec<(WorkerId, u64)>,
}

impl Base {
    /// `image`, marked as the start of the new generation `at`, as a lost log's base:
    /// its snapshot and each ingest stream's epoch, from which the new log's leases
    /// count on.
    pub fn of(mut image: ServerImage, at: &LogMark, block: u32) -> Base {
        image.log_position = at.to_string();
        Base {
            snapshot: crate::durable::snapshot::encode(&image, block),
            epochs: image
                .ingest_states
                .iter()
                .map(|(w, s)| (*w, s.epoch))
                .collect(),
        }
    }
}

/// How the follower makes a [`Base`] of the executors' parts at a mark (the roster and
/// the sources are executor 0's, where the follower runs).
pub type MakeBase = Box<dyn Fn(Vec<Part>, &LogMark) -> Base>;

/// What a snapshot needs from the follower: the position every part covers.
pub struct Mark {
    pub position: String,
    pub parts: Vec<oneshot::Receiver<Part>>,
}

/// Why a replica stopped following its log.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stopped {
    /// Entries after its position were trimmed away.
    BehindTrim,
    /// The log holds a record it cannot read.
    Unreadable,
    /// The log is not the one it followed (flushed, restarted without persistence,
    /// recreated): another generation, or none.
    Replaced,
}

impl Stopped {
    pub const ALL: [Stopped; 3] = [Stopped::BehindTrim, Stopped::Unreadable, Stopped::Replaced];

    pub fn label(self) -> &'static str {
        match self {
            Stopped::BehindTrim => "behind_trim",
            Stopped::Unreadable => "unreadable",
            Stopped::Replaced => "replaced",
        }
    }
}

/// Where a snapshot stands in the log: the stream position its parts cover, in the log
/// of this generation. Kept in a snapshot as `POSITION@GENERATION` (a snapshot from
/// before generations holds the position alone).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogMark {
    pub position: String,
    pub generation: Option<String>,
}

impl LogMark {
    /// The start of a new generation's stream.
    pub fn start_of(generation: &str) -> LogMark {
        LogMark {
            position: "0-0".into(),
            generation: Some(generation.to_string()),
        }
    }

    pub fn parse(s: &str) -> LogMark {
        match s.split_once('@') {
            Some((position, generation)) => LogMark {
                position: position.to_string(),
                generation: Some(generation.to_string()),
            },
            None => LogMark {
                position: s.to_string(),
                generation: None,
            },
        }
    }
}

impl std::fmt::Display for LogMark {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.generation {
            Some(g) => write!(f, "{}@{g}", self.position),
            None => f.write_str(&self.position),
        }
    }
}

crate::metric_set! {
    /// This replica's side of the log, counted.
    pub struct ReplicaMetrics {
        /// Writes this replica appended to the shared log.
        appended: Counter Sum "kvix_log_appended_total",
        /// Writes refused (LogUnavailable) because the log could not be reached.
        append_failures: Counter Sum "kvix_log_append_failures_total",
        /// Log records this replica applied (everybody's).
        applied: Counter Sum "kvix_log_applied_total",
        /// Failed reads of the log (retried).
        read_failures: Counter Sum "kvix_log_read_failures_total",
        /// Milliseconds part of the id of the last log entry applied.
        position_ms: Gauge Sum "kvix_log_position_ms",
        /// Sequence part of the id of the last log entry applied.
        position_seq: Gauge Sum "kvix_log_position_seq",
        /// Log entries trimmed after snapshots.
        trimmed: Counter Sum "kvix_log_trimmed_total",
        /// Snapshots this replica stored in the log's Redis.
        stored: Counter Sum "kvix_log_snapshots_stored_total",
        /// Snapshots this replica could not store in Redis (nor trim the stream for).
        store_failures: Counter Sum "kvix_log_snapshot_store_failures_total",
        /// Heals in place: the stored snapshot reloaded after the log was trimmed past this replica.
        heals: Counter Sum "kvix_log_heals_total",
        /// Lost logs rebuilt: a new generation from the most advanced replica's state.
        rebuilds: Counter Sum "kvix_log_rebuilds_total",
        /// Engine event streams this replica ingests (holds the lease of).
        leases_held: Gauge Sum "kvix_ingest_leases_held",
        /// Ingest leases this replica took.
        lease_changes: Counter Sum "kvix_ingest_lease_changes_total",
    }
}

/// This replica's side of the log.
pub struct Replica {
    pub id: String,
    pub url: LogUrl,
    link: Arc<Link>,
    /// Where the follower starts, until executor 0 takes it to run it.
    follow: Mutex<Option<Follow>>,
    pending: Mutex<HashMap<u64, Waiter>>,
    next_token: AtomicU64,
    snapshot_request: Mutex<Option<oneshot::Sender<Mark>>>,
    /// Set once the follower passed the stream's end as it was at start (and cleared
    /// when it stops following).
    pub caught_up: AtomicBool,
    /// Set the first time `caught_up` is: what the start waits for before serving.
    pub first_caught_up: crate::latch::Latch,
    /// The log's generation this replica follows (a new one once a lost log is rebuilt).
    generation: Mutex<String>,
    /// What the log's `KEY:fleet` says: `--fleet` and `--block-size`.
    pub fleet: String,
    /// The index's `--block-size`, which the stored snapshots are decoded with.
    pub block_size: u32,
    /// Set while the replica heals in place (reloads the stored snapshot).
    pub healing: AtomicBool,
    /// Set while the replicas rebuild a lost log: writes are refused until then.
    pub rebuilding: AtomicBool,
    /// See [`Replica::generations`].
    generations: AtomicU64,
    /// Counts the follower's failed steps: an appender's connection made before the
    /// last one is likely dead too (Redis restarted, failed over), and is made again
    /// before its next append rather than failing it.
    pub link_failures: AtomicU64,
    /// The other replicas that reported following the log in the last 10 s, as the
    /// follower last read their reports.
    peers: Mutex<Vec<String>>,
    /// Why this replica stopped following the log, and in words: it refuses writes,
    /// /livez says so, and the process exits non-zero.
    broken: Mutex<Option<(Stopped, String)>>,
    pub metrics: ReplicaMetrics,
    stop: AtomicBool,
}

/// Where the follower reads from (just after `position`), and the executors' inboxes it
/// hands records to.
pub struct Follow {
    pub position: String,
    pub inboxes: Vec<mpsc::Sender<LogJob>>,
}

impl Replica {
    /// This replica of the log; its follower (reading from just after `position`, handing
    /// records to the executors' `inboxes`) runs once executor 0 takes it
    /// ([`Replica::take_follow`]), its appenders once each executor starts one.
    pub fn new(
        url: LogUrl,
        generation: String,
        (fleet, block_size): (String, u32),
        position: String,
        inboxes: Vec<mpsc::Sender<LogJob>>,
    ) -> Result<Arc<Replica>, crate::error::StartError> {
        let link = Link::open(&url.server).map_err(|source| crate::error::StartError::Log {
            server: url.server.to_string(),
            source,
        })?;
        let id = format!("{:016x}", rand_id());
        Ok(Arc::new(Replica {
            id,
            url,
            link: Arc::new(link),
            follow: Mutex::new(Some(Follow { position, inboxes })),
            pending: Mutex::new(HashMap::new()),
            next_token: AtomicU64::new(1),
            snapshot_request: Mutex::new(None),
            caught_up: AtomicBool::new(false),
            first_caught_up: crate::latch::Latch::new(),
            generation: Mutex::new(generation),
            fleet,
            block_size,
            healing: AtomicBool::new(false),
            rebuilding: AtomicBool::new(false),
            generations: AtomicU64::new(0),
            link_failures: AtomicU64::new(0),
            peers: Mutex::new(Vec::new()),
            broken: Mutex::new(None),
            metrics: ReplicaMetrics::default(),
            stop: AtomicBool::new(false),
        }))
    }

    /// Notes who reported following the log lately (`reports`: the positions hash,
    /// `replica id` → `position ms-since-epoch`), as of `now_ms`.
    pub fn saw_peers(&self, reports: &HashMap<String, String>, now_ms: u64) {
        let lately = reports
            .iter()
            .filter(|(id, _)| **id != self.id && id.as_str() != "snapshot")
            .filter(|(_, v)| {
                v.rsplit_once(' ')
                    .and_then(|(_, at)| at.parse::<u64>().ok())
                    .is_some_and(|at| now_ms.saturating_sub(at) < 10_000)
            })
            .map(|(id, _)| id.clone())
            .collect();
        *self.peers.lock().unwrap_or_else(|p| p.into_inner()) = lately;
    }

    /// The other replicas that followed the log lately (see [`Replica::saw_peers`]).
    pub fn peers(&self) -> Vec<String> {
        self.peers.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// The follower applied the log up to `position`: its gauges say so.
    pub fn at(&self, position: &str) {
        let (ms, seq) = id_key(position);
        self.metrics.position_ms.store(ms, Relaxed);
        self.metrics.position_seq.store(seq, Relaxed);
    }

    /// The log's generation this replica follows.
    pub fn generation(&self) -> String {
        self.generation
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    fn set_generation(&self, generation: &str) {
        *self.generation.lock().unwrap_or_else(|p| p.into_inner()) = generation.to_string();
        self.generations.fetch_add(1, Relaxed);
    }

    /// How many times this replica moved to another generation (rebuilt logs): the
    /// lease thread drops every stream it leads then, since an epoch it took while the
    /// log was lost counts from a flushed counter, below the rebuilt log's.
    pub fn generations(&self) -> u64 {
        self.generations.load(Relaxed)
    }

    /// What the follower starts from, taken once (by executor 0, which runs it).
    pub fn take_follow(&self) -> Option<Follow> {
        self.follow.lock().unwrap_or_else(|p| p.into_inner()).take()
    }

    /// A blocking connection to the log's Redis, for the threads that keep one (the
    /// ingest leases, the snapshot store).
    pub fn connect(&self) -> redis::RedisResult<redis::Connection> {
        self.link.connect()
    }

    /// Why this replica no longer follows the log, if it does not.
    pub fn broken(&self) -> Option<String> {
        let broken = self.broken.lock().unwrap_or_else(|p| p.into_inner());
        broken.as_ref().map(|(_, why)| why.clone())
    }

    /// Which reason this replica stopped following the log for, if it did.
    fn stopped_for(&self) -> Option<Stopped> {
        let broken = self.broken.lock().unwrap_or_else(|p| p.into_inner());
        broken.as_ref().map(|(reason, _)| *reason)
    }

    /// The follower gives up: this replica refuses writes and fails /livez with `why`,
    /// and the process exits non-zero (executor 0's tick sees it).
    /// Writes appended and not yet read back never will be: they are answered
    /// `LogUnavailable` now.
    fn stop_following(&self, reason: Stopped, why: String) {
        tracing::error!("{why}");
        self.caught_up.store(false, Relaxed);
        *self.broken.lock().unwrap_or_else(|p| p.into_inner()) = Some((reason, why.clone()));
        self.answer_waiting(&why);
    }

    /// Answers every write still waiting to be read back `LogUnavailable(why)`; how many.
    fn answer_waiting(&self, why: &str) -> usize {
        let waiting: Vec<Waiter> = {
            let mut pending = self.pending.lock().unwrap_or_else(|p| p.into_inner());
            pending.drain().map(|(_, w)| w).collect()
        };
        let answered = waiting.len();
        for w in waiting {
            let _ = w.send(Err(Failure::LogUnavailable(why.to_string())));
        }
        answered
    }

    /// The follower cannot read the log back (`why`): every write of this replica's
    /// clients still waiting is answered `LogUnavailable` now, rather than held until the
    /// log returns (which may be never). One already appended applies once the log is
    /// read again: a client's retry is then answered `Duplicate` (event batches carry
    /// their sequence; an announce or placement again changes nothing; a retire's retry
    /// finds the worker gone, `UnknownWorker`).
    pub fn fail_pending(&self, why: &str) {
        let why = format!("{why}: the write may still apply once the log is read again (a retry is answered Duplicate)");
        let answered = self.answer_waiting(&why);
        self.metrics
            .append_failures
            .fetch_add(answered as u64, Relaxed);
    }

    pub fn stopped(&self) -> bool {
        self.stop.load(Relaxed)
    }

    pub fn stop(&self) {
        self.stop.store(true, Relaxed);
    }

    /// The token under which one of this replica's records is appended: `waiter` hears
    /// its outcome when the follower reads it back. None (and `waiter` answered
    /// `LogUnavailable`) when this replica stopped following the log: the record must
    /// not be appended.
    fn expect(&self, waiter: Waiter) -> Option<u64> {
        let token = self.next_token.fetch_add(1, Relaxed);
        self.pending
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(token, waiter);
        // The follower may have stopped since the caller looked: its waiters were
        // answered then, this one would wait for ever. While a lost log is rebuilt, a
        // record appended to the new stream would come before its base.
        let rebuilding = self.rebuilding.load(Relaxed).then(|| {
            "the write log was lost; the replicas are rebuilding it from the most advanced of them".to_string()
        });
        if let Some(why) = self.broken().or(rebuilding) {
            self.metrics.append_failures.fetch_add(1, Relaxed);
            self.fail(token, why);
            return None;
        }
        Some(token)
    }

    /// The waiter of one of this replica's own records, taken once.
    pub fn waiter(&self, token: u64) -> Option<Waiter> {
        self.pending
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&token)
    }

    fn fail(&self, token: u64, why: String) {
        if let Some(w) = self.waiter(token) {
            let _ = w.send(Err(Failure::LogUnavailable(why)));
        }
    }

    /// Asks the follower for a consistent cut: every executor's part, taken after the
    /// same position of the stream.
    pub fn mark(&self) -> oneshot::Receiver<Mark> {
        let (tx, rx) = oneshot::channel();
        *self
            .snapshot_request
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = Some(tx);
        rx
    }

    fn take_mark_request(&self) -> Option<oneshot::Sender<Mark>> {
        self.snapshot_request
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
    }
}

/// Appends the replica's metrics in Prometheus text format.
pub fn render(r: &Replica, out: &mut Exposition) {
    out.families(ReplicaMetrics::FAMILIES, std::slice::from_ref(&r.metrics));
    out.one(
        "kvix_log_caught_up",
        "1 once the replica applied the log as far as it went at start.",
        Gauge,
        u64::from(r.caught_up.load(Relaxed)),
    );
    let now = r.stopped_for();
    out.by(
        "kvix_log_stopped",
        "1 when this replica stopped following the log, by reason.",
        Gauge,
        "reason",
        Stopped::ALL.map(|reason| (reason.label(), u64::from(now == Some(reason)))),
    );
}

/// Redis keys beside the stream.
pub fn epoch_key(key: &str, worker: WorkerId) -> String {
    format!("{key}:epoch:{worker}")
}
pub fn snapshot_key(key: &str) -> String {
    format!("{key}:snapshot")
}
pub fn positions_key(key: &str) -> String {
    format!("{key}:positions")
}
pub fn generation_key(key: &str) -> String {
    format!("{key}:generation")
}
/// The positions posted by the replicas electing which of them rebuilds the lost
/// generation `old`.
pub fn rebuild_key(key: &str, old: &str) -> String {
    format!("{key}:rebuild:{old}")
}
/// The replica chosen to rebuild the lost generation `old`.
pub fn chosen_key(key: &str, old: &str) -> String {
    format!("{key}:rebuild:{old}:chosen")
}
pub fn fleet_key(key: &str) -> String {
    format!("{key}:fleet")
}

fn rand_id() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    h.write_u32(std::process::id());
    h.finish()
}

/// Compares two stream ids (`ms-seq`).
pub fn id_key(id: &str) -> (u64, u64) {
    let (ms, seq) = id.split_once('-').unwrap_or((id, "0"));
    (ms.parse().unwrap_or(0), seq.parse().unwrap_or(0))
}

#[cfg(test)]
mod tests;
