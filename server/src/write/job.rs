//! What a write queue runs ([`Queued`]), and how a queued write is answered once every
//! executor applied what it published ([`Written`], [`Tally`]).

use std::sync::Arc;

use futures::channel::oneshot;

use super::record::{Outcome, Write};
use crate::failure::Failure;
use crate::mesh::LocalFuture;

/// What an executor's write queue runs, each after every one queued before it. The two
/// kinds every write takes run inline in the queue's one task (no future allocated per
/// write: docs/benchmarks.md §11); the rare kinds are futures of their own.
pub enum Queued {
    /// A write of a worker homed here (`write::feed::home_write`), answered on `reply` once
    /// every executor applied it.
    Home {
        write: Write,
        reply: oneshot::Sender<Result<Outcome, Failure>>,
    },
    /// An update another executor published; `tally` counts it applied.
    Apply {
        update: Arc<kvix_engine::Update>,
        tally: Arc<Countdown>,
    },
    /// Anything else (install, forget, expire, export, flush), made when queued (an
    /// `async fn`'s future does nothing until polled).
    Other(LocalFuture<()>),
}

/// The peers that have yet to apply a published update; the last one answers.
pub struct Countdown {
    left: std::sync::atomic::AtomicUsize,
    done: std::sync::Mutex<Option<oneshot::Sender<()>>>,
}

impl Countdown {
    /// A tally of `peers`, and what answers once all of them applied.
    pub fn new(peers: usize) -> (Arc<Countdown>, Acks) {
        let (tx, rx) = oneshot::channel();
        let tally = Countdown {
            left: std::sync::atomic::AtomicUsize::new(peers),
            done: std::sync::Mutex::new(Some(tx)),
        };
        (Arc::new(tally), rx)
    }

    pub fn applied(&self) {
        if self.left.fetch_sub(1, std::sync::atomic::Ordering::AcqRel) == 1 {
            let done = self.done.lock().unwrap_or_else(|p| p.into_inner()).take();
            if let Some(tx) = done {
                let _ = tx.send(());
            }
        }
    }
}

/// Sends a queued write's `result` on `reply` now, or once `acks` resolve (beside the
/// queue: it does not wait for the other executors).
pub fn answer<R: 'static>(reply: oneshot::Sender<R>, Written { result, acks }: Written<R>) {
    match acks {
        None => drop(reply.send(result)),
        Some(acks) => {
            glommio::spawn_local(async move {
                let _ = acks.await;
                let _ = reply.send(result);
            })
            .detach();
        }
    }
}

/// Answered once every other executor applied a published update (a dropped sender: the
/// process is stopping, nothing to wait for).
pub type Acks = oneshot::Receiver<()>;

/// What a queued write gives back: its result, due once `acks` resolve.
pub struct Written<R> {
    pub result: R,
    pub acks: Option<Acks>,
}

impl<R> Written<R> {
    /// A result due now (nothing was published).
    pub fn now(result: R) -> Self {
        Written { result, acks: None }
    }
}

/// The failure a write sees when the process stopped under it.
pub fn stopping() -> Failure {
    Failure::Stopping
}
