//! The mock worker's prefix cache: an LRU over chain-hash blocks with a block capacity,
//! which reports what it stored and evicted as kvix events.
//!
//! Admitting a chain touches its blocks deepest first, so block 0 ends up the most
//! recently used and eviction eats chains from their ends (as vLLM frees a request's
//! blocks tail first); a held prefix stays contiguous.

use std::collections::HashMap;

use kvix_wire::Event;

const NIL: u32 = u32::MAX;

#[derive(Debug, Clone, Copy)]
struct Slot {
    hash: u64,
    /// Towards the least recently used end.
    older: u32,
    /// Towards the most recently used end.
    newer: u32,
}

/// What one admission changed.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Admitted {
    /// Newly stored runs `(start, len)` of the admitted chain.
    pub stored: Vec<(u32, u32)>,
    /// Chain hashes evicted to make room.
    pub evicted: Vec<u64>,
}

impl Admitted {
    /// The kvix events of this admission (lane 0, stores named by chain hash).
    pub fn events(&self, chain: &[u64]) -> Vec<Event> {
        let mut ev: Vec<Event> = self
            .stored
            .iter()
            .map(|&(s, n)| Event::Stored {
                lane: 0,
                start: s,
                parent: s.checked_sub(1).map(|p| chain[p as usize]),
                chain: chain[s as usize..(s + n) as usize].to_vec(),
                engine: Vec::new(),
            })
            .collect();
        if !self.evicted.is_empty() {
            ev.push(Event::Removed {
                lane: 0,
                hashes: self.evicted.clone(),
            });
        }
        ev
    }

    /// Keyspace blocks stored plus removed.
    pub fn block_events(&self) -> u64 {
        self.stored.iter().map(|&(_, n)| n as u64).sum::<u64>() + self.evicted.len() as u64
    }
}

/// An LRU block cache of `capacity` blocks.
#[derive(Debug)]
pub struct LruCache {
    capacity: usize,
    map: HashMap<u64, u32>,
    slots: Vec<Slot>,
    free: Vec<u32>,
    oldest: u32,
    newest: u32,
}

impl LruCache {
    pub fn new(capacity: usize) -> Self {
        LruCache {
            capacity,
            map: HashMap::new(),
            slots: Vec::new(),
            free: Vec::new(),
            oldest: NIL,
            newest: NIL,
        }
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    pub fn contains(&self, hash: u64) -> bool {
        self.map.contains_key(&hash)
    }

    /// How many leading blocks of `chain` this cache can reuse (a prefix, block by block).
    pub fn reusable(&self, chain: &[u64]) -> usize {
        chain
            .iter()
            .take_while(|h| self.map.contains_key(h))
            .count()
    }

    /// Stores `chain` (at most `capacity` leading blocks), refreshing held blocks, and
    /// evicts the least recently used blocks past the capacity.
    pub fn admit(&mut self, chain: &[u64]) -> Admitted {
        let n = chain.len().min(self.capacity);
        let mut out = Admitted::default();
        let mut new_flags = vec![false; n];
        for pos in (0..n).rev() {
            let h = chain[pos];
            match self.map.get(&h) {
                Some(&s) => {
                    self.unlink(s);
                    self.push_newest(s);
                }
                None => {
                    let s = self.alloc(h);
                    self.map.insert(h, s);
                    self.push_newest(s);
                    new_flags[pos] = true;
                }
            }
        }
        let mut pos = 0;
        while pos < n {
            if new_flags[pos] {
                let start = pos;
                while pos < n && new_flags[pos] {
                    pos += 1;
                }
                out.stored.push((start as u32, (pos - start) as u32));
            } else {
                pos += 1;
            }
        }
        while self.map.len() > self.capacity {
            let s = self.oldest;
            self.unlink(s);
            let h = self.slots[s as usize].hash;
            self.map.remove(&h);
            self.free.push(s);
            out.evicted.push(h);
        }
        out
    }

    fn alloc(&mut self, hash: u64) -> u32 {
        let slot = Slot {
            hash,
            older: NIL,
            newer: NIL,
        };
        match self.free.pop() {
            Some(s) => {
                self.slots[s as usize] = slot;
                s
            }
            None => {
                self.slots.push(slot);
                (self.slots.len() - 1) as u32
            }
        }
    }

    fn unlink(&mut self, s: u32) {
        let Slot { older, newer, .. } = self.slots[s as usize];
        if older != NIL {
            self.slots[older as usize].newer = newer;
        } else {
            self.oldest = newer;
        }
        if newer != NIL {
            self.slots[newer as usize].older = older;
        } else {
            self.newest = older;
        }
        self.slots[s as usize].older = NIL;
        self.slots[s as usize].newer = NIL;
    }

    fn push_newest(&mut self, s: u32) {
        self.slots[s as usize].older = self.newest;
        self.slots[s as usize].newer = NIL;
        if self.newest != NIL {
            self.slots[self.newest as usize].newer = s;
        } else {
            self.oldest = s;
        }
        self.newest = s;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn evicts_deepest_first_and_reports_events() {
        let mut c = LruCache::new(4);
        let a = [1, 2, 3];
        let ad = c.admit(&a);
        assert_eq!(ad.stored, vec![(0, 3)]);
        assert!(ad.evicted.is_empty());
        assert_eq!(c.reusable(&[1, 2, 3, 4]), 3);
        // A second chain sharing block 0: only its new blocks are stored; the oldest
        // blocks (the first chain's tail) go.
        let b = [1, 7, 8];
        let ad = c.admit(&b);
        assert_eq!(ad.stored, vec![(1, 2)]);
        assert_eq!(ad.evicted, vec![3]);
        assert_eq!(c.reusable(&a), 2);
        assert_eq!(c.reusable(&b), 3);
        assert_eq!(c.len(), 4);
        let ev = ad.events(&b);
        assert_eq!(ev.len(), 2);
        assert!(matches!(&ev[0], Event::Stored { start: 1, chain, .. } if chain == &vec![7, 8]));
        assert!(matches!(&ev[1], Event::Removed { hashes, .. } if hashes == &vec![3]));
    }

    #[test]
    fn never_holds_more_than_capacity() {
        let mut c = LruCache::new(3);
        let ad = c.admit(&[10, 11, 12, 13, 14]);
        assert_eq!(ad.stored, vec![(0, 3)]);
        assert_eq!(c.len(), 3);
        assert_eq!(c.reusable(&[10, 11, 12, 13]), 3);
    }
}
