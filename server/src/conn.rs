//! One client connection: socket → frames ([`kvix_wire::FrameReader`]) → messages →
//! [`crate::handler`] → replies, written by a task of their own.
//!
//! Requests are handled in arrival order; a reply that waits (a write on its way to
//! every executor) becomes a task, so a connection pipelines. Backpressure: at most
//! `max_inflight` replies pending per connection, and reading stops while they are.

use std::rc::Rc;

use futures_lite::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use glommio::channels::local_channel;
use glommio::sync::Semaphore;
use kvix_wire::{AlignedVec, ErrorCode, ErrorReply, FrameError, FrameReader};

use crate::executor::Executor;
use crate::handler::{error_frame, handle, Reply, Session};
use crate::metrics::Rejected;

/// Serves one connection until the peer closes it or breaks the protocol.
pub async fn serve<S>(stream: S, ex: Rc<Executor>)
where
    S: AsyncRead + AsyncWrite + Unpin + 'static,
{
    let (mut rd, mut wr) = futures::io::AsyncReadExt::split(stream);
    let (max_frame, max_inflight) = (ex.config().max_frame, ex.config().max_inflight);
    let (tx, rx) = local_channel::new_bounded::<AlignedVec>(max_inflight);
    let writer = glommio::spawn_local(async move {
        while let Some(frame) = rx.recv().await {
            if wr.write_all(&frame).await.is_err() {
                break;
            }
        }
        let _ = wr.close().await;
    });
    let tx = Rc::new(tx);
    let inflight = Rc::new(Semaphore::new(max_inflight as u64));
    let mut session = Session::default();
    let mut reader = FrameReader::new(max_frame);
    'conn: loop {
        // Handle every whole frame already buffered.
        loop {
            let frame = match reader.next() {
                Ok(Some(f)) => f,
                Ok(None) => break,
                Err(e) => {
                    refuse(&ex, &tx, 0, &e).await;
                    break 'conn;
                }
            };
            let (id, len) = (frame.header.request_id, frame.len);
            let msg = match frame.message() {
                Ok(m) => m,
                Err(e) => {
                    refuse(&ex, &tx, id, &e).await;
                    break 'conn;
                }
            };
            let reply = handle(&ex, &mut session, &frame.header, msg, frame.body);
            reader.consume(len);
            let close = session.closing;
            match reply {
                Reply::Nothing => {}
                Reply::Now(bytes) => {
                    if tx.send(bytes).await.is_err() {
                        break 'conn;
                    }
                }
                Reply::Later(fut) => {
                    // The permit is taken here, in order, so backpressure stops reading.
                    let Ok(permit) = inflight.clone().acquire_static_permit(1).await else {
                        break 'conn;
                    };
                    let tx = tx.clone();
                    glommio::spawn_local(async move {
                        let bytes = fut.await;
                        let _ = tx.send(bytes).await;
                        drop(permit);
                    })
                    .detach();
                }
            }
            if close {
                break 'conn;
            }
        }
        reader.shrink();
        match rd.read(reader.spare()).await {
            Ok(0) | Err(_) => break,
            Ok(n) => reader.filled(n),
        }
    }
    drop(tx);
    // Pending replies still go out; the writer ends when every sender is gone.
    let _ = inflight.acquire(max_inflight as u64).await;
    writer.await;
}

/// Answers a frame that broke the protocol with an error frame before closing.
async fn refuse(
    ex: &Executor,
    tx: &local_channel::LocalSender<AlignedVec>,
    id: u64,
    e: &FrameError,
) {
    ex.metrics().reject(Rejected::of(e));
    tracing::debug!("closing a connection: {e}");
    let code = match e {
        FrameError::UnsupportedVersion(_) => ErrorCode::UnsupportedVersion,
        _ => ErrorCode::BadFrame,
    };
    let _ = tx
        .send(error_frame(
            id,
            &ErrorReply {
                code,
                message: e.to_string(),
            },
        ))
        .await;
}

/// Tells a connection over the limit why it is closed.
pub async fn refuse_overloaded<S: AsyncWrite + Unpin>(mut stream: S) {
    let msg = ErrorReply {
        code: ErrorCode::Overloaded,
        message: "too many connections on this executor".into(),
    };
    let _ = stream.write_all(&error_frame(0, &msg)).await;
    let _ = stream.close().await;
}
