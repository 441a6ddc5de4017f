//! The block store of one executor: every block held by anyone, and by whom.
//!
//! Blocks are grouped into *runs*: consecutive positions of one chain held by the same
//! holder set. A run stores its chain hashes contiguously and points at an interned
//! holder set, so a prefix shared by 240 workers is one run and one set, and a query
//! walks it by comparing hashes in order. A block table (one 8-byte slot per block:
//! run id and position, hashed from the block's chain hash) finds where a query enters
//! a chain, where it re-enters after a divergence, and where an event lands mid-run.
//! The table stores no key of its own: a slot is compared and rehashed through the run
//! it points at, and the comparison checks the whole identity (keyspace, position,
//! chain hash), so two blocks whose hashes collide are simply two slots.
//!
//! A store that names its parent extends the parent's run when the parent is that run's
//! last block and the run is held by exactly the storing holder: decode-style streams
//! (one block per event) build the same long runs as one big store. Runs split when a
//! holder joins or leaves part of them (the larger side keeps its id, so only the
//! smaller side's slots move) and merge back when neighbours on the same chain end up
//! with equal sets. Adjacency is known from `parent` (the hash before a run's first
//! block, verified by lookup) and a `next` hint (validated on use).

use smallvec::SmallVec;

use crate::error::IndexError;
use crate::hashing::{block_hash, FastMap};
use crate::interner::Interner;
use crate::sets::{SetId, SetPool};
use crate::Holder;
use kvix_wire::WorkerId;

const NIL: u32 = u32::MAX;
/// Set in `Node::ks` when `parent` is known.
const HAS_PARENT: u32 = 1 << 31;

struct Node {
    hashes: SmallVec<[u64; 2]>,
    /// Chain hash of the block at `start - 1` on this run's chain, when `HAS_PARENT`.
    parent: u64,
    start: u32,
    /// Holder set; `NIL` marks a free node.
    set: SetId,
    /// A run that may continue this chain at `end()`; checked by [`BlockIndex::follows`].
    next: u32,
    /// Keyspace index, and the `HAS_PARENT` flag.
    ks: u32,
    /// Neighbours in the list of runs with the same set (`NIL` at either end).
    set_prev: u32,
    set_next: u32,
}

// What docs/design.md says a run costs.
const _: () = assert!(std::mem::size_of::<Node>() == 56);

impl Node {
    fn end(&self) -> u32 {
        self.start + self.hashes.len() as u32
    }

    /// The index of this run's first block at or after position `pos`.
    fn first_from(&self, pos: u32) -> usize {
        (pos.saturating_sub(self.start) as usize).min(self.hashes.len())
    }

    fn len(&self) -> u64 {
        self.hashes.len() as u64
    }

    fn ksi(&self) -> u32 {
        self.ks & !HAS_PARENT
    }

    fn has_parent(&self) -> bool {
        self.ks & HAS_PARENT != 0
    }

    fn set_parent(&mut self, parent: u64) {
        self.parent = parent;
        self.ks |= HAS_PARENT;
    }
}

/// A block's table slot: the run holding it and its position.
#[derive(Clone, Copy, Default)]
struct Slot {
    run: u32,
    pos: u32,
}

// SAFETY: two integers.
unsafe impl crate::table::Zeroable for Slot {}

fn slot_is(nodes: &[Node], s: &Slot, ks: u32, pos: u32, hash: u64) -> bool {
    s.pos == pos && {
        let n = &nodes[s.run as usize];
        n.ksi() == ks && n.hashes.get(pos.wrapping_sub(n.start) as usize) == Some(&hash)
    }
}

mod block_table;
pub use block_table::slow_rebuilds;
use block_table::BlockTable;

/// The blocks held and who holds them (see the module docs).
#[derive(Default)]
pub struct BlockIndex {
    nodes: Vec<Node>,
    free: Vec<u32>,
    table: BlockTable,
    sets: SetPool,
    keyspaces: Interner<u64>,
    /// Per set id, the first run of its list of runs: a holder is dropped by walking the
    /// lists of the sets holding it, not every run.
    set_runs: Vec<u32>,
    /// Runs looked at by sweeps, for tests.
    swept: u64,
    memberships: u64,
    /// Per packed holder: blocks held, and the run its last insert ended in.
    held: FastMap<u32, Held>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Held {
    blocks: u64,
    /// A hint (checked before use): a decode stream's next store names this run's last
    /// block as its parent, and so extends it without a table lookup.
    last: u32,
}

impl BlockIndex {
    pub fn new() -> Self {
        Self::default()
    }

    /// Makes room for `blocks` more blocks at once (a restore knows how many are coming),
    /// instead of growing the block table step by step.
    pub fn reserve(&mut self, blocks: usize) {
        self.reserve_slots(blocks);
    }

    /// Distinct blocks held.
    pub fn blocks(&self) -> u64 {
        self.table.len() as u64
    }

    /// (block, holder) pairs.
    pub fn memberships(&self) -> u64 {
        self.memberships
    }

    /// Runs in use: how compressed the store is.
    pub fn runs(&self) -> usize {
        self.nodes.len() - self.free.len()
    }

    /// Blocks `holder` holds.
    pub fn held_by(&self, holder: Holder) -> u64 {
        holder
            .pack()
            .ok()
            .and_then(|h| self.held.get(&h))
            .map_or(0, |c| c.blocks)
    }

    /// Records that `holder` holds block `start + j` with chain hash `chain[j]`; `parent`
    /// is the chain hash of block `start - 1`, when known.
    pub fn insert(
        &mut self,
        ks: u64,
        holder: Holder,
        start: u32,
        parent: Option<u64>,
        chain: &[u64],
    ) -> Result<(), IndexError> {
        let h = holder.pack()?;
        check_span(start, chain.len())?;
        if chain.is_empty() {
            return Ok(());
        }
        let ks = self.keyspaces.intern(&ks);
        let parent = parent.filter(|_| start > 0);
        // The run whose last block is the chain's block before `j`, if any.
        let mut prev = match parent {
            Some(p) => self
                .last_of(h)
                .filter(|&r| self.ends_with(r, ks, start, p))
                .or_else(|| self.find(ks, start - 1, p))
                .filter(|&r| self.node(r).end() == start)
                .unwrap_or(NIL),
            None => NIL,
        };
        let mut j = 0;
        while j < chain.len() {
            let pos = start + j as u32;
            let before = if j > 0 { Some(chain[j - 1]) } else { parent };
            // Extending the holder's own run: no lookup before the insert's own probe.
            let extended = (prev != NIL && self.extends(prev, pos, h))
                .then(|| self.insert_fresh(ks, pos, &chain[j..], h, before, prev))
                .filter(|&(_, k)| k > 0);
            let (mut n, r) = match extended {
                Some(done) => done,
                None => match self.find(ks, pos, chain[j]) {
                    Some(n) => {
                        let r = self.matching(n, pos, &chain[j..]);
                        (self.add_holder(n, pos, r, h), r)
                    }
                    None => self.insert_fresh(ks, pos, &chain[j..], h, before, prev),
                },
            };
            if let (true, Some(b)) = (prev != NIL && n != prev, before) {
                if self.node(n).start == pos {
                    n = self.link(prev, n, b);
                }
            }
            j += r;
            prev = if pos + r as u32 == self.node(n).end() {
                n
            } else {
                NIL
            };
        }
        if let Some(c) = self.held.get_mut(&h) {
            c.last = prev;
        }
        Ok(())
    }

    /// The run `h`'s last insert ended in, if it is still live.
    fn last_of(&self, h: u32) -> Option<u32> {
        let r = self.held.get(&h)?.last;
        (r != NIL && self.node(r).set != NIL).then_some(r)
    }

    /// Whether run `r` is in keyspace `ks` and ends with block `end - 1` = `hash`.
    fn ends_with(&self, r: u32, ks: u32, end: u32, hash: u64) -> bool {
        let n = self.node(r);
        n.ksi() == ks && n.end() == end && n.hashes.last() == Some(&hash)
    }

    /// Whether holder `h` may append block `pos` to run `r` (it alone holds `r`, which
    /// ends right before `pos`).
    fn extends(&self, r: u32, pos: u32, h: u32) -> bool {
        self.node(r).end() == pos && self.sets.is_only(self.node(r).set, h)
    }

    /// Forgets that `holder` holds the blocks with chain hashes `hashes` (in any order;
    /// a stretch of one run, ascending or descending, is taken off in one piece); returns
    /// how many it held.
    pub fn remove(&mut self, ks: u64, holder: Holder, hashes: &[u64]) -> Result<u64, IndexError> {
        let h = holder.pack()?;
        let Some(ks) = self.keyspaces.get(&ks) else {
            return Ok(0);
        };
        self.prefetch(ks, hashes);
        let (mut j, mut removed) = (0, 0u64);
        while j < hashes.len() {
            let Some((n, pos)) = self.find_held(ks, hashes[j], h) else {
                j += 1;
                continue;
            };
            // How far the following hashes run on in this run, up or down.
            let node = self.node(n);
            let at = (pos - node.start) as usize;
            let up = node.hashes[at..]
                .iter()
                .zip(&hashes[j..])
                .take_while(|(a, b)| a == b)
                .count();
            let down = node.hashes[..=at]
                .iter()
                .rev()
                .zip(&hashes[j..])
                .take_while(|(a, b)| a == b)
                .count();
            let (from, len) = if up >= down {
                (pos, up)
            } else {
                (pos + 1 - down as u32, down)
            };
            self.remove_from(n, from, len, h);
            removed += len as u64;
            j += len;
        }
        Ok(removed)
    }

    /// Whether `holder` holds block `pos` with chain hash `hash`.
    pub fn holds(&self, ks: u64, holder: Holder, pos: u32, hash: u64) -> bool {
        let (Ok(h), Some(ks)) = (holder.pack(), self.keyspaces.get(&ks)) else {
            return false;
        };
        self.find(ks, pos, hash)
            .is_some_and(|n| self.sets.contains(self.node(n).set, h))
    }

    /// Drops every block membership of one holder. Costs a pass over the live holder
    /// sets and the runs of those that hold it, not over every run.
    pub fn drop_holder(&mut self, holder: Holder) {
        while !self.sweep(holder, u64::MAX).1 {}
    }

    /// Drops about `budget` blocks' worth of `holder`'s memberships (at least one run);
    /// returns the blocks it took `holder` off and whether it holds nothing any more.
    pub fn sweep(&mut self, holder: Holder, budget: u64) -> (u64, bool) {
        match holder.pack() {
            Ok(h) if self.held.contains_key(&h) => self.drop_where(|x| x == h, budget),
            _ => (0, true),
        }
    }

    /// Drops every block membership of every lane and tier of `worker`.
    pub fn drop_worker(&mut self, worker: WorkerId) {
        while !self
            .drop_where(|x| crate::worker_of(x) == worker, u64::MAX)
            .1
        {}
    }

    /// Runs looked at by sweeps so far; for tests.
    #[doc(hidden)]
    pub fn swept_runs(&self) -> u64 {
        self.swept
    }

    /// Calls `visit(a, b, holders)` for each stretch `[a, b)` of `chain` (positions from
    /// 0) that one run covers, in position order, with the run's sorted packed holders.
    /// A position nobody holds costs one lookup; later positions are still visited (a
    /// sliding-window lane may hold them without the earlier ones).
    pub fn walk(&self, ks: u64, chain: &[u64], mut visit: impl FnMut(u32, u32, &[u32])) {
        let Some(ks) = self.keyspaces.get(&ks) else {
            return;
        };
        let len = chain.len().min(u32::MAX as usize);
        let (mut j, mut prev) = (0usize, NIL);
        while j < len {
            let pos = j as u32;
            // A run's `next` hint usually names the run that continues this chain:
            // following it saves the lookup at a run boundary.
            let hinted = (prev != NIL).then(|| self.node(prev).next).filter(|&nx| {
                nx != NIL && self.follows(prev, nx) && self.node(nx).hashes[0] == chain[j]
            });
            let Some(n) = hinted.or_else(|| self.find(ks, pos, chain[j])) else {
                j += 1;
                prev = NIL;
                continue;
            };
            let r = self.matching(n, pos, &chain[j..len]);
            let end = pos + r as u32;
            visit(pos, end, self.sets.holders(self.node(n).set));
            j += r;
            prev = if end == self.node(n).end() { n } else { NIL };
        }
    }

    fn node(&self, n: u32) -> &Node {
        &self.nodes[n as usize]
    }

    fn node_mut(&mut self, n: u32) -> &mut Node {
        &mut self.nodes[n as usize]
    }

    /// The run holding block (`ks`, `pos`, `hash`).
    fn find(&self, ks: u32, pos: u32, hash: u64) -> Option<u32> {
        let nodes = &self.nodes;
        self.table
            .table()
            .find(block_hash(ks as u64, hash), |s| {
                slot_is(nodes, s, ks, pos, hash)
            })
            .map(|s| s.run)
    }

    /// The run and position of a block with chain hash `hash` in `ks` that packed holder
    /// `h` holds (a chain hash names its prefix, so there is one, short of a collision).
    fn find_held(&self, ks: u32, hash: u64, h: u32) -> Option<(u32, u32)> {
        self.table
            .table()
            .candidates(block_hash(ks as u64, hash))
            .find(|s| {
                let n = self.node(s.run);
                n.ksi() == ks
                    && n.hashes[(s.pos - n.start) as usize] == hash
                    && self.sets.contains(n.set, h)
            })
            .map(|s| (s.run, s.pos))
    }

    /// Starts loading the table buckets of the blocks `hashes` name.
    fn prefetch(&self, ks: u32, hashes: &[u64]) {
        for &h in hashes.iter().take(64) {
            self.table.table().prefetch(block_hash(ks as u64, h));
        }
    }

    /// How many hashes of `chain` match run `n` from position `pos` on.
    fn matching(&self, n: u32, pos: u32, chain: &[u64]) -> usize {
        let node = self.node(n);
        node.hashes[(pos - node.start) as usize..]
            .iter()
            .zip(chain)
            .take_while(|(a, b)| a == b)
            .count()
    }

    /// Adds holder `h` to the `len` blocks of run `n` from `pos`; returns the run that
    /// now holds them.
    fn add_holder(&mut self, n: u32, pos: u32, len: usize, h: u32) -> u32 {
        if self.sets.contains(self.node(n).set, h) {
            return n;
        }
        let m = self.isolate(n, pos, pos + len as u32);
        let s = self.sets.with_added(self.node(m).set, h);
        self.set_set(m, s);
        self.merge_around(m)
    }

    /// Takes holder `h` off the `len` blocks of run `n` from `pos`.
    fn remove_from(&mut self, n: u32, pos: u32, len: usize, h: u32) {
        let node = self.node(n);
        let (start, end) = (node.start, node.end());
        let stop = pos + len as u32;
        if self.sets.is_only(node.set, h) && (pos == start || stop == end) {
            if pos == start && stop == end {
                return self.delete_node(n);
            }
            // A lone holder evicting a run's head or tail: trim the run in place.
            self.unmap(n, pos, stop);
            let node = self.node_mut(n);
            if stop == end {
                node.hashes.truncate((pos - start) as usize);
            } else {
                let parent = node.hashes[len - 1];
                node.hashes.drain(..len);
                node.start = stop;
                node.set_parent(parent);
            }
            shrink(&mut self.node_mut(n).hashes);
            self.memberships -= len as u64;
            self.count(h, -(len as i64));
            return;
        }
        let m = self.isolate(n, pos, stop);
        match self.sets.without(self.node(m).set, |x| x == h) {
            Some(s) => {
                self.set_set(m, s);
                self.merge_around(m);
            }
            None => self.delete_node(m),
        }
    }

    /// Records what an insert walk learnt: run `b` (starting at `a`'s end) continues
    /// `a`'s chain, whose last hash is `parent`. Merges them when their sets agree.
    fn link(&mut self, a: u32, b: u32, parent: u64) -> u32 {
        if !self.node(b).has_parent() {
            self.node_mut(b).set_parent(parent);
        }
        if !self.follows(a, b) {
            return b;
        }
        if self.node(a).set == self.node(b).set {
            return self.merge(a, b);
        }
        self.node_mut(a).next = b;
        b
    }

    /// Stores absent blocks from `pos` for holder `h`, up to the first present one:
    /// appended to `prev` when it ends at `pos` and `h` alone holds it, else as a new
    /// run after `before`. Returns the run and how many blocks it took (at least one).
    fn insert_fresh(
        &mut self,
        ks: u32,
        pos: u32,
        chain: &[u64],
        h: u32,
        before: Option<u64>,
        prev: u32,
    ) -> (u32, usize) {
        let extend = prev != NIL && self.extends(prev, pos, h);
        let dest = if extend {
            prev
        } else {
            let mut node = Node {
                hashes: SmallVec::new(),
                parent: 0,
                start: pos,
                set: NIL,
                next: NIL,
                ks,
                set_prev: NIL,
                set_next: NIL,
            };
            if let Some(b) = before {
                node.set_parent(b);
            }
            self.alloc(node)
        };
        grow(&mut self.node_mut(dest).hashes, chain.len());
        self.reserve_slots(chain.len());
        self.prefetch(ks, chain);
        let mut k = 0;
        while k < chain.len() {
            let (p, hash) = (pos + k as u32, chain[k]);
            let nodes = &self.nodes;
            let slot = Slot { run: dest, pos: p };
            if self.table.insert_absent(
                block_hash(ks as u64, hash),
                |s| slot_is(nodes, s, ks, p, hash),
                slot,
            ) {
                break;
            }
            self.nodes[dest as usize].hashes.push(hash);
            k += 1;
        }
        shrink(&mut self.node_mut(dest).hashes);
        if k == 0 {
            // The first block is there after all: only an extension attempt gets here.
            if !extend {
                self.node_mut(dest).hashes = SmallVec::new();
                self.free_node(dest);
            }
            return (dest, 0);
        }
        if !extend {
            let s = self.sets.singleton(h);
            self.node_mut(dest).set = s;
            self.enlist(dest);
        }
        self.memberships += k as u64;
        self.count(h, k as i64);
        (dest, k)
    }

    /// Takes the holders `drop` selects off about `budget` blocks' worth of runs (at
    /// least one), walking only the runs of sets that hold one of them; returns the
    /// blocks taken and whether none is left.
    fn drop_where(&mut self, drop: impl Fn(u32) -> bool + Copy, budget: u64) -> (u64, bool) {
        let hit = self
            .sets
            .ids_where(|holders| holders.iter().any(|x| drop(*x)));
        let mut taken = 0u64;
        for s in hit {
            if taken >= budget {
                return (taken, false);
            }
            let mut runs = Vec::new();
            let mut rest = self.set_runs.get(s as usize).copied().unwrap_or(NIL);
            while rest != NIL && taken < budget {
                runs.push(rest);
                taken += self.node(rest).len();
                rest = self.node(rest).set_next;
            }
            self.swept += runs.len() as u64;
            // Every run of `s` becomes a run of the same smaller set.
            let next = self.sets.without(s, drop);
            for &n in &runs {
                match next {
                    Some(id) => {
                        self.sets.acquire(id);
                        self.set_set(n, id);
                    }
                    None => self.delete_node(n),
                }
            }
            if let Some(id) = next {
                self.sets.release(id);
                for n in runs {
                    if self.node(n).set != NIL {
                        self.merge_around(n);
                    }
                }
            }
            if rest != NIL {
                return (taken, false);
            }
        }
        (taken, true)
    }

    /// Puts run `m` (just given its set) at the head of its set's list.
    fn enlist(&mut self, m: u32) {
        let s = self.node(m).set as usize;
        if s >= self.set_runs.len() {
            self.set_runs.resize(s + 1, NIL);
        }
        let head = std::mem::replace(&mut self.set_runs[s], m);
        if head != NIL {
            self.node_mut(head).set_prev = m;
        }
        let node = self.node_mut(m);
        (node.set_prev, node.set_next) = (NIL, head);
    }

    /// Takes run `m` out of its set's list.
    fn delist(&mut self, m: u32) {
        let node = self.node(m);
        let (s, prev, next) = (node.set as usize, node.set_prev, node.set_next);
        match prev {
            NIL => self.set_runs[s] = next,
            p => self.node_mut(p).set_next = next,
        }
        if next != NIL {
            self.node_mut(next).set_prev = prev;
        }
    }

    /// Frees run `m`'s set (delisting it); returns the set.
    fn unset(&mut self, m: u32) -> SetId {
        self.delist(m);
        std::mem::replace(&mut self.node_mut(m).set, NIL)
    }

    /// Replaces run `m`'s set by `s` (already acquired), keeping the counts.
    fn set_set(&mut self, m: u32, s: SetId) {
        let old = self.unset(m);
        self.node_mut(m).set = s;
        self.enlist(m);
        let len = self.node(m).len() as i64;
        let (a, b) = (self.sets.holders(old), self.sets.holders(s));
        let mut deltas: SmallVec<[(u32, i64); 4]> = SmallVec::new();
        let (mut i, mut j) = (0, 0);
        while i < a.len() || j < b.len() {
            match (a.get(i), b.get(j)) {
                (Some(x), Some(y)) if x == y => (i, j) = (i + 1, j + 1),
                (Some(&x), Some(&y)) if x < y => {
                    deltas.push((x, -len));
                    i += 1;
                }
                (Some(&x), None) => {
                    deltas.push((x, -len));
                    i += 1;
                }
                (_, Some(&y)) => {
                    deltas.push((y, len));
                    j += 1;
                }
                (None, None) => unreachable!(),
            }
        }
        for (h, d) in deltas {
            self.memberships = (self.memberships as i64 + d) as u64;
            self.count(h, d);
        }
        self.sets.release(old);
    }

    fn count(&mut self, h: u32, d: i64) {
        let c = self.held.entry(h).or_insert(Held {
            blocks: 0,
            last: NIL,
        });
        c.blocks = (c.blocks as i64 + d) as u64;
        if c.blocks == 0 {
            self.held.remove(&h);
        }
    }

    /// Cuts run `n` so that exactly `[a, b)` is one run, and returns that run.
    fn isolate(&mut self, mut n: u32, a: u32, b: u32) -> u32 {
        if a > self.node(n).start {
            n = self.cut(n, a).1;
        }
        if b < self.node(n).end() {
            n = self.cut(n, b).0;
        }
        n
    }

    /// Splits run `n` before position `at` (strictly inside it) into (left, right); the
    /// longer side stays in `n`, so only the shorter side's slots are rewritten.
    fn cut(&mut self, n: u32, at: u32) -> (u32, u32) {
        let node = self.node(n);
        let off = (at - node.start) as usize;
        let keep_left = off * 2 >= node.hashes.len();
        let (ks, set) = (node.ksi(), node.set);
        let fresh = if keep_left {
            let mut new = Node {
                hashes: node.hashes[off..].into(),
                parent: 0,
                start: at,
                set,
                next: node.next,
                ks,
                set_prev: NIL,
                set_next: NIL,
            };
            new.set_parent(node.hashes[off - 1]);
            let id = self.alloc(new);
            let node = self.node_mut(n);
            node.hashes.truncate(off);
            node.next = id;
            shrink(&mut node.hashes);
            id
        } else {
            let new = Node {
                hashes: node.hashes[..off].into(),
                parent: node.parent,
                start: node.start,
                set,
                next: n,
                ks: node.ks,
                set_prev: NIL,
                set_next: NIL,
            };
            let id = self.alloc(new);
            let node = self.node_mut(n);
            let parent = node.hashes[off - 1];
            node.set_parent(parent);
            node.hashes.drain(..off);
            node.start = at;
            shrink(&mut node.hashes);
            self.retarget_left(n, id);
            id
        };
        self.sets.acquire(set);
        self.repoint(n, fresh);
        if keep_left {
            (n, fresh)
        } else {
            (fresh, n)
        }
    }

    /// Points the slots of every block of run `new` (which were `old`'s) at `new`.
    fn repoint(&mut self, old: u32, new: u32) {
        let node = &self.nodes[new as usize];
        for (i, &h) in node.hashes.iter().enumerate() {
            let pos = node.start + i as u32;
            let hash = block_hash(node.ksi() as u64, h);
            self.table.move_slot(hash, pos, old, new);
        }
    }

    /// Removes the slots of run `n`'s blocks in `[a, b)`.
    fn unmap(&mut self, n: u32, a: u32, b: u32) {
        let node = &self.nodes[n as usize];
        for pos in a..b {
            let h = node.hashes[(pos - node.start) as usize];
            self.table.remove(block_hash(node.ksi() as u64, h), n, pos);
        }
    }

    /// Whether run `b` continues run `a`'s chain right after it.
    fn follows(&self, a: u32, b: u32) -> bool {
        let (x, y) = (self.node(a), self.node(b));
        a != b
            && y.set != NIL
            && y.ksi() == x.ksi()
            && y.has_parent()
            && y.start == x.end()
            && x.hashes.last() == Some(&y.parent)
    }

    /// Merges run `n` with chain neighbours that have the same set; returns the survivor.
    fn merge_around(&mut self, n: u32) -> u32 {
        let n = self.merge_left(n);
        self.merge_right(n)
    }

    fn merge_left(&mut self, n: u32) -> u32 {
        let node = self.node(n);
        if !node.has_parent() || node.start == 0 {
            return n;
        }
        let Some(l) = self.find(node.ksi(), node.start - 1, node.parent) else {
            return n;
        };
        if self.node(l).end() != node.start {
            return n; // the parent sits inside a run that goes on along another branch
        }
        if self.node(l).set == node.set {
            return self.merge(l, n);
        }
        self.node_mut(l).next = n;
        n
    }

    fn merge_right(&mut self, n: u32) -> u32 {
        let nx = self.node(n).next;
        if nx != NIL && self.follows(n, nx) && self.node(nx).set == self.node(n).set {
            return self.merge(n, nx);
        }
        n
    }

    /// Joins run `b` onto run `a` (`b` follows `a`, equal sets); the longer one survives.
    fn merge(&mut self, a: u32, b: u32) -> u32 {
        let (keep, gone) = if self.node(a).len() >= self.node(b).len() {
            (a, b)
        } else {
            (b, a)
        };
        let moved = std::mem::take(&mut self.node_mut(gone).hashes);
        let g = self.node(gone);
        let (g_start, g_parent, g_ks, g_next) = (g.start, g.parent, g.ks, g.next);
        let k = self.node_mut(keep);
        if keep == a {
            grow(&mut k.hashes, moved.len());
            k.hashes.extend_from_slice(&moved);
            k.next = g_next;
        } else {
            k.hashes.insert_from_slice(0, &moved);
            k.start = g_start;
            k.parent = g_parent;
            k.ks = g_ks;
        }
        let ks = k.ksi() as u64;
        for (i, &h) in moved.iter().enumerate() {
            let pos = g_start + i as u32;
            self.table.move_slot(block_hash(ks, h), pos, gone, keep);
        }
        let s = self.unset(gone);
        self.sets.release(s);
        self.free_node(gone);
        if keep == b {
            self.retarget_left(a, b);
        }
        keep
    }

    /// Run `new` now begins where run `old` began: the left neighbour's `next` hint, if it
    /// named `old`, is pointed at `new` (so hints survive cuts and merges).
    fn retarget_left(&mut self, old: u32, new: u32) {
        let node = self.node(new);
        if !node.has_parent() || node.start == 0 {
            return;
        }
        if let Some(l) = self.find(node.ksi(), node.start - 1, node.parent) {
            if self.node(l).next == old {
                self.node_mut(l).next = new;
            }
        }
    }

    /// Removes run `m` and all its blocks.
    fn delete_node(&mut self, m: u32) {
        let (start, end) = (self.node(m).start, self.node(m).end());
        self.unmap(m, start, end);
        let len = self.node(m).len() as i64;
        let set = self.unset(m);
        for i in 0..self.sets.len(set) {
            let h = self.sets.holders(set)[i];
            self.count(h, -len);
        }
        self.memberships -= len as u64 * self.sets.len(set) as u64;
        self.sets.release(set);
        self.node_mut(m).hashes = SmallVec::new();
        self.free_node(m);
        self.table.after_removals(&self.nodes, len as usize);
    }

    /// Returns run `id` (already emptied) to the free list.
    fn free_node(&mut self, id: u32) {
        self.keyspaces.release(self.node(id).ksi());
        self.free.push(id);
    }

    /// Stores a new run, in its set's list when it has a set.
    fn alloc(&mut self, node: Node) -> u32 {
        self.keyspaces.acquire(node.ksi());
        let listed = node.set != NIL;
        let id = match self.free.pop() {
            Some(id) => {
                self.nodes[id as usize] = node;
                id
            }
            None => {
                self.nodes.push(node);
                (self.nodes.len() - 1) as u32
            }
        };
        if listed {
            self.enlist(id);
        }
        id
    }

    /// Makes room for `more` slots (see [`block_table`]).
    fn reserve_slots(&mut self, more: usize) {
        self.table.reserve(&self.nodes, more);
    }

    /// Every live run, for a snapshot; [`BlockIndex::import`] rebuilds the same index.
    pub fn export(&self) -> Vec<crate::RunImage> {
        let mut out = Vec::new();
        self.export_some(&mut 0, u64::MAX, |_| true, &mut out);
        out
    }

    /// Exports about `budget` blocks' worth of runs from run slot `*cursor` on, with only
    /// the holders whose worker `keep` selects (runs left with none are skipped); true once
    /// every run is out. Lets a caller export a large index in slices.
    pub fn export_some(
        &self,
        cursor: &mut usize,
        budget: u64,
        keep: impl Fn(WorkerId) -> bool,
        out: &mut Vec<crate::RunImage>,
    ) -> bool {
        let mut spent = 0u64;
        while *cursor < self.nodes.len() && spent < budget {
            let n = &self.nodes[*cursor];
            *cursor += 1;
            if n.set == NIL {
                continue;
            }
            spent += n.len();
            let holders: Vec<(u32, u8)> = self
                .sets
                .holders(n.set)
                .iter()
                .map(|&h| Holder::unpack(h))
                .filter(|h| keep(h.worker))
                .map(|h| (h.worker, h.slot()))
                .collect();
            if holders.is_empty() {
                continue;
            }
            out.push(crate::RunImage {
                ks: *self.keyspaces.key(n.ksi()),
                start: n.start,
                parent: n.has_parent().then_some(n.parent),
                hashes: n.hashes.to_vec(),
                holders,
            });
        }
        *cursor >= self.nodes.len()
    }

    /// Inserts an exported run.
    pub fn import(&mut self, run: &crate::RunImage) -> Result<(), IndexError> {
        for &(worker, slot) in &run.holders {
            let holder = Holder::from_slot(worker, slot)
                .ok_or(IndexError::BadHolder { worker, lane: slot })?;
            self.insert(run.ks, holder, run.start, run.parent, &run.hashes)?;
        }
        Ok(())
    }

    /// Every live run as (start, length, holders); for tests and debugging.
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
        let mut held: FastMap<u32, u64> = FastMap::default();
        let mut users: FastMap<u32, u32> = FastMap::default();
        for (n, node) in self.nodes.iter().enumerate() {
            if node.set == NIL {
                continue;
            }
            *users.entry(node.ksi()).or_default() += 1;
            if node.hashes.is_empty() {
                return Err(format!("run {n} is empty"));
            }
            let holders = self.sets.holders(node.set);
            if holders.is_empty() || holders.windows(2).any(|w| w[0] >= w[1]) {
                return Err(format!("run {n} has a bad holder set {holders:?}"));
            }
            for (i, &h) in node.hashes.iter().enumerate() {
                let pos = node.start + i as u32;
                if self.find(node.ksi(), pos, h) != Some(n as u32) {
                    return Err(format!("block {i} of run {n} is not mapped to it"));
                }
            }
            blocks += node.hashes.len();
            memberships += node.len() * holders.len() as u64;
            for &h in holders {
                *held.entry(h).or_insert(0) += node.len();
            }
        }
        self.table.check(&self.nodes)?;
        self.check_set_lists()?;
        if blocks != self.table.len() {
            return Err(format!("{} slots for {blocks} blocks", self.table.len()));
        }
        if memberships != self.memberships {
            return Err(format!(
                "membership count {} but runs hold {memberships}",
                self.memberships
            ));
        }
        self.keyspaces.check(&users)?;
        let counts: FastMap<u32, u64> = self.held.iter().map(|(&h, c)| (h, c.blocks)).collect();
        if held != counts {
            return Err(format!(
                "per-holder counts {counts:?} but runs hold {held:?}"
            ));
        }
        Ok(())
    }
}

impl BlockIndex {
    /// Each live run is in its set's list once, and the lists hold nothing else.
    fn check_set_lists(&self) -> Result<(), String> {
        let mut listed = 0usize;
        for (s, &head) in self.set_runs.iter().enumerate() {
            let (mut n, mut prev) = (head, NIL);
            while n != NIL {
                let node = self.node(n);
                if node.set as usize != s || node.set_prev != prev {
                    return Err(format!("run {n} is misplaced in the list of set {s}"));
                }
                listed += 1;
                if listed > self.nodes.len() {
                    return Err(format!("the list of set {s} loops"));
                }
                (prev, n) = (n, node.set_next);
            }
        }
        if listed != self.runs() {
            return Err(format!("{listed} runs listed of {}", self.runs()));
        }
        Ok(())
    }
}

/// Makes room for `more` hashes with 1/8 headroom: runs grown a block at a time end up
/// about as tight as runs stored in one piece, and each append stays amortized O(1).
fn grow(hashes: &mut SmallVec<[u64; 2]>, more: usize) {
    let want = hashes.len() + more;
    if want > hashes.capacity() {
        hashes.reserve_exact(want - hashes.len() + want / 8);
    }
}

/// Releases a run's spare hash capacity once it is mostly unused.
fn shrink(hashes: &mut SmallVec<[u64; 2]>) {
    if hashes.capacity() > hashes.len() + hashes.len() / 4 + 4 {
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

    /// Per (worker, lane): the covered runs `[a, b)`.
    type Held = Vec<(u32, u8, Vec<(u32, u32)>)>;

    /// Per (worker, lane): covered runs of `chain`.
    fn cov(ix: &BlockIndex, ks: u64, chain: &[u64]) -> Held {
        let mut out: std::collections::BTreeMap<(u32, u8), Vec<(u32, u32)>> = Default::default();
        ix.walk(ks, chain, |a, b, hs| {
            for &h in hs {
                let h = Holder::unpack(h);
                let runs = out.entry((h.worker, h.lane)).or_default();
                match runs.last_mut() {
                    Some(r) if r.1 == a => r.1 = b,
                    _ => runs.push((a, b)),
                }
            }
        });
        out.into_iter().map(|((w, l), r)| (w, l, r)).collect()
    }

    const A: Holder = Holder {
        worker: 1,
        lane: 0,
        tier: kvix_wire::Tier::Gpu,
    };
    const B: Holder = Holder {
        worker: 2,
        lane: 0,
        tier: kvix_wire::Tier::Gpu,
    };

    #[test]
    fn a_growing_or_draining_table_is_rebuilt_a_slice_per_write() {
        let mut ix = BlockIndex::new();
        let chains = 6000u64;
        for c in 0..chains {
            let chain: Vec<u64> = (0..32).map(|i| c << 20 | i).collect();
            ix.insert(7, A, 0, None, &chain).unwrap();
            if c % 1000 == 999 {
                ix.check_invariants().unwrap();
            }
        }
        // Then all but a few chains go (the table shrinks, also a slice at a time).
        for c in 0..chains - 50 {
            let chain: Vec<u64> = (0..32).map(|i| c << 20 | i).collect();
            assert_eq!(ix.remove(7, A, &chain).unwrap(), 32);
            if c % 1000 == 999 {
                ix.check_invariants().unwrap();
            }
        }
        ix.check_invariants().unwrap();
        assert_eq!(ix.blocks(), 50 * 32);
        // 192,000 blocks went in through tables of up to 262,144 buckets; no write put
        // more than its share (64 slots a block) in a rebuild.
        assert!(
            ix.table.most_walked <= 64 * 32,
            "one write walked {} slots",
            ix.table.most_walked
        );
        assert!(ix.table.table().capacity() < 8192, "the table shrank");
    }

    /// One run of 300,000 blocks, stored 512 at a time as a slice of a huge event batch
    /// stores them: the table grows under it, and no slice walks more than its share of
    /// that run (the walk used to take a whole run at once: 10 ms for half a million
    /// blocks, in one slice of a write).
    #[test]
    fn a_long_run_is_walked_in_part() {
        let mut ix = BlockIndex::new();
        let chain: Vec<u64> = (0..300_000u64)
            .map(|i| i.wrapping_mul(0x9e37_79b9_7f4a_7c15))
            .collect();
        for (i, part) in chain.chunks(512).enumerate() {
            let parent = (i > 0).then(|| chain[i * 512 - 1]);
            ix.insert(7, A, (i * 512) as u32, parent, part).unwrap();
            if i % 97 == 0 {
                ix.check_invariants().unwrap();
            }
        }
        assert_eq!(ix.runs(), 1);
        assert!(
            ix.table.most_walked <= 64 * 512,
            "one slice walked {}",
            ix.table.most_walked
        );
        for part in chain.chunks(512).rev() {
            ix.remove(7, A, part).unwrap();
        }
        ix.check_invariants().unwrap();
        assert_eq!(ix.blocks(), 0);
    }

    #[test]
    fn shared_prefix_is_one_run_and_splits_merge_back() {
        let mut ix = BlockIndex::new();
        let chain: Vec<u64> = (100..110).collect();
        ix.insert(7, A, 0, None, &chain).unwrap();
        ix.insert(7, B, 0, None, &chain[..4]).unwrap();
        assert_eq!(ix.runs(), 2);
        assert_eq!(ix.blocks(), 10);
        assert_eq!(ix.memberships(), 14);
        assert_eq!((ix.held_by(A), ix.held_by(B)), (10, 4));
        ix.check_invariants().unwrap();
        assert_eq!(
            cov(&ix, 7, &chain),
            vec![(1, 0, vec![(0, 10)]), (2, 0, vec![(0, 4)])]
        );
        // B joins the rest in a separate store: the runs merge back into one.
        ix.insert(7, B, 4, Some(chain[3]), &chain[4..]).unwrap();
        assert_eq!(ix.runs(), 1);
        ix.check_invariants().unwrap();
        // Tail evictions by A leave B's blocks as one run again.
        for p in (6..10).rev() {
            assert_eq!(ix.remove(7, A, &chain[p..p + 1]).unwrap(), 1);
            ix.check_invariants().unwrap();
        }
        assert_eq!(ix.runs(), 2, "{:?}", ix.dump());
        assert_eq!(ix.remove(7, A, &chain[9..]).unwrap(), 0);
        ix.drop_worker(2);
        ix.check_invariants().unwrap();
        assert_eq!(ix.blocks(), 6);
        assert_eq!(cov(&ix, 7, &chain), vec![(1, 0, vec![(0, 6)])]);
        ix.drop_holder(A);
        assert_eq!((ix.blocks(), ix.memberships(), ix.runs()), (0, 0, 0));
    }

    #[test]
    fn one_block_stores_naming_their_parent_extend_one_run() {
        let chain: Vec<u64> = (500..1000).collect();
        let mut whole = BlockIndex::new();
        whole.insert(3, A, 0, None, &chain).unwrap();
        let mut decode = BlockIndex::new();
        decode.insert(3, A, 0, None, &chain[..1]).unwrap();
        for p in 1..chain.len() {
            decode
                .insert(3, A, p as u32, Some(chain[p - 1]), &chain[p..p + 1])
                .unwrap();
        }
        decode.check_invariants().unwrap();
        assert_eq!(decode.dump(), whole.dump());
        assert_eq!(decode.runs(), 1);
        // Without the parent, a mid-chain store is its own run.
        let mut blind = BlockIndex::new();
        blind.insert(3, A, 0, None, &chain[..1]).unwrap();
        blind.insert(3, A, 1, None, &chain[1..2]).unwrap();
        assert_eq!(blind.runs(), 2);
    }

    #[test]
    fn queries_skip_gaps_and_wrong_positions() {
        let mut ix = BlockIndex::new();
        let chain: Vec<u64> = (0..20).map(|i| 1000 + i).collect();
        ix.insert(1, A, 8, None, &chain[8..12]).unwrap();
        ix.insert(1, B, 15, None, &chain[15..18]).unwrap();
        assert_eq!(
            cov(&ix, 1, &chain),
            vec![(1, 0, vec![(8, 12)]), (2, 0, vec![(15, 18)])]
        );
        // A hash at the wrong position or keyspace is not a match.
        assert_eq!(cov(&ix, 1, &chain[1..]), vec![]);
        assert_eq!(cov(&ix, 2, &chain), vec![]);
        // A diverging chain matches only its shared prefix.
        let mut other = chain.clone();
        other[10..].iter_mut().for_each(|h| *h += 1 << 40);
        assert_eq!(cov(&ix, 1, &other[..12]), vec![(1, 0, vec![(8, 10)])]);
    }

    #[test]
    fn middle_removal_sweep_and_bad_input() {
        let mut ix = BlockIndex::new();
        let chain: Vec<u64> = (0..9).map(|i| 77 + i).collect();
        ix.insert(3, A, 0, None, &chain).unwrap();
        ix.insert(3, B, 2, None, &chain[2..7]).unwrap();
        assert_eq!(ix.remove(3, A, &chain[4..5]).unwrap(), 1);
        ix.check_invariants().unwrap();
        assert_eq!(
            cov(&ix, 3, &chain),
            vec![(1, 0, vec![(0, 4), (5, 9)]), (2, 0, vec![(2, 7)])]
        );
        ix.insert(3, A, 3, None, &chain[3..6]).unwrap();
        ix.check_invariants().unwrap();
        // A sweep takes the holder off every run it is in.
        let before = ix.swept_runs();
        assert_eq!(ix.sweep(A, u64::MAX), (9, true));
        assert_eq!(
            ix.swept_runs() - before,
            3,
            "A's runs: [0, 2), [2, 7) and [7, 9)"
        );
        ix.check_invariants().unwrap();
        assert_eq!(ix.held_by(A), 0);
        assert_eq!(cov(&ix, 3, &chain), vec![(2, 0, vec![(2, 7)])]);
        assert!(ix
            .insert(3, Holder::new(1 << 21, 0), 0, None, &chain)
            .is_err());
        assert!(ix.insert(3, Holder::new(1, 16), 0, None, &chain).is_err());
        assert!(ix.insert(3, A, u32::MAX - 2, None, &chain).is_err());
    }

    #[test]
    fn a_sweep_walks_only_the_runs_of_the_sets_holding_its_holder() {
        let mut ix = BlockIndex::new();
        let prefix: Vec<u64> = (0..8).map(|i| 1 << 40 | i).collect();
        for w in 0..200u32 {
            for c in 0..5u64 {
                let tail: Vec<u64> = (0..6).map(|i| (w as u64) << 20 | c << 8 | i).collect();
                ix.insert(3, Holder::new(w, 0), 0, None, &prefix).unwrap();
                ix.insert(3, Holder::new(w, 0), 8, Some(prefix[7]), &tail)
                    .unwrap();
            }
        }
        let runs = ix.runs();
        assert_eq!(runs, 1 + 200 * 5);
        let before = ix.swept_runs();
        ix.drop_holder(Holder::new(7, 0));
        // Its own five tails and the shared prefix, not the other 995 runs.
        assert_eq!(ix.swept_runs() - before, 6);
        assert_eq!((ix.runs(), ix.held_by(Holder::new(7, 0))), (runs - 5, 0));
        ix.check_invariants().unwrap();
        // In slices: at least one run a call, never more than the budget past one run.
        let mut calls = 0;
        while !ix.sweep(Holder::new(8, 0), 1).1 {
            calls += 1;
        }
        assert_eq!((calls, ix.held_by(Holder::new(8, 0))), (5, 0));
        ix.check_invariants().unwrap();
    }

    #[test]
    fn removals_take_stretches_in_either_direction() {
        let mut ix = BlockIndex::new();
        let chain: Vec<u64> = (40..60).collect();
        ix.insert(3, A, 0, None, &chain).unwrap();
        ix.insert(3, B, 0, None, &chain[..4]).unwrap();
        // Tail first (how engines evict), then a middle stretch upwards, then strays.
        let tail: Vec<u64> = chain[15..].iter().rev().copied().collect();
        assert_eq!(ix.remove(3, A, &tail).unwrap(), 5);
        assert_eq!(ix.remove(3, A, &chain[6..9]).unwrap(), 3);
        assert_eq!(ix.remove(3, A, &[chain[1], 999, chain[11]]).unwrap(), 2);
        ix.check_invariants().unwrap();
        assert_eq!(
            cov(&ix, 3, &chain),
            vec![
                (1, 0, vec![(0, 1), (2, 6), (9, 11), (12, 15)]),
                (2, 0, vec![(0, 4)])
            ]
        );
    }

    #[test]
    fn colliding_chain_hashes_are_two_blocks() {
        // The same hash at two positions (a 64-bit collision) gives two distinct blocks.
        let mut ix = BlockIndex::new();
        ix.insert(1, A, 0, None, &[5, 6, 5]).unwrap();
        ix.insert(1, B, 0, None, &[5]).unwrap();
        ix.check_invariants().unwrap();
        assert_eq!(ix.blocks(), 3);
        assert!(ix.holds(1, A, 2, 5) && !ix.holds(1, B, 2, 5));
    }
}
