//! A map from 64-bit keys that are hashes already (engine block hashes) to values kept
//! in a slab, whose lookups can be prefetched.
//!
//! A map with one entry per cached block is far larger than the caches, so each insert
//! misses twice in a `HashMap` (its control bytes, then its bucket), and a store's
//! blocks pay those misses one after another. Here the keys sit in a [`Table`] of 16-byte
//! entries that a caller prefetches for a whole store before it inserts, and the values
//! in a `Vec` that new entries are appended to, so their writes land on lines just used.

use crate::hashing::fmix;
use crate::table::Table;

/// See the module docs.
#[derive(Debug, Clone)]
pub struct KeyMap<T> {
    /// (key, index into `slab`).
    at: Table<(u64, u64)>,
    slab: Vec<T>,
    /// Slab slots whose entry was removed, reused first.
    free: Vec<u32>,
}

impl<T> Default for KeyMap<T> {
    fn default() -> Self {
        KeyMap {
            at: Table::default(),
            slab: Vec::new(),
            free: Vec::new(),
        }
    }
}

impl<T: Default> KeyMap<T> {
    pub fn len(&self) -> usize {
        self.at.len()
    }

    pub fn is_empty(&self) -> bool {
        self.at.len() == 0
    }

    /// Starts loading where `key` would be looked up.
    #[inline]
    pub fn prefetch(&self, key: u64) {
        self.at.prefetch(fmix(key));
    }

    /// Makes room for `more` entries, so that prefetches made before inserting them stay
    /// valid (an insert never moves the table).
    pub fn reserve(&mut self, more: usize) {
        self.at.reserve(more, |e| fmix(e.0));
    }

    pub fn get(&self, key: u64) -> Option<&T> {
        let at = self.at.find(fmix(key), |e| e.0 == key)?;
        Some(&self.slab[at.1 as usize])
    }

    pub fn get_mut(&mut self, key: u64) -> Option<&mut T> {
        let at = self.at.find(fmix(key), |e| e.0 == key)?;
        Some(&mut self.slab[at.1 as usize])
    }

    /// The value of `key`, `make()` inserted first when it has none.
    pub fn get_or_insert_with(&mut self, key: u64, make: impl FnOnce() -> T) -> &mut T {
        self.at.reserve(1, |e| fmix(e.0));
        let next = match self.free.last() {
            Some(&i) => i as u64,
            None => self.slab.len() as u64,
        };
        let i = match self
            .at
            .insert_absent(fmix(key), |e| e.0 == key, (key, next))
        {
            Some(e) => e.1 as usize,
            None => {
                if self.free.pop().is_some() {
                    self.slab[next as usize] = make();
                } else {
                    self.slab.push(make());
                }
                next as usize
            }
        };
        &mut self.slab[i]
    }

    /// Removes `key`'s entry, returning its value.
    pub fn remove(&mut self, key: u64) -> Option<T> {
        let (_, i) = self.at.remove(fmix(key), |e| e.0 == key)?;
        let value = std::mem::take(&mut self.slab[i as usize]);
        self.free.push(i as u32);
        if self.at.len() == 0 {
            *self = KeyMap::default();
        } else if let Some(capacity) = self.at.shrunk() {
            self.compact(capacity);
        }
        Some(value)
    }

    /// Every entry, in no particular order.
    pub fn iter(&self) -> impl Iterator<Item = (u64, &T)> + '_ {
        self.at.iter().map(|&(k, i)| (k, &self.slab[i as usize]))
    }

    /// Rebuilds the table at `capacity` (the table's own shrink rule) and the slab
    /// without its holes.
    fn compact(&mut self, capacity: usize) {
        let mut slab = Vec::with_capacity(self.at.len());
        let mut at = Table::with_capacity(capacity);
        for &(k, i) in self.at.iter() {
            at.insert_new(fmix(k), (k, slab.len() as u64));
            slab.push(std::mem::take(&mut self.slab[i as usize]));
        }
        *self = KeyMap {
            at,
            slab,
            free: Vec::new(),
        };
    }
}

impl<T: Default> FromIterator<(u64, T)> for KeyMap<T> {
    /// Later entries of a key replace earlier ones.
    fn from_iter<I: IntoIterator<Item = (u64, T)>>(entries: I) -> Self {
        let mut map = KeyMap::default();
        for (k, v) in entries {
            *map.get_or_insert_with(k, T::default) = v;
        }
        map
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashMap;

    proptest! {
        #[test]
        fn behaves_as_a_hash_map(ops in prop::collection::vec((0u64..64, any::<bool>(), any::<u32>()), 1..400)) {
            let mut m: KeyMap<u32> = KeyMap::default();
            let mut want: HashMap<u64, u32> = HashMap::new();
            for (k, insert, v) in ops {
                // Keys that collide in their low bits as well as spread ones.
                let key = if k % 2 == 0 { k << 40 } else { k.wrapping_mul(0x9e37_79b9_7f4a_7c15) };
                if insert {
                    *m.get_or_insert_with(key, || v) += 1;
                    *want.entry(key).or_insert(v) += 1;
                } else {
                    prop_assert_eq!(m.remove(key), want.remove(&key));
                }
                prop_assert_eq!(m.len(), want.len());
                prop_assert_eq!(m.get(key), want.get(&key));
            }
            let mut got: Vec<(u64, u32)> = m.iter().map(|(k, v)| (k, *v)).collect();
            let mut all: Vec<(u64, u32)> = want.into_iter().collect();
            got.sort_unstable();
            all.sort_unstable();
            prop_assert_eq!(got, all);
        }
    }

    #[test]
    fn a_drained_map_gives_its_memory_back() {
        let mut m: KeyMap<u64> = (0..10_000u64).map(|k| (k, k)).collect();
        let big = m.at.capacity();
        for k in 0..9_990 {
            assert_eq!(m.remove(k), Some(k));
        }
        assert!(m.at.capacity() < big / 100, "{} of {big}", m.at.capacity());
        assert!(m.slab.len() < 100);
        assert_eq!(m.get(9_995), Some(&9_995));
    }
}
