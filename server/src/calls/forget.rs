//! A retired worker, dropped by its home: everything it held goes, on every executor.

use std::rc::Rc;

use futures::channel::oneshot;
use kvix_wire::WorkerId;

use crate::executor::Executor;
use crate::failure::Failure;
use crate::mesh::{Call, LocalFuture};
use crate::writer::Job;

pub struct Forget {
    pub worker: WorkerId,
}

impl Call for Forget {
    type Reply = Result<(), Failure>;

    fn run(self, on: &Rc<Executor>) -> LocalFuture<Self::Reply> {
        let (reply, rx) = oneshot::channel();
        on.enqueue(Job::Retire {
            worker: self.worker,
            reply,
        });
        super::reply(rx)
    }
}
