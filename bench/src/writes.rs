//! `writes`: closed-loop acknowledged writes (one-block event batches, reply wanted), each
//! paired with an Echo of the same request and reply sizes over the same connection (the
//! transport floor), interleaved so noise hits both alike. With `--replica`, every write
//! acknowledged by the server is then looked for in queries on another replica of its
//! log: how long after the ack it is visible there (the replication lag). With `--redis`,
//! each write's bytes are also appended to a scratch stream of that Redis (XADD, the
//! command a replica's append is), interleaved the same way: the Redis round trip an
//! acknowledged write with `--log` cannot do without.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use kvix_wire::chain::token_chain;
use kvix_wire::{encode, to_native, Answer, Echo, Event, Feed, Keyspace, MessageRef, Query};
use serde::{Deserialize, Serialize};

use crate::latency::echo_payload_for;
use crate::net::{stored, WireConn};
use crate::rng::Rng;
use crate::stats::{histogram, record, Ratios, Summary};

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct WritesConfig {
    pub server: String,
    pub replica: Option<String>,
    pub redis: Option<String>,
    pub writes: usize,
    pub warmup: usize,
    pub token_block: u32,
    pub seed: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct WritesReport {
    pub command: String,
    pub config: WritesConfig,
    pub request_bytes: usize,
    pub write: Summary,
    pub floor: Summary,
    /// write / floor per percentile.
    pub ratio: Ratios,
    /// From the ack on the server to the write answered by the replica.
    pub lag: Option<Summary>,
    /// An XADD of the write's bytes to the `--redis` server (`MAXLEN ~ 1000`).
    pub append: Option<Summary>,
}

/// The scratch stream the append floor writes to.
const FLOOR_KEY: &[u8] = b"kvix-bench-append-floor";

/// How long a write may take to show on the replica before the run gives up.
const LAG_LIMIT: Duration = Duration::from_secs(5);

pub async fn run(
    cfg: &WritesConfig,
    addr: SocketAddr,
    replica: Option<SocketAddr>,
    redis: Option<SocketAddr>,
) -> anyhow::Result<WritesReport> {
    let mut conn = WireConn::connect(addr, cfg.token_block).await?;
    let name = format!("writes-{:x}", cfg.seed ^ u64::from(std::process::id()));
    let worker = conn.announce(&name, Feed::Events).await?;
    let mut other = match replica {
        Some(r) => Some(WireConn::connect(r, cfg.token_block).await?),
        None => None,
    };
    let mut redis = match redis {
        Some(r) => Some(crate::resp::Redis::connect(r).await?),
        None => None,
    };
    let ks = Keyspace::tokens("kvix-bench-writes");
    let seed = ks.seed(cfg.token_block);
    let mut rng = Rng::new(cfg.seed);
    let mut batch = |seq: u64| {
        let tokens: Vec<u32> = (0..cfg.token_block)
            .map(|_| (rng.next_u64() >> 40) as u32)
            .collect();
        stored(
            worker,
            seq,
            &ks,
            token_chain(seed, cfg.token_block, &tokens),
        )
    };
    let request_bytes = encode(&batch(0), 0, 0)?.len();
    // An Applied reply is the floor's reply: a small frame either way.
    let (payload, _) = echo_payload_for(request_bytes, 8);
    let echo = Echo {
        payload: vec![0; payload],
        reply_len: 8,
    };
    let (mut writes, mut floor, mut lag) = (histogram(), histogram(), histogram());
    let (mut append, mut replies, mut xadd) = (histogram(), Vec::new(), Vec::new());
    for i in 0..cfg.warmup + cfg.writes {
        let b = batch(i as u64);
        let chain = match &b.events[0] {
            Event::Stored { chain, .. } => chain.clone(),
            _ => unreachable!("the batch stores"),
        };
        let measured = i >= cfg.warmup;
        let t = Instant::now();
        conn.send(&b, 0).await?;
        conn.expect_applied().await?;
        let acked = Instant::now();
        if measured {
            record(&mut writes, (acked - t).as_nanos() as u64);
        }
        if let Some(other) = other.as_mut() {
            visible(other, &ks, &chain, worker).await?;
            if measured {
                record(&mut lag, acked.elapsed().as_nanos() as u64);
            }
        }
        if let Some(redis) = redis.as_mut() {
            xadd.clear();
            let bytes = encode(&b, i as u64, 0)?;
            // As a replica appends it: the record, and its origin (replica id and token).
            let args: [&[u8]; 10] = [
                b"XADD", FLOOR_KEY, b"MAXLEN", b"~", b"1000", b"*", b"r", &bytes, b"o", b"1:1234",
            ];
            crate::resp::command(&mut xadd, &args);
            let t = Instant::now();
            redis.pipeline(&xadd, 1, &mut replies).await?;
            if measured {
                record(&mut append, t.elapsed().as_nanos() as u64);
            }
            if let Some(crate::resp::Reply::Error(e)) = replies.first() {
                bail!("redis refused the XADD: {e}");
            }
        }
        let t = Instant::now();
        conn.send(&echo, 0).await?;
        conn.recv().await?;
        if measured {
            record(&mut floor, t.elapsed().as_nanos() as u64);
        }
    }
    let (write, floor) = (Summary::of(&writes), Summary::of(&floor));
    Ok(WritesReport {
        command: "writes".into(),
        config: cfg.clone(),
        request_bytes,
        ratio: write.ratio(&floor),
        write,
        floor,
        lag: replica.map(|_| Summary::of(&lag)),
        append: redis.map(|_| Summary::of(&append)),
    })
}

/// Queries `conn` until `worker` holds `chain`'s block (bounded by [`LAG_LIMIT`]).
async fn visible(
    conn: &mut WireConn,
    ks: &Keyspace,
    chain: &[u64],
    worker: u32,
) -> anyhow::Result<()> {
    let q = Query {
        keyspace: ks.clone(),
        chain: chain.to_vec(),
        candidates: vec![worker],
        top_k: 0,
        want_runs: false,
    };
    let started = Instant::now();
    loop {
        conn.send(&q, 0).await?;
        let r = conn.recv().await?;
        match r.message().context("reading the replica's answer")? {
            MessageRef::Answer(a) => {
                let a: Answer = to_native(a);
                if a.scores.iter().any(|s| s.worker == worker && s.blocks > 0) {
                    return Ok(());
                }
            }
            MessageRef::ErrorReply(e) => bail!("the replica refused a query: {}", e.message),
            other => bail!("unexpected {:?} to Query", other.kind()),
        }
        if started.elapsed() > LAG_LIMIT {
            bail!("a write acknowledged by the server was not visible on the replica within {LAG_LIMIT:?}");
        }
    }
}
