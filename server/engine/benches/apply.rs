//! Event apply throughput in block events per second, one core.
//! `cargo bench -p kvix-engine --bench apply`

mod common;

use criterion::{black_box, criterion_group, criterion_main, Criterion, Throughput};
use kvix_engine::Engine;
use kvix_wire::{Event, Feed, Lane};

const WORKERS: u32 = 8;
const EVENTS: u32 = 32;
const BLOCKS: u32 = 16;

fn apply(c: &mut Criterion) {
    let mut e = Engine::new(common::TB);
    let ids: Vec<u32> = (0..WORKERS)
        .map(|w| {
            e.announce(&format!("w{w}"), &[Lane::full(common::TB)], Feed::Events)
                .unwrap()
                .0
        })
        .collect();
    // Each worker stores 32 distinct 16-block chains (with engine hashes), on top of a
    // shared 64-block prefix, then removes them by engine hash: a flat steady state.
    let prefix = common::chain(7, 64);
    let batches: Vec<(Vec<Event>, Vec<Event>)> = (0..WORKERS)
        .map(|w| {
            let stores = (0..EVENTS)
                .map(|i| {
                    let mut tail = common::chain(100 + w * EVENTS + i, 64 + BLOCKS);
                    tail.drain(..64);
                    let engine: Vec<u64> = tail.iter().map(|h| h ^ 0xe).collect();
                    Event::Stored {
                        lane: 0,
                        start: 64,
                        parent: None,
                        chain: tail,
                        engine,
                    }
                })
                .collect::<Vec<_>>();
            let removes = stores
                .iter()
                .map(|s| match s {
                    Event::Stored { engine, .. } => Event::Removed {
                        lane: 0,
                        hashes: engine.clone(),
                    },
                    _ => unreachable!(),
                })
                .collect();
            (stores, removes)
        })
        .collect();
    for &w in &ids {
        e.apply(w, 0, common::KS, &[common::store(0, 0, &prefix)])
            .unwrap();
    }
    let mut seq = 1u64;
    let mut g = c.benchmark_group("apply");
    g.throughput(Throughput::Elements((WORKERS * EVENTS * BLOCKS * 2) as u64));
    g.bench_function("store_remove_16_block_events", |b| {
        b.iter(|| {
            for (&w, (stores, removes)) in ids.iter().zip(&batches) {
                black_box(e.apply(w, seq, common::KS, stores).unwrap());
                black_box(e.apply(w, seq + 1, common::KS, removes).unwrap());
            }
            seq += 2;
        })
    });
    g.finish();
    assert!(e.stats().blocks == 64, "steady state: {:?}", e.stats());
    let _: &Engine = &e;
}

criterion_group!(benches, apply);
criterion_main!(benches);
