//! The cache-aware pick a gateway makes from an index answer: maximise the reusable
//! prefix, penalise load. `score = overlap_blocks − alpha · queue_len`; ties go to the
//! less loaded worker, then to a per-request pseudo-random order (so equal workers share
//! the work instead of the lowest id taking it all).

use kvix_wire::WorkerId;

use crate::rng::mix;

/// Per-worker overlap scratch, reused across requests.
#[derive(Debug, Clone)]
pub struct Picker {
    overlap: Vec<u32>,
    touched: Vec<usize>,
}

impl Picker {
    pub fn new(workers: usize) -> Self {
        Picker {
            overlap: vec![0; workers],
            touched: Vec::new(),
        }
    }

    /// Picks among `load.len()` workers given the index answer `scores`
    /// ((worker, blocks)); `tie` seeds the tie order. Returns (worker index, its overlap).
    pub fn pick(
        &mut self,
        scores: impl IntoIterator<Item = (WorkerId, u32)>,
        load: &[u32],
        alpha: f64,
        tie: u64,
    ) -> (usize, u32) {
        for i in self.touched.drain(..) {
            self.overlap[i] = 0;
        }
        for (w, b) in scores {
            let w = w as usize;
            if w < self.overlap.len() {
                self.overlap[w] = b;
                self.touched.push(w);
            }
        }
        let mut best = 0usize;
        let mut best_key = (f64::NEG_INFINITY, u32::MAX, u64::MAX);
        for (w, &l) in load.iter().enumerate() {
            let s = self.overlap[w] as f64 - alpha * l as f64;
            let key = (
                s,
                l,
                mix(tie ^ (w as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)),
            );
            let better = key.0 > best_key.0
                || (key.0 == best_key.0
                    && (key.1 < best_key.1 || (key.1 == best_key.1 && key.2 < best_key.2)));
            if better {
                best = w;
                best_key = key;
            }
        }
        (best, self.overlap[best])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overlap_beats_small_load_and_load_breaks_ties() {
        let mut p = Picker::new(3);
        assert_eq!(p.pick([(1, 10)], &[0, 3, 0], 1.0, 7), (1, 10));
        // Too loaded: 10 − 12 < 0.
        assert_eq!(p.pick([(1, 10)], &[0, 12, 1], 1.0, 7).0, 0);
        // Equal overlap: the less loaded.
        assert_eq!(p.pick([(0, 5), (2, 5)], &[4, 0, 2], 0.0, 7).0, 2);
    }
}
