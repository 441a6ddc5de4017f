//! A retire, on executor 0: the registry forgets the worker, then its home drops
//! everything it held, everywhere.

use std::rc::Rc;

use kvix_wire::WorkerId;

use crate::calls::forget::Forget;
use crate::executor::Executor;
use crate::failure::Failure;
use crate::mesh::{Call, LocalFuture};
use crate::wal::Record;
use kvix_engine::EngineError;

pub struct Retire {
    pub worker: WorkerId,
}

impl Call for Retire {
    type Reply = Result<(), Failure>;

    fn run(self, on: &Rc<Executor>) -> LocalFuture<Self::Reply> {
        debug_assert_eq!(on.me(), 0, "executor 0 numbers workers");
        let on = on.clone();
        let worker = self.worker;
        Box::pin(async move {
            if !on.registry().is_active(worker) {
                return Err(EngineError::UnknownWorker(worker).into());
            }
            on.log(&Record::Retire { worker }).await?;
            on.registry().retire(worker)?;
            on.ingest().retired(worker);
            on.on(on.home_of(worker), Forget { worker }).await?
        })
    }
}
