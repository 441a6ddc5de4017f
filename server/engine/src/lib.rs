//! kvix-engine: the index engine of kvix. No I/O, no threads: the server runs one
//! [`Core`] per executor, and [`Engine`] runs one on a single thread for tests and benches.
//!
//! - [`index`]: the block store ([`BlockIndex`]): runs of chain hashes, interned holder
//!   sets, a block table, and the walk a query takes through them,
//! - [`query`]: scoring and ranking the workers a walk meets ([`Ranker`]),
//! - [`score`]: the joint reuse rules over a worker's lanes ([`Rules`]),
//! - [`feed`]: per-worker feed state (event sequences and names, placement recency),
//!   which turns feed input into block operations ([`ops`]),
//! - [`roster`]: the registry (names → small ids, lane validation) and the roster every
//!   executor keeps,
//! - [`core`]: one executor's roster, home feeds, index and query scratch,
//! - [`engine`]: the single-threaded composition.

pub mod core;
pub mod coverage;
pub mod engine;
pub mod error;
pub mod feed;
mod hashing;
pub mod image;
pub mod index;
mod interner;
mod keymap;
pub mod ops;
pub mod query;
pub mod roster;
pub mod score;
mod sets;
mod table;

pub use crate::core::Core;
pub use coverage::Coverage;
pub use engine::{Answer, Engine, EngineStats};
pub use error::{EngineError, EventError, IndexError, RosterError};
pub use feed::{
    ApplyReport, EventFeed, EventRef, EventView, EventsJob, FeedState, FillIn, PlacementFeed,
    Placing, Sequencer, OTHER_KEYSPACE_LOOKUPS,
};
#[doc(hidden)]
pub use hashing::FastMap;
pub use image::{
    EngineImage, EventFeedImage, FeedImage, NameImage, PlacedImage, PlacementFeedImage, RunImage,
    WorkerImage,
};
pub use index::slow_rebuilds;
pub use index::BlockIndex;
pub use interner::Interner;
pub use keymap::KeyMap;
pub use ops::{Cursor, Op, OpBatch, RosterChange, Update};
pub use query::{Ask, Ranker};
pub use roster::{AnnounceOutcome, Class, Classes, Registry, Roster, WorkerEntry};
pub use score::{Rule, Rules};

use kvix_wire::{ChunkKind, Keyspace, Tier, WorkerId};

/// Most lanes a worker may announce (a holder packs its lane in 4 bits).
pub const MAX_LANES: usize = 16;

/// Worker ids stay below this, so per-query scratch indexed by worker stays small.
pub const MAX_WORKERS: u32 = 1 << 20;

/// A keyspace as the engine sees it: its seed (which is also its id) and its kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Ks {
    pub seed: u64,
    pub kind: ChunkKind,
}

impl Ks {
    /// The engine view of a wire keyspace on a server hashing `token_block`-token blocks.
    pub fn of(keyspace: &Keyspace, token_block: u32) -> Self {
        Ks {
            seed: keyspace.seed(token_block),
            kind: keyspace.kind,
        }
    }

    pub fn tokens(seed: u64) -> Self {
        Ks {
            seed,
            kind: ChunkKind::Tokens,
        }
    }

    pub fn bytes(seed: u64) -> Self {
        Ks {
            seed,
            kind: ChunkKind::Bytes,
        }
    }
}

/// One cache group of one worker in one storage tier: what holds a block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Holder {
    pub worker: WorkerId,
    pub lane: u8,
    pub tier: Tier,
}

/// A packed holder's worker is its bits from here up (`worker << 6 | tier << 4 | lane`).
pub(crate) const WORKER_SHIFT: u32 = 6;

/// The worker of a packed holder.
#[inline]
pub(crate) const fn worker_of(packed: u32) -> WorkerId {
    packed >> WORKER_SHIFT
}

impl Holder {
    /// A lane's holder on GPU (where engines' own stores land).
    pub fn new(worker: WorkerId, lane: u8) -> Self {
        Holder::in_tier(worker, lane, Tier::Gpu)
    }

    pub fn in_tier(worker: WorkerId, lane: u8, tier: Tier) -> Self {
        Holder { worker, lane, tier }
    }

    /// Packed as `worker << 6 | tier << 4 | lane`: sorting packed holders groups them by
    /// worker, then tier.
    pub(crate) fn pack(self) -> Result<u32, IndexError> {
        if self.worker >= MAX_WORKERS || self.lane as usize >= MAX_LANES {
            return Err(IndexError::BadHolder {
                worker: self.worker,
                lane: self.lane,
            });
        }
        Ok(self.worker << WORKER_SHIFT | (self.tier as u32) << 4 | self.lane as u32)
    }

    pub(crate) fn unpack(packed: u32) -> Self {
        Holder {
            worker: worker_of(packed),
            lane: (packed & 15) as u8,
            tier: tier_of(packed),
        }
    }

    /// The holder's lane and tier in one byte, as a snapshot keeps it (`tier << 4 |
    /// lane`: a snapshot written before tiers reads as GPU).
    pub fn slot(self) -> u8 {
        (self.tier as u8) << 4 | self.lane
    }

    /// The holder of `worker` at `slot` ([`Holder::slot`]); None for a tier past storage.
    pub fn from_slot(worker: WorkerId, slot: u8) -> Option<Self> {
        let tier = *Tier::ALL.get(usize::from(slot >> 4))?;
        Some(Holder::in_tier(worker, slot & 15, tier))
    }
}

/// The tier of a packed holder.
#[inline]
pub(crate) fn tier_of(packed: u32) -> Tier {
    Tier::ALL[((packed >> 4) & 3).min(2) as usize]
}
