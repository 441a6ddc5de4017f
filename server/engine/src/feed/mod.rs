//! Per-worker feed state, kept on the worker's home executor. A feed turns what a worker
//! (or a gateway) reports into block operations ([`crate::OpBatch`]) that every
//! executor applies to its own index.

mod events;
mod placement;

pub use events::{ApplyReport, EventFeed, EventsJob, Sequencer, OTHER_KEYSPACE_LOOKUPS};
pub use placement::{PlacementFeed, Placing};

use kvix_wire::{ArchivedEvent, Event, Feed, Tier};
use rkyv::option::ArchivedOption;
use rkyv::rend::{u32_le, u64_le};
use rkyv::vec::ArchivedVec;

/// One engine event, borrowed from a native [`Event`] or in place from a frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventRef<'a> {
    /// Blocks now held in `tier` (an engine's own stores: GPU).
    Stored {
        tier: Tier,
        lane: u8,
        start: u32,
        parent: Option<u64>,
        chain: &'a [u64],
        engine: &'a [u64],
    },
    /// Blocks named by engine (or chain) hash left `tier`, or every tier (`None`: their
    /// names go too).
    Removed {
        tier: Option<Tier>,
        lane: u8,
        hashes: &'a [u64],
    },
    Cleared,
}

/// Something that reads as an [`EventRef`].
pub trait EventView {
    fn view(&self) -> EventRef<'_>;
}

impl EventView for Event {
    fn view(&self) -> EventRef<'_> {
        match self {
            Event::Stored {
                lane,
                start,
                parent,
                chain,
                engine,
            } => EventRef::Stored {
                tier: Tier::Gpu,
                lane: *lane,
                start: *start,
                parent: *parent,
                chain,
                engine,
            },
            Event::StoredIn {
                tier,
                lane,
                start,
                parent,
                chain,
                engine,
            } => EventRef::Stored {
                tier: *tier,
                lane: *lane,
                start: *start,
                parent: *parent,
                chain,
                engine,
            },
            Event::Removed { lane, hashes } => EventRef::Removed {
                tier: None,
                lane: *lane,
                hashes,
            },
            Event::RemovedFrom { tier, lane, hashes } => EventRef::Removed {
                tier: Some(*tier),
                lane: *lane,
                hashes,
            },
            Event::Cleared => EventRef::Cleared,
        }
    }
}

impl EventView for ArchivedEvent {
    fn view(&self) -> EventRef<'_> {
        match self {
            ArchivedEvent::Stored {
                lane,
                start,
                parent,
                chain,
                engine,
            } => archived_store(Tier::Gpu, *lane, start, parent, chain, engine),
            ArchivedEvent::StoredIn {
                tier,
                lane,
                start,
                parent,
                chain,
                engine,
            } => archived_store(tier.to_native(), *lane, start, parent, chain, engine),
            ArchivedEvent::Removed { lane, hashes } => EventRef::Removed {
                tier: None,
                lane: *lane,
                hashes: kvix_wire::u64s(hashes),
            },
            ArchivedEvent::RemovedFrom { tier, lane, hashes } => EventRef::Removed {
                tier: Some(tier.to_native()),
                lane: *lane,
                hashes: kvix_wire::u64s(hashes),
            },
            ArchivedEvent::Cleared => EventRef::Cleared,
        }
    }
}

fn archived_store<'a>(
    tier: Tier,
    lane: u8,
    start: &u32_le,
    parent: &ArchivedOption<u64_le>,
    chain: &'a ArchivedVec<u64_le>,
    engine: &'a ArchivedVec<u64_le>,
) -> EventRef<'a> {
    EventRef::Stored {
        tier,
        lane,
        start: start.to_native(),
        parent: parent.as_ref().map(|p| p.to_native()),
        chain: kvix_wire::u64s(chain),
        engine: kvix_wire::u64s(engine),
    }
}

/// How gateways' placements fill in for an event-fed worker whose history is lost:
/// at most `capacity_blocks` blocks (0: they do not), each kept `ttl_ms` after it was
/// last placed (0: until cut by the capacity).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FillIn {
    pub capacity_blocks: u64,
    pub ttl_ms: u64,
}

impl FillIn {
    /// An empty feed to keep the placements in; None when they do not fill in.
    pub fn feed(self) -> Option<PlacementFeed> {
        (self.capacity_blocks > 0).then(|| PlacementFeed::new(self.capacity_blocks, self.ttl_ms))
    }
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

    /// The placements this feed keeps: a placement feed's, or an event feed's fill-in.
    pub fn placements(&mut self) -> Option<&mut PlacementFeed> {
        match self {
            FeedState::Placements(f) => Some(f),
            FeedState::Events(f) => f.fill(),
        }
    }

    /// The feed as plain data at `now_ms`.
    pub fn export(&self, now_ms: u64) -> crate::FeedImage {
        match self {
            FeedState::Events(f) => crate::FeedImage::Events(f.export(now_ms)),
            FeedState::Placements(f) => crate::FeedImage::Placements(f.export(now_ms)),
        }
    }

    /// Restores an image of the same feed kind, an event feed's fill-in as `fill_in`
    /// says; false (nothing restored) for another kind.
    pub fn import(&mut self, image: &crate::FeedImage, now_ms: u64, fill_in: FillIn) -> bool {
        match (self, image) {
            (FeedState::Events(f), crate::FeedImage::Events(i)) => f.import(i, now_ms, fill_in),
            (FeedState::Placements(f), crate::FeedImage::Placements(i)) => f.import(i, now_ms),
            _ => return false,
        }
        true
    }
}
