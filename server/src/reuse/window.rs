//! A window of the last outcomes, a client's or a worker's.

use std::collections::VecDeque;

use super::Outcome;

/// The last outcomes, each with whom it is about (a worker in a client's window, a
/// client in a worker's), and whether they add up to a verdict (kept between reports:
/// raising and clearing have different thresholds).
#[derive(Debug)]
pub(super) struct Window<K> {
    pub(super) last: VecDeque<(K, Outcome)>,
    cap: usize,
    pub(super) bad: bool,
}

impl<K: PartialEq + Clone> Window<K> {
    pub(super) fn new(cap: usize) -> Self {
        Window {
            last: VecDeque::with_capacity(cap),
            cap,
            bad: false,
        }
    }

    pub(super) fn push(&mut self, about: K, o: Outcome) {
        if self.last.len() == self.cap {
            self.last.pop_front();
        }
        self.last.push_back((about, o));
    }

    pub(super) fn full(&self) -> bool {
        self.last.len() == self.cap
    }

    pub(super) fn wrong(&self) -> usize {
        self.last
            .iter()
            .filter(|(_, o)| *o != Outcome::Exact)
            .count()
    }

    /// The most frequent wrong outcome.
    pub(super) fn direction(&self) -> Outcome {
        let count = |x| self.last.iter().filter(|(_, o)| *o == x).count();
        [Outcome::Missed, Outcome::Under, Outcome::Over]
            .into_iter()
            .max_by_key(|&o| count(o))
            .unwrap_or(Outcome::Exact)
    }

    /// Whom the outcomes are about, each with (outcomes, wrong ones).
    pub(super) fn by_whom(&self) -> Vec<(K, usize, usize)> {
        let mut out: Vec<(K, usize, usize)> = Vec::new();
        for (k, o) in &self.last {
            let wrong = usize::from(*o != Outcome::Exact);
            match out.iter_mut().find(|(x, _, _)| x == k) {
                Some(e) => {
                    e.1 += 1;
                    e.2 += wrong;
                }
                None => out.push((k.clone(), 1, wrong)),
            }
        }
        out
    }

    pub(super) fn shown(&self) -> String {
        self.last
            .iter()
            .map(|(_, o)| match o {
                Outcome::Exact => '=',
                Outcome::Over => '+',
                Outcome::Under => '-',
                Outcome::Missed => '0',
            })
            .collect()
    }
}
