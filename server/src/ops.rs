//! What shards ask each other: the requests and replies that cross the mesh, and the
//! conversions from the archived wire messages (one copy, at the shard boundary).

use kvix_engine::{BlockOp, Coverage, Holder};
use kvix_wire::{
    Announced, Applied, ArchivedAnnounce, ArchivedEvent, ErrorCode, Event, EventSource, Feed,
    Keyspace, Lane, Stats, WorkerId,
};

/// An error that goes back to the client as an ErrorReply.
#[derive(Debug, Clone)]
pub struct Failure {
    pub code: ErrorCode,
    pub message: String,
}

impl Failure {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        Failure {
            code,
            message: message.into(),
        }
    }
}

/// A worker (re-)registration, validated at the edge, executed on shard 0.
#[derive(Debug, Clone)]
pub struct AnnounceReq {
    pub name: String,
    pub lanes: Vec<Lane>,
    pub feed: Feed,
    pub source: Option<EventSource>,
}

/// Work on a worker's feed state, executed on the worker's home shard.
#[derive(Debug, Clone)]
pub enum FeedReq {
    Events {
        worker: WorkerId,
        seq: u64,
        keyspace: Keyspace,
        events: Vec<Event>,
    },
    Place {
        worker: WorkerId,
        keyspace: Keyspace,
        chain: Vec<u64>,
    },
}

/// A roster entry as every shard keeps a copy of it.
#[derive(Debug, Clone)]
pub struct RosterEntry {
    pub id: WorkerId,
    pub name: String,
    pub lanes: Vec<Lane>,
    pub feed: Feed,
    /// The roster changed: drop what the worker held under the old one.
    pub reset: bool,
}

/// A block operation that owns its hashes, to cross to another shard.
#[derive(Debug, Clone)]
pub enum Blocks {
    Insert {
        ks: u64,
        holder: Holder,
        start: u32,
        chain: Vec<u64>,
    },
    Remove {
        ks: u64,
        holder: Holder,
        pos: u32,
        hash: u64,
    },
    DropWorker {
        worker: WorkerId,
    },
}

impl Blocks {
    pub fn of(op: BlockOp<'_>) -> Blocks {
        match op {
            BlockOp::Insert {
                ks,
                holder,
                start,
                chain,
            } => Blocks::Insert {
                ks,
                holder,
                start,
                chain: chain.to_vec(),
            },
            BlockOp::Remove {
                ks,
                holder,
                pos,
                hash,
            } => Blocks::Remove {
                ks,
                holder,
                pos,
                hash,
            },
            BlockOp::DropWorker { worker } => Blocks::DropWorker { worker },
        }
    }

    pub fn as_op(&self) -> BlockOp<'_> {
        match *self {
            Blocks::Insert {
                ks,
                holder,
                start,
                ref chain,
            } => BlockOp::Insert {
                ks,
                holder,
                start,
                chain,
            },
            Blocks::Remove {
                ks,
                holder,
                pos,
                hash,
            } => BlockOp::Remove {
                ks,
                holder,
                pos,
                hash,
            },
            Blocks::DropWorker { worker } => BlockOp::DropWorker { worker },
        }
    }
}

#[derive(Debug)]
pub enum ShardReq {
    /// Covered runs of these chain pieces `(start, hashes)`, for a query's fan-out.
    Coverage {
        ks: u64,
        pieces: Vec<(u32, Vec<u64>)>,
        candidates: Vec<WorkerId>,
    },
    /// Block stores and removals that fall in this shard's segments.
    Blocks(Vec<Blocks>),
    /// Register a worker (shard 0 only: it owns id assignment).
    Announce(AnnounceReq),
    /// Forget a worker (shard 0 only; it tells the others).
    Retire(WorkerId),
    /// Replicate a roster change.
    Roster(RosterEntry),
    /// Drop a retired worker everywhere.
    Forget(WorkerId),
    Feed(FeedReq),
    Stats,
    /// This shard's part of a snapshot.
    Export,
}

pub enum ShardRep {
    Coverage(Coverage),
    Done,
    Announced(Announced),
    Applied(Applied),
    Stats(Stats),
    Failed(Failure),
    Export(ShardImage),
}

/// One shard's part of a snapshot: the runs it owns and the feeds it is home to.
#[derive(Debug, Default)]
pub struct ShardImage {
    pub runs: Vec<kvix_engine::RunImage>,
    pub feeds: Vec<(WorkerId, kvix_engine::FeedImage)>,
}

impl std::fmt::Debug for ShardRep {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ShardRep::Coverage(c) => write!(f, "Coverage({} workers)", c.workers().count()),
            ShardRep::Done => f.write_str("Done"),
            ShardRep::Announced(a) => write!(f, "{a:?}"),
            ShardRep::Applied(a) => write!(f, "{a:?}"),
            ShardRep::Stats(s) => write!(f, "{s:?}"),
            ShardRep::Failed(e) => write!(f, "{e:?}"),
            ShardRep::Export(i) => {
                write!(f, "Export({} runs, {} feeds)", i.runs.len(), i.feeds.len())
            }
        }
    }
}

/// Validates an announce at the edge: unknown or malformed lanes never reach a shard.
pub fn announce_request(a: &ArchivedAnnounce) -> Result<AnnounceReq, Failure> {
    let native: kvix_wire::Announce = kvix_wire::to_native(a);
    if native.name.is_empty() {
        return Err(Failure::new(
            ErrorCode::BadLane,
            "a worker needs a non-empty name",
        ));
    }
    Ok(AnnounceReq {
        name: native.name,
        lanes: native.lanes,
        feed: native.feed,
        source: native.source,
    })
}

pub fn event_native(e: &ArchivedEvent) -> Event {
    match e {
        ArchivedEvent::Stored {
            lane,
            start,
            chain,
            engine,
        } => Event::Stored {
            lane: *lane,
            start: start.to_native(),
            chain: kvix_wire::u64s(chain).to_vec(),
            engine: kvix_wire::u64s(engine).to_vec(),
        },
        ArchivedEvent::Removed { lane, hashes } => Event::Removed {
            lane: *lane,
            hashes: kvix_wire::u64s(hashes).to_vec(),
        },
        ArchivedEvent::Cleared => Event::Cleared,
    }
}
