//! The load-aware choice a gateway makes from an answer: maximise the reusable prefix
//! (weighed by tier: a block reused from CPU or storage is worth less than one on GPU,
//! [`crate::WorkerScore::reuse`]), penalise load. Each worker scores `reuse − alpha ·
//! load`, the highest wins; ties go to the less loaded worker, then to a per-request
//! pseudo-random order (so that equal workers share the work instead of the lowest one
//! taking it all).
//!
//! With `load` counted in KV blocks (queued prompts' blocks plus decoding ones) and
//! `alpha = 1 / w`, this is Dynamo's KV router cost at temperature 0 (`w` its
//! `overlap_score_weight`, 1 by default): it picks the lowest `w · prefill_blocks +
//! decode_blocks`, and `prefill_blocks = prompt_blocks − blocks`. Counting load in
//! requests instead, `alpha` is how many blocks of reuse one more queued request is
//! worth ([`DEFAULT_ALPHA`]: 1).

use kvix_wire::WorkerId;

use crate::types::QueryOutcome;

/// How many blocks of reuse one unit of load costs, by default (Dynamo's default
/// overlap weight, load in blocks).
pub const DEFAULT_ALPHA: f64 = 1.0;

/// The chosen worker: its index among the workers given, and the reuse it was chosen
/// for (the expected hit, 0 when none holds any of the prompt).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Picked {
    /// Index into the workers given.
    pub index: usize,
    /// Reusable prefix weighed by tier, in GPU keyspace blocks ([`crate::WorkerScore::reuse`]).
    pub reuse: f64,
}

/// Picks among `workers` (name, load) for a query's `outcome`; `tie` seeds the order of
/// workers equal on score and load (a request counter, a random number). Workers the
/// answer does not score reuse nothing; an outcome without scores (empty, failed open)
/// picks by load alone. `None` only when `workers` is empty.
pub fn pick<N: AsRef<str>>(
    outcome: &QueryOutcome,
    workers: &[(N, f64)],
    alpha: f64,
    tie: u64,
) -> Option<Picked> {
    let scores = match outcome {
        QueryOutcome::Scores(s) => &s[..],
        _ => &[],
    };
    let reuse = |name: &str| {
        scores
            .iter()
            .find(|s| s.name.as_deref() == Some(name))
            .map_or(0.0, |s| s.expected_reuse())
    };
    let mut best: Option<(Key, Picked)> = None;
    for (index, (name, load)) in workers.iter().enumerate() {
        let r = reuse(name.as_ref());
        let key = Key::new(r, *load, alpha, tie, index);
        if best.as_ref().is_none_or(|(k, _)| key.beats(k)) {
            best = Some((key, Picked { index, reuse: r }));
        }
    }
    best.map(|(_, p)| p)
}

/// [`pick`] over dense worker indices, with per-worker scratch reused across requests:
/// for callers that pick among many workers at a high rate (the bench's simulators).
#[derive(Debug, Clone)]
pub struct Picker {
    overlap: Vec<f64>,
    touched: Vec<usize>,
}

impl Picker {
    /// Scratch for workers `0..workers`.
    pub fn new(workers: usize) -> Self {
        Picker {
            overlap: vec![0.0; workers],
            touched: Vec::new(),
        }
    }

    /// Picks among `load.len()` workers given an answer's `scores` ((worker index,
    /// reuse: blocks, or blocks weighed by tier)); as [`pick`].
    pub fn pick<R: Into<f64>, L: Copy + Into<f64>>(
        &mut self,
        scores: impl IntoIterator<Item = (WorkerId, R)>,
        load: &[L],
        alpha: f64,
        tie: u64,
    ) -> Picked {
        for i in self.touched.drain(..) {
            self.overlap[i] = 0.0;
        }
        for (w, r) in scores {
            let w = w as usize;
            if w < self.overlap.len() {
                self.overlap[w] = r.into();
                self.touched.push(w);
            }
        }
        let mut best: Option<(Key, Picked)> = None;
        for (index, &l) in load.iter().enumerate() {
            let r = self.overlap.get(index).copied().unwrap_or(0.0);
            let key = Key::new(r, l.into(), alpha, tie, index);
            if best.as_ref().is_none_or(|(k, _)| key.beats(k)) {
                best = Some((key, Picked { index, reuse: r }));
            }
        }
        best.map_or(
            Picked {
                index: 0,
                reuse: 0.0,
            },
            |(_, p)| p,
        )
    }
}

/// A worker's standing: score, then load, then the request's order.
struct Key {
    score: f64,
    load: f64,
    order: u64,
}

impl Key {
    fn new(reuse: f64, load: f64, alpha: f64, tie: u64, index: usize) -> Key {
        Key {
            score: reuse - alpha * load,
            load,
            order: mix(tie ^ (index as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)),
        }
    }

    fn beats(&self, other: &Key) -> bool {
        self.score > other.score
            || (self.score == other.score
                && (self.load < other.load
                    || (self.load == other.load && self.order < other.order)))
    }
}

/// splitmix64's finaliser: the tie order of workers for one request.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::WorkerScore;
    use kvix_wire::{Depths, TierWeights};

    fn scores(s: &[(&str, u32)]) -> QueryOutcome {
        QueryOutcome::Scores(
            s.iter()
                .enumerate()
                .map(|(i, (n, b))| WorkerScore::on_gpu(i as u32, Some((*n).into()), *b))
                .collect(),
        )
    }

    #[test]
    fn overlap_beats_small_load_and_load_breaks_ties() {
        let mut p = Picker::new(3);
        assert_eq!(
            p.pick([(1, 10)], &[0u32, 3, 0], 1.0, 7),
            Picked {
                index: 1,
                reuse: 10.0
            }
        );
        // Too loaded: 10 − 12 < 0.
        assert_eq!(p.pick([(1, 10)], &[0u32, 12, 1], 1.0, 7).index, 0);
        // Equal overlap: the less loaded.
        assert_eq!(p.pick([(0, 5), (2, 5)], &[4u32, 0, 2], 0.0, 7).index, 2);
    }

    #[test]
    fn by_name_and_without_scores() {
        let workers = [("a", 0.0), ("b", 2.0), ("c", 1.0)];
        let out = scores(&[("b", 8), ("c", 3)]);
        assert_eq!(
            pick(&out, &workers, 1.0, 1),
            Some(Picked {
                index: 1,
                reuse: 8.0
            })
        );
        // Load weighs more: c (3 − 4·1) vs b (8 − 4·2) vs a (0).
        assert_eq!(
            pick(&out, &workers, 4.0, 1),
            Some(Picked {
                index: 0,
                reuse: 0.0
            })
        );
        // Failed open or empty: the least loaded.
        assert_eq!(
            pick(&QueryOutcome::Timeout, &workers, 1.0, 1).map(|p| p.index),
            Some(0)
        );
        assert_eq!(
            pick(&QueryOutcome::Empty, &[("x", 3.0), ("y", 1.0)], 1.0, 1).map(|p| p.index),
            Some(1)
        );
        assert_eq!(pick::<&str>(&out, &[], 1.0, 1), None);
    }

    #[test]
    fn equal_workers_share_the_work() {
        let workers = [("a", 1.0), ("b", 1.0), ("c", 1.0)];
        let mut n = [0; 3];
        for tie in 0..3000 {
            n[pick(&QueryOutcome::Empty, &workers, 1.0, tie)
                .unwrap()
                .index] += 1;
        }
        assert!(n.iter().all(|&k| k > 800), "{n:?}");
    }

    /// The same choice as Dynamo's cost at temperature 0 (lowest `w · prefill + decode`,
    /// prefill = prompt − overlap) with `alpha = 1 / w`, wherever that lowest is unique.
    #[test]
    fn matches_dynamos_default_cost() {
        let mut z = 0x1234_5678u64;
        let mut next = |n: u64| {
            z = mix(z.wrapping_add(0x9E37_79B9_7F4A_7C15));
            z % n
        };
        for _ in 0..2000 {
            let prompt = 1 + next(64) as u32;
            let k = 1 + next(8) as usize;
            let w = [0.5, 1.0, 2.0][next(3) as usize];
            let names: Vec<String> = (0..k).map(|i| format!("w{i}")).collect();
            let overlap: Vec<u32> = (0..k).map(|_| next(u64::from(prompt) + 1) as u32).collect();
            let decode: Vec<f64> = (0..k).map(|_| next(200) as f64).collect();
            let cost: Vec<f64> = (0..k)
                .map(|i| w * f64::from(prompt - overlap[i]) + decode[i])
                .collect();
            let low = cost.iter().cloned().fold(f64::INFINITY, f64::min);
            if cost.iter().filter(|c| **c == low).count() > 1 {
                continue;
            }
            let want = cost.iter().position(|c| *c == low).unwrap();
            let out = QueryOutcome::Scores(
                (0..k)
                    .filter(|&i| overlap[i] > 0)
                    .map(|i| {
                        WorkerScore::on_gpu(i as u32, Some(names[i].as_str().into()), overlap[i])
                    })
                    .collect(),
            );
            let workers: Vec<(&str, f64)> = names
                .iter()
                .map(String::as_str)
                .zip(decode.iter().copied())
                .collect();
            assert_eq!(
                pick(&out, &workers, 1.0 / w, next(1 << 20)).unwrap().index,
                want
            );
        }
    }

    #[test]
    fn reuse_from_cpu_is_weighed_against_gpu() {
        // a: 8 blocks on GPU; b: 2 on GPU then 10 more from CPU. By blocks b wins; at
        // Dynamo's weights (CPU 0.75) b's 2 + 7.5 beats a's 8; at CPU 0.5 a wins.
        let tiers = |gpu, cpu| Depths {
            gpu,
            cpu,
            storage: cpu,
        };
        let score = |worker, name: &str, d: Depths, w: &TierWeights| WorkerScore {
            tiers: d,
            reuse: d.weighed(w),
            ..WorkerScore::on_gpu(worker, Some(name.into()), d.storage)
        };
        let workers = [("a", 0.0), ("b", 0.0)];
        for (w, want) in [
            (TierWeights::DYNAMO, 1),
            (
                TierWeights {
                    cpu: 0.5,
                    storage: 0.0,
                },
                0,
            ),
        ] {
            let out = QueryOutcome::Scores(vec![
                score(0, "a", tiers(8, 8), &w),
                score(1, "b", tiers(2, 12), &w),
            ]);
            assert_eq!(pick(&out, &workers, 1.0, 3).unwrap().index, want, "{w:?}");
        }
    }
}
