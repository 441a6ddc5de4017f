//! The flags, in sections: one struct per part of the server, flattened into [`Config`]
//! (`--help` shows them under their section's heading). A `--config` file names the same
//! flags ([`super::file`]).

use std::net::SocketAddr;
use std::path::PathBuf;

use clap::Args;

use super::{flag, online_cpus, parse_mode, ConfigError, Steering, MAX_SOURCES};

/// Where the server listens: the kvix protocol's TCP port and Unix socket, and the metrics endpoint.
#[derive(Args, Debug, Clone)]
#[command(next_help_heading = "Listening")]
pub struct Listen {
    /// TCP address for the kvix protocol.
    #[arg(
        id = "listen",
        long = "listen",
        default_value = "127.0.0.1:7420",
        env = "KVIX_LISTEN"
    )]
    pub tcp: SocketAddr,

    /// Unix socket path for the kvix protocol ("" to disable).
    #[arg(long, default_value = "/tmp/kvix.sock", env = "KVIX_UNIX")]
    pub unix: String,

    /// Permissions of the Unix socket file (octal): who may connect without a token.
    #[arg(long, default_value = "600", value_parser = parse_mode)]
    pub unix_mode: u32,

    /// HTTP address for Prometheus metrics ("" to disable).
    #[arg(long, default_value = "127.0.0.1:7421", env = "KVIX_METRICS")]
    pub metrics: String,

    /// TCP address for the HTTP API (Dynamo's standalone KV indexer API: /register,
    /// /query, ...); off unless given. TLS and --auth-token (as a bearer token) apply.
    #[arg(long, env = "KVIX_HTTP")]
    pub http: Option<SocketAddr>,
}

/// The executors: how many, where they run, and how connections are spread over them.
#[derive(Args, Debug, Clone)]
#[command(next_help_heading = "Executors")]
pub struct Executors {
    /// Executors, each with a whole copy of the index (memory grows with it); 0 = one per
    /// CPU the process may use.
    #[arg(long, default_value_t = 0)]
    pub cores: usize,

    /// Pin each executor to its own CPU among those the process may run on (cpuset,
    /// taskset).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub pin: bool,

    /// Microseconds an idle executor spins before parking (lower wake-up latency, burns CPU).
    #[arg(long, default_value_t = 0)]
    pub spin_us: u64,

    /// Connection steering across executors: ebpf, cbpf or none (plain SO_REUSEPORT).
    /// eBPF falls back to classic BPF, and that to none, when the kernel refuses it.
    #[arg(long, default_value = "ebpf")]
    pub steering: Steering,
}

/// What one client connection may hold and how long it may take, and who may connect.
#[derive(Args, Debug, Clone)]
#[command(next_help_heading = "Connections")]
pub struct Connections {
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
}

/// TLS on the TCP port.
#[derive(Args, Debug, Clone)]
#[command(next_help_heading = "TLS")]
pub struct Tls {
    /// TLS on the TCP port: the server's certificate chain (PEM). With --tls-key; the
    /// Unix socket and the metrics port stay plain.
    #[arg(
        id = "tls_cert",
        value_name = "PEM",
        long = "tls-cert",
        requires = "tls_key"
    )]
    pub cert: Option<PathBuf>,

    /// The private key of --tls-cert (PEM; keep the file mode 0600).
    #[arg(
        id = "tls_key",
        value_name = "PEM",
        long = "tls-key",
        requires = "tls_cert"
    )]
    pub key: Option<PathBuf>,

    /// Require client certificates on the TCP port, signed by a CA of this PEM file.
    #[arg(
        id = "tls_client_ca",
        value_name = "PEM",
        long = "tls-client-ca",
        requires = "tls_cert"
    )]
    pub client_ca: Option<PathBuf>,
}

/// The index: its keyspaces' block size and its bounds.
#[derive(Args, Debug, Clone)]
#[command(next_help_heading = "Index")]
pub struct Index {
    /// Token block size of every token keyspace; clients hashing with another are refused.
    #[arg(long, default_value_t = 16)]
    pub block_size: u32,

    /// Distinct blocks the index may hold (each executor holds a copy, ~30 B a block):
    /// past it, event batches that store blocks are refused with Overloaded until
    /// removals make room (0 = no bound). Placements are bounded by their own capacity.
    #[arg(long, default_value_t = 64 << 20)]
    pub max_blocks: u64,

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
}

/// The engines' KV events: the threads that read them, the sources allowed, engines that connect (--events-bind) or are declared in a file.
#[derive(Args, Debug, Clone)]
#[command(next_help_heading = "Ingest")]
pub struct Ingest {
    /// Threads that read the engines' KV event publishers (each polls many of them).
    #[arg(long, default_value_t = 1)]
    pub ingest_threads: usize,

    /// Event sources (announces with a ZMQ endpoint) subscribed at most; further
    /// announces with a source are refused with TooManySources.
    #[arg(long, default_value_t = 1024)]
    pub max_sources: usize,

    /// Networks event sources may be in (comma-separated CIDRs, or "any"): the server
    /// connects to whatever endpoint an announce names, so by default only to loopback
    /// and private addresses. ipc:// sources are always local. Engines on --events-bind
    /// must publish from them too.
    #[arg(
        long,
        default_value = "127.0.0.0/8,::1/128,10.0.0.0/8,172.16.0.0/12,192.168.0.0/16,fc00::/7",
        value_delimiter = ','
    )]
    pub source_allow: Vec<String>,

    /// Where engines connect their KV event publishers (tcp://*:5557, tcp://HOST:PORT or
    /// ipc://PATH), as vLLM and SGLang do when their endpoint names a host. The topic names
    /// the engine (--events-topic); the first message of one no worker has yet announces
    /// it. With --log every replica binds, and the one an engine connects to ingests it.
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
}

/// What outlives the process: snapshots, the write-ahead log, the replicas' shared log.
#[derive(Args, Debug, Clone)]
#[command(next_help_heading = "Durability")]
pub struct Durability {
    /// Snapshot file: restored on start, written on shutdown and every --snapshot-every.
    #[arg(long)]
    pub snapshot: Option<PathBuf>,

    /// Seconds between periodic snapshots (0 = only on shutdown).
    #[arg(long, default_value_t = 60)]
    pub snapshot_every: u64,

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
    /// A password goes in the URL (redis://:PASSWORD@HOST:PORT/KEY): give it through
    /// KVIX_LOG_URL, which /proc shows only to the server's own user.
    #[arg(long, env = "KVIX_LOG_URL", hide_env_values = true)]
    pub log: Option<crate::durable::replica::LogUrl>,

    /// Replicas: the name of the fleet this replica belongs to. The first replica on a
    /// log key records it (with --block-size); a replica of another fleet, or with another
    /// block size, refuses to start on that key instead of merging into its index.
    #[arg(long, requires = "log", default_value = "")]
    pub fleet: String,

    /// Replicas: a fleet's first start. Where the log's key is empty (no generation: a
    /// new key, or a log lost while no replica ran), begin a new, empty log at once.
    /// Without it such a replica waits up to --log-empty-wait for a replica holding the
    /// fleet's state (a running one, or one restarted with its --snapshot file) to
    /// rebuild the log, then exits non-zero; `kvix-server log reset` begins an empty log
    /// on the key instead.
    #[arg(long, requires = "log", default_value_t = false)]
    pub log_new: bool,

    /// Replicas: seconds a replica that finds the log's key empty waits for it to be
    /// rebuilt (see --log-new).
    #[arg(long, requires = "log", default_value_t = 60)]
    pub log_empty_wait: u64,
}

impl Executors {
    /// `--cores`, or one per CPU the process may use.
    pub fn count(&self) -> usize {
        if self.cores > 0 {
            self.cores
        } else {
            online_cpus()
        }
    }

    pub fn spin(&self) -> Option<std::time::Duration> {
        (self.spin_us > 0).then(|| std::time::Duration::from_micros(self.spin_us))
    }

    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        if self.count() > 256 {
            let why = format!("{} is more than the 256 executors supported", self.count());
            return Err(flag("cores", why));
        }
        Ok(())
    }
}

impl Connections {
    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        if self.max_frame < 1024 {
            return Err(flag("max-frame", "must be at least 1024 bytes"));
        }
        if self.max_inflight == 0 {
            return Err(flag("max-inflight", "must be at least 1"));
        }
        if self.max_connections == 0 {
            return Err(flag("max-connections", "must be at least 1"));
        }
        Ok(())
    }
}

impl Index {
    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        if self.block_size == 0 {
            return Err(flag("block-size", "must be at least 1 token"));
        }
        if self.max_workers == 0 || self.max_workers > kvix_engine::MAX_WORKERS {
            let why = format!("must be between 1 and {}", kvix_engine::MAX_WORKERS);
            return Err(flag("max-workers", why));
        }
        Ok(())
    }
}

impl Ingest {
    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        self.source_networks()?;
        if self.max_sources > MAX_SOURCES {
            let why = format!("must be at most {MAX_SOURCES} (each holds three libzmq sockets, about four descriptors)");
            return Err(flag("max-sources", why));
        }
        if self.ingest_threads == 0 || self.ingest_threads > 64 {
            return Err(flag("ingest-threads", "must be between 1 and 64"));
        }
        Ok(())
    }

    /// --source-allow as networks; None = any address.
    pub fn source_networks(&self) -> Result<Option<Vec<ipnet::IpNet>>, ConfigError> {
        if self.source_allow.iter().any(|s| s.trim() == "any") {
            return Ok(None);
        }
        self.source_allow
            .iter()
            .map(|s| {
                s.trim().parse().map_err(|_| {
                    flag(
                        "source-allow",
                        format!("{s:?} is not a network like 10.0.0.0/8 (or \"any\")"),
                    )
                })
            })
            .collect::<Result<_, _>>()
            .map(Some)
    }
}
