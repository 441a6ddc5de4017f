//! An open-addressing hash table whose keys live with (or behind) its values, and which
//! can prefetch a bucket before it is needed.
//!
//! The engine's two per-block tables (the index's block table and the event feeds' names)
//! are far larger than the caches, so every access is a miss. A store or removal knows
//! all of its blocks' hashes up front: [`Table::prefetch`] lets it start every miss of a
//! batch before resolving the first, so they overlap instead of queueing. hashbrown
//! exposes no bucket addresses, hence this table (see docs/design.md for the measurement).
//!
//! Layout: one tag byte per bucket (empty, deleted, or 7 bits of the hash) and the values
//! in a parallel array. Buckets come in groups of 16 whose tags are compared at once
//! (SSE2 where there is one); a probe walks groups from the one its hash picks, touches a
//! value only on a tag match, and stops at a group with an empty bucket. Keys are
//! compared by a closure, as in `hashbrown::HashTable`: a value may hold its key, or name
//! where the key lives.
//!
//! Invariant: no value lives past a group that has an empty bucket, counting from the
//! group its hash picks. An insert takes the first free bucket from there, so it only
//! passes groups that are wholly live; a removal empties its bucket only when the group
//! has an empty bucket already (else it leaves a tombstone).

const EMPTY: u8 = 0;
const DELETED: u8 = 1;
const GROUP: usize = 16;
/// Buckets may be filled (live + deleted) to this fraction before the table grows.
const LOAD_NUM: usize = 7;
const LOAD_DEN: usize = 8;

fn tag_of(hash: u64) -> u8 {
    (hash >> 57) as u8 | 0x80
}

/// Values whose all-zero bytes are a valid value: a new table's buckets are zeroed memory
/// straight from the allocator (the kernel's zero pages), not written one by one.
///
/// # Safety
/// The all-zero bit pattern must be a valid `Self`.
pub(crate) unsafe trait Zeroable: Copy {}

// SAFETY: plain integers.
unsafe impl Zeroable for u64 {}
// SAFETY: plain integers.
unsafe impl Zeroable for u32 {}
// SAFETY: plain integers.
unsafe impl Zeroable for (u64, u64) {}

/// See the module docs. `V` is small and `Copy` (an id, a pair of ids, a key and value).
#[derive(Debug, Clone)]
pub(crate) struct Table<V> {
    tags: Box<[u8]>,
    vals: Box<[V]>,
    mask: usize,
    len: usize,
    deleted: usize,
}

impl<V: Zeroable> Default for Table<V> {
    fn default() -> Self {
        Self::with_capacity(0)
    }
}

impl<V: Zeroable> Table<V> {
    /// A table that holds `capacity` values before it must grow.
    pub(crate) fn with_capacity(capacity: usize) -> Self {
        let buckets = Self::buckets_for(capacity);
        // SAFETY: `V: Zeroable`.
        let vals = unsafe { Box::<[V]>::new_zeroed_slice(buckets).assume_init() };
        Table {
            tags: vec![EMPTY; buckets].into_boxed_slice(),
            vals,
            mask: buckets.wrapping_sub(1),
            len: 0,
            deleted: 0,
        }
    }

    /// Buckets a table of `capacity` values has.
    fn buckets_for(capacity: usize) -> usize {
        if capacity == 0 {
            0
        } else {
            (capacity * LOAD_DEN)
                .div_ceil(LOAD_NUM)
                .next_power_of_two()
                .max(GROUP)
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Buckets left as tombstones by removals.
    pub(crate) fn deleted(&self) -> usize {
        self.deleted
    }

    /// Values it holds before it must grow.
    pub(crate) fn capacity(&self) -> usize {
        self.tags.len() * LOAD_NUM / LOAD_DEN
    }

    /// Whether `more` inserts fit without growing (deleted buckets count as used).
    pub(crate) fn fits(&self, more: usize) -> bool {
        self.len + self.deleted + more <= self.capacity()
    }

    /// Heap bytes held.
    pub(crate) fn bytes(&self) -> usize {
        self.tags.len() * (1 + std::mem::size_of::<V>())
    }

    /// The first group a probe for `hash` reads.
    #[inline]
    fn home(&self, hash: u64) -> usize {
        hash as usize & self.mask & !(GROUP - 1)
    }

    /// Starts loading the group where a probe for `hash` begins.
    #[inline]
    pub(crate) fn prefetch(&self, hash: u64) {
        if self.tags.is_empty() {
            return;
        }
        let g = self.home(hash);
        prefetch(self.tags.as_ptr().wrapping_add(g));
        prefetch(
            self.vals
                .as_ptr()
                .wrapping_add(g + (hash as usize & (GROUP - 1))),
        );
    }

    /// The bucket of the value `eq` accepts among those hashed to `hash`.
    #[inline]
    fn bucket(&self, hash: u64, mut eq: impl FnMut(&V) -> bool) -> Option<usize> {
        if self.tags.is_empty() {
            return None;
        }
        let tag = tag_of(hash);
        let mut g = self.home(hash);
        loop {
            let (mut hits, empty) = masks(&self.tags[g..g + GROUP], tag);
            while hits != 0 {
                let i = g + hits.trailing_zeros() as usize;
                if eq(&self.vals[i]) {
                    return Some(i);
                }
                hits &= hits - 1;
            }
            if empty != 0 {
                return None;
            }
            g = (g + GROUP) & self.mask;
        }
    }

    pub(crate) fn find(&self, hash: u64, eq: impl FnMut(&V) -> bool) -> Option<&V> {
        self.bucket(hash, eq).map(|i| &self.vals[i])
    }

    pub(crate) fn find_mut(&mut self, hash: u64, eq: impl FnMut(&V) -> bool) -> Option<&mut V> {
        self.bucket(hash, eq).map(|i| &mut self.vals[i])
    }

    /// Every value hashed to `hash` (the candidates `find` would compare).
    pub(crate) fn candidates(&self, hash: u64) -> impl Iterator<Item = &V> + '_ {
        let tag = tag_of(hash);
        let mut g = self.home(hash);
        let (mut hits, mut base, mut done) = (0u32, 0usize, self.tags.is_empty());
        std::iter::from_fn(move || loop {
            if hits != 0 {
                let i = base + hits.trailing_zeros() as usize;
                hits &= hits - 1;
                return Some(&self.vals[i]);
            }
            if done {
                return None;
            }
            let (h, empty) = masks(&self.tags[g..g + GROUP], tag);
            (hits, base, done) = (h, g, empty != 0);
            g = (g + GROUP) & self.mask;
        })
    }

    /// Adds `v` unless `eq` accepts a value already hashed to `hash` (then that value is
    /// returned and the table is unchanged), in one probe; the caller made room.
    pub(crate) fn insert_absent(
        &mut self,
        hash: u64,
        mut eq: impl FnMut(&V) -> bool,
        v: V,
    ) -> Option<&mut V> {
        debug_assert!(self.fits(1), "insert without room");
        let tag = tag_of(hash);
        let mut g = self.home(hash);
        let mut free = None;
        loop {
            let group = &self.tags[g..g + GROUP];
            let (mut hits, empty) = masks(group, tag);
            while hits != 0 {
                let i = g + hits.trailing_zeros() as usize;
                if eq(&self.vals[i]) {
                    return Some(&mut self.vals[i]);
                }
                hits &= hits - 1;
            }
            if free.is_none() {
                let f = free_mask(group);
                if f != 0 {
                    free = Some(g + f.trailing_zeros() as usize);
                }
            }
            if empty != 0 {
                break;
            }
            g = (g + GROUP) & self.mask;
        }
        let i = free.expect("a probe that met an empty bucket met a free one");
        if self.tags[i] == DELETED {
            self.deleted -= 1;
        }
        self.tags[i] = tag;
        self.vals[i] = v;
        self.len += 1;
        None
    }

    /// Adds `v`, which must not be in the table yet; the caller made room ([`Table::fits`]).
    pub(crate) fn insert_new(&mut self, hash: u64, v: V) {
        debug_assert!(self.fits(1), "insert without room");
        let mut g = self.home(hash);
        let i = loop {
            let free = free_mask(&self.tags[g..g + GROUP]);
            if free != 0 {
                break g + free.trailing_zeros() as usize;
            }
            g = (g + GROUP) & self.mask;
        };
        if self.tags[i] == DELETED {
            self.deleted -= 1;
        }
        self.tags[i] = tag_of(hash);
        self.vals[i] = v;
        self.len += 1;
    }

    /// Removes and returns the value `eq` accepts among those hashed to `hash`.
    pub(crate) fn remove(&mut self, hash: u64, eq: impl FnMut(&V) -> bool) -> Option<V> {
        let i = self.bucket(hash, eq)?;
        // A group with an empty bucket ends every probe that reaches it (see the module
        // docs): its other buckets can be emptied too, instead of left as tombstones.
        let g = i & !(GROUP - 1);
        if masks(&self.tags[g..g + GROUP], 0).1 != 0 {
            self.tags[i] = EMPTY;
        } else {
            self.tags[i] = DELETED;
            self.deleted += 1;
        }
        self.len -= 1;
        Some(self.vals[i])
    }

    /// Every value, in bucket order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = &V> + '_ {
        self.tags
            .iter()
            .zip(self.vals.iter())
            .filter(|(t, _)| **t >= 0x80)
            .map(|(_, v)| v)
    }

    /// Makes room for `more` inserts, rehashing (values hashed by `hash_of`) into a table
    /// twice the size when full, or the same size when tombstones filled it.
    pub(crate) fn reserve(&mut self, more: usize, hash_of: impl Fn(&V) -> u64) {
        if self.fits(more) {
            return;
        }
        let cap = grown(self.len + more, self.capacity());
        self.rebuild(cap, hash_of);
    }

    /// Gives memory back once the table is mostly empty (it halves at most).
    pub(crate) fn shrink(&mut self, hash_of: impl Fn(&V) -> u64) {
        if let Some(capacity) = self.shrunk() {
            self.rebuild(capacity, hash_of);
        }
    }

    /// The capacity to rebuild at once the table is mostly empty (it halves at most).
    pub(crate) fn shrunk(&self) -> Option<usize> {
        (self.capacity() > 64 && self.len < self.capacity() / 4).then_some(self.len * 2)
    }

    fn rebuild(&mut self, capacity: usize, hash_of: impl Fn(&V) -> u64) {
        let mut t = Self::with_capacity(capacity);
        t.extend(self.iter().map(|v| (hash_of(v), *v)));
        *self = t;
    }

    /// Adds values known to be absent (a rebuild), prefetching a few buckets ahead.
    pub(crate) fn extend(&mut self, values: impl Iterator<Item = (u64, V)>) {
        const AHEAD: usize = 16;
        let mut ring = [(0u64, None::<V>); AHEAD];
        for (n, (hash, v)) in values.enumerate() {
            self.prefetch(hash);
            let slot = &mut ring[n % AHEAD];
            if let (h, Some(old)) = std::mem::replace(slot, (hash, Some(v))) {
                self.insert_new(h, old);
            }
        }
        for (h, v) in ring {
            if let Some(v) = v {
                self.insert_new(h, v);
            }
        }
    }
}

/// The capacity to rebuild at for `need` values: the same when tombstones filled the
/// table but live values fill at most 3/4 of it (under churn the size stays flat),
/// else twice as much.
pub(crate) fn grown(need: usize, capacity: usize) -> usize {
    if need <= capacity / 4 * 3 {
        capacity
    } else {
        (capacity * 2).max(need)
    }
}

/// A table's memory, made ready a slice at a time: zeroing a large table at once (and
/// the page faults of fresh memory) held its caller for milliseconds.
pub(crate) struct Unbuilt<V> {
    tags: Box<[std::mem::MaybeUninit<u8>]>,
    vals: Box<[std::mem::MaybeUninit<V>]>,
    /// Buckets whose tag and value are zeroed.
    ready: usize,
}

impl<V: Zeroable> Unbuilt<V> {
    /// The memory of a table that holds `capacity` values, not yet zeroed.
    pub(crate) fn new(capacity: usize) -> Self {
        let buckets = Table::<V>::buckets_for(capacity);
        Unbuilt {
            tags: Box::new_uninit_slice(buckets),
            vals: Box::new_uninit_slice(buckets),
            ready: 0,
        }
    }

    /// Zeroes about `bytes` more (at least one bucket); true once all are.
    pub(crate) fn prepare(&mut self, bytes: usize) -> bool {
        let per = 1 + std::mem::size_of::<V>();
        let end = self.ready.saturating_add(bytes.div_ceil(per).max(1));
        let end = end.min(self.tags.len());
        self.tags[self.ready..end].fill(std::mem::MaybeUninit::new(EMPTY));
        self.vals[self.ready..end].fill(std::mem::MaybeUninit::zeroed());
        self.ready = end;
        end == self.tags.len()
    }

    /// The empty table, once [`Unbuilt::prepare`] has zeroed it all.
    pub(crate) fn build(self) -> Table<V> {
        assert_eq!(
            self.ready,
            self.tags.len(),
            "a table built before it was zeroed"
        );
        let buckets = self.tags.len();
        // SAFETY: every bucket's tag and value was written (zeroes; `V: Zeroable`).
        let (tags, vals) = unsafe { (self.tags.assume_init(), self.vals.assume_init()) };
        Table {
            tags,
            vals,
            mask: buckets.wrapping_sub(1),
            len: 0,
            deleted: 0,
        }
    }
}

/// Of a group's 16 tags: which equal `tag`, and which are empty (bit i: tag i).
#[inline]
fn masks(group: &[u8], tag: u8) -> (u32, u32) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `group` holds 16 bytes; SSE2 is part of x86_64.
    unsafe {
        use std::arch::x86_64::*;
        let g = _mm_loadu_si128(group.as_ptr().cast());
        let hits = _mm_movemask_epi8(_mm_cmpeq_epi8(g, _mm_set1_epi8(tag as i8))) as u32;
        let empty = _mm_movemask_epi8(_mm_cmpeq_epi8(g, _mm_setzero_si128())) as u32;
        (hits, empty)
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let (mut hits, mut empty) = (0, 0);
        for (i, &t) in group.iter().enumerate() {
            hits |= ((t == tag) as u32) << i;
            empty |= ((t == EMPTY) as u32) << i;
        }
        (hits, empty)
    }
}

/// Of a group's 16 tags: which are free (empty or deleted: the high bit is clear).
#[inline]
fn free_mask(group: &[u8]) -> u32 {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: as in `masks`.
    unsafe {
        use std::arch::x86_64::*;
        !(_mm_movemask_epi8(_mm_loadu_si128(group.as_ptr().cast())) as u32) & 0xffff
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        group
            .iter()
            .enumerate()
            .fold(0, |m, (i, &t)| m | ((t < 0x80) as u32) << i)
    }
}

#[inline]
fn prefetch<T>(p: *const T) {
    #[cfg(all(target_arch = "x86_64", not(feature = "no-prefetch")))]
    // SAFETY: prefetching is a hint; it never faults, whatever the address.
    unsafe {
        std::arch::x86_64::_mm_prefetch(p.cast::<i8>(), std::arch::x86_64::_MM_HINT_T0);
    }
    #[cfg(any(not(target_arch = "x86_64"), feature = "no-prefetch"))]
    let _ = p;
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use proptest::prelude::*;

    use super::*;
    use crate::hashing::fmix;

    #[test]
    fn a_table_zeroed_a_slice_at_a_time_is_an_empty_table() {
        let mut u = Unbuilt::<u64>::new(1000);
        let mut slices = 0;
        while !u.prepare(100) {
            slices += 1;
        }
        // 2,048 buckets of 9 bytes, 100 bytes (12 buckets) a slice.
        assert_eq!(slices, 2048usize.div_ceil(12) - 1);
        let mut t = u.build();
        assert_eq!((t.len(), t.capacity(), t.iter().count()), (0, 1792, 0));
        for k in 0..1792u64 {
            t.insert_new(k.wrapping_mul(0x9e37_79b9_7f4a_7c15), k);
        }
        assert_eq!(t.iter().count(), 1792);
        assert_eq!(
            t.find(7u64.wrapping_mul(0x9e37_79b9_7f4a_7c15), |&v| v == 7),
            Some(&7)
        );
    }

    #[test]
    fn capacity_doubles_when_full() {
        let t: Table<u64> = Table::with_capacity(100);
        let doubled: Table<u64> = Table::with_capacity(t.capacity() * 2);
        assert_eq!(doubled.tags.len(), t.tags.len() * 2);
        assert_eq!(
            Table::<u64>::with_capacity(t.capacity()).tags.len(),
            t.tags.len()
        );
    }

    #[derive(Debug, Clone, Copy)]
    enum Step {
        Insert(u16),
        Remove(u16),
        Find(u16),
    }

    fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            3 => any::<u16>().prop_map(|k| Step::Insert(k % 600)),
            2 => any::<u16>().prop_map(|k| Step::Remove(k % 600)),
            2 => any::<u16>().prop_map(|k| Step::Find(k % 600)),
        ]
    }

    /// A weak hash for half the keys, so probes collide and wrap around.
    fn hash(k: u64) -> u64 {
        if k.is_multiple_of(2) {
            k % 7
        } else {
            fmix(k)
        }
    }

    proptest! {
        #[test]
        fn table_matches_a_hash_map(steps in prop::collection::vec(step(), 1..2000)) {
            let mut t: Table<(u64, u64)> = Table::default();
            let mut bulk: Table<(u64, u64)> = Table::with_capacity(64);
            bulk.extend((0..20u64).map(|k| (hash(k), (k, k))));
            prop_assert_eq!(bulk.len(), 20);
            prop_assert!((0..20u64).all(|k| bulk.find(hash(k), |e| e.0 == k) == Some(&(k, k))));
            let mut m: HashMap<u64, u64> = HashMap::new();
            for (n, s) in steps.into_iter().enumerate() {
                match s {
                    Step::Insert(k) => {
                        let k = k as u64;
                        if let Some(v) = t.find_mut(hash(k), |e| e.0 == k) {
                            v.1 = n as u64;
                        } else {
                            t.reserve(1, |e| hash(e.0));
                            t.insert_new(hash(k), (k, n as u64));
                        }
                        m.insert(k, n as u64);
                    }
                    Step::Remove(k) => {
                        let k = k as u64;
                        prop_assert_eq!(t.remove(hash(k), |e| e.0 == k).map(|e| e.1), m.remove(&k));
                        t.shrink(|e| hash(e.0));
                    }
                    Step::Find(k) => {
                        let k = k as u64;
                        prop_assert_eq!(t.find(hash(k), |e| e.0 == k).map(|e| e.1), m.get(&k).copied());
                        prop_assert_eq!(t.candidates(hash(k)).filter(|e| e.0 == k).count(), m.contains_key(&k) as usize);
                    }
                }
                prop_assert_eq!(t.len(), m.len());
            }
            let mut all: Vec<(u64, u64)> = t.iter().copied().collect();
            all.sort_unstable();
            let mut want: Vec<(u64, u64)> = m.into_iter().collect();
            want.sort_unstable();
            prop_assert_eq!(all, want);
        }
    }
}
