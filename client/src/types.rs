//! The client's API types: how workers are named, prompts, query options and outcomes.

use std::sync::Arc;
use std::time::Duration;

use kvix_wire::{Depths, ErrorReply, SuspectCause, TierWeights, WorkerId};

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

/// `"name"` (quoted) or `id 7`, as messages name a worker.
impl std::fmt::Display for WorkerRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            WorkerRef::Id(id) => write!(f, "id {id}"),
            WorkerRef::Name(n) => write!(f, "{n:?}"),
        }
    }
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
    /// What reuse from CPU and storage is worth against GPU for this query; None: the
    /// client's [`crate::ClientConfig::tier_weights`].
    pub weights: Option<TierWeights>,
}

/// One worker's reusable prefix.
#[derive(Debug, Clone, PartialEq)]
pub struct WorkerScore {
    /// The worker's id on the server that answered.
    pub worker: WorkerId,
    /// Its name (None only when the server's roster could not be fetched in time).
    pub name: Option<Arc<str>>,
    /// Reusable prefix loading from any tier, in keyspace blocks (`tiers.storage`).
    pub blocks: u32,
    /// The prefix by tier: from GPU alone, then continuing from CPU, then from storage.
    pub tiers: Depths,
    /// `tiers` weighed by the query's tier weights, in GPU blocks: what the pick weighs.
    pub reuse: f64,
    /// The worker's history is lost: batches of its engine went by unapplied, so the
    /// engine may hold more of the prompt than `blocks` (never less) until it clears
    /// its cache or restarts.
    pub history_lost: bool,
    /// The server doubts this score, and why (its engine's reuse reports disagree).
    pub suspect: Option<SuspectCause>,
}

impl WorkerScore {
    /// [`WorkerScore::reuse`] as a pick should weigh it: halved for a worker whose
    /// engine's reports say kvix predicts more than it keeps
    /// ([`SuspectCause::EventsLagging`]: its prefix may be gone by the time the request
    /// arrives); the other causes say kvix predicts less, which no pick can make up.
    pub fn expected_reuse(&self) -> f64 {
        match self.suspect {
            Some(SuspectCause::EventsLagging) => self.reuse / 2.0,
            _ => self.reuse,
        }
    }

    /// A score whose blocks are all on GPU (tests, and answers built by hand).
    pub fn on_gpu(worker: WorkerId, name: Option<Arc<str>>, blocks: u32) -> Self {
        WorkerScore {
            worker,
            name,
            blocks,
            tiers: Depths::gpu_only(blocks),
            reuse: f64::from(blocks),
            history_lost: false,
            suspect: None,
        }
    }
}

/// What a query came to. Every variant but `Scores` means "route without the index".
#[derive(Debug, Clone, PartialEq)]
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
