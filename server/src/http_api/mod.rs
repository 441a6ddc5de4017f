//! The HTTP/JSON listener (`--http`): NVIDIA Dynamo's standalone KV indexer API
//! (`dynamo-kv-router` 1.6.1, the Mooncake RFC #1403 shape) over kvix's index, for the
//! gateways and routers that speak it. Its paths, bodies, units (tokens), status codes
//! and error shapes are Dynamo's (docs/operations.md, "HTTP API"); the differential test
//! in `bench/peer` runs both side by side.
//!
//! Every executor accepts on its own socket of the port and answers the queries it
//! reads from its own copy; registrations are announces (with the engine's ZMQ
//! endpoint as the worker's source) on the write route, through the log when there is
//! one. HTTP/1.1 with keep-alive; a body is read whole (bounded as Dynamo bounds it)
//! before it is parsed, a large one parsed aside ([`aside`]).

mod aside;
mod endpoint;
pub mod head;
pub mod instances;
pub mod json;
mod query_body;
mod routes;

use std::net::IpAddr;
use std::rc::Rc;
use std::time::Duration;

use futures_lite::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::executor::Executor;
use crate::metrics::{ExecutorMetrics, HTTP_CODES, HTTP_ROUTES};
use head::{Head, HeadError, Method};
pub use routes::Route;

/// A refused request's body up to this size is read and dropped (the connection is
/// kept); a larger one closes the connection.
const DRAIN: u64 = 64 << 10;
/// A body must arrive within this long once its head has.
const BODY_TIMEOUT: Duration = Duration::from_secs(30);
/// A kept-alive connection with nothing to read for this long (unless `--idle-timeout-s`
/// says otherwise) is closed.
const IDLE: Duration = Duration::from_secs(300);

/// One response.
pub struct Response {
    pub status: u16,
    content_type: Option<&'static str>,
    body: Vec<u8>,
    allow: Option<String>,
    /// The connection is closed after it (its request was not read whole).
    close: bool,
}

impl Response {
    pub fn json(status: u16, body: Vec<u8>) -> Self {
        Response {
            status,
            content_type: Some("application/json"),
            body,
            allow: None,
            close: false,
        }
    }

    /// A rejection in axum's words: plain text.
    pub fn text(status: u16, body: impl Into<String>) -> Self {
        Response {
            content_type: Some("text/plain; charset=utf-8"),
            ..Response::json(status, body.into().into_bytes())
        }
    }

    pub fn empty(status: u16) -> Self {
        Response {
            content_type: None,
            ..Response::json(status, Vec::new())
        }
    }

    fn closing(self) -> Self {
        Response {
            close: true,
            ..self
        }
    }

    /// The bytes on the wire; `head_only` for a HEAD request.
    fn bytes(&self, head_only: bool) -> Vec<u8> {
        let mut out = format!("HTTP/1.1 {} {}\r\n", self.status, reason(self.status));
        if let Some(t) = self.content_type {
            out += &format!("content-type: {t}\r\n");
        }
        if let Some(allow) = &self.allow {
            out += &format!("allow: {allow}\r\n");
        }
        if self.close {
            out += "connection: close\r\n";
        }
        out += &format!("content-length: {}\r\n\r\n", self.body.len());
        let mut bytes = out.into_bytes();
        if !head_only {
            bytes.extend_from_slice(&self.body);
        }
        bytes
    }
}

fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        201 => "Created",
        400 => "Bad Request",
        401 => "Unauthorized",
        403 => "Forbidden",
        404 => "Not Found",
        405 => "Method Not Allowed",
        409 => "Conflict",
        411 => "Length Required",
        413 => "Payload Too Large",
        415 => "Unsupported Media Type",
        422 => "Unprocessable Entity",
        429 => "Too Many Requests",
        431 => "Request Header Fields Too Large",
        501 => "Not Implemented",
        503 => "Service Unavailable",
        _ => "Internal Server Error",
    }
}

/// Serves one HTTP connection until the client closes it, breaks the protocol or idles.
pub async fn serve<S>(mut stream: S, ex: Rc<Executor>, _peer: Option<IpAddr>)
where
    S: AsyncRead + AsyncWrite + Unpin + 'static,
{
    let idle = ex.settings().conn.idle.unwrap_or(IDLE);
    let mut buf: Vec<u8> = Vec::with_capacity(4096);
    loop {
        let head = match read_head(&mut stream, &mut buf, idle).await {
            Ok(Some(h)) => h,
            Ok(None) => return,
            Err(e) => {
                let status = if e == HeadError::TooLarge { 431 } else { 400 };
                count(&ex, None, status);
                let refusal = Response::text(status, e.to_string()).closing();
                let _ = stream.write_all(&refusal.bytes(false)).await;
                return;
            }
        };
        buf.drain(..head.len);
        let route = Route::of(&head.path);
        let response = match checked(&ex, route, &head) {
            // A small body refused unread is read and dropped: the connection goes on.
            Err(refusal) if refusal.close || head.length.unwrap_or(0) > DRAIN => refusal.closing(),
            Err(refusal) => match read_body(&mut stream, &mut buf, &head).await {
                Err(()) => return,
                Ok(_) => refusal,
            },
            Ok(route) => match read_body(&mut stream, &mut buf, &head).await {
                Err(()) => return,
                Ok(body) => routes::handle(&ex, route, &head, body).await,
            },
        };
        count(&ex, route.map(|r| r.0), response.status);
        let close = response.close || !head.keep_alive;
        let bytes = response.bytes(head.method == Method::Head);
        if stream.write_all(&bytes).await.is_err() || close {
            let _ = stream.close().await;
            return;
        }
    }
}

fn count(ex: &Executor, route: Option<Route>, status: u16) {
    let m = ex.metrics();
    let r = route.map_or(HTTP_ROUTES.len() - 1, |r| r as usize);
    ExecutorMetrics::add(&m.http_requests[r], 1);
    if let Some(i) = HTTP_CODES.iter().position(|&c| c == status) {
        ExecutorMetrics::add(&m.http_responses[i], 1);
    }
}

/// The route a request may go to, or the refusal it gets before its body is read (one
/// that must close the connection says so).
fn checked(
    ex: &Executor,
    route: Option<(Route, &'static [Method])>,
    head: &Head,
) -> Result<Route, Response> {
    let Some((route, methods)) = route else {
        return Err(Response::empty(404));
    };
    if !methods.contains(&head.method) {
        let allow = methods
            .iter()
            .map(|m| format!("{m:?}").to_uppercase())
            .collect::<Vec<_>>()
            .join(",");
        return Err(Response {
            allow: Some(allow),
            ..Response::empty(405)
        });
    }
    if let Some(token) = &ex.settings().conn.auth_token {
        let given = head
            .authorization
            .as_deref()
            .and_then(|a| a.strip_prefix("Bearer "));
        if !given.is_some_and(|g| crate::auth::same_token(g.as_bytes(), token.as_bytes())) {
            let why = "missing or wrong bearer token (--auth-token)";
            return Err(Response::json(401, json::error(why)));
        }
    }
    if route.takes_json() && !head::is_json(head.content_type.as_deref()) {
        let why = "Expected request with `Content-Type: application/json`";
        return Err(Response::text(415, why));
    }
    match head.length {
        _ if head.chunked => Err(Response::text(
            411,
            "kvix's HTTP API reads bodies with a Content-Length, not chunked",
        )
        .closing()),
        None if route.takes_json() => {
            Err(Response::text(411, "a body needs a Content-Length").closing())
        }
        Some(n) if n > route.max_body() => Err(Response::text(
            413,
            "Failed to buffer the request body: length limit exceeded",
        )
        .closing()),
        _ => Ok(route),
    }
}

/// Reads a request head into `buf` (which may hold bytes already): None when the client
/// closed or idled before one began.
async fn read_head<S: AsyncRead + Unpin>(
    stream: &mut S,
    buf: &mut Vec<u8>,
    idle: Duration,
) -> Result<Option<Head>, HeadError> {
    loop {
        if let Some(h) = head::parse(buf)? {
            return Ok(Some(h));
        }
        match read_some(stream, buf, idle).await {
            Some(0) | None => return Ok(None),
            Some(_) => {}
        }
    }
}

/// Reads the request's body (its Content-Length bytes; none without one) after `buf`'s
/// head, answering `Expect: 100-continue` first. Err when the client went away or was
/// too slow.
async fn read_body<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    buf: &mut Vec<u8>,
    head: &Head,
) -> Result<Vec<u8>, ()> {
    let want = head.length.unwrap_or(0) as usize;
    if head.expects_continue && buf.len() < want {
        stream
            .write_all(b"HTTP/1.1 100 Continue\r\n\r\n")
            .await
            .map_err(drop)?;
    }
    let started = std::time::Instant::now();
    buf.reserve(want.saturating_sub(buf.len()));
    while buf.len() < want {
        let left = BODY_TIMEOUT.saturating_sub(started.elapsed());
        match read_some(stream, buf, left).await {
            Some(0) | None => return Err(()),
            Some(_) => {}
        }
    }
    Ok(buf.drain(..want).collect())
}

/// One read into `buf`: the bytes read (0: closed), None on an error or past `limit`.
async fn read_some<S: AsyncRead + Unpin>(
    stream: &mut S,
    buf: &mut Vec<u8>,
    limit: Duration,
) -> Option<usize> {
    let mut chunk = [0u8; 16 * 1024];
    let read = glommio::timer::timeout(limit, async {
        stream.read(&mut chunk).await.map_err(Into::into)
    });
    match read.await {
        Ok(n) => {
            buf.extend_from_slice(&chunk[..n]);
            Some(n)
        }
        Err(_) => None,
    }
}
