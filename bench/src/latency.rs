//! `latency`: closed-loop queries against a server through kvix-client, each paired with
//! an Echo of the same request and reply sizes over the same client and connection —
//! the transport floor, measured in the same run, interleaved so noise hits both alike.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use indicatif::ProgressBar;
use kvix_client::{Client, QueryOptions, QueryOutcome};
use kvix_wire::{encode, Answer, Echo, Query, Score};
use serde::{Deserialize, Serialize};

use crate::net::{gateway_with, Dataset, WireConn};
use crate::rng::Rng;
use crate::stats::{histogram, record, Ratios, Summary};

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LatencyConfig {
    pub server: String,
    pub blocks: Vec<u32>,
    pub queries: usize,
    pub warmup: usize,
    pub workers: usize,
    pub chains_per_length: usize,
    pub system_blocks: u32,
    pub top_k: u32,
    pub token_block: u32,
    /// Client spins this long before parking (None: park at once).
    pub spin_us: Option<u64>,
    pub seed: u64,
    pub max_seconds: f64,
    /// TLS to the server (`kvix-server --tls-cert`): the CA its certificate is signed
    /// by. None: plain TCP.
    #[serde(default)]
    pub tls_ca: Option<std::path::PathBuf>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LatencyRow {
    pub blocks: u32,
    pub request_bytes: usize,
    pub reply_bytes: usize,
    pub echo_request_bytes: usize,
    pub echo_reply_bytes: usize,
    pub query: Summary,
    pub floor: Summary,
    /// query / floor per percentile.
    pub ratio: Ratios,
    /// Queries that did not come back as scores (timeout, disconnect, refusal).
    pub not_scored: u64,
    pub echo_errors: u64,
    pub mean_scores: f64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LatencyReport {
    pub command: String,
    pub config: LatencyConfig,
    pub server_shards: u32,
    pub rows: Vec<LatencyRow>,
}

/// The payload length whose Echo frame is closest to `target` bytes.
pub fn echo_payload_for(target: usize, reply_len: u32) -> (usize, usize) {
    let size = |p: usize| {
        encode(
            &Echo {
                payload: vec![0; p],
                reply_len,
            },
            0,
            0,
        )
        .map(|f| f.len())
        .unwrap_or(usize::MAX)
    };
    let base = size(0);
    let guess = target.saturating_sub(base);
    let mut best = (0usize, base);
    for p in guess.saturating_sub(16)..=guess + 16 {
        let s = size(p);
        if s.abs_diff(target) < best.1.abs_diff(target) || (s == target && best.1 != target) {
            best = (p, s);
        }
    }
    best
}

/// Query frame bytes and answer frame bytes for `chain` with `scores` scores.
pub fn query_sizes(q: &Query, scores: usize) -> (usize, usize) {
    let req = encode(q, 0, 0).map(|f| f.len()).unwrap_or(0);
    let ans = Answer {
        scores: vec![
            Score {
                worker: 0,
                blocks: 0
            };
            scores
        ],
        unscorable: 0,
        runs: Vec::new(),
        history_lost: Vec::new(),
        reissued: 0,
    };
    let rep = encode(&ans, 0, 0).map(|f| f.len()).unwrap_or(0);
    (req, rep)
}

pub async fn run(
    cfg: &LatencyConfig,
    addr: SocketAddr,
    pb: &ProgressBar,
) -> anyhow::Result<LatencyReport> {
    let ds = Dataset::build(
        cfg.seed,
        cfg.token_block,
        cfg.workers,
        &cfg.blocks,
        cfg.chains_per_length,
        cfg.system_blocks,
    );
    let tls = cfg.tls_ca.as_ref().map(|ca| kvix_client::ClientTls {
        ca: ca.clone(),
        server_name: None,
        identity: None,
    });
    let mut wc = WireConn::connect_with(addr, cfg.token_block, tls.as_ref()).await?;
    let shards = wc.welcome.shards;
    ds.preload(&mut wc).await?;
    let client = gateway_with(
        &[addr],
        cfg.token_block,
        Duration::from_secs(1),
        cfg.spin_us.map(Duration::from_micros),
        "kvix-bench-latency",
        tls,
    )
    .await?;
    pb.set_length((cfg.blocks.len() * (cfg.queries + cfg.warmup)) as u64);
    let mut rows = Vec::new();
    let mut rng = Rng::new(cfg.seed ^ 0x1a7e);
    for (g, &len) in ds.lengths.iter().enumerate() {
        rows.push(measure(cfg, &client, &ds, g, len, &mut rng, pb).await?);
    }
    pb.finish_and_clear();
    drop(wc);
    Ok(LatencyReport {
        command: "latency".into(),
        config: cfg.clone(),
        server_shards: shards,
        rows,
    })
}

async fn measure(
    cfg: &LatencyConfig,
    client: &Client,
    ds: &Dataset,
    g: usize,
    len: u32,
    rng: &mut Rng,
    pb: &ProgressBar,
) -> anyhow::Result<LatencyRow> {
    let opts = QueryOptions {
        top_k: cfg.top_k,
        ..Default::default()
    };
    let chains = &ds.chains[g];
    // Size the floor from one real answer.
    let first = client.query_chain(&ds.keyspace, &chains[0], &opts).await;
    let n_scores = match &first {
        QueryOutcome::Scores(s) => s.len(),
        _ => 0,
    };
    let q = Query {
        keyspace: ds.keyspace.clone(),
        chain: chains[0].clone(),
        candidates: Vec::new(),
        top_k: cfg.top_k,
        want_runs: false,
    };
    let (req, rep) = query_sizes(&q, n_scores);
    let (reply_payload, echo_rep) = echo_payload_for(rep, 0);
    let (payload, echo_req) = echo_payload_for(req, reply_payload as u32);
    let (mut hq, mut hf) = (histogram(), histogram());
    let (mut not_scored, mut echo_errors, mut scores_sum) = (0u64, 0u64, 0u64);
    let start = Instant::now();
    for i in 0..cfg.warmup + cfg.queries {
        if start.elapsed().as_secs_f64() > cfg.max_seconds {
            break;
        }
        let chain = &chains[rng.below(chains.len() as u64) as usize];
        let measured = i >= cfg.warmup;
        // Alternate which goes first so neither always follows the other.
        for step in 0..2 {
            if (step == 0) == (i % 2 == 0) {
                let t = Instant::now();
                let out = client.query_chain(&ds.keyspace, chain, &opts).await;
                let ns = t.elapsed().as_nanos() as u64;
                if measured {
                    match out {
                        QueryOutcome::Scores(s) => {
                            scores_sum += s.len() as u64;
                            record(&mut hq, ns);
                        }
                        _ => not_scored += 1,
                    }
                }
            } else {
                let t = Instant::now();
                let out = client.echo(vec![0u8; payload], reply_payload as u32).await;
                let ns = t.elapsed().as_nanos() as u64;
                if measured {
                    match out {
                        Ok(_) => record(&mut hf, ns),
                        Err(_) => echo_errors += 1,
                    }
                }
            }
        }
        pb.inc(1);
    }
    let (query, floor) = (Summary::of(&hq), Summary::of(&hf));
    Ok(LatencyRow {
        blocks: len,
        request_bytes: req,
        reply_bytes: rep,
        echo_request_bytes: echo_req,
        echo_reply_bytes: echo_rep,
        ratio: query.ratio(&floor),
        query,
        floor,
        not_scored,
        echo_errors,
        mean_scores: if hq.is_empty() {
            0.0
        } else {
            scores_sum as f64 / hq.len() as f64
        },
    })
}
