//! What a query collects: for each (worker, lane) that holds any block of the queried
//! range, its sorted, coalesced runs `[a, b)` of absolute positions.
//!
//! Everything lives in flat vectors reused across queries (no allocation per holder):
//! a dense worker → slot table, then per worker a list of lanes, per lane a list of runs.
//! Walks feed runs in position order, so adding is an append or an extension; runs that
//! arrive out of order (merging shards' coverages) take a slower sorted insert.

use kvix_wire::{Run, WorkerId};

use crate::Holder;

const NIL: u32 = u32::MAX;

#[derive(Clone, Copy)]
struct WorkerCov {
    worker: WorkerId,
    first_lane: u32,
}

#[derive(Clone, Copy)]
struct LaneCov {
    lane: u8,
    next: u32,
    head: u32,
    tail: u32,
}

#[derive(Clone, Copy)]
struct Cell {
    run: Run,
    next: u32,
}

/// Reusable per-query coverage (see the module docs).
#[derive(Default)]
pub struct Coverage {
    workers: Vec<WorkerCov>,
    lanes: Vec<LaneCov>,
    cells: Vec<Cell>,
    /// worker id → index in `workers`, `NIL` when not seen in this query.
    slot: Vec<u32>,
    /// Candidate filter: `allowed[w]` for the workers in `candidates`.
    filtering: bool,
    allowed: Vec<bool>,
    candidates: Vec<WorkerId>,
}

impl Coverage {
    pub fn new() -> Self {
        Self::default()
    }

    /// Empties the coverage for a new query, keeping only `candidates` when given.
    pub fn reset(&mut self, candidates: Option<&[WorkerId]>) {
        for w in &self.workers {
            self.slot[w.worker as usize] = NIL;
        }
        self.workers.clear();
        self.lanes.clear();
        self.cells.clear();
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
    }

    /// Whether `worker` passes the candidate filter.
    pub fn admits(&self, worker: WorkerId) -> bool {
        !self.filtering || self.allowed.get(worker as usize).copied().unwrap_or(false)
    }

    pub fn is_empty(&self) -> bool {
        self.workers.is_empty()
    }

    /// Adds `[a, b)` for every holder of a (sorted, packed) holder set.
    pub(crate) fn add_set(&mut self, holders: &[u32], a: u32, b: u32) {
        for &h in holders {
            let holder = Holder::unpack(h);
            if self.admits(holder.worker) {
                self.push(holder, a, b);
            }
        }
    }

    /// Adds the run `[a, b)` to `holder` (filtered), coalescing with touching runs.
    pub fn add_run(&mut self, holder: Holder, a: u32, b: u32) {
        if a < b && holder.worker < crate::MAX_WORKERS && self.admits(holder.worker) {
            self.push(holder, a, b);
        }
    }

    /// Adds everything `other` holds (another shard's coverage of the same query).
    pub fn absorb(&mut self, other: &Coverage) {
        for w in other.workers() {
            for (lane, runs) in other.lanes_of(w) {
                for r in runs {
                    self.add_run(Holder::new(w, lane), r.start, r.end);
                }
            }
        }
    }

    /// Workers with coverage, in the order they were first seen.
    pub fn workers(&self) -> impl Iterator<Item = WorkerId> + '_ {
        self.workers.iter().map(|w| w.worker)
    }

    /// The covered lanes of `worker` (unordered) with their runs (ascending).
    pub fn lanes_of(&self, worker: WorkerId) -> impl Iterator<Item = (u8, Runs<'_>)> + '_ {
        let first = self
            .slot
            .get(worker as usize)
            .filter(|s| **s != NIL)
            .map_or(NIL, |s| self.workers[*s as usize].first_lane);
        let mut li = first;
        std::iter::from_fn(move || {
            if li == NIL {
                return None;
            }
            let l = self.lanes[li as usize];
            li = l.next;
            Some((
                l.lane,
                Runs {
                    cov: self,
                    cell: l.head,
                },
            ))
        })
    }

    /// The runs of one lane of `worker` (empty when it has none).
    pub fn runs(&self, worker: WorkerId, lane: u8) -> Runs<'_> {
        self.lanes_of(worker)
            .find(|(l, _)| *l == lane)
            .map(|(_, r)| r)
            .unwrap_or(Runs {
                cov: self,
                cell: NIL,
            })
    }

    fn push(&mut self, holder: Holder, a: u32, b: u32) {
        let li = self.lane_index(holder);
        let tail = self.lanes[li].tail;
        if tail == NIL {
            let c = self.new_cell(a, b);
            let l = &mut self.lanes[li];
            l.head = c;
            l.tail = c;
            return;
        }
        let last = &mut self.cells[tail as usize].run;
        if last.end == a {
            last.end = b;
        } else if last.end < a {
            let c = self.new_cell(a, b);
            self.cells[tail as usize].next = c;
            self.lanes[li].tail = c;
        } else {
            self.insert_sorted(li, a, b);
        }
    }

    /// Slow path: rebuilds the lane's list with `[a, b)` merged in.
    fn insert_sorted(&mut self, li: usize, a: u32, b: u32) {
        let mut runs: Vec<Run> = Runs {
            cov: self,
            cell: self.lanes[li].head,
        }
        .collect();
        runs.push(Run { start: a, end: b });
        runs.sort_unstable_by_key(|r| r.start);
        let mut merged: Vec<Run> = Vec::with_capacity(runs.len());
        for r in runs {
            match merged.last_mut() {
                Some(m) if r.start <= m.end => m.end = m.end.max(r.end),
                _ => merged.push(r),
            }
        }
        let mut head = NIL;
        for r in merged.iter().rev() {
            let c = self.new_cell(r.start, r.end);
            self.cells[c as usize].next = head;
            head = c;
        }
        let mut tail = head;
        while self.cells[tail as usize].next != NIL {
            tail = self.cells[tail as usize].next;
        }
        self.lanes[li].head = head;
        self.lanes[li].tail = tail;
    }

    fn new_cell(&mut self, a: u32, b: u32) -> u32 {
        self.cells.push(Cell {
            run: Run { start: a, end: b },
            next: NIL,
        });
        (self.cells.len() - 1) as u32
    }

    fn lane_index(&mut self, holder: Holder) -> usize {
        let w = holder.worker as usize;
        if self.slot.len() <= w {
            self.slot.resize(w + 1, NIL);
        }
        if self.slot[w] == NIL {
            self.slot[w] = self.workers.len() as u32;
            self.workers.push(WorkerCov {
                worker: holder.worker,
                first_lane: NIL,
            });
        }
        let wi = self.slot[w] as usize;
        let mut li = self.workers[wi].first_lane;
        while li != NIL {
            if self.lanes[li as usize].lane == holder.lane {
                return li as usize;
            }
            li = self.lanes[li as usize].next;
        }
        self.lanes.push(LaneCov {
            lane: holder.lane,
            next: self.workers[wi].first_lane,
            head: NIL,
            tail: NIL,
        });
        let li = self.lanes.len() - 1;
        self.workers[wi].first_lane = li as u32;
        li
    }
}

/// Iterator over one lane's runs, ascending.
#[derive(Clone, Copy)]
pub struct Runs<'a> {
    cov: &'a Coverage,
    cell: u32,
}

impl Iterator for Runs<'_> {
    type Item = Run;

    fn next(&mut self) -> Option<Run> {
        if self.cell == NIL {
            return None;
        }
        let c = self.cov.cells[self.cell as usize];
        self.cell = c.next;
        Some(c.run)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn runs(c: &Coverage, w: u32, l: u8) -> Vec<(u32, u32)> {
        c.runs(w, l).map(|r| (r.start, r.end)).collect()
    }

    #[test]
    fn runs_coalesce_in_and_out_of_order() {
        let mut c = Coverage::new();
        c.reset(None);
        let h = Holder::new(3, 1);
        c.add_run(h, 0, 4);
        c.add_run(h, 4, 6);
        c.add_run(h, 8, 9);
        assert_eq!(runs(&c, 3, 1), vec![(0, 6), (8, 9)]);
        c.add_run(h, 6, 8);
        assert_eq!(runs(&c, 3, 1), vec![(0, 9)]);
        c.add_run(Holder::new(3, 0), 2, 3);
        assert_eq!(c.lanes_of(3).count(), 2);
        assert_eq!(runs(&c, 4, 0), vec![]);
        c.reset(Some(&[7]));
        assert!(c.is_empty());
        c.add_run(h, 0, 1);
        c.add_run(Holder::new(7, 0), 0, 1);
        assert_eq!(c.workers().collect::<Vec<_>>(), vec![7]);
        c.reset(None);
        assert!(c.admits(3));
    }

    #[test]
    fn absorb_merges_interleaved_shards() {
        let (mut a, mut b) = (Coverage::new(), Coverage::new());
        a.reset(None);
        b.reset(None);
        let h = Holder::new(1, 0);
        a.add_run(h, 0, 4);
        a.add_run(h, 8, 12);
        b.add_run(h, 4, 8);
        b.add_run(h, 12, 13);
        b.add_run(Holder::new(2, 0), 4, 5);
        a.absorb(&b);
        assert_eq!(runs(&a, 1, 0), vec![(0, 13)]);
        assert_eq!(runs(&a, 2, 0), vec![(4, 5)]);
    }
}
