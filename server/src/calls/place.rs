//! A placement, taken to its worker's home.

use std::rc::Rc;

use futures::channel::oneshot;
use kvix_wire::AlignedVec;

use crate::executor::Executor;
use crate::failure::Failure;
use crate::mesh::{Call, LocalFuture};
use crate::writer::Job;

/// The `Placement` frame body (validated by the connection that read it).
pub struct Place {
    pub body: AlignedVec,
}

impl Call for Place {
    type Reply = Result<(), Failure>;

    fn run(self, on: &Rc<Executor>) -> LocalFuture<Self::Reply> {
        let (reply, rx) = oneshot::channel();
        on.enqueue(Job::Place {
            body: self.body,
            reply,
        });
        super::reply(rx)
    }
}
