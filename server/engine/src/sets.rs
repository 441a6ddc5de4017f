//! Interned holder sets. Every run of blocks points at one set id, so a prefix held by
//! 240 workers stores its 240 holders once, not once per block.

use crate::hashing::FastMap;

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
    lookup: FastMap<Box<[u32]>, SetId>,
    scratch: Vec<u32>,
}

impl SetPool {
    pub(crate) fn holders(&self, id: SetId) -> &[u32] {
        &self.slots[id as usize].holders
    }

    pub(crate) fn contains(&self, id: SetId, holder: u32) -> bool {
        self.holders(id).binary_search(&holder).is_ok()
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
            self.lookup.remove(&holders);
            self.free.push(id);
        }
    }

    /// The set `{holder}`, acquired.
    pub(crate) fn singleton(&mut self, holder: u32) -> SetId {
        self.intern_scratch_with(|s| s.push(holder))
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

    fn intern_scratch_with(&mut self, fill: impl FnOnce(&mut Vec<u32>)) -> SetId {
        self.scratch.clear();
        fill(&mut self.scratch);
        self.intern_scratch()
    }

    fn intern_scratch(&mut self) -> SetId {
        if let Some(&id) = self.lookup.get(self.scratch.as_slice()) {
            self.slots[id as usize].refs += 1;
            return id;
        }
        let holders: Box<[u32]> = self.scratch.as_slice().into();
        let id = match self.free.pop() {
            Some(id) => {
                self.slots[id as usize] = Slot {
                    holders: holders.clone(),
                    refs: 1,
                };
                id
            }
            None => {
                self.slots.push(Slot {
                    holders: holders.clone(),
                    refs: 1,
                });
                (self.slots.len() - 1) as SetId
            }
        };
        self.lookup.insert(holders, id);
        id
    }

    /// Live sets (for stats and tests).
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
        let back = p.without(ab, |h| h == 3).unwrap();
        assert_eq!(back, a);
        assert_eq!(p.without(a, |_| true), None);
        for id in [a, b, ab, back] {
            p.release(id);
        }
        assert_eq!(p.live(), 0);
        // Freed slots are reused.
        let c = p.singleton(9);
        assert!(c == a || c == ab);
    }
}
