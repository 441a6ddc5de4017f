//! Where the log's Redis is and how to reach it: one address, or Redis Sentinel, asked
//! for the current primary on every (re)connection, so the log follows a failover.

use std::fmt;
use std::sync::Mutex;

use redis::sentinel::Sentinel;

use super::IO_TIMEOUT;

/// The log's server as `--log` names it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LogServer {
    /// `redis://HOST:PORT`: this server, always.
    Direct(String),
    /// `redis+sentinel://S1:P1,S2:P2/MASTER`: the primary those sentinels name MASTER.
    Sentinel {
        sentinels: Vec<String>,
        master: String,
    },
}

impl fmt::Display for LogServer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LogServer::Direct(url) => f.write_str(url),
            LogServer::Sentinel { sentinels, master } => {
                let hosts: Vec<&str> = sentinels
                    .iter()
                    .map(|s| s.trim_start_matches("redis://"))
                    .collect();
                write!(f, "redis+sentinel://{}/{master}", hosts.join(","))
            }
        }
    }
}

/// Connections to the log's current primary.
pub enum Link {
    Direct(redis::Client),
    Sentinel {
        sentinel: Mutex<Sentinel>,
        master: String,
    },
}

impl Link {
    pub fn open(server: &LogServer) -> redis::RedisResult<Link> {
        Ok(match server {
            LogServer::Direct(url) => Link::Direct(redis::Client::open(url.as_str())?),
            LogServer::Sentinel { sentinels, master } => Link::Sentinel {
                sentinel: Mutex::new(Sentinel::build(sentinels.clone())?),
                master: master.clone(),
            },
        })
    }

    /// A new connection to the primary (asked of the sentinels first), with every
    /// command bounded by [`IO_TIMEOUT`].
    pub fn connect(&self) -> redis::RedisResult<redis::Connection> {
        let client = match self {
            Link::Direct(client) => client.clone(),
            Link::Sentinel { sentinel, master } => {
                let mut s = sentinel.lock().map_err(|_| {
                    redis::RedisError::from((redis::ErrorKind::Client, "sentinel lock poisoned"))
                })?;
                s.master_for(master, None)?
            }
        };
        let c = client.get_connection_with_timeout(IO_TIMEOUT)?;
        c.set_read_timeout(Some(IO_TIMEOUT))?;
        c.set_write_timeout(Some(IO_TIMEOUT))?;
        Ok(c)
    }
}
