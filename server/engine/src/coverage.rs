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

/// One (worker, lane): its first run inline (most holders have exactly one), later runs
/// in a list of cells.
#[derive(Clone, Copy)]
struct LaneCov {
    holder: u32,
    first: Run,
    more: u32,
    last: u32,
    next_lane: u32,
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
    /// Packed holder → index in `lanes`, `NIL` when not seen in this query.
    holder_slot: Vec<u32>,
    /// Worker id → index in `workers`.
    worker_slot: Vec<u32>,
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
        for l in &self.lanes {
            self.holder_slot[l.holder as usize] = NIL;
        }
        for w in &self.workers {
            self.worker_slot[w.worker as usize] = NIL;
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
        if let Some(&max) = holders.last() {
            self.fit(max);
        }
        for &h in holders {
            if self.admits(h >> 4) {
                self.push(h, a, b);
            }
        }
    }

    /// Adds the run `[a, b)` to `holder` (filtered), coalescing with touching runs.
    pub fn add_run(&mut self, holder: Holder, a: u32, b: u32) {
        if let (true, Ok(h)) = (a < b, holder.pack()) {
            if self.admits(holder.worker) {
                self.fit(h);
                self.push(h, a, b);
            }
        }
    }

    /// Adds everything `other` holds (another shard's coverage of the same query).
    pub fn absorb(&mut self, other: &Coverage) {
        for l in &other.lanes {
            let holder = Holder::unpack(l.holder);
            for r in other.lane_runs(l) {
                self.add_run(holder, r.start, r.end);
            }
        }
    }

    /// Workers with coverage, in the order they were first seen.
    pub fn workers(&self) -> impl Iterator<Item = WorkerId> + '_ {
        self.workers.iter().map(|w| w.worker)
    }

    /// The covered lanes of `worker` (unordered) with their runs (ascending).
    pub fn lanes_of(&self, worker: WorkerId) -> impl Iterator<Item = (u8, Runs<'_>)> + '_ {
        let mut li = match self.worker_slot.get(worker as usize) {
            Some(&wi) if wi != NIL => self.workers[wi as usize].first_lane,
            _ => NIL,
        };
        std::iter::from_fn(move || {
            let l = self.lanes.get(li as usize)?;
            li = l.next_lane;
            Some(((l.holder & 15) as u8, self.lane_runs(l)))
        })
    }

    /// The runs of one lane of `worker` (empty when it has none).
    pub fn runs(&self, worker: WorkerId, lane: u8) -> Runs<'_> {
        let slot = Holder::new(worker, lane)
            .pack()
            .ok()
            .and_then(|h| self.holder_slot.get(h as usize))
            .copied()
            .unwrap_or(NIL);
        match self.lanes.get(slot as usize) {
            Some(l) => self.lane_runs(l),
            None => Runs {
                cov: self,
                first: None,
                cell: NIL,
            },
        }
    }

    fn lane_runs(&self, l: &LaneCov) -> Runs<'_> {
        Runs {
            cov: self,
            first: Some(l.first),
            cell: l.more,
        }
    }

    /// Makes the slot tables cover packed holder `h`.
    fn fit(&mut self, h: u32) {
        if self.holder_slot.len() <= h as usize {
            self.holder_slot
                .resize((h as usize + 1).next_power_of_two(), NIL);
        }
        let w = (h >> 4) as usize;
        if self.worker_slot.len() <= w {
            self.worker_slot.resize((w + 1).next_power_of_two(), NIL);
        }
    }

    /// Adds `[a, b)` to packed holder `h` (slots already fit).
    fn push(&mut self, h: u32, a: u32, b: u32) {
        let li = self.holder_slot[h as usize];
        if li == NIL {
            self.new_lane(h, a, b);
            return;
        }
        let l = &mut self.lanes[li as usize];
        let last = match l.last {
            NIL => &mut l.first,
            c => &mut self.cells[c as usize].run,
        };
        if last.end == a {
            last.end = b;
        } else if last.end < a {
            let c = self.cells.len() as u32;
            self.cells.push(Cell {
                run: Run { start: a, end: b },
                next: NIL,
            });
            let l = &mut self.lanes[li as usize];
            match l.last {
                NIL => l.more = c,
                t => self.cells[t as usize].next = c,
            }
            l.last = c;
        } else {
            self.insert_sorted(li as usize, a, b);
        }
    }

    fn new_lane(&mut self, h: u32, a: u32, b: u32) {
        let w = h >> 4;
        let mut wi = self.worker_slot[w as usize];
        if wi == NIL {
            wi = self.workers.len() as u32;
            self.worker_slot[w as usize] = wi;
            self.workers.push(WorkerCov {
                worker: w,
                first_lane: NIL,
            });
        }
        let li = self.lanes.len() as u32;
        let wc = &mut self.workers[wi as usize];
        self.lanes.push(LaneCov {
            holder: h,
            first: Run { start: a, end: b },
            more: NIL,
            last: NIL,
            next_lane: wc.first_lane,
        });
        wc.first_lane = li;
        self.holder_slot[h as usize] = li;
    }

    /// Slow path: rebuilds the lane's runs with `[a, b)` merged in.
    fn insert_sorted(&mut self, li: usize, a: u32, b: u32) {
        let mut runs: Vec<Run> = self.lane_runs(&self.lanes[li]).collect();
        runs.push(Run { start: a, end: b });
        runs.sort_unstable_by_key(|r| r.start);
        let mut merged: Vec<Run> = Vec::with_capacity(runs.len());
        for r in runs {
            match merged.last_mut() {
                Some(m) if r.start <= m.end => m.end = m.end.max(r.end),
                _ => merged.push(r),
            }
        }
        let (mut more, mut last) = (NIL, NIL);
        for r in &merged[1..] {
            let c = self.cells.len() as u32;
            self.cells.push(Cell { run: *r, next: NIL });
            match last {
                NIL => more = c,
                t => self.cells[t as usize].next = c,
            }
            last = c;
        }
        let l = &mut self.lanes[li];
        l.first = merged[0];
        l.more = more;
        l.last = last;
    }
}

/// Iterator over one lane's runs, ascending.
#[derive(Clone, Copy)]
pub struct Runs<'a> {
    cov: &'a Coverage,
    first: Option<Run>,
    cell: u32,
}

impl Iterator for Runs<'_> {
    type Item = Run;

    fn next(&mut self) -> Option<Run> {
        if let Some(r) = self.first.take() {
            return Some(r);
        }
        let c = self.cov.cells.get(self.cell as usize)?;
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
