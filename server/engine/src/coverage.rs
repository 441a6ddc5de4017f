//! The covered runs one query collects for the workers scored by their lane rules: for
//! each (worker, lane, tier) that holds any block of the queried chain, its coalesced
//! runs `[a, b)` of positions, ascending (the walk visits positions in order).
//!
//! Everything lives in flat vectors reused across queries (no allocation per holder):
//! a dense worker → slot table, then per worker a list of lanes, per lane a list of runs.

use kvix_wire::{Run, WorkerId};

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
}

impl Coverage {
    pub fn new() -> Self {
        Self::default()
    }

    /// Empties the coverage for a new query.
    pub fn reset(&mut self) {
        for l in &self.lanes {
            self.holder_slot[l.holder as usize] = NIL;
        }
        for w in &self.workers {
            self.worker_slot[w.worker as usize] = NIL;
        }
        self.workers.clear();
        self.lanes.clear();
        self.cells.clear();
    }

    pub fn is_empty(&self) -> bool {
        self.workers.is_empty()
    }

    /// Workers with coverage, in the order they were first seen.
    pub fn workers(&self) -> impl Iterator<Item = WorkerId> + '_ {
        self.workers.iter().map(|w| w.worker)
    }

    /// The covered holders of `worker` (unordered) as their slots (`tier << 4 | lane`,
    /// [`crate::Holder::slot`]) with their runs (ascending).
    pub fn slots_of(&self, worker: WorkerId) -> impl Iterator<Item = (u8, Runs<'_>)> + '_ {
        let mut li = match self.worker_slot.get(worker as usize) {
            Some(&wi) if wi != NIL => self.workers[wi as usize].first_lane,
            _ => NIL,
        };
        std::iter::from_fn(move || {
            let l = self.lanes.get(li as usize)?;
            li = l.next_lane;
            Some(((l.holder & 63) as u8, self.lane_runs(l)))
        })
    }

    fn lane_runs(&self, l: &LaneCov) -> Runs<'_> {
        Runs {
            cov: self,
            first: Some(l.first),
            cell: l.more,
        }
    }

    /// Adds `[a, b)` to packed holder `h`; runs arrive in position order.
    pub(crate) fn push(&mut self, h: u32, a: u32, b: u32) {
        if self.holder_slot.len() <= h as usize {
            self.holder_slot
                .resize((h as usize + 1).next_power_of_two(), NIL);
        }
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
        debug_assert!(last.end <= a, "runs arrive in position order");
        if last.end == a {
            last.end = b;
            return;
        }
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
    }

    fn new_lane(&mut self, h: u32, a: u32, b: u32) {
        let w = crate::worker_of(h);
        if self.worker_slot.len() <= w as usize {
            self.worker_slot
                .resize((w as usize + 1).next_power_of_two(), NIL);
        }
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
        c.slots_of(w)
            .filter(|(lane, _)| *lane == l)
            .flat_map(|(_, r)| r.map(|r| (r.start, r.end)))
            .collect()
    }

    #[test]
    fn runs_coalesce_and_reset_forgets() {
        let mut c = Coverage::new();
        let h = 3 << 6 | 1;
        c.push(h, 0, 4);
        c.push(h, 4, 6);
        c.push(h, 8, 9);
        assert_eq!(runs(&c, 3, 1), vec![(0, 6), (8, 9)]);
        c.push(3 << 6, 2, 3);
        // The same lane in the CPU tier is a holder of its own.
        c.push(3 << 6 | 1 << 4 | 1, 0, 2);
        assert_eq!(c.slots_of(3).count(), 3);
        assert_eq!(runs(&c, 3, 1 << 4 | 1), vec![(0, 2)]);
        assert_eq!(runs(&c, 4, 0), vec![]);
        c.reset();
        assert!(c.is_empty());
        assert_eq!(c.slots_of(3).count(), 0);
        c.push(7 << 6, 0, 1);
        assert_eq!(c.workers().collect::<Vec<_>>(), vec![7]);
    }
}
