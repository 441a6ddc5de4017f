//! The chain hasher: block i of a prompt hashes its units seeded by block i−1's hash,
//! block 0 by the keyspace seed. Equal chain hash ⇒ equal whole prefix.
//!
//! Only whole blocks are hashed; a trailing partial block has no hash (no engine can
//! reuse it). Any change here bumps [`CHAIN_HASH_VERSION`] and the protocol version:
//! `tests/golden.rs` pins it.

/// The chain hash function's version. Protocol versions 1 to 5 share chain hash 1
/// (version 2 changed only the layout of `Event::Stored`, version 3 added error codes,
/// version 4 fields of `Answer` and `Roster`, version 5 tiers and new kinds; extra keys ([`mix_extra`]) change no hash
/// of a block without them).
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
    // Called once per block by the ingest: no allocation unless there is a block.
    let mut scratch = Vec::new();
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

/// Extra keys of one engine block: inputs other than its token ids that the engine hashed
/// into the block (vLLM's multimodal items and prompt-embedding digests). Two prompts
/// with the same tokens but other extra keys must never share a block, so the keys are
/// mixed into the chain hash of the block's first keyspace block, and so into every
/// later block of the chain. A gateway that knows the same keys (docs/protocol.md)
/// computes the same chain; one that does not never matches them.
///
/// A LoRA adapter and a cache salt are not extra keys here: they choose the keyspace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExtraKey {
    /// A multimodal item: its identifier (vLLM's `mm_hash`) and its offset in tokens from
    /// the start of the engine block (negative when it began in an earlier block).
    Multimodal { identifier: String, offset: i64 },
    /// Raw bytes (vLLM's prompt-embedding digest of the block).
    Bytes(Vec<u8>),
    /// Any other key, as text.
    Text(String),
    /// Any other key, as an integer.
    Int(i64),
}

const EXTRA_DOMAIN: u64 = 0x6b76_6978_6578_7472; // "kvixextr"

/// The canonical bytes of a block's extra keys: per key a tag byte (1 multimodal,
/// 2 bytes, 3 text, 4 integer), then for 1: the identifier's length (u32 LE), its
/// UTF-8 bytes and the offset (i64 LE); for 2 and 3: length (u32 LE) and bytes; for
/// 4: the value (i64 LE).
pub fn extra_bytes(keys: &[ExtraKey], out: &mut Vec<u8>) {
    let with_len = |out: &mut Vec<u8>, b: &[u8]| {
        out.extend_from_slice(&(b.len() as u32).to_le_bytes());
        out.extend_from_slice(b);
    };
    for k in keys {
        match k {
            ExtraKey::Multimodal { identifier, offset } => {
                out.push(1);
                with_len(out, identifier.as_bytes());
                out.extend_from_slice(&offset.to_le_bytes());
            }
            ExtraKey::Bytes(b) => {
                out.push(2);
                with_len(out, b);
            }
            ExtraKey::Text(t) => {
                out.push(3);
                with_len(out, t.as_bytes());
            }
            ExtraKey::Int(v) => {
                out.push(4);
                out.extend_from_slice(&v.to_le_bytes());
            }
        }
    }
}

/// The chain hash of a block whose tokens hashed to `block_hash` and whose engine block
/// carries `keys` (no keys: `block_hash` unchanged).
pub fn mix_extra(block_hash: u64, keys: &[ExtraKey]) -> u64 {
    if keys.is_empty() {
        return block_hash;
    }
    let mut bytes = Vec::new();
    extra_bytes(keys, &mut bytes);
    xxh3_64_with_seed(&bytes, block_hash ^ EXTRA_DOMAIN)
}

/// The chain of a token prompt whose engine blocks (`engine_block` tokens, a multiple of
/// `block`) carry extra keys: `extras[j]` belongs to engine block `j` (missing or empty:
/// none). Without extra keys this is [`token_chain`].
pub fn token_chain_with_extras(
    seed: u64,
    block: u32,
    engine_block: u32,
    tokens: &[u32],
    extras: &[Vec<ExtraKey>],
) -> Vec<u64> {
    let (b, per) = (
        block as usize,
        (engine_block / block.max(1)).max(1) as usize,
    );
    let mut out = Vec::with_capacity(tokens.len() / b.max(1));
    let mut prev = seed;
    for (i, chunk) in tokens.chunks_exact(b.max(1)).enumerate() {
        let mut one = Vec::with_capacity(1);
        chain_tokens(prev, block, chunk, &mut one);
        let mut h = one[0];
        if i % per == 0 {
            if let Some(keys) = extras.get(i / per) {
                h = mix_extra(h, keys);
            }
        }
        out.push(h);
        prev = h;
    }
    out
}

/// Tokens as the u32 little-endian bytes the hash is defined over: the tokens' own
/// memory on a little-endian machine, else converted into `scratch`.
fn token_bytes<'a>(tokens: &'a [u32], scratch: &'a mut Vec<u8>) -> &'a [u8] {
    if cfg!(target_endian = "little") {
        return zerocopy::IntoBytes::as_bytes(tokens);
    }
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
    fn extra_keys_change_their_block_and_every_later_one_and_nothing_before() {
        let tokens: Vec<u32> = (0..96).collect();
        let plain = token_chain(3, 16, &tokens);
        assert_eq!(token_chain_with_extras(3, 16, 32, &tokens, &[]), plain);
        let image = vec![ExtraKey::Multimodal {
            identifier: "img-1".into(),
            offset: 4,
        }];
        let keyed = token_chain_with_extras(3, 16, 32, &tokens, &[vec![], image.clone()]);
        assert_eq!(keyed[..2], plain[..2], "engine block 0 carries no key");
        assert!(keyed[2..].iter().zip(&plain[2..]).all(|(a, b)| a != b));
        // Another identifier or offset is another chain.
        let moved = vec![ExtraKey::Multimodal {
            identifier: "img-1".into(),
            offset: 5,
        }];
        assert_ne!(
            token_chain_with_extras(3, 16, 32, &tokens, &[vec![], moved])[2],
            keyed[2]
        );
        // Continuing a keyed chain from its last hash is incremental, as for tokens.
        assert_eq!(
            token_chain(keyed[3], 16, &tokens[64..]),
            keyed[4..].to_vec()
        );
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
