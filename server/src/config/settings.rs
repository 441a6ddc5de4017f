//! What an executor needs of the flags, resolved once at start: each part it runs reads
//! its own settings, not the whole command line.

use std::path::PathBuf;
use std::time::Duration;

use super::Config;

/// An executor's settings.
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

/// The index's and its writes' settings (write/, queries, snapshots).
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
        let c = &self.conn;
        ExecutorSettings {
            conn: ConnLimits {
                max_frame: c.max_frame,
                max_inflight: c.max_inflight,
                max_unsent: c.max_unsent.max(c.max_frame as usize) as u64,
                stall: Duration::from_millis(c.stall_timeout_ms.max(1)),
                handshake: Duration::from_millis(c.handshake_timeout_ms.max(1)),
                idle: (c.idle_timeout_s > 0).then(|| Duration::from_secs(c.idle_timeout_s)),
                max_connections: c.max_connections,
                auth_token: c.auth_token.clone(),
                block_size: self.index.block_size,
            },
            index: IndexSettings {
                block_size: self.index.block_size,
                max_blocks: self.index.max_blocks,
            },
            snapshot: self.durability.snapshot.clone(),
        }
    }
}
