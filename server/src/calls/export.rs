//! One executor's part of a snapshot, taken by its write queue (so no write of its
//! workers is half in it).

use std::rc::Rc;

use futures::channel::oneshot;

use crate::executor::Executor;
use crate::mesh::{Call, LocalFuture};
use crate::writer::{Job, Part};

pub struct Export;

impl Call for Export {
    type Reply = Part;

    fn run(self, on: &Rc<Executor>) -> LocalFuture<Part> {
        let (reply, rx) = oneshot::channel();
        on.enqueue(Job::Export { reply });
        Box::pin(async move { rx.await.unwrap_or_default() })
    }
}
