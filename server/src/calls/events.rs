//! An event batch, taken to its worker's home.

use std::rc::Rc;

use futures::channel::oneshot;
use kvix_wire::{AlignedVec, Applied};

use crate::executor::Executor;
use crate::failure::Failure;
use crate::mesh::{Call, LocalFuture};
use crate::writer::Job;

/// The `EventBatch` frame body (validated by the connection that read it).
pub struct Events {
    pub body: AlignedVec,
}

impl Call for Events {
    type Reply = Result<Applied, Failure>;

    fn run(self, on: &Rc<Executor>) -> LocalFuture<Self::Reply> {
        let (reply, rx) = oneshot::channel();
        on.enqueue(Job::Events {
            body: self.body,
            reply,
        });
        super::reply(rx)
    }
}
