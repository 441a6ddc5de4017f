//! Waiting until the writes accepted so far are applied everywhere (a clean stop's last
//! snapshot then covers the whole log).
//!
//! [`Flush`] answers once an executor's write queue reached it: every job queued there
//! before it is done. [`Drain`], run on executor X, flushes every executor through X's
//! own channels, so it arrives behind every call X sent before. Run on every executor
//! once, it sees each accepted write through its home's queue (which then sent its
//! update to the others); run on every executor a second time, it sees those updates
//! applied.

use std::rc::Rc;

use futures::channel::oneshot;

use crate::executor::Executor;
use crate::mesh::{Call, LocalFuture};
use crate::writer::Job;

pub struct Flush;

impl Call for Flush {
    type Reply = ();

    fn run(self, on: &Rc<Executor>) -> LocalFuture<()> {
        let (reply, rx) = oneshot::channel();
        on.enqueue(Job::Flush { reply });
        Box::pin(async move {
            let _ = rx.await;
        })
    }
}

pub struct Drain;

impl Call for Drain {
    type Reply = ();

    fn run(self, on: &Rc<Executor>) -> LocalFuture<()> {
        let flushes: Vec<_> = (0..on.executors()).map(|e| on.on(e, Flush)).collect();
        Box::pin(async move {
            for f in flushes {
                let _ = f.await;
            }
        })
    }
}
