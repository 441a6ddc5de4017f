//! The engine against a naive reference model: random sequences of announce / apply /
//! place / expire / retire / query over mixed rosters, several keyspaces and colliding
//! prefixes, stores and removals in every storage tier. Answers (scores, tier depths,
//! order under tier weights, unscorable, runs) must match, for the single-thread
//! [`Engine`] and for fleets of cores composed the way the server composes its executors
//! (each worker's writes turned into updates on its home core, every core applying every
//! update, in small slices, and every core answering queries on its own).

use std::collections::{BTreeMap, BTreeSet, HashMap};

use kvix_engine::{
    AnnounceOutcome, Answer, ApplyReport, Ask, Core, Cursor, Engine, EngineError, FillIn, Ks,
    Registry, Update,
};
use kvix_wire::{
    chain::token_chain, ApplyStatus, Depths, Event, Feed, Lane, LaneKind, Run, Tier, TierWeights,
    WorkerId,
};
use proptest::prelude::*;

const TB: u32 = 4;

/// How placements fill in for an event-fed worker whose history is lost.
const FILL: FillIn = FillIn {
    capacity_blocks: 9,
    ttl_ms: 45,
};

/// (scores, their tier depths, unscorable, per covered worker its lanes' runs).
type RefAnswer = (
    Vec<(WorkerId, u32)>,
    Vec<Depths>,
    u32,
    Vec<(WorkerId, Vec<Vec<Run>>)>,
);

/// Held memberships: (worker, slot, keyspace, position, hash); a slot is `tier << 4 |
/// lane`.
type Held = BTreeSet<(WorkerId, u8, u64, u32, u64)>;

fn slot(tier: Tier, lane: u8) -> u8 {
    (tier as u8) << 4 | lane
}

/// The weights a query op picks from.
const WEIGHTS: [TierWeights; 4] = [
    TierWeights::JOINT,
    TierWeights::DYNAMO,
    TierWeights {
        cpu: 0.0,
        storage: 0.0,
    },
    TierWeights {
        cpu: 0.8,
        storage: 0.8,
    },
];

struct RefWorker {
    lanes: Vec<Lane>,
    feed: Feed,
    seq: Option<u64>,
    /// (lane, name) → (keyspace, position, chain hashes).
    names: HashMap<(u8, u64), (u64, u32, Vec<u64>)>,
    /// (keyspace, position, hash) → (placement tick, time): a placement feed's blocks,
    /// or an event feed's fill-in.
    placed: HashMap<(u64, u32, u64), (u64, u64)>,
    clock: u64,
    /// An event feed whose history is lost takes placements (`FILL`).
    filling: bool,
}

#[derive(Default)]
struct Reference {
    ids: HashMap<String, WorkerId>,
    workers: BTreeMap<WorkerId, RefWorker>,
    held: Held,
    tick: u64,
}

fn plain(lanes: &[Lane]) -> bool {
    lanes.len() == 1 && lanes[0].kind.is_full()
}

fn valid(lanes: &[Lane], feed: Feed) -> bool {
    !lanes.is_empty()
        && lanes.len() <= 16
        && lanes.iter().all(|l| {
            l.block_tokens > 0
                && l.block_tokens % TB == 0
                && match l.kind {
                    LaneKind::ChunkedLocal { chunk } => chunk > 0 && chunk % TB == 0,
                    LaneKind::SlidingWindow { window } => window > 0,
                    _ => true,
                }
        })
        && (feed == Feed::Events || plain(lanes))
}

/// A lane's engine block in keyspace blocks of this keyspace (bytes: plain workers only, 1).
fn k_of(lane: &Lane, ks: Ks) -> u32 {
    match ks.kind {
        kvix_wire::ChunkKind::Tokens => lane.block_tokens / TB,
        kvix_wire::ChunkKind::Bytes => 1,
    }
}

impl Reference {
    fn drop_worker(&mut self, w: WorkerId) {
        self.held.retain(|m| m.0 != w);
    }

    fn announce(&mut self, name: &str, lanes: &[Lane], feed: Feed) -> Option<WorkerId> {
        if !valid(lanes, feed) {
            return None;
        }
        let next = self.ids.len() as WorkerId;
        let id = *self.ids.entry(name.to_string()).or_insert(next);
        if let Some(w) = self.workers.get(&id) {
            if w.lanes == lanes && w.feed == feed {
                return Some(id);
            }
        }
        self.drop_worker(id);
        self.workers.insert(
            id,
            RefWorker {
                lanes: lanes.to_vec(),
                feed,
                seq: None,
                names: HashMap::new(),
                placed: HashMap::new(),
                clock: 0,
                filling: false,
            },
        );
        Some(id)
    }

    fn retire(&mut self, w: WorkerId) -> bool {
        let known = self.workers.remove(&w).is_some();
        self.drop_worker(w);
        known
    }

    /// None: refused as a whole (any invalid event refuses the batch, and its seq is not
    /// taken). Some((status, block events: blocks stored, or named by removals)).
    fn apply(
        &mut self,
        w: WorkerId,
        seq: u64,
        ks: Ks,
        events: &[Event],
    ) -> Option<(ApplyStatus, u64)> {
        let worker = self.workers.get_mut(&w)?;
        if worker.feed != Feed::Events
            || (ks.kind == kvix_wire::ChunkKind::Bytes && !plain(&worker.lanes))
        {
            return None;
        }
        let valid = |e: &Event| match e {
            Event::Stored {
                lane,
                chain,
                engine,
                ..
            }
            | Event::StoredIn {
                lane,
                chain,
                engine,
                ..
            } => worker.lanes.get(*lane as usize).is_some_and(|l| {
                engine.is_empty() || engine.len() == chain.len().div_ceil(k_of(l, ks) as usize)
            }),
            Event::Removed { lane, .. } | Event::RemovedFrom { lane, .. } => {
                (*lane as usize) < worker.lanes.len()
            }
            Event::Cleared => true,
        };
        if !events.iter().all(valid) {
            return None;
        }
        let status = match worker.seq {
            Some(last) if seq <= last => return Some((ApplyStatus::Duplicate, 0)),
            Some(last) if seq != last + 1 => ApplyStatus::Gap { expected: last + 1 },
            _ => ApplyStatus::Applied,
        };
        worker.seq = Some(seq);
        let mut named = 0;
        for e in events {
            let (tier, e) = match e {
                Event::StoredIn {
                    tier,
                    lane,
                    start,
                    parent,
                    chain,
                    engine,
                } => (
                    Some(*tier),
                    Event::Stored {
                        lane: *lane,
                        start: *start,
                        parent: *parent,
                        chain: chain.clone(),
                        engine: engine.clone(),
                    },
                ),
                Event::RemovedFrom { tier, lane, hashes } => (
                    Some(*tier),
                    Event::Removed {
                        lane: *lane,
                        hashes: hashes.clone(),
                    },
                ),
                e => (None, e.clone()),
            };
            match &e {
                Event::Stored {
                    lane,
                    start,
                    chain,
                    engine,
                    ..
                } => {
                    let tier = tier.unwrap_or(Tier::Gpu);
                    let k = k_of(&worker.lanes[*lane as usize], ks) as usize;
                    for (i, &h) in chain.iter().enumerate() {
                        let at = start + i as u32;
                        self.held.insert((w, slot(tier, *lane), ks.seed, at, h));
                        // The events report it now: the fill-in lets go of it.
                        if *lane == 0 {
                            worker.placed.remove(&(ks.seed, at, h));
                        }
                    }
                    named += chain.len() as u64;
                    for (j, &e) in engine.iter().enumerate() {
                        let group = chain[j * k..((j + 1) * k).min(chain.len())].to_vec();
                        worker
                            .names
                            .insert((*lane, e), (ks.seed, start + (j * k) as u32, group));
                    }
                }
                Event::Removed { lane, hashes } => {
                    // From one tier (the names stay), or from every tier.
                    let tiers: Vec<Tier> = tier.map_or(Tier::ALL.to_vec(), |t| vec![t]);
                    for h in hashes {
                        let found = match tier {
                            Some(_) => worker.names.get(&(*lane, *h)).cloned(),
                            None => worker.names.remove(&(*lane, *h)),
                        };
                        match found {
                            Some((kss, pos, group)) => {
                                named += group.len() as u64;
                                for (i, g) in group.iter().enumerate() {
                                    for &t in &tiers {
                                        let at = pos + i as u32;
                                        self.held.remove(&(w, slot(t, *lane), kss, at, *g));
                                    }
                                }
                            }
                            // Not an engine hash: a chain hash in the batch's keyspace.
                            None => {
                                named += 1;
                                for &t in &tiers {
                                    let key = (w, slot(t, *lane), ks.seed, *h);
                                    self.held.retain(|m| (m.0, m.1, m.2, m.4) != key);
                                }
                            }
                        }
                    }
                }
                Event::Cleared => {
                    worker.names.clear();
                    worker.placed.clear();
                    worker.filling = false;
                    self.held.retain(|m| m.0 != w);
                }
                Event::StoredIn { .. } | Event::RemovedFrom { .. } => unreachable!("mapped"),
            }
        }
        Some((status, named))
    }

    /// An event-fed worker of one full lane takes placements from now on, until its
    /// events clear it.
    fn fill_in(&mut self, w: WorkerId) -> bool {
        let Some(worker) = self.workers.get_mut(&w) else {
            return false;
        };
        worker.filling |= worker.feed == Feed::Events && plain(&worker.lanes);
        worker.filling
    }

    fn place(&mut self, w: WorkerId, ks: Ks, chain: &[u64], now: u64) -> bool {
        let Some(worker) = self.workers.get_mut(&w) else {
            return false;
        };
        let capacity_blocks = match worker.feed {
            Feed::Placements {
                capacity_blocks, ..
            } => capacity_blocks,
            Feed::Events if worker.filling => FILL.capacity_blocks,
            Feed::Events => return false,
        };
        self.tick += 1;
        worker.clock = worker.clock.max(now);
        let n = chain.len().min(capacity_blocks as usize);
        for (pos, &h) in chain[..n].iter().enumerate() {
            let key = (ks.seed, pos as u32, h);
            // A fill-in leaves what the events report to them.
            let events_hold = worker.feed == Feed::Events
                && !worker.placed.contains_key(&key)
                && self.held.contains(&(w, 0, ks.seed, pos as u32, h));
            if !events_hold {
                worker.placed.insert(key, (self.tick, worker.clock));
            }
            self.held.insert((w, 0, ks.seed, pos as u32, h));
        }
        while worker.placed.len() as u64 > capacity_blocks {
            // Oldest placement first, deepest block first within one placement.
            let (&key, _) = worker
                .placed
                .iter()
                .min_by_key(|(key, (tick, _))| (*tick, std::cmp::Reverse(key.1)))
                .unwrap();
            worker.placed.remove(&key);
            self.held.remove(&(w, 0, key.0, key.1, key.2));
        }
        true
    }

    fn expire(&mut self, now: u64) {
        for (&w, worker) in &mut self.workers {
            let ttl_ms = match worker.feed {
                Feed::Placements { ttl_ms, .. } => ttl_ms,
                Feed::Events => FILL.ttl_ms,
            };
            if ttl_ms == 0 {
                continue;
            }
            let gone: Vec<_> = worker
                .placed
                .iter()
                .filter(|(_, (_, t))| now.saturating_sub(*t) > ttl_ms)
                .map(|(k, _)| *k)
                .collect();
            for key in gone {
                worker.placed.remove(&key);
                self.held.remove(&(w, 0, key.0, key.1, key.2));
            }
        }
    }

    /// The §4 rules written directly: every candidate position, every lane, every block;
    /// per tier as docs/design.md defines the depths.
    fn query(
        &self,
        ks: Ks,
        chain: &[u64],
        cands: Option<&[WorkerId]>,
        top_k: u32,
        weights: TierWeights,
    ) -> RefAnswer {
        let n = chain.len() as u32;
        let (mut scored, mut unscorable, mut runs) = (Vec::new(), 0, Vec::new());
        for (&w, worker) in &self.workers {
            if cands.is_some_and(|c| !c.contains(&w)) {
                continue;
            }
            let in_tier = |tier: usize, lane: usize, pos: u32| {
                let s = slot(Tier::ALL[tier], lane as u8);
                self.held
                    .contains(&(w, s, ks.seed, pos, chain[pos as usize]))
            };
            // Held in a tier up to `top`.
            let held_to =
                |top: usize, lane: usize, pos: u32| (0..=top).any(|t| in_tier(t, lane, pos));
            let lanes = worker.lanes.len();
            if !(0..lanes).any(|i| (0..n).any(|p| held_to(2, i, p))) {
                continue;
            }
            let ks_block = TB;
            let ks_of = |l: &Lane| k_of(l, ks);
            let step = worker
                .lanes
                .iter()
                .map(ks_of)
                .fold(1u32, |a, k| a / gcd(a, k) * k);
            // The joint score when lane positions count as held up to tier `top`.
            let best = |top: usize| {
                let held = |lane: usize, pos: u32| held_to(top, lane, pos);
                let all = |lane: usize, a: u32, b: u32| (a..b).all(|p| held(lane, p));
                let covered = |lane: usize| (0..n).any(|p| held(lane, p));
                let accepts = |i: usize, l: &Lane, p: u32| -> bool {
                    if !covered(i) {
                        return p == 0;
                    }
                    let k = ks_of(l);
                    match l.kind {
                        LaneKind::FullAttention | LaneKind::MlaAttention => all(i, 0, p),
                        LaneKind::SlidingWindow { window } => {
                            let m = (window - 1).div_ceil(l.block_tokens).max(1);
                            p == 0 || all(i, p.saturating_sub(m * k), p)
                        }
                        LaneKind::ChunkedLocal { chunk } => {
                            let c = chunk / ks_block;
                            all(i, p / c * c, p)
                        }
                        LaneKind::Mamba => p == 0 || held(i, p - 1),
                    }
                };
                (0..=n)
                    .rev()
                    .filter(|p| p % step == 0)
                    .find(|&p| {
                        worker
                            .lanes
                            .iter()
                            .enumerate()
                            .all(|(i, l)| accepts(i, l, p))
                    })
                    .unwrap_or(0)
            };
            let depths = if lanes == 1 && worker.lanes[0].kind.is_full() {
                // GPU from block 0, then CPU from where GPU stops, then storage.
                let mut p = 0;
                let mut reach = [0u32; 3];
                for (tier, r) in reach.iter_mut().enumerate() {
                    while p < n && in_tier(tier, 0, p) {
                        p += 1;
                    }
                    *r = p / step * step;
                }
                Depths {
                    gpu: reach[0],
                    cpu: reach[1],
                    storage: reach[2],
                }
            } else {
                Depths {
                    gpu: best(0),
                    cpu: best(1),
                    storage: best(2),
                }
            };
            if depths.storage > 0 {
                scored.push((w, depths));
            } else {
                unscorable += 1;
            }
            let lane_runs = (0..lanes)
                .map(|i| {
                    let mut out: Vec<Run> = Vec::new();
                    for p in (0..n).filter(|&p| held_to(2, i, p)) {
                        match out.last_mut() {
                            Some(r) if r.end == p => r.end = p + 1,
                            _ => out.push(Run {
                                start: p,
                                end: p + 1,
                            }),
                        }
                    }
                    out
                })
                .collect();
            runs.push((w, lane_runs));
        }
        // Weighed in 1/65536 GPU blocks, rounded per weight: ties are exact.
        let fixed = |x: f32| (f64::from(x) * 65536.0).round() as u64;
        let value = |d: &Depths| {
            d.gpu as u64 * 65536
                + (d.cpu - d.gpu) as u64 * fixed(weights.cpu)
                + (d.storage - d.cpu) as u64 * fixed(weights.storage)
        };
        scored.sort_by_key(|(w, d)| (std::cmp::Reverse(value(d)), *w));
        if top_k > 0 {
            scored.truncate(top_k as usize);
        }
        let scores = scored.iter().map(|&(w, d)| (w, d.storage)).collect();
        let tiers = scored.iter().map(|&(_, d)| d).collect();
        (scores, tiers, unscorable, runs)
    }
}

fn gcd(a: u32, b: u32) -> u32 {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

fn rosters() -> Vec<Vec<Lane>> {
    let l = |s: &str| Lane::parse(s).unwrap();
    vec![
        vec![l("full_attention@4")],
        vec![l("full_attention@8")],
        vec![l("mla_attention@4")],
        vec![l("full_attention@4"), l("sliding_window:5@4")],
        vec![l("full_attention@8"), l("sliding_window:13@8")],
        vec![l("full_attention@4"), l("sliding_window:1@16")],
        vec![l("full_attention@4"), l("chunked_local:12@4")],
        vec![l("chunked_local:8@8"), l("mamba@8")],
        vec![l("full_attention@4"), l("mamba@8")],
        vec![l("sliding_window:8@4"), l("mamba@4"), l("full_attention@8")],
        vec![l("full_attention@6")], // refused: not a multiple of the keyspace block
        vec![],                      // refused: empty
    ]
}

fn feeds() -> Vec<Feed> {
    vec![
        Feed::Events,
        Feed::Placements {
            capacity_blocks: 12,
            ttl_ms: 0,
        },
        Feed::Placements {
            capacity_blocks: 7,
            ttl_ms: 40,
        },
    ]
}

fn keyspaces() -> Vec<Ks> {
    vec![
        Ks::tokens(0x0000_0001_0000_00aa),
        Ks::tokens(0x0000_0002_0000_00bb),
        Ks::tokens(0x0000_0007_0000_00cc),
        Ks::bytes(0x0000_0005_0000_00dd),
        // More keyspaces than are usually in use at once: a keyspace whose runs all went
        // gives its index to the next new one.
        Ks::tokens(0x0000_0003_0000_00ee),
        Ks::tokens(0x0000_0004_0000_00ff),
    ]
}

/// A prompt from a 3-letter block alphabet, hashed in a keyspace: prefixes collide often.
fn chain_of(ks: Ks, blocks: &[u8]) -> Vec<u64> {
    let tokens: Vec<u32> = blocks
        .iter()
        .flat_map(|&b| [b as u32; TB as usize])
        .collect();
    token_chain(ks.seed, TB, &tokens)
}

#[derive(Debug, Clone)]
enum Op {
    Announce {
        name: u8,
        roster: usize,
        feed: usize,
    },
    Retire {
        name: u8,
    },
    Store {
        name: u8,
        ks: usize,
        prompt: Prompt,
        from: usize,
        lane: u8,
        engine: bool,
        /// How: one event naming its parent, one without, or one batch per engine block
        /// naming its parent (vLLM decode).
        style: Style,
        tier: Tier,
    },
    Remove {
        name: u8,
        lane: u8,
        pick: usize,
        unknown: bool,
        /// From one tier, or (None) every tier.
        tier: Option<Tier>,
    },
    Clear {
        name: u8,
    },
    Seq {
        name: u8,
        delta: i8,
    },
    Place {
        name: u8,
        ks: usize,
        prompt: Prompt,
        dt: u64,
    },
    Expire {
        dt: u64,
    },
    /// The worker's history is lost: placements fill in for it.
    LoseHistory {
        name: u8,
    },
    Query {
        ks: usize,
        prompt: Prompt,
        cands: Option<u8>,
        top_k: u32,
        runs: bool,
        weights: usize,
    },
}

#[derive(Debug, Clone, Copy)]
enum Style {
    Parent,
    Orphan,
    Decode,
}

/// One of the case's pool of prompts, cut to at most `len` blocks.
#[derive(Debug, Clone, Copy)]
struct Prompt {
    pick: usize,
    len: usize,
}

/// Four prompts sharing prefixes of a random base (blocks from a 3-letter alphabet).
fn pool() -> impl Strategy<Value = Vec<Vec<u8>>> {
    let base = prop::collection::vec(0u8..3, 12..24);
    let tails = prop::collection::vec((0usize..24, prop::collection::vec(0u8..3, 0..8)), 4);
    (base, tails).prop_map(|(base, tails)| {
        tails
            .into_iter()
            .map(|(cut, tail)| {
                base[..cut.min(base.len())]
                    .iter()
                    .chain(&tail)
                    .copied()
                    .collect()
            })
            .collect()
    })
}

fn prompt() -> impl Strategy<Value = Prompt> {
    (
        0usize..4,
        prop_oneof![3 => Just(usize::MAX), 1 => 0usize..24],
    )
        .prop_map(|(pick, len)| Prompt { pick, len })
}

fn ks_index() -> impl Strategy<Value = usize> {
    prop_oneof![5 => Just(0usize), 1 => 1..keyspaces().len()]
}

fn style() -> impl Strategy<Value = Style> {
    prop_oneof![
        Just(Style::Parent),
        Just(Style::Orphan),
        Just(Style::Decode)
    ]
}

fn tier() -> impl Strategy<Value = Tier> {
    prop_oneof![4 => Just(Tier::Gpu), 2 => Just(Tier::Cpu), 1 => Just(Tier::Storage)]
}

fn op() -> impl Strategy<Value = Op> {
    let name = 0u8..5;
    let from = prop_oneof![3 => Just(0usize), 2 => 0usize..6, 1 => 0usize..24];
    prop_oneof![
        1 => (name.clone(), 0..rosters().len(), 0..feeds().len()).prop_map(|(name, roster, feed)| Op::Announce { name, roster, feed }),
        1 => name.clone().prop_map(|name| Op::Retire { name }),
        8 => (name.clone(), ks_index(), prompt(), from, 0u8..4, any::<bool>(), style(), tier()).prop_map(|(name, ks, prompt, from, lane, engine, style, tier)| Op::Store { name, ks, prompt, from, lane, engine, style, tier }),
        3 => (name.clone(), 0u8..3, any::<usize>(), prop::bool::weighted(0.1), prop::option::weighted(0.4, tier())).prop_map(|(name, lane, pick, unknown, tier)| Op::Remove { name, lane, pick, unknown, tier }),
        1 => name.clone().prop_map(|name| Op::Clear { name }),
        1 => (name.clone(), -1i8..3).prop_map(|(name, delta)| Op::Seq { name, delta }),
        4 => (name.clone(), ks_index(), prompt(), 0u64..30).prop_map(|(name, ks, prompt, dt)| Op::Place { name, ks, prompt, dt }),
        1 => (0u64..40).prop_map(|dt| Op::Expire { dt }),
        1 => name.clone().prop_map(|name| Op::LoseHistory { name }),
        6 => (ks_index(), prompt(), prop::option::of(any::<u8>()), 0u32..3, any::<bool>(), 0..WEIGHTS.len()).prop_map(|(ks, prompt, cands, top_k, runs, weights)| Op::Query { ks, prompt, cands, top_k, runs, weights }),
    ]
}

/// Every case starts by announcing the five workers (valid rosters, mixed feeds), some
/// of whose history is lost at once (placements fill in for them).
fn opening() -> impl Strategy<Value = Vec<Op>> {
    prop::collection::vec(
        (
            0usize..10,
            prop_oneof![3 => Just(0usize), 1 => 1usize..3],
            prop::bool::weighted(0.4),
        ),
        5,
    )
    .prop_map(|v| {
        v.into_iter()
            .enumerate()
            .flat_map(|(i, (roster, feed, lost))| {
                let name = i as u8;
                let announce = Op::Announce { name, roster, feed };
                std::iter::once(announce).chain(lost.then_some(Op::LoseHistory { name }))
            })
            .collect()
    })
}

/// What the harness drives: the single-thread engine, or a fleet of cores.
trait Subject {
    fn announce(&mut self, name: &str, lanes: &[Lane], feed: Feed)
        -> Result<WorkerId, EngineError>;
    fn retire(&mut self, w: WorkerId) -> Result<(), EngineError>;
    fn apply(
        &mut self,
        w: WorkerId,
        seq: u64,
        ks: Ks,
        events: &[Event],
    ) -> Result<ApplyReport, EngineError>;
    fn place(&mut self, w: WorkerId, ks: Ks, chain: &[u64], now: u64) -> Result<bool, EngineError>;
    fn fill_in(&mut self, w: WorkerId) -> bool;
    fn expire(&mut self, now: u64);
    /// One answer per core.
    fn query(&mut self, ks: Ks, chain: &[u64], ask: &Ask<'_>) -> Vec<Answer>;
    /// Invariants hold; (memberships, blocks) per core.
    fn check(&self) -> Vec<(u64, u64)>;
}

impl Subject for Engine {
    fn announce(
        &mut self,
        name: &str,
        lanes: &[Lane],
        feed: Feed,
    ) -> Result<WorkerId, EngineError> {
        Engine::announce(self, name, lanes, feed).map(|r| r.0)
    }
    fn retire(&mut self, w: WorkerId) -> Result<(), EngineError> {
        Engine::retire(self, w)
    }
    fn apply(
        &mut self,
        w: WorkerId,
        seq: u64,
        ks: Ks,
        events: &[Event],
    ) -> Result<ApplyReport, EngineError> {
        Engine::apply(self, w, seq, ks, events)
    }
    fn place(&mut self, w: WorkerId, ks: Ks, chain: &[u64], now: u64) -> Result<bool, EngineError> {
        Engine::place(self, w, ks, chain, now)
    }
    fn fill_in(&mut self, w: WorkerId) -> bool {
        Engine::fill_in(self, w)
    }
    fn expire(&mut self, now: u64) {
        Engine::expire(self, now).unwrap();
    }
    fn query(&mut self, ks: Ks, chain: &[u64], ask: &Ask<'_>) -> Vec<Answer> {
        vec![Engine::ask(self, ks, chain, ask)]
    }
    fn check(&self) -> Vec<(u64, u64)> {
        self.check_invariants().unwrap();
        let s = self.stats();
        vec![(s.memberships, s.blocks)]
    }
}

/// Cores composed as the server composes its executors: a registry assigns ids, a
/// worker's writes become updates on its home core (id mod cores) in feed steps of
/// `budget` blocks, and every core applies every update in slices of `budget` blocks.
struct Fleet {
    registry: Registry,
    cores: Vec<Core>,
    budget: u64,
}

impl Fleet {
    fn new(cores: usize, budget: u64) -> Self {
        Fleet {
            registry: Registry::new(),
            cores: (0..cores).map(|_| Core::new().with_fill_in(FILL)).collect(),
            budget,
        }
    }

    fn home(&mut self, w: WorkerId) -> &mut Core {
        let n = self.cores.len();
        &mut self.cores[w as usize % n]
    }

    fn write<T>(
        &mut self,
        w: WorkerId,
        f: impl FnOnce(&mut Core, &mut Update) -> Result<T, EngineError>,
    ) -> Result<T, EngineError> {
        let mut u = Update::new();
        let out = f(self.home(w), &mut u)?;
        for core in &mut self.cores {
            let mut cursor = Cursor::default();
            while !cursor.is_finished() {
                core.apply_some(&u, &mut cursor, self.budget).unwrap();
            }
        }
        Ok(out)
    }
}

impl Subject for Fleet {
    fn announce(
        &mut self,
        name: &str,
        lanes: &[Lane],
        feed: Feed,
    ) -> Result<WorkerId, EngineError> {
        let (entry, outcome): (_, AnnounceOutcome) =
            self.registry.register(name, lanes, feed, TB)?;
        let id = entry.id;
        self.write(id, |core, u| {
            core.register(entry, outcome, u);
            Ok(id)
        })
    }
    fn retire(&mut self, w: WorkerId) -> Result<(), EngineError> {
        self.registry.retire(w)?;
        self.write(w, |core, u| core.retire(w, u))
    }
    fn apply(
        &mut self,
        w: WorkerId,
        seq: u64,
        ks: Ks,
        events: &[Event],
    ) -> Result<ApplyReport, EngineError> {
        // The feed step in slices of `budget` blocks, as the server's write queue cuts it.
        let budget = self.budget;
        self.write(w, |core, u| {
            let mut job = core.start_events(w, seq, ks, events, budget)?;
            while !core.events_some(w, ks, events, &mut job, u)? {}
            Ok(job.report)
        })
    }
    fn place(&mut self, w: WorkerId, ks: Ks, chain: &[u64], now: u64) -> Result<bool, EngineError> {
        let budget = self.budget;
        self.write(w, |core, u| {
            let Some(mut job) = core.start_placing(w, ks, chain, now)? else {
                return Ok(false);
            };
            while !core.place_some(w, ks, chain, &mut job, budget, u)? {}
            Ok(true)
        })
    }
    fn fill_in(&mut self, w: WorkerId) -> bool {
        self.home(w).fill_in(w)
    }
    fn expire(&mut self, now: u64) {
        for home in 0..self.cores.len() as u32 {
            self.write(home, |core, u| {
                core.expire(now, u);
                Ok(())
            })
            .unwrap();
        }
    }
    fn query(&mut self, ks: Ks, chain: &[u64], ask: &Ask<'_>) -> Vec<Answer> {
        self.cores
            .iter_mut()
            .map(|core| {
                let mut a = Answer::default();
                core.query_into(ks, chain, ask, &mut a);
                a
            })
            .collect()
    }
    fn check(&self) -> Vec<(u64, u64)> {
        self.cores
            .iter()
            .map(|c| {
                c.index().check_invariants().unwrap();
                (c.index().memberships(), c.index().blocks())
            })
            .collect()
    }
}

struct Harness {
    pool: Vec<Vec<u8>>,
    subjects: Vec<Box<dyn Subject>>,
    reference: Reference,
    /// Per worker: the next seq to send, and the names it stored (for removals).
    next_seq: HashMap<WorkerId, u64>,
    stored: HashMap<WorkerId, Vec<(u8, u64)>>,
    now: u64,
}

impl Harness {
    fn new(pool: Vec<Vec<u8>>) -> Self {
        Harness {
            pool,
            subjects: vec![
                Box::new(Engine::new(TB).with_fill_in(FILL)),
                Box::new(Fleet::new(2, 3)),
                Box::new(Fleet::new(3, 1)),
            ],
            reference: Reference::default(),
            next_seq: HashMap::new(),
            stored: HashMap::new(),
            now: 0,
        }
    }

    fn chain(&self, ks: Ks, p: Prompt) -> Vec<u64> {
        let blocks = &self.pool[p.pick];
        chain_of(ks, &blocks[..p.len.min(blocks.len())])
    }

    fn id(&self, name: u8) -> Option<WorkerId> {
        self.reference.ids.get(&format!("w{name}")).copied()
    }

    fn apply(&mut self, name: u8, ks: Ks, events: Vec<Event>, seq_delta: i64) {
        let Some(w) = self.id(name) else { return };
        let next = self.next_seq.entry(w).or_insert(10);
        let seq = (*next as i64 + seq_delta).max(0) as u64;
        let want = self.reference.apply(w, seq, ks, &events);
        if want.is_some_and(|(s, _)| s != ApplyStatus::Duplicate) {
            *self.next_seq.get_mut(&w).unwrap() = seq + 1;
        }
        for s in &mut self.subjects {
            let got = s
                .apply(w, seq, ks, &events)
                .ok()
                .map(|r| (r.status, r.block_events));
            assert_eq!(got, want, "apply {events:?}");
        }
    }

    fn run(&mut self, op: Op) {
        let (rosters, feeds, kss) = (rosters(), feeds(), keyspaces());
        match op {
            Op::Announce { name, roster, feed } => {
                let want =
                    self.reference
                        .announce(&format!("w{name}"), &rosters[roster], feeds[feed]);
                for s in &mut self.subjects {
                    let got = s
                        .announce(&format!("w{name}"), &rosters[roster], feeds[feed])
                        .ok();
                    assert_eq!(got, want);
                }
                if let Some(w) = want {
                    if self.reference.workers[&w].seq.is_none() {
                        self.stored.remove(&w);
                    }
                }
            }
            Op::Retire { name } => {
                let Some(w) = self.id(name) else { return };
                let want = self.reference.retire(w);
                for s in &mut self.subjects {
                    assert_eq!(s.retire(w).is_ok(), want);
                }
            }
            Op::Store {
                name,
                ks,
                prompt,
                from,
                lane,
                engine,
                style,
                tier,
            } => {
                let ks = kss[ks];
                let chain = self.chain(ks, prompt);
                let from = from.min(chain.len());
                let Some(w) = self.id(name) else { return };
                let k = self
                    .reference
                    .workers
                    .get(&w)
                    .and_then(|r| r.lanes.get(lane as usize))
                    .map_or(1, |l| k_of(l, ks)) as usize;
                let event = |start: usize, end: usize, parent: bool| {
                    let part = chain[start..end].to_vec();
                    let names: Vec<u64> = if engine {
                        part.chunks(k)
                            .map(|g| g[0] ^ 0x5eed ^ (lane as u64) << 40)
                            .collect()
                    } else {
                        part.clone()
                    };
                    let (start, parent) = (
                        start as u32,
                        (parent && start > 0).then(|| chain[start - 1]),
                    );
                    let engine = if engine { names.clone() } else { vec![] };
                    let event = match tier {
                        Tier::Gpu => Event::Stored {
                            lane,
                            start,
                            parent,
                            chain: part,
                            engine,
                        },
                        tier => Event::StoredIn {
                            tier,
                            lane,
                            start,
                            parent,
                            chain: part,
                            engine,
                        },
                    };
                    (event, names)
                };
                let batches: Vec<(Event, Vec<u64>)> = match style {
                    Style::Parent => vec![event(from, chain.len(), true)],
                    Style::Orphan => vec![event(from, chain.len(), false)],
                    Style::Decode => (from..chain.len())
                        .step_by(k)
                        .map(|a| event(a, (a + k).min(chain.len()), true))
                        .collect(),
                };
                for (event, names) in batches {
                    self.stored
                        .entry(w)
                        .or_default()
                        .extend(names.iter().map(|n| (lane, *n)));
                    self.apply(name, ks, vec![event], 0);
                }
            }
            Op::Remove {
                name,
                lane,
                pick,
                unknown,
                tier,
            } => {
                let Some(w) = self.id(name) else { return };
                let names = self.stored.get(&w).cloned().unwrap_or_default();
                let (lane, hashes) = if unknown || names.is_empty() {
                    (lane, vec![0xdead_beef])
                } else {
                    // A few names of one lane, in any order.
                    let (l, _) = names[pick % names.len()];
                    let of_lane: Vec<u64> =
                        names.iter().filter(|n| n.0 == l).map(|n| n.1).collect();
                    let at = pick % of_lane.len();
                    let take = 1 + pick / 7 % 3;
                    (l, of_lane.into_iter().cycle().skip(at).take(take).collect())
                };
                let event = match tier {
                    None => Event::Removed { lane, hashes },
                    Some(tier) => Event::RemovedFrom { tier, lane, hashes },
                };
                self.apply(name, kss[0], vec![event], 0);
            }
            Op::Clear { name } => self.apply(name, kss[1], vec![Event::Cleared], 0),
            Op::Seq { name, delta } => self.apply(name, kss[2], vec![], delta as i64),
            Op::Place {
                name,
                ks,
                prompt,
                dt,
            } => {
                self.now += dt;
                let Some(w) = self.id(name) else { return };
                let ks = kss[ks];
                let chain = self.chain(ks, prompt);
                let want = self.reference.place(w, ks, &chain, self.now);
                for s in &mut self.subjects {
                    assert_eq!(matches!(s.place(w, ks, &chain, self.now), Ok(true)), want);
                }
            }
            Op::LoseHistory { name } => {
                let Some(w) = self.id(name) else { return };
                let want = self.reference.fill_in(w);
                for s in &mut self.subjects {
                    assert_eq!(s.fill_in(w), want);
                }
            }
            Op::Expire { dt } => {
                self.now += dt;
                self.reference.expire(self.now);
                for s in &mut self.subjects {
                    s.expire(self.now);
                }
            }
            Op::Query {
                ks,
                prompt,
                cands,
                top_k,
                runs,
                weights,
            } => {
                let ks = kss[ks];
                let chain = self.chain(ks, prompt);
                let cands: Option<Vec<WorkerId>> =
                    cands.map(|m| (0..8).filter(|i| m >> i & 1 == 1).collect());
                let weights = WEIGHTS[weights];
                let (scores, tiers, unscorable, want_runs) =
                    self.reference
                        .query(ks, &chain, cands.as_deref(), top_k, weights);
                let ask = Ask {
                    candidates: cands.as_deref(),
                    top_k,
                    want_runs: runs,
                    weights,
                };
                for s in &mut self.subjects {
                    for a in s.query(ks, &chain, &ask) {
                        assert_eq!(
                            (&a.scores, &a.tiers, a.unscorable),
                            (&scores, &tiers, unscorable),
                            "query {prompt:?} in {ks:?} weighed {weights:?}"
                        );
                        if runs {
                            let got: Vec<(WorkerId, Vec<Vec<Run>>)> = a
                                .runs
                                .iter()
                                .map(|w| {
                                    (w.worker, w.lanes.iter().map(|l| l.runs.clone()).collect())
                                })
                                .collect();
                            assert_eq!(got, want_runs);
                        }
                    }
                }
            }
        }
        let members = self.reference.held.len() as u64;
        let blocks = self
            .reference
            .held
            .iter()
            .map(|m| (m.2, m.3, m.4))
            .collect::<BTreeSet<_>>()
            .len() as u64;
        for s in &self.subjects {
            for got in s.check() {
                assert_eq!(got, (members, blocks));
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, max_shrink_iters: 4000, ..ProptestConfig::default() })]

    #[test]
    fn engine_and_fleets_match_reference(pool in pool(), opening in opening(), ops in prop::collection::vec(op(), 1..80)) {
        // Block-table rebuilds under way across many writes (a few dozen blocks here).
        kvix_engine::slow_rebuilds();
        let mut h = Harness::new(pool);
        for op in opening.into_iter().chain(ops) {
            h.run(op);
        }
    }
}
