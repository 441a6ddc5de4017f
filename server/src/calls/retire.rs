//! A retire, on executor 0: the registry forgets the worker, then its home drops
//! everything it held, everywhere.

use std::rc::Rc;

use kvix_wire::WorkerId;

use crate::calls::forget::Forget;
use crate::executor::Executor;
use crate::failure::Failure;
use crate::mesh::{Call, LocalFuture};

pub struct Retire {
    pub worker: WorkerId,
}

impl Call for Retire {
    type Reply = Result<(), Failure>;

    fn run(self, on: &Rc<Executor>) -> LocalFuture<Self::Reply> {
        debug_assert_eq!(on.me(), 0, "executor 0 numbers workers");
        if let Err(e) = on.registry().retire(self.worker) {
            return Box::pin(std::future::ready(Err(e.into())));
        }
        on.ingest().retired(self.worker);
        let forgotten = on.on(
            on.home_of(self.worker),
            Forget {
                worker: self.worker,
            },
        );
        Box::pin(async move { forgotten.await? })
    }
}
