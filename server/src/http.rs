//! The metrics endpoint: `GET /metrics` (Prometheus text), the probes `GET /livez` (also
//! `/healthz`: fails only where a restart is the cure) and `GET /readyz` (fails while the
//! server should get no traffic: stopping, or a replica behind its log), and `GET
//! /reuse` (the reuse verdicts, JSON: [`crate::reuse::view`]), HTTP/1.1 with
//! `Connection: close`. Served by executor 0; it reads the executors' atomics only.
//! Bounded: 64 scrapes at once, 8 KiB requests, 5 s per scrape; 8 more connections are
//! kept for the probes alone, so slow scrapers never make a health check fail.

use std::cell::Cell;
use std::rc::Rc;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Duration;

use futures_lite::{AsyncReadExt, AsyncWriteExt};
use glommio::net::TcpListener;

use crate::metrics::{self, ExecutorMetrics};

const MAX_REQUEST: usize = 8 * 1024;
/// Scrapes served at once; more are closed at once (a scraper retries).
const MAX_CONNECTIONS: usize = 64;
/// Connections past [`MAX_CONNECTIONS`] that may still ask for a probe (anything else
/// gets 503 there).
const HEALTH_RESERVE: usize = 8;
/// A scrape must arrive and be taken within this long.
const TIMEOUT: Duration = Duration::from_secs(5);

pub async fn serve_metrics(
    listener: TcpListener,
    shards: Arc<[ExecutorMetrics]>,
    replica: Option<Arc<crate::durable::replica::Replica>>,
    ex: Rc<crate::executor::Executor>,
) {
    let open = Rc::new(Cell::new(0usize));
    loop {
        let mut stream = match listener.accept().await {
            Ok(s) => s,
            Err(e) => {
                // Out of descriptors, most likely: pause instead of spinning.
                let errors = &shards[0].accept_errors;
                if errors.fetch_add(1, Relaxed) < 4 {
                    tracing::warn!("metrics accept failed: {e}");
                }
                glommio::timer::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        if open.get() >= MAX_CONNECTIONS + HEALTH_RESERVE {
            drop(stream);
            continue;
        }
        let health_only = open.get() >= MAX_CONNECTIONS;
        open.set(open.get() + 1);
        let (shards, open, replica, ex) =
            (shards.clone(), open.clone(), replica.clone(), ex.clone());
        glommio::spawn_local(async move {
            let _ = glommio::timer::timeout(TIMEOUT, async {
                let mut req = Vec::with_capacity(512);
                let mut chunk = [0u8; 1024];
                while !req.windows(4).any(|w| w == b"\r\n\r\n") && req.len() < MAX_REQUEST {
                    match stream.read(&mut chunk).await {
                        Ok(0) | Err(_) => return Ok(()),
                        Ok(n) => req.extend_from_slice(&chunk[..n]),
                    }
                }
                let reuse = || {
                    let core = ex.core();
                    let name_of = |w| core.roster().get(w).map(|e| e.name.clone());
                    crate::reuse::view(&name_of).to_string()
                };
                let health = Health::of(replica.as_deref(), ex.stopping());
                let scrape = || metrics::render(&shards, replica.as_deref());
                let (status, body, kind) = respond(&req, health_only, &health, &scrape, &reuse);
                let head = format!(
                    "HTTP/1.1 {status}\r\nContent-Type: {kind}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                    body.len()
                );
                let _ = stream.write_all(head.as_bytes()).await;
                let _ = stream.write_all(body.as_bytes()).await;
                let _ = stream.close().await;
                Ok(())
            })
            .await;
            open.set(open.get() - 1);
        })
        .detach();
    }
}

/// What the probes say: why the server is not live (a restart is the cure), and why it
/// should get no traffic now.
#[derive(Default)]
struct Health {
    dead: Option<String>,
    unready: Option<String>,
}

impl Health {
    fn of(replica: Option<&crate::durable::replica::Replica>, stopping: bool) -> Health {
        let dead = replica.and_then(|r| r.broken());
        let unready = if stopping {
            Some("stopping".to_string())
        } else if let Some(why) = &dead {
            Some(why.clone())
        } else {
            replica.filter(|r| !r.caught_up.load(Relaxed)).map(|r| {
                if r.healing.load(Relaxed) {
                    "healing in place: reloading the snapshot the fleet stored (the log was trimmed past this replica)".to_string()
                } else {
                    "not caught up with the write log".to_string()
                }
            })
        };
        Health { dead, unready }
    }
}

fn respond(
    req: &[u8],
    health_only: bool,
    health: &Health,
    scrape: &dyn Fn() -> String,
    reuse: &dyn Fn() -> String,
) -> (&'static str, String, &'static str) {
    const TEXT: &str = "text/plain; version=0.0.4";
    let probe = |failing: &Option<String>| match failing {
        Some(why) => ("503 Service Unavailable", format!("{why}\n"), TEXT),
        None => ("200 OK", "ok\n".into(), TEXT),
    };
    let line = req.split(|&b| b == b'\r').next().unwrap_or_default();
    let mut parts = line.split(|&b| b == b' ');
    match (parts.next(), parts.next()) {
        (Some(b"GET"), Some(b"/livez" | b"/healthz")) => probe(&health.dead),
        (Some(b"GET"), Some(b"/readyz")) => probe(&health.unready),
        _ if health_only => (
            "503 Service Unavailable",
            "too many scrapes at once; /livez, /readyz and /healthz only\n".into(),
            TEXT,
        ),
        (Some(b"GET"), Some(b"/metrics")) => ("200 OK", scrape(), TEXT),
        (Some(b"GET"), Some(b"/reuse")) => ("200 OK", reuse(), "application/json"),
        (Some(b"GET"), _) => (
            "404 Not Found",
            "try /metrics, /livez, /readyz, /healthz or /reuse\n".into(),
            TEXT,
        ),
        _ => ("405 Method Not Allowed", "GET only\n".into(), TEXT),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routes() {
        let shards = vec![ExecutorMetrics::default()];
        let scrape = || metrics::render(&shards, None);
        let well = Health::default();
        let at = |req: &[u8], health: &Health, busy: bool| {
            respond(req, busy, health, &scrape, &String::new)
        };
        assert_eq!(
            at(b"GET /metrics HTTP/1.1\r\n\r\n", &well, false).0,
            "200 OK"
        );
        assert!(at(b"GET /metrics HTTP/1.1\r\n\r\n", &well, false)
            .1
            .contains("kvix_queries_total"));
        for probe in ["/livez", "/readyz", "/healthz"] {
            let req = format!("GET {probe} HTTP/1.1\r\n\r\n");
            assert_eq!(at(req.as_bytes(), &well, false).0, "200 OK");
            // Probes are served past the scrapes' limit.
            assert_eq!(at(req.as_bytes(), &well, true).0, "200 OK");
        }
        assert_eq!(
            at(b"GET /x HTTP/1.1\r\n\r\n", &well, false).0,
            "404 Not Found"
        );
        assert_eq!(
            at(b"POST /metrics HTTP/1.1\r\n\r\n", &well, false).0,
            "405 Method Not Allowed"
        );
        assert_eq!(at(b"", &well, false).0, "405 Method Not Allowed");
        assert_eq!(
            at(b"GET /metrics HTTP/1.1\r\n\r\n", &well, true).0,
            "503 Service Unavailable"
        );
    }

    #[test]
    fn a_healing_replica_is_live_and_not_ready_a_broken_one_neither() {
        let shards = vec![ExecutorMetrics::default()];
        let scrape = || metrics::render(&shards, None);
        let get = |path: &str, health: &Health| {
            let req = format!("GET {path} HTTP/1.1\r\n\r\n");
            respond(req.as_bytes(), false, health, &scrape, &String::new)
        };
        let healing = Health {
            dead: None,
            unready: Some("healing in place".into()),
        };
        assert_eq!(get("/livez", &healing).0, "200 OK");
        assert_eq!(get("/healthz", &healing).0, "200 OK");
        let (status, why, _) = get("/readyz", &healing);
        assert_eq!(
            (status, why.as_str()),
            ("503 Service Unavailable", "healing in place\n")
        );
        let broken = Health {
            dead: Some("unreadable".into()),
            unready: Some("unreadable".into()),
        };
        for probe in ["/livez", "/healthz", "/readyz"] {
            assert_eq!(get(probe, &broken).0, "503 Service Unavailable", "{probe}");
        }
    }
}
