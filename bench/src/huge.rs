//! `huge-writes`: what a query waits behind frame-limit writes. One connection sends
//! event batches as large as the server's frame limit (one store, its removal, then ten
//! stores back to back) while another queries a 125-block prompt at a low rate; the
//! queries' latency before and during the writes, and the writes' rate. Run against a
//! kvix-server and against `kvix-bench echo-server` on the same cores (the same frames,
//! each answered at once, queries as Echoes of the same sizes): the transport's floor.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use kvix_wire::{encode, Echo, Event, EventBatch, Feed, Keyspace, MessageRef, Query};
use serde::{Deserialize, Serialize};

use crate::latency::echo_payload_for;
use crate::net::{stored, WireConn};
use crate::rng::Rng;
use crate::stats::{histogram, record, Summary};

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct HugeConfig {
    pub server: String,
    /// The server is `kvix-bench echo-server`: queries go as Echoes of their sizes.
    pub echo: bool,
    /// Stores back to back after the first store and its removal.
    pub stores: usize,
    /// Between two queries.
    pub query_interval_us: u64,
    /// Queries before the writes start (the idle baseline).
    pub idle_queries: usize,
    pub token_block: u32,
    pub seed: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct HugeReport {
    pub command: String,
    pub config: HugeConfig,
    /// Blocks in each batch (as many as the frame limit takes).
    pub blocks_per_batch: usize,
    pub frame_bytes: usize,
    pub idle: Summary,
    pub during_writes: Summary,
    /// Queries during the writes past the 2 ms deadline.
    pub past_deadline: u64,
    pub write_seconds: f64,
    /// Block events (stored and removed) per second over the write phase.
    pub block_events_per_s: f64,
}

const PROMPT_BLOCKS: usize = 125;

/// Chain hashes as the writes use them (kvix takes them as given).
fn chain(rng: &mut Rng, n: usize) -> Vec<u64> {
    (0..n).map(|_| rng.next_u64()).collect()
}

pub async fn run(cfg: &HugeConfig, addr: SocketAddr) -> anyhow::Result<HugeReport> {
    let mut writer = WireConn::connect(addr, cfg.token_block).await?;
    let mut querier = WireConn::connect(addr, cfg.token_block).await?;
    let worker = writer.announce("huge-writes", Feed::Events).await?;
    let ks = Keyspace::tokens("kvix-bench-huge");
    let mut rng = Rng::new(cfg.seed);
    let prompt = chain(&mut rng, PROMPT_BLOCKS);
    writer
        .send(&stored(worker, 0, &ks, prompt.clone()), 0)
        .await?;
    writer.expect_applied().await?;
    // As many blocks as one frame takes: the frame's fixed part, then 8 bytes a block.
    let max = writer.welcome.max_frame as usize;
    let fixed = encode(&stored(worker, 1, &ks, vec![]), 0, 0)?.len() + 64;
    let blocks = (max - fixed) / 8;
    let batches = batches(worker, &ks, &mut rng, blocks, cfg.stores);
    let frame_bytes = encode(&batches[0], 0, 0)?.len();
    if frame_bytes > max {
        bail!("a batch of {blocks} blocks is {frame_bytes} bytes, past the frame limit {max}");
    }
    let query = Query {
        keyspace: ks,
        chain: prompt,
        top_k: 16,
        ..Default::default()
    };
    let mut ask = Asker::new(&query, cfg.echo)?;
    let mut idle = histogram();
    for _ in 0..cfg.idle_queries {
        record(&mut idle, ask.once(&mut querier).await?);
        tokio::time::sleep(Duration::from_micros(cfg.query_interval_us)).await;
    }
    let done = Arc::new(AtomicBool::new(false));
    let writes = {
        let done = done.clone();
        tokio::spawn(async move {
            let t = Instant::now();
            let result = write_all(&mut writer, &batches).await;
            done.store(true, Ordering::SeqCst);
            result.map(|events| (t.elapsed(), events))
        })
    };
    let (mut during, mut past_deadline) = (histogram(), 0);
    while !done.load(Ordering::SeqCst) {
        let ns = ask.once(&mut querier).await?;
        past_deadline += u64::from(ns > 2_000_000);
        record(&mut during, ns);
        tokio::time::sleep(Duration::from_micros(cfg.query_interval_us)).await;
    }
    let (took, events) = writes.await.context("the writer task")??;
    Ok(HugeReport {
        command: String::new(),
        config: cfg.clone(),
        blocks_per_batch: blocks,
        frame_bytes,
        idle: Summary::of(&idle),
        during_writes: Summary::of(&during),
        past_deadline,
        write_seconds: took.as_secs_f64(),
        block_events_per_s: events as f64 / took.as_secs_f64(),
    })
}

/// The writes: a store of `blocks`, its removal, then `stores` stores of new chains.
fn batches(
    worker: u32,
    ks: &Keyspace,
    rng: &mut Rng,
    blocks: usize,
    stores: usize,
) -> Vec<EventBatch> {
    let first = chain(rng, blocks);
    let removal = EventBatch {
        worker,
        seq: 2,
        keyspace: ks.clone(),
        events: vec![Event::Removed {
            lane: 0,
            hashes: first.clone(),
        }],
    };
    let mut out = vec![stored(worker, 1, ks, first), removal];
    for i in 0..stores {
        out.push(stored(worker, 3 + i as u64, ks, chain(rng, blocks)));
    }
    out
}

/// Sends the store and its removal one at a time, then the rest back to back, and reads
/// every reply; the block events written.
async fn write_all(conn: &mut WireConn, batches: &[EventBatch]) -> anyhow::Result<u64> {
    let events = |b: &EventBatch| match &b.events[0] {
        Event::Stored { chain, .. } => chain.len() as u64,
        Event::Removed { hashes, .. } => hashes.len() as u64,
        _ => 0,
    };
    for b in &batches[..2] {
        conn.send(b, 0).await?;
        conn.expect_applied().await?;
    }
    for b in &batches[2..] {
        conn.queue(b, 0)?;
    }
    conn.flush().await?;
    for _ in &batches[2..] {
        conn.expect_applied().await?;
    }
    Ok(batches.iter().map(events).sum())
}

/// One query (or its Echo twin), timed.
struct Asker {
    query: Query,
    echo: Option<Echo>,
}

impl Asker {
    fn new(query: &Query, echo: bool) -> anyhow::Result<Asker> {
        let echo = echo
            .then(|| {
                let request = encode(query, 0, 0)?.len();
                // An answer naming one worker.
                let (reply, _) = echo_payload_for(96, 0);
                let (payload, _) = echo_payload_for(request, reply as u32);
                anyhow::Ok(Echo {
                    payload: vec![0; payload],
                    reply_len: reply as u32,
                })
            })
            .transpose()?;
        Ok(Asker {
            query: query.clone(),
            echo,
        })
    }

    /// Nanoseconds from sending to the reply read.
    async fn once(&mut self, conn: &mut WireConn) -> anyhow::Result<u64> {
        let t = Instant::now();
        match &self.echo {
            Some(e) => conn.send(e, 0).await?,
            None => conn.send(&self.query, 0).await?,
        };
        let r = conn.recv().await?;
        let ns = t.elapsed().as_nanos() as u64;
        match r.message()? {
            MessageRef::Answer(a) if !a.scores.is_empty() => Ok(ns),
            MessageRef::Echo(_) => Ok(ns),
            other => bail!("a query got {:?}", other.kind()),
        }
    }
}
