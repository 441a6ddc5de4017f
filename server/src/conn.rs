//! One client connection: socket → frames ([`kvix_wire::FrameReader`]) → messages →
//! [`crate::handler`] → replies, written by a task of their own.
//!
//! Requests are handled in arrival order; a reply that waits (a write on its way to
//! every executor) becomes a task, so a connection pipelines. What one connection can
//! hold is bounded whatever the client does:
//! - at most `--max-inflight` requests pending (fire-and-forget ones included);
//! - at most `--max-unsent` bytes of replies not yet taken by the client: past it the
//!   server stops reading, and a client that takes nothing for `--stall-timeout-ms` is
//!   disconnected;
//! - a connection that sends no Hello within `--handshake-timeout-ms`, or nothing for
//!   `--idle-timeout-s` with nothing pending, is closed.
//!
//! When the connection ends, its slot and buffers are freed at once: pending replies
//! are dropped with the writer.

use std::cell::Cell;
use std::rc::Rc;
use std::time::{Duration, Instant};

use futures::channel::oneshot;
use futures::future::{select, Either};
use futures_lite::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use glommio::channels::local_channel::{self, LocalSender};
use glommio::sync::{Semaphore, StaticPermit};
use kvix_wire::{AlignedVec, ErrorCode, ErrorReply, FrameError, FrameReader, MAX_HELLO_FRAME};

use crate::executor::Executor;
use crate::handler::{error_frame, handle, Reply, ReplyTo, Session};
use crate::metrics::{ExecutorMetrics, Rejected};

/// A reply on its way to the socket, holding its share of the byte budget.
struct Outgoing {
    frame: AlignedVec,
    permit: StaticPermit,
    /// For a query's reply: the executor's write slices at the turn to its reactor before
    /// the one that read the query (what it waited behind is counted from there).
    query_read_at: Option<u64>,
}

/// Why a connection was closed by the server (for the log and the metrics).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Closed {
    Peer,
    Protocol,
    Handshake,
    Idle,
    Stalled,
}

/// Serves one connection until the peer closes it, breaks the protocol or a limit ends it.
pub async fn serve<S>(stream: S, ex: Rc<Executor>, peer: Option<std::net::IpAddr>)
where
    S: AsyncRead + AsyncWrite + Unpin + 'static,
{
    let limits = ex.settings().conn.clone();
    let (max_frame, max_inflight) = (limits.max_frame, limits.max_inflight);
    let (max_unsent, stall) = (limits.max_unsent, limits.stall);
    let (mut rd, mut wr) = futures::io::AsyncReadExt::split(stream);
    let budget = Rc::new(Semaphore::new(max_unsent));
    let (tx, rx) = local_channel::new_unbounded::<Outgoing>();
    let (writer_gone, mut gone) = oneshot::channel::<()>();
    // Set when the writer gave up (stalled client or broken socket): the reader stops at
    // the next frame, whatever the client keeps sending.
    let over = Rc::new(Cell::new(false));
    let writer = {
        let (budget, ex, over) = (budget.clone(), ex.clone(), over.clone());
        glommio::spawn_local(async move {
            while let Some(Outgoing {
                frame,
                permit,
                query_read_at,
            }) = rx.recv().await
            {
                let write = async { wr.write_all(&frame).await.map_err(Into::into) };
                match glommio::timer::timeout(stall, write).await {
                    Ok(()) => {
                        drop(permit);
                        if let Some(at) = query_read_at {
                            let m = ex.metrics();
                            let now = m.write_slices.load(std::sync::atomic::Ordering::Relaxed);
                            m.query_write_slices.observe(now - at);
                        }
                    }
                    Err(glommio::GlommioError::TimedOut(_)) => {
                        ExecutorMetrics::add(&ex.metrics().stalled, 1);
                        break;
                    }
                    Err(_) => break,
                }
            }
            // Wakes a reader waiting for budget, and tells it the connection is over.
            over.set(true);
            budget.close();
            let _ = writer_gone.send(());
            let _ = wr.close().await;
        })
    };
    let out = Out {
        tx: Rc::new(tx),
        budget,
        cap: max_unsent,
    };
    let inflight = Rc::new(Semaphore::new(max_inflight as u64));
    let mut session = Session {
        peer,
        ..Session::default()
    };
    // Until Hello, frames are small and the whole handshake has one deadline: a peer
    // that announces a large frame and sends it a byte at a time holds neither the
    // buffer that frame would need nor its connection slot for longer than that.
    let mut reader = FrameReader::new(max_frame.min(MAX_HELLO_FRAME));
    let handshake_by = Instant::now() + limits.handshake;
    let closed = 'conn: loop {
        // Handle every whole frame already buffered.
        loop {
            if over.get() {
                break 'conn Closed::Stalled;
            }
            let frame = match reader.next() {
                Ok(Some(f)) => f,
                Ok(None) => break,
                Err(e) => {
                    let id = reader.request_id().unwrap_or(0);
                    refuse(&ex, &out, id, &e).await;
                    break 'conn Closed::Protocol;
                }
            };
            let (id, len) = (frame.header.request_id, frame.len);
            let msg = match frame.message() {
                Ok(m) => m,
                Err(e) => {
                    refuse(&ex, &out, id, &e).await;
                    break 'conn Closed::Protocol;
                }
            };
            let query_read_at = matches!(
                msg,
                kvix_wire::MessageRef::Query(_) | kvix_wire::MessageRef::TieredQuery(_)
            )
            .then(crate::write::apply::slices_at_turn_before_last);
            let reply = handle(&ex, &mut session, &frame.header, msg, frame.body);
            reader.consume(len);
            if session.hello {
                reader.set_max_frame(max_frame);
            }
            let close = session.closing;
            match reply {
                Reply::Nothing => {}
                Reply::Now(bytes) => {
                    if !out.send_stamped(bytes, query_read_at).await {
                        break 'conn Closed::Stalled;
                    }
                }
                Reply::Later(fut) => {
                    if !pending(&inflight, &out, async move { Some(fut.await) }).await {
                        break 'conn Closed::Stalled;
                    }
                }
                Reply::Quiet(fut) => {
                    if !pending(&inflight, &out, fut).await {
                        break 'conn Closed::Stalled;
                    }
                }
            }
            if close {
                break 'conn Closed::Protocol;
            }
        }
        reader.shrink();
        let limit = if !session.hello {
            handshake_by.saturating_duration_since(Instant::now())
        } else {
            (limits.idle).unwrap_or(Duration::from_secs(u64::from(u32::MAX)))
        };
        let got = {
            let read = glommio::timer::timeout(limit, async {
                rd.read(reader.spare()).await.map_err(Into::into)
            });
            match select(Box::pin(read), &mut gone).await {
                Either::Left((r, _)) => Some(r),
                Either::Right(_) => None,
            }
        };
        match got {
            Some(Ok(0)) => break Closed::Peer,
            Some(Ok(n)) => reader.filled(n),
            Some(Err(glommio::GlommioError::TimedOut(_))) => {
                let pending = inflight.available() < max_inflight as u64;
                if pending {
                    continue;
                }
                break if session.hello {
                    Closed::Idle
                } else {
                    Closed::Handshake
                };
            }
            Some(Err(_)) => break Closed::Peer,
            None => break Closed::Stalled,
        }
    };
    match closed {
        Closed::Handshake => {
            ex.metrics().reject(Rejected::Handshake);
            refuse_with(&out, 0, ErrorCode::BadFrame, "no Hello in time").await;
        }
        Closed::Idle => ExecutorMetrics::add(&ex.metrics().idle_closed, 1),
        Closed::Peer | Closed::Protocol | Closed::Stalled => {}
    }
    tracing::debug!(?closed, "connection closed");
    drop(out);
    // The writer flushes what is queued (each write bounded by the stall timeout) and
    // ends when every sender is gone; replies still being computed find it gone.
    writer.await;
}

/// The sending side of a connection: replies go out within the byte budget.
#[derive(Clone)]
struct Out {
    tx: Rc<LocalSender<Outgoing>>,
    budget: Rc<Semaphore>,
    /// The whole budget: a reply larger than it takes all of it.
    cap: u64,
}

impl Out {
    /// Queues a reply once the budget has room for it; false when the connection is over.
    async fn send(&self, bytes: AlignedVec) -> bool {
        self.send_stamped(bytes, None).await
    }

    /// As `send`, for a query's reply, stamped with the write slices it is counted from.
    async fn send_stamped(&self, frame: AlignedVec, query_read_at: Option<u64>) -> bool {
        let cost = (frame.len() as u64).min(self.cap);
        let Ok(permit) = self.budget.clone().acquire_static_permit(cost).await else {
            return false;
        };
        let out = Outgoing {
            frame,
            permit,
            query_read_at,
        };
        self.tx.try_send(out).is_ok()
    }
}

/// Runs a reply that waits as a task holding one of the connection's in-flight permits
/// (taken here, in order, so a full connection stops reading); a quiet one (the client
/// asked for no reply) sends only a refusal. False when the connection is over.
async fn pending(
    inflight: &Rc<Semaphore>,
    out: &Out,
    fut: impl std::future::Future<Output = Option<AlignedVec>> + 'static,
) -> bool {
    let Ok(permit) = inflight.clone().acquire_static_permit(1).await else {
        return false;
    };
    let out = out.clone();
    glommio::spawn_local(async move {
        if let Some(bytes) = fut.await {
            out.send(bytes).await;
        }
        drop(permit);
    })
    .detach();
    true
}

/// Answers a frame that broke the protocol with an error frame before closing.
async fn refuse(ex: &Executor, out: &Out, id: u64, e: &FrameError) {
    ex.metrics().reject(Rejected::of(e));
    tracing::debug!("closing a connection: {e}");
    let code = match e {
        FrameError::UnsupportedVersion(_) | FrameError::KindTooNew { .. } => {
            ErrorCode::UnsupportedVersion
        }
        _ => ErrorCode::BadFrame,
    };
    refuse_with(out, id, code, &e.to_string()).await;
}

async fn refuse_with(out: &Out, id: u64, code: ErrorCode, message: &str) {
    let frame = error_frame(
        ReplyTo::unread(id),
        &ErrorReply {
            code,
            message: message.to_string(),
        },
    );
    out.send(frame).await;
}

/// Tells a connection over the limit why it is closed.
pub async fn refuse_overloaded<S: AsyncWrite + Unpin>(mut stream: S) {
    let msg = ErrorReply {
        code: ErrorCode::Overloaded,
        message: "too many connections on this executor".into(),
    };
    let _ = stream
        .write_all(&error_frame(ReplyTo::unread(0), &msg))
        .await;
    let _ = stream.close().await;
}
