//! Joint scoring: the reuse rules over a worker's whole lane roster, and the
//! ranking of an answer. Pure functions over covered runs; positions in keyspace blocks.
//!
//! Each lane accepts a set of hit lengths `p` that is a union of intervals (chunked local
//! adds a lattice of chunk boundaries). The score is the largest `p` on the grid of
//! multiples of `step` (the lcm of the lanes' engine blocks) that every lane accepts. It
//! is found by a descending fixpoint: full lanes cap the start (they are monotone),
//! then each other lane lowers `p` to the largest value it accepts, until all agree. Each
//! lane keeps a cursor into its runs that only moves down, so a score costs
//! O(lanes × runs) however long the prompt is.

use smallvec::SmallVec;

use kvix_wire::{Depths, LaneKind, Run, WorkerId, WorkerRuns};

use crate::MAX_LANES;

/// One lane's acceptance rule, in keyspace blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rule {
    /// Full / MLA attention: every block of `[0, p)` is held.
    Full,
    /// Sliding window: the `span` blocks before `p` are held (`span` = m engine blocks,
    /// m = max(1, ceil((W−1)/b))); `p = 0` always.
    Window { span: u32 },
    /// Chunked local attention: `[floor(p / chunk)·chunk, p)` is held.
    Chunk { chunk: u32 },
    /// Mamba: a state is saved exactly at `p`, i.e. block `p − 1` is held (`p = 0` always).
    ///
    /// Checkpoint granularity is pinned here: a stored Mamba engine block marks all of its
    /// keyspace blocks, and since `p` is a multiple of the engine block, the rule reads
    /// only the block ending at `p`; a single-unit mark at `p − 1` scores the same.
    Mamba,
}

impl Rule {
    /// The rule of a lane of `kind` whose engine block is `k` keyspace blocks of
    /// `keyspace_block` tokens (both already validated by the roster).
    pub fn of(kind: LaneKind, block_tokens: u32, k: u32, keyspace_block: u32) -> Rule {
        match kind {
            LaneKind::FullAttention | LaneKind::MlaAttention => Rule::Full,
            LaneKind::SlidingWindow { window } => {
                let m = window.saturating_sub(1).div_ceil(block_tokens).max(1);
                Rule::Window {
                    span: m.saturating_mul(k),
                }
            }
            LaneKind::ChunkedLocal { chunk } => Rule::Chunk {
                chunk: (chunk / keyspace_block).max(1),
            },
            LaneKind::Mamba => Rule::Mamba,
        }
    }

    /// The interval `[lo, hi]` of hit lengths > 0 that the held run `r` makes acceptable.
    fn interval(self, r: Run) -> (u64, u64) {
        let (a, b) = (r.start as u64, r.end as u64);
        let lo = match self {
            Rule::Full if a == 0 => 1,
            Rule::Full => u64::MAX,
            Rule::Window { .. } if a == 0 => 1,
            Rule::Window { span } => a + span as u64,
            Rule::Chunk { chunk } => (a + 1).max(a.div_ceil(chunk as u64) * chunk as u64),
            Rule::Mamba => a + 1,
        };
        (lo, b)
    }
}

/// A worker's lanes as rules, and the grid its hits sit on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rules {
    rules: SmallVec<[Rule; 4]>,
    step: u32,
}

impl Rules {
    /// Rules for lanes with engine blocks of `k[i]` keyspace blocks; `None` when their
    /// lcm does not fit in u32.
    pub fn new(rules: &[Rule], k: &[u32]) -> Option<Rules> {
        let mut step = 1u64;
        for &k in k {
            step = lcm(step, k.max(1) as u64);
            if step > u32::MAX as u64 {
                return None;
            }
        }
        Some(Rules {
            rules: rules.into(),
            step: step as u32,
        })
    }

    /// A single full lane of one block: a plain worker, and every worker in a byte keyspace.
    pub fn plain() -> Rules {
        Rules {
            rules: [Rule::Full].into_iter().collect(),
            step: 1,
        }
    }

    pub fn rules(&self) -> &[Rule] {
        &self.rules
    }

    /// Candidates are multiples of this (lcm of the engine blocks, keyspace blocks).
    pub fn step(&self) -> u32 {
        self.step
    }

    /// The largest hit length `p ≤ n` (a multiple of `step`) every lane accepts, given
    /// each lane's covered runs (`runs[i]` for lane `i`: sorted, disjoint, coalesced).
    /// A lane with no runs accepts only `p = 0`.
    pub fn score(&self, runs: &[&[Run]], n: u32) -> u32 {
        self.score_with(|i| runs.get(i).copied().unwrap_or(&[]), n)
    }

    /// [`Rules::score`] with lane `i`'s runs given by `lane(i)`.
    pub fn score_with<'r>(&self, lane: impl Fn(usize) -> &'r [Run], n: u32) -> u32 {
        let step = self.step as u64;
        let mut p = floor(n as u64, step);
        for (i, r) in self.rules.iter().enumerate() {
            if *r == Rule::Full {
                p = p.min(floor(from_zero(lane(i)) as u64, step));
            }
        }
        let mut cursors = [0usize; MAX_LANES];
        for (i, c) in cursors.iter_mut().enumerate().take(self.rules.len()) {
            *c = lane(i).len();
        }
        loop {
            if p == 0 {
                return 0;
            }
            let mut agreed = true;
            for (i, &rule) in self.rules.iter().enumerate() {
                if rule == Rule::Full {
                    continue;
                }
                let q = best_at_most(rule, lane(i), &mut cursors[i], p, step);
                if q < p {
                    p = q;
                    agreed = false;
                    if p == 0 {
                        return 0;
                    }
                }
            }
            if agreed {
                return p as u32;
            }
        }
    }

    /// One full lane on a grid of single blocks: a plain worker, whose score is its
    /// covered-from-zero prefix (the query's fast path).
    pub fn is_plain(&self) -> bool {
        self.rules.len() == 1 && self.rules[0] == Rule::Full && self.step == 1
    }
}

/// A worker's reusable depth per tier, cumulative (see [`Depths`]), given `held(tier,
/// lane)`: the runs lane `lane` holds in tier `tier` (0 GPU, 1 CPU, 2 storage), each
/// sorted and coalesced.
///
/// A single full lane loads as an engine does (vLLM's offloading connector, Dynamo's
/// and Mooncake's tiered lookup): its GPU prefix from block 0, then the run CPU holds
/// from where GPU stopped, then the run storage holds from where CPU stopped; a GPU
/// block past a CPU gap is not reached. Other rosters (hybrid lanes) take each tier's
/// joint acceptance over what each lane holds in that tier or above, in any order.
pub fn depths<'r>(rules: &Rules, held: impl Fn(usize, usize) -> &'r [Run], n: u32) -> Depths {
    let lanes = rules.rules().len();
    let gpu = rules.score_with(|i| held(0, i), n);
    if (0..lanes).all(|i| held(1, i).is_empty() && held(2, i).is_empty()) {
        return Depths::gpu_only(gpu);
    }
    let step = rules.step() as u64;
    if rules.rules() == [Rule::Full] {
        let at = |p: u32| floor(p.min(n) as u64, step) as u32;
        let g = from_zero(held(0, 0));
        let c = continued(held(1, 0), g);
        let s = continued(held(2, 0), c);
        return Depths {
            gpu: at(g),
            cpu: at(c),
            storage: at(s),
        };
    }
    let cpu_runs: Vec<Vec<Run>> = (0..lanes)
        .map(|i| union(&[held(0, i), held(1, i)]))
        .collect();
    let cpu = rules.score_with(|i| &cpu_runs[i], n).max(gpu);
    let all_runs: Vec<Vec<Run>> = (0..lanes)
        .map(|i| union(&[&cpu_runs[i], held(2, i)]))
        .collect();
    let storage = rules.score_with(|i| &all_runs[i], n).max(cpu);
    Depths { gpu, cpu, storage }
}

/// Where the run of `runs` holding position `p` ends (`p` when none holds it).
fn continued(runs: &[Run], p: u32) -> u32 {
    runs.iter()
        .find(|r| r.start <= p && p < r.end)
        .map_or(p, |r| r.end)
}

/// The runs held in any of `lists` (each sorted), sorted and coalesced.
pub fn union(lists: &[&[Run]]) -> Vec<Run> {
    let mut all: Vec<Run> = lists.iter().flat_map(|l| l.iter().copied()).collect();
    all.sort_unstable_by_key(|r| r.start);
    let mut out: Vec<Run> = Vec::with_capacity(all.len());
    for r in all {
        match out.last_mut() {
            Some(last) if r.start <= last.end => last.end = last.end.max(r.end),
            _ => out.push(r),
        }
    }
    out
}

/// How far a lane's runs cover the chain from block 0.
fn from_zero(runs: &[Run]) -> u32 {
    runs.first().filter(|r| r.start == 0).map_or(0, |r| r.end)
}

/// The largest grid point `≤ p` that `rule` accepts over `runs`. `cursor` indexes one past
/// the last run still worth looking at; it only moves down as `p` does.
fn best_at_most(rule: Rule, runs: &[Run], cursor: &mut usize, p: u64, step: u64) -> u64 {
    if runs.is_empty() {
        return 0;
    }
    // Chunk boundaries need no held block (the range before them is empty).
    let lattice = match rule {
        Rule::Chunk { chunk } => floor(p, lcm(chunk as u64, step)),
        _ => 0,
    };
    while *cursor > 0 {
        let (lo, hi) = rule.interval(runs[*cursor - 1]);
        if lo <= p {
            let x = floor(p.min(hi), step);
            if x >= lo {
                return x.max(lattice);
            }
        }
        // Nothing at or below `p` in this run now, so nothing for any later, lower `p`.
        *cursor -= 1;
    }
    lattice
}

pub(crate) fn floor(x: u64, step: u64) -> u64 {
    // Most rosters have step 1: skip the division (it dominated plain-worker scoring).
    if step == 1 {
        x
    } else {
        x / step * step
    }
}

fn gcd(mut a: u64, mut b: u64) -> u64 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

fn lcm(a: u64, b: u64) -> u64 {
    a / gcd(a, b) * b
}

/// A query's answer: workers best first, the unscorable count, optional per-lane runs.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Answer {
    /// (worker, joint reusable blocks: its storage depth, reuse from any tier), depth >
    /// 0, best first by the query's tier weights, ties by lower id.
    pub scores: Vec<(WorkerId, u32)>,
    /// Each score's depths per tier, in the order of `scores`.
    pub tiers: Vec<Depths>,
    /// Workers that hold some of the chain on some lane yet score 0.
    pub unscorable: u32,
    /// When asked for: every covered worker (by id), every lane of its roster.
    pub runs: Vec<WorkerRuns>,
    /// The scored workers whose history is lost, ascending (the caller fills it: the
    /// index does not know; see `kvix_wire::Answer::history_lost`).
    pub history_lost: Vec<WorkerId>,
    /// The scored workers under a reuse verdict, ascending, with its cause (the caller
    /// fills it: the verdicts are the server's).
    pub suspect: Vec<(WorkerId, kvix_wire::SuspectCause)>,
    /// The roster's [`crate::Roster::reissued`] count (the caller fills it).
    pub reissued: u32,
}

impl Answer {
    /// The v4 wire form of this answer: one joint figure per worker.
    pub fn to_wire(&self) -> kvix_wire::Answer {
        kvix_wire::Answer {
            scores: self
                .scores
                .iter()
                .map(|&(worker, blocks)| kvix_wire::Score { worker, blocks })
                .collect(),
            unscorable: self.unscorable,
            runs: self.runs.clone(),
            history_lost: self.history_lost.clone(),
            reissued: self.reissued,
        }
    }

    /// The v5 wire form: every score with its tiers.
    pub fn to_tiered(&self) -> kvix_wire::TieredAnswer {
        kvix_wire::TieredAnswer {
            scores: self
                .scores
                .iter()
                .zip(&self.tiers)
                .map(|(&(worker, _), &tiers)| kvix_wire::TieredScore {
                    worker,
                    tiers,
                    suspect: self
                        .suspect
                        .binary_search_by_key(&worker, |&(w, _)| w)
                        .ok()
                        .map(|i| self.suspect[i].1),
                })
                .collect(),
            unscorable: self.unscorable,
            runs: self.runs.clone(),
            history_lost: self.history_lost.clone(),
            reissued: self.reissued,
            stale: false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn r(a: u32, b: u32) -> Run {
        Run { start: a, end: b }
    }

    #[test]
    fn fixpoint_agrees_with_brute_force_on_small_cases() {
        // Brute force over all p for a mixed roster and every run layout of 12 blocks.
        let rules = Rules::new(
            &[
                Rule::Full,
                Rule::Window { span: 2 },
                Rule::Chunk { chunk: 3 },
                Rule::Mamba,
            ],
            &[1, 1, 1, 1],
        )
        .unwrap();
        let masks: Vec<u32> = (0..1u32 << 12).step_by(37).collect();
        for &m0 in &masks {
            for &m1 in masks.iter().step_by(7) {
                let held = |m: u32| -> Vec<Run> {
                    let mut out: Vec<Run> = Vec::new();
                    for i in 0..12 {
                        if m >> i & 1 == 1 {
                            match out.last_mut() {
                                Some(l) if l.end == i => l.end = i + 1,
                                _ => out.push(r(i, i + 1)),
                            }
                        }
                    }
                    out
                };
                let lanes = [held(0xfff), held(m0), held(m1), held(m0 | m1)];
                let refs: Vec<&[Run]> = lanes.iter().map(|v| v.as_slice()).collect();
                assert_eq!(from_zero(refs[0]), 12);
                let has = |l: usize, i: u32| lanes[l].iter().any(|r| r.start <= i && i < r.end);
                let ok = |p: u32| {
                    let w = (p.saturating_sub(2)..p).all(|i| has(1, i));
                    let c = (p / 3 * 3..p).all(|i| has(2, i)) && !lanes[2].is_empty();
                    let m = has(3, p - 1);
                    w && c && m
                };
                let want = (1..=12).rev().find(|&p| ok(p)).unwrap_or(0);
                assert_eq!(rules.score(&refs, 12), want, "{m0:#x} {m1:#x}");
            }
        }
    }

    #[test]
    fn window_span_counts_engine_blocks() {
        // W = 4096 tokens, b = 64-token engine blocks of 4 keyspace blocks of 16 tokens:
        // m = ceil(4095 / 64) = 64 engine blocks = 256 keyspace blocks.
        let w = LaneKind::SlidingWindow { window: 4096 };
        assert_eq!(Rule::of(w, 64, 4, 16), Rule::Window { span: 256 });
        // A window of one token still needs one engine block.
        let w1 = LaneKind::SlidingWindow { window: 1 };
        assert_eq!(Rule::of(w1, 64, 4, 16), Rule::Window { span: 4 });
        assert_eq!(
            Rule::of(LaneKind::ChunkedLocal { chunk: 64 }, 16, 1, 16),
            Rule::Chunk { chunk: 4 }
        );
        assert!(Rules::new(&[Rule::Full, Rule::Full], &[u32::MAX, u32::MAX - 1]).is_none());
    }

    #[test]
    fn a_full_lane_loads_gpu_then_cpu_then_storage() {
        let plain = Rules::plain();
        let tiers = |g: Vec<Run>, c: Vec<Run>, s: Vec<Run>, n| {
            let held = [g, c, s];
            depths(&plain, |t, _| &held[t][..], n)
        };
        let d = |gpu, cpu, storage| Depths { gpu, cpu, storage };
        assert_eq!(tiers(vec![r(0, 4)], vec![], vec![], 9), d(4, 4, 4));
        // CPU continues where GPU stops, storage where CPU stops.
        assert_eq!(
            tiers(vec![r(0, 2)], vec![r(0, 5)], vec![r(4, 8)], 9),
            d(2, 5, 8)
        );
        // Nothing on GPU: CPU from block 0.
        assert_eq!(tiers(vec![], vec![r(0, 3)], vec![], 9), d(0, 3, 3));
        // A GPU block past a CPU gap is not reached; a CPU run not reaching the GPU
        // prefix's end adds nothing.
        assert_eq!(
            tiers(vec![r(0, 2), r(3, 6)], vec![r(2, 3)], vec![], 9),
            d(2, 3, 3)
        );
        assert_eq!(tiers(vec![r(0, 2)], vec![r(3, 6)], vec![], 9), d(2, 2, 2));
        // Capped at the prompt.
        assert_eq!(tiers(vec![r(0, 2)], vec![r(0, 20)], vec![], 9), d(2, 9, 9));
    }

    #[test]
    fn hybrid_tiers_take_each_tiers_joint_acceptance() {
        // A full lane and a window of 2 blocks: GPU holds the full lane to 6 but the
        // window only at 2..4; CPU holds the window at 4..6.
        let rules = Rules::new(&[Rule::Full, Rule::Window { span: 2 }], &[1, 1]).unwrap();
        let held = [
            [vec![r(0, 6)], vec![r(2, 4)]],
            [vec![], vec![r(4, 6)]],
            [vec![], vec![]],
        ];
        let d = depths(&rules, |t, l| &held[t][l][..], 6);
        assert_eq!((d.gpu, d.cpu, d.storage), (4, 6, 6));
        assert_eq!(
            union(&[&[r(0, 2), r(5, 6)], &[r(1, 3)], &[r(3, 4)]]),
            vec![r(0, 4), r(5, 6)]
        );
    }
}
