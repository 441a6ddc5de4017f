//! The worker registry: names cross the wire once, here; everything else uses small
//! integer ids. Validates lane rosters and derives each worker's scoring rules.

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
    /// keyspace, where a plain worker's one lane counts 1 chunk per block.
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

    /// How queries in keyspaces of `kind` score this worker.
    pub fn class_in(&self, kind: ChunkKind) -> Class {
        match self.rules_in(kind) {
            None => Class::Skip,
            Some(r) if r.is_plain() => Class::Plain,
            Some(_) => Class::Rules,
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

/// The workers' classes in keyspaces of one kind ([`Roster::classes`]).
#[derive(Debug, Clone, Copy)]
pub struct Classes<'a> {
    bits: &'a [u8],
    shift: u8,
}

/// The class bit of a worker holding blocks in a tier other than GPU: a plain worker
/// then takes the rules path.
const TIERED: u8 = 1 << 4;

impl Classes<'_> {
    #[inline]
    pub fn of(self, id: WorkerId) -> Class {
        let bits = self.bits.get(id as usize).copied().unwrap_or(0);
        match ((bits >> self.shift) & 3, bits & TIERED != 0) {
            (1, false) => Class::Plain,
            (1, true) | (2, _) => Class::Rules,
            _ => Class::Skip,
        }
    }
}

/// How a query scores a worker in keyspaces of one kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Class {
    /// Cannot hold blocks here (not active, or lanes in a byte keyspace): not scored.
    Skip = 0,
    /// One full lane of one keyspace block: scored by its covered-from-zero prefix.
    Plain = 1,
    /// Scored by its lanes' rules over their covered runs.
    Rules = 2,
}

/// What an announce did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AnnounceOutcome {
    /// A new name (or a retired one coming back): fresh id state.
    Created,
    /// Known with the same roster and feed: nothing changes.
    Unchanged,
    /// Known with another roster or feed: the worker's blocks and feed state are dropped.
    Changed,
}

/// The authority over names and ids: one per server (executor 0), and inside
/// [`crate::Engine`]. Ids are dense and stable: a name keeps its id across retire and
/// re-announce, until every id below the limit was given once; from then on a new name
/// takes the id retired longest ago (and that id's old name loses its claim to it).
/// Reuse is safe for the index and the logs: a retire drops the worker's blocks from
/// every copy before it is acknowledged, and a replayed log numbers in the same order,
/// so no copy and no log position credits the old worker's writes to the new one.
/// Clients learn of it from the roster's `reissued` count (see [`Roster::reissued`]).
#[derive(Debug)]
pub struct Registry {
    ids: FastMap<String, WorkerId>,
    /// Per id: its name, the roster and feed it was announced with (while active), and
    /// when it was retired.
    workers: Vec<Slot>,
    /// Retired ids by their retire number: the first is the next one given again.
    retired: std::collections::BTreeMap<u64, WorkerId>,
    /// Retires so far (numbers them; 0 means never retired).
    retires: u64,
    /// Ids given at most (`MAX_WORKERS` unless a server sets fewer).
    limit: u32,
}

#[derive(Debug)]
struct Slot {
    name: String,
    announced: Option<Announced>,
    /// The retire number while retired, else 0.
    retired_at: u64,
}

/// The roster and feed a worker was announced with.
type Announced = (Vec<Lane>, Feed);

impl Default for Registry {
    fn default() -> Self {
        Registry::with_limit(MAX_WORKERS)
    }
}

impl Registry {
    pub fn new() -> Self {
        Self::default()
    }

    /// A registry that gives ids below `limit` (at most `MAX_WORKERS`).
    pub fn with_limit(limit: u32) -> Self {
        Registry {
            ids: FastMap::default(),
            workers: Vec::new(),
            retired: Default::default(),
            retires: 0,
            limit: limit.clamp(1, MAX_WORKERS),
        }
    }

    /// Registers `name` with its lanes and feed, validated against the server's token
    /// block size. A known name keeps its id; a new one gets the next id, or once all
    /// were given, the id retired longest ago.
    pub fn register(
        &mut self,
        name: &str,
        lanes: &[Lane],
        feed: Feed,
        token_block: u32,
    ) -> Result<(WorkerEntry, AnnounceOutcome), RosterError> {
        let (lane_blocks, rules) = validate(name, lanes, feed, token_block)?;
        let id = match self.ids.get(name) {
            Some(&id) => id,
            None => self.give(name)?,
        };
        let slot = &mut self.workers[id as usize];
        let outcome = match &slot.announced {
            Some((l, f)) if l == lanes && *f == feed => AnnounceOutcome::Unchanged,
            Some(_) => AnnounceOutcome::Changed,
            None => AnnounceOutcome::Created,
        };
        slot.announced = Some((lanes.to_vec(), feed));
        if slot.retired_at != 0 {
            self.retired.remove(&slot.retired_at);
            slot.retired_at = 0;
        }
        let entry = WorkerEntry {
            id,
            name: name.to_string(),
            lanes: lanes.to_vec(),
            feed,
            lane_blocks,
            rules,
        };
        Ok((entry, outcome))
    }

    /// An id for a new name: the next one, or the one retired longest ago.
    fn give(&mut self, name: &str) -> Result<WorkerId, RosterError> {
        let id = if (self.workers.len() as u32) < self.limit {
            self.workers.push(Slot {
                name: String::new(),
                announced: None,
                retired_at: 0,
            });
            (self.workers.len() - 1) as WorkerId
        } else {
            let (_, id) = self
                .retired
                .pop_first()
                .ok_or(RosterError::TooManyWorkers { limit: self.limit })?;
            let slot = &mut self.workers[id as usize];
            self.ids.remove(&slot.name);
            slot.retired_at = 0;
            id
        };
        self.workers[id as usize].name = name.to_string();
        self.ids.insert(name.to_string(), id);
        Ok(id)
    }

    /// Marks `id` retired; its name keeps the id for a later announce, until the id is
    /// given to another name.
    pub fn retire(&mut self, id: WorkerId) -> Result<(), EngineError> {
        let slot = self
            .workers
            .get_mut(id as usize)
            .filter(|w| w.announced.is_some())
            .ok_or(EngineError::UnknownWorker(id))?;
        slot.announced = None;
        self.retires += 1;
        slot.retired_at = self.retires;
        self.retired.insert(self.retires, id);
        Ok(())
    }

    /// Whether `id` is announced and not retired.
    pub fn is_active(&self, id: WorkerId) -> bool {
        self.workers
            .get(id as usize)
            .is_some_and(|w| w.announced.is_some())
    }

    /// The id a name holds, if it was announced and its id not given to another since.
    pub fn id_of(&self, name: &str) -> Option<WorkerId> {
        self.ids.get(name).copied()
    }

    /// The name of id `id`, if it was ever given.
    pub fn name_of(&self, id: WorkerId) -> Option<&str> {
        self.workers.get(id as usize).map(|w| w.name.as_str())
    }

    /// Every id given, in id order, retired ones included.
    pub fn export(&self) -> Vec<crate::WorkerImage> {
        self.workers
            .iter()
            .enumerate()
            .map(|(id, w)| {
                let (lanes, feed) = w.announced.clone().unwrap_or((Vec::new(), Feed::Events));
                crate::WorkerImage {
                    id: id as WorkerId,
                    name: w.name.clone(),
                    lanes,
                    feed,
                    active: w.announced.is_some(),
                    retired_at: w.retired_at,
                }
            })
            .collect()
    }

    /// Rebuilds an exported registry into an empty one, giving every name its old id
    /// (whatever this registry's limit: a snapshot's ids stay theirs); returns the
    /// active workers' entries.
    pub fn import(
        &mut self,
        workers: &[crate::WorkerImage],
        token_block: u32,
    ) -> Result<Vec<WorkerEntry>, RosterError> {
        let mut active = Vec::new();
        for w in workers {
            let got = self.workers.len() as WorkerId;
            if w.id != got || self.ids.contains_key(&w.name) || w.id >= MAX_WORKERS {
                return Err(RosterError::IdMismatch {
                    name: w.name.clone(),
                    want: w.id,
                    got,
                });
            }
            self.workers.push(Slot {
                name: w.name.clone(),
                announced: None,
                retired_at: 0,
            });
            self.ids.insert(w.name.clone(), w.id);
            let lanes = if w.active {
                w.lanes.clone()
            } else {
                vec![Lane::full(token_block)]
            };
            let (entry, _) = self.register(&w.name, &lanes, w.feed, token_block)?;
            if w.active {
                active.push(entry);
            } else {
                self.workers[w.id as usize].announced = None;
                if w.retired_at != 0 {
                    self.workers[w.id as usize].retired_at = w.retired_at;
                    self.retired.insert(w.retired_at, w.id);
                    self.retires = self.retires.max(w.retired_at);
                }
            }
        }
        Ok(active)
    }
}

/// The workers as every executor sees them: entries by id, installed from the
/// registry's decisions, and each worker's query class per keyspace kind.
#[derive(Debug, Default)]
pub struct Roster {
    entries: Vec<Option<WorkerEntry>>,
    /// Active workers by name, for clients that name a worker they did not announce.
    by_name: FastMap<String, WorkerId>,
    /// Per id: the token class in bits 0..2, the byte class in bits 2..4, [`TIERED`].
    classes: Vec<u8>,
    active: u32,
    /// The names of ids removed here, until installed again.
    removed: FastMap<WorkerId, String>,
    /// Ids installed under another name than they were removed with.
    reissued: u32,
    /// Installs and removals so far: views derived from the roster (the HTTP API's
    /// partitions) are rebuilt when it moves.
    changes: u64,
}

impl Roster {
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds or replaces a worker's entry.
    pub fn install(&mut self, entry: WorkerEntry) {
        let id = entry.id as usize;
        if self.entries.len() <= id {
            self.entries.resize_with(id + 1, || None);
            self.classes.resize(id + 1, 0);
        }
        // A worker installed again keeps what it holds (an unchanged announce drops
        // nothing), so it stays tiered.
        let tiered = self.classes[id] & TIERED;
        self.classes[id] = entry.class_in(ChunkKind::Tokens) as u8
            | (entry.class_in(ChunkKind::Bytes) as u8) << 2
            | tiered;
        self.by_name.insert(entry.name.clone(), entry.id);
        if self
            .removed
            .remove(&entry.id)
            .is_some_and(|old| old != entry.name)
        {
            self.reissued = self.reissued.wrapping_add(1);
        }
        if self.entries[id].replace(entry).is_none() {
            self.active += 1;
        }
        self.changes += 1;
    }

    /// Installs and removals so far (see the field).
    pub fn changes(&self) -> u64 {
        self.changes
    }

    /// Ids given again to another name since this roster started (it changes whenever
    /// an id's name does): a client that learnt names under another count lists the
    /// roster again before it names an id. Every executor applies the same installs
    /// and removals in the same order, so their counts agree. An id retired before a
    /// restart and given again after it is not counted: no client of this process
    /// learnt its old name.
    pub fn reissued(&self) -> u32 {
        self.reissued
    }

    /// Removes a worker's entry.
    pub fn remove(&mut self, id: WorkerId) -> Option<WorkerEntry> {
        let entry = self.entries.get_mut(id as usize)?.take()?;
        self.by_name.remove(&entry.name);
        self.removed.insert(id, entry.name.clone());
        self.classes[id as usize] = 0;
        self.active -= 1;
        self.changes += 1;
        Some(entry)
    }

    /// The active worker `id`.
    pub fn get(&self, id: WorkerId) -> Option<&WorkerEntry> {
        self.entries.get(id as usize)?.as_ref()
    }

    /// The active worker announced as `name`.
    pub fn named(&self, name: &str) -> Option<&WorkerEntry> {
        self.get(*self.by_name.get(name)?)
    }

    /// One past the highest id installed: where ids given later start.
    pub fn end(&self) -> WorkerId {
        self.entries.len() as WorkerId
    }

    /// Active workers with ids from `from` on, in id order.
    pub fn from(&self, from: WorkerId) -> impl Iterator<Item = &WorkerEntry> {
        self.entries.iter().skip(from as usize).flatten()
    }

    /// Like [`Roster::get`], as an error for unknown ids.
    pub fn worker(&self, id: WorkerId) -> Result<&WorkerEntry, EngineError> {
        self.get(id).ok_or(EngineError::UnknownWorker(id))
    }

    /// Worker `id` holds blocks in a tier other than GPU (until it is removed): its
    /// queries take the rules path, which scores each tier.
    pub fn mark_tiered(&mut self, id: WorkerId) {
        if let Some(c) = self.classes.get_mut(id as usize) {
            *c |= TIERED;
        }
    }

    /// Whether worker `id` was ever marked tiered since it was installed.
    pub fn is_tiered(&self, id: WorkerId) -> bool {
        self.classes
            .get(id as usize)
            .is_some_and(|c| c & TIERED != 0)
    }

    /// How queries in keyspaces of `kind` score worker `id`.
    pub fn class(&self, id: WorkerId, kind: ChunkKind) -> Class {
        self.classes(kind).of(id)
    }

    /// Every worker's class in keyspaces of `kind`, for a loop over many: a query looks
    /// up each holder of a run (the roster behind a reference would be loaded again
    /// at every one).
    pub fn classes(&self, kind: ChunkKind) -> Classes<'_> {
        Classes {
            bits: &self.classes,
            shift: if kind == ChunkKind::Bytes { 2 } else { 0 },
        }
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

    fn register(
        r: &mut Registry,
        name: &str,
        lanes: &[Lane],
    ) -> Result<(WorkerId, AnnounceOutcome), RosterError> {
        r.register(name, lanes, EV, 16).map(|(e, o)| (e.id, o))
    }

    #[test]
    fn same_name_same_id_and_changes_are_reported() {
        let mut r = Registry::new();
        let full = [Lane::full(16)];
        assert_eq!(
            register(&mut r, "a", &full),
            Ok((0, AnnounceOutcome::Created))
        );
        assert_eq!(
            register(&mut r, "b", &full),
            Ok((1, AnnounceOutcome::Created))
        );
        assert_eq!(
            register(&mut r, "a", &full),
            Ok((0, AnnounceOutcome::Unchanged))
        );
        let hybrid = [Lane::full(16), Lane::parse("mamba@32").unwrap()];
        let (entry, outcome) = r.register("a", &hybrid, EV, 16).unwrap();
        assert_eq!(outcome, AnnounceOutcome::Changed);
        assert_eq!(entry.rules.step(), 2);
        r.retire(0).unwrap();
        assert!(r.retire(0).is_err());
        assert!(!r.is_active(0) && r.is_active(1));
        assert_eq!(
            register(&mut r, "a", &full),
            Ok((0, AnnounceOutcome::Created))
        );
        assert_eq!(r.id_of("b"), Some(1));
        assert_eq!(r.name_of(1), Some("b"));
    }

    #[test]
    fn ids_are_given_again_retired_longest_ago_first_once_all_were_given() {
        let full = [Lane::full(16)];
        let mut r = Registry::with_limit(3);
        for (i, name) in ["a", "b", "c"].into_iter().enumerate() {
            assert_eq!(
                register(&mut r, name, &full),
                Ok((i as WorkerId, AnnounceOutcome::Created))
            );
        }
        assert_eq!(
            register(&mut r, "d", &full),
            Err(RosterError::TooManyWorkers { limit: 3 })
        );
        r.retire(1).unwrap();
        r.retire(0).unwrap();
        // Retired and announced again before any reuse: its own id, not given away.
        r.retire(2).unwrap();
        assert_eq!(
            register(&mut r, "c", &full),
            Ok((2, AnnounceOutcome::Created))
        );
        // A snapshot here keeps the retire order.
        let mut restored = Registry::with_limit(3);
        let active = restored.import(&r.export(), 16).unwrap();
        assert_eq!(active.iter().map(|e| e.id).collect::<Vec<_>>(), [2]);
        for r in [&mut r, &mut restored] {
            assert_eq!(register(r, "d", &full), Ok((1, AnnounceOutcome::Created)));
            assert_eq!(register(r, "e", &full), Ok((0, AnnounceOutcome::Created)));
            assert_eq!((r.id_of("a"), r.id_of("b")), (None, None));
            assert_eq!((r.name_of(0), r.name_of(1)), (Some("e"), Some("d")));
            assert!(matches!(
                register(r, "a", &full),
                Err(RosterError::TooManyWorkers { .. })
            ));
        }
        assert_eq!(r.export(), restored.export());
    }

    #[test]
    fn a_fleet_that_churns_names_never_runs_out_of_ids() {
        // More announce / retire pairs than there are ids: each new name takes the id
        // retired longest ago once all were given (before, the 2^20th was refused).
        let full = [Lane::full(16)];
        let mut r = Registry::new();
        for i in 0..MAX_WORKERS + 3 {
            let (id, outcome) = register(&mut r, &format!("pod-{i}"), &full).unwrap();
            assert_eq!((id, outcome), (i % MAX_WORKERS, AnnounceOutcome::Created));
            r.retire(id).unwrap();
        }
        assert_eq!(r.id_of("pod-0"), None);
        assert_eq!(r.name_of(2), Some(&*format!("pod-{}", MAX_WORKERS + 2)));
    }

    #[test]
    fn a_roster_counts_ids_installed_under_another_name() {
        let full = [Lane::full(16)];
        let mut reg = Registry::with_limit(2);
        let mut r = Roster::new();
        for name in ["a", "b"] {
            r.install(reg.register(name, &full, EV, 16).unwrap().0);
        }
        // Retired and announced again under its own name: nothing to relearn.
        reg.retire(0).unwrap();
        r.remove(0);
        r.install(reg.register("a", &full, EV, 16).unwrap().0);
        assert_eq!(r.reissued(), 0);
        reg.retire(0).unwrap();
        r.remove(0);
        let (c, _) = reg.register("c", &full, EV, 16).unwrap();
        assert_eq!(c.id, 0);
        r.install(c);
        assert_eq!(r.reissued(), 1);
        assert_eq!(r.named("c").map(|e| e.id), Some(0));
        assert!(r.named("a").is_none());
    }

    #[test]
    fn bad_rosters_are_typed_errors() {
        let mut r = Registry::new();
        assert!(matches!(
            register(&mut r, "x", &[]),
            Err(RosterError::EmptyRoster(_))
        ));
        let many = vec![Lane::full(16); 17];
        assert!(matches!(
            register(&mut r, "x", &many),
            Err(RosterError::TooManyLanes { count: 17, .. })
        ));
        assert!(matches!(
            register(&mut r, "x", &[Lane::full(24)]),
            Err(RosterError::BadLane { index: 0, .. })
        ));
        let chunk = Lane::parse("chunked_local:40@16").unwrap();
        assert!(matches!(
            register(&mut r, "x", &[chunk]),
            Err(RosterError::ChunkNotAligned { chunk: 40, .. })
        ));
        let swa = Lane::parse("swa:128@16").unwrap();
        let place = Feed::Placements {
            capacity_blocks: 10,
            ttl_ms: 0,
        };
        assert!(matches!(
            r.register("x", &[Lane::full(16), swa], place, 16),
            Err(RosterError::PlacementsNeedOneFullLane(_))
        ));
        assert!(register(&mut r, "", &[Lane::full(16)]).is_err());
        assert!(r.register("x", &[Lane::full(16)], EV, 0).is_err());
        assert_eq!(r.id_of("x"), None);
    }

    #[test]
    fn byte_keyspaces_refuse_lanes_with_a_clear_error_and_classes_follow() {
        let mut reg = Registry::new();
        let mut r = Roster::new();
        let swa = Lane::parse("sliding_window:128@16").unwrap();
        for (name, lanes) in [
            ("plain", vec![Lane::full(16)]),
            ("hybrid", vec![Lane::full(16), swa]),
            ("wide", vec![Lane::full(32)]),
        ] {
            r.install(reg.register(name, &lanes, EV, 16).unwrap().0);
        }
        let plain = r.get(0).unwrap();
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
        assert_eq!(
            r.get(2).unwrap().lane_blocks_in(ChunkKind::Tokens).unwrap(),
            &[2]
        );
        let classes = |k| (0..4).map(|w| r.class(w, k)).collect::<Vec<_>>();
        assert_eq!(
            classes(ChunkKind::Tokens),
            [Class::Plain, Class::Rules, Class::Rules, Class::Skip]
        );
        assert_eq!(
            classes(ChunkKind::Bytes),
            [Class::Plain, Class::Skip, Class::Plain, Class::Skip]
        );
        r.remove(0);
        assert_eq!(r.class(0, ChunkKind::Tokens), Class::Skip);
        assert_eq!(r.len(), 2);
    }
}
