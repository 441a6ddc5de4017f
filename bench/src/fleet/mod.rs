//! `fleet`: the routing claim end to end, on the wire. Mock engines ([`engine`]: LRU
//! prefix caches, request slots, a prefill/decode time model, vLLM 0.34 KV events over
//! real ZMQ with a replay endpoint) serve multi-turn sessions sprayed at random across
//! gateways ([`gateway`]), each its own kvix-client making the client's load-aware pick,
//! against a real kvix-server ([`server`]) started for the leg. Time is real: requests
//! wait for slots, prefill and decode take their modelled time, events take the wire.
//!
//! Legs, on the same workload (sessions, contents, gateway choices and think times are
//! drawn per session from the seed): `events` (kvix fed by the engines' events; with a
//! CPU tier, `events-joint` picks by the joint depth instead of the tier-weighed one),
//! `placements` (kvix fed by the gateways' placements), `local` (each gateway's own
//! index of its own placements, the incumbent), `round-robin`, and `oracle` (every
//! engine's cache read directly at routing time, no lag: the ceiling).
//!
//! Every figure is measured on the engines: a request's reused blocks are those its
//! engine held when its prefill started, whatever the gateway expected.

pub mod engine;
pub mod gateway;
pub mod proxy;
pub mod server;

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use kvix_client::{Addr, Client, ClientConfig, QueryOptions, QueryOutcome};
use kvix_wire::{Depths, Feed, Keyspace, Lane, TierWeights};
use serde::{Deserialize, Serialize};

use crate::rng::Rng;
use crate::sim::tokens;
use crate::stats::cov;
use crate::workload::Workload;
use engine::{Conversation, Engine, EngineSpec, EventsTo, TimeModel};
use gateway::Gateway;
use server::{free_port, Redis, Server};

/// Where the gateways' prefix knowledge comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum Leg {
    /// kvix, fed by the engines' KV events; the pick weighs CPU blocks by the time model
    /// (a block loaded costs `cpu_load_us_per_block`, one recomputed its tokens' prefill).
    Events,
    /// kvix, fed by the engines' KV events; the pick counts a CPU block as a GPU one
    /// (the joint depth, as a v4 answer ranks).
    EventsJoint,
    /// kvix, fed by the gateways' placements.
    Placements,
    /// Each gateway's own index of its own placements.
    Local,
    RoundRobin,
    /// Every engine's cache, read at routing time.
    Oracle,
}

/// As the command line names it.
impl std::fmt::Display for Leg {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let v = clap::ValueEnum::to_possible_value(self).expect("no leg is skipped");
        f.write_str(v.get_name())
    }
}

/// A fault injected halfway through the arrivals.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum Chaos {
    /// Gateway 0 restarts cold: a new connection, an empty own index, no load counts.
    GatewayRestart,
    /// Engine 0 restarts: its cache empties, its event sequence starts again at 0 on new
    /// sockets, its replay buffer is gone.
    EngineRestart,
    /// Replica 0 (the gateways' primary) is killed (-9) and started again 2 s later.
    ReplicaRestart,
    /// The replicas' Redis is paused (SIGSTOP) for 3 s.
    RedisPause,
    /// The replicas' Redis loses its data (FLUSHALL): they rebuild the log from the most
    /// advanced of them.
    RedisFlush,
    /// The replicas' Redis is killed and started again empty (no persistence), as a
    /// Redis pod without a volume restarts: the log and every connection are gone.
    RedisRestart,
}

/// A part of the fleet set up wrong for the whole leg, for kvix's reuse verdicts to
/// find.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum Misconfig {
    /// Gateway 0's token ids are not the engines' (another chat template): its queries
    /// and placements hash in another keyspace.
    GatewayTokenization,
    /// Engine 0's events go elsewhere (its publisher connects where nothing listens)
    /// while it is announced to kvix as event-fed, as an engine with a wrong endpoint
    /// is; the kvix legs' gateways publish placements, which fill in for it once kvix
    /// names it `events_missing` (not with `--no-fill-in`).
    EngineEventsElsewhere,
}

impl Misconfig {
    /// The reuse verdict that names it (`kvix_workers_suspect{cause}`).
    pub fn cause(self) -> &'static str {
        match self {
            Misconfig::GatewayTokenization => "gateway_tokenization",
            Misconfig::EngineEventsElsewhere => "events_missing",
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct FleetConfig {
    pub engines: u32,
    pub gateways: u32,
    /// Session arrivals per second (Poisson), for `seconds`.
    pub session_rate: f64,
    pub seconds: f64,
    /// Requests an engine runs at once; more queue.
    pub slots: u32,
    /// The gateways' query deadline.
    pub deadline_ms: f64,
    /// The kvix-server binary the kvix legs start.
    pub server: PathBuf,
    /// Its `--cores`.
    pub server_cores: u32,
    /// kvix servers per kvix leg: more than one are replicas of one Redis log (a
    /// `redis-server` the leg starts), and every gateway knows them all.
    pub replicas: u32,
    pub chaos: Option<Chaos>,
    pub misconfig: Option<Misconfig>,
    /// Whether the kvix server's placements fill in for event-fed workers whose history
    /// is lost or whose events are missing (false: `--fill-in-blocks 0`).
    pub fill_in: bool,
    #[serde(flatten)]
    pub workload: Workload,
}

/// What one leg measured.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct LegResult {
    pub leg: Leg,
    pub requests: u64,
    pub followups: u64,
    /// Σ reused blocks / Σ prompt blocks over turn ≥ 2 requests, on the engines.
    pub followup_hit: f64,
    /// `followup_hit` over the oracle leg's in the same run.
    pub vs_oracle: Option<f64>,
    pub first_turn_hit: f64,
    /// Share of follow-ups sent to the engine of the session's previous turn.
    pub same_worker: f64,
    /// Share of requests routed without the index (query past the deadline, no
    /// connection, refused).
    pub degraded: f64,
    /// The degraded requests by outcome (timeout, disconnected, rejected).
    pub degraded_by: BTreeMap<String, u64>,
    /// CoV of requests served per engine.
    pub load_cov: f64,
    /// |expected − actual| reused tokens per request (None: round robin expects nothing).
    pub error_p50_tokens: Option<u64>,
    pub error_p95_tokens: Option<u64>,
    /// Requests whose engine held less than the gateway expected (a false hit: stale
    /// knowledge, or an eviction between the choice and the prefill).
    pub false_hits: u64,
    pub lookup_p50_us: f64,
    pub lookup_p99_us: f64,
    /// Arrival to completion, from the engines' time model and queues.
    pub e2e_p50_ms: f64,
    pub e2e_p99_ms: f64,
    /// The kvix-servers' cores busy (average, all replicas) and peak resident memory
    /// (the largest replica's).
    pub server_cores: Option<f64>,
    pub server_rss_mib: Option<f64>,
    /// The servers' own query time, p99 (the slowest replica's).
    pub server_query_p99_us: Option<u64>,
    /// Event batches the engines published.
    pub event_batches: u64,
    /// kvix legs: (session, engine) pairs where, once the leg is over and the last
    /// events or placements are in, kvix's score for the session's whole conversation
    /// differs from what the engine holds (10 s allowed for them to arrive).
    pub audit_mismatches: Option<u64>,
    /// With replicas: conversations whose answers differ between replicas once the leg
    /// is over (10 s allowed to converge).
    pub replicas_differ: Option<u64>,
    /// With `gateway-restart`: the follow-up hit of the restarted gateway's requests
    /// after its restart.
    pub cold_gateway_followup_hit: Option<f64>,
    /// kvix legs: the most verdicts the server held at once during the leg, by cause
    /// (every gateway reports each request's reuse).
    pub verdicts: Option<BTreeMap<String, u64>>,
    /// With a misconfiguration: seconds from the leg's start, and reports about what is
    /// at fault (gateway 0's, or those on engine 0's requests)
    /// sent, until the server named it.
    pub flagged_after_s: Option<f64>,
    pub flagged_after_reports: Option<u64>,
    /// Of the follow-ups' prompt blocks, the share loaded from the CPU tier.
    pub followup_cpu_share: f64,
    /// Follow-ups' time to first token (slot wait, loading, prefill), measured.
    pub followup_ttft_mean_ms: f64,
    pub followup_ttft_p90_ms: f64,
    /// Follow-ups' loading and prefill alone, from the time model (no queues, no clock):
    /// what the choices of engine cost.
    pub followup_prefill_mean_ms: f64,
    /// `followup_ttft_mean_ms` over the oracle leg's in the same run.
    pub ttft_vs_oracle: Option<f64>,
    pub wall_s: f64,
}

/// Running sums of one leg.
#[derive(Default)]
struct Acc {
    requests: u64,
    fu: Ratio,
    first: Ratio,
    cold: Ratio,
    same: u64,
    degraded: BTreeMap<String, u64>,
    false_hits: u64,
    served: Vec<u64>,
    errors: Vec<u64>,
    lookups_ns: Vec<u64>,
    e2e_us: Vec<u64>,
    fu_cpu: Ratio,
    fu_ttft_us: Vec<u64>,
    fu_prefill_us: Vec<u64>,
}

#[derive(Default, Clone, Copy)]
struct Ratio {
    hit: u64,
    of: u64,
    n: u64,
}

impl Ratio {
    fn add(&mut self, hit: u64, of: u64) {
        self.hit += hit;
        self.of += of;
        self.n += 1;
    }

    fn value(&self) -> f64 {
        if self.of == 0 {
            0.0
        } else {
            self.hit as f64 / self.of as f64
        }
    }
}

fn mean(v: &[u64]) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.iter().sum::<u64>() as f64 / v.len() as f64
}

fn percentile(v: &mut [u64], q: f64) -> u64 {
    if v.is_empty() {
        return 0;
    }
    v.sort_unstable();
    v[((v.len() - 1) as f64 * q).round() as usize]
}

/// One leg's fleet while it runs.
struct Fleet {
    cfg: FleetConfig,
    leg: Leg,
    keyspace: Keyspace,
    /// The system prefix every session starts with.
    system: Conversation,
    engines: Arc<Vec<Engine>>,
    /// Each engine's index by its name (the name of its worker in kvix's answers).
    engine_of_name: Arc<HashMap<Arc<str>, usize>>,
    gateways: Vec<RwLock<Arc<Gateway>>>,
    servers: Mutex<Vec<Server>>,
    redis: Option<Redis>,
    events_to: Option<EventsTo>,
    ctx: zmq::Context,
    /// Each session's whole conversation (prompt and output of its last turn), for the
    /// audit.
    conversations: Mutex<Vec<Vec<u64>>>,
    /// Set when gateway 0 restarted.
    restarted_at: Mutex<Option<Instant>>,
    /// Set once the leg's sessions and audits are over (the verdict watch stops).
    done: std::sync::atomic::AtomicBool,
    acc: Mutex<Acc>,
}

const MODEL: &str = "fleet";

fn host(i: u32) -> String {
    // Every engine its own loopback address, as every pod its own IP: the topic names
    // the host, and kvix asks the replay port there.
    format!("127.1.{}.{}", i / 250, i % 250 + 1)
}

impl Fleet {
    /// What a block loaded from CPU is worth against one on GPU under the time model:
    /// 1 − load / recompute (0.9 for 80 µs against 16 × 50 µs).
    fn tier_weights(&self) -> TierWeights {
        let w = &self.cfg.workload;
        let recompute = f64::from(w.block_tokens) * w.prefill_us_per_token;
        let cpu = if recompute > 0.0 {
            (1.0 - w.cpu_load_us_per_block / recompute).clamp(0.0, 1.0)
        } else {
            0.0
        };
        TierWeights {
            cpu: cpu as f32,
            storage: 0.0,
        }
    }

    fn addrs(&self) -> Vec<String> {
        let servers = self.servers.lock().unwrap_or_else(|e| e.into_inner());
        servers.iter().map(|s| s.addr.clone()).collect()
    }

    /// A connection to every replica (or to one, `only`).
    async fn client(&self, name: String, only: Option<usize>) -> anyhow::Result<Client> {
        let addrs = self.addrs();
        let addrs = match only {
            Some(i) => vec![addrs[i].clone()],
            None => addrs,
        };
        let mut cfg = ClientConfig::new(addrs.into_iter().map(Addr::tcp));
        cfg.replicas = cfg.servers.len() > 1;
        cfg.name = name;
        cfg.deadline = Duration::from_secs_f64(self.cfg.deadline_ms / 1000.0);
        cfg.token_block = self.cfg.workload.block_tokens;
        Ok(Client::connect(cfg).await?)
    }

    async fn gateway(&self, g: usize) -> anyhow::Result<Gateway> {
        let client = match self.leg {
            Leg::Events | Leg::EventsJoint | Leg::Placements => {
                Some(self.client(format!("gateway-{g}"), None).await?)
            }
            _ => None,
        };
        Gateway::new(g, self, client)
    }

    /// Until kvix scores every engine for the whole system prefix: the engines (events)
    /// or a controller (placements) told it, and the fleet is in its steady state.
    /// Waits until kvix scores every engine but `silent` of them (whose events go
    /// elsewhere) for the shared system prefix.
    async fn await_system_prefix(&self, control: &Client, silent: usize) -> anyhow::Result<()> {
        let want = self.system.chain.len() as u32;
        let opts = QueryOptions {
            deadline: Some(Duration::from_millis(200)),
            ..Default::default()
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let held = match control
                .query_chain(&self.keyspace, &self.system.chain, &opts)
                .await
            {
                QueryOutcome::Scores(s) => s.iter().filter(|s| s.blocks == want).count(),
                _ => 0,
            };
            if held == self.engines.len() - silent {
                return Ok(());
            }
            anyhow::ensure!(
                Instant::now() < deadline,
                "kvix scores {held} of {} engines for the system prefix after 30 s",
                self.engines.len()
            );
            // An engine's first messages can be lost before its PUB has connected; an
            // empty batch gets it announced (and its history replayed).
            for e in self.engines.iter() {
                e.heartbeat();
                e.serve_replay();
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    async fn session(self: Arc<Self>, s: u32) {
        let cfg = &self.cfg;
        let mut conversation = self.system.clone();
        let mut prev: Option<usize> = None;
        for turn in 1..=cfg.workload.turns {
            let mut rng = Rng::derive(cfg.workload.seed, u64::from(s), u64::from(turn));
            let n = rng.around(if turn == 1 {
                cfg.workload.user_tokens
            } else {
                cfg.workload.followup_tokens
            });
            let mut message = Vec::new();
            tokens(&mut rng, n, &mut message);
            conversation.extend(&message);
            let g = rng.below(u64::from(cfg.gateways)) as usize;
            let gateway = self.gateways[g]
                .read()
                .unwrap_or_else(|e| e.into_inner())
                .clone();
            let arrival = Instant::now();
            let routed = gateway.route(&conversation.chain, rng.next_u64()).await;
            let prompt_blocks = conversation.chain.len() as u64;
            let mut out_rng =
                Rng::derive(cfg.workload.seed, u64::from(s), 1_000_000 + u64::from(turn));
            let mut output = Vec::new();
            let n = out_rng.around(cfg.workload.output_tokens);
            tokens(&mut out_rng, n, &mut output);
            gateway.started(routed.engine);
            let prompt_tokens = conversation.tokens.len() as u32;
            let served = self.engines[routed.engine]
                .serve(&mut conversation, &output, arrival)
                .await;
            gateway.finished(routed.engine);
            gateway.report(&routed, served.reused_blocks, prompt_tokens);
            let cold = g == 0
                && self
                    .restarted_at
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .is_some_and(|at| arrival >= at);
            {
                let mut acc = self.acc.lock().unwrap_or_else(|e| e.into_inner());
                let (hit, of) = (u64::from(served.reused_blocks), prompt_blocks);
                acc.requests += 1;
                acc.served[routed.engine] += 1;
                if turn == 1 {
                    acc.first.add(hit, of);
                } else {
                    acc.fu.add(hit, of);
                    acc.fu_cpu.add(u64::from(served.from_cpu), of);
                    acc.fu_ttft_us.push(served.ttft.as_micros() as u64);
                    acc.fu_prefill_us.push(served.prefill.as_micros() as u64);
                    if cold {
                        acc.cold.add(hit, of);
                    }
                    acc.same += u64::from(prev == Some(routed.engine));
                }
                if let Some(why) = routed.degraded {
                    *acc.degraded.entry(why.to_string()).or_default() += 1;
                }
                if let Some(p) = routed.predicted {
                    acc.false_hits += u64::from(p > served.reused_blocks);
                    acc.errors.push(
                        u64::from(p.abs_diff(served.reused_blocks))
                            * u64::from(cfg.workload.block_tokens),
                    );
                }
                acc.lookups_ns.push(routed.lookup.as_nanos() as u64);
                acc.e2e_us.push(served.e2e.as_micros() as u64);
            }
            prev = Some(routed.engine);
            if turn == cfg.workload.turns {
                self.conversations
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .push(conversation.chain.clone());
            }
            if turn < cfg.workload.turns {
                let think =
                    Rng::derive(cfg.workload.seed, u64::from(s), 2_000_000 + u64::from(turn))
                        .exp(cfg.workload.think_ms * 1000.0);
                tokio::time::sleep(Duration::from_micros(think as u64)).await;
            }
        }
    }

    /// kvix's depths of `chain` for every engine, as `client` answers.
    async fn said(&self, client: &Client, chain: &[u64]) -> Vec<Depths> {
        let opts = QueryOptions {
            deadline: Some(Duration::from_millis(500)),
            ..Default::default()
        };
        let mut said = vec![Depths::default(); self.engines.len()];
        if let QueryOutcome::Scores(s) = client.query_chain(&self.keyspace, chain, &opts).await {
            for s in s {
                if let Some(&i) = s.name.and_then(|n| self.engine_of_name.get(&n)) {
                    said[i] = s.tiers;
                }
            }
        }
        said
    }

    /// `wrong` over every conversation, summed, polled until 0 or 10 s.
    async fn until_none<'a, F, Fut>(&'a self, wrong: F) -> u64
    where
        F: Fn(&'a Fleet, Vec<u64>) -> Fut,
        Fut: std::future::Future<Output = u64>,
    {
        let conversations = self
            .conversations
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let mut n = 0;
            for chain in &conversations {
                n += wrong(self, chain.clone()).await;
            }
            if n == 0 || Instant::now() >= deadline {
                return n;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// (session, engine) pairs where kvix's depths of the conversation, tier by tier,
    /// are not what the engine holds.
    async fn audit(&self, control: &Client) -> u64 {
        self.until_none(|fleet, chain| async move {
            let said = fleet.said(control, &chain).await;
            let engines = fleet.engines.iter();
            engines
                .zip(&said)
                .filter(|(e, d)| {
                    let held = e.held(&chain);
                    (held.gpu, held.cpu, held.cpu) != (d.gpu, d.cpu, d.storage)
                })
                .count() as u64
        })
        .await
    }

    /// Conversations whose answers differ between replicas.
    async fn replicas_differ(&self) -> anyhow::Result<u64> {
        let mut each = Vec::new();
        for i in 0..self.addrs().len() {
            each.push(self.client(format!("fleet-replica-{i}"), Some(i)).await?);
        }
        let each = &each;
        Ok(self
            .until_none(|fleet, chain| async move {
                let first = fleet.said(&each[0], &chain).await;
                let mut differ = 0;
                for c in &each[1..] {
                    differ += u64::from(fleet.said(c, &chain).await != first);
                }
                differ
            })
            .await)
    }

    async fn inject(self: Arc<Self>, chaos: Chaos) -> anyhow::Result<()> {
        match chaos {
            Chaos::GatewayRestart => {
                let fresh = Arc::new(self.gateway(0).await?);
                *self.gateways[0].write().unwrap_or_else(|e| e.into_inner()) = fresh;
                *self.restarted_at.lock().unwrap_or_else(|e| e.into_inner()) = Some(Instant::now());
            }
            Chaos::EngineRestart => self.engines[0].restart(&self.ctx, self.events_to.as_ref())?,
            Chaos::ReplicaRestart => {
                let fleet = self.clone();
                tokio::task::spawn_blocking(move || {
                    let mut servers = fleet.servers.lock().unwrap_or_else(|e| e.into_inner());
                    servers[0].restart(Duration::from_secs(2))
                })
                .await??;
            }
            Chaos::RedisPause => {
                let redis = self.redis.as_ref().expect("checked at start");
                redis.pause(true)?;
                tokio::time::sleep(Duration::from_secs(3)).await;
                redis.pause(false)?;
            }
            Chaos::RedisFlush => self.redis.as_ref().expect("checked at start").flush()?,
            Chaos::RedisRestart => {
                let fleet = self.clone();
                tokio::task::spawn_blocking(move || {
                    fleet.redis.as_ref().expect("checked at start").restart()
                })
                .await??;
            }
        }
        Ok(())
    }
}

/// What the verdict watch saw.
struct Verdicts {
    most: BTreeMap<String, u64>,
    flagged: Option<(f64, u64)>,
}

/// Reads the primary server's verdicts every 250 ms until the leg is done: the most
/// held at once by cause, and when (and after how many of its reports) a misconfigured
/// gateway was named.
async fn watch_verdicts(fleet: Arc<Fleet>, started: Instant) -> Verdicts {
    use std::sync::atomic::Ordering::Relaxed;
    let mut v = Verdicts {
        most: server::SUSPECT_CAUSES
            .iter()
            .map(|c| (c.to_string(), 0))
            .collect(),
        flagged: None,
    };
    while !fleet.done.load(Relaxed) {
        let now = {
            let servers = fleet.servers.lock().unwrap_or_else(|e| e.into_inner());
            servers.first().and_then(Server::suspects)
        };
        if let Some(now) = now {
            for (cause, n) in server::SUSPECT_CAUSES.iter().zip(now) {
                let most = v.most.entry(cause.to_string()).or_default();
                *most = (*most).max(n);
            }
            let named = fleet.cfg.misconfig.and_then(|m| {
                let at = server::SUSPECT_CAUSES
                    .iter()
                    .position(|&c| c == m.cause())?;
                Some(now[at] > 0)
            });
            if named == Some(true) && v.flagged.is_none() {
                // Reports about what is at fault: gateway 0's own, or every request
                // engine 0 served (each is reported).
                let reports = match fleet.cfg.misconfig {
                    Some(Misconfig::EngineEventsElsewhere) => {
                        let acc = fleet.acc.lock().unwrap_or_else(|e| e.into_inner());
                        acc.served[0]
                    }
                    _ => fleet.gateways[0]
                        .read()
                        .unwrap_or_else(|e| e.into_inner())
                        .reports_sent(),
                };
                v.flagged = Some((started.elapsed().as_secs_f64(), reports));
            }
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    v
}

/// Runs one leg.
pub async fn run_leg(cfg: &FleetConfig, leg: Leg) -> anyhow::Result<LegResult> {
    anyhow::ensure!(
        cfg.engines > 0 && cfg.engines <= 250 * 250 && cfg.gateways > 0 && cfg.workload.turns > 0,
        "need 1..62500 engines, gateways and turns"
    );
    anyhow::ensure!(
        cfg.session_rate > 0.0 && cfg.seconds > 0.0,
        "need a rate and a duration"
    );
    let started = Instant::now();
    let keyspace = Keyspace::tokens(MODEL);
    let seed = keyspace.seed(cfg.workload.block_tokens);
    let ctx = zmq::Context::new();
    let mut args: Vec<String> = vec![
        "--cores".into(),
        cfg.server_cores.to_string(),
        "--block-size".into(),
        cfg.workload.block_tokens.to_string(),
    ];
    if !cfg.fill_in {
        args.extend(["--fill-in-blocks".into(), "0".into()]);
    }
    let kvix = matches!(leg, Leg::Events | Leg::EventsJoint | Leg::Placements);
    let by_events = matches!(leg, Leg::Events | Leg::EventsJoint);
    let replicas = if kvix { cfg.replicas.max(1) } else { 0 };
    let needs_replicas = matches!(
        cfg.chaos,
        Some(Chaos::ReplicaRestart | Chaos::RedisPause | Chaos::RedisFlush | Chaos::RedisRestart)
    );
    anyhow::ensure!(
        !kvix || !needs_replicas || replicas > 1,
        "{:?} needs replicas (--replicas 2 or more)",
        cfg.chaos
    );
    // Engines that connect (--events-bind): each replica binds, and with replicas the
    // engines reach them through a proxy, as through a Kubernetes Service.
    let binds = match by_events {
        true => (0..replicas)
            .map(|_| free_port())
            .collect::<anyhow::Result<Vec<_>>>()?,
        false => Vec::new(),
    };
    let events_to = match by_events {
        true => {
            // Outside the ephemeral range: every engine binds it at its own host, where
            // its PUB's connection from port 0 could otherwise take it first.
            let replay_port = kvix_testkit::free_port();
            args.extend(["--events-replay-port".into(), replay_port.to_string()]);
            let to = match replicas {
                1 => binds[0],
                _ => proxy::start(binds.clone()).await?,
            };
            Some(EventsTo {
                kvix: format!("tcp://127.0.0.1:{to}"),
                replay_port,
                model: MODEL.into(),
            })
        }
        false => None,
    };
    let redis = (replicas > 1).then(Redis::start).transpose()?;
    if let Some(r) = &redis {
        args.extend([
            "--log-new".into(),
            "--log".into(),
            format!("redis://127.0.0.1:{}/kvix-fleet", r.port),
        ]);
    }
    let servers = (0..replicas as usize)
        .map(|i| {
            let mut args = args.clone();
            if let Some(bind) = binds.get(i) {
                args.extend(["--events-bind".into(), format!("tcp://127.0.0.1:{bind}")]);
            }
            Server::start(&cfg.server, &args)
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    let spec = EngineSpec {
        capacity_blocks: cfg.workload.capacity_blocks as usize,
        cpu_capacity_blocks: cfg.workload.cpu_capacity_blocks as usize,
        block_tokens: cfg.workload.block_tokens,
        slots: cfg.slots as usize,
        time: TimeModel {
            prefill_us_per_token: cfg.workload.prefill_us_per_token,
            decode_ms_per_token: cfg.workload.decode_ms_per_token,
            cpu_load_us_per_block: cfg.workload.cpu_load_us_per_block,
        },
    };
    // Engine 0 publishing where nothing listens, for Misconfig::EngineEventsElsewhere.
    let misdirected = events_to
        .as_ref()
        .filter(|_| cfg.misconfig == Some(Misconfig::EngineEventsElsewhere))
        .map(|to| -> anyhow::Result<EventsTo> {
            Ok(EventsTo {
                kvix: format!("tcp://127.0.0.1:{}", free_port()?),
                ..to.clone()
            })
        })
        .transpose()?;
    let engines = (0..cfg.engines)
        .map(|i| {
            let to = misdirected
                .as_ref()
                .filter(|_| i == 0)
                .or(events_to.as_ref());
            Engine::start(&ctx, host(i), &spec, to)
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    let mut system_prompt = Vec::new();
    tokens(
        &mut Rng::derive(cfg.workload.seed, u64::MAX, 0),
        cfg.workload.system_tokens,
        &mut system_prompt,
    );
    let mut system = Conversation::new(seed, cfg.workload.block_tokens);
    system.extend(&system_prompt);
    let mut fleet = Fleet {
        cfg: cfg.clone(),
        leg,
        keyspace,
        system,
        engine_of_name: Arc::new(
            engines
                .iter()
                .enumerate()
                .map(|(i, e)| (Arc::from(e.name.as_str()), i))
                .collect(),
        ),
        engines: Arc::new(engines),
        gateways: Vec::new(),
        servers: Mutex::new(servers),
        redis,
        events_to,
        ctx,
        conversations: Mutex::new(Vec::new()),
        restarted_at: Mutex::new(None),
        done: std::sync::atomic::AtomicBool::new(false),
        acc: Mutex::new(Acc {
            served: vec![0; cfg.engines as usize],
            ..Default::default()
        }),
    };
    // Steady state of a running fleet: every engine holds the shared system prefix and
    // every index knows it. Without this the first holders of the prefix draw all the
    // first turns and the rest of the fleet stays cold.
    for e in fleet.engines.iter() {
        e.admit(&fleet.system.chain, &fleet.system.tokens);
    }
    let control = match kvix {
        true => Some(fleet.client("fleet-controller".into(), None).await?),
        false => None,
    };
    if let Some(control) = &control {
        if leg == Leg::Placements {
            let feed = Feed::Placements {
                capacity_blocks: u64::from(cfg.workload.capacity_blocks),
                ttl_ms: 0,
            };
            for e in fleet.engines.iter() {
                control
                    .announce(&e.name, vec![Lane::full(cfg.workload.block_tokens)], feed)
                    .await?;
                control.publish_placement(
                    e.name.as_str(),
                    &fleet.keyspace,
                    fleet.system.chain.clone(),
                );
            }
        }
        if misdirected.is_some() {
            let e = &fleet.engines[0];
            let lanes = vec![Lane::full(cfg.workload.block_tokens)];
            control.announce(&e.name, lanes, Feed::Events).await?;
        }
        let silent = usize::from(misdirected.is_some());
        fleet.await_system_prefix(control, silent).await?;
    }
    for g in 0..cfg.gateways as usize {
        let gw = fleet.gateway(g).await?;
        fleet.gateways.push(RwLock::new(Arc::new(gw)));
    }
    let fleet = Arc::new(fleet);
    let replay = fleet.events_to.is_some().then(|| {
        let fleet = fleet.clone();
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_millis(10)).await;
                fleet.engines.iter().for_each(Engine::serve_replay);
            }
        })
    });
    let watch = kvix.then(|| tokio::spawn(watch_verdicts(fleet.clone(), Instant::now())));
    let mut arrivals = Rng::derive(cfg.workload.seed, u64::MAX, 1);
    let mut at = 0.0;
    let mut s = 0u32;
    let mut sessions = Vec::new();
    let t0 = tokio::time::Instant::now();
    let chaos = cfg.chaos.map(|chaos| {
        let fleet = fleet.clone();
        let at = t0 + Duration::from_secs_f64(cfg.seconds / 2.0);
        tokio::spawn(async move {
            tokio::time::sleep_until(at).await;
            fleet.inject(chaos).await
        })
    });
    loop {
        at += arrivals.exp(1.0 / cfg.session_rate);
        if at >= cfg.seconds {
            break;
        }
        tokio::time::sleep_until(t0 + Duration::from_secs_f64(at)).await;
        sessions.push(tokio::spawn(fleet.clone().session(s)));
        s += 1;
    }
    for task in sessions {
        task.await?;
    }
    if let Some(chaos) = chaos {
        chaos.await??;
    }
    let audit_mismatches = match &control {
        Some(c) => Some(fleet.audit(c).await),
        None => None,
    };
    let replicas_differ = match replicas > 1 {
        true => Some(fleet.replicas_differ().await?),
        false => None,
    };
    if let Some(r) = replay {
        r.abort();
    }
    let verdicts = match watch {
        Some(w) => {
            fleet.done.store(true, std::sync::atomic::Ordering::Relaxed);
            Some(w.await?)
        }
        None => None,
    };
    let usage: Vec<_> = {
        let servers = fleet.servers.lock().unwrap_or_else(|e| e.into_inner());
        servers.iter().map(Server::usage).collect()
    };
    let event_batches = fleet.engines.iter().map(Engine::published).sum();
    let mut acc = std::mem::take(&mut *fleet.acc.lock().unwrap_or_else(|e| e.into_inner()));
    let served: Vec<f64> = acc.served.iter().map(|&x| x as f64).collect();
    let predicts = leg != Leg::RoundRobin;
    Ok(LegResult {
        leg,
        requests: acc.requests,
        followups: acc.fu.n,
        followup_hit: acc.fu.value(),
        vs_oracle: None,
        first_turn_hit: acc.first.value(),
        same_worker: if acc.fu.n == 0 {
            0.0
        } else {
            acc.same as f64 / acc.fu.n as f64
        },
        degraded: acc.degraded.values().sum::<u64>() as f64 / acc.requests.max(1) as f64,
        degraded_by: std::mem::take(&mut acc.degraded),
        load_cov: cov(&served),
        error_p50_tokens: predicts.then(|| percentile(&mut acc.errors, 0.5)),
        error_p95_tokens: predicts.then(|| percentile(&mut acc.errors, 0.95)),
        false_hits: acc.false_hits,
        lookup_p50_us: percentile(&mut acc.lookups_ns, 0.5) as f64 / 1e3,
        lookup_p99_us: percentile(&mut acc.lookups_ns, 0.99) as f64 / 1e3,
        e2e_p50_ms: percentile(&mut acc.e2e_us, 0.5) as f64 / 1e3,
        e2e_p99_ms: percentile(&mut acc.e2e_us, 0.99) as f64 / 1e3,
        server_cores: kvix.then(|| usage.iter().map(|u| u.cores).sum()),
        server_rss_mib: kvix.then(|| usage.iter().map(|u| u.peak_rss_mib).fold(0.0, f64::max)),
        server_query_p99_us: usage.iter().filter_map(|u| u.query_p99_us).max(),
        event_batches,
        audit_mismatches,
        replicas_differ,
        cold_gateway_followup_hit: (cfg.chaos == Some(Chaos::GatewayRestart))
            .then(|| acc.cold.value()),
        verdicts: verdicts.as_ref().map(|v| v.most.clone()),
        flagged_after_s: verdicts.as_ref().and_then(|v| v.flagged.map(|f| f.0)),
        flagged_after_reports: verdicts.as_ref().and_then(|v| v.flagged.map(|f| f.1)),
        followup_cpu_share: acc.fu_cpu.value(),
        followup_ttft_mean_ms: mean(&acc.fu_ttft_us) / 1e3,
        followup_ttft_p90_ms: percentile(&mut acc.fu_ttft_us, 0.9) as f64 / 1e3,
        followup_prefill_mean_ms: mean(&acc.fu_prefill_us) / 1e3,
        ttft_vs_oracle: None,
        wall_s: started.elapsed().as_secs_f64(),
    })
}

/// Runs `legs` in order on the same workload; each kvix leg against its own server.
pub async fn run(cfg: &FleetConfig, legs: &[Leg]) -> anyhow::Result<Vec<LegResult>> {
    let mut results = Vec::new();
    for &leg in legs {
        results.push(run_leg(cfg, leg).await?);
    }
    if let Some((hit, ttft)) = results
        .iter()
        .find(|r| r.leg == Leg::Oracle)
        .map(|r| (r.followup_hit, r.followup_ttft_mean_ms))
    {
        for r in &mut results {
            r.vs_oracle = (hit > 0.0).then(|| r.followup_hit / hit);
            r.ttft_vs_oracle = (ttft > 0.0).then(|| r.followup_ttft_mean_ms / ttft);
        }
    }
    Ok(results)
}
