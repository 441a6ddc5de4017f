//! The skew benchmark: every prompt shares a 2k-token system prefix, yet the work of
//! answering must spread evenly over the shards. Work is counted in blocks visited per
//! shard (`kvix_shard_work_total`), so the figure is deterministic, not a timing.
//!
//! Run: `cargo test -p kvix-server --test skew -- --nocapture`

mod common;

use common::*;
use kvix_wire::*;

const SHARDS: usize = 4;
const PREFIX_BLOCKS: usize = 125; // 2000 tokens at 16 tokens per block

fn shard_work(metrics: &str) -> Vec<u64> {
    (0..SHARDS)
        .map(|s| {
            let key = format!("kvix_shard_work_total{{shard=\"{s}\"}} ");
            let line = metrics
                .lines()
                .find(|l| l.starts_with(&key))
                .expect("per-shard work metric");
            line[key.len()..].trim().parse().unwrap()
        })
        .collect()
}

fn prompt(ks: &Keyspace, user: u32, suffix_blocks: usize) -> Vec<u64> {
    let mut tokens: Vec<u32> = (0..(PREFIX_BLOCKS as u32 * 16)).collect();
    tokens.extend((0..suffix_blocks as u32 * 16).map(|i| 1_000_000 + user * 10_000 + i));
    chain::token_chain(ks.seed(16), 16, &tokens)
}

#[test]
fn a_shared_system_prefix_spreads_evenly_over_four_shards() {
    let server = Server::start(&["--cores", "4", "--pin", "false", "--segment", "16"]);
    let mut c = server.session();
    let ks = Keyspace::tokens("meta-llama/Llama-3.1-8B");
    let mut workers = Vec::new();
    for w in 0..8 {
        let id = c
            .announce(&format!("w{w}"), vec![Lane::full(16)], Feed::Events)
            .unwrap()
            .worker;
        let chain = prompt(&ks, w, 20);
        c.ask(&EventBatch {
            worker: id,
            seq: 0,
            keyspace: ks.clone(),
            events: vec![Event::Stored {
                lane: 0,
                start: 0,
                chain,
                engine: vec![],
            }],
        });
        workers.push(id);
    }
    let before = shard_work(&server.scrape());
    let mut naive = vec![0u64; SHARDS];
    for q in 0..400u32 {
        // Short and long questions after the shared prefix.
        let chain = prompt(&ks, q % 16, 5 + (q as usize * 7) % 60);
        let ans = c.query(&ks, &chain);
        assert_eq!(ans.scores.len(), 8, "every worker holds the shared prefix");
        // What sharding a whole chain by its first block's hash would have done.
        naive[(chain[0] % SHARDS as u64) as usize] += chain.len() as u64;
    }
    let after = shard_work(&server.scrape());
    let work: Vec<u64> = after.iter().zip(&before).map(|(a, b)| a - b).collect();
    let mean = work.iter().sum::<u64>() as f64 / SHARDS as f64;
    let busiest = *work.iter().max().unwrap() as f64 / mean;
    let naive_mean = naive.iter().sum::<u64>() as f64 / SHARDS as f64;
    let naive_busiest = *naive.iter().max().unwrap() as f64 / naive_mean;
    println!("blocks visited per shard: {work:?}; busiest / mean = {busiest:.3}");
    println!("whole-chain-by-first-hash sharding would give {naive:?}; busiest / mean = {naive_busiest:.3}");
    assert!(
        busiest <= 1.25,
        "busiest shard {busiest:.3}× the mean: {work:?}"
    );
}
