//! The approximate feed: gateways' placements. Each placed block keeps its place in a
//! recency list; past the capacity the oldest-used blocks are cut first.
//!
//! A placement refreshes every block of its chain at once. Within one placement the
//! deepest block counts as the oldest, so cuts eat chains from their ends and a held
//! prefix stays contiguous. The list and its map hold at most `capacity + chain length`
//! entries at any time, so memory is bounded by the capacity (trap 9).

use kvix_wire::WorkerId;

use super::BlockOp;
use crate::hashing::{BlockKey, BlockMap};
use crate::Holder;

const NIL: u32 = u32::MAX;

#[derive(Debug, Clone, Copy)]
struct Slot {
    ks: u64,
    hash: u64,
    pos: u32,
    /// Towards the least recently used end.
    older: u32,
    /// Towards the most recently used end.
    newer: u32,
    /// Placement clock (ms) when last placed.
    time: u64,
}

/// Placement-feed state of one worker.
#[derive(Debug)]
pub struct PlacementFeed {
    capacity: u64,
    ttl_ms: u64,
    slots: Vec<Slot>,
    free: Vec<u32>,
    map: BlockMap<u32>,
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
            map: BlockMap::default(),
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
    pub fn place<'a>(
        &mut self,
        worker: WorkerId,
        ks: u64,
        chain: &'a [u64],
        now_ms: u64,
        out: &mut Vec<BlockOp<'a>>,
    ) {
        use std::collections::hash_map::Entry;
        self.clock = self.clock.max(now_ms);
        // Blocks past the capacity would be cut right away (they are the newest, but the
        // deepest, and everything older goes first), so they are never placed.
        let n = chain.len().min(self.capacity.min(u32::MAX as u64) as usize);
        let mut scratch = std::mem::take(&mut self.scratch);
        scratch.clear();
        let mut placed = n;
        for (pos, &hash) in chain[..n].iter().enumerate() {
            let pos = pos as u32;
            let s = match self.map.entry(BlockKey::new(ks, pos, hash)) {
                Entry::Occupied(e) => {
                    let s = *e.get();
                    let slot = &self.slots[s as usize];
                    if (slot.ks, slot.pos, slot.hash) != (ks, pos, hash) {
                        placed = pos as usize; // key collision: stop the chain here
                        break;
                    }
                    s
                }
                Entry::Vacant(e) => {
                    let slot = Slot {
                        ks,
                        hash,
                        pos,
                        older: NIL,
                        newer: NIL,
                        time: 0,
                    };
                    let s = match self.free.pop() {
                        Some(s) => {
                            self.slots[s as usize] = slot;
                            s
                        }
                        None => {
                            self.slots.push(slot);
                            (self.slots.len() - 1) as u32
                        }
                    };
                    e.insert(s);
                    self.len += 1;
                    s
                }
            };
            self.unlink(s);
            scratch.push(s);
        }
        // Deepest first, so the chain's root ends up the most recent of this placement.
        for &s in scratch.iter().rev() {
            self.slots[s as usize].time = self.clock;
            self.push_newest(s);
        }
        self.scratch = scratch;
        if placed > 0 {
            out.push(BlockOp::Insert {
                ks,
                holder: Holder::new(worker, 0),
                start: 0,
                chain: &chain[..placed],
            });
        }
        while self.len > self.capacity {
            self.cut_oldest(worker, out);
        }
    }

    /// The placed blocks, oldest-used first, with their ages at `now_ms`.
    pub fn export(&self, now_ms: u64) -> crate::PlacementFeedImage {
        let mut placed = Vec::with_capacity(self.len as usize);
        let mut s = self.oldest;
        while s != NIL {
            let slot = &self.slots[s as usize];
            placed.push(crate::PlacedImage {
                ks: slot.ks,
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
            let key = BlockKey::new(p.ks, p.pos, p.hash);
            if self.map.contains_key(&key) {
                continue;
            }
            let slot = Slot {
                ks: p.ks,
                hash: p.hash,
                pos: p.pos,
                older: NIL,
                newer: NIL,
                time: self.clock.saturating_sub(p.age_ms),
            };
            self.slots.push(slot);
            let s = (self.slots.len() - 1) as u32;
            self.map.insert(key, s);
            self.len += 1;
            self.push_newest(s);
        }
    }

    /// Cuts blocks placed more than `ttl_ms` before `now_ms` (none when the TTL is 0).
    pub fn expire(&mut self, worker: WorkerId, now_ms: u64, out: &mut Vec<BlockOp<'_>>) {
        if self.ttl_ms == 0 {
            return;
        }
        while self.oldest != NIL
            && now_ms.saturating_sub(self.slots[self.oldest as usize].time) > self.ttl_ms
        {
            self.cut_oldest(worker, out);
        }
    }

    fn cut_oldest(&mut self, worker: WorkerId, out: &mut Vec<BlockOp<'_>>) {
        let s = self.oldest;
        if s == NIL {
            return;
        }
        self.unlink(s);
        let slot = self.slots[s as usize];
        self.map
            .remove(&BlockKey::new(slot.ks, slot.pos, slot.hash));
        self.free.push(s);
        self.len -= 1;
        out.push(BlockOp::Remove {
            ks: slot.ks,
            holder: Holder::new(worker, 0),
            pos: slot.pos,
            hash: slot.hash,
        });
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

    fn cuts(out: &[BlockOp<'_>]) -> Vec<(u32, u64)> {
        out.iter()
            .filter_map(|op| match op {
                BlockOp::Remove { pos, hash, .. } => Some((*pos, *hash)),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn oldest_then_deepest_are_cut_first() {
        let mut f = PlacementFeed::new(6, 0);
        let a = [1, 2, 3, 4];
        let b = [1, 2, 7];
        let mut out = Vec::new();
        f.place(0, 9, &a, 10, &mut out);
        f.place(0, 9, &b, 20, &mut out);
        assert_eq!(f.len(), 5);
        out.clear();
        // Extending b refreshes it; a's own tail is the oldest, its deepest block first.
        f.place(0, 9, &[1, 2, 7, 8, 9], 30, &mut out);
        assert_eq!(cuts(&out), vec![(3, 4)]);
        out.clear();
        // Longer than the capacity: only the first 6 blocks are placed; (2, 7) (3, 8)
        // (4, 9) are refreshed, then a's last block and the unrefreshed rest are cut.
        f.place(0, 9, &[5, 6, 7, 8, 9, 10, 11, 12], 40, &mut out);
        assert!(matches!(out[0], BlockOp::Insert { chain, .. } if chain.len() == 6));
        assert_eq!(cuts(&out), vec![(2, 3), (1, 2), (0, 1)]);
        assert_eq!(f.len(), 6);
    }

    #[test]
    fn ttl_expires_oldest_only_and_zero_means_never() {
        let mut f = PlacementFeed::new(100, 50);
        let mut out = Vec::new();
        f.place(0, 1, &[1, 2], 100, &mut out);
        f.place(0, 1, &[3], 130, &mut out);
        out.clear();
        f.expire(0, 150, &mut out);
        assert!(out.is_empty());
        f.expire(0, 151, &mut out);
        assert_eq!(cuts(&out), vec![(1, 2), (0, 1)]);
        let mut never = PlacementFeed::new(100, 0);
        never.place(0, 1, &[1], 0, &mut out);
        out.clear();
        never.expire(0, u64::MAX, &mut out);
        assert!(out.is_empty());
    }
}
