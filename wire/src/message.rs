//! The message bodies. Each is an rkyv-archived struct that follows a frame header
//! whose `kind` byte names it; [`crate::codec`] maps kinds to types in one table.

use rkyv::{Archive, Deserialize, Serialize};

use crate::{Keyspace, Lane, WorkerId};

/// First frame of every connection, client → server.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub struct Hello {
    /// Free text naming the client (logged).
    pub client: String,
    /// The token block size the client hashes with; refused unless equal to the server's.
    pub token_block: u32,
    /// Shared token, when the server requires one.
    pub auth: Option<String>,
}

/// The server's answer to [`Hello`].
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub struct Welcome {
    pub server: String,
    pub token_block: u32,
    pub byte_chunk: u32,
    /// The server's executors, each holding a whole copy of the index.
    pub shards: u32,
    /// Largest frame (header + body) the server accepts.
    pub max_frame: u32,
}

/// Which workers can reuse how much of this chain.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq, Default)]
#[rkyv(derive(Debug))]
pub struct Query {
    pub keyspace: Keyspace,
    /// Chain hashes of the prompt's whole blocks, from block 0.
    pub chain: Vec<u64>,
    /// Only these workers are scored; empty = all.
    pub candidates: Vec<WorkerId>,
    /// At most this many scores, best first; 0 = all.
    pub top_k: u32,
    /// Also return the raw per-lane covered runs (debugging).
    pub want_runs: bool,
}

/// One worker's joint reusable prefix, in keyspace blocks.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub struct Score {
    pub worker: WorkerId,
    pub blocks: u32,
}

/// A half-open run `[start, end)` of block positions.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub struct Run {
    pub start: u32,
    pub end: u32,
}

/// The covered runs of one lane along the queried chain.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub struct LaneRuns {
    pub lane: u8,
    pub runs: Vec<Run>,
}

/// Debug detail: every lane of one worker, including lanes with no coverage.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub struct WorkerRuns {
    pub worker: WorkerId,
    pub lanes: Vec<LaneRuns>,
}

/// The reply to [`Query`].
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq, Default)]
#[rkyv(derive(Debug))]
pub struct Answer {
    /// Workers with a positive joint score, best first (ties: lower id first).
    pub scores: Vec<Score>,
    /// Workers that hold some of the chain yet can reuse none of it jointly.
    pub unscorable: u32,
    /// Filled when the query asked for runs.
    pub runs: Vec<WorkerRuns>,
    /// The scored workers whose history is lost, ascending: their engine may hold more
    /// than their score says (batches went by unapplied), until it clears or restarts.
    pub history_lost: Vec<WorkerId>,
    /// The server's count of ids given again to another name (see [`Roster::reissued`]):
    /// names learnt under another count may be stale.
    pub reissued: u32,
}

/// v5: where a worker holds a block, in the order an engine loads a prefix from: its
/// GPU blocks first, then blocks offloaded to CPU memory, then storage (disk, a shared
/// or remote store). A depth in a lower tier is cumulative (see [`Depths`]).
#[derive(
    Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord,
)]
#[rkyv(derive(Debug, PartialEq, Eq))]
#[repr(u8)]
pub enum Tier {
    Gpu,
    Cpu,
    Storage,
}

impl Tier {
    pub const ALL: [Tier; 3] = [Tier::Gpu, Tier::Cpu, Tier::Storage];

    /// The label used in metrics and JSON.
    pub const fn label(self) -> &'static str {
        match self {
            Tier::Gpu => "gpu",
            Tier::Cpu => "cpu",
            Tier::Storage => "storage",
        }
    }
}

impl ArchivedTier {
    pub fn to_native(&self) -> Tier {
        match self {
            ArchivedTier::Gpu => Tier::Gpu,
            ArchivedTier::Cpu => Tier::Cpu,
            ArchivedTier::Storage => Tier::Storage,
        }
    }
}

/// v5: what reuse from a lower tier is worth against reuse from GPU (1): a block loaded
/// from CPU or storage is a transfer, cheaper than recomputing it but not free.
/// Each weight is in `[0, 1]`.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq)]
#[rkyv(derive(Debug))]
pub struct TierWeights {
    pub cpu: f32,
    pub storage: f32,
}

impl TierWeights {
    /// Dynamo's KV router: host memory 0.75, disk 0.25 of a GPU block.
    pub const DYNAMO: TierWeights = TierWeights {
        cpu: 0.75,
        storage: 0.25,
    };
    /// Every tier as good as GPU: ranks by the joint depth, as a v4 answer does.
    pub const JOINT: TierWeights = TierWeights {
        cpu: 1.0,
        storage: 1.0,
    };

    /// Whether both weights are numbers in `[0, 1]`.
    pub fn is_valid(&self) -> bool {
        [self.cpu, self.storage]
            .iter()
            .all(|w| (0.0..=1.0).contains(w))
    }
}

impl Default for TierWeights {
    fn default() -> Self {
        TierWeights::DYNAMO
    }
}

/// v5: ask as [`Query`] does, ranked by reuse weighed by tier.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Default)]
#[rkyv(derive(Debug))]
pub struct TieredQuery {
    pub keyspace: Keyspace,
    /// Chain hashes of the prompt's whole blocks, from block 0.
    pub chain: Vec<u64>,
    /// Only these workers are scored; empty = all.
    pub candidates: Vec<WorkerId>,
    /// At most this many scores, best first; 0 = all.
    pub top_k: u32,
    /// Also return the raw per-lane covered runs (debugging; every tier's runs joined).
    pub want_runs: bool,
    pub weights: TierWeights,
}

/// v5: how deep a worker's reusable prefix reaches, in keyspace blocks, loading from
/// GPU only (`gpu`), then continuing from CPU (`cpu`), then from storage (`storage`):
/// `gpu <= cpu <= storage`, and `storage` is the joint figure a v4 answer gives.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq, Default)]
#[rkyv(derive(Debug))]
pub struct Depths {
    pub gpu: u32,
    pub cpu: u32,
    pub storage: u32,
}

impl Depths {
    /// Depths of a worker whose blocks are all on GPU.
    pub const fn gpu_only(blocks: u32) -> Depths {
        Depths {
            gpu: blocks,
            cpu: blocks,
            storage: blocks,
        }
    }

    /// The reuse these depths are worth under `w`, in GPU blocks. Depths out of order
    /// (from a peer that broke the rule) are taken as cumulative from GPU up.
    pub fn weighed(&self, w: &TierWeights) -> f64 {
        let cpu = self.cpu.max(self.gpu);
        let storage = self.storage.max(cpu);
        self.gpu as f64
            + f64::from(w.cpu) * (cpu - self.gpu) as f64
            + f64::from(w.storage) * (storage - cpu) as f64
    }
}

/// v5: why the server doubts a worker's score (its reuse reports disagree with it).
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[rkyv(derive(Debug))]
#[repr(u8)]
pub enum SuspectCause {
    /// The asking gateway's token ids differ from the engine's (its tokenizer or chat
    /// template): predictions miss reuse the engine has.
    GatewayTokenization,
    /// The worker's events stopped or go elsewhere: it reuses what the index lacks.
    EventsMissing,
    /// The worker evicts before its removals arrive: predicted reuse is not there.
    EventsLagging,
    /// The worker reuses more than the index knows (history lost, a tier not reported).
    Undercounted,
}

/// v5: one worker's reusable prefix, with its tiers.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub struct TieredScore {
    pub worker: WorkerId,
    pub tiers: Depths,
    /// Set when the server doubts this score, with why.
    pub suspect: Option<SuspectCause>,
}

/// v5: the reply to [`TieredQuery`]; what [`Answer`] says, each score with its tiers,
/// ranked by [`Depths::weighed`] under the query's weights (ties: lower id first).
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq, Default)]
#[rkyv(derive(Debug))]
pub struct TieredAnswer {
    pub scores: Vec<TieredScore>,
    pub unscorable: u32,
    pub runs: Vec<WorkerRuns>,
    pub history_lost: Vec<WorkerId>,
    pub reissued: u32,
    /// The answering replica knows its copy is behind the log: ask another one.
    pub stale: bool,
}

/// v5: what one routed request reused, as its engine reported it.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub struct Reuse {
    pub worker: WorkerId,
    /// The keyspace's model the request was for.
    pub model: String,
    /// The reuse the answer predicted for this worker, in tokens; None when the worker
    /// was not in the answer (the gateway chose it for other reasons).
    pub predicted_tokens: Option<u32>,
    /// What the engine says it reused (`usage.prompt_tokens_details.cached_tokens`).
    pub cached_tokens: u32,
    /// The prompt's length in tokens (an engine never reuses all of it).
    pub prompt_tokens: u32,
}

/// v5: a gateway's batch of reuse reports (sent without asking for a reply).
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq, Default)]
#[rkyv(derive(Debug))]
pub struct ReuseReport {
    pub reports: Vec<Reuse>,
}

/// How a worker's holdings are learnt.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub enum Feed {
    /// Exact engine events (stored / removed / cleared).
    Events,
    /// Gateways' placements: approximate, capped at `capacity_blocks` (oldest-used cut
    /// first), optionally expiring after `ttl_ms` (0 = never).
    Placements { capacity_blocks: u64, ttl_ms: u64 },
}

/// Where the server can subscribe to a worker's own KV event stream (vLLM / SGLang).
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub struct EventSource {
    /// ZMQ PUB endpoint, e.g. `tcp://127.0.0.1:5557`.
    pub endpoint: String,
    /// ZMQ ROUTER replay endpoint; empty = none.
    pub replay: String,
    /// Keyspace the engine's token ids are rehashed into.
    pub model: String,
    pub salt: String,
}

/// Register (or re-register) a worker and its lane roster.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub struct Announce {
    /// Stable name; the same name always maps to the same id.
    pub name: String,
    /// One lane per independently evicted cache group; a plain worker has one full lane.
    pub lanes: Vec<Lane>,
    pub feed: Feed,
    pub source: Option<EventSource>,
}

/// The reply to [`Announce`].
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub struct Announced {
    pub worker: WorkerId,
    /// False when the name was known with the same roster (nothing reset).
    pub created: bool,
}

/// Forget a worker and everything it holds.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub struct Retire {
    pub worker: WorkerId,
}

/// One engine cache event of a worker.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub enum Event {
    /// Blocks `start .. start + chain.len()` of a chain are now held by `lane`.
    /// `parent` is the chain hash of block `start − 1` when the producer knows it (a
    /// decode-style store of one block names its parent): the index then extends the
    /// parent's run instead of opening a new one. `engine` is empty or holds one engine
    /// hash per engine block of the lane, for removals that name engine hashes.
    Stored {
        lane: u8,
        start: u32,
        parent: Option<u64>,
        chain: Vec<u64>,
        engine: Vec<u64>,
    },
    /// Blocks named by engine hash (or chain hash, where the store carried none) are gone.
    Removed { lane: u8, hashes: Vec<u64> },
    /// The worker dropped its whole cache.
    Cleared,
    /// v5: `Stored` in a tier other than GPU (a `Stored` is GPU): the blocks are now
    /// also held in `tier`, where the engine can load them from.
    StoredIn {
        tier: Tier,
        lane: u8,
        start: u32,
        parent: Option<u64>,
        chain: Vec<u64>,
        engine: Vec<u64>,
    },
    /// v5: the named blocks left `tier` but another tier still holds them (their names
    /// stay). A `Removed` says they left every tier.
    RemovedFrom {
        tier: Tier,
        lane: u8,
        hashes: Vec<u64>,
    },
}

/// A batch of a worker's events, in its own sequence order.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub struct EventBatch {
    pub worker: WorkerId,
    pub seq: u64,
    pub keyspace: Keyspace,
    pub events: Vec<Event>,
}

/// What became of an [`EventBatch`].
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub enum ApplyStatus {
    Applied,
    /// seq was at or below the last applied one: ignored.
    Duplicate,
    /// Applied, but seqs between `expected` and this one never arrived.
    Gap {
        expected: u64,
    },
}

#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub struct Applied {
    pub seq: u64,
    pub status: ApplyStatus,
}

/// A gateway dispatched a request for `chain` to `worker`.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub struct Placement {
    pub worker: WorkerId,
    pub keyspace: Keyspace,
    pub chain: Vec<u64>,
}

/// Ask for the server's counters.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq, Default)]
#[rkyv(derive(Debug))]
pub struct StatsRequest {}

#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq, Default)]
#[rkyv(derive(Debug))]
pub struct Stats {
    pub workers: u32,
    /// Distinct blocks held, over all shards.
    pub blocks: u64,
    /// (block, holder) memberships.
    pub memberships: u64,
    pub queries: u64,
    pub events: u64,
    /// Queries each executor answered, for the skew view.
    pub shard_load: Vec<u64>,
}

/// Asks for the names of the workers announced, by any client: every active worker
/// with an id from `from` on, and the workers named in `names` whatever their id.
/// A gateway that announced nothing learns from it the names its answers' ids stand for.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq, Default)]
#[rkyv(derive(Debug))]
pub struct RosterRequest {
    pub from: WorkerId,
    pub names: Vec<String>,
}

/// One active worker: its id and the name it was announced under.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub struct RosterEntry {
    pub worker: WorkerId,
    pub name: String,
}

/// Reply to [`RosterRequest`]: active workers in id order (those asked for by name
/// first). `more`: the listing stopped to keep the frame small; ask again from `next`.
/// Otherwise `next` is one past the highest id the server has given.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq, Default)]
#[rkyv(derive(Debug))]
pub struct Roster {
    pub workers: Vec<RosterEntry>,
    pub next: WorkerId,
    pub more: bool,
    /// Ids this server gave again to another name since it started (once every id
    /// was given, a new name takes the id retired longest ago). A client whose names
    /// were learnt under another count lists the roster again from id 0 and drops what
    /// it knew: an id may name another worker now.
    pub reissued: u32,
}

/// A raw payload echoed back at `reply_len` bytes: the latency floor of the transport.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq, Default)]
#[rkyv(derive(Debug))]
pub struct Echo {
    pub payload: Vec<u8>,
    pub reply_len: u32,
}

/// Generic success with no other content (retire, placement when a reply is wanted).
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq, Default)]
#[rkyv(derive(Debug))]
pub struct Ack {}

/// Why a request (or the connection) was refused.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub enum ErrorCode {
    /// The frame could not be read; the connection is closed after this.
    BadFrame,
    UnsupportedVersion,
    /// A request came before a successful Hello.
    NoHello,
    Unauthorized,
    BlockSizeMismatch,
    UnknownWorker,
    /// A lane roster or a lane index was refused.
    BadLane,
    /// Lanes other than one full lane cannot feed a byte keyspace.
    LanesInByteKeyspace,
    /// Too many connections (the connection is closed), or the index is at
    /// `--max-blocks` and a batch that stores blocks is refused (retry later).
    Overloaded,
    /// The request is valid but the server cannot do it (a bug if it shows up).
    Internal,
    /// An announce's event source cannot be subscribed (endpoint, feed).
    BadSource,
    /// An announce would subscribe more event sources than `--max-sources`.
    TooManySources,
    /// The reply would exceed the largest frame (`--max-frame`).
    TooLarge,
    /// An event batch's sequence number jumps absurdly far ahead of the last one.
    BadSequence,
    /// The replicated write log (Redis) cannot be reached: the write was not taken.
    LogUnavailable,
    /// v5: a field of the request is out of its range (tier weights, ...).
    BadRequest,
    /// v5: this replica's copy is behind the log and cannot answer: ask another one.
    Stale,
}

impl ErrorCode {
    /// Every code, in tag order.
    pub const ALL: [ErrorCode; 17] = [
        ErrorCode::BadFrame,
        ErrorCode::UnsupportedVersion,
        ErrorCode::NoHello,
        ErrorCode::Unauthorized,
        ErrorCode::BlockSizeMismatch,
        ErrorCode::UnknownWorker,
        ErrorCode::BadLane,
        ErrorCode::LanesInByteKeyspace,
        ErrorCode::Overloaded,
        ErrorCode::Internal,
        ErrorCode::BadSource,
        ErrorCode::TooManySources,
        ErrorCode::TooLarge,
        ErrorCode::BadSequence,
        ErrorCode::LogUnavailable,
        ErrorCode::BadRequest,
        ErrorCode::Stale,
    ];

    /// The code a client of `version` knows: a v4 client reads a code new in v5 as the
    /// v4 code that calls for the same action.
    pub fn for_version(self, version: u16) -> ErrorCode {
        match self {
            ErrorCode::BadRequest if version < 5 => ErrorCode::BadFrame,
            ErrorCode::Stale if version < 5 => ErrorCode::Overloaded,
            code => code,
        }
    }
}

#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub struct ErrorReply {
    pub code: ErrorCode,
    pub message: String,
}

impl ArchivedErrorCode {
    pub fn to_native(&self) -> ErrorCode {
        use ArchivedErrorCode as A;
        match self {
            A::BadFrame => ErrorCode::BadFrame,
            A::UnsupportedVersion => ErrorCode::UnsupportedVersion,
            A::NoHello => ErrorCode::NoHello,
            A::Unauthorized => ErrorCode::Unauthorized,
            A::BlockSizeMismatch => ErrorCode::BlockSizeMismatch,
            A::UnknownWorker => ErrorCode::UnknownWorker,
            A::BadLane => ErrorCode::BadLane,
            A::LanesInByteKeyspace => ErrorCode::LanesInByteKeyspace,
            A::Overloaded => ErrorCode::Overloaded,
            A::Internal => ErrorCode::Internal,
            A::BadSource => ErrorCode::BadSource,
            A::TooManySources => ErrorCode::TooManySources,
            A::TooLarge => ErrorCode::TooLarge,
            A::BadSequence => ErrorCode::BadSequence,
            A::LogUnavailable => ErrorCode::LogUnavailable,
            A::BadRequest => ErrorCode::BadRequest,
            A::Stale => ErrorCode::Stale,
        }
    }
}
