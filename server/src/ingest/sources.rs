//! What an event source may be: an endpoint libzmq connects to, on a host the operator
//! allowed (`--source-allow`).

use kvix_wire::EventSource;

use super::bound;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SourceError {
    #[error(
        "event source endpoint {0:?}: expected tcp://HOST:PORT or ipc://PATH (at most 107 bytes)"
    )]
    Endpoint(String),
    #[error("event source endpoint {0:?}: connect to the engine's address, not a wildcard (the engine binds tcp://*:PORT; name its host here)")]
    Wildcard(String),
    #[error("an event source needs the Events feed")]
    Feed,
    #[error("{max} event sources are subscribed already (--max-sources)")]
    TooMany { max: usize },
    #[error("event source endpoint {endpoint:?}: {addr} is outside --source-allow")]
    NotAllowed { endpoint: String, addr: String },
    #[error("event source endpoint {endpoint:?}: {why}")]
    Unresolved { endpoint: String, why: String },
    #[error("event source endpoint {0:?}: this server binds no --events-bind socket for that rank (bound://RANK/TOPIC)")]
    NotBound(String),
    #[error("a bound source may not take over {0:?}: that worker has another source, or none (retire it first)")]
    NameTaken(String),
}

/// Checks an endpoint the way libzmq will use it to connect, or a `bound://` one against
/// the ranks this server binds.
pub(super) fn check_endpoint(ep: &str, bound_ranks: usize) -> Result<(), SourceError> {
    if ep.starts_with(bound::SCHEME) {
        return match bound::parse_source_endpoint(ep) {
            Some((rank, topic)) if rank < bound_ranks && !topic.is_empty() => Ok(()),
            _ => Err(SourceError::NotBound(ep.to_string())),
        };
    }
    let bad = || SourceError::Endpoint(ep.to_string());
    if let Some(path) = ep.strip_prefix("ipc://") {
        // A Unix socket path holds at most 107 bytes (sun_path).
        return if path.is_empty() || path.len() > 107 {
            Err(bad())
        } else {
            Ok(())
        };
    }
    let rest = ep.strip_prefix("tcp://").ok_or_else(bad)?;
    let (host, port) = rest.rsplit_once(':').ok_or_else(bad)?;
    if host == "*" || host == "0.0.0.0" || host == "[::]" {
        return Err(SourceError::Wildcard(ep.to_string()));
    }
    match port.parse::<u16>() {
        Ok(p) if p > 0 && !host.is_empty() => Ok(()),
        _ => Err(bad()),
    }
}

/// Checks that every address a tcp endpoint names (or resolves to) is in `allow` (None:
/// any). Blocking: it may ask the resolver.
pub fn check_hosts(
    source: &EventSource,
    allow: Option<&[ipnet::IpNet]>,
) -> Result<(), SourceError> {
    use std::net::ToSocketAddrs;
    let Some(allow) = allow else { return Ok(()) };
    for ep in [&source.endpoint, &source.replay] {
        let Some(rest) = ep.strip_prefix("tcp://") else {
            continue;
        };
        let (host, port) = rest.rsplit_once(':').unwrap_or((rest, "0"));
        let host = host.trim_start_matches('[').trim_end_matches(']');
        let port: u16 = port.parse().unwrap_or(0);
        let addrs: Vec<std::net::IpAddr> = match host.parse() {
            Ok(ip) => vec![ip],
            Err(_) => (host, port)
                .to_socket_addrs()
                .map_err(|e| SourceError::Unresolved {
                    endpoint: ep.clone(),
                    why: e.to_string(),
                })?
                .map(|a| a.ip())
                .collect(),
        };
        if let Some(bad) = addrs
            .iter()
            .find(|ip| !allow.iter().any(|n| n.contains(*ip)))
        {
            return Err(SourceError::NotAllowed {
                endpoint: ep.clone(),
                addr: bad.to_string(),
            });
        }
    }
    Ok(())
}
