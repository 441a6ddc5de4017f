//! The metrics endpoint: `GET /metrics` (Prometheus text), `GET /healthz` and `GET /reuse`
//! (the reuse verdicts, JSON: [`crate::reuse::view`]), HTTP/1.1
//! with `Connection: close`. Served by executor 0; it reads the executors' atomics only.
//! Bounded: 64 scrapes at once, 8 KiB requests, 5 s per scrape; 8 more connections are
//! kept for `/healthz` alone, so slow scrapers never make a health check fail.

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
/// Connections past [`MAX_CONNECTIONS`] that may still ask for `/healthz` (anything
/// else gets 503 there).
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
                let (status, body, kind) =
                    respond(&req, &shards, replica.as_deref(), health_only, &reuse);
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

fn respond(
    req: &[u8],
    shards: &[ExecutorMetrics],
    replica: Option<&crate::durable::replica::Replica>,
    health_only: bool,
    reuse: &dyn Fn() -> String,
) -> (&'static str, String, &'static str) {
    const TEXT: &str = "text/plain; version=0.0.4";
    let line = req.split(|&b| b == b'\r').next().unwrap_or_default();
    let mut parts = line.split(|&b| b == b' ');
    match (parts.next(), parts.next()) {
        (Some(b"GET"), Some(b"/healthz")) => match replica.and_then(|r| r.broken()) {
            Some(why) => ("503 Service Unavailable", format!("{why}\n"), TEXT),
            None => ("200 OK", "ok\n".into(), TEXT),
        },
        _ if health_only => (
            "503 Service Unavailable",
            "too many scrapes at once; /healthz only\n".into(),
            TEXT,
        ),
        (Some(b"GET"), Some(b"/metrics")) => ("200 OK", metrics::render(shards, replica), TEXT),
        (Some(b"GET"), Some(b"/reuse")) => ("200 OK", reuse(), "application/json"),
        (Some(b"GET"), _) => (
            "404 Not Found",
            "try /metrics, /healthz or /reuse\n".into(),
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
        assert_eq!(
            respond(
                b"GET /metrics HTTP/1.1\r\n\r\n",
                &shards,
                None,
                false,
                &String::new
            )
            .0,
            "200 OK"
        );
        assert!(respond(
            b"GET /metrics HTTP/1.1\r\n\r\n",
            &shards,
            None,
            false,
            &String::new
        )
        .1
        .contains("kvix_queries_total"));
        assert_eq!(
            respond(
                b"GET /healthz HTTP/1.1\r\n\r\n",
                &shards,
                None,
                false,
                &String::new
            )
            .0,
            "200 OK"
        );
        assert_eq!(
            respond(
                b"GET /x HTTP/1.1\r\n\r\n",
                &shards,
                None,
                false,
                &String::new
            )
            .0,
            "404 Not Found"
        );
        assert_eq!(
            respond(
                b"POST /metrics HTTP/1.1\r\n\r\n",
                &shards,
                None,
                false,
                &String::new
            )
            .0,
            "405 Method Not Allowed"
        );
        assert_eq!(
            respond(b"", &shards, None, false, &String::new).0,
            "405 Method Not Allowed"
        );
        let busy = |req: &[u8]| respond(req, &shards, None, true, &String::new).0;
        assert_eq!(busy(b"GET /healthz HTTP/1.1\r\n\r\n"), "200 OK");
        assert_eq!(
            busy(b"GET /metrics HTTP/1.1\r\n\r\n"),
            "503 Service Unavailable"
        );
    }
}
