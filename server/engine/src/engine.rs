//! The single-threaded composition: roster, feeds and `shards` block indexes routed by
//! [`Sharding`]. The server runs the same parts spread over cores; tests and benches use
//! this. Any shard count gives the same answers as one shard.

use kvix_wire::{Event, Feed, Lane, WorkerId};

use crate::coverage::Coverage;
use crate::error::EngineError;
use crate::feed::{ApplyReport, BlockOp, FeedState};
use crate::index::BlockIndex;
use crate::roster::{AnnounceOutcome, Roster};
use crate::score::Ranker;
use crate::sharding::Sharding;
use crate::Ks;

pub use crate::score::Answer;

/// How an [`Engine`] is set up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EngineConfig {
    /// The server's token block size (tokens per keyspace block in token keyspaces).
    pub token_block: u32,
    pub sharding: Sharding,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            token_block: 16,
            sharding: Sharding::default(),
        }
    }
}

/// Counters over all shards.
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

/// Roster + feeds + sharded block indexes on one thread.
pub struct Engine {
    cfg: EngineConfig,
    roster: Roster,
    feeds: Vec<Option<FeedState>>,
    shards: Vec<BlockIndex>,
    cov: Coverage,
    ranker: Ranker,
}

impl Engine {
    /// One shard, default segment.
    pub fn new(token_block: u32) -> Self {
        Self::with_config(EngineConfig {
            token_block,
            ..Default::default()
        })
    }

    pub fn with_config(cfg: EngineConfig) -> Self {
        Engine {
            cfg,
            roster: Roster::new(),
            feeds: Vec::new(),
            shards: (0..cfg.sharding.shards.max(1))
                .map(|_| BlockIndex::new())
                .collect(),
            cov: Coverage::new(),
            ranker: Ranker::new(),
        }
    }

    pub fn config(&self) -> EngineConfig {
        self.cfg
    }

    pub fn roster(&self) -> &Roster {
        &self.roster
    }

    pub fn shards(&self) -> &[BlockIndex] {
        &self.shards
    }

    /// Registers (or re-registers) a worker. A changed roster or feed drops the worker's
    /// blocks and feed state; the same one changes nothing.
    pub fn announce(
        &mut self,
        name: &str,
        lanes: &[Lane],
        feed: Feed,
    ) -> Result<(WorkerId, AnnounceOutcome), EngineError> {
        let (id, outcome) = self
            .roster
            .announce(name, lanes, feed, self.cfg.token_block)?;
        if outcome != AnnounceOutcome::Unchanged {
            self.drop_worker(id);
            if self.feeds.len() <= id as usize {
                self.feeds.resize_with(id as usize + 1, || None);
            }
            self.feeds[id as usize] = Some(FeedState::new(feed, lanes.len()));
        }
        Ok((id, outcome))
    }

    /// Forgets a worker and everything it holds.
    pub fn retire(&mut self, worker: WorkerId) -> Result<(), EngineError> {
        self.roster.retire(worker)?;
        self.drop_worker(worker);
        self.feeds[worker as usize] = None;
        Ok(())
    }

    /// Forgets a worker's sequence baseline (its producer restarted counting from 0).
    pub fn reset_sequence(&mut self, worker: WorkerId) -> Result<(), EngineError> {
        match self.feed_mut(worker)? {
            FeedState::Events(f) => {
                f.sequencer().reset();
                Ok(())
            }
            other => Err(wrong_feed(worker, other, "events")),
        }
    }

    /// Applies one event batch of `worker`, in keyspace `ks`.
    pub fn apply(
        &mut self,
        worker: WorkerId,
        seq: u64,
        ks: Ks,
        events: &[Event],
    ) -> Result<ApplyReport, EngineError> {
        let entry = self.roster.worker(worker)?;
        let lane_blocks = entry.lane_blocks_in(ks.kind)?;
        let feed = feed_of(&mut self.feeds, worker)?;
        let FeedState::Events(feed) = feed else {
            return Err(wrong_feed(worker, feed, "events"));
        };
        let mut ops = Vec::new();
        let report = feed.apply(worker, seq, ks.seed, lane_blocks, events, &mut ops);
        self.route(&ops)?;
        Ok(report)
    }

    /// A gateway placed `chain` on `worker` at `now_ms`.
    pub fn place(
        &mut self,
        worker: WorkerId,
        ks: Ks,
        chain: &[u64],
        now_ms: u64,
    ) -> Result<(), EngineError> {
        self.roster.worker(worker)?.lane_blocks_in(ks.kind)?;
        let feed = feed_of(&mut self.feeds, worker)?;
        let FeedState::Placements(feed) = feed else {
            return Err(wrong_feed(worker, feed, "placements"));
        };
        let mut ops = Vec::new();
        feed.place(worker, ks.seed, chain, now_ms, &mut ops);
        self.route(&ops)
    }

    /// Expires placements older than their TTL; returns how many blocks were cut.
    pub fn expire(&mut self, now_ms: u64) -> Result<u64, EngineError> {
        let mut ops = Vec::new();
        for (w, feed) in self.feeds.iter_mut().enumerate() {
            if let Some(FeedState::Placements(f)) = feed {
                f.expire(w as WorkerId, now_ms, &mut ops);
            }
        }
        self.route(&ops)?;
        Ok(ops.len() as u64)
    }

    /// Who can reuse how much of `chain` in `ks` (see [`Answer`]). `candidates`: only
    /// these workers (`None`: all); `top_k = 0`: every scoring worker.
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
        let chain = &chain[..chain.len().min(u32::MAX as usize)];
        self.cov.reset(candidates);
        for piece in self.cfg.sharding.split(ks.seed, 0, chain) {
            self.shards[piece.shard as usize].coverage(
                ks.seed,
                piece.start,
                piece.chain,
                &mut self.cov,
            );
        }
        let roster = &self.roster;
        self.ranker.rank(
            &self.cov,
            chain.len() as u32,
            top_k,
            want_runs,
            |w| roster.get(w).and_then(|e| e.rules_in(ks.kind)),
            out,
        );
    }

    pub fn stats(&self) -> EngineStats {
        EngineStats {
            workers: self.roster.len(),
            blocks: self.shards.iter().map(BlockIndex::blocks).sum(),
            memberships: self.shards.iter().map(BlockIndex::memberships).sum(),
            runs: self.shards.iter().map(|s| s.runs() as u64).sum(),
        }
    }

    /// The whole engine as plain data at `now_ms` (see [`crate::image`]).
    pub fn export(&self, now_ms: u64) -> crate::EngineImage {
        crate::EngineImage {
            workers: self.roster.export(),
            runs: self.shards.iter().flat_map(BlockIndex::export).collect(),
            feeds: self
                .feeds
                .iter()
                .enumerate()
                .filter_map(|(w, f)| f.as_ref().map(|f| (w as WorkerId, f.export(now_ms))))
                .collect(),
        }
    }

    /// Restores an image into a fresh engine (any shard count) at `now_ms`.
    pub fn import(&mut self, image: &crate::EngineImage, now_ms: u64) -> Result<(), EngineError> {
        self.roster.import(&image.workers, self.cfg.token_block)?;
        for w in self.roster.iter() {
            if self.feeds.len() <= w.id as usize {
                self.feeds.resize_with(w.id as usize + 1, || None);
            }
            self.feeds[w.id as usize] = Some(FeedState::new(w.feed, w.lanes.len()));
        }
        for (w, img) in &image.feeds {
            if let Some(Some(f)) = self.feeds.get_mut(*w as usize) {
                f.import(img, now_ms);
            }
        }
        let sharding = self.cfg.sharding;
        for run in &image.runs {
            for p in sharding.split(run.ks, run.start, &run.hashes) {
                self.shards[p.shard as usize].import(run.ks, p.start, p.chain, &run.holders)?;
            }
        }
        Ok(())
    }

    /// Checks every shard's invariants; for tests.
    #[doc(hidden)]
    pub fn check_invariants(&self) -> Result<(), String> {
        self.shards
            .iter()
            .try_for_each(BlockIndex::check_invariants)
    }

    fn feed_mut(&mut self, worker: WorkerId) -> Result<&mut FeedState, EngineError> {
        self.roster.worker(worker)?;
        feed_of(&mut self.feeds, worker)
    }

    fn drop_worker(&mut self, worker: WorkerId) {
        for s in &mut self.shards {
            s.drop_worker(worker);
        }
    }

    /// Sends each operation to the shard(s) owning its positions.
    fn route(&mut self, ops: &[BlockOp<'_>]) -> Result<(), EngineError> {
        let (sharding, shards) = (self.cfg.sharding, &mut self.shards);
        let mut result = Ok(());
        for op in ops {
            sharding.route(op, |s, piece| {
                if result.is_ok() {
                    result = shards[s as usize].apply(&piece);
                }
            });
        }
        Ok(result?)
    }
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

fn wrong_feed(worker: WorkerId, has: &FeedState, wanted: &'static str) -> EngineError {
    EngineError::WrongFeed {
        worker,
        has: has.kind(),
        wanted,
    }
}
