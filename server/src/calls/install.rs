//! A (re-)registered worker, installed by its home: its feed starts afresh (what it held
//! is dropped when its roster or feed changed) and every executor's roster learns it.

use std::rc::Rc;

use futures::channel::oneshot;
use kvix_engine::{AnnounceOutcome, WorkerEntry};

use crate::executor::Executor;
use crate::mesh::{Call, LocalFuture};
use crate::writer::Job;

pub struct Install {
    pub entry: WorkerEntry,
    pub outcome: AnnounceOutcome,
}

impl Call for Install {
    /// Sent once every executor installed it.
    type Reply = ();

    fn run(self, on: &Rc<Executor>) -> LocalFuture<()> {
        let (reply, done) = oneshot::channel();
        on.enqueue(Job::Register {
            entry: self.entry,
            outcome: self.outcome,
            reply,
        });
        Box::pin(async move {
            let _ = done.await;
        })
    }
}
