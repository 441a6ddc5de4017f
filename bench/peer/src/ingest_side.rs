//! kvix fed through its own ingest: each store as vLLM publishes it (token ids, engine
//! hashes, the parent's engine hash), turned into kvix events by the server's
//! translator (`kvix_events::translate`: token rehash, the engine-hash map) and
//! applied by the engine, on one thread, as on a worker's home executor. Dynamo's side
//! is handed its per-block token hashes ready-made (its publisher computes them on the
//! worker), so this figure charges kvix for hashing that Dynamo's does not include.

use std::time::{Duration, Instant};

use kvix_engine::{Engine, Ks};
use kvix_events::payload::{self, Batch, EngineEvent, Stored};
use kvix_events::translate::{Counts, Translator};
use kvix_wire::{ChunkKind, Lane};

use crate::workload::{self, splitmix, Block, Ev, TOKEN_BLOCK};

/// One engine batch per store, with its worker, decoded and as vLLM's msgpack bytes;
/// built ahead of time (not timed).
pub type Prepared = Vec<(u32, Batch, Vec<u8>)>;

/// `batch` as vLLM 0.9's publisher encodes it: `[ts, [event, ...], dp_rank]`, each store
/// `["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id,
/// medium]`.
fn msgpack(batch: &Batch) -> Vec<u8> {
    use rmpv::Value;
    let events = batch
        .events
        .iter()
        .map(|e| match e {
            EngineEvent::Stored(st) => Value::Array(vec![
                Value::from("BlockStored"),
                Value::Array(st.block_hashes.iter().map(|&h| Value::from(h)).collect()),
                st.parent.map_or(Value::Nil, Value::from),
                Value::Array(st.token_ids.iter().map(|&t| Value::from(t)).collect()),
                Value::from(st.block_size),
                Value::Nil,
                Value::from("GPU"),
            ]),
            other => panic!("the load has stores only: {other:?}"),
        })
        .collect();
    let v = Value::Array(vec![
        Value::F64(batch.ts),
        Value::Array(events),
        Value::from(batch.dp_rank),
    ]);
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, &v).expect("a Vec takes any value");
    out
}

/// The tokens of a block: a function of its own-token hash, as Dynamo's tree is keyed,
/// so both sides see the same tree.
fn tokens(b: &Block, out: &mut Vec<u32>) {
    out.extend((0..TOKEN_BLOCK as u64).map(|i| splitmix(b.local ^ i) as u32));
}

/// The load's stores as vLLM batches (removals and clears are not part of a load).
pub fn prepare(events: &[Ev]) -> Prepared {
    let mut out = Vec::new();
    for e in events {
        if let Ev::Store {
            worker,
            parent,
            blocks,
            ..
        } = e
        {
            let mut token_ids = Vec::with_capacity(blocks.len() * TOKEN_BLOCK as usize);
            for b in blocks {
                tokens(b, &mut token_ids);
            }
            let stored = Stored::plain(
                blocks.iter().map(|b| b.engine).collect(),
                parent.map(|p| p.engine),
                token_ids,
                TOKEN_BLOCK,
            );
            let batch = Batch {
                ts: 0.0,
                events: vec![EngineEvent::Stored(stored)],
                dp_rank: 0,
            };
            // vLLM 0.9's arrays by default; KVIX_PEER_VLLM=0.34: its tagged maps
            // (kvix_events::encode, checked against the real 0.34 publisher).
            let bytes = match std::env::var("KVIX_PEER_VLLM").as_deref() {
                Ok("0.34") => kvix_events::encode::vllm_batch(&batch),
                _ => msgpack(&batch),
            };
            out.push((*worker, batch, bytes));
        }
    }
    out
}

/// What one load through the ingest took.
pub struct Loaded {
    pub took: Duration,
    pub engine: Engine,
    /// Heap bytes of the translators and the engine together.
    pub bytes: usize,
}

/// Which part of the ingest path a load runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Path {
    /// The translator, then the engine: what the server does.
    Whole,
    /// The translator alone (its events dropped): for profiling its share.
    TranslatorOnly,
    /// vLLM's msgpack bytes decoded (`kvix_events::payload`), then as `Whole`.
    Decoded,
}

/// Translates every batch and, for [`Path::Whole`], applies its events; `live` counts
/// heap bytes.
pub fn apply(workers: u32, batches: &Prepared, path: Path, live: impl Fn() -> usize) -> Loaded {
    let before = live();
    let lanes = [Lane::full(TOKEN_BLOCK)];
    let mut engine = workload::fleet_engine(workers);
    let mut translators: Vec<Translator> = (0..workers)
        .map(|_| Translator::new(TOKEN_BLOCK, "model", "", &lanes))
        .collect();
    let mut seqs = vec![0u64; workers as usize];
    let (mut groups, mut counts) = (Vec::new(), Counts::default());
    let t = Instant::now();
    for (w, batch, bytes) in batches {
        let tr = &mut translators[*w as usize];
        groups.clear();
        if path == Path::Decoded {
            let decoded = payload::decode(bytes).expect("the bytes decode");
            tr.apply(&decoded, &mut groups, &mut counts);
        } else {
            tr.apply(batch, &mut groups, &mut counts);
        }
        if path == Path::TranslatorOnly {
            continue;
        }
        for g in &groups {
            let ks = Ks {
                seed: tr.seed(g.ks),
                kind: ChunkKind::Tokens,
            };
            let seq = &mut seqs[*w as usize];
            engine
                .apply(*w, *seq, ks, &g.events)
                .expect("translated events apply");
            *seq += 1;
        }
    }
    let took = t.elapsed();
    assert_eq!(
        counts.skipped.iter().sum::<u64>(),
        0,
        "the translator took every store"
    );
    drop(groups);
    let bytes = live() - before;
    drop(translators);
    Loaded {
        took,
        engine,
        bytes,
    }
}
