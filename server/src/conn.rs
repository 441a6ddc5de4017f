//! One client connection: socket → frames → messages → the shard's handlers → replies.
//!
//! Frames are read into an aligned buffer and handled in place, in arrival order; a
//! request whose answer needs other shards becomes a task, so a connection pipelines.
//! Backpressure: at most `max_inflight` replies pending per connection, and reading
//! stops while they are; bytes buffered per connection are bounded by `max_frame`.

use std::rc::Rc;

use futures_lite::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use glommio::channels::local_channel;
use glommio::sync::Semaphore;
use kvix_wire::{split_frame, AlignedVec, ErrorCode, ErrorReply, FrameError};

use crate::handler::{error_frame, Reply, Session};
use crate::metrics::Rejected;
use crate::shard::Shard;

const READ_CHUNK: usize = 64 * 1024;

/// Serves one connection until the peer closes it or breaks the protocol.
pub async fn serve<S>(stream: S, shard: Rc<Shard>)
where
    S: AsyncRead + AsyncWrite + Unpin + 'static,
{
    let (mut rd, mut wr) = futures::io::AsyncReadExt::split(stream);
    let limits = shard.limits();
    let (tx, rx) = local_channel::new_bounded::<AlignedVec>(limits.max_inflight);
    let writer = glommio::spawn_local(async move {
        while let Some(frame) = rx.recv().await {
            if wr.write_all(&frame).await.is_err() {
                break;
            }
        }
        let _ = wr.close().await;
    });
    let tx = Rc::new(tx);
    let inflight = Rc::new(Semaphore::new(limits.max_inflight as u64));
    let mut session = Session::default();
    let mut buf = AlignedVec::with_capacity(READ_CHUNK);
    let (mut start, mut end) = (0usize, 0usize);
    'conn: loop {
        // Handle every whole frame already buffered.
        loop {
            let frame = match split_frame(&buf[start..end], limits.max_frame) {
                Ok(Some(f)) => f,
                Ok(None) => break,
                Err(e) => {
                    refuse(&shard, &tx, 0, &e).await;
                    break 'conn;
                }
            };
            let id = frame.header.request_id;
            let msg = match frame.message() {
                Ok(m) => m,
                Err(e) => {
                    refuse(&shard, &tx, id, &e).await;
                    break 'conn;
                }
            };
            start += frame.len;
            let reply = shard.handle(&mut session, &frame.header, msg);
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
        // Make room: move the unread tail to the front (keeps 8-byte alignment: frames
        // are multiples of 8), or grow up to one max frame plus a read chunk.
        if start == end {
            (start, end) = (0, 0);
        } else if start > 0 && buf.len() - end < READ_CHUNK {
            buf.copy_within(start..end, 0);
            (start, end) = (0, end - start);
        }
        if buf.len() - end < READ_CHUNK {
            let want = (end + READ_CHUNK).min(limits.max_frame as usize + READ_CHUNK);
            if want <= buf.len() {
                break; // cannot happen: split_frame refuses frames over max_frame
            }
            buf.resize(want, 0);
        }
        match rd.read(&mut buf[end..]).await {
            Ok(0) | Err(_) => break,
            Ok(n) => end += n,
        }
    }
    drop(tx);
    // Pending replies still go out; the writer ends when every sender is gone.
    let _ = inflight.acquire(limits.max_inflight as u64).await;
    writer.await;
}

/// Answers a frame that broke the protocol with an error frame before closing.
async fn refuse(
    shard: &Shard,
    tx: &local_channel::LocalSender<AlignedVec>,
    id: u64,
    e: &FrameError,
) {
    shard.metrics().reject(Rejected::of(e));
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
pub async fn refuse_overloaded<S: AsyncWrite + Unpin>(mut stream: S, _shard: &Shard) {
    let msg = ErrorReply {
        code: ErrorCode::Overloaded,
        message: "too many connections on this executor".into(),
    };
    let _ = stream.write_all(&error_frame(0, &msg)).await;
    let _ = stream.close().await;
}
