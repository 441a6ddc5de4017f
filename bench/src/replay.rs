//! Trace replay: route each trace request to a worker via an index, publish the
//! placement, and measure the index round trip and how deep its answers reach.

use std::time::{Duration, Instant};

use indicatif::ProgressBar;
use serde::{Deserialize, Serialize};

use crate::stats::{histogram, record, Summary};
use crate::trace::{trace_chain, TraceRecord};
use kvix_client::pick::Picker;

/// What a replay talks to: the in-process engine or a server through the client.
pub trait IndexTarget {
    /// Worker ids, in announce order (index `i` = simulated worker `i`).
    fn workers(&self) -> &[u32];
    /// The keyspace seed chains are hashed with.
    fn seed(&self) -> u64;
    /// (worker id, reusable blocks) for `chain`.
    fn query(&mut self, chain: &[u64], out: &mut Vec<(u32, u32)>) -> anyhow::Result<()>;
    /// Publish that `worker` (an id) now serves `chain`.
    fn place(&mut self, worker: u32, chain: &[u64], now_ms: u64) -> anyhow::Result<()>;
}

/// How to replay.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ReplayConfig {
    /// Keyspace blocks per 512-token trace block.
    pub sub_blocks: u32,
    /// Load penalty in blocks per in-flight request.
    pub alpha: f64,
    /// `None`: as fast as possible; `Some(s)`: at `s`× the trace's own pace.
    pub speed: Option<f64>,
    /// At most this many requests.
    pub limit: usize,
    /// Stop after this much wall time.
    pub max_seconds: f64,
    /// Simulated service time model for in-flight counts (trace clock), per token.
    pub prefill_us_per_token: f64,
    pub decode_ms_per_token: f64,
}

/// What a replay measured.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ReplayResult {
    pub target: String,
    pub requests: u64,
    pub prompt_blocks_mean: f64,
    /// Σ matched blocks on the chosen worker / Σ prompt blocks.
    pub hit_depth: f64,
    /// Σ best matched blocks over all workers / Σ prompt blocks.
    pub best_depth: f64,
    /// Share of requests whose chosen worker matched at least one block.
    pub hit_share: f64,
    pub query: Summary,
    pub place: Summary,
    /// Replay wall time and the achieved request rate.
    pub wall_s: f64,
    pub rate_per_s: f64,
    /// Requests sent later than their scheduled time by more than 1 ms (paced runs).
    pub late: u64,
}

/// Replays `trace` against `target`.
pub fn replay(
    target: &mut dyn IndexTarget,
    name: &str,
    trace: &[TraceRecord],
    cfg: &ReplayConfig,
    progress: &ProgressBar,
) -> anyhow::Result<ReplayResult> {
    let workers = target.workers().to_vec();
    anyhow::ensure!(!workers.is_empty(), "no workers");
    let max_id = *workers.iter().max().unwrap() as usize;
    let mut index_of = vec![usize::MAX; max_id + 1];
    for (i, &w) in workers.iter().enumerate() {
        index_of[w as usize] = i;
    }
    let mut picker = Picker::new(workers.len());
    let mut inflight = vec![0u32; workers.len()];
    // (done at trace µs, worker) min-heap.
    let mut done = std::collections::BinaryHeap::new();
    let (mut hq, mut hp) = (histogram(), histogram());
    let (mut matched, mut best, mut blocks, mut hits, mut late) = (0u64, 0u64, 0u64, 0u64, 0u64);
    let mut answer = Vec::new();
    let n = trace.len().min(cfg.limit);
    progress.set_length(n as u64);
    let start = Instant::now();
    let t0 = trace.first().map(|r| r.timestamp).unwrap_or(0.0);
    let mut requests = 0u64;
    for (i, rec) in trace[..n].iter().enumerate() {
        if start.elapsed().as_secs_f64() > cfg.max_seconds {
            break;
        }
        let ts = rec.timestamp - t0;
        if let Some(speed) = cfg.speed {
            let due = Duration::from_secs_f64((ts / 1000.0 / speed).max(0.0));
            let el = start.elapsed();
            if due > el {
                std::thread::sleep(due - el);
            } else if el - due > Duration::from_millis(1) {
                late += 1;
            }
        }
        let now_us = (ts * 1000.0) as u64;
        while let Some(&std::cmp::Reverse((t, w))) = done.peek() {
            if t > now_us {
                break;
            }
            done.pop();
            inflight[w] -= 1;
        }
        let chain = trace_chain(target.seed(), cfg.sub_blocks, &rec.hash_ids);
        let q0 = Instant::now();
        target.query(&chain, &mut answer)?;
        record(&mut hq, q0.elapsed().as_nanos() as u64);
        let top = answer.iter().map(|&(_, b)| b).max().unwrap_or(0);
        let scores = answer
            .iter()
            .filter_map(|&(id, b)| index_of.get(id as usize).map(|&w| (w as u32, b)))
            .filter(|&(w, _)| w as usize != usize::MAX);
        let picked = picker.pick(scores, &inflight, cfg.alpha, i as u64);
        let (w, got) = (picked.index, picked.reuse as u32);
        let p0 = Instant::now();
        target.place(workers[w], &chain, now_us / 1000)?;
        record(&mut hp, p0.elapsed().as_nanos() as u64);
        matched += got as u64;
        best += top as u64;
        blocks += chain.len() as u64;
        hits += (got > 0) as u64;
        inflight[w] += 1;
        let service = rec.input_length as f64 * cfg.prefill_us_per_token
            + rec.output_length as f64 * cfg.decode_ms_per_token * 1000.0;
        done.push(std::cmp::Reverse((now_us + service as u64, w)));
        requests += 1;
        progress.inc(1);
    }
    progress.finish_and_clear();
    let wall = start.elapsed().as_secs_f64();
    let ratio = |a: u64, b: u64| if b == 0 { 0.0 } else { a as f64 / b as f64 };
    Ok(ReplayResult {
        target: name.to_string(),
        requests,
        prompt_blocks_mean: ratio(blocks, requests),
        hit_depth: ratio(matched, blocks),
        best_depth: ratio(best, blocks),
        hit_share: ratio(hits, requests),
        query: Summary::of(&hq),
        place: Summary::of(&hp),
        wall_s: wall,
        rate_per_s: if wall > 0.0 {
            requests as f64 / wall
        } else {
            0.0
        },
        late,
    })
}

/// The in-process target: a [`kvix_engine::Engine`] with placement-fed workers.
pub struct InProcess {
    engine: kvix_engine::Engine,
    ks: kvix_engine::Ks,
    ids: Vec<u32>,
    answer: kvix_engine::Answer,
}

impl InProcess {
    pub fn new(workers: u32, capacity_blocks: u64, token_block: u32) -> anyhow::Result<Self> {
        let mut engine = kvix_engine::Engine::new(token_block);
        let keyspace = kvix_wire::Keyspace::tokens("mooncake-trace");
        let ks = kvix_engine::Ks::of(&keyspace, token_block);
        let lanes = [kvix_wire::Lane {
            kind: kvix_wire::LaneKind::FullAttention,
            block_tokens: token_block,
        }];
        let feed = kvix_wire::Feed::Placements {
            capacity_blocks,
            ttl_ms: 0,
        };
        let ids = (0..workers)
            .map(|w| {
                engine
                    .announce(&format!("trace-worker-{w}"), &lanes, feed)
                    .map(|(id, _)| id)
                    .map_err(|e| anyhow::anyhow!("announce: {e}"))
            })
            .collect::<anyhow::Result<Vec<_>>>()?;
        Ok(InProcess {
            engine,
            ks,
            ids,
            answer: kvix_engine::Answer::default(),
        })
    }

    pub fn engine(&self) -> &kvix_engine::Engine {
        &self.engine
    }
}

impl IndexTarget for InProcess {
    fn workers(&self) -> &[u32] {
        &self.ids
    }

    fn seed(&self) -> u64 {
        self.ks.seed
    }

    fn query(&mut self, chain: &[u64], out: &mut Vec<(u32, u32)>) -> anyhow::Result<()> {
        self.engine
            .query_into(self.ks, chain, None, 0, false, &mut self.answer);
        out.clear();
        out.extend_from_slice(&self.answer.scores);
        Ok(())
    }

    fn place(&mut self, worker: u32, chain: &[u64], now_ms: u64) -> anyhow::Result<()> {
        match self.engine.place(worker, self.ks, chain, now_ms) {
            Ok(true) => Ok(()),
            Ok(false) => anyhow::bail!("place: worker {worker} does not take placements"),
            Err(e) => anyhow::bail!("place: {e}"),
        }
    }
}

/// A kvix-server target: workers announced (placement feed) over a worker-side wire
/// connection, queries and placements through kvix-client, as a gateway would.
pub struct Remote {
    rt: tokio::runtime::Runtime,
    client: kvix_client::Client,
    keyspace: kvix_wire::Keyspace,
    seed: u64,
    ids: Vec<u32>,
    opts: kvix_client::QueryOptions,
    _conn: crate::net::WireConn,
    pub not_scored: u64,
}

impl Remote {
    pub fn connect(
        addr: std::net::SocketAddr,
        workers: u32,
        capacity_blocks: u64,
        token_block: u32,
    ) -> anyhow::Result<Self> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let keyspace = kvix_wire::Keyspace::tokens("mooncake-trace");
        let (conn, ids, client) = rt.block_on(async {
            let mut conn = crate::net::WireConn::connect(addr, token_block).await?;
            let feed = kvix_wire::Feed::Placements {
                capacity_blocks,
                ttl_ms: 0,
            };
            let mut ids = Vec::new();
            for w in 0..workers {
                ids.push(conn.announce(&format!("trace-worker-{w}"), feed).await?);
            }
            let client = crate::net::gateway(
                &[addr],
                token_block,
                Duration::from_secs(1),
                None,
                "kvix-bench-trace",
            )
            .await?;
            anyhow::Ok((conn, ids, client))
        })?;
        Ok(Remote {
            rt,
            client,
            seed: keyspace.seed(token_block),
            keyspace,
            ids,
            opts: kvix_client::QueryOptions::default(),
            _conn: conn,
            not_scored: 0,
        })
    }
}

impl IndexTarget for Remote {
    fn workers(&self) -> &[u32] {
        &self.ids
    }

    fn seed(&self) -> u64 {
        self.seed
    }

    fn query(&mut self, chain: &[u64], out: &mut Vec<(u32, u32)>) -> anyhow::Result<()> {
        let outcome = self
            .rt
            .block_on(self.client.query_chain(&self.keyspace, chain, &self.opts));
        out.clear();
        match outcome {
            kvix_client::QueryOutcome::Scores(s) => {
                out.extend(s.iter().map(|x| (x.worker, x.blocks)))
            }
            kvix_client::QueryOutcome::Empty => {}
            other => {
                self.not_scored += 1;
                anyhow::ensure!(
                    self.not_scored < 100,
                    "server stopped answering: {}",
                    other.kind()
                );
            }
        }
        Ok(())
    }

    fn place(&mut self, worker: u32, chain: &[u64], _now_ms: u64) -> anyhow::Result<()> {
        let _g = self.rt.enter();
        self.client
            .publish_placement(worker, &self.keyspace, chain.to_vec());
        // Let the background sender run so placements do not pile up in the queue.
        self.rt.block_on(tokio::task::yield_now());
        Ok(())
    }
}
