//! Keyspaces: the (model, LoRA, cache salt, kind, block size) tuple that two chains
//! must share before their hashes can mean the same prefix.

use rkyv::{Archive, Deserialize, Serialize};
use xxhash_rust::xxh3::xxh3_64;

/// Size of one chunk in a byte keyspace (string prompts).
pub const BYTE_CHUNK: u32 = 256;

/// Whether a keyspace's chains are cut from token ids or from prompt bytes.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[rkyv(derive(Debug))]
pub enum ChunkKind {
    /// Token ids (u32 LE), `block_tokens` per block.
    #[default]
    Tokens,
    /// Raw prompt bytes, [`BYTE_CHUNK`] per block. Lane rules do not apply here.
    Bytes,
}

/// A keyspace as a client names it. The block size is the server's, fixed at handshake.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq, Hash, Default)]
#[rkyv(derive(Debug))]
pub struct Keyspace {
    pub model: String,
    /// LoRA adapter name; empty for the base model.
    pub lora: String,
    /// Cache salt (per-tenant isolation); empty for none.
    pub salt: String,
    pub kind: ChunkKind,
}

impl Keyspace {
    pub fn tokens(model: impl Into<String>) -> Self {
        Keyspace {
            model: model.into(),
            kind: ChunkKind::Tokens,
            ..Default::default()
        }
    }

    pub fn bytes(model: impl Into<String>) -> Self {
        Keyspace {
            model: model.into(),
            kind: ChunkKind::Bytes,
            ..Default::default()
        }
    }

    /// The block size in units (tokens or bytes) for this keyspace on a server whose
    /// token block size is `token_block`.
    pub fn block_units(&self, token_block: u32) -> u32 {
        match self.kind {
            ChunkKind::Tokens => token_block,
            ChunkKind::Bytes => BYTE_CHUNK,
        }
    }

    /// The keyspace's own hash: the seed of block 0 of every chain in it, and its id.
    pub fn seed(&self, token_block: u32) -> u64 {
        keyspace_seed(
            &self.model,
            &self.lora,
            &self.salt,
            self.kind,
            self.block_units(token_block),
        )
    }
}

impl ArchivedKeyspace {
    pub fn kind(&self) -> ChunkKind {
        match self.kind {
            ArchivedChunkKind::Tokens => ChunkKind::Tokens,
            ArchivedChunkKind::Bytes => ChunkKind::Bytes,
        }
    }

    /// Same as [`Keyspace::seed`], read in place.
    pub fn seed(&self, token_block: u32) -> u64 {
        let kind = self.kind();
        let units = match kind {
            ChunkKind::Tokens => token_block,
            ChunkKind::Bytes => BYTE_CHUNK,
        };
        keyspace_seed(&self.model, &self.lora, &self.salt, kind, units)
    }

    pub fn to_native(&self) -> Keyspace {
        Keyspace {
            model: self.model.to_string(),
            lora: self.lora.to_string(),
            salt: self.salt.to_string(),
            kind: self.kind(),
        }
    }
}

/// Canonical encoding: a domain tag, then each field length-prefixed (u32 LE), then the
/// kind byte and the block size (u32 LE). Pinned by the golden vectors.
fn keyspace_seed(model: &str, lora: &str, salt: &str, kind: ChunkKind, block_units: u32) -> u64 {
    let mut buf = Vec::with_capacity(32 + model.len() + lora.len() + salt.len());
    buf.extend_from_slice(b"kvix-keyspace-v1");
    for field in [model, lora, salt] {
        buf.extend_from_slice(&(field.len() as u32).to_le_bytes());
        buf.extend_from_slice(field.as_bytes());
    }
    buf.push(match kind {
        ChunkKind::Tokens => 0,
        ChunkKind::Bytes => 1,
    });
    buf.extend_from_slice(&block_units.to_le_bytes());
    xxh3_64(&buf)
}
