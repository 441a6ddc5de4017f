//! Per-worker feed state, kept on the worker's home shard. A feed turns what a worker
//! (or a gateway) reports into [`BlockOp`]s that the caller routes, by
//! [`crate::Sharding`], to the [`crate::BlockIndex`] owning each position.

mod events;
mod placement;

pub use events::{ApplyReport, EventFeed, Sequencer};
pub use placement::PlacementFeed;

use kvix_wire::{Feed, WorkerId};

use crate::Holder;

/// A block-store operation produced by a feed. `chain` borrows the feed's input.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockOp<'a> {
    /// `holder` holds block `start + j` with chain hash `chain[j]`.
    Insert {
        ks: u64,
        holder: Holder,
        start: u32,
        chain: &'a [u64],
    },
    /// `holder` no longer holds block `pos` with chain hash `hash`.
    Remove {
        ks: u64,
        holder: Holder,
        pos: u32,
        hash: u64,
    },
    /// Every block of `worker`, every lane and keyspace, on every shard.
    DropWorker { worker: WorkerId },
}

/// The feed state of one worker.
#[derive(Debug)]
pub enum FeedState {
    Events(EventFeed),
    Placements(PlacementFeed),
}

impl FeedState {
    /// Fresh state for a worker with `lanes` lanes fed by `feed`.
    pub fn new(feed: Feed, lanes: usize) -> Self {
        match feed {
            Feed::Events => FeedState::Events(EventFeed::new(lanes)),
            Feed::Placements {
                capacity_blocks,
                ttl_ms,
            } => FeedState::Placements(PlacementFeed::new(capacity_blocks, ttl_ms)),
        }
    }

    /// The feed's kind, for error messages.
    pub fn kind(&self) -> &'static str {
        match self {
            FeedState::Events(_) => "events",
            FeedState::Placements(_) => "placements",
        }
    }
}

impl FeedState {
    /// The feed as plain data at `now_ms`.
    pub fn export(&self, now_ms: u64) -> crate::FeedImage {
        match self {
            FeedState::Events(f) => crate::FeedImage::Events(f.export()),
            FeedState::Placements(f) => crate::FeedImage::Placements(f.export(now_ms)),
        }
    }

    /// Restores an image of the same feed kind; false (nothing restored) for another kind.
    pub fn import(&mut self, image: &crate::FeedImage, now_ms: u64) -> bool {
        match (self, image) {
            (FeedState::Events(f), crate::FeedImage::Events(i)) => f.import(i),
            (FeedState::Placements(f), crate::FeedImage::Placements(i)) => f.import(i, now_ms),
            _ => return false,
        }
        true
    }
}
