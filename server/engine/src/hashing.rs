//! Hashing for the engine's maps. Block keys are already well mixed, so the hasher
//! only folds its input (no SipHash on the hot path).

use std::hash::{BuildHasherDefault, Hash, Hasher};

/// A multiply-fold hasher (FxHash style); inputs that are not mixed yet get mixed here.
#[derive(Default, Clone, Copy)]
pub(crate) struct Fold(u64);

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

pub(crate) type FoldBuild = BuildHasherDefault<Fold>;
pub(crate) type FastMap<K, V> = std::collections::HashMap<K, V, FoldBuild>;

/// A block's map key: (keyspace, position, chain hash) mixed into 64 bits and stored as
/// two u32 halves, so a `(BlockKey, u32)` map slot is 12 bytes instead of 16.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct BlockKey([u32; 2]);

impl BlockKey {
    pub(crate) fn new(ks: u64, pos: u32, hash: u64) -> Self {
        // Equal hashes at other positions or keyspaces must land elsewhere; the owner
        // of a key still verifies the full identity, so a collision is never a false hit.
        let x = fmix(hash ^ fmix(ks ^ (pos as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15)));
        BlockKey([(x >> 32) as u32, x as u32])
    }
}

impl Hash for BlockKey {
    fn hash<H: Hasher>(&self, state: &mut H) {
        state.write_u64((self.0[0] as u64) << 32 | self.0[1] as u64);
    }
}

/// Identity for already-mixed keys.
#[derive(Default, Clone, Copy)]
pub(crate) struct Ident(u64);

impl Hasher for Ident {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = self.0.rotate_left(8) ^ *b as u64;
        }
    }
    fn write_u64(&mut self, v: u64) {
        self.0 = v;
    }
}

pub(crate) type BlockMap<V> = std::collections::HashMap<BlockKey, V, BuildHasherDefault<Ident>>;

/// murmur3's 64-bit finalizer.
fn fmix(mut x: u64) -> u64 {
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
    fn block_keys_separate_positions_and_keyspaces() {
        let k = BlockKey::new(1, 5, 99);
        assert_ne!(k, BlockKey::new(1, 6, 99));
        assert_ne!(k, BlockKey::new(2, 5, 99));
        assert_eq!(k, BlockKey::new(1, 5, 99));
        assert_eq!(std::mem::size_of::<(BlockKey, u32)>(), 12);
    }
}
