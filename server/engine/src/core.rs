//! One executor's share of the engine: the roster as every executor sees it, the feed
//! state of the workers this executor is home to, the whole index, and query scratch.
//!
//! Writes are split in two. On a worker's home, [`Core::events`], [`Core::place`],
//! [`Core::register`] and [`Core::retire`] check the write against the feed and turn it
//! into an [`Update`] (block operations, then a roster change), touching nothing else.
//! Every executor, the home included, then applies that update to its own index with
//! [`Core::apply`] (or in bounded slices with [`Core::apply_some`]). Queries read only
//! this executor's index and roster. [`crate::Engine`] is one `Core` that is home to
//! every worker, so tests of the engine exercise exactly what the server runs.

use kvix_wire::{ApplyStatus, Tier, WorkerId};

use crate::error::{EngineError, IndexError};
use crate::feed::{ApplyReport, EventFeed, EventView, EventsJob, FeedState, FillIn, Placing};
use crate::index::BlockIndex;
use crate::ops::{Cursor, Op, RosterChange, Update};
use crate::query::{Ask, Ranker};
use crate::roster::{AnnounceOutcome, Roster, WorkerEntry};
use crate::score::Answer;
use crate::{FeedImage, Holder, Ks, RunImage, MAX_LANES};

/// One executor's roster, home feeds, index and query scratch (see the module docs).
pub struct Core {
    roster: Roster,
    /// Feed state of the workers this core is home to, by id.
    feeds: Vec<Option<FeedState>>,
    index: BlockIndex,
    ranker: Ranker,
    fill_in: FillIn,
}

impl Default for Core {
    fn default() -> Self {
        Self::new()
    }
}

impl Core {
    pub fn new() -> Self {
        Core {
            roster: Roster::new(),
            feeds: Vec::new(),
            index: BlockIndex::new(),
            ranker: Ranker::new(),
            fill_in: FillIn::default(),
        }
    }

    /// A core whose event-fed workers, once their history is lost, take gateways'
    /// placements as `fill_in` says ([`Core::fill_in`]).
    pub fn with_fill_in(self, fill_in: FillIn) -> Self {
        Core { fill_in, ..self }
    }

    pub fn roster(&self) -> &Roster {
        &self.roster
    }

    pub fn index(&self) -> &BlockIndex {
        &self.index
    }

    /// Makes room for `blocks` more blocks in the index at once.
    pub fn reserve(&mut self, blocks: usize) {
        self.index.reserve(blocks);
    }

    /// Whether this core keeps `worker`'s feed.
    pub fn is_home(&self, worker: WorkerId) -> bool {
        matches!(self.feeds.get(worker as usize), Some(Some(_)))
    }

    /// Home: a worker the registry (re-)registered. When its roster or feed changed (or
    /// it is new), what it held is dropped and its feed starts afresh.
    pub fn register(&mut self, entry: WorkerEntry, outcome: AnnounceOutcome, out: &mut Update) {
        let id = entry.id;
        if outcome != AnnounceOutcome::Unchanged || !self.is_home(id) {
            self.drop_all(id, out);
            *feed_slot(&mut self.feeds, id) = Some(FeedState::new(entry.feed, entry.lanes.len()));
        }
        out.roster = Some(RosterChange::Install(entry));
    }

    /// Home: forgets a worker and everything it holds.
    pub fn retire(&mut self, worker: WorkerId, out: &mut Update) -> Result<(), EngineError> {
        self.roster.worker(worker)?;
        self.drop_all(worker, out);
        out.roster = Some(RosterChange::Remove(worker));
        Ok(())
    }

    /// Home: drops what a placement-fed worker holds and starts its feed afresh: its
    /// engine lost its cache (a restart), as the engine's own reuse reports say. An
    /// event-fed worker is refused: its events say what its engine holds.
    pub fn forget_placements(
        &mut self,
        worker: WorkerId,
        out: &mut Update,
    ) -> Result<(), EngineError> {
        let entry = self.roster.worker(worker)?;
        let (feed, lanes) = (entry.feed, entry.lanes.len());
        let state = feed_of(&mut self.feeds, worker)?;
        if !matches!(state, FeedState::Placements(_)) {
            return Err(wrong_feed(worker, state, "placements"));
        }
        // As a changed announce resets a worker ([`Core::register`]).
        self.drop_all(worker, out);
        *feed_slot(&mut self.feeds, worker) = Some(FeedState::new(feed, lanes));
        Ok(())
    }

    /// Forgets `worker`'s feed and drops what it holds: each lane and tier swept from
    /// the index (the runs of the holder sets that hold it; nothing to do for one holding
    /// none).
    fn drop_all(&mut self, worker: WorkerId, out: &mut Update) {
        let fed = self.feeds.get_mut(worker as usize).and_then(Option::take);
        // Only a worker with a feed or in the roster can hold anything.
        if fed.is_some() || self.roster.get(worker).is_some() {
            out.ops.sweep_lanes(worker, MAX_LANES);
        }
    }

    /// Home: checks batch `seq` of `worker`'s events in `ks` and turns it into block
    /// operations. A batch is taken whole or refused whole (its seq not taken either).
    pub fn events<E: EventView>(
        &mut self,
        worker: WorkerId,
        seq: u64,
        ks: Ks,
        events: &[E],
        out: &mut Update,
    ) -> Result<ApplyReport, EngineError> {
        let (lane_blocks, feed) = self.sequenced(worker, ks, seq, events)?;
        Ok(feed.apply(worker, seq, ks.seed, lane_blocks, events, &mut out.ops))
    }

    /// Home: starts batch `seq` of `worker`'s events as a feed step in slices of about
    /// `budget` blocks, checked whole first; [`Core::events_some`] applies it (nothing
    /// else may write to this worker's feed until it is done). What [`Core::events`]
    /// does at once.
    pub fn start_events<E: EventView>(
        &mut self,
        worker: WorkerId,
        seq: u64,
        ks: Ks,
        events: &[E],
        budget: u64,
    ) -> Result<EventsJob, EngineError> {
        let (_, feed) = self.sequenced(worker, ks, seq, events)?;
        Ok(feed.start(seq, events.len(), budget))
    }

    /// Home: one slice more of a batch started by [`Core::start_events`], appending the
    /// block operations to `out`; true once it is done (its report in `job.report`).
    pub fn events_some<E: EventView>(
        &mut self,
        worker: WorkerId,
        ks: Ks,
        events: &[E],
        job: &mut EventsJob,
        out: &mut Update,
    ) -> Result<bool, EngineError> {
        let (lane_blocks, feed) = home_feed(&self.roster, &mut self.feeds, worker, ks)?;
        let FeedState::Events(feed) = feed else {
            return Err(wrong_feed(worker, feed, "events"));
        };
        Ok(feed.apply_some(worker, ks.seed, lane_blocks, events, job, &mut out.ops))
    }

    /// Home: events of `worker` in `ks` that come without a sequence number, in the order
    /// their producer checked (the server's engine-event ingest), checked whole and
    /// turned into block operations.
    pub fn ingest<E: EventView>(
        &mut self,
        worker: WorkerId,
        ks: Ks,
        events: &[E],
        out: &mut Update,
    ) -> Result<ApplyReport, EngineError> {
        let (lane_blocks, feed) = self.checked(worker, ks, 0, events)?;
        Ok(feed.apply_unsequenced(
            worker,
            ks.seed,
            lane_blocks,
            events,
            ApplyStatus::Applied,
            &mut out.ops,
        ))
    }

    /// Home: events of `worker` in `ks` that come without a sequence number (the
    /// ingest), checked whole, as a feed step in slices of about `budget` blocks that
    /// [`Core::events_some`] applies. What [`Core::ingest`] does at once.
    pub fn start_ingest<E: EventView>(
        &mut self,
        worker: WorkerId,
        ks: Ks,
        events: &[E],
        budget: u64,
    ) -> Result<EventsJob, EngineError> {
        let (_, feed) = self.checked(worker, ks, 0, events)?;
        Ok(feed.start_unsequenced(budget))
    }

    /// The event feed of `worker` once batch `seq` passed its checks whole, its seq
    /// included.
    fn sequenced<E: EventView>(
        &mut self,
        worker: WorkerId,
        ks: Ks,
        seq: u64,
        events: &[E],
    ) -> Result<(&[u32], &mut EventFeed), EngineError> {
        let (lane_blocks, feed) = self.checked(worker, ks, seq, events)?;
        if let Some(why) = feed.sequencer().implausible(seq) {
            return Err(EngineError::BadSequence { seq, why });
        }
        Ok((lane_blocks, feed))
    }

    /// The event feed of `worker` once `events` passed its checks whole.
    fn checked<E: EventView>(
        &mut self,
        worker: WorkerId,
        ks: Ks,
        seq: u64,
        events: &[E],
    ) -> Result<(&[u32], &mut EventFeed), EngineError> {
        let (lane_blocks, feed) = home_feed(&self.roster, &mut self.feeds, worker, ks)?;
        let FeedState::Events(feed) = feed else {
            return Err(wrong_feed(worker, feed, "events"));
        };
        feed.check(lane_blocks, events)
            .map_err(|(index, source)| EngineError::Refused { seq, index, source })?;
        Ok((lane_blocks, feed))
    }

    /// Home: a gateway placed `chain` on `worker` at `now_ms`; false where the worker's
    /// feed does not take it (see [`Core::start_placing`]).
    pub fn place(
        &mut self,
        worker: WorkerId,
        ks: Ks,
        chain: &[u64],
        now_ms: u64,
        out: &mut Update,
    ) -> Result<bool, EngineError> {
        let Some(mut job) = self.start_placing(worker, ks, chain, now_ms)? else {
            return Ok(false);
        };
        while !self.place_some(worker, ks, chain, &mut job, u64::MAX, out)? {}
        Ok(true)
    }

    /// Home: starts a placement to be done in slices by [`Core::place_some`] (nothing else
    /// may write to this worker's feed until it is done). None where the worker's feed
    /// does not take it: an event-fed worker's own events are exact, so its placements
    /// are passed over unless they fill in for its lost history ([`Core::fill_in`]).
    pub fn start_placing(
        &mut self,
        worker: WorkerId,
        ks: Ks,
        chain: &[u64],
        now_ms: u64,
    ) -> Result<Option<Placing>, EngineError> {
        let (_, feed) = home_feed(&self.roster, &mut self.feeds, worker, ks)?;
        Ok(feed.placements().map(|f| f.start(chain.len(), now_ms)))
    }

    /// Home: about `budget` blocks of a placement `job`; true once it is done. A fill-in
    /// leaves the blocks the worker's events report to them.
    pub fn place_some(
        &mut self,
        worker: WorkerId,
        ks: Ks,
        chain: &[u64],
        job: &mut Placing,
        budget: u64,
        out: &mut Update,
    ) -> Result<bool, EngineError> {
        let (_, feed) = home_feed(&self.roster, &mut self.feeds, worker, ks)?;
        let ops = &mut out.ops;
        match feed {
            FeedState::Placements(f) => {
                let alone = |_, _| false;
                Ok(f.place_some(worker, ks.seed, chain, job, budget, alone, ops))
            }
            FeedState::Events(f) => {
                let Some(fill) = f.fill() else {
                    return Err(wrong_feed(worker, feed, "placements"));
                };
                let (index, lane0) = (&self.index, Holder::new(worker, 0));
                let held = |pos, hash| index.holds(ks.seed, lane0, pos, hash);
                Ok(fill.place_some(worker, ks.seed, chain, job, budget, held, ops))
            }
        }
    }

    /// Home: `worker`'s history is lost (its engine may hold blocks its events will not
    /// report), so gateways' placements fill in for it from now on, as the core's
    /// [`FillIn`] says, until its events' clear. Only a worker of one full-attention lane
    /// takes them (a placement records whole chains on lane 0); false where it does not.
    pub fn fill_in(&mut self, worker: WorkerId) -> bool {
        let one_full_lane = self
            .roster
            .get(worker)
            .is_some_and(|e| e.lanes.len() == 1 && e.lanes[0].kind.is_full());
        let Some(Some(FeedState::Events(f))) = self.feeds.get_mut(worker as usize) else {
            return false;
        };
        if f.fills() {
            return true;
        }
        // A new empty feed only where none is under way (this runs at every delivery
        // of a worker whose history is lost).
        match self.fill_in.feed() {
            Some(fill) if one_full_lane => {
                f.start_fill(fill);
                true
            }
            _ => false,
        }
    }

    /// Whether placements on `worker` fill in for its lost history.
    pub fn fills_in(&self, worker: WorkerId) -> bool {
        matches!(
            self.feeds.get(worker as usize),
            Some(Some(FeedState::Events(f))) if f.fills()
        )
    }

    /// Home: cuts the placements older than their TTL, of every worker homed here (a
    /// fill-in's too).
    pub fn expire(&mut self, now_ms: u64, out: &mut Update) {
        for (w, feed) in self.feeds.iter_mut().enumerate() {
            if let Some(f) = feed.as_mut().and_then(FeedState::placements) {
                f.expire(w as WorkerId, now_ms, &mut out.ops);
            }
        }
    }

    /// Home: forgets a worker's sequence baseline (its producer restarted from 0).
    pub fn reset_sequence(&mut self, worker: WorkerId) -> Result<(), EngineError> {
        self.roster.worker(worker)?;
        match feed_of(&mut self.feeds, worker)? {
            FeedState::Events(f) => {
                f.sequencer().reset();
                Ok(())
            }
            other => Err(wrong_feed(worker, other, "events")),
        }
    }

    /// The last sequence applied for an event-fed worker homed here.
    pub fn last_seq(&mut self, worker: WorkerId) -> Option<u64> {
        match self.feeds.get_mut(worker as usize)? {
            Some(FeedState::Events(f)) => f.sequencer().last(),
            _ => None,
        }
    }

    /// Every executor: applies a whole update.
    pub fn apply(&mut self, update: &Update) -> Result<(), IndexError> {
        let mut cursor = Cursor::default();
        self.apply_some(update, &mut cursor, u64::MAX)
    }

    /// Every executor: applies about `budget` blocks of `update` from `cursor` on (an
    /// insert or removal is cut mid-way, keeping the chain linked), then its roster
    /// change once every operation is in. `cursor.is_finished()` tells when it is all
    /// applied. An operation the index refuses is skipped; the first refusal is returned
    /// once the update is finished (feeds only emit valid operations: a refusal is a bug).
    pub fn apply_some(
        &mut self,
        update: &Update,
        cursor: &mut Cursor,
        budget: u64,
    ) -> Result<(), IndexError> {
        let batch = &update.ops;
        let mut left = budget;
        let mut result = Ok(());
        while cursor.op < batch.ops.len() && left > 0 {
            let op = batch.ops[cursor.op];
            let from = cursor.done;
            let step = ((op.len() - from) as u64).min(left) as u32;
            let done = match op {
                Op::Insert {
                    ks,
                    holder,
                    start,
                    parent,
                    at,
                    ..
                } => {
                    if holder.tier != Tier::Gpu {
                        self.roster.mark_tiered(holder.worker);
                    }
                    let chain = batch.hashes(at + from, step);
                    let parent = match from {
                        0 => parent,
                        _ => Some(batch.hashes[(at + from - 1) as usize]),
                    };
                    self.index.insert(ks, holder, start + from, parent, chain)
                }
                Op::Remove { ks, holder, at, .. } => self
                    .index
                    .remove(ks, holder, batch.hashes(at + from, step))
                    .map(drop),
                Op::Sweep { holder } => {
                    let (taken, finished) = self.index.sweep(holder, left);
                    left -= taken.clamp(1, left);
                    if finished {
                        cursor.op += 1;
                    } else {
                        left = 0;
                    }
                    continue;
                }
            };
            if result.is_ok() {
                result = done;
            }
            left -= (step as u64).clamp(1, left);
            cursor.done += step;
            if cursor.done >= op.len() {
                cursor.op += 1;
                cursor.done = 0;
            }
        }
        if cursor.op >= batch.ops.len() && !cursor.finished {
            match &update.roster {
                Some(RosterChange::Install(entry)) => self.roster.install(entry.clone()),
                Some(RosterChange::Remove(w)) => {
                    self.roster.remove(*w);
                }
                None => {}
            }
            cursor.finished = true;
        }
        result
    }

    /// Who can reuse how much of `chain` in `ks` (see [`Answer`]), into a reused answer.
    pub fn query_into(&mut self, ks: Ks, chain: &[u64], ask: &Ask<'_>, out: &mut Answer) {
        self.ranker
            .query(&self.index, &self.roster, ks, chain, ask, out);
    }

    /// The feeds of the workers homed here, as plain data at `now_ms`.
    pub fn export_feeds(&self, now_ms: u64) -> Vec<(WorkerId, FeedImage)> {
        self.feeds
            .iter()
            .enumerate()
            .filter_map(|(w, f)| f.as_ref().map(|f| (w as WorkerId, f.export(now_ms))))
            .collect()
    }

    /// The index's runs, with only the holders `keep` selects (runs left with none are
    /// skipped): a home exports its own workers' blocks, consistent with its feeds.
    pub fn export_runs(&self, keep: impl Fn(WorkerId) -> bool) -> Vec<RunImage> {
        let mut out = Vec::new();
        self.index.export_some(&mut 0, u64::MAX, keep, &mut out);
        out
    }

    /// Restores a snapshot into a fresh core: the active `entries`, every run, and the
    /// feeds of the workers `home` selects, at `now_ms`.
    /// Restores a snapshot's roster, feeds and runs; the number of holders dropped for
    /// naming a worker or lane the roster lacks (a roster changed while the snapshot was
    /// taken). A holder no roster could have (lane >= 16, worker >= 2^20, a tier past
    /// storage) refuses it.
    pub fn import(
        &mut self,
        entries: &[WorkerEntry],
        runs: &[RunImage],
        feeds: &[(WorkerId, FeedImage)],
        home: impl Fn(WorkerId) -> bool,
        now_ms: u64,
    ) -> Result<usize, EngineError> {
        for e in entries {
            self.roster.install(e.clone());
            if home(e.id) {
                *feed_slot(&mut self.feeds, e.id) = Some(FeedState::new(e.feed, e.lanes.len()));
            }
        }
        for (w, img) in feeds {
            if let Some(Some(f)) = self.feeds.get_mut(*w as usize) {
                f.import(img, now_ms, self.fill_in);
            }
        }
        self.index
            .reserve(runs.iter().map(|r| r.hashes.len()).sum());
        let mut dropped = 0;
        for run in runs {
            for &(worker, slot) in &run.holders {
                let holder = Holder::from_slot(worker, slot)
                    .ok_or(IndexError::BadHolder { worker, lane: slot })?;
                holder.pack()?;
                if holder.tier != Tier::Gpu {
                    self.roster.mark_tiered(worker);
                }
            }
            // A holder is restored only on a lane its active worker has: one past the
            // roster would be held where no sweep reaches it.
            let active = |&(w, slot): &(u32, u8)| {
                self.roster
                    .get(w)
                    .is_some_and(|e| ((slot & 15) as usize) < e.lanes.len())
            };
            if run.holders.iter().all(active) {
                self.index.import(run)?;
            } else {
                let mut run = run.clone();
                let before = run.holders.len();
                run.holders.retain(active);
                dropped += before - run.holders.len();
                self.index.import(&run)?;
            }
        }
        // A feed's tiers are not in its image: what the index holds says them.
        for (w, feed) in self.feeds.iter_mut().enumerate() {
            if let Some(FeedState::Events(f)) = feed {
                if self.roster.is_tiered(w as WorkerId) {
                    f.note_tier(Tier::Cpu);
                    f.note_tier(Tier::Storage);
                }
            }
        }
        Ok(dropped)
    }
}

fn feed_slot(feeds: &mut Vec<Option<FeedState>>, worker: WorkerId) -> &mut Option<FeedState> {
    if feeds.len() <= worker as usize {
        feeds.resize_with(worker as usize + 1, || None);
    }
    &mut feeds[worker as usize]
}

fn feed_of(
    feeds: &mut [Option<FeedState>],
    worker: WorkerId,
) -> Result<&mut FeedState, EngineError> {
    feeds
        .get_mut(worker as usize)
        .and_then(Option::as_mut)
        .ok_or(EngineError::UnknownWorker(worker))
}

/// The worker's lane blocks in `ks` and its feed state (this being its home).
fn home_feed<'a>(
    roster: &'a Roster,
    feeds: &'a mut [Option<FeedState>],
    worker: WorkerId,
    ks: Ks,
) -> Result<(&'a [u32], &'a mut FeedState), EngineError> {
    let lane_blocks = roster.worker(worker)?.lane_blocks_in(ks.kind)?;
    Ok((lane_blocks, feed_of(feeds, worker)?))
}

fn wrong_feed(worker: WorkerId, has: &FeedState, wanted: &'static str) -> EngineError {
    EngineError::WrongFeed {
        worker,
        has: has.kind(),
        wanted,
    }
}
