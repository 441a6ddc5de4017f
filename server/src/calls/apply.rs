//! A home's update, applied by another executor's write queue (in the order the home
//! published its updates).

use std::rc::Rc;
use std::sync::Arc;

use futures::channel::oneshot;
use kvix_engine::Update;

use crate::executor::Executor;
use crate::mesh::{Call, LocalFuture};
use crate::writer::Job;

pub struct Apply(pub Arc<Update>);

impl Call for Apply {
    /// Sent once the update is applied on the callee.
    type Reply = ();

    fn run(self, on: &Rc<Executor>) -> LocalFuture<()> {
        let (ack, done) = oneshot::channel();
        on.enqueue(Job::Apply {
            update: self.0,
            ack,
        });
        Box::pin(async move {
            let _ = done.await;
        })
    }
}
