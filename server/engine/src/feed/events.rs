//! The exact feed: a worker's own engine events, in its sequence order.

use kvix_wire::{ApplyStatus, Tier, WorkerId};

use super::{EventRef, EventView, PlacementFeed};
use crate::error::{EventError, IndexError};
use crate::hashing::{fmix, FastMap};
use crate::ops::OpBatch;
use crate::table::Table;
use crate::Holder;

/// Tracks a worker's batch sequence numbers.
#[derive(Debug, Default, Clone, Copy)]
pub struct Sequencer {
    last: Option<u64>,
}

/// How far past the last applied seq a batch may jump: further is not a lost message
/// but a broken producer, and would make every later batch a duplicate.
pub const MAX_SEQ_JUMP: u64 = 1 << 32;

impl Sequencer {
    /// Why `seq` is refused outright, if it is: at or above 2^63, or more than
    /// [`MAX_SEQ_JUMP`] past the last applied.
    pub fn implausible(&self, seq: u64) -> Option<String> {
        if seq >= 1 << 63 {
            return Some("at or above 2^63".into());
        }
        match self.last {
            Some(last) if seq > last && seq - last > MAX_SEQ_JUMP => Some(format!(
                "{} past the last applied {last} (more than 2^32)",
                seq - last
            )),
            _ => None,
        }
    }

    /// Classifies batch `seq`: at or below the last applied → duplicate (ignore it);
    /// beyond the next expected → applied with a gap; the first batch sets the baseline.
    pub fn admit(&mut self, seq: u64) -> ApplyStatus {
        let status = match self.last {
            Some(last) if seq <= last => return ApplyStatus::Duplicate,
            Some(last) if seq != last + 1 => ApplyStatus::Gap { expected: last + 1 },
            _ => ApplyStatus::Applied,
        };
        self.last = Some(seq);
        status
    }

    /// Forgets the baseline (the producer restarted and counts from 0 again).
    pub fn reset(&mut self) {
        self.last = None;
    }

    pub fn last(&self) -> Option<u64> {
        self.last
    }

    /// Resumes from a snapshot's baseline.
    pub fn restore(&mut self, last: Option<u64>) {
        self.last = last;
    }
}

/// What became of one event batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApplyReport {
    pub status: ApplyStatus,
    /// Events applied.
    pub events: u32,
    /// Keyspace blocks stored, or named by removals (a removal of a block the lane does
    /// not hold changes nothing).
    pub block_events: u64,
    /// Removal names not looked for in the lane's other keyspaces: the batch had used
    /// its [`OTHER_KEYSPACE_LOOKUPS`]; each was taken as a chain hash of the batch's
    /// keyspace.
    pub unprobed: u64,
    /// Lookups in other keyspaces the batch may still make.
    lookups_left: u64,
}

/// Lookups of removal names in keyspaces other than their batch's, per batch. A lane
/// with names in K keyspaces costs up to K lookups per name its batch's keyspace lacks;
/// unbounded, one frame of such names over many keyspaces would hold an executor for
/// minutes. 2^20 lookups cost about what storing a full frame's blocks does.
pub const OTHER_KEYSPACE_LOOKUPS: u64 = 1 << 20;

/// A batch's feed step under way ([`EventFeed::start`], [`EventFeed::apply_some`]).
#[derive(Debug)]
pub struct EventsJob {
    pub report: ApplyReport,
    /// The event it is at, and the blocks of it already applied.
    at: usize,
    off: usize,
    /// Blocks a slice takes.
    budget: u64,
}

/// The piece of `event` from block `off` on of at most `budget` blocks (whole engine
/// blocks of its lane, at least one): the piece, its length, and whether it ends the event.
fn piece_of<'a>(
    event: EventRef<'a>,
    off: usize,
    budget: u64,
    lane_blocks: &[u32],
) -> (EventRef<'a>, usize, bool) {
    let take = |n: usize, k: usize| -> usize {
        let k = k.max(1);
        let most = (budget as usize / k).max(1) * k;
        (n - off).min(most)
    };
    match event {
        EventRef::Stored {
            tier,
            lane,
            start,
            parent,
            chain,
            engine,
        } => {
            let k = lane_blocks.get(lane as usize).map_or(1, |&k| k as usize);
            let len = take(chain.len(), k);
            let piece = EventRef::Stored {
                tier,
                lane,
                start: start + off as u32,
                parent: if off == 0 {
                    parent
                } else {
                    Some(chain[off - 1])
                },
                chain: &chain[off..off + len],
                engine: if engine.is_empty() {
                    engine
                } else {
                    &engine[off / k.max(1)..((off + len).div_ceil(k.max(1))).min(engine.len())]
                },
            };
            (piece, len, off + len == chain.len())
        }
        EventRef::Removed { tier, lane, hashes } => {
            let len = take(hashes.len(), 1);
            let piece = EventRef::Removed {
                tier,
                lane,
                hashes: &hashes[off..off + len],
            };
            (piece, len, off + len == hashes.len())
        }
        EventRef::Cleared => (EventRef::Cleared, 0, true),
    }
}

impl ApplyReport {
    fn new(status: ApplyStatus) -> Self {
        ApplyReport {
            status,
            events: 0,
            block_events: 0,
            unprobed: 0,
            lookups_left: OTHER_KEYSPACE_LOOKUPS,
        }
    }
}

/// The engine hashes one lane stored in one keyspace → the chain hashes of the blocks
/// each names. 16 bytes per name that names one keyspace block, the common case (one
/// per engine block stored with its engine hash; stores without engine hashes are
/// removed by chain hash and need no name).
///
/// Names of one block are first appended to `recent` and put into their table in bulk
/// ([`Names::settle`]) once there are [`RECENT`] of them or before anything looks a name
/// up. A fleet's workers interleave their stores, so each worker's table is cold when its
/// next store comes: one at a time, every name costs a TLB miss and a cache miss; in bulk,
/// the table's pages and lines are fetched once for many names, far ahead of their use.
#[derive(Debug, Default)]
struct Names {
    ks: u64,
    /// Names of one keyspace block: (name, chain hash).
    one: Table<(u64, u64)>,
    /// Names of one keyspace block not in `one` yet, in the order they were stored.
    recent: Vec<(u64, u64)>,
    /// Names of an engine block of several keyspace blocks.
    many: FastMap<u64, Box<[u64]>>,
}

/// How many names of one block wait in [`Names::recent`] before they are put in bulk.
const RECENT: usize = 512;

impl Names {
    fn len(&mut self) -> usize {
        self.settle();
        self.one.len() + self.many.len()
    }

    fn is_empty(&self) -> bool {
        self.one.len() == 0 && self.recent.is_empty() && self.many.is_empty()
    }

    /// Records that `name` names the blocks `chain`.
    fn set(&mut self, name: u64, chain: &[u64]) {
        if let [one] = chain {
            self.recent.push((name, *one));
            if self.recent.len() >= RECENT {
                self.settle();
            }
        } else {
            self.settle();
            self.one.remove(fmix(name), |e| e.0 == name);
            self.many.insert(name, chain.into());
        }
    }

    /// Puts the recent names into their table, in order, prefetching ahead.
    fn settle(&mut self) {
        const AHEAD: usize = 16;
        if self.recent.is_empty() {
            return;
        }
        let recent = std::mem::take(&mut self.recent);
        self.one.reserve(recent.len(), |e| fmix(e.0));
        for &(name, _) in recent.iter().take(AHEAD) {
            self.one.prefetch(fmix(name));
        }
        for (i, &(name, chain)) in recent.iter().enumerate() {
            if let Some(&(ahead, _)) = recent.get(i + AHEAD) {
                self.one.prefetch(fmix(ahead));
            }
            match self
                .one
                .insert_absent(fmix(name), |e| e.0 == name, (name, chain))
            {
                Some(e) => e.1 = chain,
                None if !self.many.is_empty() => drop(self.many.remove(&name)),
                None => {}
            }
        }
        self.recent = recent;
        self.recent.clear();
    }

    /// Appends the chain hashes `name` names to `out` and forgets it unless `keep`;
    /// false if unknown.
    fn take(&mut self, name: u64, keep: bool, out: &mut Vec<u64>) -> bool {
        self.settle();
        if keep {
            if let Some(&(_, c)) = self.one.find(fmix(name), |e| e.0 == name) {
                out.push(c);
                return true;
            }
            return self
                .many
                .get(&name)
                .map(|g| out.extend_from_slice(g))
                .is_some();
        }
        if let Some((_, c)) = self.one.remove(fmix(name), |e| e.0 == name) {
            out.push(c);
            self.one.shrink(|e| fmix(e.0));
            return true;
        }
        match self.many.remove(&name) {
            Some(g) => {
                out.extend_from_slice(&g);
                true
            }
            None => false,
        }
    }

    /// Every name and the chain hashes it names, as if settled.
    fn entries(&self) -> FastMap<u64, Vec<u64>> {
        let mut all: FastMap<u64, Vec<u64>> = self.one.iter().map(|&(n, c)| (n, vec![c])).collect();
        all.extend(self.many.iter().map(|(&n, g)| (n, g.to_vec())));
        all.extend(self.recent.iter().map(|&(n, c)| (n, vec![c])));
        all
    }
}

/// One lane's names, per keyspace, the keyspaces found by seed (a worker salting each
/// prompt has as many as it holds prompts).
#[derive(Debug, Default)]
struct LaneNames {
    list: Vec<Names>,
    at: FastMap<u64, u32>,
}

impl LaneNames {
    fn index(&self, ks: u64) -> Option<usize> {
        self.at.get(&ks).map(|&i| i as usize)
    }

    /// The names of keyspace `ks`, created when new.
    fn of(&mut self, ks: u64) -> &mut Names {
        let i = match self.index(ks) {
            Some(i) => i,
            None => {
                self.at.insert(ks, self.list.len() as u32);
                self.list.push(Names {
                    ks,
                    ..Default::default()
                });
                self.list.len() - 1
            }
        };
        &mut self.list[i]
    }

    /// Forgets the keyspaces among `touched` (indexes, in any order, repeats allowed) that
    /// name nothing any more, so the list only holds keyspaces with blocks.
    fn forget_empty(&mut self, touched: &mut Vec<usize>) {
        touched.sort_unstable_by(|a, b| b.cmp(a));
        touched.dedup();
        // Highest first: a swap_remove moves the last entry, already looked at, into `i`.
        for &i in touched.iter() {
            if self.list[i].is_empty() {
                self.at.remove(&self.list[i].ks);
                self.list.swap_remove(i);
                if let Some(moved) = self.list.get(i) {
                    self.at.insert(moved.ks, i as u32);
                }
            }
        }
        touched.clear();
    }
}

/// Event-feed state of one worker: its sequence and, per lane and keyspace, its names.
#[derive(Debug, Default)]
pub struct EventFeed {
    seq: Sequencer,
    lanes: Vec<LaneNames>,
    scratch: Vec<u64>,
    touched: Vec<usize>,
    /// Gateways' placements filling in for a worker whose history is lost (its engine
    /// may hold blocks its events will never report): lane 0's blocks the events do not
    /// report, cut by the placements' capacity and TTL. The events' clear ends it.
    fill: Option<PlacementFeed>,
    /// The tiers this worker's stores ever named (bit per [`Tier`]; GPU always): a
    /// removal from every tier removes from these.
    tiers: u8,
}

impl EventFeed {
    pub fn new(lanes: usize) -> Self {
        EventFeed {
            lanes: (0..lanes).map(|_| LaneNames::default()).collect(),
            tiers: 1 << Tier::Gpu as u8,
            ..Default::default()
        }
    }

    /// Takes `tier` as one this worker's stores named (a snapshot restores what the
    /// index holds, not the feed's mask).
    pub fn note_tier(&mut self, tier: Tier) {
        self.tiers |= 1 << tier as u8;
    }

    pub fn sequencer(&mut self) -> &mut Sequencer {
        &mut self.seq
    }

    /// The placements filling in for this worker's lost history, if any.
    pub fn fill(&mut self) -> Option<&mut PlacementFeed> {
        self.fill.as_mut()
    }

    pub fn fills(&self) -> bool {
        self.fill.is_some()
    }

    /// Takes placements in to fill in for lost history, `fill` being the (empty) feed
    /// that keeps them; a fill already under way is kept.
    pub fn start_fill(&mut self, fill: PlacementFeed) {
        self.fill.get_or_insert(fill);
    }

    /// Names tracked for removals, over all lanes.
    pub fn names(&mut self) -> usize {
        let lists = self.lanes.iter_mut().flat_map(|l| &mut l.list);
        lists.map(Names::len).sum()
    }

    /// Heap bytes of the names' tables (for memory figures).
    pub fn bytes(&self) -> usize {
        let recent = |n: &Names| n.recent.capacity() * std::mem::size_of::<(u64, u64)>();
        self.lanes
            .iter()
            .flat_map(|l| &l.list)
            .map(|n| n.one.bytes() + recent(n))
            .sum()
    }

    /// Checks a whole batch without applying any of it: the first event that would be
    /// refused, by index. A batch is applied whole or not at all.
    pub fn check<E: EventView>(
        &self,
        lane_blocks: &[u32],
        events: &[E],
    ) -> Result<(), (u32, EventError)> {
        for (i, e) in events.iter().enumerate() {
            self.validate(lane_blocks, e.view())
                .map_err(|err| (i as u32, err))?;
        }
        Ok(())
    }

    /// Applies batch `seq` of `worker` in keyspace `ks`, where lane `i`'s engine block
    /// is `lane_blocks[i]` keyspace blocks, appending the block operations to `out`.
    /// The caller has checked the batch ([`EventFeed::check`]); an event that would be
    /// refused is skipped all the same.
    pub fn apply<E: EventView>(
        &mut self,
        worker: WorkerId,
        seq: u64,
        ks: u64,
        lane_blocks: &[u32],
        events: &[E],
        out: &mut OpBatch,
    ) -> ApplyReport {
        let status = self.seq.admit(seq);
        if status == ApplyStatus::Duplicate {
            return ApplyReport::new(status);
        }
        self.apply_unsequenced(worker, ks, lane_blocks, events, status, out)
    }

    /// Starts batch `seq` as a feed step in slices of about `budget` blocks
    /// ([`EventFeed::apply_some`]); the caller has checked the batch. A duplicate has
    /// nothing to apply.
    pub fn start(&mut self, seq: u64, events: usize, budget: u64) -> EventsJob {
        let status = self.seq.admit(seq);
        EventsJob {
            report: ApplyReport::new(status),
            at: if status == ApplyStatus::Duplicate {
                events
            } else {
                0
            },
            off: 0,
            budget: budget.max(1),
        }
    }

    /// One slice more of `job`'s batch (at least one engine block): what
    /// [`EventFeed::apply`] does at once, cut inside long stores and removals. A store's
    /// later pieces continue its first (their parent is the block before them), as a
    /// decode stream's one-block stores do. True once the batch is done.
    pub fn apply_some<E: EventView>(
        &mut self,
        worker: WorkerId,
        ks: u64,
        lane_blocks: &[u32],
        events: &[E],
        job: &mut EventsJob,
        out: &mut OpBatch,
    ) -> bool {
        let mut left = job.budget;
        while job.at < events.len() {
            let event = events[job.at].view();
            let (piece, len, end) = piece_of(event, job.off, left, lane_blocks);
            let taken = self.one(worker, ks, lane_blocks, piece, out, &mut job.report);
            if !taken || end {
                job.report.events += u32::from(taken);
                job.at += 1;
                job.off = 0;
            } else {
                job.off += len;
            }
            left = left.saturating_sub(len.max(1) as u64);
            if left == 0 {
                break;
            }
        }
        job.at >= events.len()
    }

    /// Starts events whose order their producer already checked (the engine-event
    /// ingest) as a job applied by [`EventFeed::apply_some`] in slices of `budget` blocks.
    pub fn start_unsequenced(&self, budget: u64) -> EventsJob {
        EventsJob {
            report: ApplyReport::new(ApplyStatus::Applied),
            at: 0,
            off: 0,
            budget: budget.max(1),
        }
    }

    /// Applies events whose order their producer already checked (the engine-event
    /// ingest, which sequences its streams itself), reporting `status`.
    pub fn apply_unsequenced<E: EventView>(
        &mut self,
        worker: WorkerId,
        ks: u64,
        lane_blocks: &[u32],
        events: &[E],
        status: ApplyStatus,
        out: &mut OpBatch,
    ) -> ApplyReport {
        let mut report = ApplyReport::new(status);
        for event in events {
            if self.one(worker, ks, lane_blocks, event.view(), out, &mut report) {
                report.events += 1;
            }
        }
        report
    }

    /// The names of `lane` in keyspace `ks`, created when new.
    fn names_in(&mut self, lane: u8, ks: u64) -> &mut Names {
        self.lanes[lane as usize].of(ks)
    }

    /// Why `event` would be refused; for a store, its lane's engine block (keyspace blocks).
    fn validate(&self, lane_blocks: &[u32], event: EventRef<'_>) -> Result<u32, EventError> {
        let lane_of = |lane: u8| {
            lane_blocks
                .get(lane as usize)
                .copied()
                .filter(|_| (lane as usize) < self.lanes.len())
                .ok_or(EventError::NoSuchLane {
                    lane,
                    lanes: lane_blocks.len(),
                })
        };
        match event {
            EventRef::Stored {
                lane,
                start,
                chain,
                engine,
                ..
            } => {
                let k = lane_of(lane)?;
                if start as u64 + chain.len() as u64 > u32::MAX as u64 {
                    return Err(IndexError::PositionOverflow {
                        start,
                        len: chain.len(),
                    }
                    .into());
                }
                let expected = chain.len().div_ceil(k as usize);
                if !engine.is_empty() && engine.len() != expected {
                    return Err(EventError::EngineHashCount {
                        blocks: chain.len(),
                        engine_block: k,
                        expected,
                        got: engine.len(),
                    });
                }
                Ok(k)
            }
            EventRef::Removed { lane, .. } => lane_of(lane),
            EventRef::Cleared => Ok(1),
        }
    }

    /// Applies one event; false when it is refused (skipped).
    fn one(
        &mut self,
        worker: WorkerId,
        ks: u64,
        lane_blocks: &[u32],
        event: EventRef<'_>,
        out: &mut OpBatch,
        report: &mut ApplyReport,
    ) -> bool {
        // Checked whole by the caller; a lane past the roster is skipped all the same.
        let k = match event {
            EventRef::Stored { lane, .. } | EventRef::Removed { lane, .. } => {
                match lane_blocks.get(lane as usize) {
                    Some(&k) if (lane as usize) < self.lanes.len() => k as usize,
                    _ => return false,
                }
            }
            EventRef::Cleared => 1,
        };
        match event {
            EventRef::Stored {
                tier,
                lane,
                start,
                parent,
                chain,
                engine,
            } => {
                self.note_tier(tier);
                // Engine block j covers the keyspace blocks [j·k, (j+1)·k) of the store.
                // Without engine hashes, removals name the chain hashes themselves.
                if !engine.is_empty() {
                    let names = self.names_in(lane, ks);
                    for (&e, group) in engine.iter().zip(chain.chunks(k)) {
                        names.set(e, group);
                    }
                }
                if let Some(fill) = self.fill.as_mut().filter(|_| lane == 0) {
                    fill.let_go(ks, start, chain);
                }
                out.insert(
                    ks,
                    Holder::in_tier(worker, lane, tier),
                    start,
                    parent,
                    chain,
                );
                report.block_events += chain.len() as u64;
            }
            EventRef::Removed { tier, lane, hashes } => {
                let tiers = match tier {
                    Some(t) => 1 << t as u8,
                    None => self.tiers,
                };
                let keep = tier.is_some();
                let mut gone = std::mem::take(&mut self.scratch);
                let names = &mut self.lanes[lane as usize];
                // The batch's own keyspace first: an engine's removals come grouped by
                // keyspace, so a lane with many (LoRAs, salts) costs one lookup a name.
                // A name it lacks is looked for in the lane's other keyspaces.
                let own = names.index(ks);
                if let Some(i) = own {
                    names.list[i].settle();
                    for &h in hashes {
                        names.list[i].one.prefetch(fmix(h));
                    }
                }
                let others = (names.list.len() - usize::from(own.is_some())) as u64;
                for &h in hashes {
                    gone.clear();
                    let found = own
                        .filter(|&i| names.list[i].take(h, keep, &mut gone))
                        .or_else(|| {
                            if others > report.lookups_left {
                                report.lookups_left = 0;
                                report.unprobed += 1;
                                return None;
                            }
                            report.lookups_left -= others;
                            (0..names.list.len())
                                .filter(|&i| Some(i) != own)
                                .find(|&i| names.list[i].take(h, keep, &mut gone))
                        });
                    let (in_ks, named) = match found {
                        Some(i) => {
                            self.touched.push(i);
                            (names.list[i].ks, &gone[..])
                        }
                        // Not an engine hash it stored: the chain hash of a block of
                        // the batch's keyspace (a store that named no engine hashes).
                        None => (ks, std::slice::from_ref(&h)),
                    };
                    for t in Tier::ALL.into_iter().filter(|&t| tiers >> t as u8 & 1 != 0) {
                        out.remove(in_ks, Holder::in_tier(worker, lane, t), named);
                    }
                    report.block_events += named.len() as u64;
                }
                names.forget_empty(&mut self.touched);
                gone.clear();
                self.scratch = gone;
            }
            EventRef::Cleared => {
                out.sweep_lanes(worker, self.lanes.len());
                let lanes = self.lanes.len();
                *self = EventFeed {
                    seq: self.seq,
                    tiers: self.tiers,
                    ..EventFeed::new(lanes)
                };
            }
        }
        true
    }

    /// The feed as plain data at `now_ms` (sequence baseline, removal names, fill-in).
    pub fn export(&self, now_ms: u64) -> crate::EventFeedImage {
        let mut names = Vec::new();
        for (lane, per_ks) in self.lanes.iter().enumerate() {
            for n in &per_ks.list {
                let image = |name: u64, chain: Vec<u64>| crate::NameImage {
                    lane: lane as u8,
                    name,
                    ks: n.ks,
                    chain,
                };
                names.extend(n.entries().into_iter().map(|(name, c)| image(name, c)));
            }
        }
        names.sort_unstable_by_key(|n| (n.lane, n.ks, n.name));
        crate::EventFeedImage {
            last_seq: self.seq.last(),
            names,
            fill: self.fill.as_ref().map(|f| f.export(now_ms)),
        }
    }

    /// Restores an exported feed into a fresh one at `now_ms`; names of lanes beyond the
    /// roster are skipped. A fill-in is taken as `fill_in` says (not at all: off).
    pub fn import(&mut self, image: &crate::EventFeedImage, now_ms: u64, fill_in: super::FillIn) {
        if let Some(placed) = &image.fill {
            self.fill = fill_in.feed().map(|mut fill| {
                fill.import(placed, now_ms);
                fill
            });
        }
        self.seq.restore(image.last_seq);
        for n in &image.names {
            if (n.lane as usize) < self.lanes.len() && !n.chain.is_empty() {
                self.names_in(n.lane, n.ks).set(n.name, &n.chain);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::Op;
    use kvix_wire::Event;

    #[test]
    fn sequences_baseline_duplicates_and_gaps() {
        let mut s = Sequencer::default();
        assert_eq!(s.admit(5), ApplyStatus::Applied);
        assert_eq!(s.admit(5), ApplyStatus::Duplicate);
        assert_eq!(s.admit(4), ApplyStatus::Duplicate);
        assert_eq!(s.admit(6), ApplyStatus::Applied);
        assert_eq!(s.admit(9), ApplyStatus::Gap { expected: 7 });
        assert_eq!(s.admit(10), ApplyStatus::Applied);
        assert_eq!(s.admit(u64::MAX), ApplyStatus::Gap { expected: 11 });
        assert_eq!(s.admit(u64::MAX), ApplyStatus::Duplicate);
        s.reset();
        assert_eq!(s.admit(0), ApplyStatus::Applied);
    }

    fn stored(lane: u8, start: u32, chain: Vec<u64>, engine: Vec<u64>) -> Event {
        Event::Stored {
            lane,
            start,
            parent: None,
            chain,
            engine,
        }
    }

    #[test]
    fn engine_hashes_group_blocks_and_removals_coalesce_by_position() {
        let mut f = EventFeed::new(2);
        let chain: Vec<u64> = (10..15).collect();
        let events = vec![
            stored(1, 3, chain.clone(), vec![900, 901, 902]),
            Event::Removed {
                lane: 1,
                hashes: vec![902, 777, 901],
            },
        ];
        assert_eq!(f.check(&[1, 2], &events), Ok(()));
        let bad = [
            stored(1, 3, chain.clone(), vec![1]),
            stored(2, 0, vec![1], vec![]),
        ];
        assert!(matches!(
            f.check(&[1, 2], &bad[..1]),
            Err((0, EventError::EngineHashCount { expected: 3, .. }))
        ));
        assert!(matches!(
            f.check(&[1, 2], &bad[1..]),
            Err((0, EventError::NoSuchLane { lane: 2, .. }))
        ));
        let mut out = OpBatch::new();
        let r = f.apply(4, 0, 77, &[1, 2], &events, &mut out);
        assert_eq!((r.events, r.block_events), (2, 9));
        let h = Holder::new(4, 1);
        // 902 (block 7), 777 (no engine hash: taken as a chain hash) and 901 (blocks 5,
        // 6) become one removal, in the order named.
        assert_eq!(
            out.ops()[1],
            Op::Remove {
                ks: 77,
                holder: h,
                at: 5,
                len: 4
            }
        );
        assert_eq!(out.hashes(5, 4), &[14, 777, 12, 13]);
        assert_eq!(f.names(), 1);
        // A clear sweeps both lanes, in every tier.
        out.clear();
        f.apply(4, 1, 77, &[1, 2], &[Event::Cleared], &mut out);
        let swept: Vec<Op> = Tier::ALL
            .into_iter()
            .flat_map(|t| (0..2).map(move |lane| Holder::in_tier(4, lane, t)))
            .map(|holder| Op::Sweep { holder })
            .collect();
        assert_eq!(out.ops(), &swept[..]);
        assert_eq!(f.names(), 0);
    }

    #[test]
    fn a_store_without_engine_hashes_keeps_no_names_and_is_removed_by_chain_hash() {
        let mut f = EventFeed::new(1);
        let mut out = OpBatch::new();
        let chain: Vec<u64> = (10..42).collect();
        f.apply(
            4,
            0,
            77,
            &[1],
            &[stored(0, 0, chain.clone(), vec![])],
            &mut out,
        );
        assert_eq!((f.names(), f.bytes()), (0, 0), "nothing per block");
        out.clear();
        let gone = [Event::Removed {
            lane: 0,
            hashes: vec![41, 40],
        }];
        let r = f.apply(4, 1, 77, &[1], &gone, &mut out);
        assert_eq!(r.block_events, 2);
        assert_eq!(
            out.ops(),
            &[Op::Remove {
                ks: 77,
                holder: Holder::new(4, 0),
                at: 0,
                len: 2
            }]
        );
        assert_eq!(out.hashes(0, 2), &[41, 40]);
    }

    #[test]
    fn a_removal_finds_names_in_any_keyspace_and_an_emptied_keyspace_is_forgotten() {
        let mut f = EventFeed::new(1);
        let mut out = OpBatch::new();
        for (seq, ks) in [(0, 70), (1, 71), (2, 72)] {
            let events = [stored(0, 0, vec![ks * 10, ks * 10 + 1], vec![ks, ks + 100])];
            f.apply(4, seq, ks, &[1], &events, &mut out);
        }
        assert_eq!(f.lanes[0].list.len(), 3);
        // Batch keyspace 72 removing a name of keyspace 70, one of 72 and one no engine
        // hash (a chain hash of keyspace 72).
        out.clear();
        let gone = [Event::Removed {
            lane: 0,
            hashes: vec![70, 172, 5],
        }];
        let r = f.apply(4, 3, 72, &[1], &gone, &mut out);
        assert_eq!(r.block_events, 3);
        let removed: Vec<(u64, Vec<u64>)> = out
            .ops()
            .iter()
            .map(|op| match *op {
                Op::Remove { ks, at, len, .. } => (ks, out.hashes(at, len).to_vec()),
                other => panic!("{other:?}"),
            })
            .collect();
        assert_eq!(removed, vec![(70, vec![700]), (72, vec![721, 5])]);
        // Emptying keyspace 71 leaves the lane with the two that still name blocks.
        let gone = [Event::Removed {
            lane: 0,
            hashes: vec![71, 171],
        }];
        f.apply(4, 4, 70, &[1], &gone, &mut out);
        let mut left: Vec<u64> = f.lanes[0].list.iter().map(|n| n.ks).collect();
        left.sort_unstable();
        assert_eq!(left, vec![70, 72]);
        let found: Vec<Option<usize>> = [70, 71, 72].map(|ks| f.lanes[0].index(ks)).into();
        let at_70 = f.lanes[0].list.iter().position(|n| n.ks == 70);
        let at_72 = f.lanes[0].list.iter().position(|n| n.ks == 72);
        assert_eq!(
            found,
            vec![at_70, None, at_72],
            "the seed map follows the list"
        );
        assert_eq!(f.names(), 2);
    }

    #[test]
    fn a_batch_looks_in_other_keyspaces_a_bounded_number_of_times() {
        // Names in 300 keyspaces; a batch of another keyspace removes 4,000 names none
        // of them holds but the last, each costing 300 lookups while the batch has any.
        let mut f = EventFeed::new(1);
        let mut out = OpBatch::new();
        for ks in 0..300u64 {
            let events = [stored(0, 0, vec![ks << 32], vec![1 << 40 | ks])];
            f.apply(4, ks, 1000 + ks, &[1], &events, &mut out);
        }
        out.clear();
        let mut hashes: Vec<u64> = (0..3999).map(|i| 7 << 50 | i).collect();
        hashes.push(1 << 40 | 299);
        let r = f.apply(
            4,
            300,
            5,
            &[1],
            &[Event::Removed { lane: 0, hashes }],
            &mut out,
        );
        let looked = OTHER_KEYSPACE_LOOKUPS / 300;
        assert_eq!(r.unprobed, 4000 - looked, "names not looked for");
        assert_eq!(r.block_events, 4000);
        // The last one was taken as a chain hash of keyspace 5: its name stays.
        assert_eq!(f.names(), 300);
        // A batch of its own has lookups again.
        let gone = [Event::Removed {
            lane: 0,
            hashes: vec![1 << 40 | 299],
        }];
        let r = f.apply(4, 301, 5, &[1], &gone, &mut out);
        assert_eq!((r.unprobed, f.names()), (0, 299));
    }

    #[test]
    fn a_lane_finds_each_of_many_keyspaces_by_seed_as_they_empty_in_any_order() {
        let mut f = EventFeed::new(1);
        let mut out = OpBatch::new();
        let mut seq = 0;
        // A salt per prompt: 40 keyspaces of two names each on one lane.
        for ks in 100..140u64 {
            let events = [stored(
                0,
                0,
                vec![ks * 10, ks * 10 + 1],
                vec![ks, ks + 1000],
            )];
            f.apply(4, seq, ks, &[1], &events, &mut out);
            seq += 1;
        }
        let mut held: Vec<u64> = (100..140).collect();
        // Names removed in a scrambled order, some filed under another keyspace, two or
        // three keyspaces emptied by one batch.
        let mut order: Vec<u64> = held.iter().flat_map(|&ks| [ks, ks + 1000]).collect();
        order.sort_by_key(|&n| n.wrapping_mul(0x9e37_79b9_7f4a_7c15));
        for names in order.chunks(5) {
            out.clear();
            let gone = [Event::Removed {
                lane: 0,
                hashes: names.to_vec(),
            }];
            let r = f.apply(4, seq, names[0] % 1000, &[1], &gone, &mut out);
            seq += 1;
            assert_eq!(r.block_events, names.len() as u64);
            let mut got: Vec<u64> = (out.ops().iter())
                .flat_map(|op| match *op {
                    Op::Remove { at, len, .. } => out.hashes(at, len).to_vec(),
                    other => panic!("{other:?}"),
                })
                .collect();
            let mut want: Vec<u64> = (names.iter())
                .map(|&n| {
                    if n < 1000 {
                        n * 10
                    } else {
                        (n - 1000) * 10 + 1
                    }
                })
                .collect();
            got.sort_unstable();
            want.sort_unstable();
            assert_eq!(got, want, "every name is found in its own keyspace");
            let lane = &f.lanes[0];
            held.retain(|ks| lane.list.iter().any(|n| n.ks == *ks));
            assert_eq!(
                lane.list.len(),
                held.len(),
                "only keyspaces with names stay"
            );
            assert_eq!(lane.at.len(), held.len());
            for (i, n) in lane.list.iter().enumerate() {
                assert!(!n.is_empty());
                assert_eq!(lane.index(n.ks), Some(i), "keyspace {} is found", n.ks);
            }
        }
        assert_eq!((f.names(), f.lanes[0].list.len()), (0, 0));
    }

    /// Applies `events` as batch `seq` of worker 4 (one lane of one-block engine blocks);
    /// the chain hashes its removals name, in order.
    fn removed(f: &mut EventFeed, seq: u64, events: &[Event]) -> Vec<u64> {
        let mut out = OpBatch::new();
        f.apply(4, seq, 77, &[1], events, &mut out);
        out.ops()
            .iter()
            .filter_map(|op| match *op {
                Op::Remove { at, len, .. } => Some(out.hashes(at, len).to_vec()),
                _ => None,
            })
            .flatten()
            .collect()
    }

    #[test]
    fn a_name_stored_again_removes_the_blocks_it_named_last() {
        let mut f = EventFeed::new(1);
        // 500 → block 10, then again → block 11, then a group of two, then one block again.
        let events = [
            stored(0, 0, vec![10], vec![500]),
            stored(0, 0, vec![11], vec![500]),
            stored(0, 0, vec![20], vec![600]),
        ];
        removed(&mut f, 0, &events);
        assert_eq!(
            removed(
                &mut f,
                1,
                &[Event::Removed {
                    lane: 0,
                    hashes: vec![500]
                }]
            ),
            [11]
        );
        let again = [
            stored(0, 0, vec![30], vec![700]),
            Event::Removed {
                lane: 0,
                hashes: vec![600],
            },
            stored(0, 0, vec![31], vec![700]),
        ];
        assert_eq!(removed(&mut f, 2, &again), [20]);
        assert_eq!(
            removed(
                &mut f,
                3,
                &[Event::Removed {
                    lane: 0,
                    hashes: vec![700]
                }]
            ),
            [31]
        );
        assert_eq!(f.names(), 0);
    }

    #[test]
    fn names_are_the_same_whether_or_not_they_settled() {
        // Many more names than wait to be settled, some stored twice, one as a group.
        let mut f = EventFeed::new(1);
        // 3R − 7 stores: the last 7 wait unsettled (R = RECENT).
        let mut events: Vec<Event> = (0..3 * RECENT as u64 - 7)
            .map(|i| stored(0, i as u32, vec![1000 + i], vec![i % (2 * RECENT as u64)]))
            .collect();
        events.push(Event::Stored {
            lane: 0,
            start: 0,
            parent: None,
            chain: vec![7, 8],
            engine: vec![3],
        });
        let mut out = OpBatch::new();
        f.apply(4, 0, 77, &[2], &events[events.len() - 1..], &mut out);
        f.apply_unsequenced(
            4,
            77,
            &[1],
            &events[..events.len() - 1],
            ApplyStatus::Applied,
            &mut out,
        );
        let unsettled = f.export(0);
        assert_eq!(f.names(), 2 * RECENT);
        assert_eq!(f.export(0), unsettled);
        // The last store of each name wins; name 3 was a group, then one block.
        let named = |n: u64| {
            unsettled
                .names
                .iter()
                .find(|i| i.name == n)
                .map(|i| i.chain.clone())
        };
        assert_eq!(named(3), Some(vec![1000 + 2 * RECENT as u64 + 3]));
        assert_eq!(
            named(2 * RECENT as u64 - 1),
            Some(vec![1000 + 2 * RECENT as u64 - 1])
        );
        let hashes: Vec<u64> = (0..2 * RECENT as u64).collect();
        let all = removed(&mut f, 1, &[Event::Removed { lane: 0, hashes }]);
        let want: Vec<u64> = (0..2 * RECENT as u64)
            .map(|n| {
                1000 + if n < RECENT as u64 - 7 {
                    2 * RECENT as u64 + n
                } else {
                    n
                }
            })
            .collect();
        assert_eq!(all, want);
        assert_eq!(f.names(), 0);
    }
}
