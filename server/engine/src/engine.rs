//! The whole engine on one thread: the registry (names → ids) and one [`Core`] that is
//! home to every worker. Tests and benches use this; the server runs the same `Core`
//! once per executor, so both apply batches whole and answer the same way.

use kvix_wire::{Feed, Lane, WorkerId};

use crate::core::Core;
use crate::error::EngineError;
use crate::feed::{ApplyReport, EventView};
use crate::index::BlockIndex;
use crate::ops::Update;
use crate::query::Ask;
use crate::roster::{AnnounceOutcome, Registry, Roster};
use crate::Ks;

pub use crate::score::Answer;

/// Counters of an engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct EngineStats {
    pub workers: u32,
    /// Distinct blocks held.
    pub blocks: u64,
    /// (block, holder) pairs.
    pub memberships: u64,
    /// Runs (compressed nodes) in use.
    pub runs: u64,
}

/// Registry + one core, on one thread.
pub struct Engine {
    token_block: u32,
    registry: Registry,
    core: Core,
    update: Update,
}

impl Engine {
    /// An engine hashing `token_block`-token blocks in token keyspaces.
    pub fn new(token_block: u32) -> Self {
        Engine {
            token_block,
            registry: Registry::new(),
            core: Core::new(),
            update: Update::new(),
        }
    }

    pub fn token_block(&self) -> u32 {
        self.token_block
    }

    pub fn roster(&self) -> &Roster {
        self.core.roster()
    }

    pub fn registry(&self) -> &Registry {
        &self.registry
    }

    pub fn index(&self) -> &BlockIndex {
        self.core.index()
    }

    /// Makes room for `blocks` more blocks at once.
    pub fn reserve(&mut self, blocks: usize) {
        self.core.reserve(blocks);
    }

    /// Registers (or re-registers) a worker. A changed roster or feed drops the worker's
    /// blocks and feed state; the same one changes nothing.
    pub fn announce(
        &mut self,
        name: &str,
        lanes: &[Lane],
        feed: Feed,
    ) -> Result<(WorkerId, AnnounceOutcome), EngineError> {
        let (entry, outcome) = self
            .registry
            .register(name, lanes, feed, self.token_block)?;
        let id = entry.id;
        let mut u = std::mem::take(&mut self.update);
        u.clear();
        self.core.register(entry, outcome, &mut u);
        let done = self.core.apply(&u);
        self.update = u;
        done?;
        Ok((id, outcome))
    }

    /// Forgets a worker and everything it holds.
    pub fn retire(&mut self, worker: WorkerId) -> Result<(), EngineError> {
        self.registry.retire(worker)?;
        self.write(|core, u| core.retire(worker, u))
    }

    /// Forgets a worker's sequence baseline (its producer restarted counting from 0).
    pub fn reset_sequence(&mut self, worker: WorkerId) -> Result<(), EngineError> {
        self.core.reset_sequence(worker)
    }

    /// Applies one event batch of `worker`, in keyspace `ks`: whole, or refused whole.
    pub fn apply<E: EventView>(
        &mut self,
        worker: WorkerId,
        seq: u64,
        ks: Ks,
        events: &[E],
    ) -> Result<ApplyReport, EngineError> {
        self.write(|core, u| core.events(worker, seq, ks, events, u))
    }

    /// A gateway placed `chain` on `worker` at `now_ms`; false where the worker's feed
    /// does not take it ([`Core::start_placing`]).
    pub fn place(
        &mut self,
        worker: WorkerId,
        ks: Ks,
        chain: &[u64],
        now_ms: u64,
    ) -> Result<bool, EngineError> {
        self.write(|core, u| core.place(worker, ks, chain, now_ms, u))
    }

    /// Drops what a placement-fed worker holds and starts its feed afresh (its engine lost
    /// its cache); refused for an event-fed worker ([`Core::forget_placements`]).
    pub fn forget_placements(&mut self, worker: WorkerId) -> Result<(), EngineError> {
        self.write(|core, u| core.forget_placements(worker, u))
    }

    /// An engine whose event-fed workers take placements as `fill_in` says once their
    /// history is lost ([`Engine::fill_in`]).
    pub fn with_fill_in(mut self, fill_in: crate::FillIn) -> Self {
        self.core = std::mem::take(&mut self.core).with_fill_in(fill_in);
        self
    }

    /// An event-fed worker's history is lost: placements fill in for it until its
    /// events clear it ([`Core::fill_in`]); false where they do not.
    pub fn fill_in(&mut self, worker: WorkerId) -> bool {
        self.core.fill_in(worker)
    }

    /// Expires placements older than their TTL; returns how many blocks were cut.
    pub fn expire(&mut self, now_ms: u64) -> Result<u64, EngineError> {
        self.write(|core, u| {
            core.expire(now_ms, u);
            Ok(u.ops.blocks())
        })
    }

    /// Runs a home-side write, then applies its update.
    fn write<T>(
        &mut self,
        f: impl FnOnce(&mut Core, &mut Update) -> Result<T, EngineError>,
    ) -> Result<T, EngineError> {
        let mut u = std::mem::take(&mut self.update);
        u.clear();
        let out = f(&mut self.core, &mut u);
        let done = match out {
            Ok(_) => self.core.apply(&u).map_err(EngineError::from),
            Err(_) => Ok(()),
        };
        self.update = u;
        done?;
        out
    }

    /// Who can reuse how much of `chain` in `ks` (see [`Answer`]), ranked by joint reuse.
    /// `candidates`: only these workers (`None`: all); `top_k = 0`: every scoring worker.
    pub fn query(
        &mut self,
        ks: Ks,
        chain: &[u64],
        candidates: Option<&[WorkerId]>,
        top_k: u32,
        want_runs: bool,
    ) -> Answer {
        let mut out = Answer::default();
        self.query_into(ks, chain, candidates, top_k, want_runs, &mut out);
        out
    }

    /// [`Engine::query`] into a reused answer (no allocation once warm).
    pub fn query_into(
        &mut self,
        ks: Ks,
        chain: &[u64],
        candidates: Option<&[WorkerId]>,
        top_k: u32,
        want_runs: bool,
        out: &mut Answer,
    ) {
        let ask = Ask {
            candidates,
            top_k,
            want_runs,
            ..Ask::joint()
        };
        self.core.query_into(ks, chain, &ask, out);
    }

    /// Who can reuse how much of `chain` in `ks`, as `ask` says (tier weights included).
    pub fn ask(&mut self, ks: Ks, chain: &[u64], ask: &Ask<'_>) -> Answer {
        let mut out = Answer::default();
        self.core.query_into(ks, chain, ask, &mut out);
        out
    }

    pub fn stats(&self) -> EngineStats {
        let ix = self.core.index();
        EngineStats {
            workers: self.core.roster().len(),
            blocks: ix.blocks(),
            memberships: ix.memberships(),
            runs: ix.runs() as u64,
        }
    }

    /// The whole engine as plain data at `now_ms` (see [`crate::image`]).
    pub fn export(&self, now_ms: u64) -> crate::EngineImage {
        crate::EngineImage {
            workers: self.registry.export(),
            runs: self.core.export_runs(|_| true),
            feeds: self.core.export_feeds(now_ms),
        }
    }

    /// Restores an image into a fresh engine at `now_ms`; the holders dropped (see
    /// `Core::import`).
    pub fn import(
        &mut self,
        image: &crate::EngineImage,
        now_ms: u64,
    ) -> Result<usize, EngineError> {
        let entries = self.registry.import(&image.workers, self.token_block)?;
        self.core
            .import(&entries, &image.runs, &image.feeds, |_| true, now_ms)
    }

    /// Checks the index's invariants; for tests.
    #[doc(hidden)]
    pub fn check_invariants(&self) -> Result<(), String> {
        self.core.index().check_invariants()
    }
}
