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
            LogServer::Direct(url) => f.write_str(&redact(url)),
            LogServer::Sentinel { sentinels, master } => {
                let hosts: Vec<String> = sentinels
                    .iter()
                    .map(|s| redact(s).trim_start_matches("redis://").to_string())
                    .collect();
                write!(f, "redis+sentinel://{}/{master}", hosts.join(","))
            }
        }
    }
}

/// `url` without its password: what is shown goes to logs and error messages.
pub fn redact(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_string();
    };
    match rest.rsplit_once('@') {
        Some((login, host)) => {
            let user = login.split_once(':').map_or(login, |(user, _)| user);
            format!("{scheme}://{user}:***@{host}")
        }
        None => url.to_string(),
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

    /// A client of the primary: the one address, or asked of the sentinels now.
    fn client(&self) -> redis::RedisResult<redis::Client> {
        Ok(match self {
            Link::Direct(client) => client.clone(),
            Link::Sentinel { sentinel, master } => {
                let mut s = sentinel.lock().map_err(|_| {
                    redis::RedisError::from((redis::ErrorKind::Client, "sentinel lock poisoned"))
                })?;
                s.master_for(master, None)?
            }
        })
    }

    /// Where the primary is and how to log in to it (blocks while sentinels are asked).
    pub fn primary(&self) -> redis::RedisResult<redis::ConnectionInfo> {
        Ok(self.client()?.get_connection_info().clone())
    }

    /// A new connection to the primary (asked of the sentinels first), with every
    /// command bounded by [`IO_TIMEOUT`].
    pub fn connect(&self) -> redis::RedisResult<redis::Connection> {
        let c = self.client()?.get_connection_with_timeout(IO_TIMEOUT)?;
        c.set_read_timeout(Some(IO_TIMEOUT))?;
        c.set_write_timeout(Some(IO_TIMEOUT))?;
        Ok(c)
    }
}

#[cfg(test)]
mod tests {
    use super::LogServer;

    #[test]
    fn a_shown_log_server_hides_its_password() {
        let shown = |url: &str| LogServer::Direct(url.into()).to_string();
        assert_eq!(
            shown("redis://:s3cret@10.0.0.1:6379"),
            "redis://:***@10.0.0.1:6379"
        );
        assert_eq!(
            shown("redis://kvix:s3cret@h:6379"),
            "redis://kvix:***@h:6379"
        );
        assert_eq!(shown("redis://h:6379"), "redis://h:6379");
        let sentinels = LogServer::Sentinel {
            sentinels: vec!["redis://:pw@s1:26379".into(), "redis://s2:26379".into()],
            master: "m".into(),
        };
        assert_eq!(
            sentinels.to_string(),
            "redis+sentinel://:***@s1:26379,s2:26379/m"
        );
    }
}
