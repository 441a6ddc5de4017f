//! What a worker's home turns its writes into, and every executor applies to its own
//! index: block operations over one shared hash buffer, and the roster change that
//! follows them. An [`Update`] owns everything it names (one allocation per buffer, not
//! one per operation), so it can be shared with other executors as it is.

use kvix_wire::{Tier, WorkerId};

use crate::roster::WorkerEntry;
use crate::Holder;

/// One block operation; hashes live in the batch's buffer at `at .. at + len`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// `holder` holds blocks `start + j` with chain hashes `hashes[at + j]`; `parent` is
    /// the chain hash of block `start - 1` when known.
    Insert {
        ks: u64,
        holder: Holder,
        start: u32,
        parent: Option<u64>,
        at: u32,
        len: u32,
    },
    /// `holder` no longer holds the blocks with chain hashes `hashes[at..at + len]`.
    Remove {
        ks: u64,
        holder: Holder,
        at: u32,
        len: u32,
    },
    /// Whatever `holder` holds is dropped (the runs of the holder sets holding it are
    /// walked; applied in slices like the others).
    Sweep { holder: Holder },
}

/// A sequence of block operations with their hashes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct OpBatch {
    pub(crate) ops: Vec<Op>,
    pub(crate) hashes: Vec<u64>,
}

impl OpBatch {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn is_empty(&self) -> bool {
        self.ops.is_empty()
    }

    pub fn ops(&self) -> &[Op] {
        &self.ops
    }

    /// The hashes an operation names.
    pub fn hashes(&self, at: u32, len: u32) -> &[u64] {
        &self.hashes[at as usize..(at + len) as usize]
    }

    /// Where the batch ends now, to cut it back to with [`OpBatch::truncate`].
    pub fn mark(&self) -> (usize, usize) {
        (self.ops.len(), self.hashes.len())
    }

    /// Drops what was appended since `mark`.
    pub fn truncate(&mut self, (ops, hashes): (usize, usize)) {
        self.ops.truncate(ops);
        self.hashes.truncate(hashes);
    }

    /// Blocks the operations name: the cost of applying them.
    pub fn blocks(&self) -> u64 {
        self.ops.iter().map(|op| op.len() as u64).sum()
    }

    pub fn clear(&mut self) {
        self.ops.clear();
        self.hashes.clear();
    }

    pub(crate) fn insert(
        &mut self,
        ks: u64,
        holder: Holder,
        start: u32,
        parent: Option<u64>,
        chain: &[u64],
    ) {
        if chain.is_empty() {
            return;
        }
        let at = self.hashes.len() as u32;
        self.hashes.extend_from_slice(chain);
        self.ops.push(Op::Insert {
            ks,
            holder,
            start,
            parent,
            at,
            len: chain.len() as u32,
        });
    }

    /// Appends a removal, extending the previous one of the same holder and keyspace.
    pub(crate) fn remove(&mut self, ks: u64, holder: Holder, hashes: &[u64]) {
        if hashes.is_empty() {
            return;
        }
        let at = self.hashes.len() as u32;
        self.hashes.extend_from_slice(hashes);
        if let Some(Op::Remove {
            ks: k,
            holder: h,
            at: a,
            len,
        }) = self.ops.last_mut()
        {
            if *k == ks && *h == holder && *a + *len == at {
                *len += hashes.len() as u32;
                return;
            }
        }
        self.ops.push(Op::Remove {
            ks,
            holder,
            at,
            len: hashes.len() as u32,
        });
    }

    /// Sweeps lanes `0..lanes` of `worker`, in every tier (a holder that holds nothing
    /// costs a lookup).
    pub(crate) fn sweep_lanes(&mut self, worker: WorkerId, lanes: usize) {
        let lanes = lanes.min(crate::MAX_LANES) as u8;
        for tier in Tier::ALL {
            self.ops.extend((0..lanes).map(|lane| Op::Sweep {
                holder: Holder::in_tier(worker, lane, tier),
            }));
        }
    }
}

impl Op {
    /// Blocks it names.
    pub fn len(&self) -> u32 {
        match *self {
            Op::Insert { len, .. } | Op::Remove { len, .. } => len,
            Op::Sweep { .. } => 0,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A roster change, applied after the block operations of its update.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RosterChange {
    Install(WorkerEntry),
    Remove(WorkerId),
}

/// Everything one write changes: block operations, then a roster change.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Update {
    pub ops: OpBatch,
    pub roster: Option<RosterChange>,
}

impl Update {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn is_empty(&self) -> bool {
        self.ops.is_empty() && self.roster.is_none()
    }

    pub fn clear(&mut self) {
        self.ops.clear();
        self.roster = None;
    }
}

/// Where a sliced application of an [`Update`] stands.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Cursor {
    pub(crate) op: usize,
    /// Blocks (or hints) of `op` already applied.
    pub(crate) done: u32,
    pub(crate) finished: bool,
}

impl Cursor {
    pub fn is_finished(&self) -> bool {
        self.finished
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn removals_coalesce_per_holder_and_keyspace() {
        let h = Holder::new(1, 0);
        let mut b = OpBatch::new();
        b.remove(7, h, &[30]);
        b.remove(7, h, &[40, 50]);
        b.remove(8, h, &[70]);
        b.remove(8, Holder::new(2, 0), &[80]);
        assert_eq!(b.ops().len(), 3);
        assert!(matches!(
            b.ops()[0],
            Op::Remove {
                ks: 7,
                at: 0,
                len: 3,
                ..
            }
        ));
        assert_eq!(b.hashes(0, 3), &[30, 40, 50]);
        b.insert(7, h, 0, None, &[1, 2]);
        b.insert(7, h, 0, None, &[]);
        b.sweep_lanes(1, 2);
        // Both lanes, in every tier.
        assert_eq!(b.ops().len(), 4 + 2 * 3);
        assert_eq!(
            b.ops()[9],
            Op::Sweep {
                holder: Holder::in_tier(1, 1, Tier::Storage)
            }
        );
        assert_eq!(
            b.ops()[5],
            Op::Sweep {
                holder: Holder::new(1, 1)
            }
        );
        assert_eq!(b.blocks(), 3 + 1 + 1 + 2);
    }
}
