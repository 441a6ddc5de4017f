//! One executor's shard: its slice of the index, its replica of the roster, the feed
//! state of the workers it is home to, and the calls to its peers.
//!
//! Blocks live on the shard that owns their segment (`Sharding::owner`); a worker's
//! feed (sequence numbers, engine-hash map, placement recency) lives on its home shard
//! (`worker % shards`); ids are assigned by shard 0; every shard keeps the roster.

use std::cell::{OnceCell, RefCell};
use std::future::Future;
use std::rc::Rc;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Instant;

use kvix_engine::{
    AnnounceOutcome, BlockIndex, BlockOp, Coverage, EngineError, FeedState, Holder, Ks, Ranker,
    Roster, Sharding,
};
use kvix_wire::{u64s, AlignedVec, Announced, Applied, ArchivedQuery, ErrorCode, Stats, WorkerId};

use crate::config::Config;
use crate::handler::frame;
use crate::mesh::{LocalFuture, Mesh};
use crate::metrics::{Outcome, ShardMetrics};
use crate::ops::{
    AnnounceReq, Blocks, Failure, FeedReq, RosterEntry, ShardImage, ShardRep, ShardReq,
};

pub struct Limits {
    pub max_frame: u32,
    pub max_inflight: usize,
}

pub struct Shard {
    config: Arc<Config>,
    all_metrics: Arc<[ShardMetrics]>,
    me: usize,
    shards: usize,
    sharding: Sharding,
    mesh: OnceCell<Rc<Mesh<ShardReq, ShardRep>>>,
    state: RefCell<State>,
    started: Instant,
}

/// Everything this shard owns; borrowed only between awaits.
struct State {
    index: BlockIndex,
    roster: Roster,
    /// Feed state of the workers this shard is home to, by id.
    feeds: Vec<Option<FeedState>>,
    ranker: Ranker,
}

/// A query split across shards: the local part answered, the remote parts on their way.
pub struct QueryPlan {
    coverage: Vec<Coverage>,
    chain_len: u32,
    kind: kvix_wire::ChunkKind,
    candidates: Vec<WorkerId>,
    top_k: u32,
    want_runs: bool,
    remote: Vec<LocalFuture<Result<ShardRep, crate::mesh::PeerGone>>>,
}

impl Shard {
    pub fn new(
        config: Arc<Config>,
        all_metrics: Arc<[ShardMetrics]>,
        me: usize,
        shards: usize,
    ) -> Rc<Self> {
        Rc::new(Shard {
            sharding: Sharding {
                shards: shards as u32,
                segment: config.segment.max(1),
            },
            config,
            all_metrics,
            me,
            shards,
            mesh: OnceCell::new(),
            state: RefCell::new(State {
                index: BlockIndex::new(),
                roster: Roster::new(),
                feeds: Vec::new(),
                ranker: Ranker::new(),
            }),
            started: Instant::now(),
        })
    }

    pub fn set_mesh(&self, mesh: Rc<Mesh<ShardReq, ShardRep>>) {
        let _ = self.mesh.set(mesh);
    }

    pub fn config(&self) -> &Config {
        &self.config
    }

    pub fn metrics(&self) -> &ShardMetrics {
        &self.all_metrics[self.me]
    }

    pub fn limits(&self) -> Limits {
        Limits {
            max_frame: self.config.max_frame,
            max_inflight: self.config.max_inflight,
        }
    }

    pub fn me(&self) -> usize {
        self.me
    }

    pub fn shards(&self) -> usize {
        self.shards
    }

    pub fn home_of(&self, worker: WorkerId) -> usize {
        worker as usize % self.shards
    }

    fn now_ms(&self) -> u64 {
        self.started.elapsed().as_millis() as u64
    }

    /// Runs `req` on shard `to`: directly when that is this shard, else over the mesh.
    /// The request is issued before this returns, so calls keep their order.
    pub fn call(
        self: &Rc<Self>,
        to: usize,
        req: ShardReq,
    ) -> LocalFuture<Result<ShardRep, Failure>> {
        if to == self.me {
            let fut = self.clone().execute(req);
            return Box::pin(async move { Ok(fut.await) });
        }
        let fut = self
            .mesh
            .get()
            .expect("mesh joined before serving")
            .call(to, req);
        Box::pin(async move {
            fut.await
                .map_err(|e| Failure::new(ErrorCode::Internal, e.to_string()))
        })
    }

    /// Serves a request addressed to this shard. The synchronous part runs before the
    /// first poll returns, which is what keeps one peer's requests in order.
    pub fn execute(self: Rc<Self>, req: ShardReq) -> LocalFuture<ShardRep> {
        match req {
            ShardReq::Coverage {
                ks,
                pieces,
                candidates,
            } => {
                let cov =
                    self.local_coverage(ks, pieces.iter().map(|(s, c)| (*s, &c[..])), &candidates);
                Box::pin(std::future::ready(ShardRep::Coverage(cov)))
            }
            ShardReq::Blocks(ops) => {
                self.apply_blocks(&ops);
                Box::pin(std::future::ready(ShardRep::Done))
            }
            ShardReq::Roster(entry) => {
                self.install(&entry);
                Box::pin(std::future::ready(ShardRep::Done))
            }
            ShardReq::Forget(worker) => {
                self.forget(worker);
                Box::pin(std::future::ready(ShardRep::Done))
            }
            ShardReq::Announce(req) => self.register(req),
            ShardReq::Retire(worker) => self.retire(worker),
            ShardReq::Feed(req) => self.feed(req),
            ShardReq::Stats => Box::pin(std::future::ready(ShardRep::Stats(self.local_stats()))),
            ShardReq::Export => Box::pin(std::future::ready(ShardRep::Export(self.export()))),
        }
    }

    fn local_coverage<'a>(
        &self,
        ks: u64,
        pieces: impl Iterator<Item = (u32, &'a [u64])>,
        candidates: &[WorkerId],
    ) -> Coverage {
        let state = self.state.borrow();
        let mut cov = Coverage::new();
        cov.reset((!candidates.is_empty()).then_some(candidates));
        let mut visited = 0u64;
        for (start, chain) in pieces {
            visited += chain.len() as u64;
            state.index.coverage(ks, start, chain, &mut cov);
        }
        ShardMetrics::add(&self.metrics().work, visited);
        cov
    }

    fn apply_blocks(&self, ops: &[Blocks]) {
        let mut state = self.state.borrow_mut();
        for op in ops {
            // Ops were validated by the feed that made them; an index refusal is a bug.
            let done = state.index.apply(&op.as_op());
            if let Err(e) = done {
                tracing::error!("block operation refused by the index: {e}");
            }
        }
        ShardMetrics::add(&self.metrics().block_events, ops.len() as u64);
        self.refresh_gauges(&state);
    }

    fn refresh_gauges(&self, state: &State) {
        let m = self.metrics();
        m.blocks.store(state.index.blocks(), Relaxed);
        m.memberships.store(state.index.memberships(), Relaxed);
        m.workers.store(state.roster.len() as u64, Relaxed);
    }

    fn install(&self, entry: &RosterEntry) {
        let mut state = self.state.borrow_mut();
        if entry.reset {
            state.index.drop_worker(entry.id);
        }
        // Replicas announce in shard 0's order, so they assign the same ids (shard 0's
        // own copy answers Unchanged here).
        match state.roster.announce(
            &entry.name,
            &entry.lanes,
            entry.feed,
            self.config.block_size,
        ) {
            Ok((id, _)) if id == entry.id => {}
            Ok((id, _)) => tracing::error!(
                "roster replica gave {:?} id {id}, shard 0 gave {}",
                entry.name,
                entry.id
            ),
            Err(e) => tracing::error!("roster replica refused worker {}: {e}", entry.id),
        }
        if self.home_of(entry.id) == self.me
            && (entry.reset || feed_slot(&mut state.feeds, entry.id).is_none())
        {
            *feed_slot(&mut state.feeds, entry.id) =
                Some(FeedState::new(entry.feed, entry.lanes.len()));
        }
        self.refresh_gauges(&state);
    }

    fn forget(&self, worker: WorkerId) {
        let mut state = self.state.borrow_mut();
        state.index.drop_worker(worker);
        *feed_slot(&mut state.feeds, worker) = None;
        let _ = state.roster.retire(worker);
        self.refresh_gauges(&state);
    }

    /// Sends `req` to every shard (this one included) and waits for all.
    fn broadcast(
        self: &Rc<Self>,
        req: impl Fn() -> ShardReq,
    ) -> impl Future<Output = Result<(), Failure>> {
        let calls: Vec<_> = (0..self.shards).map(|s| self.call(s, req())).collect();
        async move {
            for c in calls {
                c.await?;
            }
            Ok(())
        }
    }

    /// Shard 0: assigns the id, then replicates the entry everywhere before answering.
    fn register(self: Rc<Self>, req: AnnounceReq) -> LocalFuture<ShardRep> {
        // Shard 0 validates and numbers; the broadcast below installs the entry everywhere.
        let outcome = self.state.borrow_mut().roster.announce(
            &req.name,
            &req.lanes,
            req.feed,
            self.config.block_size,
        );
        let (id, outcome) = match outcome {
            Ok(v) => v,
            Err(e) => return failed(ErrorCode::BadLane, e.to_string()),
        };
        let created = outcome != AnnounceOutcome::Unchanged;
        let ingest = crate::ingest::Announcement {
            worker: id,
            name: req.name.clone(),
            lanes: req.lanes.clone(),
            feed: req.feed,
            source: req.source,
            created,
        };
        let entry = RosterEntry {
            id,
            name: req.name,
            lanes: req.lanes,
            feed: req.feed,
            reset: created,
        };
        let done = self.broadcast(move || ShardReq::Roster(entry.clone()));
        Box::pin(async move {
            match done.await {
                Ok(()) => {
                    // Installed everywhere: the ingest may subscribe to its source now.
                    crate::ingest::announced(ingest);
                    ShardRep::Announced(Announced {
                        worker: id,
                        created,
                    })
                }
                Err(f) => ShardRep::Failed(f),
            }
        })
    }

    fn retire(self: Rc<Self>, worker: WorkerId) -> LocalFuture<ShardRep> {
        if self.state.borrow().roster.get(worker).is_none() {
            return failed(
                ErrorCode::UnknownWorker,
                format!("no worker with id {worker}"),
            );
        }
        let done = self.broadcast(move || ShardReq::Forget(worker));
        Box::pin(async move {
            done.await
                .map_or_else(ShardRep::Failed, |()| ShardRep::Done)
        })
    }

    /// Home shard: sequence check and feed bookkeeping, then the block operations go
    /// to the shards owning their segments.
    fn feed(self: Rc<Self>, req: FeedReq) -> LocalFuture<ShardRep> {
        let started = Instant::now();
        let now = self.now_ms();
        let m = self.metrics();
        let mut ops = Vec::new();
        let result = {
            let mut state = self.state.borrow_mut();
            let State { roster, feeds, .. } = &mut *state;
            match &req {
                FeedReq::Events {
                    worker,
                    seq,
                    keyspace,
                    events,
                } => {
                    ShardMetrics::add(&m.batches, 1);
                    let ks = Ks::of(keyspace, self.config.block_size);
                    let (lane_blocks, feed) = match home_feed(roster, feeds, *worker, ks) {
                        Ok(v) => v,
                        Err(e) => return failed(error_code(&e), e.to_string()),
                    };
                    match feed {
                        FeedState::Events(f) => match f.check(lane_blocks, events) {
                            // A batch is applied whole or not at all (its seq not taken either).
                            Err((i, e)) => {
                                return failed(
                                    ErrorCode::BadLane,
                                    format!(
                                    "event {i} of batch {seq} refused, nothing of it applied: {e}"
                                ),
                                )
                            }
                            Ok(()) => {
                                let report =
                                    f.apply(*worker, *seq, ks.seed, lane_blocks, events, &mut ops);
                                Ok(Some((report, *seq)))
                            }
                        },
                        other => Err(wrong_feed(*worker, other, "events")),
                    }
                }
                FeedReq::Place {
                    worker,
                    keyspace,
                    chain,
                } => {
                    ShardMetrics::add(&m.placements, 1);
                    let ks = Ks::of(keyspace, self.config.block_size);
                    home_feed(roster, feeds, *worker, ks).and_then(|(_, feed)| match feed {
                        FeedState::Placements(f) => {
                            f.place(*worker, ks.seed, chain, now, &mut ops);
                            Ok(None)
                        }
                        other => Err(wrong_feed(*worker, other, "placements")),
                    })
                }
            }
        };
        let applied = match result {
            Ok(v) => v,
            Err(e) => return failed(error_code(&e), e.to_string()),
        };
        let applied = applied.map(|(report, seq)| {
            match report.status {
                kvix_wire::ApplyStatus::Duplicate => ShardMetrics::add(&m.batch_duplicates, 1),
                kvix_wire::ApplyStatus::Gap { .. } => ShardMetrics::add(&m.batch_gaps, 1),
                kvix_wire::ApplyStatus::Applied => {}
            }
            debug_assert!(report.rejected.is_empty(), "checked before applying");
            Applied {
                seq,
                status: report.status,
            }
        });
        let done = self.route_blocks(&ops);
        Box::pin(async move {
            let rep = match done.await {
                Err(f) => ShardRep::Failed(f),
                Ok(()) => applied.map_or(ShardRep::Done, ShardRep::Applied),
            };
            self.metrics().applied(started.elapsed());
            rep
        })
    }

    /// Splits block operations by owning shard and applies them there.
    fn route_blocks(
        self: &Rc<Self>,
        ops: &[BlockOp<'_>],
    ) -> impl Future<Output = Result<(), Failure>> {
        let mut per: Vec<Vec<Blocks>> = (0..self.shards).map(|_| Vec::new()).collect();
        for op in ops {
            self.sharding.route(op, |shard, piece| {
                per[shard as usize].push(Blocks::of(piece))
            });
        }
        let calls: Vec<_> = per
            .into_iter()
            .enumerate()
            .filter(|(_, ops)| !ops.is_empty())
            .map(|(s, ops)| self.call(s, ShardReq::Blocks(ops)))
            .collect();
        async move {
            for c in calls {
                c.await?;
            }
            Ok(())
        }
    }

    /// Splits a query's chain into the pieces each shard owns, answers this shard's
    /// piece in place (no copy) and sends the rest.
    pub fn plan_query(self: &Rc<Self>, q: &ArchivedQuery) -> QueryPlan {
        let ks = q.keyspace.seed(self.config.block_size);
        let chain = &u64s(&q.chain)[..q.chain.len().min(u32::MAX as usize)];
        let candidates: Vec<WorkerId> = q.candidates.iter().map(|c| c.to_native()).collect();
        let mut mine: Vec<(u32, &[u64])> = Vec::new();
        let mut theirs: Vec<Vec<(u32, Vec<u64>)>> = (0..self.shards).map(|_| Vec::new()).collect();
        for p in self.sharding.split(ks, 0, chain) {
            if p.shard as usize == self.me {
                mine.push((p.start, p.chain));
            } else {
                theirs[p.shard as usize].push((p.start, p.chain.to_vec()));
            }
        }
        let remote = theirs
            .into_iter()
            .enumerate()
            .filter(|(_, p)| !p.is_empty())
            .map(|(s, pieces)| {
                let mesh = self.mesh.get().expect("mesh joined before serving");
                let fut = mesh.call(
                    s,
                    ShardReq::Coverage {
                        ks,
                        pieces,
                        candidates: candidates.clone(),
                    },
                );
                Box::pin(fut) as LocalFuture<_>
            })
            .collect();
        QueryPlan {
            coverage: vec![self.local_coverage(ks, mine.into_iter(), &candidates)],
            chain_len: chain.len() as u32,
            kind: q.keyspace.kind(),
            candidates,
            top_k: q.top_k.to_native(),
            want_runs: q.want_runs,
            remote,
        }
    }

    /// Scores a planned query: at once when every piece was local, else once the
    /// peers' coverage is in.
    pub fn finish_query(
        self: &Rc<Self>,
        id: u64,
        mut plan: QueryPlan,
        started: Instant,
    ) -> Result<AlignedVec, LocalFuture<AlignedVec>> {
        if plan.remote.is_empty() {
            return Ok(self.score(id, &plan, started));
        }
        let me = self.clone();
        Err(Box::pin(async move {
            for fut in std::mem::take(&mut plan.remote) {
                match fut.await {
                    Ok(ShardRep::Coverage(c)) => plan.coverage.push(c),
                    Ok(other) => tracing::error!("coverage request answered with {other:?}"),
                    Err(e) => tracing::warn!("query fan-out: {e}"),
                }
            }
            me.score(id, &plan, started)
        }))
    }

    fn score(&self, id: u64, plan: &QueryPlan, started: Instant) -> AlignedVec {
        let merged;
        let cov = match &plan.coverage[..] {
            [one] => one,
            parts => {
                merged = merge(parts, &plan.candidates);
                &merged
            }
        };
        let mut answer = kvix_engine::Answer::default();
        {
            let mut state = self.state.borrow_mut();
            let State { roster, ranker, .. } = &mut *state;
            let kind = plan.kind;
            ranker.rank(
                cov,
                plan.chain_len,
                plan.top_k,
                plan.want_runs,
                |w| roster.get(w).and_then(|e| e.rules_in(kind)),
                &mut answer,
            );
        }
        let outcome = if !answer.scores.is_empty() {
            Outcome::Hit
        } else if answer.unscorable > 0 {
            Outcome::Unscorable
        } else {
            Outcome::Empty
        };
        self.metrics().query(outcome, started.elapsed());
        frame(id, &answer.to_wire())
    }

    fn local_stats(&self) -> Stats {
        let state = self.state.borrow();
        let m = self.metrics();
        Stats {
            workers: state.roster.len(),
            blocks: state.index.blocks(),
            memberships: state.index.memberships(),
            queries: m.queries.iter().map(|q| q.load(Relaxed)).sum(),
            events: m.block_events.load(Relaxed),
            shard_load: vec![m.work.load(Relaxed)],
        }
    }

    /// Sums every shard's counters (the roster is replicated: counted once).
    pub async fn gather_stats(self: &Rc<Self>) -> Stats {
        let calls: Vec<_> = (0..self.shards)
            .map(|s| self.call(s, ShardReq::Stats))
            .collect();
        let mut total = Stats::default();
        for c in calls {
            if let Ok(ShardRep::Stats(s)) = c.await {
                total.workers = s.workers;
                total.blocks += s.blocks;
                total.memberships += s.memberships;
                total.queries += s.queries;
                total.events += s.events;
                total.shard_load.extend(s.shard_load);
            }
        }
        total
    }

    fn export(&self) -> ShardImage {
        let state = self.state.borrow();
        let now = self.now_ms();
        ShardImage {
            runs: state.index.export(),
            feeds: state
                .feeds
                .iter()
                .enumerate()
                .filter_map(|(w, f)| f.as_ref().map(|f| (w as WorkerId, f.export(now))))
                .collect(),
        }
    }

    /// Gathers every shard's part into one image (run on shard 0, which owns the roster's ids).
    pub async fn snapshot(self: &Rc<Self>) -> Result<kvix_engine::EngineImage, Failure> {
        let calls: Vec<_> = (0..self.shards)
            .map(|s| self.call(s, ShardReq::Export))
            .collect();
        let mut image = kvix_engine::EngineImage {
            workers: self.state.borrow().roster.export(),
            ..Default::default()
        };
        for c in calls {
            match c.await? {
                ShardRep::Export(part) => {
                    image.runs.extend(part.runs);
                    image.feeds.extend(part.feeds);
                }
                other => {
                    return Err(Failure::new(
                        ErrorCode::Internal,
                        format!("export answered {other:?}"),
                    ))
                }
            }
        }
        image.feeds.sort_unstable_by_key(|(w, _)| *w);
        Ok(image)
    }

    /// Loads this shard's part of a snapshot: the whole roster, the feeds it is home
    /// to, the runs (pieces of runs) it owns. Runs on start, before serving.
    pub fn restore(&self, image: &kvix_engine::EngineImage) -> Result<(), EngineError> {
        let now = self.now_ms();
        let mut state = self.state.borrow_mut();
        let State {
            index,
            roster,
            feeds,
            ..
        } = &mut *state;
        roster.import(&image.workers, self.config.block_size)?;
        for w in roster.iter().filter(|w| self.home_of(w.id) == self.me) {
            *feed_slot(feeds, w.id) = Some(FeedState::new(w.feed, w.lanes.len()));
        }
        for (w, img) in &image.feeds {
            if let Some(Some(f)) = feeds.get_mut(*w as usize) {
                f.import(img, now);
            }
        }
        for run in &image.runs {
            for p in self
                .sharding
                .split(run.ks, run.start, &run.hashes)
                .filter(|p| p.shard as usize == self.me)
            {
                index.import(run.ks, p.start, p.chain, &run.holders)?;
            }
        }
        self.refresh_gauges(&state);
        Ok(())
    }

    /// Drops expired placements of the workers this shard is home to.
    pub fn expire(self: &Rc<Self>) -> impl Future<Output = Result<(), Failure>> {
        let now = self.now_ms();
        let mut ops = Vec::new();
        for (w, feed) in self.state.borrow_mut().feeds.iter_mut().enumerate() {
            if let Some(FeedState::Placements(f)) = feed {
                f.expire(w as WorkerId, now, &mut ops);
            }
        }
        self.route_blocks(&ops)
    }
}

/// Merges shards' coverages in position order (each part's runs are sorted; parts
/// interleave), so the merged runs are appended, never inserted.
fn merge(parts: &[Coverage], candidates: &[WorkerId]) -> Coverage {
    let mut out = Coverage::new();
    out.reset((!candidates.is_empty()).then_some(candidates));
    let mut runs: Vec<kvix_wire::Run> = Vec::new();
    let mut seen: Vec<(WorkerId, u8)> = Vec::new();
    for part in parts {
        for w in part.workers() {
            seen.extend(part.lanes_of(w).map(|(lane, _)| (w, lane)));
        }
    }
    seen.sort_unstable();
    seen.dedup();
    for (w, lane) in seen {
        runs.clear();
        for part in parts {
            runs.extend(part.runs(w, lane));
        }
        runs.sort_unstable_by_key(|r| r.start);
        for r in &runs {
            out.add_run(Holder::new(w, lane), r.start, r.end);
        }
    }
    out
}

fn feed_slot(feeds: &mut Vec<Option<FeedState>>, worker: WorkerId) -> &mut Option<FeedState> {
    if feeds.len() <= worker as usize {
        feeds.resize_with(worker as usize + 1, || None);
    }
    &mut feeds[worker as usize]
}

/// The worker's lane blocks in `ks` and its feed state (this being its home shard).
fn home_feed<'a>(
    roster: &'a Roster,
    feeds: &'a mut [Option<FeedState>],
    worker: WorkerId,
    ks: Ks,
) -> Result<(&'a [u32], &'a mut FeedState), EngineError> {
    let lane_blocks = roster.worker(worker)?.lane_blocks_in(ks.kind)?;
    let feed = feeds
        .get_mut(worker as usize)
        .and_then(Option::as_mut)
        .ok_or(EngineError::UnknownWorker(worker))?;
    Ok((lane_blocks, feed))
}

fn wrong_feed(worker: WorkerId, has: &FeedState, wanted: &'static str) -> EngineError {
    EngineError::WrongFeed {
        worker,
        has: has.kind(),
        wanted,
    }
}

fn error_code(e: &EngineError) -> ErrorCode {
    match e {
        EngineError::UnknownWorker(_) => ErrorCode::UnknownWorker,
        EngineError::LanesInByteKeyspace { .. } => ErrorCode::LanesInByteKeyspace,
        EngineError::Roster(_) | EngineError::WrongFeed { .. } => ErrorCode::BadLane,
        _ => ErrorCode::Internal,
    }
}

fn failed(code: ErrorCode, message: String) -> LocalFuture<ShardRep> {
    Box::pin(std::future::ready(ShardRep::Failed(Failure::new(
        code, message,
    ))))
}
