//! Which shard owns a block: by position segment, rotated per keyspace.
//!
//! Position `i` of any chain in keyspace `ks` belongs to shard
//! `((i / segment) + (ks >> 32)) % shards` (computed in u64, so no overflow). The
//! rotation makes each keyspace's shared system prefix land on a different shard.

use crate::error::IndexError;
use crate::feed::BlockOp;

/// How the index is cut over shards.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sharding {
    pub shards: u32,
    /// Positions per segment (keyspace blocks).
    pub segment: u32,
}

/// One shard's contiguous piece of a chain.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Piece<'a> {
    pub shard: u32,
    /// Absolute position of `chain[0]`.
    pub start: u32,
    pub chain: &'a [u64],
}

impl Default for Sharding {
    fn default() -> Self {
        Sharding {
            shards: 1,
            segment: 64,
        }
    }
}

impl Sharding {
    /// Checks both numbers are positive.
    pub fn new(shards: u32, segment: u32) -> Result<Self, IndexError> {
        if shards == 0 || segment == 0 {
            return Err(IndexError::BadSharding { shards, segment });
        }
        Ok(Sharding { shards, segment })
    }

    /// The shard owning position `pos` of keyspace `ks` (a keyspace seed).
    pub fn owner(&self, ks: u64, pos: u32) -> u32 {
        (((pos / self.segment) as u64 + (ks >> 32)) % self.shards as u64) as u32
    }

    /// Cuts `chain` (whose first block sits at `start`) into per-shard contiguous pieces,
    /// in position order; neighbouring segments of one shard stay one piece.
    pub fn split<'a>(&self, ks: u64, start: u32, chain: &'a [u64]) -> Pieces<'a> {
        Pieces {
            sharding: *self,
            ks,
            pos: start,
            rest: chain,
        }
    }
}

impl Sharding {
    /// Calls `f(shard, op)` with the part of `op` each shard must apply: an insert cut
    /// into per-shard pieces, a removal to the owner of its position, a worker drop to
    /// every shard.
    pub fn route<'a>(&self, op: &BlockOp<'a>, mut f: impl FnMut(u32, BlockOp<'a>)) {
        match *op {
            BlockOp::Insert {
                ks,
                holder,
                start,
                chain,
            } => {
                for p in self.split(ks, start, chain) {
                    f(
                        p.shard,
                        BlockOp::Insert {
                            ks,
                            holder,
                            start: p.start,
                            chain: p.chain,
                        },
                    );
                }
            }
            BlockOp::Remove { ks, pos, .. } => f(self.owner(ks, pos), *op),
            BlockOp::DropWorker { .. } => (0..self.shards).for_each(|s| f(s, *op)),
        }
    }
}

/// Iterator over the [`Piece`]s of a chain.
pub struct Pieces<'a> {
    sharding: Sharding,
    ks: u64,
    pos: u32,
    rest: &'a [u64],
}

impl<'a> Iterator for Pieces<'a> {
    type Item = Piece<'a>;

    fn next(&mut self) -> Option<Piece<'a>> {
        if self.rest.is_empty() {
            return None;
        }
        let s = self.sharding;
        let shard = s.owner(self.ks, self.pos);
        let mut len = 0usize;
        let mut pos = self.pos as u64;
        // Walk segment by segment while the owner stays the same.
        while len < self.rest.len() {
            let seg_end = (pos / s.segment as u64 + 1) * s.segment as u64;
            len = (len + (seg_end - pos) as usize).min(self.rest.len());
            pos = seg_end;
            if pos > u32::MAX as u64 || s.owner(self.ks, pos as u32) != shard {
                break;
            }
        }
        let (piece, rest) = self.rest.split_at(len);
        let out = Piece {
            shard,
            start: self.pos,
            chain: piece,
        };
        self.pos = self.pos.saturating_add(len as u32);
        self.rest = rest;
        Some(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn owner_rotates_by_keyspace_and_segment() {
        let s = Sharding::new(4, 8).unwrap();
        let ks = 3u64 << 32;
        assert_eq!(s.owner(ks, 0), 3);
        assert_eq!(s.owner(ks, 7), 3);
        assert_eq!(s.owner(ks, 8), 0);
        assert_eq!(
            s.owner(u64::MAX, u32::MAX),
            { ((u32::MAX / 8) as u64 + (u64::MAX >> 32)) % 4 } as u32
        );
        assert!(Sharding::new(0, 8).is_err());
        assert!(Sharding::new(2, 0).is_err());
    }

    #[test]
    fn split_cuts_at_owner_changes_only() {
        let chain: Vec<u64> = (0..20).collect();
        let s = Sharding::new(3, 4).unwrap();
        let pieces: Vec<_> = s.split(0, 2, &chain).collect();
        let starts: Vec<_> = pieces
            .iter()
            .map(|p| (p.shard, p.start, p.chain.len()))
            .collect();
        assert_eq!(
            starts,
            vec![
                (0, 2, 2),
                (1, 4, 4),
                (2, 8, 4),
                (0, 12, 4),
                (1, 16, 4),
                (2, 20, 2)
            ]
        );
        for p in &pieces {
            assert_eq!(p.chain[0], (p.start - 2) as u64);
            assert!((p.start..p.start + p.chain.len() as u32).all(|i| s.owner(0, i) == p.shard));
        }
        let one = Sharding::new(1, 4).unwrap();
        let pieces: Vec<_> = one.split(9, 2, &chain).collect();
        assert_eq!(pieces.len(), 1);
        assert_eq!(pieces[0].chain.len(), 20);
        assert_eq!(s.split(0, 0, &[]).count(), 0);
    }
}
