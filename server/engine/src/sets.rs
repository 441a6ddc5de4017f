//! Interned holder sets. Every run of blocks points at one set id, so a prefix held by
//! 240 workers stores its 240 holders once, not once per block. The lookup table holds
//! only set ids (hashed from the slot's holders), so holders are stored once.

use hashbrown::HashTable;

use crate::hashing::set_hash;

pub(crate) type SetId = u32;

struct Slot {
    /// Packed holders, sorted ascending.
    holders: Box<[u32]>,
    /// How many runs point here; the slot is freed at zero.
    refs: u32,
}

#[derive(Default)]
pub(crate) struct SetPool {
    slots: Vec<Slot>,
    free: Vec<SetId>,
    lookup: HashTable<SetId>,
    scratch: Vec<u32>,
}

impl SetPool {
    pub(crate) fn holders(&self, id: SetId) -> &[u32] {
        &self.slots[id as usize].holders
    }

    pub(crate) fn contains(&self, id: SetId, holder: u32) -> bool {
        self.holders(id).binary_search(&holder).is_ok()
    }

    pub(crate) fn is_only(&self, id: SetId, holder: u32) -> bool {
        self.holders(id) == [holder]
    }

    pub(crate) fn len(&self, id: SetId) -> usize {
        self.holders(id).len()
    }

    /// One more run points at `id`.
    pub(crate) fn acquire(&mut self, id: SetId) {
        self.slots[id as usize].refs += 1;
    }

    /// One run fewer points at `id`.
    pub(crate) fn release(&mut self, id: SetId) {
        let slot = &mut self.slots[id as usize];
        slot.refs -= 1;
        if slot.refs == 0 {
            let holders = std::mem::take(&mut slot.holders);
            if let Ok(e) = self.lookup.find_entry(set_hash(&holders), |&x| x == id) {
                e.remove();
            }
            self.free.push(id);
        }
    }

    /// The set `{holder}`, acquired.
    pub(crate) fn singleton(&mut self, holder: u32) -> SetId {
        self.scratch.clear();
        self.scratch.push(holder);
        self.intern_scratch()
    }

    /// `id ∪ {holder}`, acquired (`id` keeps its own reference).
    pub(crate) fn with_added(&mut self, id: SetId, holder: u32) -> SetId {
        let mut s = std::mem::take(&mut self.scratch);
        s.clear();
        let holders = self.holders(id);
        let at = holders.partition_point(|h| *h < holder);
        s.extend_from_slice(&holders[..at]);
        s.push(holder);
        s.extend_from_slice(&holders[at..]);
        self.scratch = s;
        self.intern_scratch()
    }

    /// `id` without the holders `drop` selects, acquired; `None` when nothing is left.
    pub(crate) fn without(&mut self, id: SetId, drop: impl Fn(u32) -> bool) -> Option<SetId> {
        let mut s = std::mem::take(&mut self.scratch);
        s.clear();
        s.extend(self.holders(id).iter().copied().filter(|h| !drop(*h)));
        self.scratch = s;
        if self.scratch.is_empty() {
            None
        } else {
            Some(self.intern_scratch())
        }
    }

    fn intern_scratch(&mut self) -> SetId {
        let hash = set_hash(&self.scratch);
        let (slots, scratch) = (&mut self.slots, &self.scratch);
        if let Some(&id) = self
            .lookup
            .find(hash, |&id| *slots[id as usize].holders == **scratch)
        {
            slots[id as usize].refs += 1;
            return id;
        }
        let slot = Slot {
            holders: scratch.as_slice().into(),
            refs: 1,
        };
        let id = match self.free.pop() {
            Some(id) => {
                slots[id as usize] = slot;
                id
            }
            None => {
                slots.push(slot);
                (slots.len() - 1) as SetId
            }
        };
        let slots = &self.slots;
        self.lookup
            .insert_unique(hash, id, |&x| set_hash(&slots[x as usize].holders));
        id
    }

    /// Ids of the live sets whose holders `pick` selects.
    pub(crate) fn ids_where(&self, pick: impl Fn(&[u32]) -> bool) -> Vec<SetId> {
        (0..self.slots.len() as SetId)
            .filter(|&id| self.slots[id as usize].refs > 0 && pick(self.holders(id)))
            .collect()
    }

    /// Live sets.
    #[cfg(test)]
    pub(crate) fn live(&self) -> usize {
        self.lookup.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn interning_shares_and_frees() {
        let mut p = SetPool::default();
        let a = p.singleton(5);
        let b = p.singleton(5);
        assert_eq!(a, b);
        let ab = p.with_added(a, 3);
        assert_eq!(p.holders(ab), &[3, 5]);
        assert!(p.contains(ab, 3) && !p.contains(ab, 4));
        assert!(p.is_only(a, 5) && !p.is_only(ab, 5));
        let back = p.without(ab, |h| h == 3).unwrap();
        assert_eq!(back, a);
        assert_eq!(p.without(a, |_| true), None);
        for id in [a, b, ab, back] {
            p.release(id);
        }
        assert_eq!(p.live(), 0);
        // Freed slots are reused, and a reused slot is found again by content.
        let c = p.singleton(9);
        assert!(c == a || c == ab);
        assert_eq!(p.singleton(9), c);
    }
}
