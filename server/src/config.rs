//! Command-line flags. With none the server listens on loopback, one executor per core.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;

/// kvix-server: the shared prefix-cache index, one pinned executor per core.
///
/// Gateways ask it which worker holds the longest reusable prefix of a prompt;
/// workers' cache events and gateways' placements keep it current. With no flags it
/// listens on 127.0.0.1:7420 (and /tmp/kvix.sock), serves metrics on 127.0.0.1:7421,
/// uses every core and keeps no snapshot.
#[derive(Parser, Debug, Clone)]
#[command(name = "kvix-server", version)]
pub struct Config {
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
    /// online CPU.
    #[arg(long, default_value_t = 0)]
    pub cores: usize,

    /// Pin executor i to CPU i (mod the CPUs online).
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

    /// Connections one executor accepts; further ones get an Overloaded error and are closed.
    #[arg(long, default_value_t = 4096)]
    pub max_connections: usize,

    /// Bytes of replies a connection may have unsent before the server stops reading it.
    #[arg(long, default_value_t = 4 << 20)]
    pub max_unsent: usize,

    /// Shared token clients must present in Hello (also from KVIX_AUTH_TOKEN).
    #[arg(long, env = "KVIX_AUTH_TOKEN", hide_env_values = true)]
    pub auth_token: Option<String>,

    /// Snapshot file: restored on start, written on shutdown and every --snapshot-every.
    #[arg(long)]
    pub snapshot: Option<PathBuf>,

    /// Seconds between periodic snapshots (0 = only on shutdown).
    #[arg(long, default_value_t = 60)]
    pub snapshot_every: u64,

    /// Microseconds an idle executor spins before parking (lower wake-up latency, burns CPU).
    #[arg(long, default_value_t = 0)]
    pub spin_us: u64,

    /// Threads that read the engines' KV event publishers (each polls many of them).
    #[arg(long, default_value_t = 1)]
    pub ingest_threads: usize,

    /// Event sources (announces with a ZMQ endpoint) subscribed at most; further
    /// announces with a source are refused with TooManySources.
    #[arg(long, default_value_t = 1024)]
    pub max_sources: usize,

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

impl Config {
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
        if self.ingest_threads == 0 || self.ingest_threads > 64 {
            return Err("--ingest-threads must be between 1 and 64".into());
        }
        if self.max_inflight == 0 || self.max_connections == 0 {
            return Err("--max-inflight and --max-connections must be at least 1".into());
        }
        Ok(())
    }
}

pub fn online_cpus() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
}
