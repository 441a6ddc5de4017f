//! Where each event-source worker homed on an executor left its stream (so the ingest
//! resumes there after a restore).

use std::rc::Rc;

use kvix_wire::WorkerId;

use crate::executor::Executor;
use crate::ingest::stream::Record;
use crate::mesh::{Call, LocalFuture};

pub struct Lasts;

impl Call for Lasts {
    type Reply = Vec<(WorkerId, Option<Record>)>;

    fn run(self, on: &Rc<Executor>) -> LocalFuture<Self::Reply> {
        let lasts = on.holders().lasts();
        Box::pin(std::future::ready(lasts))
    }
}
