//! The chain hasher: block i of a prompt hashes its units seeded by block i−1's hash,
//! block 0 by the keyspace seed. Equal chain hash ⇒ equal whole prefix.
//!
//! Only whole blocks are hashed; a trailing partial block has no hash (no engine can
//! reuse it). Any change here bumps [`CHAIN_HASH_VERSION`] and the protocol version:
//! `tests/golden.rs` pins it.

/// The chain hash function's version. Protocol versions 1 and 2 share chain hash 1
/// (version 2 changed only the layout of `Event::Stored`).
pub const CHAIN_HASH_VERSION: u16 = 1;

use xxhash_rust::xxh3::xxh3_64_with_seed;

/// Appends the chain hashes of the whole `block`-token blocks of `tokens` to `out`,
/// continuing from `seed` (the keyspace seed, or the chain hash of the block before).
pub fn chain_tokens(seed: u64, block: u32, tokens: &[u32], out: &mut Vec<u64>) {
    let block = block as usize;
    if block == 0 {
        return;
    }
    out.reserve(tokens.len() / block);
    let mut prev = seed;
    let mut scratch = Vec::with_capacity(block * 4);
    for chunk in tokens.chunks_exact(block) {
        prev = xxh3_64_with_seed(token_bytes(chunk, &mut scratch), prev);
        out.push(prev);
    }
}

/// Appends the chain hashes of the whole `chunk`-byte blocks of `bytes` to `out`.
pub fn chain_bytes(seed: u64, chunk: u32, bytes: &[u8], out: &mut Vec<u64>) {
    let chunk = chunk as usize;
    if chunk == 0 {
        return;
    }
    out.reserve(bytes.len() / chunk);
    let mut prev = seed;
    for c in bytes.chunks_exact(chunk) {
        prev = xxh3_64_with_seed(c, prev);
        out.push(prev);
    }
}

/// Convenience: the whole chain of a token prompt.
pub fn token_chain(seed: u64, block: u32, tokens: &[u32]) -> Vec<u64> {
    let mut out = Vec::new();
    chain_tokens(seed, block, tokens, &mut out);
    out
}

/// Convenience: the whole chain of a byte prompt.
pub fn byte_chain(seed: u64, chunk: u32, bytes: &[u8]) -> Vec<u64> {
    let mut out = Vec::new();
    chain_bytes(seed, chunk, bytes, &mut out);
    out
}

/// Tokens as the u32 little-endian bytes the hash is defined over.
fn token_bytes<'a>(tokens: &'a [u32], scratch: &'a mut Vec<u8>) -> &'a [u8] {
    scratch.clear();
    for t in tokens {
        scratch.extend_from_slice(&t.to_le_bytes());
    }
    scratch
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partial_blocks_are_not_hashed_and_chains_extend() {
        let tokens: Vec<u32> = (0..40).collect();
        let whole = token_chain(7, 16, &tokens);
        assert_eq!(whole.len(), 2);
        // Continuing from block 0's hash gives block 1's hash: chaining is incremental.
        assert_eq!(token_chain(whole[0], 16, &tokens[16..32]), vec![whole[1]]);
        // A different seed (keyspace) changes every hash.
        assert!(token_chain(8, 16, &tokens)
            .iter()
            .zip(&whole)
            .all(|(a, b)| a != b));
    }

    #[test]
    fn a_changed_token_changes_its_block_and_every_later_one_only() {
        let a: Vec<u32> = (0..64).collect();
        let mut b = a.clone();
        b[20] = 999;
        let (ha, hb) = (token_chain(1, 16, &a), token_chain(1, 16, &b));
        assert_eq!(ha[0], hb[0]);
        assert!(ha[1..].iter().zip(&hb[1..]).all(|(x, y)| x != y));
    }
}
