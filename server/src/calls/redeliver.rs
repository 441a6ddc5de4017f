//! An ingest delivery read back from the write-ahead log, applied on its worker's home
//! like a live one; answers once every executor applied it.

use std::rc::Rc;

use futures::channel::oneshot;

use crate::executor::Executor;
use crate::ingest::IngestJob;
use crate::mesh::{Call, LocalFuture};
use crate::writer::Job;

pub struct Redeliver {
    pub job: IngestJob,
}

impl Call for Redeliver {
    type Reply = ();

    fn run(self, on: &Rc<Executor>) -> LocalFuture<()> {
        let (tx, rx) = oneshot::channel();
        on.enqueue(Job::Ingest {
            job: self.job,
            done: Box::new(move || {
                let _ = tx.send(());
            }),
        });
        Box::pin(async move {
            let _ = rx.await;
        })
    }
}
