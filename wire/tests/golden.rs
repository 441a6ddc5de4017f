//! Golden vectors pin the chain hash forever: any change to them is a protocol
//! version bump. `KVIX_WRITE_GOLDEN=1 cargo test -p kvix-wire --test golden` rewrites
//! the file (only ever together with PROTOCOL_VERSION).

use kvix_wire::chain::{
    byte_chain, token_chain, token_chain_with_extras, ExtraKey, CHAIN_HASH_VERSION,
};
use kvix_wire::{ChunkKind, Keyspace};

const PATH: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/golden/chain_v1.txt");

fn keyspaces() -> Vec<(&'static str, Keyspace)> {
    vec![
        ("base", Keyspace::tokens("meta-llama/Llama-3.1-8B")),
        (
            "lora",
            Keyspace {
                lora: "sql-adapter".into(),
                ..Keyspace::tokens("meta-llama/Llama-3.1-8B")
            },
        ),
        (
            "salted",
            Keyspace {
                salt: "tenant-42".into(),
                ..Keyspace::tokens("meta-llama/Llama-3.1-8B")
            },
        ),
        (
            "bytes",
            Keyspace {
                kind: ChunkKind::Bytes,
                ..Keyspace::tokens("meta-llama/Llama-3.1-8B")
            },
        ),
        ("empty", Keyspace::default()),
    ]
}

/// Every vector as `name value` lines, computed by the current implementation.
fn vectors() -> String {
    let mut out =
        format!("# kvix chain hash golden vectors, chain hash version {CHAIN_HASH_VERSION}\n");
    let tokens: Vec<u32> = (0..64u32)
        .map(|i| i.wrapping_mul(2_654_435_761) % 152_000)
        .collect();
    let bytes: Vec<u8> = (0..600u32).map(|i| (i * 31 % 251) as u8).collect();
    for block in [16u32, 32] {
        for (name, ks) in keyspaces() {
            let seed = ks.seed(block);
            out += &format!("seed/{name}/b{block} {seed:016x}\n");
            let chain = match ks.kind {
                ChunkKind::Tokens => token_chain(seed, block, &tokens),
                ChunkKind::Bytes => byte_chain(seed, kvix_wire::BYTE_CHUNK, &bytes),
            };
            for (i, h) in chain.iter().enumerate() {
                out += &format!("chain/{name}/b{block}/{i} {h:016x}\n");
            }
        }
        // Extra keys (engine blocks of 2·block tokens): an image in engine block 1, a
        // prompt-embedding digest, text and an integer in engine block 3.
        let seed = Keyspace::tokens("meta-llama/Llama-3.1-8B").seed(block);
        let extras = vec![
            vec![],
            vec![ExtraKey::Multimodal {
                identifier: "img-7f3a".into(),
                offset: -3,
            }],
            vec![],
            vec![
                ExtraKey::Bytes(vec![0xde, 0xad, 0xbe, 0xef]),
                ExtraKey::Text("k".into()),
                ExtraKey::Int(-2),
            ],
        ];
        let long: Vec<u32> = (0..8 * block).map(|i| i * 7 + 1).collect();
        let keyed = token_chain_with_extras(seed, block, 2 * block, &long, &extras);
        for (i, h) in keyed.iter().enumerate() {
            out += &format!("extras/b{block}/{i} {h:016x}\n");
        }
    }
    out
}

#[test]
fn the_xxh3_primitive_is_the_published_one() {
    // XXH3_64bits of the empty input, seed 0, from the xxHash reference.
    assert_eq!(xxhash_rust::xxh3::xxh3_64(b""), 0x2D06_8005_38D3_94C2);
}

#[test]
fn block_zero_is_its_tokens_le_seeded_by_the_keyspace() {
    let ks = Keyspace::tokens("m");
    let tokens: Vec<u32> = (1000..1032).collect();
    let le: Vec<u8> = tokens[..16].iter().flat_map(|t| t.to_le_bytes()).collect();
    let chain = token_chain(ks.seed(16), 16, &tokens);
    assert_eq!(
        chain[0],
        xxhash_rust::xxh3::xxh3_64_with_seed(&le, ks.seed(16))
    );
    let le1: Vec<u8> = tokens[16..].iter().flat_map(|t| t.to_le_bytes()).collect();
    assert_eq!(
        chain[1],
        xxhash_rust::xxh3::xxh3_64_with_seed(&le1, chain[0])
    );
}

#[test]
fn chain_hashes_match_the_golden_file() {
    let now = vectors();
    if std::env::var_os("KVIX_WRITE_GOLDEN").is_some() {
        std::fs::write(PATH, &now).unwrap();
    }
    let pinned = std::fs::read_to_string(PATH).expect("golden file is committed");
    for (line, (want, got)) in pinned.lines().zip(now.lines()).enumerate() {
        assert_eq!(
            got,
            want,
            "golden vector line {} changed: that is a chain hash (and protocol) version bump",
            line + 1
        );
    }
    assert_eq!(pinned.lines().count(), now.lines().count());
}
