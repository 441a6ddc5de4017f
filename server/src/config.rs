//! Command-line flags. With none the server listens on loopback, one executor per core.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;

use crate::ingest::bound::{rank_endpoint, BindSpec};
use crate::ingest::fleet::parse_lanes;

/// kvix-server: the shared prefix-cache index, one pinned executor per core.
///
/// Gateways ask it which worker holds the longest reusable prefix of a prompt;
/// workers' cache events and gateways' placements keep it current. With no flags it
/// listens on 127.0.0.1:7420 (and /tmp/kvix.sock), serves metrics on 127.0.0.1:7421,
/// uses every core and keeps no snapshot.
///
/// `kvix-server check [FLAGS]` checks what a start with these flags needs (ports free,
/// files readable, the write-ahead log whole, Redis answering, ...) and exits: non-zero
/// if anything would fail. docs/operations.md explains every flag.
#[derive(Parser, Debug, Clone)]
#[command(
    name = "kvix-server",
    version,
    override_usage = "kvix-server [FLAGS]\n       kvix-server check [FLAGS]"
)]
pub struct Config {
    /// A TOML file of flags, keyed by long name without the dashes (`max-blocks = 1000`,
    /// `wal = true`, `source-allow = ["10.0.0.0/8"]`); the command line and the
    /// environment variables named here win over it.
    #[arg(long, env = "KVIX_CONFIG")]
    pub config: Option<PathBuf>,

    /// TCP address for the kvix protocol.
    #[arg(long, default_value = "127.0.0.1:7420", env = "KVIX_LISTEN")]
    pub listen: SocketAddr,

    /// Unix socket path for the kvix protocol ("" to disable).
    #[arg(long, default_value = "/tmp/kvix.sock", env = "KVIX_UNIX")]
    pub unix: String,

    /// HTTP address for Prometheus metrics ("" to disable).
    #[arg(long, default_value = "127.0.0.1:7421", env = "KVIX_METRICS")]
    pub metrics: String,

    /// Executors, each with a whole copy of the index (memory grows with it); 0 = one per
    /// CPU the process may use.
    #[arg(long, default_value_t = 0)]
    pub cores: usize,

    /// Pin each executor to its own CPU among those the process may run on (cpuset,
    /// taskset).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub pin: bool,

    /// Token block size of every token keyspace; clients hashing with another are refused.
    #[arg(long, default_value_t = 16)]
    pub block_size: u32,

    /// Largest accepted frame in bytes.
    #[arg(long, default_value_t = kvix_wire::DEFAULT_MAX_FRAME)]
    pub max_frame: u32,

    /// Requests one connection may have in flight before the server stops reading it.
    #[arg(long, default_value_t = 256)]
    pub max_inflight: usize,

    /// Connections one executor serves; one more is handed to the least loaded executor
    /// with room, and gets an Overloaded error and is closed only when every one is full.
    #[arg(long, default_value_t = 4096)]
    pub max_connections: usize,

    /// Bytes of replies a connection may have unsent before the server stops reading it
    /// (at least --max-frame).
    #[arg(long, default_value_t = 4 << 20)]
    pub max_unsent: usize,

    /// A client that takes no reply bytes for this long while replies wait is
    /// disconnected (milliseconds).
    #[arg(long, default_value_t = 10_000)]
    pub stall_timeout_ms: u64,

    /// A connection must send its Hello within this many milliseconds.
    #[arg(long, default_value_t = 5_000)]
    pub handshake_timeout_ms: u64,

    /// A connection with nothing pending that sends nothing for this many seconds is
    /// closed (0 = never).
    #[arg(long, default_value_t = 600)]
    pub idle_timeout_s: u64,

    /// Shared token clients must present in Hello (also from KVIX_AUTH_TOKEN). A flag's
    /// value is visible to every local user in /proc: prefer --auth-token-file.
    #[arg(long, env = "KVIX_AUTH_TOKEN", hide_env_values = true)]
    pub auth_token: Option<String>,

    /// File holding the shared token (its first line; keep the file mode 0600).
    #[arg(long, conflicts_with = "auth_token")]
    pub auth_token_file: Option<PathBuf>,

    /// TLS on the TCP port: the server's certificate chain (PEM). With --tls-key; the
    /// Unix socket and the metrics port stay plain.
    #[arg(long, requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,

    /// The private key of --tls-cert (PEM; keep the file mode 0600).
    #[arg(long, requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,

    /// Require client certificates on the TCP port, signed by a CA of this PEM file.
    #[arg(long, requires = "tls_cert")]
    pub tls_client_ca: Option<PathBuf>,

    /// Permissions of the Unix socket file (octal): who may connect without a token.
    #[arg(long, default_value = "600", value_parser = parse_mode)]
    pub unix_mode: u32,

    /// Snapshot file: restored on start, written on shutdown and every --snapshot-every.
    #[arg(long)]
    pub snapshot: Option<PathBuf>,

    /// Write-ahead log beside the snapshot (SNAPSHOT.wal.N): every accepted write is
    /// appended before it is applied and replayed on start, so kill -9 loses nothing
    /// acknowledged. Needs --snapshot.
    #[arg(long, default_value_t = false)]
    pub wal: bool,

    /// How often the write-ahead log is flushed to disk, in milliseconds; 0 = before each
    /// write is acknowledged (a machine crash then loses nothing either, at the price of
    /// a disk flush per write).
    #[arg(long, default_value_t = 100)]
    pub wal_sync_ms: u64,

    /// What start does when the write-ahead log is damaged before its tail (a flipped
    /// byte, not a crash mid-write): `refuse` names the file and offset and stops;
    /// `truncate` accepts the loss, cuts the log there (keeping the damaged file as
    /// .damaged) and starts with the records before it.
    #[arg(long, value_enum, default_value_t = crate::durable::wal::Recover::Refuse)]
    pub wal_recover: crate::durable::wal::Recover,

    /// Replicas: every write goes through this Redis (or Valkey) Stream and every server
    /// naming it applies the stream in order, as identical copies (redis://HOST:PORT/KEY,
    /// or redis+sentinel://S1:P1,S2:P2/MASTER/KEY to follow the primary Sentinel names).
    #[arg(long)]
    pub log: Option<crate::durable::replica::LogUrl>,

    /// Replicas: the name of the fleet this replica belongs to. The first replica on a
    /// log key records it (with --block-size); a replica of another fleet, or with another
    /// block size, refuses to start on that key instead of merging into its index.
    #[arg(long, requires = "log", default_value = "")]
    pub fleet: String,

    /// Seconds between periodic snapshots (0 = only on shutdown).
    #[arg(long, default_value_t = 60)]
    pub snapshot_every: u64,

    /// Microseconds an idle executor spins before parking (lower wake-up latency, burns CPU).
    #[arg(long, default_value_t = 0)]
    pub spin_us: u64,

    /// Threads that read the engines' KV event publishers (each polls many of them).
    #[arg(long, default_value_t = 1)]
    pub ingest_threads: usize,

    /// Worker ids given at most (up to 2^20). Once every id was given, a new name takes
    /// the id retired longest ago; with none retired it is refused. Replicas sharing a
    /// --log number alike only with the same value.
    #[arg(long, default_value_t = kvix_engine::MAX_WORKERS)]
    pub max_workers: u32,

    /// Blocks gateways' placements may fill in per event-fed worker whose history is
    /// lost (its engine may hold blocks its events will not report) until the engine's
    /// clear makes it exact; 0: placements on event-fed workers are always passed over.
    #[arg(long, default_value_t = 65_536)]
    pub fill_in_blocks: u64,

    /// Seconds a filled-in block is kept after it was last placed (0: until cut by
    /// --fill-in-blocks).
    #[arg(long, default_value_t = 300)]
    pub fill_in_ttl: u64,

    /// Event sources (announces with a ZMQ endpoint) subscribed at most; further
    /// announces with a source are refused with TooManySources.
    #[arg(long, default_value_t = 1024)]
    pub max_sources: usize,

    /// Where engines connect their KV event publishers (tcp://*:5557, tcp://HOST:PORT or
    /// ipc://PATH), as vLLM and SGLang do when their endpoint names a host. The topic names
    /// the engine (--events-topic); the first message of one no worker has yet announces
    /// it. Not with --log.
    #[arg(long)]
    pub events_bind: Option<String>,

    /// Data-parallel ranks per engine on --events-bind: rank r connects to its port + r
    /// (an ipc path + "_dp<r>"), as the engines offset their endpoint; one socket each.
    #[arg(long, default_value_t = 1)]
    pub events_ranks: usize,

    /// The engines' topic: {host} names the worker (rank r > 0: "<host>/dp<r>"), {model}
    /// is the keyspace its token ids are rehashed into.
    #[arg(long, default_value = "kv@{host}@{model}")]
    pub events_topic: String,

    /// The engines' replay port (+ rank) at the topic's host; none by default (what an
    /// engine published before its worker was announced, or while the server was away,
    /// is then lost).
    #[arg(long)]
    pub events_replay_port: Option<u16>,

    /// The lanes engines on --events-bind are announced with, KIND[:PARAM]@TOKENS
    /// comma-separated, one per KV cache group (e.g.
    /// full_attention@16,sliding_window:4096@16); default one full-attention lane of
    /// --block-size tokens.
    #[arg(long)]
    pub events_lanes: Option<String>,

    /// Seconds an engine on --events-bind may have no connection before its worker is
    /// retired (what it held would be false hits).
    #[arg(long, default_value_t = 60)]
    pub events_grace: u64,

    /// A file declaring the engines to ingest, one per line (NAME ENDPOINT model=M
    /// [replay=EP] [salt=S] [lanes=KIND@TOKENS,...] [dp=N]): each is announced once the
    /// server has restored, and the file is read again at SIGHUP (new and changed ones
    /// announced, removed ones retired; a file that does not read changes nothing).
    #[arg(long)]
    pub engines: Option<PathBuf>,

    /// Distinct blocks the index may hold (each executor holds a copy, ~30 B a block):
    /// past it, event batches that store blocks are refused with Overloaded until
    /// removals make room (0 = no bound). Placements are bounded by their own capacity.
    #[arg(long, default_value_t = 64 << 20)]
    pub max_blocks: u64,

    /// Networks event sources may be in (comma-separated CIDRs, or "any"): the server
    /// connects to whatever endpoint an announce names, so by default only to loopback
    /// and private addresses. ipc:// sources are always local.
    #[arg(
        long,
        default_value = "127.0.0.0/8,::1/128,10.0.0.0/8,172.16.0.0/12,192.168.0.0/16,fc00::/7",
        value_delimiter = ','
    )]
    pub source_allow: Vec<String>,

    /// Connection steering across executors: ebpf, cbpf or none (plain SO_REUSEPORT).
    /// eBPF falls back to classic BPF, and that to none, when the kernel refuses it.
    #[arg(long, default_value = "ebpf")]
    pub steering: Steering,
}

#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum Steering {
    Ebpf,
    Cbpf,
    None,
}

fn parse_mode(s: &str) -> Result<u32, String> {
    u32::from_str_radix(s, 8)
        .ok()
        .filter(|m| *m <= 0o777)
        .ok_or_else(|| format!("{s:?} is not an octal file mode like 600 or 660"))
}

impl Config {
    /// Reads --auth-token-file into the token, once at start.
    pub fn load_auth_token_file(&mut self) -> Result<(), String> {
        let Some(path) = &self.auth_token_file else {
            return Ok(());
        };
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("--auth-token-file {}: {e}", path.display()))?;
        let token = text.lines().next().unwrap_or_default().trim().to_string();
        if token.is_empty() {
            return Err(format!("--auth-token-file {} is empty", path.display()));
        }
        self.auth_token = Some(token);
        Ok(())
    }

    /// Executors to start: `--cores`, or one per online CPU.
    pub fn executors(&self) -> usize {
        if self.cores > 0 {
            self.cores
        } else {
            online_cpus()
        }
    }

    pub fn spin(&self) -> Option<Duration> {
        (self.spin_us > 0).then(|| Duration::from_micros(self.spin_us))
    }

    /// Checks flag combinations clap cannot.
    pub fn validate(&self) -> Result<(), String> {
        if self.block_size == 0 {
            return Err("--block-size must be at least 1 token".into());
        }
        if self.executors() > 256 {
            return Err(format!(
                "--cores {} is more than the 256 executors supported",
                self.executors()
            ));
        }
        if (self.max_frame as usize) < 1024 {
            return Err("--max-frame must be at least 1024 bytes".into());
        }
        self.source_networks()?;
        if self.wal && self.log.is_some() {
            return Err(
                "--wal and --log are two logs: with --log the Redis stream is the log".into(),
            );
        }
        if self.wal && self.snapshot.is_none() {
            return Err("--wal keeps its files beside the snapshot: give --snapshot too".into());
        }
        if self.max_sources > MAX_SOURCES {
            return Err(format!(
                "--max-sources must be at most {MAX_SOURCES} (each holds three libzmq sockets, about four descriptors)"
            ));
        }
        if self.max_workers == 0 || self.max_workers > kvix_engine::MAX_WORKERS {
            return Err(format!(
                "--max-workers must be between 1 and {}",
                kvix_engine::MAX_WORKERS
            ));
        }
        if self.ingest_threads == 0 || self.ingest_threads > 64 {
            return Err("--ingest-threads must be between 1 and 64".into());
        }
        if self.max_inflight == 0 || self.max_connections == 0 {
            return Err("--max-inflight and --max-connections must be at least 1".into());
        }
        self.bind_spec()?;
        Ok(())
    }

    /// --events-bind and its flags, checked.
    pub fn bind_spec(&self) -> Result<Option<BindSpec>, String> {
        let Some(base) = &self.events_bind else {
            return Ok(None);
        };
        if self.log.is_some() {
            return Err("--events-bind is for one server: with --log, announce engines with their endpoint (each replica subscribes under its ingest lease)".into());
        }
        if !(base.starts_with("tcp://") || base.starts_with("ipc://")) {
            return Err(format!(
                "--events-bind {base:?}: expected tcp://HOST:PORT (tcp://*:5557) or ipc://PATH"
            ));
        }
        if self.events_ranks == 0 || self.events_ranks > 256 {
            return Err("--events-ranks must be between 1 and 256".into());
        }
        let lanes = match &self.events_lanes {
            Some(text) => parse_lanes(text).map_err(|e| format!("--events-lanes: {e}"))?,
            None => vec![kvix_wire::Lane::full(self.block_size)],
        };
        if lanes.len() > 16 {
            return Err("--events-lanes: at most 16 lanes".into());
        }
        if let Some(l) = lanes
            .iter()
            .find(|l| !l.block_tokens.is_multiple_of(self.block_size))
        {
            return Err(format!(
                "--events-lanes: a lane of {} tokens is not a multiple of --block-size {}",
                l.block_tokens, self.block_size
            ));
        }
        let endpoints = (0..self.events_ranks)
            .map(|r| rank_endpoint(base, r).map_err(|e| format!("--events-bind {e}")))
            .collect::<Result<_, _>>()?;
        Ok(Some(BindSpec {
            endpoints,
            topic: self.events_topic.parse()?,
            replay_port: self.events_replay_port,
            lanes,
            grace: Duration::from_secs(self.events_grace),
        }))
    }
}

/// Most event sources one server subscribes.
pub const MAX_SOURCES: usize = 65_536;

/// What an executor needs of the flags, resolved once at start: each part it runs
/// reads its own settings, not the whole command line.
#[derive(Debug, Clone)]
pub struct ExecutorSettings {
    pub conn: ConnLimits,
    pub index: IndexSettings,
    /// `--snapshot`: where checkpoints go.
    pub snapshot: Option<PathBuf>,
}

/// A client connection's limits and handshake (conn.rs, handler.rs, admit.rs).
#[derive(Debug, Clone)]
pub struct ConnLimits {
    /// Largest frame taken or sent.
    pub max_frame: u32,
    /// Requests read ahead of their replies.
    pub max_inflight: usize,
    /// Reply bytes queued for a client that does not read (at least one frame).
    pub max_unsent: u64,
    /// A client that takes no reply for this long is cut off.
    pub stall: Duration,
    /// Time to send Hello.
    pub handshake: Duration,
    /// A connection idle this long after Hello is closed (None: never).
    pub idle: Option<Duration>,
    /// Connections per executor.
    pub max_connections: usize,
    /// `--auth-token` (or its file's).
    pub auth_token: Option<String>,
    /// The tokens per block clients must hash with.
    pub block_size: u32,
}

/// The index's and its writes' settings (writer.rs, queries, snapshots).
#[derive(Debug, Clone, Copy)]
pub struct IndexSettings {
    /// Tokens per keyspace block.
    pub block_size: u32,
    /// Blocks the index holds at most (0: no bound).
    pub max_blocks: u64,
}

impl Config {
    /// The executors' settings (after [`Config::load_auth_token_file`]).
    pub fn executor_settings(&self) -> ExecutorSettings {
        ExecutorSettings {
            conn: ConnLimits {
                max_frame: self.max_frame,
                max_inflight: self.max_inflight,
                max_unsent: self.max_unsent.max(self.max_frame as usize) as u64,
                stall: Duration::from_millis(self.stall_timeout_ms.max(1)),
                handshake: Duration::from_millis(self.handshake_timeout_ms.max(1)),
                idle: (self.idle_timeout_s > 0).then(|| Duration::from_secs(self.idle_timeout_s)),
                max_connections: self.max_connections,
                auth_token: self.auth_token.clone(),
                block_size: self.block_size,
            },
            index: IndexSettings {
                block_size: self.block_size,
                max_blocks: self.max_blocks,
            },
            snapshot: self.snapshot.clone(),
        }
    }
}

impl Config {
    /// --source-allow as networks; None = any address.
    pub fn source_networks(&self) -> Result<Option<Vec<ipnet::IpNet>>, String> {
        if self.source_allow.iter().any(|s| s.trim() == "any") {
            return Ok(None);
        }
        self.source_allow
            .iter()
            .map(|s| {
                s.trim().parse().map_err(|_| {
                    format!("--source-allow: {s:?} is not a network like 10.0.0.0/8 (or \"any\")")
                })
            })
            .collect::<Result<_, _>>()
            .map(Some)
    }
}

pub fn online_cpus() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    fn validated(args: &[&str]) -> Result<(), String> {
        let args = std::iter::once("kvix-server").chain(args.iter().copied());
        Config::try_parse_from(args).unwrap().validate()
    }

    #[test]
    fn the_defaults_validate_and_absurd_counts_are_refused_with_the_flag_named() {
        assert_eq!(validated(&[]), Ok(()));
        assert_eq!(validated(&["--max-sources", "65536"]), Ok(()));
        let too_many = validated(&["--max-sources", "700000000"]).unwrap_err();
        assert!(too_many.starts_with("--max-sources"), "{too_many}");
        assert_eq!(validated(&["--max-workers", "1048576"]), Ok(()));
        for bad in ["0", "1048577"] {
            let e = validated(&["--max-workers", bad]).unwrap_err();
            assert!(e.starts_with("--max-workers"), "{e}");
        }
        let threads = validated(&["--ingest-threads", "0"]).unwrap_err();
        assert!(threads.starts_with("--ingest-threads"), "{threads}");
        assert_eq!(
            validated(&["--events-bind", "tcp://*:5557", "--events-ranks", "4"]),
            Ok(())
        );
        for (flags, named) in [
            (&["--events-bind", "udp://x:1"][..], "--events-bind"),
            (
                &["--events-bind", "tcp://*:65535", "--events-ranks", "2"],
                "--events-bind",
            ),
            (
                &[
                    "--events-bind",
                    "tcp://*:5557",
                    "--events-topic",
                    "kv@{host}",
                ],
                "--events-topic",
            ),
            (
                &[
                    "--events-bind",
                    "tcp://*:5557",
                    "--events-lanes",
                    "full_attention@24",
                ],
                "--events-lanes",
            ),
            (
                &["--events-bind", "tcp://*:5557", "--events-lanes", "warp@16"],
                "--events-lanes",
            ),
            (
                &[
                    "--events-bind",
                    "tcp://*:5557",
                    "--log",
                    "redis://127.0.0.1/kv",
                ],
                "--events-bind",
            ),
        ] {
            let e = validated(flags).unwrap_err();
            assert!(e.starts_with(named), "{flags:?}: {e}");
        }
    }
}
