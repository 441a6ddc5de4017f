//! `kvix-server check [FLAGS]`: what a start with these flags would need, checked
//! without serving: the flags themselves, the ports free, the open-files limit, the
//! snapshot readable and its directory writable, the fleet file, the replicas' Redis
//! reachable, the TLS files. One line per check; the process exits non-zero if any failed.

use std::net::ToSocketAddrs;

use crate::config::Config;
use crate::durable::{replica, snapshot};
use crate::error::StartError;
use crate::{ingest, listener, rlimit};

/// One check's outcome: what was checked, and what was found or why a start would fail.
pub struct Checked {
    pub what: String,
    pub result: Result<String, StartError>,
}

/// Every check for `config` (flags already parsed and validated).
pub fn run(config: &Config) -> Vec<Checked> {
    let mut out = Vec::new();
    let mut check =
        |what: String, result: Result<String, StartError>| out.push(Checked { what, result });
    check(
        format!("--listen {}", config.listen.tcp),
        port_free(&config.listen.tcp.to_string()),
    );
    if !config.listen.metrics.is_empty() {
        check(
            format!("--metrics {}", config.listen.metrics),
            port_free(&config.listen.metrics),
        );
    }
    if let Some(http) = config.listen.http {
        check(format!("--http {http}"), port_free(&http.to_string()));
    }
    if !config.listen.unix.is_empty() {
        check(
            format!("--unix {}", config.listen.unix),
            unix_free(&config.listen.unix),
        );
    }
    if let (Some(cert), Some(key)) = (&config.tls.cert, &config.tls.key) {
        let client_ca = config.tls.client_ca.as_deref();
        check(
            format!("--tls-cert {}", cert.display()),
            crate::tls::server_config(cert, key, client_ca)
                .map(|_| match client_ca {
                    Some(_) => "TLS on the TCP port, client certificates required".into(),
                    None => "TLS on the TCP port".into(),
                })
                .map_err(StartError::from),
        );
    }
    if let Some(bind) = config
        .ingest
        .events_bind
        .as_deref()
        .and_then(|b| b.strip_prefix("tcp://"))
    {
        let addr = bind.replacen('*', "0.0.0.0", 1);
        check(format!("--events-bind {bind}"), port_free(&addr));
    }
    let wanted = rlimit::wanted(
        config.executors(),
        config.conn.max_connections,
        config.ingest.max_sources,
    );
    check(
        "open files (ulimit -n)".into(),
        match rlimit::raise_open_files() {
            Ok((_, after)) if after >= wanted => Ok(format!("{after}, {wanted} wanted")),
            Ok((_, have)) => Err(StartError::OpenFiles { have, want: wanted }),
            Err(e) => Err(StartError::io("raising the open-files limit")(e)),
        },
    );
    if let Some(path) = &config.durability.snapshot {
        let loaded = snapshot::load(path, config.index.block_size);
        // The generations a start would replay: from the snapshot's on.
        let wal_from = loaded
            .as_ref()
            .ok()
            .and_then(Option::as_ref)
            .map_or(0, |i| i.wal_from);
        check(
            format!("--snapshot {}", path.display()),
            snapshot::check_writable(path)
                .map_err(StartError::from)
                .and_then(|()| match loaded {
                    Ok(Some(_)) => Ok("readable, its directory writable".into()),
                    Ok(None) => Ok("absent (a start begins empty), its directory writable".into()),
                    Err(e) => Err(e.into()),
                }),
        );
        if config.durability.wal {
            check(
                "--wal".into(),
                crate::durable::wal::Wal::inspect(path, wal_from).map_err(StartError::from),
            );
        }
    }
    if let Some(path) = &config.ingest.engines {
        check(
            format!("--engines {}", path.display()),
            std::fs::read_to_string(path)
                .map_err(|source| StartError::FleetFile {
                    path: path.clone(),
                    source,
                })
                .and_then(|text| {
                    ingest::engines_file::parse(
                        &path.display().to_string(),
                        &text,
                        config.index.block_size,
                    )
                    .map(|d| format!("{} workers declared", d.len()))
                    .map_err(StartError::from)
                }),
        );
    }
    if let Some(log) = &config.durability.log {
        check(
            format!("--log {}", log.server),
            replica::Link::open(&log.server)
                .and_then(|link| link.connect())
                .and_then(|mut c| redis::cmd("PING").query::<String>(&mut c))
                .map(|pong| format!("answers ({pong})"))
                .map_err(|source| StartError::Log {
                    server: log.server.to_string(),
                    source,
                }),
        );
    }
    out
}

/// Whether a TCP address can be bound now (nothing else serves it).
fn port_free(addr: &str) -> Result<String, StartError> {
    let shown = addr;
    let addr = addr
        .to_socket_addrs()
        .map_err(StartError::io(format!("resolving {shown}")))?
        .next()
        .ok_or_else(|| StartError::Unresolved(shown.to_string()))?;
    match listener::probe_bind(addr) {
        Ok(()) => Ok("free".into()),
        Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => Err(StartError::InUse),
        Err(e) => Err(StartError::io(format!("binding {addr}"))(e)),
    }
}

/// Whether a Unix socket path is free: absent, or a stale socket of a dead server.
fn unix_free(path: &str) -> Result<String, StartError> {
    match listener::stale_unix_socket(path) {
        Ok(false) => Ok("free".into()),
        Ok(true) => Ok("a stale socket (a start replaces it)".into()),
        Err(e) => Err(e),
    }
}
