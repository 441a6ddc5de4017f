//! `soak`: placement churn against a server for a while, sampling its resident memory.
//!
//! `workers` placement-fed workers, each capped at `capacity` blocks, receive
//! fire-and-forget placements of fresh chains (a shared system prefix, then blocks of
//! their own) at `rate` per second until every cap is reached and then beyond: the block
//! count goes flat, and so must the memory. The server's metrics endpoint
//! gives its resident bytes, its block count and how many executors hold a copy.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use indicatif::ProgressBar;
use kvix_wire::chain::token_chain;
use kvix_wire::{Feed, Placement, FLAG_NO_REPLY};
use serde::{Deserialize, Serialize};

use crate::metrics::scrape;
use crate::net::WireConn;
use crate::rng::Rng;

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SoakConfig {
    pub server: String,
    pub metrics: String,
    pub workers: usize,
    pub capacity: u64,
    /// Blocks of the shared system prefix, then of each placement's own tail.
    pub prefix_blocks: u32,
    pub tail_blocks: u32,
    /// Placements per second, all workers together.
    pub rate: f64,
    pub duration_s: f64,
    pub sample_s: f64,
    pub token_block: u32,
    pub seed: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Sample {
    pub at_s: f64,
    pub blocks: u64,
    pub resident_bytes: u64,
    /// Resident bytes per block held, per executor's copy of the index.
    pub bytes_per_block_per_copy: f64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SoakReport {
    pub command: String,
    pub config: SoakConfig,
    pub executors: u64,
    pub placements: u64,
    pub samples: Vec<Sample>,
    /// Resident bytes at the end over those when the caps were first all reached.
    pub growth_after_full: f64,
}

pub async fn run(
    cfg: &SoakConfig,
    addr: SocketAddr,
    metrics: SocketAddr,
    pb: &ProgressBar,
) -> anyhow::Result<SoakReport> {
    anyhow::ensure!(cfg.workers > 0 && cfg.rate > 0.0, "need workers and a rate");
    let ks = kvix_wire::Keyspace::tokens("kvix-bench-soak");
    let seed = ks.seed(cfg.token_block);
    let mut conn = WireConn::connect(addr, cfg.token_block).await?;
    let feed = Feed::Placements {
        capacity_blocks: cfg.capacity,
        ttl_ms: 0,
    };
    let mut ids = Vec::with_capacity(cfg.workers);
    for w in 0..cfg.workers {
        let name = format!("soak-{w}");
        let id = conn.announce(&name, feed).await?;
        // Start empty whatever an earlier run left.
        conn.retire(id).await?;
        ids.push(conn.announce(&name, feed).await?);
    }
    let system: Vec<u32> = (0..cfg.prefix_blocks * cfg.token_block).collect();
    let mut rng = Rng::new(cfg.seed);
    let mut tokens = Vec::new();
    let executors = scrape(metrics, &["kvix_executors"])?[0].max(1);
    // Every cap reached: each worker's own blocks, and the prefix they all share once.
    let prefix = cfg.prefix_blocks as u64;
    let full_at = cfg.workers as u64 * cfg.capacity.saturating_sub(prefix) + prefix;
    let (mut samples, mut full_rss) = (Vec::new(), None);
    let start = Instant::now();
    let interval = Duration::from_secs_f64(1.0 / cfg.rate);
    let (mut sent, mut next_sample) = (0u64, 0.0);
    pb.set_length(cfg.duration_s as u64);
    while start.elapsed().as_secs_f64() < cfg.duration_s {
        let due = (start.elapsed().as_secs_f64() * cfg.rate) as u64;
        while sent < due {
            tokens.clear();
            tokens.extend_from_slice(&system);
            tokens.extend((0..cfg.tail_blocks * cfg.token_block).map(|_| rng.next_u64() as u32));
            let chain = token_chain(seed, cfg.token_block, &tokens);
            let worker = ids[sent as usize % ids.len()];
            conn.queue(
                &Placement {
                    worker,
                    keyspace: ks.clone(),
                    chain,
                },
                FLAG_NO_REPLY,
            )?;
            sent += 1;
        }
        conn.flush().await?;
        let at = start.elapsed().as_secs_f64();
        if at >= next_sample {
            let v = scrape(metrics, &["kvix_blocks", "kvix_resident_bytes"])?;
            let (blocks, rss) = (v[0], v[1]);
            if full_rss.is_none() && blocks >= full_at {
                full_rss = Some(rss);
            }
            samples.push(Sample {
                at_s: at,
                blocks,
                resident_bytes: rss,
                bytes_per_block_per_copy: rss as f64 / blocks.max(1) as f64 / executors as f64,
            });
            next_sample += cfg.sample_s;
            pb.set_position(at as u64);
        }
        tokio::time::sleep(interval.min(Duration::from_millis(5))).await;
    }
    pb.finish_and_clear();
    let last = samples.last().map_or(0, |s| s.resident_bytes);
    Ok(SoakReport {
        command: "soak".into(),
        config: cfg.clone(),
        executors,
        placements: sent,
        samples,
        growth_after_full: full_rss.map_or(f64::NAN, |f| last as f64 / f.max(1) as f64),
    })
}
