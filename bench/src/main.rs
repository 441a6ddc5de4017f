//! kvix-bench: the numbers of kvix, each measured against a floor or a peer in the same
//! run. See `kvix-bench --help` and docs/benchmarks.md.

use std::path::PathBuf;

use anyhow::Context;
use clap::{Args, Parser, Subcommand};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde::Serialize;

use kvix_bench::fleet::{self, Chaos, FleetConfig, Leg, Misconfig};
use kvix_bench::replay::{self, InProcess, Remote, ReplayConfig, ReplayResult};
use kvix_bench::sim::{self, LegResult, LoadView, Regime, SimConfig};
use kvix_bench::table::{f, Table};
use kvix_bench::trace;
use kvix_bench::workload::Workload;
use kvix_bench::{http_latency, huge, latency, load, net, redis, soak, stats, writes};

#[derive(Parser, Debug)]
#[command(
    name = "kvix-bench",
    version,
    about = "Benchmarks for kvix, the shared prefix-cache index",
    long_about = "Benchmarks for kvix, the shared prefix-cache index.\n\n\
        Every subcommand works with no flags. Results go to stdout as a table, or as JSON \
        with --json; progress goes to stderr. Latency figures come with a floor measured \
        in the same run (this kind of VM is shared and noisy): quote ratios, not bare \
        microseconds. All network traffic goes to 127.0.0.1 only."
)]
struct Cli {
    /// Print the result as JSON on stdout instead of a table.
    #[arg(long, global = true)]
    json: bool,
    /// No progress bars.
    #[arg(long, global = true)]
    quiet: bool,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Routing simulation: shared index (fed by worker cache events) vs per-gateway local
    /// guesses (fed by own placements); follow-up cache hit and load CoV for G gateways.
    ///
    /// Mock workers keep LRU prefix caches; multi-turn sessions (turn 2 extends turn 1's
    /// prompt) are sprayed at uniformly random gateways, each making the same cache-aware
    /// pick (overlap_blocks - alpha * queue_len, ties by load). The hit ratio is what the
    /// chosen worker actually still holds. Deterministic for a --seed.
    Sim(SimArgs),
    /// The routing claim end to end: mock engines (LRU caches, slots, a prefill/decode
    /// time model, vLLM 0.34 KV events over ZMQ with replay) and gateways (each its own
    /// kvix-client) around a real kvix-server, in real time.
    ///
    /// Legs on the same workload: events (kvix fed by the engines' events), placements
    /// (kvix fed by the gateways' placements), local (each gateway its own index of its
    /// own placements), round-robin, oracle (every engine's cache read at routing time).
    /// Hits are measured on the engines. Starts a kvix-server per kvix leg (--server).
    Fleet(FleetArgs),
    /// Replay the Mooncake trace: route each request via the index, publish the
    /// placement, report query latency percentiles and index hit depth.
    ///
    /// hash_ids map to chains (block i = chain hash of (block i-1's hash, hash_id)).
    /// Targets: --in-process (kvix_engine::Engine directly) or a server (--server).
    Trace(TraceArgs),
    /// Closed-loop queries against a server, with the transport floor (Echo of the same
    /// request/reply sizes) measured in the same run; prints query/floor per percentile.
    Latency(LatencyArgs),
    /// Open-loop load at --rate from N gateways with event traffic from M workers;
    /// coordinated-omission-correct latency and the share missing a 2 ms deadline.
    Load(LoadArgs),
    /// Placement churn against a server until every worker's cap is reached and beyond,
    /// sampling its resident memory (which must go flat with the block count).
    Soak(SoakArgs),
    /// The same queries against Redis (llm-d style: one hash per block, pipelined HKEYS)
    /// and kvix, side by side, same data in both.
    Redis(RedisArgs),
    /// Closed-loop acknowledged writes (one-block event batches) with the transport floor
    /// (an Echo of the same sizes) in the same run; with --replica, how long after its ack
    /// each write is visible on another replica of the server's log.
    Writes(WritesArgs),
    /// Queries beside frame-limit writes: one connection stores as many blocks as a frame
    /// takes, removes them, then stores ten such batches back to back, while another
    /// queries a 125-block prompt at a low rate. Query percentiles before and during the
    /// writes, and the writes' rate. With --echo against `kvix-bench echo-server`: the
    /// same frames through the transport alone (scripts/huge-writes.sh runs both).
    HugeWrites(HugeArgs),
    /// A stand-in server for `huge-writes --echo`: answers Hello, Echo, Announce and every
    /// request at once without an index (a thread per connection). Prints its address.
    EchoServer(EchoServerArgs),
}

#[derive(Args, Debug)]
struct HugeArgs {
    /// Server address (loopback only): a kvix-server, or an echo-server with --echo.
    #[arg(long, default_value = "127.0.0.1:7420")]
    server: String,
    /// The server is `kvix-bench echo-server`: queries go as Echoes of the same sizes.
    #[arg(long)]
    echo: bool,
    /// Stores back to back after the first store and its removal.
    #[arg(long, default_value_t = 10)]
    stores: usize,
    /// Microseconds between two queries.
    #[arg(long, default_value_t = 1000)]
    query_interval_us: u64,
    /// Queries before the writes (the idle baseline).
    #[arg(long, default_value_t = 2000)]
    idle_queries: usize,
    /// Tokens per block (the server's --block-size).
    #[arg(long, default_value_t = 16)]
    token_block: u32,
    #[arg(long, default_value_t = 11)]
    seed: u64,
}

#[derive(Args, Debug)]
struct EchoServerArgs {
    /// Address to listen on (port 0: any free port; the address is printed).
    #[arg(long, default_value = "127.0.0.1:0")]
    listen: String,
    /// Largest frame it reads (the Welcome says so); kvix-server's default.
    #[arg(long, default_value_t = kvix_wire::DEFAULT_MAX_FRAME)]
    max_frame: u32,
}

#[derive(Args, Debug)]
struct SimArgs {
    /// Gateway counts to simulate, one leg each per regime.
    #[arg(long, value_delimiter = ',', default_value = "1,8")]
    gateways: Vec<u32>,
    /// Regimes to compare.
    #[arg(long, value_delimiter = ',', default_value = "shared,local")]
    regimes: Vec<Regime>,
    #[arg(long, default_value_t = 240)]
    workers: u32,
    /// Sessions per leg.
    #[arg(long, default_value_t = 20_000)]
    sessions: u32,
    /// Session arrivals per simulated second.
    #[arg(long, default_value_t = 600.0)]
    session_rate: f64,
    #[command(flatten)]
    workload: Workload,
    /// Queue lengths a gateway sees: its own in-flight counts, or the fleet's.
    #[arg(long, value_enum, default_value_t = LoadView::Gateway)]
    load_view: LoadView,
}

#[derive(Args, Debug)]
struct FleetArgs {
    /// Legs to run, in order.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "oracle,events,placements,local,round-robin"
    )]
    legs: Vec<Leg>,
    /// Mock engines (each its own loopback address, 127.1.x.y).
    #[arg(long, default_value_t = 120)]
    engines: u32,
    #[arg(long, default_value_t = 8)]
    gateways: u32,
    /// Session arrivals per second.
    #[arg(long, default_value_t = 30.0)]
    session_rate: f64,
    /// Seconds of arrivals per leg (each leg then runs until its sessions end).
    #[arg(long, default_value_t = 30.0)]
    seconds: f64,
    /// Requests an engine runs at once; more wait in its queue.
    #[arg(long, default_value_t = 16)]
    slots: u32,
    /// The gateways' query deadline, ms.
    #[arg(long, default_value_t = 2.0)]
    deadline_ms: f64,
    /// The kvix-server binary. Default: the one beside this kvix-bench.
    #[arg(long)]
    server: Option<PathBuf>,
    /// The server's --cores.
    #[arg(long, default_value_t = 1)]
    server_cores: u32,
    /// kvix servers per kvix leg; more than one are replicas of one Redis log, in a
    /// redis-server the leg starts (the placements leg: the events leg runs one).
    #[arg(long, default_value_t = 1)]
    replicas: u32,
    /// A fault halfway through the arrivals of every leg.
    #[arg(long, value_enum)]
    chaos: Option<Chaos>,
    /// A part set up wrong for every leg, for kvix's reuse verdicts to name (the kvix
    /// legs' gateways report every request's reuse).
    #[arg(long, value_enum)]
    misconfig: Option<Misconfig>,
    /// The kvix server without placements filling in for event-fed workers whose
    /// history is lost or whose events are missing (`--fill-in-blocks 0`): what the
    /// fill-in recovers, by comparison.
    #[arg(long)]
    no_fill_in: bool,
    #[command(flatten)]
    workload: Workload,
}

#[derive(Args, Debug)]
struct TraceArgs {
    /// Trace file (JSON lines). Default: ../shared/data/mooncake_synthetic_trace.jsonl
    /// relative to the repository root.
    #[arg(long)]
    path: Option<PathBuf>,
    /// Replay against kvix_engine::Engine in this process.
    #[arg(long)]
    in_process: bool,
    /// Server address (when not --in-process).
    #[arg(long, default_value = "127.0.0.1:7420")]
    server: String,
    /// Simulated workers (placement-fed).
    #[arg(long, default_value_t = 16)]
    workers: u32,
    /// Placement capacity per worker, in keyspace blocks.
    #[arg(long, default_value_t = 100_000)]
    capacity_blocks: u64,
    /// Keyspace blocks per 512-token trace block (32 = 16-token blocks).
    #[arg(long, default_value_t = 1)]
    sub_blocks: u32,
    /// Token block size of the in-process engine / expected of the server.
    #[arg(long, default_value_t = 16)]
    token_block: u32,
    /// Load penalty (blocks per in-flight request).
    #[arg(long, default_value_t = 1.0)]
    alpha: f64,
    /// Replay at this multiple of the trace's own pace (default: as fast as possible).
    #[arg(long, conflicts_with = "as_fast_as_possible")]
    speed: Option<f64>,
    /// Replay as fast as possible (the default when --speed is not given).
    #[arg(long)]
    as_fast_as_possible: bool,
    /// At most this many requests.
    #[arg(long, default_value_t = usize::MAX)]
    limit: usize,
    /// Stop after this many wall seconds.
    #[arg(long, default_value_t = 600.0)]
    max_seconds: f64,
}

/// What the server is preloaded with (shared by latency, load and redis).
#[derive(Args, Debug, Clone)]
struct DataArgs {
    /// Simulated workers announced (event feed) and preloaded.
    #[arg(long, default_value_t = 240)]
    workers: usize,
    /// Distinct prompts per chain length; each is held whole by one worker, to half by
    /// another, to a quarter by a third.
    #[arg(long, default_value_t = 64)]
    chains: usize,
    /// Blocks of the system prefix every worker holds.
    #[arg(long, default_value_t = 32)]
    system_blocks: u32,
    /// Token block size (must equal the server's --block-size).
    #[arg(long, default_value_t = 16)]
    token_block: u32,
    #[arg(long, default_value_t = 1)]
    seed: u64,
}

#[derive(Args, Debug)]
struct SoakArgs {
    /// kvix-server address (loopback only).
    #[arg(long, default_value = "127.0.0.1:7420")]
    server: String,
    /// The server's metrics address (loopback only).
    #[arg(long, default_value = "127.0.0.1:7421")]
    metrics: String,
    /// Placement-fed workers.
    #[arg(long, default_value_t = 240)]
    workers: usize,
    /// Blocks each worker may hold (placements past it cut its oldest-used blocks).
    #[arg(long, default_value_t = 9500)]
    capacity: u64,
    /// Blocks of the system prefix every placement starts with.
    #[arg(long, default_value_t = 16)]
    prefix_blocks: u32,
    /// Blocks of each placement's own tail.
    #[arg(long, default_value_t = 32)]
    tail_blocks: u32,
    /// Placements per second, all workers together.
    #[arg(long, default_value_t = 3000.0)]
    rate: f64,
    /// Seconds of churn.
    #[arg(long, default_value_t = 90.0)]
    duration: f64,
    /// Seconds between memory samples.
    #[arg(long, default_value_t = 5.0)]
    sample: f64,
    /// Token block size (must equal the server's --block-size).
    #[arg(long, default_value_t = 16)]
    token_block: u32,
    #[arg(long, default_value_t = 1)]
    seed: u64,
}

#[derive(Args, Debug)]
struct WritesArgs {
    /// kvix-server address (loopback only) the writes go to.
    #[arg(long, default_value = "127.0.0.1:7420")]
    server: String,
    /// Another replica of the server's --log: each write is looked for there after its ack.
    #[arg(long)]
    replica: Option<String>,
    /// A Redis (the log's): each write's bytes are also appended there (XADD to a scratch
    /// stream), the round trip an acknowledged write with --log cannot do without.
    #[arg(long)]
    redis: Option<String>,
    /// Measured writes (and as many echoes).
    #[arg(long, default_value_t = 5000)]
    writes: usize,
    #[arg(long, default_value_t = 500)]
    warmup: usize,
    /// Tokens per block (the server's --block-size).
    #[arg(long, default_value_t = 16)]
    token_block: u32,
    #[arg(long, default_value_t = 7)]
    seed: u64,
}

#[derive(Args, Debug)]
struct LatencyArgs {
    /// kvix-server address (loopback only).
    #[arg(long, default_value = "127.0.0.1:7420")]
    server: String,
    /// Chain lengths in blocks, one row each.
    #[arg(long, value_delimiter = ',', default_value = "125,1250")]
    blocks: Vec<u32>,
    /// Measured queries (and as many echoes) per chain length.
    #[arg(long, default_value_t = 20_000)]
    queries: usize,
    #[arg(long, default_value_t = 1000)]
    warmup: usize,
    /// Scores per answer (0 = all).
    #[arg(long, default_value_t = 16)]
    top_k: u32,
    /// Client spins this many µs before parking while waiting for a reply.
    #[arg(long)]
    spin_us: Option<u64>,
    /// Wall-time bound per chain length.
    #[arg(long, default_value_t = 120.0)]
    max_seconds: f64,
    /// TLS to the server (kvix-server --tls-cert): PEM file of the CA its certificate
    /// (for 127.0.0.1) is signed by. Queries, the floor's echoes and the preload all go
    /// over TLS.
    #[arg(long)]
    tls_ca: Option<std::path::PathBuf>,
    /// Query kvix's HTTP API instead (kvix-server --http ADDR), beside an HTTP echo of
    /// the same sizes on that listener (the floor); the engines' events come from this
    /// process over ZMQ, registered with POST /register.
    #[arg(long)]
    http: Option<String>,
    /// With --http: Dynamo's standalone KV indexer (bench/peer's dynamo-indexer) queried
    /// beside it, fed the same engines.
    #[arg(long, requires = "http")]
    dynamo: Option<String>,
    /// With --http: engines (bound ZMQ publishers), each registered with both.
    #[arg(long, default_value_t = 16)]
    engines: usize,
    #[command(flatten)]
    data: DataArgs,
}

#[derive(Args, Debug)]
struct LoadArgs {
    /// kvix-server address (loopback only); several, comma-separated, are replicas of
    /// one log: queries go to the first up and are hedged to the next, the workers'
    /// writes go through the last.
    #[arg(
        long,
        alias = "servers",
        value_delimiter = ',',
        default_value = "127.0.0.1:7420"
    )]
    server: Vec<String>,
    /// Queries per second, all gateways together (open loop).
    #[arg(long, default_value_t = 2000.0)]
    rate: f64,
    /// Simulated gateways, each its own kvix-client connection.
    #[arg(long, default_value_t = 8)]
    gateways: usize,
    /// Event batches per second from the workers (each stores and removes blocks).
    #[arg(long, default_value_t = 1000.0)]
    event_rate: f64,
    /// Blocks stored per event batch.
    #[arg(long, default_value_t = 16)]
    event_blocks: u32,
    /// Stores carry an engine hash per block and removals name them (as vLLM's do).
    #[arg(long)]
    event_engine: bool,
    /// Stores take their chains in turn from this many made before the run (0: a fresh
    /// chain per batch); keeps the generator's own hashing out of runs of huge batches.
    #[arg(long, default_value_t = 0)]
    event_pool: usize,
    /// Seconds of load.
    #[arg(long, default_value_t = 10.0)]
    duration: f64,
    /// Interleave an Echo of the same sizes half-way between queries, at the same rate:
    /// the transport floor under the same load (false: queries only).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    floor: bool,
    /// Chain length of the queries, blocks.
    #[arg(long, default_value_t = 125)]
    blocks: u32,
    #[arg(long, default_value_t = 16)]
    top_k: u32,
    /// Deadline a gateway gives a query, ms.
    #[arg(long, default_value_t = 2.0)]
    deadline_ms: f64,
    /// Requests in flight before new ones are skipped (and counted as misses).
    #[arg(long, default_value_t = 10_000)]
    max_inflight: usize,
    /// tokio worker threads for the gateways.
    #[arg(long, default_value_t = 1)]
    threads: usize,
    /// The (last) server's metrics address: the report gives the queries each of its
    /// executors answered ("" to skip).
    #[arg(long, default_value = "127.0.0.1:7421")]
    metrics: String,
    #[command(flatten)]
    data: DataArgs,
}

#[derive(Args, Debug)]
struct RedisArgs {
    /// kvix-server address (loopback only).
    #[arg(long, default_value = "127.0.0.1:7420")]
    server: String,
    /// Redis address (scripts/redis.sh start).
    #[arg(long, default_value = "127.0.0.1:6379")]
    redis: String,
    #[arg(long, value_delimiter = ',', default_value = "125,1250")]
    blocks: Vec<u32>,
    #[arg(long, default_value_t = 5000)]
    queries: usize,
    #[arg(long, default_value_t = 200)]
    warmup: usize,
    #[arg(long, default_value_t = 120.0)]
    max_seconds: f64,
    #[command(flatten)]
    data: DataArgs,
}

fn progress(quiet: bool, what: &str) -> ProgressBar {
    if quiet {
        return ProgressBar::hidden();
    }
    let pb = ProgressBar::with_draw_target(Some(0), ProgressDrawTarget::stderr());
    pb.set_style(
        ProgressStyle::with_template("{msg:>24} [{bar:40}] {pos}/{len} {per_sec} eta {eta}")
            .expect("valid template")
            .progress_chars("=> "),
    );
    pb.set_message(what.to_string());
    pb
}

fn emit<T: Serialize>(
    json: bool,
    value: &T,
    table: impl FnOnce(&T) -> String,
) -> anyhow::Result<()> {
    if json {
        println!("{}", serde_json::to_string_pretty(value)?);
    } else {
        print!("{}", table(value));
    }
    Ok(())
}

#[derive(Serialize)]
struct SimReport {
    command: &'static str,
    config: SimConfig,
    legs: Vec<LegResult>,
}

fn cmd_sim(a: SimArgs, json: bool, quiet: bool) -> anyhow::Result<()> {
    let base = SimConfig {
        workers: a.workers,
        gateways: a.gateways.first().copied().unwrap_or(1),
        sessions: a.sessions,
        session_rate: a.session_rate,
        load_view: a.load_view,
        regime: a.regimes.first().copied().unwrap_or(Regime::Shared),
        workload: a.workload,
    };
    let mut legs = Vec::new();
    for &regime in &a.regimes {
        for &gateways in &a.gateways {
            let cfg = SimConfig {
                regime,
                gateways,
                ..base.clone()
            };
            let pb = progress(quiet, &format!("sim {regime:?} G={gateways}"));
            legs.push(sim::run(&cfg, &pb)?);
        }
    }
    let report = SimReport {
        command: "sim",
        config: base,
        legs,
    };
    emit(json, &report, |r| {
        let mut t = Table::new(&[
            "regime",
            "gateways",
            "follow-up hit",
            "turn-1 hit",
            "same worker",
            "load CoV",
            "in-flight CoV",
            "requests",
            "wall s",
        ]);
        for l in &r.legs {
            t.row(vec![
                format!("{:?}", l.regime).to_lowercase(),
                l.gateways.to_string(),
                f(l.followup_hit, 3),
                f(l.first_turn_hit, 3),
                f(l.same_worker, 3),
                f(l.load_cov, 3),
                f(l.inflight_cov, 3),
                l.requests.to_string(),
                f(l.wall_s, 1),
            ]);
        }
        format!(
            "sim: {} workers, {} sessions x {} turns, seed {}, capacity {} blocks, alpha {}, load view {:?}\n{}",
            r.config.workers,
            r.config.sessions,
            r.config.workload.turns,
            r.config.workload.seed,
            r.config.workload.capacity_blocks,
            r.config.workload.alpha,
            r.config.load_view,
            t.render()
        )
    })
}

#[derive(Serialize)]
struct FleetReport {
    command: &'static str,
    config: FleetConfig,
    legs: Vec<fleet::LegResult>,
}

fn cmd_fleet(a: FleetArgs, json: bool) -> anyhow::Result<()> {
    let server = match a.server {
        Some(p) => p,
        None => std::env::current_exe()?
            .parent()
            .context("kvix-bench's directory")?
            .join("kvix-server"),
    };
    let config = FleetConfig {
        engines: a.engines,
        gateways: a.gateways,
        session_rate: a.session_rate,
        seconds: a.seconds,
        slots: a.slots,
        deadline_ms: a.deadline_ms,
        server,
        server_cores: a.server_cores,
        replicas: a.replicas,
        chaos: a.chaos,
        misconfig: a.misconfig,
        fill_in: !a.no_fill_in,
        workload: a.workload,
    };
    let legs = runtime(2)?.block_on(fleet::run(&config, &a.legs))?;
    let report = FleetReport {
        command: "fleet",
        config,
        legs,
    };
    emit(json, &report, |r| {
        let opt = |v: Option<f64>, d: usize| v.map_or("-".into(), |v| f(v, d));
        let mut t = Table::new(&[
            "leg",
            "follow-up hit",
            "vs oracle",
            "same worker",
            "degraded",
            "load CoV",
            "error p50/p95 tok",
            "false hits",
            "audit",
            "replicas differ",
            "lookup p50/p99 us",
            "e2e p50/p99 ms",
            "server cores",
            "server MiB",
            "fu CPU share",
            "fu TTFT mean/p90 ms",
            "fu prefill ms",
            "TTFT vs oracle",
            "requests",
        ]);
        for l in &r.legs {
            t.row(vec![
                l.leg.to_string(),
                f(l.followup_hit, 3),
                opt(l.vs_oracle, 3),
                f(l.same_worker, 3),
                f(l.degraded, 4),
                f(l.load_cov, 3),
                match (l.error_p50_tokens, l.error_p95_tokens) {
                    (Some(a), Some(b)) => format!("{a}/{b}"),
                    _ => "-".into(),
                },
                l.false_hits.to_string(),
                l.audit_mismatches.map_or("-".into(), |m| m.to_string()),
                l.replicas_differ.map_or("-".into(), |m| m.to_string()),
                format!("{}/{}", f(l.lookup_p50_us, 0), f(l.lookup_p99_us, 0)),
                format!("{}/{}", f(l.e2e_p50_ms, 0), f(l.e2e_p99_ms, 0)),
                opt(l.server_cores, 2),
                opt(l.server_rss_mib, 0),
                f(l.followup_cpu_share, 3),
                format!(
                    "{}/{}",
                    f(l.followup_ttft_mean_ms, 1),
                    f(l.followup_ttft_p90_ms, 1)
                ),
                f(l.followup_prefill_mean_ms, 1),
                opt(l.ttft_vs_oracle, 3),
                l.requests.to_string(),
            ]);
        }
        let cold: Vec<String> = r
            .legs
            .iter()
            .filter_map(|l| Some(format!("{} {}", l.leg, f(l.cold_gateway_followup_hit?, 3))))
            .collect();
        format!(
            "fleet: {} engines, {} gateways, {} sessions/s for {} s, {} turns, seed {}, capacity {} blocks, CPU tier {} blocks, {} slots, chaos {:?}\n{}{}",
            r.config.engines,
            r.config.gateways,
            r.config.session_rate,
            r.config.seconds,
            r.config.workload.turns,
            r.config.workload.seed,
            r.config.workload.capacity_blocks,
            r.config.workload.cpu_capacity_blocks,
            r.config.slots,
            r.config.chaos,
            t.render(),
            if cold.is_empty() {
                String::new()
            } else {
                format!("restarted gateway's follow-up hit after its restart: {}\n", cold.join(", "))
            } + &verdicts_line(&r.legs)
        )
    })
}

/// The kvix legs' reuse verdicts: the most held at once by cause, and when a
/// misconfigured gateway was named.
fn verdicts_line(legs: &[fleet::LegResult]) -> String {
    let mut out = String::new();
    for l in legs {
        let Some(v) = &l.verdicts else { continue };
        let held: Vec<String> = v.iter().map(|(c, n)| format!("{c} {n}")).collect();
        out += &format!("{} verdicts (most at once): {}", l.leg, held.join(", "));
        if let (Some(s), Some(n)) = (l.flagged_after_s, l.flagged_after_reports) {
            out +=
                &format!("; the misconfigured part named after {s:.1} s and {n} reports about it");
        }
        out.push('\n');
    }
    out
}

/// The default trace path: `../shared/data/…` relative to the repository root, looked up
/// from the current directory and from where this crate was built.
fn default_trace_path() -> PathBuf {
    let rel = "../shared/data/mooncake_synthetic_trace.jsonl";
    let here = PathBuf::from(rel);
    if here.exists() {
        return here;
    }
    let built = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join(rel);
    if built.exists() {
        return built;
    }
    here
}

#[derive(Serialize)]
struct TraceReport {
    command: &'static str,
    path: String,
    workers: u32,
    sub_blocks: u32,
    speed: Option<f64>,
    result: ReplayResult,
    index_blocks: Option<u64>,
}

fn cmd_trace(a: TraceArgs, json: bool, quiet: bool) -> anyhow::Result<()> {
    let path = a.path.clone().unwrap_or_else(default_trace_path);
    let records = trace::load_trace(&path).context("reading the trace")?;
    let cfg = ReplayConfig {
        sub_blocks: a.sub_blocks,
        alpha: a.alpha,
        speed: if a.as_fast_as_possible { None } else { a.speed },
        limit: a.limit,
        max_seconds: a.max_seconds,
        prefill_us_per_token: 0.0,
        decode_ms_per_token: 20.0,
    };
    let pb = progress(quiet, "trace replay");
    let (result, index_blocks) = if a.in_process {
        let mut t = InProcess::new(a.workers, a.capacity_blocks, a.token_block)?;
        let r = replay::replay(&mut t, "in-process", &records, &cfg, &pb)?;
        (r, Some(t.engine().stats().blocks))
    } else {
        let addr = kvix_bench::net::loopback(&a.server)?;
        let mut t = Remote::connect(addr, a.workers, a.capacity_blocks, a.token_block)?;
        let r = replay::replay(&mut t, &format!("server {addr}"), &records, &cfg, &pb)?;
        (r, None)
    };
    let report = TraceReport {
        command: "trace",
        path: path.display().to_string(),
        workers: a.workers,
        sub_blocks: a.sub_blocks,
        speed: cfg.speed,
        result,
        index_blocks,
    };
    emit(json, &report, |r| {
        let x = &r.result;
        let mut t = Table::new(&[
            "", "p50 us", "p90 us", "p99 us", "p99.9 us", "max us", "count",
        ]);
        for (name, s) in [("query", &x.query), ("place", &x.place)] {
            t.row(vec![
                name.into(),
                f(s.p50_us, 2),
                f(s.p90_us, 2),
                f(s.p99_us, 2),
                f(s.p999_us, 2),
                f(s.max_us, 2),
                s.count.to_string(),
            ]);
        }
        format!(
            "trace: {} ({} requests, {} workers, {} blocks/trace block, {}) against {}\n\
             hit depth (chosen worker) {:.3}, best available {:.3}, requests with a hit {:.3}, \
             prompt {:.1} blocks mean, {:.0} req/s over {:.2} s\n{}",
            r.path,
            x.requests,
            r.workers,
            r.sub_blocks,
            match r.speed {
                Some(s) => format!("{s}x trace pace, {} late", x.late),
                None => "as fast as possible".into(),
            },
            x.target,
            x.hit_depth,
            x.best_depth,
            x.hit_share,
            x.prompt_blocks_mean,
            x.rate_per_s,
            x.wall_s,
            t.render()
        )
    })
}

fn runtime(threads: usize) -> anyhow::Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads.max(1))
        .enable_all()
        .build()?)
}

fn cmd_soak(a: SoakArgs, json: bool, quiet: bool) -> anyhow::Result<()> {
    let (addr, metrics) = (net::loopback(&a.server)?, net::loopback(&a.metrics)?);
    let cfg = soak::SoakConfig {
        server: a.server,
        metrics: a.metrics,
        workers: a.workers,
        capacity: a.capacity,
        prefix_blocks: a.prefix_blocks,
        tail_blocks: a.tail_blocks,
        rate: a.rate,
        duration_s: a.duration,
        sample_s: a.sample,
        token_block: a.token_block,
        seed: a.seed,
    };
    let pb = progress(quiet, "soak: seconds");
    let report = runtime(1)?.block_on(soak::run(&cfg, addr, metrics, &pb))?;
    emit(json, &report, |r| {
        let mut t = Table::new(&["s", "blocks", "RSS MiB", "B/block/copy"]);
        for s in &r.samples {
            t.row(vec![
                f(s.at_s, 0),
                s.blocks.to_string(),
                f(s.resident_bytes as f64 / (1 << 20) as f64, 1),
                f(s.bytes_per_block_per_copy, 1),
            ]);
        }
        format!(
            "soak: {} placement workers x {} blocks, {} placements, {} executor(s) each with a copy\n{}\nresident memory at the end / when every cap was first reached: {:.3}\n",
            r.config.workers,
            r.config.capacity,
            r.placements,
            r.executors,
            t.render(),
            r.growth_after_full
        )
    })
}

fn cmd_huge(a: HugeArgs, json: bool) -> anyhow::Result<()> {
    let addr = net::loopback(&a.server)?;
    let cfg = huge::HugeConfig {
        server: a.server,
        echo: a.echo,
        stores: a.stores,
        query_interval_us: a.query_interval_us,
        idle_queries: a.idle_queries,
        token_block: a.token_block,
        seed: a.seed,
    };
    let rt = runtime(2)?;
    let mut report = rt.block_on(huge::run(&cfg, addr))?;
    report.command = std::env::args().collect::<Vec<_>>().join(" ");
    emit(json, &report, |r| {
        let mut t = Table::new(&["queries", "p50 us", "p90 us", "p99 us", "p99.9 us", "count"]);
        for (what, s) in [("idle", &r.idle), ("during the writes", &r.during_writes)] {
            let mut cells = vec![what.to_string()];
            cells.extend(s.cells());
            t.row(cells);
        }
        format!(
            "huge-writes against {}{}: batches of {} blocks ({} B frames)\n{}max during the writes {:.0} us, {} past 2 ms; writes {:.2} s, {:.2} M block events/s\n",
            r.config.server,
            if r.config.echo { " (echo-server)" } else { "" },
            r.blocks_per_batch,
            r.frame_bytes,
            t.render(),
            r.during_writes.max_us,
            r.past_deadline,
            r.write_seconds,
            r.block_events_per_s / 1e6,
        )
    })
}

fn cmd_writes(a: WritesArgs, json: bool) -> anyhow::Result<()> {
    let addr = net::loopback(&a.server)?;
    let replica = a.replica.as_deref().map(net::loopback).transpose()?;
    let redis = a.redis.as_deref().map(net::loopback).transpose()?;
    let cfg = writes::WritesConfig {
        server: a.server.clone(),
        replica: a.replica.clone(),
        redis: a.redis.clone(),
        writes: a.writes,
        warmup: a.warmup,
        token_block: a.token_block,
        seed: a.seed,
    };
    let rt = runtime(1)?;
    let report = rt.block_on(writes::run(&cfg, addr, replica, redis))?;
    emit(json, &report, |r| {
        let mut t = Table::new(&["what", "p50 us", "p90 us", "p99 us", "p99.9 us", "count"]);
        let mut add = |what: &str, s: &stats::Summary| {
            let mut cells = vec![what.to_string()];
            cells.extend(s.cells());
            t.row(cells);
        };
        add("acknowledged write", &r.write);
        add("floor (echo)", &r.floor);
        if let Some(lag) = &r.lag {
            add("visible on the replica after the ack", lag);
        }
        if let Some(append) = &r.append {
            add("XADD of its bytes to Redis", append);
        }
        format!(
            "writes: {} one-block event batches ({} B) to {}\n{}write / floor: p50 {:.2}, p99 {:.2}, p99.9 {:.2}\n",
            r.config.writes,
            r.request_bytes,
            r.config.server,
            t.render(),
            r.ratio.p50,
            r.ratio.p99,
            r.ratio.p999
        )
    })
}

fn cmd_latency(a: LatencyArgs, json: bool, quiet: bool) -> anyhow::Result<()> {
    if let Some(http) = &a.http {
        return cmd_http_latency(http, &a, json, quiet);
    }
    let addr = net::loopback(&a.server)?;
    let cfg = latency::LatencyConfig {
        server: a.server.clone(),
        blocks: a.blocks,
        queries: a.queries,
        warmup: a.warmup,
        workers: a.data.workers,
        chains_per_length: a.data.chains,
        system_blocks: a.data.system_blocks,
        top_k: a.top_k,
        token_block: a.data.token_block,
        spin_us: a.spin_us,
        seed: a.data.seed,
        max_seconds: a.max_seconds,
        tls_ca: a.tls_ca,
    };
    let pb = progress(quiet, "latency");
    let rt = runtime(1)?;
    let report = rt.block_on(latency::run(&cfg, addr, &pb))?;
    emit(json, &report, |r| {
        let mut t = Table::new(&[
            "blocks", "what", "req B", "reply B", "p50 us", "p90 us", "p99 us", "p99.9 us", "count",
        ]);
        for row in &r.rows {
            for (what, s, rq, rp) in [
                ("query", &row.query, row.request_bytes, row.reply_bytes),
                (
                    "floor (echo)",
                    &row.floor,
                    row.echo_request_bytes,
                    row.echo_reply_bytes,
                ),
            ] {
                let mut cells = vec![
                    row.blocks.to_string(),
                    what.into(),
                    rq.to_string(),
                    rp.to_string(),
                ];
                cells.extend(s.cells());
                t.row(cells);
            }
            let mut cells = vec![
                row.blocks.to_string(),
                "query / floor".into(),
                String::new(),
                String::new(),
            ];
            cells.extend(row.ratio.cells());
            cells.push(format!("{} not scored", row.not_scored));
            t.row(cells);
        }
        format!(
            "latency: closed loop against {} ({} shards), {} workers preloaded, top_k {}\n{}",
            r.config.server,
            r.server_shards,
            r.config.workers,
            r.config.top_k,
            t.render()
        )
    })
}

fn cmd_http_latency(http: &str, a: &LatencyArgs, json: bool, quiet: bool) -> anyhow::Result<()> {
    let cfg = http_latency::HttpLatencyConfig {
        kvix: net::loopback(http)?,
        dynamo: a.dynamo.as_deref().map(net::loopback).transpose()?,
        blocks: a.blocks.clone(),
        queries: a.queries,
        warmup: a.warmup,
        engines: a.engines,
        chains_per_length: a.data.chains,
        system_blocks: a.data.system_blocks,
        token_block: a.data.token_block,
        seed: a.data.seed,
        max_seconds: a.max_seconds,
    };
    let pb = progress(quiet, "latency --http");
    let report = http_latency::run(&cfg, &pb)?;
    emit(json, &report, |r| {
        let mut t = Table::new(&[
            "blocks", "what", "req B", "reply B", "p50 us", "p90 us", "p99 us", "p99.9 us", "count",
        ]);
        for row in &r.rows {
            let named = [
                Some(("kvix", &row.kvix)),
                row.dynamo.as_ref().map(|d| ("Dynamo", d)),
                Some(("floor (echo)", &row.floor)),
            ];
            for (what, s) in named.into_iter().flatten() {
                let mut cells = vec![
                    row.blocks.to_string(),
                    what.into(),
                    row.request_bytes.to_string(),
                    row.reply_bytes.to_string(),
                ];
                cells.extend(s.cells());
                t.row(cells);
            }
            let ratios = [
                Some(("kvix / floor", &row.kvix_over_floor)),
                row.dynamo_over_kvix.as_ref().map(|x| ("Dynamo / kvix", x)),
            ];
            for (what, x) in ratios.into_iter().flatten() {
                let mut cells = vec![
                    row.blocks.to_string(),
                    what.into(),
                    String::new(),
                    String::new(),
                ];
                cells.extend(x.cells());
                t.row(cells);
            }
        }
        format!(
            "latency --http: kvix at {} and Dynamo at {}, {} engines, one keep-alive connection each\n{}",
            r.config.kvix,
            r.config.dynamo.map_or("-".to_string(), |d| d.to_string()),
            r.config.engines,
            t.render()
        )
    })
}

fn cmd_load(a: LoadArgs, json: bool, quiet: bool) -> anyhow::Result<()> {
    let addrs = a
        .server
        .iter()
        .map(|s| net::loopback(s))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let cfg = load::LoadConfig {
        server: a.server.join(","),
        rate: a.rate,
        gateways: a.gateways,
        workers: a.data.workers,
        event_rate: a.event_rate,
        event_blocks: a.event_blocks,
        event_engine: a.event_engine,
        event_pool: a.event_pool,
        duration_s: a.duration,
        floor: a.floor,
        blocks: a.blocks,
        chains: a.data.chains,
        system_blocks: a.data.system_blocks,
        top_k: a.top_k,
        deadline_ms: a.deadline_ms,
        token_block: a.data.token_block,
        max_inflight: a.max_inflight,
        seed: a.data.seed,
        metrics: a.metrics,
    };
    let rt = runtime(a.threads)?;
    let pb = progress(quiet, "load: queries and echoes");
    let report = load::run(&cfg, &addrs, &rt, &pb)?;
    emit(json, &report, |r| {
        let mut t = Table::new(&[
            "what", "sent", "rate/s", "p50 us", "p99 us", "p99.9 us", "max us", "miss 2ms",
        ]);
        let mut add = |name: &str, p: &load::Phase| {
            t.row(vec![
                name.into(),
                p.sent.to_string(),
                f(p.achieved_rate, 0),
                f(p.latency.p50_us, 1),
                f(p.latency.p99_us, 1),
                f(p.latency.p999_us, 1),
                f(p.latency.max_us, 1),
                format!("{:.4}", p.miss_share),
            ]);
        };
        add("query", &r.queries);
        if let Some(fl) = &r.floor {
            add("floor (echo)", fl);
        }
        let ratio = r
            .ratio
            .map(|x| {
                format!(
                    "query / floor: p50 {:.2}, p99 {:.2}, p99.9 {:.2}\n",
                    x.p50, x.p99, x.p999
                )
            })
            .unwrap_or_default();
        let split = match &r.executor_queries {
            Ok(q) => {
                let all = q.iter().sum::<u64>().max(1) as f64;
                let shares: Vec<String> = q
                    .iter()
                    .enumerate()
                    .map(|(e, n)| format!("{e}: {n} ({:.0} %)", 100.0 * *n as f64 / all))
                    .collect();
                format!("queries per executor: {}\n", shares.join(", "))
            }
            Err(e) => format!("queries per executor: not read ({e})\n"),
        };
        let refused = if r.event_batches_refused.is_empty() {
            format!("event batches sent: {}, refused: none\n", r.event_batches)
        } else {
            let by_code: Vec<String> = r
                .event_batches_refused
                .iter()
                .map(|(code, n)| format!("{code} {n}"))
                .collect();
            format!(
                "event batches sent: {}, refused: {}\n",
                r.event_batches,
                by_code.join(", ")
            )
        };
        format!(
            "load: open loop {} q/s from {} gateways, {} workers sending {:.0} block events/s, \
             {}-block queries ({} B / {} B), deadline {} ms\n{}{}{}{}",
            r.config.rate,
            r.config.gateways,
            r.config.workers,
            r.block_events_per_s,
            r.config.blocks,
            r.request_bytes,
            r.reply_bytes,
            r.config.deadline_ms,
            t.render(),
            ratio,
            split,
            refused
        )
    })
}

fn cmd_redis(a: RedisArgs, json: bool, quiet: bool) -> anyhow::Result<()> {
    let addr = net::loopback(&a.server)?;
    let raddr = net::loopback(&a.redis)?;
    let cfg = redis::RedisConfig {
        server: a.server.clone(),
        redis: a.redis.clone(),
        blocks: a.blocks,
        queries: a.queries,
        warmup: a.warmup,
        workers: a.data.workers,
        chains_per_length: a.data.chains,
        system_blocks: a.data.system_blocks,
        token_block: a.data.token_block,
        seed: a.data.seed,
        max_seconds: a.max_seconds,
    };
    let pb = progress(quiet, "redis vs kvix");
    let rt = runtime(1)?;
    let report = rt.block_on(redis::run(&cfg, addr, raddr, &pb))?;
    emit(json, &report, |r| {
        let mut t = Table::new(&[
            "blocks", "what", "p50 us", "p90 us", "p99 us", "p99.9 us", "count",
        ]);
        for row in &r.rows {
            for (what, s) in [("kvix", &row.kvix), ("redis", &row.redis)] {
                let mut cells = vec![row.blocks.to_string(), what.into()];
                cells.extend(s.cells());
                t.row(cells);
            }
            let mut cells = vec![row.blocks.to_string(), "redis / kvix".into()];
            cells.extend(row.ratio.cells());
            cells.push(format!("agree {:.3}", row.agree));
            t.row(cells);
        }
        format!(
            "redis: llm-d style pipelined HKEYS at {} vs kvix at {}, {} workers, {} keys\n{}",
            r.config.redis,
            r.config.server,
            r.config.workers,
            r.redis_keys,
            t.render()
        )
    })
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    let done = match cli.cmd {
        Cmd::Sim(a) => cmd_sim(a, cli.json, cli.quiet),
        Cmd::Fleet(a) => cmd_fleet(a, cli.json),
        Cmd::Trace(a) => cmd_trace(a, cli.json, cli.quiet),
        Cmd::Latency(a) => cmd_latency(a, cli.json, cli.quiet),
        Cmd::Load(a) => cmd_load(a, cli.json, cli.quiet),
        Cmd::Soak(a) => cmd_soak(a, cli.json, cli.quiet),
        Cmd::Redis(a) => cmd_redis(a, cli.json, cli.quiet),
        Cmd::Writes(a) => cmd_writes(a, cli.json),
        Cmd::HugeWrites(a) => cmd_huge(a, cli.json),
        Cmd::EchoServer(a) => kvix_bench::echo_server::serve(&a.listen, a.max_frame),
    };
    match done {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            // One line with the cause chain (a dead server, a bad flag), no backtrace.
            eprintln!("kvix-bench: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
