//! `--log`: where the log is, read from its URL (a password shown as `***`).

use super::link::{self, LogServer};

/// Where the log is: `redis://HOST:PORT/KEY`, or `redis+sentinel://S1:P1[,S2:P2...]/MASTER/KEY`
/// to follow the primary Redis Sentinel names MASTER.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogUrl {
    pub server: LogServer,
    pub key: String,
}

/// A `--log` that names no stream: the URL is shown with its password hidden.
#[derive(Debug, thiserror::Error)]
#[error("--log {shown:?}: {why} (expected redis://HOST:PORT/KEY or redis+sentinel://HOST:PORT[,HOST:PORT...]/MASTER/KEY)")]
pub struct BadLogUrl {
    shown: String,
    why: &'static str,
}

impl std::str::FromStr for LogUrl {
    type Err = BadLogUrl;

    fn from_str(s: &str) -> Result<Self, BadLogUrl> {
        let bad = |why| BadLogUrl {
            shown: link::redact(s),
            why,
        };
        if let Some(rest) = s.strip_prefix("redis://") {
            let (host, key) = rest
                .split_once('/')
                .filter(|(h, k)| !h.is_empty() && !k.is_empty())
                .ok_or_else(|| bad("a stream key must follow the address"))?;
            return Ok(LogUrl {
                server: LogServer::Direct(format!("redis://{host}")),
                key: key.to_string(),
            });
        }
        let rest = s
            .strip_prefix("redis+sentinel://")
            .ok_or_else(|| bad("unknown scheme"))?;
        let mut parts = rest.splitn(3, '/');
        let (hosts, master, key) = (parts.next(), parts.next(), parts.next());
        let (Some(hosts), Some(master), Some(key)) = (hosts, master, key) else {
            return Err(bad(
                "sentinels, the master's name and a stream key are needed",
            ));
        };
        let hosts: Vec<&str> = hosts.split(',').map(str::trim).collect();
        if hosts.iter().any(|h| h.is_empty()) || master.is_empty() || key.is_empty() {
            return Err(bad("empty sentinel address, master name or key"));
        }
        Ok(LogUrl {
            server: LogServer::Sentinel {
                sentinels: hosts.iter().map(|h| format!("redis://{h}")).collect(),
                master: master.to_string(),
            },
            key: key.to_string(),
        })
    }
}
