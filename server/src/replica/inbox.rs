//! Each executor's end of the follower: records are queued on it in stream order and
//! applied through the same calls a client's write takes ([`crate::apply`]); the writer
//! of the record hears the outcome, and the follower is released after a barrier.

use std::rc::Rc;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::mpsc as std_mpsc;

use futures::channel::{mpsc, oneshot};
use futures::StreamExt;

use super::Waiter;
use crate::executor::Executor;
use crate::wal::Record;
use crate::writer::{Job, Part};

pub enum LogJob {
    Apply {
        record: Record,
        waiter: Option<Waiter>,
        barrier: Option<std_mpsc::Sender<()>>,
    },
    Export {
        reply: oneshot::Sender<Part>,
    },
}

pub async fn serve(ex: Rc<Executor>, mut rx: mpsc::Receiver<LogJob>) {
    while let Some(job) = rx.next().await {
        match job {
            LogJob::Apply {
                record,
                waiter,
                barrier,
            } => {
                // Queued on its executor now, in stream order; answered when applied.
                let done = crate::apply::record(&ex, record);
                let ex = ex.clone();
                glommio::spawn_local(async move {
                    let outcome = done.await;
                    if let Some(r) = ex.replica() {
                        r.metrics.applied.fetch_add(1, Relaxed);
                    }
                    if let Some(w) = waiter {
                        let _ = w.send(outcome);
                    }
                    if let Some(b) = barrier {
                        let _ = b.send(());
                    }
                })
                .detach();
            }
            LogJob::Export { reply } => ex.enqueue(Job::Export { reply }),
        }
    }
}
