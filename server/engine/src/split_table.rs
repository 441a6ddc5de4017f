//! The block table: [`Table`]s of at most `LEAF_BUCKETS` buckets, chosen by the top bits
//! of the hash through a directory (extendible hashing). A full leaf splits in two by
//! its next hash bit, so growth costs one leaf's rehash at a time, never the whole
//! table's: doubling one table of 1.8 M blocks held an apply for 80–100 ms (every
//! executor at once, every query behind it); a leaf split rehashes at most 7,168.
//!
//! Values do not hold their hash (a block's slot names its run): a rehash asks the
//! caller's [`Rehash`], so every value held must be hashable whenever the caller
//! inserts or removes. A split reads the values' hashes far apart in memory, so it asks
//! for them to be prefetched a few values ahead.

use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};

use crate::table::{grown, Table, Zeroable};

/// Buckets of a leaf that splits instead of growing (73 KiB of 8-byte values).
static LEAF_BUCKETS: AtomicUsize = AtomicUsize::new(32768);

/// Leaves split from 32 buckets on, so that tests of a few hundred blocks split often
/// (process-wide; call before building indexes).
#[doc(hidden)]
pub fn split_leaves_early() {
    LEAF_BUCKETS.store(32, Relaxed);
}
/// A leaf this deep grows instead (a directory of 2^24 leaves: billions of blocks, or
/// hashes equal in 24 leading bits).
const MAX_DEPTH: u32 = 24;

/// How the values' hashes are found again (they do not hold them).
pub(crate) trait Rehash<V> {
    fn hash(&self, v: &V) -> u64;
    /// Starts loading what [`Rehash::near`] reads first (called 16 values ahead).
    fn far(&self, _v: &V) {}
    /// Starts loading what [`Rehash::hash`] reads (called 8 values ahead).
    fn near(&self, _v: &V) {}
}

impl<V, F: Fn(&V) -> u64> Rehash<V> for F {
    fn hash(&self, v: &V) -> u64 {
        self(v)
    }
}

/// One cache line: a lookup reads the directory, then this.
#[derive(Debug, Clone)]
#[repr(align(64))]
struct Leaf<V> {
    table: Table<V>,
    /// Leading hash bits all its values share.
    depth: u32,
}

#[derive(Debug, Clone)]
pub(crate) struct SplitTable<V> {
    /// The leaf of each `depth`-bit hash prefix (a leaf of depth d appears 2^(depth-d)
    /// times, in one stretch).
    dir: Vec<u32>,
    depth: u32,
    leaves: Vec<Leaf<V>>,
    len: usize,
}

impl<V: Zeroable> Default for SplitTable<V> {
    fn default() -> Self {
        SplitTable {
            dir: vec![0],
            depth: 0,
            leaves: vec![Leaf {
                table: Table::default(),
                depth: 0,
            }],
            len: 0,
        }
    }
}

/// The top `depth` bits of `hash` (0 when `depth` is 0).
#[inline]
fn prefix(hash: u64, depth: u32) -> usize {
    ((hash >> 1) >> (63 - depth)) as usize
}

impl<V: Zeroable> SplitTable<V> {
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Heap bytes held.
    #[cfg(test)]
    pub(crate) fn bytes(&self) -> usize {
        let leaves: usize = self.leaves.iter().map(|l| l.table.bytes()).sum();
        leaves + self.dir.len() * 4 + self.leaves.len() * std::mem::size_of::<Leaf<V>>()
    }

    #[inline]
    fn leaf(&self, hash: u64) -> &Table<V> {
        &self.leaves[self.dir[prefix(hash, self.depth)] as usize].table
    }

    #[inline]
    fn leaf_mut(&mut self, hash: u64) -> &mut Table<V> {
        &mut self.leaves[self.dir[prefix(hash, self.depth)] as usize].table
    }

    #[inline]
    pub(crate) fn prefetch(&self, hash: u64) {
        self.leaf(hash).prefetch(hash);
    }

    pub(crate) fn find(&self, hash: u64, eq: impl FnMut(&V) -> bool) -> Option<&V> {
        self.leaf(hash).find(hash, eq)
    }

    pub(crate) fn find_mut(&mut self, hash: u64, eq: impl FnMut(&V) -> bool) -> Option<&mut V> {
        self.leaf_mut(hash).find_mut(hash, eq)
    }

    pub(crate) fn candidates(&self, hash: u64) -> impl Iterator<Item = &V> + '_ {
        self.leaf(hash).candidates(hash)
    }

    /// Adds `v` unless `eq` accepts a value already hashed to `hash` (that one is returned,
    /// the table unchanged), first making room in its leaf (`hash_of` rehashes).
    pub(crate) fn insert_absent(
        &mut self,
        hash: u64,
        eq: impl FnMut(&V) -> bool,
        v: V,
        hash_of: impl Rehash<V>,
    ) -> Option<&mut V> {
        self.make_room(hash, hash_of);
        let table = &mut self.leaves[self.dir[prefix(hash, self.depth)] as usize].table;
        let found = table.insert_absent(hash, eq, v);
        if found.is_none() {
            self.len += 1;
        }
        found
    }

    /// Removes and returns the value `eq` accepts; a leaf left mostly empty gives memory
    /// back (`hash_of` rehashes), an empty one all of it, and an empty table its leaves.
    pub(crate) fn remove(
        &mut self,
        hash: u64,
        eq: impl FnMut(&V) -> bool,
        hash_of: impl Rehash<V>,
    ) -> Option<V> {
        let table = self.leaf_mut(hash);
        let v = table.remove(hash, eq)?;
        if table.len() == 0 {
            *table = Table::default();
        } else {
            table.shrink(|v| hash_of.hash(v));
        }
        self.len -= 1;
        if self.len == 0 {
            *self = Self::default();
        }
        Some(v)
    }

    /// Makes room for one value hashed to `hash`: its leaf grows while it is smaller than
    /// `LEAF_BUCKETS` (or clears its tombstones), else splits until the half that takes
    /// `hash` has room.
    fn make_room(&mut self, hash: u64, hash_of: impl Rehash<V>) {
        loop {
            let li = self.dir[prefix(hash, self.depth)] as usize;
            let leaf = &mut self.leaves[li];
            if leaf.table.fits(1) {
                return;
            }
            let cap = leaf.table.capacity();
            if grown(leaf.table.len() + 1, cap) == cap
                || cap < LEAF_BUCKETS.load(Relaxed) * 7 / 8
                || leaf.depth >= MAX_DEPTH
                || !self.split(li, hash, &hash_of)
            {
                let leaf = &mut self.leaves[li];
                leaf.table.reserve(1, |v| hash_of.hash(v));
                return;
            }
        }
    }

    /// Splits leaf `li` (the leaf of `hash`) in two by the hash bit after its prefix;
    /// false (nothing changed) when that bit is the same for all its values.
    fn split(&mut self, li: usize, hash: u64, hash_of: &impl Rehash<V>) -> bool {
        let depth = self.leaves[li].depth;
        let table = &self.leaves[li].table;
        let vals: Vec<V> = table.iter().copied().collect();
        let mut hashed: Vec<(u64, V)> = Vec::with_capacity(vals.len());
        for (i, v) in vals.iter().enumerate() {
            if let Some(ahead) = vals.get(i + 16) {
                hash_of.far(ahead);
            }
            if let Some(ahead) = vals.get(i + 8) {
                hash_of.near(ahead);
            }
            hashed.push((hash_of.hash(v), *v));
        }
        let bit = |h: u64| (h >> (63 - depth)) & 1 == 1;
        let highs = hashed.iter().filter(|(h, _)| bit(*h)).count();
        if highs == 0 || highs == hashed.len() {
            return false;
        }
        if depth == self.depth {
            self.dir = (0..self.dir.len() * 2).map(|i| self.dir[i / 2]).collect();
            self.depth += 1;
        }
        let cap = table.capacity();
        let (mut low, mut high) = (Table::with_capacity(cap), Table::with_capacity(cap));
        for (h, v) in hashed.drain(..) {
            if bit(h) {
                high.insert_new(h, v);
            } else {
                low.insert_new(h, v);
            }
        }
        let hi = self.leaves.len() as u32;
        self.leaves[li] = Leaf {
            table: low,
            depth: depth + 1,
        };
        self.leaves.push(Leaf {
            table: high,
            depth: depth + 1,
        });
        // The leaf's stretch of the directory: its upper half now names the high leaf.
        let span = 1usize << (self.depth - depth);
        let first = prefix(hash, depth) << (self.depth - depth);
        for d in &mut self.dir[first + span / 2..first + span] {
            *d = hi;
        }
        true
    }

    /// Every value, leaf by leaf.
    #[cfg(test)]
    pub(crate) fn iter(&self) -> impl Iterator<Item = &V> + '_ {
        self.leaves.iter().flat_map(|l| l.table.iter())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashMap;

    fn hash(k: u64) -> u64 {
        crate::hashing::fmix(k)
    }

    #[test]
    fn a_million_values_split_into_leaves_no_larger_than_the_limit() {
        split_leaves_early();
        let mut t = SplitTable::<u64>::default();
        for k in 0..1_000_000u64 {
            assert!(t
                .insert_absent(hash(k), |&v| v == k, k, |v: &u64| hash(*v))
                .is_none());
        }
        assert_eq!(t.len(), 1_000_000);
        assert!(t.leaves.len() > 100);
        for l in &t.leaves {
            assert!(l.table.capacity() <= LEAF_BUCKETS.load(Relaxed) * 7 / 8);
        }
        for k in (0..1_000_000u64).step_by(7) {
            assert_eq!(t.find(hash(k), |&v| v == k), Some(&k));
        }
        for k in 0..1_000_000u64 {
            assert_eq!(t.remove(hash(k), |&v| v == k, |v: &u64| hash(*v)), Some(k));
        }
        assert_eq!((t.len(), t.iter().count()), (0, 0));
        assert!(t.bytes() < 1 << 10, "{} bytes left when empty", t.bytes());
    }

    #[test]
    fn equal_hashes_grow_a_leaf_past_the_limit_instead_of_splitting_forever() {
        split_leaves_early();
        let mut t = SplitTable::<u64>::default();
        for k in 0..1000 {
            t.insert_absent(7, |&v| v == k, k, |_: &u64| 7);
        }
        assert_eq!(t.len(), 1000);
        assert_eq!(t.candidates(7).count(), 1000);
    }

    #[derive(Debug, Clone)]
    enum Step {
        Insert(u64),
        Remove(u64),
    }

    fn step() -> impl Strategy<Value = Step> {
        // Keys from a small range (repeats and removals of absent keys) or a wide one.
        let key = prop_oneof![0u64..500, any::<u64>()];
        prop_oneof![3 => key.clone().prop_map(Step::Insert), 2 => key.prop_map(Step::Remove)]
    }

    proptest! {
        #[test]
        fn split_table_matches_a_hash_map(steps in prop::collection::vec(step(), 1..3000)) {
            split_leaves_early();
            let mut t = SplitTable::<u64>::default();
            let mut m: HashMap<u64, ()> = HashMap::new();
            for s in steps {
                match s {
                    Step::Insert(k) => {
                        let had = t.insert_absent(hash(k), |&v| v == k, k, |v: &u64| hash(*v)).is_some();
                        prop_assert_eq!(had, m.insert(k, ()).is_some());
                    }
                    Step::Remove(k) => {
                        let got = t.remove(hash(k), |&v| v == k, |v: &u64| hash(*v));
                        prop_assert_eq!(got.is_some(), m.remove(&k).is_some());
                    }
                }
                prop_assert_eq!(t.len(), m.len());
            }
            let mut all: Vec<u64> = t.iter().copied().collect();
            all.sort_unstable();
            let mut want: Vec<u64> = m.keys().copied().collect();
            want.sort_unstable();
            prop_assert_eq!(all, want);
            for k in m.keys() {
                prop_assert_eq!(t.find(hash(*k), |&v| v == *k), Some(k));
            }
        }
    }
}
