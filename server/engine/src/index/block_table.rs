//! The block table, rebuilt a slice at a time.
//!
//! A table that must grow (or shrink, or shed its tombstones) is rebuilt from the runs,
//! which hold the hashes in order. Done in one go that held one write for 50 ns a block
//! (80–100 ms at 1.8 M blocks), and every executor applies every write, so every query
//! waited. Instead the rebuild starts while the table still has room for 1/32 of its
//! capacity and walks the runs a slice per write: the old table stays whole and
//! answers every lookup; the new one holds the blocks already walked (runs with ids
//! below `cursor`, and the blocks of run `cursor` before position `pos`: one run may
//! hold half a million blocks, more than a slice should walk), and a write that changes
//! the slots of walked blocks changes them there too.
//! When the walk reaches the last run the new table takes over. Should the old one fill
//! up first (a write far larger than the headroom), the rest of the walk is done at once.

use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};

use super::{Node, Slot, NIL};
use crate::hashing::block_hash;
use crate::table::{grown, Table, Unbuilt};

/// Slots of runs walked per block a write stores (or removes): the walk ends after
/// 1/64 of the table's size in stored blocks, well before the headroom is used up.
static STEP: AtomicUsize = AtomicUsize::new(64);
/// A rebuild starts when the table's room falls below its capacity / `HEADROOM`: late,
/// so the table grows at about the load it grew at when rebuilt at once (memory).
static HEADROOM: AtomicUsize = AtomicUsize::new(32);

/// Rebuilds walk one slot per block written and start at half the capacity, so that in
/// tests of a few dozen blocks they are under way across many writes (process-wide).
#[doc(hidden)]
pub fn slow_rebuilds() {
    STEP.store(1, Relaxed);
    HEADROOM.store(2, Relaxed);
}

#[derive(Default)]
pub(super) struct BlockTable {
    /// The whole table: every lookup reads this one.
    table: Table<Slot>,
    rebuild: Option<Rebuild>,
    /// The most slots one write put in a table being rebuilt (for tests).
    pub(super) most_walked: usize,
}

struct Rebuild {
    /// The new table's memory while it is being zeroed (a slice a write, before the
    /// walk starts: zeroing and faulting in tens of MiB at once held a write too).
    unbuilt: Option<Unbuilt<Slot>>,
    table: Table<Slot>,
    /// Runs with ids below this are in `table`,
    cursor: u32,
    /// and the blocks of run `cursor` at positions below this.
    pos: u32,
}

impl Rebuild {
    /// Puts a slot in the new table if its run has been walked; when it has no room left
    /// (writes during the walk outgrew it) the rebuild is dropped, to start over later.
    fn add(rebuild: &mut Option<Rebuild>, hash: u64, slot: Slot) {
        if let Some(t) = Rebuild::walked(rebuild, slot.run, slot.pos) {
            if t.fits(1) {
                t.insert_new(hash, slot);
            } else {
                *rebuild = None;
            }
        }
    }

    /// The new table, when block `pos` of run `run` has been walked.
    fn walked(rebuild: &mut Option<Rebuild>, run: u32, pos: u32) -> Option<&mut Table<Slot>> {
        rebuild
            .as_mut()
            .filter(|r| r.has_walked(run, pos))
            .map(|r| &mut r.table)
    }

    fn has_walked(&self, run: u32, pos: u32) -> bool {
        run < self.cursor || run == self.cursor && pos < self.pos
    }
}

impl BlockTable {
    pub(super) fn len(&self) -> usize {
        self.table.len()
    }

    pub(super) fn table(&self) -> &Table<Slot> {
        &self.table
    }

    /// Adds `slot` unless `eq` accepts one already hashed to `hash` (then true).
    pub(super) fn insert_absent(
        &mut self,
        hash: u64,
        eq: impl FnMut(&Slot) -> bool,
        slot: Slot,
    ) -> bool {
        if self.table.insert_absent(hash, eq, slot).is_some() {
            return true;
        }
        Rebuild::add(&mut self.rebuild, hash, slot);
        false
    }

    /// Removes the slot of block `pos` of run `run`.
    pub(super) fn remove(&mut self, hash: u64, run: u32, pos: u32) {
        self.table.remove(hash, |s| s.run == run && s.pos == pos);
        if let Some(t) = Rebuild::walked(&mut self.rebuild, run, pos) {
            t.remove(hash, |s| s.run == run && s.pos == pos);
        }
    }

    /// Block `pos` moved from run `from` to run `to` (a cut or a merge).
    pub(super) fn move_slot(&mut self, hash: u64, pos: u32, from: u32, to: u32) {
        let is = |s: &Slot| s.run == from && s.pos == pos;
        if let Some(s) = self.table.find_mut(hash, is) {
            s.run = to;
        }
        let Some(r) = &mut self.rebuild else { return };
        match (r.has_walked(from, pos), r.has_walked(to, pos)) {
            (true, true) => {
                if let Some(s) = r.table.find_mut(hash, is) {
                    s.run = to;
                }
            }
            // The walk reaches `to` later and puts the slot in then.
            (true, false) => drop(r.table.remove(hash, is)),
            // The walk passed `to` before the block was in it.
            (false, true) => Rebuild::add(&mut self.rebuild, hash, Slot { run: to, pos }),
            (false, false) => {}
        }
    }

    /// Makes room for `more` slots, and takes a slice of any rebuild under way. A table
    /// with less room than 1/`HEADROOM` of its capacity starts a rebuild; one that cannot
    /// take `more` now finishes it at once.
    pub(super) fn reserve(&mut self, nodes: &[Node], more: usize) {
        let budget = more.max(1) * STEP.load(Relaxed);
        self.step(nodes, budget);
        let (len, cap) = (self.table.len(), self.table.capacity());
        let headroom = cap / HEADROOM.load(Relaxed);
        if self.rebuild.is_none() && !self.table.fits(more + headroom) {
            // Where tombstones took the room, the same size (unless live values fill
            // three quarters); else twice the size, lest the next rebuild follow at once.
            let size = if self.table.deleted() >= headroom {
                grown(len + more, cap)
            } else {
                (cap * 2).max(len + more + headroom)
            };
            self.start(size);
            self.step(nodes, budget);
        }
        if !self.table.fits(more) {
            self.step(nodes, usize::MAX);
            if !self.table.fits(more) {
                let cap = grown(self.table.len() + more, self.table.capacity());
                self.start(cap);
                self.step(nodes, usize::MAX);
            }
        }
    }

    /// After removals: a table left a quarter full is rebuilt at half its size.
    pub(super) fn after_removals(&mut self, nodes: &[Node], removed: usize) {
        self.step(nodes, removed.max(1) * STEP.load(Relaxed));
        if let (None, Some(capacity)) = (&self.rebuild, self.table.shrunk()) {
            self.start(capacity);
        }
    }

    fn start(&mut self, capacity: usize) {
        self.rebuild = Some(Rebuild {
            unbuilt: Some(Unbuilt::new(capacity)),
            table: Table::default(),
            cursor: 0,
            pos: 0,
        });
    }

    /// Zeroes a slice of the new table's memory (64 bytes a slot of `budget`, at least
    /// 64 KiB) or, once it is ready, walks about `budget` slots' worth of runs; swaps
    /// the tables once all are walked.
    fn step(&mut self, nodes: &[Node], budget: usize) {
        let Some(r) = &mut self.rebuild else { return };
        if let Some(u) = &mut r.unbuilt {
            if !u.prepare(budget.saturating_mul(64).max(64 << 10)) {
                return;
            }
            r.table = r.unbuilt.take().expect("being prepared").build();
            if budget != usize::MAX {
                return;
            }
        }
        // The stretch to walk: from the cursor, whole runs, the last perhaps in part.
        let (from, from_pos) = (r.cursor as usize, r.pos);
        let (mut to, mut to_pos, mut slots) = (from, from_pos, 0usize);
        // Free runs count too: a stretch of them is walked past in slices as well.
        let mut walked = 0usize;
        while to < nodes.len() && walked < budget {
            let node = &nodes[to];
            let first = node.first_from(to_pos);
            let take = match node.set {
                NIL => 0,
                _ => (node.hashes.len() - first).min(budget - walked),
            };
            (slots, walked) = (slots + take, walked + take.max(1));
            if node.set != NIL && first + take < node.hashes.len() {
                to_pos = node.start + (first + take) as u32;
                break;
            }
            (to, to_pos) = (to + 1, 0);
        }
        // Its table was sized for the old one's contents and headroom: should writes
        // during the walk outgrow it, the rebuild starts over later.
        if !r.table.fits(slots) {
            self.rebuild = None;
            return;
        }
        self.most_walked = self.most_walked.max(slots);
        let stretch = (from..(to + 1).min(nodes.len())).filter(|&i| nodes[i].set != NIL);
        r.table.extend(stretch.flat_map(|i| {
            let node = &nodes[i];
            let first = if i == from {
                node.first_from(from_pos)
            } else {
                0
            };
            let end = if i == to {
                node.first_from(to_pos)
            } else {
                node.hashes.len()
            };
            let ks = node.ksi() as u64;
            (first..end).map(move |k| {
                let slot = Slot {
                    run: i as u32,
                    pos: node.start + k as u32,
                };
                (block_hash(ks, node.hashes[k]), slot)
            })
        }));
        (r.cursor, r.pos) = (to as u32, to_pos);
        if to == nodes.len() {
            let done = self.rebuild.take().expect("a rebuild under way");
            self.table = done.table;
        }
    }

    /// Checks a rebuild under way against the runs (each walked run's blocks, and no
    /// more, are in the new table); for tests.
    pub(super) fn check(&self, nodes: &[Node]) -> Result<(), String> {
        let Some(r) = &self.rebuild else {
            return Ok(());
        };
        let mut slots = 0;
        for (n, node) in nodes.iter().enumerate().take(r.cursor as usize + 1) {
            if node.set == NIL {
                continue;
            }
            for (i, &h) in node.hashes.iter().enumerate() {
                let pos = node.start + i as u32;
                if !r.has_walked(n as u32, pos) {
                    continue;
                }
                let hash = block_hash(node.ksi() as u64, h);
                if r.table
                    .find(hash, |s| s.run == n as u32 && s.pos == pos)
                    .is_none()
                {
                    return Err(format!("rebuild: block {i} of walked run {n} is missing"));
                }
                slots += 1;
            }
        }
        if slots != r.table.len() {
            return Err(format!(
                "rebuild: {} slots for {slots} blocks of walked runs",
                r.table.len()
            ));
        }
        Ok(())
    }
}
