//! `redis`: the same queries against Redis, llm-d style (one hash per block key
//! `kvix:{chain hash}` whose fields are the names of the workers holding it; a query is
//! a pipelined HKEYS of every block of the chain, the longest prefix per worker computed
//! client side), side by side with kvix, same data loaded in both, interleaved.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use indicatif::ProgressBar;
use kvix_client::{QueryOptions, QueryOutcome};
use serde::{Deserialize, Serialize};

use crate::net::{gateway, Dataset, WireConn};
use crate::resp::{command, longest_prefixes, Redis, Reply};
use crate::rng::Rng;
use crate::stats::{histogram, record, Ratios, Summary};

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RedisConfig {
    pub server: String,
    pub redis: String,
    pub blocks: Vec<u32>,
    pub queries: usize,
    pub warmup: usize,
    pub workers: usize,
    pub chains_per_length: usize,
    pub system_blocks: u32,
    pub token_block: u32,
    pub seed: u64,
    pub max_seconds: f64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RedisRow {
    pub blocks: u32,
    pub kvix: Summary,
    pub redis: Summary,
    /// redis / kvix per percentile.
    pub ratio: Ratios,
    /// Queries where both named the same best score (blocks).
    pub agree: f64,
    pub failures: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RedisReport {
    pub command: String,
    pub config: RedisConfig,
    pub redis_keys: usize,
    pub rows: Vec<RedisRow>,
}

fn key(h: u64) -> Vec<u8> {
    format!("kvix:{h}").into_bytes()
}

/// Loads the dataset into Redis: first deletes every key it will write, then HSETs.
async fn load_redis(r: &mut Redis, ds: &Dataset) -> anyhow::Result<usize> {
    let held = ds.held();
    let mut keys: Vec<u64> = held.iter().flatten().flatten().copied().collect();
    keys.sort_unstable();
    keys.dedup();
    let mut replies = Vec::new();
    for chunk in keys.chunks(1000) {
        let mut cmds = Vec::new();
        for &h in chunk {
            command(&mut cmds, &[b"DEL", &key(h)]);
        }
        r.pipeline(&cmds, chunk.len(), &mut replies).await?;
    }
    let pairs: Vec<(u64, &str)> = held
        .iter()
        .enumerate()
        .flat_map(|(w, chains)| {
            chains
                .iter()
                .flatten()
                .map(move |&h| (h, ds.workers[w].as_str()))
        })
        .collect();
    for chunk in pairs.chunks(1000) {
        let mut cmds = Vec::new();
        for &(h, w) in chunk {
            command(&mut cmds, &[b"HSET", &key(h), w.as_bytes(), b"1"]);
        }
        r.pipeline(&cmds, chunk.len(), &mut replies).await?;
        if let Some(Reply::Error(e)) = replies.iter().find(|x| matches!(x, Reply::Error(_))) {
            anyhow::bail!("redis HSET: {e}");
        }
    }
    Ok(keys.len())
}

pub async fn run(
    cfg: &RedisConfig,
    addr: SocketAddr,
    redis_addr: SocketAddr,
    pb: &ProgressBar,
) -> anyhow::Result<RedisReport> {
    let ds = Dataset::build(
        cfg.seed,
        cfg.token_block,
        cfg.workers,
        &cfg.blocks,
        cfg.chains_per_length,
        cfg.system_blocks,
    );
    let mut r = Redis::connect(redis_addr).await?;
    let redis_keys = load_redis(&mut r, &ds).await?;
    let mut wc = WireConn::connect(addr, cfg.token_block).await?;
    ds.preload(&mut wc).await?;
    let client = gateway(
        &[addr],
        cfg.token_block,
        Duration::from_secs(1),
        None,
        "kvix-bench-redis",
    )
    .await?;
    let opts = QueryOptions::default(); // all workers, as the Redis side computes
    pb.set_length((cfg.blocks.len() * (cfg.queries + cfg.warmup)) as u64);
    let mut rng = Rng::new(cfg.seed ^ 0x4ed1);
    let mut rows = Vec::new();
    let mut replies = Vec::new();
    for (g, &len) in ds.lengths.iter().enumerate() {
        let chains = &ds.chains[g];
        let (mut hk, mut hr) = (histogram(), histogram());
        let (mut agree, mut n, mut failures) = (0u64, 0u64, 0u64);
        let start = Instant::now();
        for i in 0..cfg.warmup + cfg.queries {
            if start.elapsed().as_secs_f64() > cfg.max_seconds {
                break;
            }
            let chain = &chains[rng.below(chains.len() as u64) as usize];
            let measured = i >= cfg.warmup;
            let (mut kbest, mut rbest) = (0u32, 0u32);
            for step in 0..2 {
                if (step == 0) == (i % 2 == 0) {
                    let t = Instant::now();
                    let out = client.query_chain(&ds.keyspace, chain, &opts).await;
                    let ns = t.elapsed().as_nanos() as u64;
                    match out {
                        QueryOutcome::Scores(s) => {
                            kbest = s.first().map(|x| x.blocks).unwrap_or(0);
                            if measured {
                                record(&mut hk, ns);
                            }
                        }
                        QueryOutcome::Empty => {
                            if measured {
                                record(&mut hk, ns);
                            }
                        }
                        _ => failures += measured as u64,
                    }
                } else {
                    let t = Instant::now();
                    let mut cmds = Vec::with_capacity(chain.len() * 40);
                    for &h in chain {
                        command(&mut cmds, &[b"HKEYS", &key(h)]);
                    }
                    r.pipeline(&cmds, chain.len(), &mut replies).await?;
                    let scores = longest_prefixes(&replies);
                    let ns = t.elapsed().as_nanos() as u64;
                    rbest = scores.first().map(|x| x.1).unwrap_or(0);
                    if measured {
                        record(&mut hr, ns);
                    }
                }
            }
            if measured {
                n += 1;
                agree += (kbest == rbest) as u64;
            }
            pb.inc(1);
        }
        let (k, rs) = (Summary::of(&hk), Summary::of(&hr));
        rows.push(RedisRow {
            blocks: len,
            ratio: rs.ratio(&k),
            kvix: k,
            redis: rs,
            agree: if n == 0 { 0.0 } else { agree as f64 / n as f64 },
            failures,
        });
    }
    pb.finish_and_clear();
    drop(wc);
    Ok(RedisReport {
        command: "redis".into(),
        config: cfg.clone(),
        redis_keys,
        rows,
    })
}
