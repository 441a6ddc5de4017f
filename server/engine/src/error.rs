//! Typed errors. Bad input is refused with one of these, never a panic.

use kvix_wire::{LaneError, WorkerId};

/// A block-store operation that cannot be carried out.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IndexError {
    #[error(
        "holder (worker {worker}, lane {lane}) is out of range (worker ids < 2^20, lanes < 16)"
    )]
    BadHolder { worker: WorkerId, lane: u8 },
    #[error("blocks from position {start} for {len} blocks run past position 2^32-1")]
    PositionOverflow { start: u32, len: usize },
}

/// A lane roster (or an announce) that is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RosterError {
    #[error("worker {0:?} announced no lanes; a plain worker has one full_attention lane")]
    EmptyRoster(String),
    #[error("worker {name:?} announced {count} lanes; at most 16 are supported")]
    TooManyLanes { name: String, count: usize },
    #[error("worker {name:?} lane {index}: {source}")]
    BadLane {
        name: String,
        index: usize,
        #[source]
        source: LaneError,
    },
    #[error("worker {name:?} lane {index}: chunk of {chunk} tokens is not a positive multiple of the keyspace block ({keyspace_block} tokens)")]
    ChunkNotAligned {
        name: String,
        index: usize,
        chunk: u32,
        keyspace_block: u32,
    },
    #[error("worker {name:?}: the lanes' engine blocks have no common multiple below 2^32 keyspace blocks")]
    StepTooLarge { name: String },
    #[error("worker {0:?}: a placements feed records whole chains, so it needs exactly one full_attention (or mla_attention) lane")]
    PlacementsNeedOneFullLane(String),
    #[error("a worker needs a non-empty name")]
    EmptyName,
    #[error("the server's token block size must be positive")]
    ZeroTokenBlock,
    #[error("no more worker ids: all {limit} are held by active workers (retire one, or raise --max-workers up to 2^20)")]
    TooManyWorkers { limit: u32 },
    #[error("snapshot gives {name:?} id {want}, but the roster numbered it {got} (ids must be restored into an empty roster, in order)")]
    IdMismatch {
        name: String,
        want: WorkerId,
        got: WorkerId,
    },
}

/// Why one event of a batch is refused (which refuses the whole batch).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EventError {
    #[error("lane {lane} is not in the worker's roster of {lanes} lanes")]
    NoSuchLane { lane: u8, lanes: usize },
    #[error("a store of {blocks} blocks in {engine_block}-block engine blocks needs {expected} engine hashes (or none), got {got}")]
    EngineHashCount {
        blocks: usize,
        engine_block: u32,
        expected: usize,
        got: usize,
    },
    #[error("{0}")]
    Index(#[from] IndexError),
}

/// A request the engine refuses as a whole.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EngineError {
    #[error("unknown worker {0}")]
    UnknownWorker(WorkerId),
    #[error("worker {worker} ({name:?}) has the lane roster [{roster}]: lane rules count token blocks and cannot apply to a byte keyspace, so only a worker with a single full-attention lane can hold blocks there")]
    LanesInByteKeyspace {
        worker: WorkerId,
        name: String,
        roster: String,
    },
    #[error("worker {worker} is fed by {has}, not {wanted}")]
    WrongFeed {
        worker: WorkerId,
        has: &'static str,
        wanted: &'static str,
    },
    #[error("event {index} of batch {seq} refused, nothing of the batch applied: {source}")]
    Refused {
        seq: u64,
        index: u32,
        #[source]
        source: EventError,
    },
    #[error("batch seq {seq} refused: {why} (retire and announce the worker again to start its sequence over)")]
    BadSequence { seq: u64, why: String },
    #[error(transparent)]
    Roster(#[from] RosterError),
    #[error(transparent)]
    Index(#[from] IndexError),
}
