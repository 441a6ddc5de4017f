//! Memory per block and per extra holder, counted by a global allocator (requested
//! bytes; malloc's own per-allocation overhead is not included).
//! `cargo bench -p kvix-engine --bench memory`

mod common;
#[path = "common/counting.rs"]
mod counting;

use kvix_engine::{BlockIndex, Engine, Holder};
use kvix_wire::{Event, Feed, Lane};

#[global_allocator]
static ALLOC: counting::Counting = counting::Counting;

const CHAINS: u32 = 5_000;
const LEN: u32 = 100;

fn per(bytes: usize, n: u64) -> f64 {
    bytes as f64 / n as f64
}

fn main() {
    let chains: Vec<Vec<u64>> = (0..CHAINS).map(|c| common::chain(c, LEN)).collect();
    let ks = common::KS.seed;

    // 1. One shard's block store, one holder per chain.
    let base = counting::live();
    let mut ix = BlockIndex::new();
    for (c, ch) in chains.iter().enumerate() {
        ix.insert(ks, Holder::new(c as u32 % 240, 0), 0, None, ch)
            .unwrap();
    }
    let one = counting::live() - base;
    println!(
        "index, 1 holder:          {:>9} blocks  {:>6.1} B/block  ({} runs)",
        ix.blocks(),
        per(one, ix.blocks()),
        ix.runs()
    );

    // 2. Three more holders of each whole chain (shared runs, interned sets).
    let mid = counting::live();
    for (c, ch) in chains.iter().enumerate() {
        for extra in 1..=3u32 {
            ix.insert(
                ks,
                Holder::new((c as u32 + extra * 7) % 240, 0),
                0,
                None,
                ch,
            )
            .unwrap();
        }
    }
    let extra = counting::live() - mid;
    let added = ix.memberships() - ix.blocks();
    println!(
        "index, +3 whole holders:  {:>9} extra   {:>6.1} B/extra holder ({} runs)",
        added,
        per(extra, added),
        ix.runs()
    );

    // 3. Three more holders of prefixes of different depths: runs split per depth.
    let mid = counting::live();
    let before = ix.memberships();
    for (c, ch) in chains.iter().enumerate() {
        for (i, depth) in [30usize, 60, 90].into_iter().enumerate() {
            let w = (c as u32 + 100 + i as u32) % 240;
            ix.insert(ks, Holder::new(w, 0), 0, None, &ch[..depth])
                .unwrap();
        }
    }
    let extra = counting::live() - mid;
    let added = ix.memberships() - before;
    println!(
        "index, +3 prefix holders: {:>9} extra   {:>6.1} B/extra holder ({} runs)",
        added,
        per(extra, added),
        ix.runs()
    );
    println!(
        "index, total:             {:>9} blocks  {:>6.1} B/block over {} memberships",
        ix.blocks(),
        per(counting::live() - base, ix.blocks()),
        ix.memberships()
    );
    drop(ix);
    println!(
        "index dropped:            {} B left",
        counting::live() - base
    );

    // 4. Worst case: a second holder of every other block: one run per block.
    let base = counting::live();
    let mut ix = BlockIndex::new();
    for (c, ch) in chains.iter().enumerate().take(1000) {
        ix.insert(ks, Holder::new(c as u32, 0), 0, None, ch)
            .unwrap();
        for p in (0..LEN as usize).step_by(2) {
            ix.insert(
                ks,
                Holder::new(c as u32 + 1, 0),
                p as u32,
                None,
                &ch[p..p + 1],
            )
            .unwrap();
        }
    }
    println!(
        "index, fragmented:        {:>9} blocks  {:>6.1} B/block  ({} runs, worst case)",
        ix.blocks(),
        per(counting::live() - base, ix.blocks()),
        ix.runs()
    );
    drop(ix);

    // 5. The whole engine with event feeds (engine-hash map for removals) and removal.
    let base = counting::live();
    let mut e = Engine::new(common::TB);
    let ids: Vec<u32> = (0..240)
        .map(|w| {
            e.announce(&format!("w{w}"), &[Lane::full(common::TB)], Feed::Events)
                .unwrap()
                .0
        })
        .collect();
    let stored: Vec<Event> = chains
        .iter()
        .map(|ch| Event::Stored {
            lane: 0,
            start: 0,
            parent: None,
            chain: ch.clone(),
            engine: ch.iter().map(|h| h ^ 0xe).collect(),
        })
        .collect();
    let after_setup = counting::live();
    for (c, ev) in stored.iter().enumerate() {
        e.apply(ids[c % 240], c as u64, common::KS, std::slice::from_ref(ev))
            .unwrap();
    }
    let blocks = e.stats().blocks;
    println!(
        "engine + event feeds:     {:>9} blocks  {:>6.1} B/block  (index + engine-hash names)",
        blocks,
        per(counting::live() - after_setup, blocks)
    );
    for (c, ev) in stored.iter().enumerate() {
        let Event::Stored { engine, .. } = ev else {
            unreachable!()
        };
        let rm = Event::Removed {
            lane: 0,
            hashes: engine.clone(),
        };
        e.apply(ids[c % 240], (CHAINS + c as u32) as u64, common::KS, &[rm])
            .unwrap();
    }
    println!(
        "engine after removing all: {} blocks, {} B still allocated (arenas keep their peak capacity)",
        e.stats().blocks,
        counting::live().saturating_sub(after_setup),
    );
    drop(stored);
    drop(e);
    println!(
        "engine dropped:           {} B left",
        counting::live().saturating_sub(base)
    );
}
