//! An announce, on executor 0: the registry validates the roster and numbers the name,
//! then the worker's home installs it (dropping what it held if its roster changed).

use std::rc::Rc;

use kvix_wire::{Announced, ErrorCode, EventSource, Feed, Lane};

use crate::calls::install::Install;
use crate::executor::Executor;
use crate::failure::Failure;
use crate::mesh::{Call, LocalFuture};

pub struct Register {
    pub name: String,
    pub lanes: Vec<Lane>,
    pub feed: Feed,
    pub source: Option<EventSource>,
}

impl Call for Register {
    type Reply = Result<Announced, Failure>;

    fn run(self, on: &Rc<Executor>) -> LocalFuture<Self::Reply> {
        debug_assert_eq!(on.me(), 0, "executor 0 numbers workers");
        let block = on.config().block_size;
        let registered = on
            .registry()
            .register(&self.name, &self.lanes, self.feed, block);
        let (entry, outcome) = match registered {
            Ok(v) => v,
            Err(e) => {
                return Box::pin(std::future::ready(Err(Failure::new(
                    ErrorCode::BadLane,
                    e.to_string(),
                ))))
            }
        };
        let worker = entry.id;
        let created = outcome != kvix_engine::AnnounceOutcome::Unchanged;
        let ingest = crate::ingest::Announcement {
            worker,
            name: self.name,
            lanes: self.lanes,
            feed: self.feed,
            source: self.source,
            created,
        };
        let installed = on.on(on.home_of(worker), Install { entry, outcome });
        Box::pin(async move {
            installed.await?;
            // Installed everywhere: the ingest may subscribe to its source now.
            crate::ingest::announced(ingest);
            Ok(Announced { worker, created })
        })
    }
}
