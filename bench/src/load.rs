//! `load`: open-loop queries at a target rate from N simulated gateways (each its own
//! kvix-client connection) while M simulated workers stream cache events.
//!
//! Coordinated-omission-correct: a pacer thread (std sleep, µs resolution, not tokio's
//! 1 ms timer) spawns each request at its intended send time whether or not earlier ones
//! came back, and latency is measured from that intended time. The floor, Echoes of the
//! same request and reply sizes, is interleaved with the queries in the same phase (one
//! half-way between each two queries, on the next gateway), so both meet the same
//! machine: on a shared VM whose hiccups come and go, a floor measured in a phase of
//! its own would compare the query with another moment's noise.

use anyhow::Context;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use indicatif::ProgressBar;
use kvix_client::{Client, QueryOptions, QueryOutcome};
use kvix_wire::chain::token_chain;
use kvix_wire::{Event, EventBatch, Query, FLAG_NO_REPLY};
use serde::{Deserialize, Serialize};

use crate::latency::{echo_payload_for, query_sizes};
use crate::net::{self, gateway, Dataset, WireConn};
use crate::rng::Rng;
use crate::stats::{histogram, record, Ratios, Summary};

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LoadConfig {
    pub server: String,
    /// Queries per second, all gateways together.
    pub rate: f64,
    pub gateways: usize,
    pub workers: usize,
    /// Event batches per second, all workers together (0: none).
    pub event_rate: f64,
    /// Blocks stored (then later removed) per event batch.
    pub event_blocks: u32,
    /// Stores carry an engine hash per block and removals name them, as vLLM's do (the
    /// home then keeps a name per block: the costly feed step).
    #[serde(default)]
    pub event_engine: bool,
    /// Stores take their chains in turn from this many made before the run (0: a fresh
    /// chain per batch). Keeps the generator's hashing out of runs of huge batches.
    #[serde(default)]
    pub event_pool: usize,
    pub duration_s: f64,
    /// Interleave an Echo floor at the same rate.
    pub floor: bool,
    pub blocks: u32,
    pub chains: usize,
    pub system_blocks: u32,
    pub top_k: u32,
    pub deadline_ms: f64,
    pub token_block: u32,
    pub max_inflight: usize,
    pub seed: u64,
    /// The server's metrics address, for the per-executor split ("" for none).
    #[serde(default)]
    pub metrics: String,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Phase {
    pub sent: u64,
    pub achieved_rate: f64,
    /// From intended send time to reply.
    pub latency: Summary,
    /// Answered later than the deadline, or not answered (fail-open), or never sent
    /// because too many were in flight: over all scheduled.
    pub miss_share: f64,
    pub not_answered: u64,
    pub skipped: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LoadReport {
    pub command: String,
    pub config: LoadConfig,
    pub request_bytes: usize,
    pub reply_bytes: usize,
    pub queries: Phase,
    pub floor: Option<Phase>,
    /// query / floor per percentile, when the floor ran.
    pub ratio: Option<Ratios>,
    pub event_batches: u64,
    /// Event batches (sent without wanting a reply) the server refused, by error code.
    pub event_batches_refused: Vec<(String, u64)>,
    pub block_events_per_s: f64,
    /// The gateways' clients, summed over the run.
    pub clients: ClientTally,
    /// Queries each executor of the server answered during the run (from its metrics),
    /// or why they could not be read.
    pub executor_queries: Result<Vec<u64>, String>,
}

/// Why the gateways' queries failed open, and what their failover did: a lost server
/// shows as `disconnected` (no other server could take the query in time), a slow
/// machine as `timeouts`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct ClientTally {
    pub timeouts: u64,
    pub disconnected: u64,
    pub hedges: u64,
    pub hedges_won: u64,
    pub failovers: u64,
}

impl ClientTally {
    fn of(clients: &[kvix_client::Client]) -> Self {
        clients
            .iter()
            .map(|c| c.counters())
            .fold(Self::default(), |t, c| ClientTally {
                timeouts: t.timeouts + c.timeouts,
                disconnected: t.disconnected + c.disconnected,
                hedges: t.hedges + c.hedges,
                hedges_won: t.hedges_won + c.hedges_won,
                failovers: t.failovers + c.failovers,
            })
    }
}

struct Rec {
    hist: Mutex<Histogram<u64>>,
    late: AtomicU64,
    not_answered: AtomicU64,
    inflight: AtomicU64,
    skipped: AtomicU64,
    sent: AtomicU64,
}

impl Rec {
    fn new() -> Arc<Rec> {
        Arc::new(Rec {
            hist: Mutex::new(histogram()),
            late: AtomicU64::new(0),
            not_answered: AtomicU64::new(0),
            inflight: AtomicU64::new(0),
            skipped: AtomicU64::new(0),
            sent: AtomicU64::new(0),
        })
    }

    fn done(&self, intended: Instant, answered: bool, deadline: Duration) {
        let took = intended.elapsed();
        if let Ok(mut h) = self.hist.lock() {
            record(&mut h, took.as_nanos() as u64);
        }
        if !answered {
            self.not_answered.fetch_add(1, Relaxed);
        } else if took > deadline {
            self.late.fetch_add(1, Relaxed);
        }
        self.inflight.fetch_sub(1, Relaxed);
    }

    fn phase(&self, wall: f64) -> Phase {
        let h = self
            .hist
            .lock()
            .map(|h| h.clone())
            .unwrap_or_else(|_| histogram());
        let sent = self.sent.load(Relaxed);
        let skipped = self.skipped.load(Relaxed);
        let not_answered = self.not_answered.load(Relaxed);
        let scheduled = sent + skipped;
        Phase {
            sent,
            achieved_rate: if wall > 0.0 { sent as f64 / wall } else { 0.0 },
            latency: Summary::of(&h),
            miss_share: if scheduled == 0 {
                0.0
            } else {
                (self.late.load(Relaxed) + not_answered + skipped) as f64 / scheduled as f64
            },
            not_answered,
            skipped,
        }
    }
}

#[derive(Clone, Copy)]
enum Kind {
    Query,
    Echo { payload: usize, reply: u32 },
}

/// Runs the pacer on this (blocking) thread: `rate`/s of each kind over `secs`, the
/// kinds taking turns slot by slot, round-robin over the gateways, each request spawned
/// on `rt` at its intended time and recorded in its kind's `Rec`.
fn pace(
    rt: &tokio::runtime::Handle,
    clients: &[Client],
    ds: &Arc<Dataset>,
    cfg: &LoadConfig,
    kinds: &[(Kind, Arc<Rec>)],
    pb: &ProgressBar,
) -> f64 {
    let start = Instant::now();
    let slots = kinds.len().max(1) as f64;
    let interval = Duration::from_secs_f64(1.0 / (cfg.rate * slots).max(1e-3));
    let total = (cfg.duration_s * cfg.rate * slots).ceil() as u64;
    let deadline = Duration::from_secs_f64(cfg.deadline_ms / 1000.0);
    let opts = Arc::new(QueryOptions {
        top_k: cfg.top_k,
        ..Default::default()
    });
    let mut rng = Rng::new(cfg.seed ^ 0x10ad);
    pb.set_length(total);
    pb.set_position(0);
    for i in 0..total {
        let intended = start + interval.mul_f64(i as f64);
        let now = Instant::now();
        if intended > now {
            std::thread::sleep(intended - now);
        }
        let (kind, rec) = &kinds[i as usize % kinds.len()];
        let (kind, rec) = (*kind, rec.clone());
        if rec.inflight.load(Relaxed) >= cfg.max_inflight as u64 {
            rec.skipped.fetch_add(1, Relaxed);
            continue;
        }
        rec.inflight.fetch_add(1, Relaxed);
        rec.sent.fetch_add(1, Relaxed);
        let client = clients[i as usize % clients.len()].clone();
        let chain = rng.below(ds.chains[0].len() as u64) as usize;
        let ds = ds.clone();
        let opts = opts.clone();
        rt.spawn(async move {
            let answered = match kind {
                Kind::Query => matches!(
                    client
                        .query_chain(&ds.keyspace, &ds.chains[0][chain], &opts)
                        .await,
                    QueryOutcome::Scores(_) | QueryOutcome::Empty
                ),
                Kind::Echo { payload, reply } => {
                    client.echo(vec![0u8; payload], reply).await.is_ok()
                }
            };
            rec.done(intended, answered, deadline);
        });
        if i % 256 == 0 {
            pb.set_position(i);
        }
    }
    // Let the stragglers finish (bounded).
    let end = Instant::now() + Duration::from_secs(2);
    let inflight = || {
        kinds
            .iter()
            .map(|(_, r)| r.inflight.load(Relaxed))
            .sum::<u64>()
    };
    while inflight() > 0 && Instant::now() < end {
        std::thread::sleep(Duration::from_millis(1));
    }
    pb.finish_and_clear();
    start.elapsed().as_secs_f64()
}

/// What the event traffic sent, and what of it the server refused (by error code).
#[derive(Default)]
struct EventCounts {
    sent: AtomicU64,
    refused: Mutex<Vec<(String, u64)>>,
}

/// Background event traffic: `event_rate` batches/s over one worker connection, each
/// storing a fresh chain on the next worker and removing the one it stored last time.
async fn events(
    addr: SocketAddr,
    cfg: LoadConfig,
    ids: Vec<u32>,
    first_seq: Vec<u64>,
    ks: kvix_wire::Keyspace,
    stop: Arc<AtomicBool>,
    counts: Arc<EventCounts>,
) -> anyhow::Result<()> {
    let mut conn = WireConn::connect(addr, cfg.token_block).await?;
    let seed = ks.seed(cfg.token_block);
    let mut seqs = first_seq;
    let mut last: Vec<Vec<u64>> = vec![Vec::new(); ids.len()];
    let mut rng = Rng::new(cfg.seed ^ 0xe7e7);
    let mut fresh = {
        let mut rng = Rng::new(cfg.seed ^ 0x9001);
        move || -> Vec<u64> {
            let tokens: Vec<u32> = (0..cfg.event_blocks * cfg.token_block)
                .map(|_| (rng.next_u64() >> 40) as u32)
                .collect();
            token_chain(seed, cfg.token_block, &tokens)
        }
    };
    let pool: Vec<Vec<u64>> = (0..cfg.event_pool).map(|_| fresh()).collect();
    let mut turn = 0usize;
    let mut tick = tokio::time::interval(Duration::from_millis(1));
    let per_ms = cfg.event_rate / 1000.0;
    let (mut owed, mut w) = (0f64, 0usize);
    while !stop.load(Relaxed) {
        tick.tick().await;
        owed += per_ms;
        while owed >= 1.0 {
            owed -= 1.0;
            let chain = if pool.is_empty() {
                let tokens: Vec<u32> = (0..cfg.event_blocks * cfg.token_block)
                    .map(|_| (rng.next_u64() >> 40) as u32)
                    .collect();
                token_chain(seed, cfg.token_block, &tokens)
            } else {
                turn += 1;
                pool[turn % pool.len()].clone()
            };
            let engine: Vec<u64> = if cfg.event_engine {
                chain.iter().map(|h| h ^ 0x5bd1_e995_0000_0001).collect()
            } else {
                Vec::new()
            };
            let names = if cfg.event_engine {
                engine.clone()
            } else {
                chain.clone()
            };
            let mut evs = vec![Event::Stored {
                lane: 0,
                start: 0,
                parent: None,
                chain,
                engine,
            }];
            let old = std::mem::replace(&mut last[w], names);
            if !old.is_empty() {
                evs.push(Event::Removed {
                    lane: 0,
                    hashes: old,
                });
            }
            seqs[w] += 1;
            conn.queue(
                &EventBatch {
                    worker: ids[w],
                    seq: seqs[w],
                    keyspace: ks.clone(),
                    events: evs,
                },
                FLAG_NO_REPLY,
            )?;
            counts.sent.fetch_add(1, Relaxed);
            w = (w + 1) % ids.len();
        }
        conn.flush().await?;
        let codes = conn.refusals()?;
        if !codes.is_empty() {
            let mut r = counts.refused.lock().unwrap_or_else(|p| p.into_inner());
            for code in codes {
                let name = format!("{code:?}");
                match r.iter_mut().find(|(c, _)| *c == name) {
                    Some((_, n)) => *n += 1,
                    None => r.push((name, 1)),
                }
            }
        }
    }
    Ok(())
}

/// Runs the load against `addrs`: one server, or replicas of one log (the gateways'
/// clients hedge across them; the workers' writes go through the last one, so killing
/// the first tests the gateways' failover alone).
pub fn run(
    cfg: &LoadConfig,
    addrs: &[SocketAddr],
    rt: &tokio::runtime::Runtime,
    pb: &ProgressBar,
) -> anyhow::Result<LoadReport> {
    let addr = *addrs.last().context("no server address")?;
    anyhow::ensure!(
        cfg.rate > 0.0 && cfg.gateways > 0,
        "need a rate and gateways"
    );
    anyhow::ensure!(
        cfg.duration_s > 0.0 && cfg.duration_s <= 600.0,
        "--duration must be in (0, 600] s"
    );
    let ds = Arc::new(Dataset::build(
        cfg.seed,
        cfg.token_block,
        cfg.workers,
        &[cfg.blocks],
        cfg.chains,
        cfg.system_blocks,
    ));
    let (ids, clients, n_scores) = rt.block_on(async {
        let mut wc = WireConn::connect(addr, cfg.token_block).await?;
        let ids = ds.preload(&mut wc).await?;
        let deadline = Duration::from_secs_f64(cfg.deadline_ms / 1000.0);
        let mut clients = Vec::new();
        for g in 0..cfg.gateways {
            clients.push(
                gateway(
                    addrs,
                    cfg.token_block,
                    deadline,
                    None,
                    &format!("kvix-bench-gw-{g}"),
                )
                .await?,
            );
        }
        let probe = clients[0]
            .query_chain(
                &ds.keyspace,
                &ds.chains[0][0],
                &QueryOptions {
                    top_k: cfg.top_k,
                    deadline: Some(Duration::from_secs(1)),
                    ..Default::default()
                },
            )
            .await;
        let n = match probe {
            QueryOutcome::Scores(s) => s.len(),
            _ => 0,
        };
        anyhow::Ok((ids, clients, n))
    })?;
    let held = ds.held();
    let first_seq: Vec<u64> = held.iter().map(|h| h.len() as u64).collect();
    let stop = Arc::new(AtomicBool::new(false));
    let ev_counts = Arc::new(EventCounts::default());
    let ev_task = (cfg.event_rate > 0.0).then(|| {
        rt.spawn(events(
            addr,
            cfg.clone(),
            ids.clone(),
            first_seq,
            ds.keyspace.clone(),
            stop.clone(),
            ev_counts.clone(),
        ))
    });
    let q = Query {
        keyspace: ds.keyspace.clone(),
        chain: ds.chains[0][0].clone(),
        candidates: Vec::new(),
        top_k: cfg.top_k,
        want_runs: false,
    };
    let (req, rep) = query_sizes(&q, n_scores);
    let (reply_payload, _) = echo_payload_for(rep, 0);
    let (payload, _) = echo_payload_for(req, reply_payload as u32);
    let echo = Kind::Echo {
        payload,
        reply: reply_payload as u32,
    };
    let (query_rec, floor_rec) = (Rec::new(), Rec::new());
    let mut kinds = vec![(Kind::Query, query_rec.clone())];
    if cfg.floor {
        kinds.push((echo, floor_rec.clone()));
    }
    let split_at = |what: &str| -> Result<Vec<u64>, String> {
        let addr = net::loopback(&cfg.metrics).map_err(|e| format!("--metrics: {e}"))?;
        crate::metrics::executor_queries(addr).map_err(|e| format!("{what}: {e}"))
    };
    let split_before = split_at("before the run");
    let ev0 = Instant::now();
    let wall = pace(rt.handle(), &clients, &ds, cfg, &kinds, pb);
    let queries = query_rec.phase(wall);
    let floor = cfg.floor.then(|| floor_rec.phase(wall));
    stop.store(true, Relaxed);
    let ev_wall = ev0.elapsed().as_secs_f64();
    if let Some(t) = ev_task {
        rt.block_on(async {
            match tokio::time::timeout(Duration::from_secs(2), t).await {
                Ok(Ok(r)) => r,
                Ok(Err(e)) => Err(anyhow::anyhow!("event task: {e}")),
                Err(_) => Ok(()),
            }
        })?;
    }
    let batches = ev_counts.sent.load(Relaxed);
    let event_batches_refused = ev_counts
        .refused
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .clone();
    let tally = ClientTally::of(&clients);
    let executor_queries = split_before.and_then(|before| {
        let after = split_at("after the run")?;
        Ok(after.iter().zip(&before).map(|(a, b)| a - b).collect())
    });
    Ok(LoadReport {
        command: "load".into(),
        config: cfg.clone(),
        request_bytes: req,
        reply_bytes: rep,
        ratio: floor.as_ref().map(|f| queries.latency.ratio(&f.latency)),
        queries,
        floor,
        event_batches: batches,
        event_batches_refused,
        // Each batch stores event_blocks and (after the first round) removes as many.
        block_events_per_s: if ev_wall > 0.0 {
            batches as f64 * cfg.event_blocks as f64 * 2.0 / ev_wall
        } else {
            0.0
        },
        clients: tally,
        executor_queries,
    })
}
