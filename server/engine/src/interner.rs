//! Keys (keyspaces) as small indexes, counted by their users.
//!
//! Runs and placed blocks name their keyspace by a 4-byte index, not its 8-byte seed; the
//! ingest's engine-hash map names it the same way. A fleet that salts prompts per user or
//! per request meets a stream of keyspaces, so an index whose last user went is given to
//! the next new key: the table holds at most as many keys as were ever in use at once,
//! and a lookup is one hash probe however many there are.
//!
//! An index is only reused by [`Interner::intern`] of a new key. A caller that keeps an
//! index across operations without counting it as a user must not intern in between;
//! a count that drops to zero and rises again inside one operation (a run freed, then
//! another allocated) is safe.

use std::hash::Hash;

use crate::hashing::FastMap;

#[derive(Debug, Clone)]
pub struct Interner<K> {
    slots: Vec<Slot<K>>,
    ids: FastMap<K, u32>,
    /// Indexes whose users all went at some point, each listed once (`Slot::listed`); one
    /// that gained users since is skipped when popped.
    idle: Vec<u32>,
}

impl<K> Default for Interner<K> {
    fn default() -> Self {
        Interner {
            slots: Vec::new(),
            ids: FastMap::default(),
            idle: Vec::new(),
        }
    }
}

#[derive(Debug, Clone)]
struct Slot<K> {
    key: K,
    /// Users (runs, placed blocks).
    users: u32,
    listed: bool,
}

impl<K: Hash + Eq + Clone> Interner<K> {
    pub fn get(&self, key: &K) -> Option<u32> {
        self.ids.get(key).copied()
    }

    /// The key of index `i` (which must have been interned).
    pub fn key(&self, i: u32) -> &K {
        &self.slots[i as usize].key
    }

    /// Every index's key, in index order (idle ones too).
    pub fn keys(&self) -> impl Iterator<Item = &K> + '_ {
        self.slots.iter().map(|s| &s.key)
    }

    /// The index of `key`, given an unused one (or a new one) when it has none. An index
    /// interned but never acquired is idle from the start, so it is reused too.
    pub fn intern(&mut self, key: &K) -> u32 {
        if let Some(i) = self.get(key) {
            return i;
        }
        let i = loop {
            match self.idle.pop() {
                Some(i) => {
                    let slot = &mut self.slots[i as usize];
                    slot.listed = false;
                    if slot.users == 0 {
                        self.ids
                            .remove(&std::mem::replace(&mut slot.key, key.clone()));
                        break i;
                    }
                }
                None => {
                    self.slots.push(Slot {
                        key: key.clone(),
                        users: 0,
                        listed: false,
                    });
                    break (self.slots.len() - 1) as u32;
                }
            }
        };
        self.ids.insert(key.clone(), i);
        self.list(i);
        i
    }

    /// Counts one more user of index `i`.
    pub fn acquire(&mut self, i: u32) {
        self.slots[i as usize].users += 1;
    }

    /// Counts one user of index `i` less; at none it may be reused.
    pub fn release(&mut self, i: u32) {
        let users = &mut self.slots[i as usize].users;
        *users -= 1;
        if *users == 0 {
            self.list(i);
        }
    }

    fn list(&mut self, i: u32) {
        if !std::mem::replace(&mut self.slots[i as usize].listed, true) {
            self.idle.push(i);
        }
    }

    /// Indexes allocated (in use or waiting to be reused).
    pub fn slots(&self) -> usize {
        self.slots.len()
    }

    /// Checks the user counts against the users found of every index; for tests.
    pub(crate) fn check(&self, found: &FastMap<u32, u32>) -> Result<(), String> {
        for (i, slot) in self.slots.iter().enumerate() {
            let want = found.get(&(i as u32)).copied().unwrap_or(0);
            if slot.users != want {
                return Err(format!(
                    "keyspace {i}: {} users counted, {want} found",
                    slot.users
                ));
            }
            if slot.users > 0 && self.get(&slot.key) != Some(i as u32) {
                return Err(format!("keyspace {i} is in use but not looked up"));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_index_whose_users_went_is_given_to_the_next_new_seed() {
        let mut k = Interner::<u64>::default();
        let a = k.intern(&10);
        k.acquire(a);
        let b = k.intern(&20);
        k.acquire(b);
        assert_ne!(a, b);
        k.release(a);
        // Still known until a new seed needs its index.
        assert_eq!(k.get(&10), Some(a));
        assert_eq!(k.intern(&10), a);
        let c = k.intern(&30);
        assert_eq!(c, a, "the idle index is reused");
        assert_eq!((k.get(&10), k.get(&30), *k.key(c)), (None, Some(c), 30));
        assert_eq!(k.slots(), 2);
    }

    #[test]
    fn an_index_in_use_again_is_not_reused() {
        let mut k = Interner::<u64>::default();
        let a = k.intern(&10);
        k.acquire(a);
        k.release(a);
        k.acquire(a);
        let b = k.intern(&20);
        assert_ne!(a, b);
        assert_eq!(k.get(&10), Some(a));
        // Released twice over its life, listed once: one reuse, then a fresh index.
        k.release(a);
        k.acquire(a);
        k.release(a);
        k.acquire(b);
        let c = k.intern(&30);
        assert_eq!(c, a);
        k.acquire(c);
        assert_eq!(k.intern(&40), 2);
    }

    #[test]
    fn a_stream_of_short_lived_keyspaces_uses_a_bounded_table() {
        let mut k = Interner::<u64>::default();
        let mut live = std::collections::VecDeque::new();
        for seed in 0..10_000u64 {
            let i = k.intern(&seed);
            k.acquire(i);
            live.push_back(i);
            if live.len() > 8 {
                k.release(live.pop_front().unwrap());
            }
        }
        assert!(k.slots() <= 10, "{} slots for 9 live keyspaces", k.slots());
    }
}
