//! The worker registry: names cross the wire once, here; everything else uses small
//! integer ids (trap 7). Validates lane rosters and derives each worker's scoring rules.

use kvix_wire::{ChunkKind, Feed, Lane, LaneError, LaneKind, WorkerId};

use crate::error::{EngineError, RosterError};
use crate::hashing::FastMap;
use crate::score::{Rule, Rules};
use crate::{MAX_LANES, MAX_WORKERS};

/// A registered worker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerEntry {
    pub id: WorkerId,
    pub name: String,
    pub lanes: Vec<Lane>,
    pub feed: Feed,
    /// Engine block of each lane in token-keyspace blocks.
    pub lane_blocks: Vec<u32>,
    /// Scoring rules in token keyspaces.
    pub rules: Rules,
}

impl WorkerEntry {
    /// A single full-attention (or MLA) lane: the only roster a byte keyspace accepts.
    pub fn is_plain(&self) -> bool {
        self.lanes.len() == 1 && self.lanes[0].kind.is_full()
    }

    /// Engine block sizes per lane in keyspace blocks of `kind`; refuses lanes in a byte
    /// keyspace (trap 4), where a plain worker's one lane counts 1 chunk per block.
    pub fn lane_blocks_in(&self, kind: ChunkKind) -> Result<&[u32], EngineError> {
        match kind {
            ChunkKind::Tokens => Ok(&self.lane_blocks),
            ChunkKind::Bytes if self.is_plain() => Ok(&[1]),
            ChunkKind::Bytes => Err(EngineError::LanesInByteKeyspace {
                worker: self.id,
                name: self.name.clone(),
                roster: self
                    .lanes
                    .iter()
                    .map(|l| l.to_string())
                    .collect::<Vec<_>>()
                    .join(", "),
            }),
        }
    }

    /// The scoring rules in keyspaces of `kind`; `None` where the worker cannot hold blocks.
    pub fn rules_in(&self, kind: ChunkKind) -> Option<&Rules> {
        static PLAIN: std::sync::OnceLock<Rules> = std::sync::OnceLock::new();
        match kind {
            ChunkKind::Tokens => Some(&self.rules),
            ChunkKind::Bytes if self.is_plain() => Some(PLAIN.get_or_init(Rules::plain)),
            ChunkKind::Bytes => None,
        }
    }
}

/// What an announce did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AnnounceOutcome {
    /// A new name (or a retired one coming back): fresh id state.
    Created,
    /// Known with the same roster and feed: nothing changes.
    Unchanged,
    /// Known with another roster or feed: the caller must drop its blocks and feed state.
    Changed,
}

/// Names → ids, ids → entries. Ids are dense and stable: a name keeps its id for the
/// life of the roster, even across retire and re-announce.
#[derive(Debug, Default)]
pub struct Roster {
    ids: FastMap<String, WorkerId>,
    entries: Vec<Option<WorkerEntry>>,
    active: u32,
}

impl Roster {
    pub fn new() -> Self {
        Self::default()
    }

    /// Registers `name` with its lanes and feed, validated against the server's token
    /// block size. The same name always gets the same id.
    pub fn announce(
        &mut self,
        name: &str,
        lanes: &[Lane],
        feed: Feed,
        token_block: u32,
    ) -> Result<(WorkerId, AnnounceOutcome), RosterError> {
        let (lane_blocks, rules) = validate(name, lanes, feed, token_block)?;
        let id = match self.ids.get(name) {
            Some(&id) => id,
            None => {
                if self.entries.len() as u32 >= MAX_WORKERS {
                    return Err(RosterError::TooManyWorkers);
                }
                let id = self.entries.len() as WorkerId;
                self.ids.insert(name.to_string(), id);
                self.entries.push(None);
                id
            }
        };
        let slot = &mut self.entries[id as usize];
        let outcome = match slot {
            Some(e) if e.lanes == lanes && e.feed == feed => {
                return Ok((id, AnnounceOutcome::Unchanged))
            }
            Some(_) => AnnounceOutcome::Changed,
            None => {
                self.active += 1;
                AnnounceOutcome::Created
            }
        };
        *slot = Some(WorkerEntry {
            id,
            name: name.to_string(),
            lanes: lanes.to_vec(),
            feed,
            lane_blocks,
            rules,
        });
        Ok((id, outcome))
    }

    /// Every id ever given, in id order, retired ones included.
    pub fn export(&self) -> Vec<crate::WorkerImage> {
        let mut names: Vec<(&String, WorkerId)> = self.ids.iter().map(|(n, &id)| (n, id)).collect();
        names.sort_unstable_by_key(|&(_, id)| id);
        names
            .into_iter()
            .map(|(name, id)| match &self.entries[id as usize] {
                Some(e) => crate::WorkerImage {
                    id,
                    name: name.clone(),
                    lanes: e.lanes.clone(),
                    feed: e.feed,
                    active: true,
                },
                None => crate::WorkerImage {
                    id,
                    name: name.clone(),
                    lanes: Vec::new(),
                    feed: Feed::Events,
                    active: false,
                },
            })
            .collect()
    }

    /// Rebuilds an exported roster into an empty one, giving every name its old id.
    pub fn import(
        &mut self,
        workers: &[crate::WorkerImage],
        token_block: u32,
    ) -> Result<(), RosterError> {
        for w in workers {
            let lanes = if w.active {
                w.lanes.clone()
            } else {
                vec![Lane::full(token_block)]
            };
            let feed = if w.active { w.feed } else { Feed::Events };
            let (id, _) = self.announce(&w.name, &lanes, feed, token_block)?;
            if id != w.id {
                return Err(RosterError::IdMismatch {
                    name: w.name.clone(),
                    want: w.id,
                    got: id,
                });
            }
            if !w.active {
                let _ = self.retire(id);
            }
        }
        Ok(())
    }

    /// Marks `id` retired; its name keeps the id for a later announce.
    pub fn retire(&mut self, id: WorkerId) -> Result<WorkerEntry, EngineError> {
        let entry = self
            .entries
            .get_mut(id as usize)
            .and_then(Option::take)
            .ok_or(EngineError::UnknownWorker(id))?;
        self.active -= 1;
        Ok(entry)
    }

    /// The active worker `id`.
    pub fn get(&self, id: WorkerId) -> Option<&WorkerEntry> {
        self.entries.get(id as usize)?.as_ref()
    }

    /// Like [`Roster::get`], as an error for unknown ids.
    pub fn worker(&self, id: WorkerId) -> Result<&WorkerEntry, EngineError> {
        self.get(id).ok_or(EngineError::UnknownWorker(id))
    }

    /// The id a name was given, if it was ever announced.
    pub fn id_of(&self, name: &str) -> Option<WorkerId> {
        self.ids.get(name).copied()
    }

    /// Active workers.
    pub fn len(&self) -> u32 {
        self.active
    }

    pub fn is_empty(&self) -> bool {
        self.active == 0
    }

    /// Every active worker, by id.
    pub fn iter(&self) -> impl Iterator<Item = &WorkerEntry> {
        self.entries.iter().flatten()
    }
}

/// Checks a roster and derives (engine blocks per lane, rules) for token keyspaces.
fn validate(
    name: &str,
    lanes: &[Lane],
    feed: Feed,
    token_block: u32,
) -> Result<(Vec<u32>, Rules), RosterError> {
    if name.is_empty() {
        return Err(RosterError::EmptyName);
    }
    if token_block == 0 {
        return Err(RosterError::ZeroTokenBlock);
    }
    if lanes.is_empty() {
        return Err(RosterError::EmptyRoster(name.to_string()));
    }
    if lanes.len() > MAX_LANES {
        return Err(RosterError::TooManyLanes {
            name: name.to_string(),
            count: lanes.len(),
        });
    }
    let bad = |index, source| RosterError::BadLane {
        name: name.to_string(),
        index,
        source,
    };
    let mut blocks = Vec::with_capacity(lanes.len());
    let mut rules = Vec::with_capacity(lanes.len());
    for (i, lane) in lanes.iter().enumerate() {
        let k = lane.blocks_in(token_block).map_err(|e| bad(i, e))?;
        match lane.kind {
            LaneKind::SlidingWindow { window: 0 } => {
                let e = LaneError::MissingParam {
                    kind: "sliding_window",
                    param: "window",
                };
                return Err(bad(i, e));
            }
            LaneKind::ChunkedLocal { chunk } if chunk == 0 || chunk % token_block != 0 => {
                return Err(RosterError::ChunkNotAligned {
                    name: name.to_string(),
                    index: i,
                    chunk,
                    keyspace_block: token_block,
                })
            }
            _ => {}
        }
        blocks.push(k);
        rules.push(Rule::of(lane.kind, lane.block_tokens, k, token_block));
    }
    if matches!(feed, Feed::Placements { .. }) && !(lanes.len() == 1 && lanes[0].kind.is_full()) {
        return Err(RosterError::PlacementsNeedOneFullLane(name.to_string()));
    }
    let rules = Rules::new(&rules, &blocks).ok_or_else(|| RosterError::StepTooLarge {
        name: name.to_string(),
    })?;
    Ok((blocks, rules))
}

#[cfg(test)]
mod tests {
    use super::*;

    const EV: Feed = Feed::Events;

    #[test]
    fn same_name_same_id_and_changes_are_reported() {
        let mut r = Roster::new();
        let full = [Lane::full(16)];
        assert_eq!(
            r.announce("a", &full, EV, 16),
            Ok((0, AnnounceOutcome::Created))
        );
        assert_eq!(
            r.announce("b", &full, EV, 16),
            Ok((1, AnnounceOutcome::Created))
        );
        assert_eq!(
            r.announce("a", &full, EV, 16),
            Ok((0, AnnounceOutcome::Unchanged))
        );
        let hybrid = [Lane::full(16), Lane::parse("mamba@32").unwrap()];
        assert_eq!(
            r.announce("a", &hybrid, EV, 16),
            Ok((0, AnnounceOutcome::Changed))
        );
        assert_eq!(r.get(0).unwrap().rules.step(), 2);
        assert_eq!(r.len(), 2);
        r.retire(0).unwrap();
        assert!(r.retire(0).is_err());
        assert_eq!(r.len(), 1);
        assert_eq!(
            r.announce("a", &full, EV, 16),
            Ok((0, AnnounceOutcome::Created))
        );
        assert_eq!(r.id_of("b"), Some(1));
    }

    #[test]
    fn bad_rosters_are_typed_errors() {
        let mut r = Roster::new();
        assert!(matches!(
            r.announce("x", &[], EV, 16),
            Err(RosterError::EmptyRoster(_))
        ));
        let many = vec![Lane::full(16); 17];
        assert!(matches!(
            r.announce("x", &many, EV, 16),
            Err(RosterError::TooManyLanes { count: 17, .. })
        ));
        assert!(matches!(
            r.announce("x", &[Lane::full(24)], EV, 16),
            Err(RosterError::BadLane { index: 0, .. })
        ));
        let chunk = Lane::parse("chunked_local:40@16").unwrap();
        assert!(matches!(
            r.announce("x", &[chunk], EV, 16),
            Err(RosterError::ChunkNotAligned { chunk: 40, .. })
        ));
        let swa = Lane::parse("swa:128@16").unwrap();
        let place = Feed::Placements {
            capacity_blocks: 10,
            ttl_ms: 0,
        };
        assert!(matches!(
            r.announce("x", &[Lane::full(16), swa], place, 16),
            Err(RosterError::PlacementsNeedOneFullLane(_))
        ));
        assert!(r.announce("", &[Lane::full(16)], EV, 16).is_err());
        assert!(r.announce("x", &[Lane::full(16)], EV, 0).is_err());
        assert!(r.is_empty());
    }

    #[test]
    fn byte_keyspaces_refuse_lanes_with_a_clear_error() {
        let mut r = Roster::new();
        let swa = Lane::parse("sliding_window:128@16").unwrap();
        r.announce("plain", &[Lane::full(32)], EV, 16).unwrap();
        r.announce("hybrid", &[Lane::full(16), swa], EV, 16)
            .unwrap();
        let plain = r.get(0).unwrap();
        assert_eq!(plain.lane_blocks_in(ChunkKind::Tokens).unwrap(), &[2]);
        assert_eq!(plain.lane_blocks_in(ChunkKind::Bytes).unwrap(), &[1]);
        assert_eq!(plain.rules_in(ChunkKind::Bytes).unwrap().step(), 1);
        let hybrid = r.get(1).unwrap();
        let err = hybrid.lane_blocks_in(ChunkKind::Bytes).unwrap_err();
        assert!(
            err.to_string().contains("cannot apply to a byte keyspace"),
            "{err}"
        );
        assert!(err.to_string().contains("sliding_window:128@16"), "{err}");
        assert!(hybrid.rules_in(ChunkKind::Bytes).is_none());
    }
}
