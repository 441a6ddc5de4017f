//! The payload fuzz target's seed corpus (server/events/fuzz/seeds/payload): engine
//! batches as vLLM encodes them (0.34's maps, as `encode::vllm_batch` writes them, and
//! 0.9.2's arrays, checked against the real publisher's bytes by server/tests/engines.rs),
//! each one decoding to the batch it was made from, kept equal to what
//! this version encodes. `KVIX_WRITE_SEEDS=1 cargo test -p kvix-events --test
//! fuzz_seeds` rewrites them.

use std::path::PathBuf;

use kvix_events::encode::vllm_batch;
use kvix_events::payload::{decode, Batch, EngineEvent, Medium, Removed, Stored};
use rmpv::Value;

fn batch(events: Vec<EngineEvent>) -> Batch {
    Batch {
        ts: 1.5,
        events,
        dp_rank: 0,
    }
}

fn stored(hashes: Vec<u64>, parent: Option<u64>) -> Stored {
    let tokens = (0..hashes.len() as u32 * 16).collect();
    Stored::plain(hashes, parent, tokens, 16)
}

fn removed(hashes: Vec<u64>) -> EngineEvent {
    EngineEvent::Removed(Removed::new(hashes, Medium::Gpu, 0))
}

/// vLLM 0.9's encoding: every struct an array, the tag first, and no medium yet. The
/// real 0.9.2 publisher sends these bytes (but the timestamp) for this batch
/// (server/tests/engines.rs).
fn v09_arrays() -> (Vec<u8>, Batch) {
    let s = |x: &str| Value::from(x);
    let stored = Value::Array(vec![
        s("BlockStored"),
        Value::Array(vec![Value::from(7u64), Value::from(9u64)]),
        Value::Nil,
        Value::Array((0..32u32).map(Value::from).collect()),
        Value::from(16u32),
        Value::Nil,
    ]);
    let gone = Value::Array(vec![
        s("BlockRemoved"),
        Value::Array(vec![Value::from(9u64)]),
    ]);
    let payload = Value::Array(vec![
        Value::F64(1.5),
        Value::Array(vec![stored, gone]),
        Value::from(0u32),
    ]);
    let mut bytes = Vec::new();
    rmpv::encode::write_value(&mut bytes, &payload).unwrap();
    let want = batch(vec![
        EngineEvent::Stored(self::stored(vec![7, 9], None)),
        removed(vec![9]),
    ]);
    (bytes, want)
}

fn seeds() -> Vec<(&'static str, Vec<u8>, Batch)> {
    let mut hybrid = stored(vec![21, 22], Some(20));
    hybrid.group_idx = 1;
    hybrid.spec_kind = Some("sliding_window".into());
    hybrid.sliding_window = Some(64);
    let mut rank = batch(vec![EngineEvent::Stored(stored(vec![31], None))]);
    rank.dp_rank = 3;
    let batches = [
        (
            "stored",
            batch(vec![EngineEvent::Stored(stored(vec![1, 2], None))]),
        ),
        (
            "stored_continued",
            batch(vec![EngineEvent::Stored(stored(vec![3], Some(2)))]),
        ),
        ("stored_hybrid", batch(vec![EngineEvent::Stored(hybrid)])),
        ("removed", batch(vec![removed(vec![1, 2])])),
        ("cleared", batch(vec![EngineEvent::Cleared])),
        ("dp_rank", rank),
        (
            "mixed",
            batch(vec![
                EngineEvent::Stored(stored(vec![4, 5, 6], None)),
                removed(vec![6]),
                EngineEvent::Unknown("SomethingNew".into()),
                EngineEvent::Cleared,
            ]),
        ),
    ];
    let mut out: Vec<(&'static str, Vec<u8>, Batch)> = batches
        .into_iter()
        .map(|(name, b)| (name, vllm_batch(&b), b))
        .collect();
    let (bytes, want) = v09_arrays();
    out.push(("v09_arrays", bytes, want));
    out
}

#[test]
fn the_seed_corpus_is_current_and_every_seed_decodes_to_its_batch() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fuzz/seeds/payload");
    let seeds = seeds();
    for (name, bytes, want) in &seeds {
        assert_eq!(decode(bytes).as_ref(), Ok(want), "seed {name}");
    }
    if std::env::var("KVIX_WRITE_SEEDS").is_ok() {
        std::fs::create_dir_all(&dir).unwrap();
        for (name, bytes, _) in &seeds {
            std::fs::write(dir.join(name), bytes).unwrap();
        }
    }
    for (name, bytes, _) in &seeds {
        let on_disk = std::fs::read(dir.join(name))
            .unwrap_or_else(|e| panic!("seed {name}: {e} (KVIX_WRITE_SEEDS=1 writes them)"));
        assert_eq!(
            &on_disk, bytes,
            "seed {name} is stale (KVIX_WRITE_SEEDS=1 rewrites it)"
        );
    }
}
