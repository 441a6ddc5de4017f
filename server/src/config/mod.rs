//! The server's configuration: the flags, in typed sections ([`sections`]) that a
//! `--config` TOML file names alike ([`file`]), checked together ([`Config::validate`]),
//! and resolved once into what each part of an executor is given ([`settings`]). With no
//! flags the server listens on loopback, one executor per core.

use std::path::PathBuf;

use clap::Parser;

use crate::ingest::bound::{rank_endpoint, BindSpec};
use crate::ingest::engines_file::parse_lanes;

pub mod file;
pub mod sections;
pub mod settings;

pub use sections::{Connections, Durability, Executors, Index, Ingest, Listen, Tls};
pub use settings::{ConnLimits, ExecutorSettings, IndexSettings};

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

    #[command(flatten)]
    pub listen: Listen,

    #[command(flatten)]
    pub executors: Executors,

    #[command(flatten)]
    pub conn: Connections,

    #[command(flatten)]
    pub tls: Tls,

    #[command(flatten)]
    pub index: Index,

    #[command(flatten)]
    pub ingest: Ingest,

    #[command(flatten)]
    pub durability: Durability,
}

#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum Steering {
    Ebpf,
    Cbpf,
    None,
}

/// Why the flags cannot start a server: each names the flag (or the file) it is about.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// One flag's value (or a flag beside it) is wrong.
    #[error("--{flag}: {why}")]
    Flag { flag: &'static str, why: String },
    #[error("--auth-token-file {path}: {source}")]
    TokenFile {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("--auth-token-file {0} is empty")]
    EmptyTokenFile(PathBuf),
    /// The `--config` file, or one of its keys.
    #[error("--config {path}: {why}")]
    File { path: String, why: String },
}

fn flag(flag: &'static str, why: impl Into<String>) -> ConfigError {
    ConfigError::Flag {
        flag,
        why: why.into(),
    }
}

/// An octal file mode that is not one.
#[derive(Debug, thiserror::Error)]
#[error("{0:?} is not an octal file mode like 600 or 660")]
pub struct NotAMode(String);

fn parse_mode(s: &str) -> Result<u32, NotAMode> {
    u32::from_str_radix(s, 8)
        .ok()
        .filter(|m| *m <= 0o777)
        .ok_or_else(|| NotAMode(s.to_string()))
}

/// Most event sources one server subscribes.
pub const MAX_SOURCES: usize = 65_536;

impl Config {
    /// Reads --auth-token-file into the token, once at start.
    pub fn load_auth_token_file(&mut self) -> Result<(), ConfigError> {
        let Some(path) = &self.conn.auth_token_file else {
            return Ok(());
        };
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::TokenFile {
            path: path.clone(),
            source,
        })?;
        let token = text.lines().next().unwrap_or_default().trim().to_string();
        if token.is_empty() {
            return Err(ConfigError::EmptyTokenFile(path.clone()));
        }
        self.conn.auth_token = Some(token);
        Ok(())
    }

    /// Executors to start: `--cores`, or one per online CPU.
    pub fn executors(&self) -> usize {
        self.executors.count()
    }

    /// Checks each section, then the flags that involve two of them.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.executors.validate()?;
        self.conn.validate()?;
        self.index.validate()?;
        self.ingest.validate()?;
        let same_port = |other: &str| {
            other.parse::<std::net::SocketAddr>().ok().is_some_and(|o| {
                self.listen
                    .http
                    .is_some_and(|h| h.port() == o.port() && h.port() != 0)
            })
        };
        if same_port(&self.listen.tcp.to_string()) || same_port(&self.listen.metrics) {
            return Err(flag(
                "http",
                "must be a port of its own, not --listen's or --metrics'",
            ));
        }
        let d = &self.durability;
        if d.wal && d.log.is_some() {
            return Err(flag(
                "wal",
                "not with --log: with --log the Redis stream is the log",
            ));
        }
        if d.wal && d.snapshot.is_none() {
            return Err(flag(
                "wal",
                "it keeps its files beside the snapshot: give --snapshot too",
            ));
        }
        self.bind_spec()?;
        Ok(())
    }

    /// What a replica's log records as its fleet (`KEY:fleet`): replicas of one fleet
    /// share the name and the block size.
    pub fn fleet(&self) -> String {
        format!(
            "fleet {:?}, --block-size {}",
            self.durability.fleet, self.index.block_size
        )
    }

    /// --events-bind and its flags, checked.
    pub fn bind_spec(&self) -> Result<Option<BindSpec>, ConfigError> {
        let i = &self.ingest;
        let Some(base) = &i.events_bind else {
            return Ok(None);
        };
        if !(base.starts_with("tcp://") || base.starts_with("ipc://")) {
            return Err(flag(
                "events-bind",
                format!("{base:?}: expected tcp://HOST:PORT (tcp://*:5557) or ipc://PATH"),
            ));
        }
        if i.events_ranks == 0 || i.events_ranks > 256 {
            return Err(flag("events-ranks", "must be between 1 and 256"));
        }
        let block = self.index.block_size;
        let lanes = match &i.events_lanes {
            Some(text) => parse_lanes(text).map_err(|e| flag("events-lanes", e.to_string()))?,
            None => vec![kvix_wire::Lane::full(block)],
        };
        if lanes.len() > 16 {
            return Err(flag("events-lanes", "at most 16 lanes"));
        }
        if let Some(l) = lanes.iter().find(|l| !l.block_tokens.is_multiple_of(block)) {
            return Err(flag(
                "events-lanes",
                format!(
                    "a lane of {} tokens is not a multiple of --block-size {block}",
                    l.block_tokens
                ),
            ));
        }
        let endpoints = (0..i.events_ranks)
            .map(|r| rank_endpoint(base, r).map_err(|e| flag("events-bind", e.to_string())))
            .collect::<Result<_, _>>()?;
        Ok(Some(BindSpec {
            endpoints,
            topic: i
                .events_topic
                .parse()
                .map_err(|e: crate::ingest::bound::BadTopic| flag("events-topic", e.to_string()))?,
            replay_port: i.events_replay_port,
            lanes,
            grace: std::time::Duration::from_secs(i.events_grace),
            allow: i.source_networks()?,
        }))
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

    fn validated(args: &[&str]) -> Result<(), ConfigError> {
        let args = std::iter::once("kvix-server").chain(args.iter().copied());
        Config::try_parse_from(args).unwrap().validate()
    }

    #[test]
    fn the_defaults_validate_and_absurd_counts_are_refused_with_the_flag_named() {
        assert!(validated(&[]).is_ok());
        assert!(validated(&["--max-sources", "65536"]).is_ok());
        let too_many = validated(&["--max-sources", "700000000"])
            .unwrap_err()
            .to_string();
        assert!(too_many.starts_with("--max-sources"), "{too_many}");
        assert!(validated(&["--max-workers", "1048576"]).is_ok());
        for bad in ["0", "1048577"] {
            let e = validated(&["--max-workers", bad]).unwrap_err().to_string();
            assert!(e.starts_with("--max-workers"), "{e}");
        }
        let threads = validated(&["--ingest-threads", "0"])
            .unwrap_err()
            .to_string();
        assert!(threads.starts_with("--ingest-threads"), "{threads}");
        assert!(validated(&["--events-bind", "tcp://*:5557", "--events-ranks", "4"]).is_ok());
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
        ] {
            let e = validated(flags).unwrap_err().to_string();
            assert!(e.starts_with(named), "{flags:?}: {e}");
        }
    }
}
