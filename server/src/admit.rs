//! Admission of new connections: which executor serves one, and what a full server or
//! a failed accept does.
//!
//! Steering (see [`crate::steering`]) hands a connection to the executor pinned to the
//! CPU that took its SYN, which on loopback is the client's own CPU: one client process
//! opening many connections from one thread lands them all on one executor. So
//! `--max-connections` is a per-executor share with spill-over: a connection that finds
//! its executor full is served by the least loaded peer with room, and a client is
//! refused `Overloaded` only when every executor is full. A slot is taken on the
//! serving executor's counter (compare-and-swap) before the connection moves, so two
//! executors spilling at once cannot overfill a peer.

use std::cell::Cell;
use std::net::IpAddr;
use std::rc::Rc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

use futures_lite::{AsyncRead, AsyncWrite};
use glommio::net::{AcceptedTcpStream, AcceptedUnixStream, TcpStream, UnixStream};
use glommio::TaskQueueHandle;

use crate::executor::Executor;
use crate::metrics::{ExecutorMetrics, Rejected};

thread_local! {
    /// The task queue this executor serves connections in (set once it exists), for
    /// connections a peer hands over.
    static CONN_QUEUE: Cell<Option<TaskQueueHandle>> = const { Cell::new(None) };
}

/// Names the task queue connections run in on the calling executor.
pub fn set_conn_queue(queue: TaskQueueHandle) {
    CONN_QUEUE.with(|q| q.set(Some(queue)));
}

/// An accepted connection not yet bound to an executor: any executor may serve it.
pub trait Accepted: Send + 'static {
    type Stream: AsyncRead + AsyncWrite + Unpin + 'static;
    /// Whether the stream begins with the TLS handshake when the server has TLS.
    const TLS: bool;
    fn bind(self) -> Self::Stream;
    /// The client's address (for the Hello gate's per-address slow-down).
    fn peer(stream: &Self::Stream) -> Option<IpAddr>;
}

impl Accepted for AcceptedTcpStream {
    type Stream = TcpStream;
    const TLS: bool = true;
    fn bind(self) -> TcpStream {
        let s = self.bind_to_executor();
        let _ = s.set_nodelay(true);
        s
    }
    fn peer(stream: &TcpStream) -> Option<IpAddr> {
        stream.peer_addr().ok().map(|a| a.ip())
    }
}

impl Accepted for AcceptedUnixStream {
    type Stream = UnixStream;
    const TLS: bool = false;
    fn bind(self) -> UnixStream {
        self.bind_to_executor()
    }
    fn peer(_: &UnixStream) -> Option<IpAddr> {
        None
    }
}

/// Takes a connection slot on `m` unless it already holds `max`.
fn take_slot(m: &ExecutorMetrics, max: usize) -> bool {
    m.connections_open
        .fetch_update(Relaxed, Relaxed, |n| ((n as usize) < max).then_some(n + 1))
        .is_ok()
}

/// Takes a slot on the least loaded executor other than `me` that has room.
fn spill_target(all: &[ExecutorMetrics], me: usize, max: usize) -> Option<usize> {
    let mut peers: Vec<usize> = (0..all.len()).filter(|&p| p != me).collect();
    peers.sort_by_key(|&p| all[p].connections_open.load(Relaxed));
    peers.into_iter().find(|&p| take_slot(&all[p], max))
}

/// What a listener's connections speak.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Protocol {
    /// The kvix protocol (the `--listen` port, the Unix socket).
    Kvix,
    /// The HTTP API (`--http`).
    Http,
}

/// Serves a new connection here, on the least loaded peer with room when this executor
/// is full, or refuses it `Overloaded` when every executor is.
pub fn admit<A: Accepted>(
    ex: &Rc<Executor>,
    accepted: A,
    queue: TaskQueueHandle,
    protocol: Protocol,
) {
    let max = ex.settings().conn.max_connections;
    let all = ex.all_metrics();
    if take_slot(ex.metrics(), max) {
        start::<A>(ex, accepted.bind(), queue, protocol);
        return;
    }
    if let Some(peer) = spill_target(all, ex.me(), max) {
        ExecutorMetrics::add(&ex.metrics().spilled, 1);
        ex.mesh().spawn_on(peer, move |on| {
            let queue = CONN_QUEUE.with(Cell::get);
            match queue {
                Some(queue) => start::<A>(on, accepted.bind(), queue, protocol),
                // The peer serves nothing yet: give its slot back and refuse.
                None => {
                    on.metrics().connections_open.fetch_sub(1, Relaxed);
                    refuse(on, accepted.bind(), None);
                }
            }
        });
        return;
    }
    refuse(ex, accepted.bind(), Some(queue));
}

fn refuse<S>(ex: &Executor, stream: S, queue: Option<TaskQueueHandle>)
where
    S: AsyncWrite + Unpin + 'static,
{
    ex.metrics().reject(Rejected::Overloaded);
    let task = crate::conn::refuse_overloaded(stream);
    let spawned = match queue {
        Some(q) => glommio::spawn_local_into(task, q).ok(),
        None => Some(glommio::spawn_local(task)),
    };
    if let Some(t) = spawned {
        t.detach();
    }
}

/// Serves a connection whose slot on `ex` is taken; the slot is given back when it ends.
fn start<A: Accepted>(
    ex: &Rc<Executor>,
    stream: A::Stream,
    queue: TaskQueueHandle,
    protocol: Protocol,
) {
    ExecutorMetrics::add(&ex.metrics().connections_total, 1);
    let on = ex.clone();
    let peer = A::peer(&stream);
    let tls = ex.tls().filter(|_| A::TLS).cloned();
    let serve = async move {
        match tls {
            None => serve(stream, on.clone(), peer, protocol).await,
            Some(tls) => match handshake(&tls, stream).await {
                Ok(stream) => serve(stream, on.clone(), peer, protocol).await,
                Err(e) => tls_failed(&on, peer, &e),
            },
        }
        on.metrics().connections_open.fetch_sub(1, Relaxed);
    };
    match glommio::spawn_local_into(serve, queue) {
        Ok(t) => drop(t.detach()),
        Err(_) => drop(ex.metrics().connections_open.fetch_sub(1, Relaxed)),
    }
}

async fn serve<S>(stream: S, ex: Rc<Executor>, peer: Option<IpAddr>, protocol: Protocol)
where
    S: AsyncRead + AsyncWrite + Unpin + 'static,
{
    match protocol {
        Protocol::Kvix => crate::conn::serve(stream, ex, peer).await,
        Protocol::Http => crate::http_api::serve(stream, ex, peer).await,
    }
}

/// A TLS handshake has this long to finish (a client that connects and sends nothing
/// holds a slot no longer).
const TLS_HANDSHAKE: Duration = Duration::from_secs(10);

/// The server's side of a TLS handshake on `stream`, bounded by [`TLS_HANDSHAKE`].
async fn handshake<S: AsyncRead + AsyncWrite + Unpin>(
    tls: &futures_rustls::TlsAcceptor,
    stream: S,
) -> std::io::Result<futures_rustls::server::TlsStream<S>> {
    use futures::future::{select, Either};
    let accept = std::pin::pin!(tls.accept(stream));
    let late = std::pin::pin!(glommio::timer::sleep(TLS_HANDSHAKE));
    match select(accept, late).await {
        Either::Left((done, _)) => done,
        Either::Right(_) => Err(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            format!("no TLS handshake within {TLS_HANDSHAKE:?}"),
        )),
    }
}

/// A failed TLS handshake: counted, and logged at 1, 2, 4, ... failures with its cause
/// (a client speaking plain kvix to a TLS port fails here too).
fn tls_failed(ex: &Executor, peer: Option<IpAddr>, e: &std::io::Error) {
    if let Some(total) = crate::loud::count_loudly(&ex.metrics().tls_failures) {
        tracing::warn!(
            ?peer,
            "TLS handshake failed ({total} so far on this executor): {e}"
        );
    }
}

/// A failed accept (most often out of file descriptors): counted, logged at most once a
/// second, and followed by a pause so the loop never spins; connections closing (idle
/// and handshake timeouts) give the descriptors back.
pub async fn accept_failed(
    ex: &Executor,
    what: &str,
    e: glommio::GlommioError<()>,
    listener: Option<std::os::fd::RawFd>,
) {
    let m = ex.metrics();
    let n = m.accept_errors.fetch_add(1, Relaxed);
    if n.is_power_of_two() || n < 4 {
        tracing::warn!("{what} accept failed ({} so far): {e}", n + 1);
    }
    let out_of_fds = matches!(&e, glommio::GlommioError::IoError(io)
        if matches!(io.raw_os_error(), Some(libc::EMFILE) | Some(libc::ENFILE)));
    if let (true, Some(fd)) = (out_of_fds, listener) {
        if reserve::shed(fd) {
            ExecutorMetrics::add(&m.shed, 1);
        }
    }
    glommio::timer::sleep(Duration::from_millis(50)).await;
}

/// One descriptor held back for when the process runs out: given up for a moment to
/// accept the connection at the head of the queue and close it at once, so a full
/// process says no (the client sees the connection closed) instead of leaving clients
/// waiting in the queue.
pub mod reserve {
    use std::fs::File;
    use std::os::fd::RawFd;
    use std::sync::Mutex;

    static RESERVE: Mutex<Option<File>> = Mutex::new(None);

    pub fn hold() {
        let mut r = RESERVE.lock().unwrap_or_else(|p| p.into_inner());
        if r.is_none() {
            *r = File::open("/dev/null").ok();
        }
    }

    /// Accepts and closes one queued connection on `listener`; true if one was shed.
    pub fn shed(listener: RawFd) -> bool {
        let mut r = RESERVE.lock().unwrap_or_else(|p| p.into_inner());
        drop(r.take());
        // SAFETY: accept4 on our own listening socket; the new descriptor is closed here.
        let fd = unsafe {
            libc::accept4(
                listener,
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK,
            )
        };
        if fd >= 0 {
            // SAFETY: fd was just returned by accept4 and is owned by nobody else.
            unsafe { libc::close(fd) };
        }
        *r = File::open("/dev/null").ok();
        fd >= 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn executors(open: &[u64]) -> Vec<ExecutorMetrics> {
        open.iter()
            .map(|&n| {
                let m = ExecutorMetrics::default();
                m.connections_open.store(n, Relaxed);
                m
            })
            .collect()
    }

    #[test]
    fn spill_takes_a_slot_on_the_least_loaded_peer_with_room() {
        let all = executors(&[4, 3, 1, 4]);
        assert_eq!(spill_target(&all, 0, 4), Some(2));
        assert_eq!(all[2].connections_open.load(Relaxed), 2);
        assert_eq!(spill_target(&all, 0, 4), Some(2));
        assert_eq!(spill_target(&all, 0, 4), Some(1));
        assert_eq!(spill_target(&all, 0, 4), Some(2));
        assert_eq!(spill_target(&all, 0, 4), None, "every peer full");
        let open: Vec<u64> = all
            .iter()
            .map(|m| m.connections_open.load(Relaxed))
            .collect();
        assert_eq!(open, [4, 4, 4, 4], "no peer filled past the limit");
    }

    #[test]
    fn a_slot_is_taken_only_below_the_limit() {
        let all = executors(&[1]);
        assert!(take_slot(&all[0], 2));
        assert!(!take_slot(&all[0], 2));
        assert_eq!(all[0].connections_open.load(Relaxed), 2);
    }
}
