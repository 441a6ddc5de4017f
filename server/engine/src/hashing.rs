//! Hashing for the engine's tables. Chain hashes are already well mixed, so the hasher
//! only folds its input (no SipHash on the hot path).

use std::hash::{BuildHasherDefault, Hasher};

/// A multiply-fold hasher (FxHash style); inputs that are not mixed yet get mixed here.
#[derive(Default, Clone, Copy)]
pub struct Fold(u64);

const K: u64 = 0xf135_7aea_2e62_a9c5;

impl Hasher for Fold {
    fn finish(&self) -> u64 {
        // Rotate so the high product bits (the well-mixed ones) reach the bucket index.
        self.0.rotate_left(26)
    }

    fn write(&mut self, bytes: &[u8]) {
        let mut chunks = bytes.chunks_exact(8);
        for c in &mut chunks {
            let mut w = [0u8; 8];
            w.copy_from_slice(c);
            self.write_u64(u64::from_le_bytes(w));
        }
        for b in chunks.remainder() {
            self.write_u64(*b as u64);
        }
    }

    fn write_u64(&mut self, v: u64) {
        self.0 = (self.0 ^ v).wrapping_mul(K);
    }

    fn write_u32(&mut self, v: u32) {
        self.write_u64(v as u64);
    }

    fn write_u8(&mut self, v: u8) {
        self.write_u64(v as u64);
    }

    fn write_usize(&mut self, v: usize) {
        self.write_u64(v as u64);
    }
}

pub type FoldBuild = BuildHasherDefault<Fold>;
/// A `HashMap` with the multiply-fold hasher: for keys that are hashes already (or small
/// ids), where SipHash's flooding resistance buys nothing and costs a third of a lookup.
pub type FastMap<K, V> = std::collections::HashMap<K, V, FoldBuild>;

/// The table hash of a block: its chain hash in keyspace `ks` (a small per-table index
/// or a seed). Positions are not mixed in: a chain hash already names its whole prefix,
/// and every table compares the full identity (position included) on a hit.
pub(crate) fn block_hash(ks: u64, hash: u64) -> u64 {
    fmix(hash ^ fmix(ks.wrapping_mul(0x9e37_79b9_7f4a_7c15)))
}

/// Hash of a sorted holder set.
pub(crate) fn set_hash(holders: &[u32]) -> u64 {
    let mut h = Fold::default();
    h.write_u64(holders.len() as u64);
    for &x in holders {
        h.write_u32(x);
    }
    fmix(h.finish())
}

/// murmur3's 64-bit finalizer: a bijection on u64.
pub(crate) fn fmix(mut x: u64) -> u64 {
    x ^= x >> 33;
    x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
    x ^= x >> 33;
    x = x.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    x ^ (x >> 33)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_hashes_separate_keyspaces_and_set_hashes_lengths() {
        assert_ne!(block_hash(1, 99), block_hash(2, 99));
        assert_eq!(block_hash(1, 99), block_hash(1, 99));
        assert_ne!(set_hash(&[1]), set_hash(&[1, 0]));
    }
}
