//! The approximate feed: gateways' placements. Each placed block keeps its place in a
//! recency list; past the capacity the oldest-used blocks are cut first.
//!
//! A placement refreshes every block of its chain at once. Within one placement the
//! deepest block counts as the oldest, so cuts eat chains from their ends and a held
//! prefix stays contiguous. The list and its map hold at most `capacity + chain length`
//! entries at any time, so memory is bounded by the capacity.

use hashbrown::hash_table::Entry;
use hashbrown::HashTable;
use kvix_wire::WorkerId;

use crate::hashing::block_hash;
use crate::interner::Interner;
use crate::ops::OpBatch;
use crate::Holder;

const NIL: u32 = u32::MAX;

/// A placed block: 32 bytes, plus a 4-byte table slot naming it.
#[derive(Debug, Clone, Copy)]
struct Slot {
    hash: u64,
    /// Placement clock (ms) when last placed.
    time: u64,
    pos: u32,
    /// Index into the feed's keyspaces.
    ks: u32,
    /// Towards the least recently used end.
    older: u32,
    /// Towards the most recently used end.
    newer: u32,
}

impl Slot {
    /// Whether this slot keeps block (`ksi`, `pos`, `hash`).
    fn is(&self, ksi: u32, pos: u32, hash: u64) -> bool {
        (self.ks, self.pos, self.hash) == (ksi, pos, hash)
    }
}

fn slot_hash(slots: &[Slot], s: u32) -> u64 {
    let slot = &slots[s as usize];
    block_hash(slot.ks as u64, slot.hash)
}

/// A placement under way (see [`PlacementFeed::start`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Placing {
    n: usize,
    step: Step,
    at: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Step {
    Refresh,
    Link,
    Cut,
}

/// Placement-feed state of one worker.
#[derive(Debug)]
pub struct PlacementFeed {
    capacity: u64,
    ttl_ms: u64,
    slots: Vec<Slot>,
    free: Vec<u32>,
    /// Slot ids, hashed from the slot's block.
    map: HashTable<u32>,
    keyspaces: Interner<u64>,
    oldest: u32,
    newest: u32,
    len: u64,
    /// The largest `now_ms` seen: stamps stay monotone along the list even if callers'
    /// clocks are not, so expiry can stop at the first live block.
    clock: u64,
    scratch: Vec<u32>,
}

impl PlacementFeed {
    pub fn new(capacity_blocks: u64, ttl_ms: u64) -> Self {
        PlacementFeed {
            capacity: capacity_blocks,
            ttl_ms,
            slots: Vec::new(),
            free: Vec::new(),
            map: HashTable::new(),
            keyspaces: Interner::default(),
            oldest: NIL,
            newest: NIL,
            len: 0,
            clock: 0,
            scratch: Vec::new(),
        }
    }

    /// Blocks currently placed.
    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// `worker` (lane 0) now holds blocks `[0, len)` of `chain`; appends the insert and any
    /// capacity cuts to `out`.
    pub fn place(
        &mut self,
        worker: WorkerId,
        ks: u64,
        chain: &[u64],
        now_ms: u64,
        out: &mut OpBatch,
    ) {
        let mut job = self.start(chain.len(), now_ms);
        while !self.place_some(worker, ks, chain, &mut job, u64::MAX, |_, _| false, out) {}
    }

    /// Starts placing a chain of `len` blocks at `now_ms`, to be done by
    /// [`PlacementFeed::place_some`] in slices (nothing else may touch this feed between).
    pub fn start(&mut self, len: usize, now_ms: u64) -> Placing {
        self.clock = self.clock.max(now_ms);
        self.scratch.clear();
        Placing {
            // Blocks past the capacity would be cut right away (they are the newest, but
            // the deepest, and everything older goes first), so they are never placed.
            n: len.min(self.capacity.min(u32::MAX as u64) as usize),
            step: Step::Refresh,
            at: 0,
        }
    }

    /// Does about `budget` blocks of the placement `job` of `chain`; true once it is done.
    /// Beside another feed of the same worker (a fill-in), a block this feed does not
    /// hold yet and `held(pos, hash)` says the worker holds already (the other feed
    /// reported it) is left to the other feed, so this one's cuts never take away what
    /// the other reported; alone, `held` says false.
    #[allow(clippy::too_many_arguments)]
    pub fn place_some(
        &mut self,
        worker: WorkerId,
        ks: u64,
        chain: &[u64],
        job: &mut Placing,
        budget: u64,
        held: impl Fn(u32, u64) -> bool,
        out: &mut OpBatch,
    ) -> bool {
        let mut left = budget;
        let ksi = self.keyspaces.intern(&ks);
        while left > 0 {
            left -= 1;
            match job.step {
                // Every block of the chain: found or made, and taken out of the list.
                Step::Refresh if job.at < job.n => {
                    let (pos, hash) = (job.at as u32, chain[job.at]);
                    job.at += 1;
                    let Some(s) = self.slot_of(ksi, pos, hash, || held(pos, hash)) else {
                        continue;
                    };
                    self.unlink(s);
                    self.scratch.push(s);
                }
                Step::Refresh => job.step = Step::Link,
                // Deepest first, so the chain's root ends up the most recent of this
                // placement.
                Step::Link if !self.scratch.is_empty() => {
                    let s = self.scratch.pop().expect("not empty");
                    self.slots[s as usize].time = self.clock;
                    self.push_newest(s);
                }
                Step::Link => {
                    out.insert(ks, Holder::new(worker, 0), 0, None, &chain[..job.n]);
                    job.step = Step::Cut;
                }
                Step::Cut if self.len > self.capacity => self.cut_oldest(worker, out),
                Step::Cut => {
                    self.scratch.clear();
                    return true;
                }
            }
        }
        false
    }

    /// The slot of block (`ksi`, `pos`, `hash`), if this feed holds it.
    fn find(&self, ksi: u32, pos: u32, hash: u64) -> Option<u32> {
        let slots = &self.slots;
        self.map
            .find(block_hash(ksi as u64, hash), |&s| {
                slots[s as usize].is(ksi, pos, hash)
            })
            .copied()
    }

    /// Lets go of blocks `start..` of `chain` in keyspace `ks` without cutting them: the
    /// worker's other feed reports them now, and this one must not take them away.
    pub fn let_go(&mut self, ks: u64, start: u32, chain: &[u64]) {
        let Some(ksi) = self.keyspaces.get(&ks) else {
            return;
        };
        for (pos, &hash) in (start..).zip(chain) {
            if let Some(s) = self.find(ksi, pos, hash) {
                self.unlink(s);
                self.free_slot(s);
            }
        }
    }

    /// The slot of block (`ksi`, `pos`, `hash`), created (unlinked) when new unless
    /// `held_elsewhere` says the worker's other feed holds it (then None).
    fn slot_of(
        &mut self,
        ksi: u32,
        pos: u32,
        hash: u64,
        held_elsewhere: impl FnOnce() -> bool,
    ) -> Option<u32> {
        let slots = &self.slots;
        let entry = self.map.entry(
            block_hash(ksi as u64, hash),
            |&s| slots[s as usize].is(ksi, pos, hash),
            |&s| slot_hash(slots, s),
        );
        let e = match entry {
            Entry::Occupied(e) => return Some(*e.get()),
            Entry::Vacant(_) if held_elsewhere() => return None,
            Entry::Vacant(e) => e,
        };
        let slot = Slot {
            hash,
            time: 0,
            pos,
            ks: ksi,
            older: NIL,
            newer: NIL,
        };
        // A freed slot is reused only after the table stopped naming it, so the id is
        // free to go in here.
        let s = match self.free.pop() {
            Some(s) => s,
            None => self.slots.len() as u32,
        };
        e.insert(s);
        self.keyspaces.acquire(ksi);
        if s as usize == self.slots.len() {
            self.slots.push(slot);
        } else {
            self.slots[s as usize] = slot;
        }
        self.len += 1;
        Some(s)
    }

    /// The placed blocks, oldest-used first, with their ages at `now_ms`.
    pub fn export(&self, now_ms: u64) -> crate::PlacementFeedImage {
        let mut placed = Vec::with_capacity(self.len as usize);
        let mut s = self.oldest;
        while s != NIL {
            let slot = &self.slots[s as usize];
            placed.push(crate::PlacedImage {
                ks: *self.keyspaces.key(slot.ks),
                pos: slot.pos,
                hash: slot.hash,
                age_ms: now_ms.max(self.clock).saturating_sub(slot.time),
            });
            s = slot.newer;
        }
        crate::PlacementFeedImage { placed }
    }

    /// Restores an exported feed into a fresh one at `now_ms`, keeping the recency order.
    /// The blocks themselves are restored into the index separately (they are runs there).
    pub fn import(&mut self, image: &crate::PlacementFeedImage, now_ms: u64) {
        self.clock = self.clock.max(now_ms);
        // Over capacity (a smaller capacity since): keep the most recently used.
        let skip = image
            .placed
            .len()
            .saturating_sub(self.capacity.min(u32::MAX as u64) as usize);
        for p in &image.placed[skip..] {
            let ksi = self.keyspaces.intern(&p.ks);
            let s = (self.slot_of(ksi, p.pos, p.hash, || false)).expect("made when absent");
            self.unlink(s);
            self.slots[s as usize].time = self.clock.saturating_sub(p.age_ms);
            self.push_newest(s);
        }
    }

    /// Cuts blocks placed more than `ttl_ms` before `now_ms` (none when the TTL is 0).
    pub fn expire(&mut self, worker: WorkerId, now_ms: u64, out: &mut OpBatch) {
        if self.ttl_ms == 0 {
            return;
        }
        while self.oldest != NIL
            && now_ms.saturating_sub(self.slots[self.oldest as usize].time) > self.ttl_ms
        {
            self.cut_oldest(worker, out);
        }
    }

    fn cut_oldest(&mut self, worker: WorkerId, out: &mut OpBatch) {
        let s = self.oldest;
        if s == NIL {
            return;
        }
        self.unlink(s);
        let (ks, hash) = self.free_slot(s);
        out.remove(ks, Holder::new(worker, 0), &[hash]);
    }

    /// Forgets unlinked slot `s`; its block's keyspace and hash.
    fn free_slot(&mut self, s: u32) -> (u64, u64) {
        let slot = self.slots[s as usize];
        if let Ok(e) = self
            .map
            .find_entry(block_hash(slot.ks as u64, slot.hash), |&x| x == s)
        {
            e.remove();
        }
        self.free.push(s);
        self.len -= 1;
        let ks = *self.keyspaces.key(slot.ks);
        self.keyspaces.release(slot.ks);
        if self.map.len() < self.map.capacity() / 4 {
            let slots = &self.slots;
            self.map
                .shrink_to(self.map.len() * 2, |&x| slot_hash(slots, x));
        }
        (ks, slot.hash)
    }

    /// Takes `s` out of the recency list (no-op when it is not linked).
    fn unlink(&mut self, s: u32) {
        let Slot { older, newer, .. } = self.slots[s as usize];
        if older == NIL && newer == NIL && self.oldest != s {
            return;
        }
        match older {
            NIL => self.oldest = newer,
            o => self.slots[o as usize].newer = newer,
        }
        match newer {
            NIL => self.newest = older,
            n => self.slots[n as usize].older = older,
        }
        let slot = &mut self.slots[s as usize];
        slot.older = NIL;
        slot.newer = NIL;
    }

    fn push_newest(&mut self, s: u32) {
        let prev = self.newest;
        {
            let slot = &mut self.slots[s as usize];
            slot.older = prev;
            slot.newer = NIL;
        }
        match prev {
            NIL => self.oldest = s,
            p => self.slots[p as usize].newer = s,
        }
        self.newest = s;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::Op;

    fn cuts(out: &OpBatch) -> Vec<u64> {
        out.ops()
            .iter()
            .flat_map(|op| match *op {
                Op::Remove { at, len, .. } => out.hashes(at, len).to_vec(),
                _ => vec![],
            })
            .collect()
    }

    #[test]
    fn oldest_then_deepest_are_cut_first() {
        let mut f = PlacementFeed::new(6, 0);
        let mut out = OpBatch::new();
        f.place(0, 9, &[1, 2, 3, 4], 10, &mut out);
        f.place(0, 9, &[1, 2, 7], 20, &mut out);
        assert_eq!(f.len(), 5);
        out.clear();
        // Extending b refreshes it; a's own tail is the oldest, its deepest block first.
        f.place(0, 9, &[1, 2, 7, 8, 9], 30, &mut out);
        assert_eq!(cuts(&out), vec![4]);
        out.clear();
        // Longer than the capacity: only the first 6 blocks are placed; (2, 7) (3, 8)
        // (4, 9) are refreshed, then a's last block and the unrefreshed rest are cut.
        f.place(0, 9, &[5, 6, 7, 8, 9, 10, 11, 12], 40, &mut out);
        assert!(matches!(out.ops()[0], Op::Insert { len: 6, .. }));
        assert_eq!(cuts(&out), vec![3, 2, 1]);
        assert_eq!(f.len(), 6);
    }

    #[test]
    fn a_placement_in_slices_is_the_placement_whole() {
        let chains: Vec<Vec<u64>> = (0..6u64)
            .map(|c| (0..7).map(|i| c * 100 + i.min(c + 1)).collect())
            .collect();
        let (mut whole, mut sliced) = (PlacementFeed::new(20, 0), PlacementFeed::new(20, 0));
        let (mut a, mut b) = (OpBatch::new(), OpBatch::new());
        for (t, chain) in chains.iter().enumerate() {
            whole.place(0, 9, chain, t as u64, &mut a);
            let mut job = sliced.start(chain.len(), t as u64);
            let mut slices = 1;
            while !sliced.place_some(0, 9, chain, &mut job, 3, |_, _| false, &mut b) {
                slices += 1;
            }
            assert!(slices > 2, "7 blocks in slices of 3");
        }
        assert_eq!(a, b);
        assert_eq!(whole.export(10), sliced.export(10));
    }

    #[test]
    fn ttl_expires_oldest_only_and_zero_means_never() {
        let mut f = PlacementFeed::new(100, 50);
        let mut out = OpBatch::new();
        f.place(0, 1, &[1, 2], 100, &mut out);
        f.place(0, 1, &[3], 130, &mut out);
        out.clear();
        f.expire(0, 150, &mut out);
        assert!(out.is_empty());
        f.expire(0, 151, &mut out);
        assert_eq!(cuts(&out), vec![2, 1]);
        let mut never = PlacementFeed::new(100, 0);
        never.place(0, 1, &[1], 0, &mut out);
        out.clear();
        never.expire(0, u64::MAX, &mut out);
        assert!(out.is_empty());
    }
}
