//! A query: walk the chain through the index once, score every worker that holds part of
//! it, rank them. Scratch is reused across queries, so a warm query allocates nothing.
//!
//! The walk hands over one stretch `[a, b)` per run it passes, with the run's holder
//! set. Plain workers (one full lane of one keyspace block, most of a fleet) are scored
//! in bulk: the plain holders of the run at block 0 are *alive*; at every later stretch
//! the alive list is intersected with the stretch's holders (a merge of two sorted
//! lists), and whoever drops out scores the stretch's start. Drop-outs come in rising
//! score, each group in rising id, so the plain part of the answer needs no sort. Every
//! other worker (hybrid rosters, coarser grids, workers holding blocks in a tier other
//! than GPU, and all workers when runs are asked for) has its per-lane, per-tier runs
//! collected and is scored by its [`Rules`] (see [`crate::score::depths`]).
//!
//! Answers are ranked by reuse weighed by tier ([`TierWeights`]); a plain worker's
//! blocks are all on GPU, so any weights rank plain workers by their score.

use kvix_wire::{ChunkKind, Depths, LaneRuns, Run, TierWeights, WorkerId, WorkerRuns};

use crate::coverage::Coverage;
use crate::index::BlockIndex;
use crate::roster::{Class, Classes, Roster};
use crate::score::{self, Answer, Rules};
use crate::{worker_of, Ks};

/// What a query asks besides its keyspace and chain.
#[derive(Debug, Clone, Copy)]
pub struct Ask<'a> {
    /// Only these workers (`None`: all).
    pub candidates: Option<&'a [WorkerId]>,
    /// At most this many scores, best first; 0: every scoring worker.
    pub top_k: u32,
    /// Also list every covered worker's runs.
    pub want_runs: bool,
    /// How the ranking weighs reuse from CPU and storage against GPU.
    pub weights: TierWeights,
}

impl Ask<'_> {
    /// Every worker, ranked by joint reuse (every tier as good as GPU): a v4 query.
    pub const fn joint() -> Ask<'static> {
        Ask {
            candidates: None,
            top_k: 0,
            want_runs: false,
            weights: TierWeights::JOINT,
        }
    }
}

/// Weights in 1/65536 of a GPU block: ranking keys are integers, so ties are exact.
const UNIT: u64 = 1 << 16;

fn fixed(w: f32) -> u64 {
    (f64::from(w.clamp(0.0, 1.0)) * UNIT as f64).round() as u64
}

/// A ranking value: the weighed depth in 1/65536 GPU blocks.
fn weighed(d: Depths, (cpu, storage): (u64, u64)) -> u64 {
    d.gpu as u64 * UNIT + (d.cpu - d.gpu) as u64 * cpu + (d.storage - d.cpu) as u64 * storage
}

/// Query scratch and the ranking of an answer.
#[derive(Default)]
pub struct Ranker {
    /// Candidate filter: `allowed[w]` for the workers in `candidates`.
    filtering: bool,
    allowed: Vec<bool>,
    candidates: Vec<WorkerId>,
    /// Per worker: the query epoch it was last seen in.
    seen: Vec<u32>,
    epoch: u32,
    /// Plain holders covering `[0, end)`, sorted.
    alive: Vec<u32>,
    /// The plain holders of the run at block 0: they score, whatever they meet later.
    initial: Vec<u32>,
    kept: Vec<u32>,
    end: u32,
    /// Plain workers that dropped out, in drop-out order; `groups` marks where each
    /// score's group ends in `dropped`.
    dropped: Vec<WorkerId>,
    groups: Vec<(u32, usize)>,
    unscorable: u32,
    /// Workers scored by rules, and their runs.
    ruled: Vec<WorkerId>,
    cov: Coverage,
    buf: Vec<Run>,
    spans: Vec<(usize, usize)>,
    /// Ruled workers that scored: (weighed depth, worker, depths), best first once sorted.
    keys: Vec<(u64, WorkerId, Depths)>,
}

/// What the walk needs to know per query.
struct Ctx<'a> {
    roster: &'a Roster,
    classes: Classes<'a>,
    kind: ChunkKind,
    /// Every worker by rules (runs were asked for).
    all_ruled: bool,
}

impl Ranker {
    pub fn new() -> Self {
        Self::default()
    }

    /// Who can reuse how much of `chain` (see [`Answer`] and [`Ask`]).
    pub fn query(
        &mut self,
        index: &BlockIndex,
        roster: &Roster,
        ks: Ks,
        chain: &[u64],
        ask: &Ask<'_>,
        out: &mut Answer,
    ) {
        let chain = &chain[..chain.len().min(u32::MAX as usize)];
        self.reset(ask.candidates);
        let ctx = Ctx {
            roster,
            classes: roster.classes(ks.kind),
            kind: ks.kind,
            all_ruled: ask.want_runs,
        };
        index.walk(ks.seed, chain, |a, b, holders| {
            self.stretch(&ctx, a, b, holders)
        });
        self.drop_alive();
        self.rank(&ctx, chain.len() as u32, ask, out);
    }

    fn reset(&mut self, candidates: Option<&[WorkerId]>) {
        for w in self.candidates.drain(..) {
            self.allowed[w as usize] = false;
        }
        self.filtering = candidates.is_some();
        for &w in candidates.unwrap_or(&[]) {
            if w < crate::MAX_WORKERS {
                if self.allowed.len() <= w as usize {
                    self.allowed.resize(w as usize + 1, false);
                }
                self.allowed[w as usize] = true;
                self.candidates.push(w);
            }
        }
        self.epoch = self.epoch.wrapping_add(1);
        if self.epoch == 0 {
            self.seen.iter_mut().for_each(|s| *s = 0);
            self.epoch = 1;
        }
        self.alive.clear();
        self.initial.clear();
        self.end = 0;
        self.dropped.clear();
        self.groups.clear();
        self.unscorable = 0;
        self.ruled.clear();
        self.cov.reset();
    }

    fn admits(&self, w: WorkerId) -> bool {
        !self.filtering || self.allowed.get(w as usize).copied().unwrap_or(false)
    }

    /// Marks `w` seen in this query; true the first time.
    fn first_sight(&mut self, w: WorkerId) -> bool {
        if self.seen.len() <= w as usize {
            self.seen.resize((w as usize + 1).next_power_of_two(), 0);
        }
        let s = &mut self.seen[w as usize];
        let first = *s != self.epoch;
        *s = self.epoch;
        first
    }

    /// One stretch `[a, b)` of the chain held by `holders` (sorted, packed).
    fn stretch(&mut self, ctx: &Ctx<'_>, a: u32, b: u32, holders: &[u32]) {
        if a == 0 && !ctx.all_ruled {
            // Every holder of the first run: the survivors in a local, sized once.
            let mut alive = std::mem::take(&mut self.alive);
            alive.reserve(holders.len());
            for &h in holders {
                let w = worker_of(h);
                if !self.admits(w) {
                    continue;
                }
                match ctx.classes.of(w) {
                    Class::Skip => {}
                    Class::Plain => alive.push(h),
                    Class::Rules => self.ruled_holds(w, h, a, b),
                }
            }
            self.initial.clear();
            self.initial.extend_from_slice(&alive);
            self.alive = alive;
            self.end = b;
            return;
        }
        if a != self.end {
            self.drop_alive();
        }
        let mut alive = std::mem::take(&mut self.alive);
        let mut kept = std::mem::take(&mut self.kept);
        kept.clear();
        let before = self.dropped.len();
        let mut i = 0;
        for &h in holders {
            while i < alive.len() && alive[i] < h {
                self.dropped.push(worker_of(alive[i]));
                i += 1;
            }
            if i < alive.len() && alive[i] == h {
                kept.push(h);
                i += 1;
                continue;
            }
            let w = worker_of(h);
            if !self.admits(w) {
                continue;
            }
            match ctx.classes.of(w) {
                Class::Skip => {}
                Class::Plain if ctx.all_ruled => self.ruled_holds(w, h, a, b),
                // A plain worker first met past block 0 cannot reuse anything.
                Class::Plain => {
                    if self.initial.binary_search(&h).is_err() && self.first_sight(w) {
                        self.unscorable += 1;
                    }
                }
                Class::Rules => self.ruled_holds(w, h, a, b),
            }
        }
        self.dropped
            .extend(alive[i..].iter().map(|&h| worker_of(h)));
        if self.dropped.len() > before {
            self.groups.push((self.end, self.dropped.len()));
        }
        alive.clear();
        self.alive = kept;
        self.kept = alive;
        if !self.alive.is_empty() {
            self.end = b;
        }
    }

    fn ruled_holds(&mut self, w: WorkerId, h: u32, a: u32, b: u32) {
        if self.first_sight(w) {
            self.ruled.push(w);
        }
        self.cov.push(h, a, b);
    }

    /// Every alive plain worker drops out at `end`.
    fn drop_alive(&mut self) {
        if !self.alive.is_empty() {
            self.dropped.extend(self.alive.drain(..).map(worker_of));
            self.groups.push((self.end, self.dropped.len()));
        }
    }

    fn rank(&mut self, ctx: &Ctx<'_>, n: u32, ask: &Ask<'_>, out: &mut Answer) {
        out.scores.clear();
        out.tiers.clear();
        out.runs.clear();
        out.unscorable = self.unscorable;
        self.keys.clear();
        let weights = (fixed(ask.weights.cpu), fixed(ask.weights.storage));
        for i in 0..self.ruled.len() {
            let w = self.ruled[i];
            let Some(rules) = ctx.roster.get(w).and_then(|e| e.rules_in(ctx.kind)) else {
                continue;
            };
            let runs = ask.want_runs.then_some(&mut out.runs);
            let d = self.score_ruled(w, rules, n, runs);
            if d.storage > 0 {
                self.keys.push((weighed(d, weights), w, d));
            } else {
                out.unscorable += 1;
            }
        }
        // Best first, then lower id.
        self.keys
            .sort_unstable_by_key(|&(v, w, _)| (std::cmp::Reverse(v), w));
        let keep = if ask.top_k == 0 {
            usize::MAX
        } else {
            ask.top_k as usize
        };
        // Merge the plain groups (best group last, ids rising within) with the ruled keys.
        let mut keys = self.keys.iter();
        let mut next_key = keys.next();
        let mut g = self.groups.len();
        let mut plain = self
            .groups
            .last()
            .map_or(0, |_| if g >= 2 { self.groups[g - 2].1 } else { 0 });
        while out.scores.len() < keep {
            let group = (g > 0).then(|| self.groups[g - 1]);
            let from_plain = match (group, next_key) {
                (None, None) => break,
                (Some(_), None) => true,
                (None, Some(_)) => false,
                (Some((s, _)), Some(&(v, kw, _))) => {
                    let sv = s as u64 * UNIT;
                    sv > v || (sv == v && self.dropped[plain] < kw)
                }
            };
            if from_plain {
                let (s, end) = group.expect("a plain group");
                out.scores.push((self.dropped[plain], s));
                out.tiers.push(Depths::gpu_only(s));
                plain += 1;
                if plain == end {
                    g -= 1;
                    plain = if g >= 2 { self.groups[g - 2].1 } else { 0 };
                }
            } else {
                let &(_, w, d) = next_key.expect("a ruled key");
                out.scores.push((w, d.storage));
                out.tiers.push(d);
                next_key = keys.next();
            }
        }
        out.runs.sort_unstable_by_key(|r| r.worker);
    }

    /// Scores a worker by its rules over its collected runs, per tier (and lists its
    /// runs, every tier's joined, when asked).
    fn score_ruled(
        &mut self,
        w: WorkerId,
        rules: &Rules,
        n: u32,
        runs: Option<&mut Vec<WorkerRuns>>,
    ) -> Depths {
        let lanes = rules.rules().len();
        self.buf.clear();
        self.spans.clear();
        self.spans.resize(lanes * 3, (0, 0));
        for (slot, slot_runs) in self.cov.slots_of(w) {
            let (tier, lane) = ((slot >> 4) as usize, (slot & 15) as usize);
            if lane < lanes && tier < 3 {
                let a = self.buf.len();
                self.buf.extend(slot_runs);
                self.spans[tier * lanes + lane] = (a, self.buf.len());
            }
        }
        let (buf, spans) = (&self.buf, &self.spans);
        let held = |tier: usize, lane: usize| {
            let (a, b) = spans[tier * lanes + lane];
            &buf[a..b]
        };
        let d = score::depths(rules, held, n);
        if let Some(runs) = runs {
            runs.push(WorkerRuns {
                worker: w,
                lanes: (0..lanes)
                    .map(|i| LaneRuns {
                        lane: i as u8,
                        runs: score::union(&[held(0, i), held(1, i), held(2, i)]),
                    })
                    .collect(),
            });
        }
        d
    }
}
