//! One shard's block store.
//!
//! Blocks are grouped into *runs*: consecutive positions of one chain held by the same
//! holder set. A run stores its chain hashes contiguously and points at an interned
//! holder set, so a prefix shared by 240 workers is one run and one set, and a query
//! walks it by comparing hashes in order. A per-block map (`(keyspace, position, hash)`
//! → run) finds where a chain enters the shard, where it re-enters after a run ends or
//! diverges, and where an event lands mid-run.
//!
//! Runs split when a holder joins or leaves part of them (the larger side keeps its
//! slot, so only the smaller side's map entries move) and merge back when neighbours on
//! the same chain end up with equal sets. Chain adjacency is known from two links kept
//! per run: `parent` (the hash before the run's first block, verified by lookup) and a
//! `next` hint (validated on use), so a stale link is never trusted.

use smallvec::SmallVec;

use crate::coverage::Coverage;
use crate::error::IndexError;
use crate::hashing::{BlockKey, BlockMap, FastMap};
use crate::sets::{SetId, SetPool};
use crate::Holder;
use kvix_wire::WorkerId;

const NIL: u32 = u32::MAX;

struct Node {
    ks: u64,
    /// Chain hash of the block at `start - 1` on this run's chain, when `has_parent`.
    parent: u64,
    start: u32,
    /// Holder set; `NIL` marks a free node.
    set: SetId,
    /// A run that may continue this chain at `end()`; checked by [`BlockIndex::follows`].
    next: u32,
    has_parent: bool,
    hashes: SmallVec<[u64; 2]>,
}

impl Node {
    fn end(&self) -> u32 {
        self.start + self.hashes.len() as u32
    }

    fn len(&self) -> u64 {
        self.hashes.len() as u64
    }
}

/// One shard's blocks and who holds them (see the module docs).
#[derive(Default)]
pub struct BlockIndex {
    nodes: Vec<Node>,
    free: Vec<u32>,
    map: BlockMap<u32>,
    sets: SetPool,
    memberships: u64,
    collisions: u64,
}

impl BlockIndex {
    pub fn new() -> Self {
        Self::default()
    }

    /// Distinct blocks held.
    pub fn blocks(&self) -> u64 {
        self.map.len() as u64
    }

    /// (block, holder) pairs.
    pub fn memberships(&self) -> u64 {
        self.memberships
    }

    /// Runs (nodes) in use: how compressed the store is.
    pub fn runs(&self) -> usize {
        self.nodes.len() - self.free.len()
    }

    /// Blocks refused because their 64-bit key was taken by a different block.
    pub fn collisions(&self) -> u64 {
        self.collisions
    }

    /// Records that `holder` holds block `start + j` with chain hash `chain[j]`.
    pub fn insert(
        &mut self,
        ks: u64,
        holder: Holder,
        start: u32,
        chain: &[u64],
    ) -> Result<(), IndexError> {
        let h = holder.pack()?;
        check_span(start, chain.len())?;
        let mut j = 0;
        // The run whose last block is the chain's block before `j`, if any.
        let mut prev = NIL;
        while j < chain.len() {
            let pos = start + j as u32;
            let parent = j.checked_sub(1).map(|p| chain[p]);
            let (mut n, r) = match self.locate(ks, pos, chain[j]) {
                Some(n) => {
                    let r = self.matching(n, pos, &chain[j..]);
                    (self.add_holder(n, pos, r, h), r)
                }
                None => match self.insert_fresh(ks, pos, &chain[j..], h, parent) {
                    Some((n, r)) => (n, r),
                    None => {
                        j += 1;
                        prev = NIL;
                        continue;
                    }
                },
            };
            if prev != NIL && self.nodes[n as usize].start == pos {
                n = self.link(prev, n, chain[j - 1]);
            }
            j += r;
            prev = if pos + r as u32 == self.nodes[n as usize].end() {
                n
            } else {
                NIL
            };
        }
        Ok(())
    }

    /// Forgets that `holder` holds block `pos` with chain hash `hash`; false when it did not.
    pub fn remove(
        &mut self,
        ks: u64,
        holder: Holder,
        pos: u32,
        hash: u64,
    ) -> Result<bool, IndexError> {
        let h = holder.pack()?;
        let Some(n) = self.locate(ks, pos, hash) else {
            return Ok(false);
        };
        if !self.sets.contains(self.nodes[n as usize].set, h) {
            return Ok(false);
        }
        let m = self.isolate(n, pos, pos + 1);
        match self.sets.without(self.nodes[m as usize].set, |x| x == h) {
            Some(s) => {
                self.set_set(m, s);
                self.merge_around(m);
            }
            None => self.delete_node(m),
        }
        Ok(true)
    }

    /// Whether `holder` holds block `pos` with chain hash `hash`.
    pub fn holds(&self, ks: u64, holder: Holder, pos: u32, hash: u64) -> bool {
        match (holder.pack(), self.locate(ks, pos, hash)) {
            (Ok(h), Some(n)) => self.sets.contains(self.nodes[n as usize].set, h),
            _ => false,
        }
    }

    /// Drops every block membership of one holder. Costs a pass over all runs.
    pub fn drop_holder(&mut self, holder: Holder) {
        if let Ok(h) = holder.pack() {
            self.drop_where(|x| x == h);
        }
    }

    /// Drops every block membership of every lane of `worker`. Costs a pass over all runs.
    pub fn drop_worker(&mut self, worker: WorkerId) {
        self.drop_where(|x| x >> 4 == worker);
    }

    /// Adds to `out` the runs of every admitted holder over blocks `start + j` whose hash
    /// is `chain[j]`. Positions in `out` are absolute; `start` may be any position (a
    /// shard's piece of a query starts at a segment boundary with nothing before it here).
    pub fn coverage(&self, ks: u64, start: u32, chain: &[u64], out: &mut Coverage) {
        let len = chain.len().min((u32::MAX - start) as usize);
        let mut j = 0;
        let mut prev = NIL;
        while j < len {
            let pos = start + j as u32;
            // A run's `next` hint usually names the run that continues this chain:
            // following it saves the map lookup at a run boundary.
            let hinted = (prev != NIL)
                .then(|| self.nodes[prev as usize].next)
                .filter(|&nx| {
                    nx != NIL
                        && self.follows(prev, nx)
                        && self.nodes[nx as usize].hashes[0] == chain[j]
                });
            let Some(n) = hinted.or_else(|| self.locate(ks, pos, chain[j])) else {
                j += 1;
                prev = NIL;
                continue;
            };
            let r = self.matching(n, pos, &chain[j..len]);
            out.add_set(
                self.sets.holders(self.nodes[n as usize].set),
                pos,
                pos + r as u32,
            );
            j += r;
            prev = if pos + r as u32 == self.nodes[n as usize].end() {
                n
            } else {
                NIL
            };
        }
    }

    /// The run holding block (`ks`, `pos`, `hash`), verified against the run itself.
    fn locate(&self, ks: u64, pos: u32, hash: u64) -> Option<u32> {
        let n = *self.map.get(&BlockKey::new(ks, pos, hash))?;
        let node = &self.nodes[n as usize];
        let hit = node.set != NIL
            && node.ks == ks
            && pos >= node.start
            && pos < node.end()
            && node.hashes[(pos - node.start) as usize] == hash;
        hit.then_some(n)
    }

    /// How many hashes of `chain` match run `n` from position `pos` on.
    fn matching(&self, n: u32, pos: u32, chain: &[u64]) -> usize {
        let node = &self.nodes[n as usize];
        node.hashes[(pos - node.start) as usize..]
            .iter()
            .zip(chain)
            .take_while(|(a, b)| a == b)
            .count()
    }

    /// Adds holder `h` to the `len` blocks of run `n` from `pos`; returns the run that
    /// now holds them.
    fn add_holder(&mut self, n: u32, pos: u32, len: usize, h: u32) -> u32 {
        if self.sets.contains(self.nodes[n as usize].set, h) {
            return n;
        }
        let m = self.isolate(n, pos, pos + len as u32);
        let s = self.sets.with_added(self.nodes[m as usize].set, h);
        self.set_set(m, s);
        self.merge_around(m)
    }

    /// Records what an insert walk learnt: run `b` (starting at `a`'s end) continues
    /// `a`'s chain, whose last hash is `parent`. Merges them when their sets agree.
    fn link(&mut self, a: u32, b: u32, parent: u64) -> u32 {
        let node = &mut self.nodes[b as usize];
        if !node.has_parent {
            node.has_parent = true;
            node.parent = parent;
        }
        if !self.follows(a, b) {
            return b;
        }
        if self.nodes[a as usize].set == self.nodes[b as usize].set {
            return self.merge(a, b);
        }
        self.nodes[a as usize].next = b;
        b
    }

    /// Stores absent blocks from `pos` for holder `h` as a new run, up to the first block
    /// that is present (or whose key is taken). Returns the run and how many blocks it
    /// took, or `None` when the first block's key is taken by another block.
    fn insert_fresh(
        &mut self,
        ks: u64,
        pos: u32,
        chain: &[u64],
        h: u32,
        parent: Option<u64>,
    ) -> Option<(u32, usize)> {
        use std::collections::hash_map::Entry;
        let n = self.alloc(Node {
            ks,
            parent: parent.unwrap_or(0),
            start: pos,
            set: NIL,
            next: NIL,
            has_parent: parent.is_some(),
            hashes: SmallVec::new(),
        });
        let mut k = 0;
        while k < chain.len() {
            match self.map.entry(BlockKey::new(ks, pos + k as u32, chain[k])) {
                Entry::Vacant(e) => {
                    e.insert(n);
                    self.nodes[n as usize].hashes.push(chain[k]);
                    k += 1;
                }
                Entry::Occupied(_) => break,
            }
        }
        if k == 0 {
            // `locate` found no such block, yet its key is taken: a 64-bit collision with
            // another block. Refuse this one block rather than mix the two up.
            self.free.push(n);
            self.collisions += 1;
            return None;
        }
        self.nodes[n as usize].set = self.sets.singleton(h);
        self.memberships += k as u64;
        Some((self.merge_around(n), k))
    }

    fn drop_where(&mut self, drop: impl Fn(u32) -> bool + Copy) {
        let mut memo: FastMap<SetId, Option<SetId>> = FastMap::default();
        let mut changed = Vec::new();
        for n in 0..self.nodes.len() as u32 {
            let s = self.nodes[n as usize].set;
            if s == NIL || !self.sets.holders(s).iter().any(|x| drop(*x)) {
                continue;
            }
            // Sets created here never contain a dropped holder, so a reused id is skipped
            // by the test above before it could hit a stale memo entry.
            let next = match memo.get(&s) {
                Some(&next) => {
                    if let Some(id) = next {
                        self.sets.acquire(id);
                    }
                    next
                }
                None => {
                    let next = self.sets.without(s, drop);
                    memo.insert(s, next);
                    next
                }
            };
            match next {
                Some(id) => {
                    self.set_set(n, id);
                    changed.push(n);
                }
                None => self.delete_node(n),
            }
        }
        for n in changed {
            if self.nodes[n as usize].set != NIL {
                self.merge_around(n);
            }
        }
        self.maybe_shrink_map();
    }

    /// Replaces run `m`'s set by `s` (already acquired), keeping the membership count.
    fn set_set(&mut self, m: u32, s: SetId) {
        let node = &mut self.nodes[m as usize];
        let old = std::mem::replace(&mut node.set, s);
        let len = node.len();
        self.memberships =
            self.memberships + len * self.sets.len(s) as u64 - len * self.sets.len(old) as u64;
        self.sets.release(old);
    }

    /// Cuts run `n` so that exactly `[a, b)` is one run, and returns that run.
    fn isolate(&mut self, mut n: u32, a: u32, b: u32) -> u32 {
        if a > self.nodes[n as usize].start {
            n = self.cut(n, a).1;
        }
        if b < self.nodes[n as usize].end() {
            n = self.cut(n, b).0;
        }
        n
    }

    /// Splits run `n` before position `at` (strictly inside it) into (left, right); the
    /// longer side stays in `n`, so only the shorter side's map entries are rewritten.
    fn cut(&mut self, n: u32, at: u32) -> (u32, u32) {
        let node = &self.nodes[n as usize];
        let off = (at - node.start) as usize;
        let keep_left = off * 2 >= node.hashes.len();
        let (ks, set) = (node.ks, node.set);
        let fresh = if keep_left {
            let tail: SmallVec<[u64; 2]> = node.hashes[off..].into();
            let new = Node {
                ks,
                parent: node.hashes[off - 1],
                start: at,
                set,
                next: node.next,
                has_parent: true,
                hashes: tail,
            };
            let id = self.alloc(new);
            let node = &mut self.nodes[n as usize];
            node.hashes.truncate(off);
            node.next = id;
            shrink(&mut node.hashes);
            id
        } else {
            let head: SmallVec<[u64; 2]> = node.hashes[..off].into();
            let new = Node {
                ks,
                parent: node.parent,
                start: node.start,
                set,
                next: n,
                has_parent: node.has_parent,
                hashes: head,
            };
            let id = self.alloc(new);
            let node = &mut self.nodes[n as usize];
            node.parent = node.hashes[off - 1];
            node.has_parent = true;
            node.hashes.drain(..off);
            node.start = at;
            shrink(&mut node.hashes);
            self.retarget_left(n, id);
            id
        };
        self.sets.acquire(set);
        self.repoint(fresh);
        if keep_left {
            (n, fresh)
        } else {
            (fresh, n)
        }
    }

    /// Points the map entries of every block of run `n` at `n`.
    fn repoint(&mut self, n: u32) {
        let node = &self.nodes[n as usize];
        for (i, &h) in node.hashes.iter().enumerate() {
            if let Some(v) = self
                .map
                .get_mut(&BlockKey::new(node.ks, node.start + i as u32, h))
            {
                *v = n;
            }
        }
    }

    /// Whether run `b` continues run `a`'s chain right after it.
    fn follows(&self, a: u32, b: u32) -> bool {
        let (x, y) = (&self.nodes[a as usize], &self.nodes[b as usize]);
        a != b
            && y.set != NIL
            && y.ks == x.ks
            && y.has_parent
            && y.start == x.end()
            && x.hashes.last() == Some(&y.parent)
    }

    /// Merges run `n` with chain neighbours that have the same set; returns the survivor.
    fn merge_around(&mut self, n: u32) -> u32 {
        let n = self.merge_left(n);
        self.merge_right(n)
    }

    fn merge_left(&mut self, n: u32) -> u32 {
        let node = &self.nodes[n as usize];
        if !node.has_parent || node.start == 0 {
            return n;
        }
        let Some(l) = self.locate(node.ks, node.start - 1, node.parent) else {
            return n;
        };
        if self.nodes[l as usize].end() != node.start {
            return n; // the parent sits inside a run that goes on along another branch
        }
        if self.nodes[l as usize].set == node.set {
            return self.merge(l, n);
        }
        self.nodes[l as usize].next = n;
        n
    }

    fn merge_right(&mut self, n: u32) -> u32 {
        let nx = self.nodes[n as usize].next;
        if nx != NIL
            && self.follows(n, nx)
            && self.nodes[nx as usize].set == self.nodes[n as usize].set
        {
            return self.merge(n, nx);
        }
        n
    }

    /// Joins run `b` onto run `a` (`b` follows `a`, equal sets); the longer one survives.
    fn merge(&mut self, a: u32, b: u32) -> u32 {
        let (keep, gone) = if self.nodes[a as usize].len() >= self.nodes[b as usize].len() {
            (a, b)
        } else {
            (b, a)
        };
        let moved = std::mem::take(&mut self.nodes[gone as usize].hashes);
        let g = &self.nodes[gone as usize];
        let (g_start, g_parent, g_has_parent, g_next) = (g.start, g.parent, g.has_parent, g.next);
        let k = &mut self.nodes[keep as usize];
        if keep == a {
            k.hashes.extend_from_slice(&moved);
            k.next = g_next;
        } else {
            k.hashes.insert_from_slice(0, &moved);
            k.start = g_start;
            k.parent = g_parent;
            k.has_parent = g_has_parent;
        }
        let ks = k.ks;
        for (i, &h) in moved.iter().enumerate() {
            if let Some(v) = self.map.get_mut(&BlockKey::new(ks, g_start + i as u32, h)) {
                *v = keep;
            }
        }
        let s = self.nodes[gone as usize].set;
        self.nodes[gone as usize].set = NIL;
        self.sets.release(s);
        self.free.push(gone);
        if keep == b {
            self.retarget_left(a, b);
        }
        keep
    }

    /// Run `new` now begins where run `old` began: the left neighbour's `next` hint, if it
    /// named `old`, is pointed at `new` (so hints survive cuts and merges).
    fn retarget_left(&mut self, old: u32, new: u32) {
        let node = &self.nodes[new as usize];
        if !node.has_parent || node.start == 0 {
            return;
        }
        if let Some(l) = self.locate(node.ks, node.start - 1, node.parent) {
            if self.nodes[l as usize].next == old {
                self.nodes[l as usize].next = new;
            }
        }
    }

    /// Removes run `m` and all its blocks.
    fn delete_node(&mut self, m: u32) {
        let node = &mut self.nodes[m as usize];
        let hashes = std::mem::take(&mut node.hashes);
        let (ks, start, set) = (node.ks, node.start, node.set);
        node.set = NIL;
        for (i, &h) in hashes.iter().enumerate() {
            self.map.remove(&BlockKey::new(ks, start + i as u32, h));
        }
        self.memberships -= hashes.len() as u64 * self.sets.len(set) as u64;
        self.sets.release(set);
        self.free.push(m);
        self.maybe_shrink_map();
    }

    fn alloc(&mut self, node: Node) -> u32 {
        match self.free.pop() {
            Some(id) => {
                self.nodes[id as usize] = node;
                id
            }
            None => {
                self.nodes.push(node);
                (self.nodes.len() - 1) as u32
            }
        }
    }

    /// Gives memory back once the map is mostly empty (amortized: it halves at most).
    fn maybe_shrink_map(&mut self) {
        let (len, cap) = (self.map.len(), self.map.capacity());
        if cap > 64 && len < cap / 4 {
            self.map.shrink_to(len * 2);
        }
    }

    /// Applies one block operation (already routed to this shard).
    pub fn apply(&mut self, op: &crate::BlockOp<'_>) -> Result<(), IndexError> {
        match *op {
            crate::BlockOp::Insert {
                ks,
                holder,
                start,
                chain,
            } => self.insert(ks, holder, start, chain),
            crate::BlockOp::Remove {
                ks,
                holder,
                pos,
                hash,
            } => self.remove(ks, holder, pos, hash).map(drop),
            crate::BlockOp::DropWorker { worker } => {
                self.drop_worker(worker);
                Ok(())
            }
        }
    }

    /// Every live run, for a snapshot; [`BlockIndex::import`] rebuilds the same index.
    pub fn export(&self) -> Vec<crate::RunImage> {
        self.nodes
            .iter()
            .filter(|n| n.set != NIL)
            .map(|n| crate::RunImage {
                ks: n.ks,
                start: n.start,
                hashes: n.hashes.to_vec(),
                holders: self
                    .sets
                    .holders(n.set)
                    .iter()
                    .map(|&h| {
                        let h = Holder::unpack(h);
                        (h.worker, h.lane)
                    })
                    .collect(),
            })
            .collect()
    }

    /// Inserts an exported run (or the part of it this shard owns).
    pub fn import(
        &mut self,
        ks: u64,
        start: u32,
        hashes: &[u64],
        holders: &[(u32, u8)],
    ) -> Result<(), IndexError> {
        for &(worker, lane) in holders {
            self.insert(ks, Holder::new(worker, lane), start, hashes)?;
        }
        Ok(())
    }

    /// Every live run as (start, length, packed holders); for tests and debugging.
    #[doc(hidden)]
    pub fn dump(&self) -> Vec<(u32, usize, Vec<Holder>)> {
        let mut out: Vec<_> = self
            .nodes
            .iter()
            .filter(|n| n.set != NIL)
            .map(|n| {
                let hs = self.sets.holders(n.set).iter().map(|h| Holder::unpack(*h));
                (n.start, n.hashes.len(), hs.collect())
            })
            .collect();
        out.sort();
        out
    }

    /// Checks every internal invariant; for tests.
    #[doc(hidden)]
    pub fn check_invariants(&self) -> Result<(), String> {
        let mut blocks = 0usize;
        let mut memberships = 0u64;
        for (n, node) in self.nodes.iter().enumerate() {
            if node.set == NIL {
                continue;
            }
            if node.hashes.is_empty() {
                return Err(format!("run {n} is empty"));
            }
            let holders = self.sets.holders(node.set);
            if holders.is_empty() || holders.windows(2).any(|w| w[0] >= w[1]) {
                return Err(format!("run {n} has a bad holder set {holders:?}"));
            }
            for (i, &h) in node.hashes.iter().enumerate() {
                let key = BlockKey::new(node.ks, node.start + i as u32, h);
                if self.map.get(&key) != Some(&(n as u32)) {
                    return Err(format!("block {} of run {n} is not mapped to it", i));
                }
            }
            blocks += node.hashes.len();
            memberships += node.len() * holders.len() as u64;
        }
        if blocks != self.map.len() {
            return Err(format!(
                "{} map entries for {blocks} blocks",
                self.map.len()
            ));
        }
        if memberships != self.memberships {
            return Err(format!(
                "membership count {} but runs hold {memberships}",
                self.memberships
            ));
        }
        Ok(())
    }
}

/// Releases a run's spare hash capacity once it is mostly unused.
fn shrink(hashes: &mut SmallVec<[u64; 2]>) {
    if hashes.capacity() > 2 * hashes.len() + 4 {
        hashes.shrink_to_fit();
    }
}

fn check_span(start: u32, len: usize) -> Result<(), IndexError> {
    if start as u64 + len as u64 > u32::MAX as u64 {
        return Err(IndexError::PositionOverflow { start, len });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    type Held = Vec<(u32, u8, Vec<(u32, u32)>)>;

    fn cov(ix: &BlockIndex, ks: u64, start: u32, chain: &[u64]) -> Held {
        let mut c = Coverage::new();
        c.reset(None);
        ix.coverage(ks, start, chain, &mut c);
        let mut out: Vec<_> = c
            .workers()
            .flat_map(|w| {
                c.lanes_of(w)
                    .map(|(l, r)| (w, l, r.map(|r| (r.start, r.end)).collect()))
                    .collect::<Vec<_>>()
            })
            .collect();
        out.sort();
        out
    }

    const A: Holder = Holder { worker: 1, lane: 0 };
    const B: Holder = Holder { worker: 2, lane: 0 };

    #[test]
    fn shared_prefix_is_one_run_and_splits_merge_back() {
        let mut ix = BlockIndex::new();
        let chain: Vec<u64> = (100..110).collect();
        ix.insert(7, A, 0, &chain).unwrap();
        ix.insert(7, B, 0, &chain[..4]).unwrap();
        assert_eq!(ix.runs(), 2);
        assert_eq!(ix.blocks(), 10);
        assert_eq!(ix.memberships(), 14);
        ix.check_invariants().unwrap();
        assert_eq!(
            cov(&ix, 7, 0, &chain),
            vec![(1, 0, vec![(0, 10)]), (2, 0, vec![(0, 4)])]
        );
        // B joins the rest in a separate store: the runs merge back into one.
        ix.insert(7, B, 4, &chain[4..]).unwrap();
        assert_eq!(ix.runs(), 1);
        ix.check_invariants().unwrap();
        // Tail evictions by A leave B's blocks as one run again.
        for p in (6..10).rev() {
            assert!(ix.remove(7, A, p, chain[p as usize]).unwrap());
            ix.check_invariants().unwrap();
        }
        assert_eq!(ix.runs(), 2, "{:?}", ix.dump());
        assert!(!ix.remove(7, A, 9, chain[9]).unwrap());
        ix.drop_worker(2);
        ix.check_invariants().unwrap();
        assert_eq!(ix.blocks(), 6);
        assert_eq!(cov(&ix, 7, 0, &chain), vec![(1, 0, vec![(0, 6)])]);
        ix.drop_holder(A);
        assert_eq!((ix.blocks(), ix.memberships(), ix.runs()), (0, 0, 0));
    }

    #[test]
    fn queries_enter_anywhere_and_skip_gaps() {
        let mut ix = BlockIndex::new();
        let chain: Vec<u64> = (0..20).map(|i| 1000 + i).collect();
        ix.insert(1, A, 8, &chain[8..12]).unwrap();
        ix.insert(1, B, 15, &chain[15..18]).unwrap();
        assert_eq!(
            cov(&ix, 1, 10, &chain[10..]),
            vec![(1, 0, vec![(10, 12)]), (2, 0, vec![(15, 18)])]
        );
        // A hash at the wrong position or keyspace is not a match.
        assert_eq!(cov(&ix, 1, 9, &chain[10..]), vec![]);
        assert_eq!(cov(&ix, 2, 10, &chain[10..]), vec![]);
        // A diverging chain matches only its shared prefix.
        let mut other = chain.clone();
        other[10..].iter_mut().for_each(|h| *h += 1 << 40);
        assert_eq!(cov(&ix, 1, 0, &other[..12]), vec![(1, 0, vec![(8, 10)])]);
    }

    #[test]
    fn middle_removal_and_bad_input() {
        let mut ix = BlockIndex::new();
        let chain: Vec<u64> = (0..9).map(|i| 77 + i).collect();
        ix.insert(3, A, 0, &chain).unwrap();
        assert!(ix.remove(3, A, 4, chain[4]).unwrap());
        ix.check_invariants().unwrap();
        assert_eq!(cov(&ix, 3, 0, &chain), vec![(1, 0, vec![(0, 4), (5, 9)])]);
        ix.insert(3, A, 3, &chain[3..6]).unwrap();
        ix.check_invariants().unwrap();
        assert_eq!(ix.runs(), 1);
        assert!(ix.insert(3, Holder::new(1 << 21, 0), 0, &chain).is_err());
        assert!(ix.insert(3, Holder::new(1, 16), 0, &chain).is_err());
        assert!(ix.insert(3, A, u32::MAX - 2, &chain).is_err());
    }
}
