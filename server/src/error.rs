//! Why the server did not start, stopped, or would not start (`kvix-server check` reports
//! the same errors a start would): each variant says what was being done and keeps its
//! cause. Errors of one request are [`crate::failure::Failure`] instead.

use std::net::SocketAddr;
use std::path::PathBuf;

use crate::config::ConfigError;
use crate::durable::snapshot::SnapshotError;
use crate::durable::wal::WalError;
use crate::ingest::engines_file::FleetError;
use crate::tls::TlsError;

#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("invalid flags: {0}")]
    Config(#[from] ConfigError),
    /// A system call on a socket or file, named by what it was for.
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "{addr} is already served by another process (is another kvix-server running?); \
         waited {waited_s} s for it to be released"
    )]
    Served { addr: SocketAddr, waited_s: u64 },
    #[error("in use by another process (is another kvix-server running?)")]
    InUse,
    #[error("{0} resolves to nothing")]
    Unresolved(String),
    #[error("{0} exists and is not a socket; refusing to replace it")]
    NotASocket(String),
    #[error("another server is listening on {0}")]
    UnixServed(String),
    #[error(transparent)]
    Tls(#[from] TlsError),
    #[error(transparent)]
    Snapshot(#[from] SnapshotError),
    #[error("the write-ahead log: {0}")]
    Wal(#[from] WalError),
    #[error(transparent)]
    Fleet(#[from] FleetError),
    #[error("--engines {path}: {source}")]
    FleetFile {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("--log {server}: {source}")]
    Log {
        server: String,
        source: redis::RedisError,
    },
    #[error(
        "--log {server}/{key}: the write log is empty (no generation) and no replica rebuilt \
         it within {waited_s} s (--log-empty-wait). A new fleet: start it with --log-new, or \
         run `kvix-server log reset` with this replica's flags. A log lost while every \
         replica was down, none with a --snapshot file of it: the fleet's state is gone; \
         reset, and the engines' and gateways' next writes refill it"
    )]
    LogEmpty {
        server: String,
        key: String,
        waited_s: u64,
    },
    #[error(
        "open files {have}: the configured connections and sources may need {want} (raise \
         the hard limit, or lower --max-connections / --max-sources)"
    )]
    OpenFiles { have: u64, want: u64 },
    /// An executor's task or the executor itself could not be started.
    #[error("starting {what}: {why}")]
    Spawn { what: &'static str, why: String },
    #[error("restoring the snapshot's workers: {0}")]
    RestoreWorkers(kvix_engine::RosterError),
    #[error("restoring the snapshot's index: {0}")]
    RestoreIndex(kvix_engine::EngineError),
    #[error("the snapshot's ingest state of worker {0} does not fit its roster")]
    IngestState(u32),
    #[error("snapshot {path} not written: {source}")]
    SnapshotWrite {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("snapshot not taken: {0}")]
    SnapshotTaken(#[from] crate::failure::Failure),
    #[error("snapshot not taken: the log follower did not cut the log within {0:?}")]
    Uncut(std::time::Duration),
    /// A replica that stopped following its write log and cannot heal in place exits:
    /// the orchestrator restarts it, and the start decides afresh.
    #[error("stopped following the write log: {0}")]
    LogStopped(String),
    #[error("executor {executor}: {source}")]
    Executor {
        executor: usize,
        source: Box<StartError>,
    },
    #[error("executor {executor} panicked: {why}")]
    Panicked { executor: usize, why: String },
    /// Another executor failed first (the reason it gave is reported instead).
    #[error("another executor failed")]
    PeerFailed,
}

impl StartError {
    /// An I/O error, said of `what`.
    pub fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> StartError {
        let what = what.into();
        move |source| StartError::Io { what, source }
    }

    /// A glommio task or executor that did not start.
    pub fn spawn<E: std::fmt::Display>(what: &'static str) -> impl FnOnce(E) -> StartError {
        move |e| StartError::Spawn {
            what,
            why: e.to_string(),
        }
    }

    /// Whether this is, or wraps, [`StartError::PeerFailed`].
    pub fn is_peer_failed(&self) -> bool {
        match self {
            StartError::PeerFailed => true,
            StartError::Executor { source, .. } => source.is_peer_failed(),
            _ => false,
        }
    }
}
