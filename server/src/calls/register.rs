//! An announce, on executor 0: the registry validates the roster and numbers the name,
//! then the worker's home installs it (dropping what it held if its roster changed).

use std::rc::Rc;

use kvix_wire::{Announced, ErrorCode, EventSource, Feed, Lane};

use crate::calls::install::Install;
use crate::executor::Executor;
use crate::failure::Failure;
use crate::ingest::SourceError;
use crate::mesh::{Call, LocalFuture};
use crate::wal::Record;

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
        let refuse = |code, message: String| -> LocalFuture<Self::Reply> {
            Box::pin(std::future::ready(Err(Failure::new(code, message))))
        };
        if let Some(source) = &self.source {
            let known = on.registry().id_of(&self.name);
            if let Err(e) = on.ingest().check(source, self.feed, known) {
                let code = match e {
                    SourceError::TooMany { .. } => ErrorCode::TooManySources,
                    _ => ErrorCode::BadSource,
                };
                return refuse(code, format!("worker {:?}: {e}", self.name));
            }
        }
        // Where a source's host is a name, checking it asks the resolver: off the executor.
        let hosts = self.source.clone().map(|source| {
            let allow = on.ingest().allow.clone();
            glommio::executor()
                .spawn_blocking(move || crate::ingest::check_hosts(&source, allow.as_deref()))
        });
        let on = on.clone();
        Box::pin(async move {
            if let Some(hosts) = hosts {
                if let Err(e) = hosts.await {
                    return Err(Failure::new(
                        ErrorCode::BadSource,
                        format!("worker {:?}: {e}", self.name),
                    ));
                }
            }
            on.log(&Record::Announce {
                name: self.name.clone(),
                lanes: self.lanes.clone(),
                feed: self.feed,
                source: self.source.clone(),
            })
            .await?;
            let block = on.config().block_size;
            let registered = on
                .registry()
                .register(&self.name, &self.lanes, self.feed, block);
            let (entry, outcome) =
                registered.map_err(|e| Failure::new(ErrorCode::BadLane, e.to_string()))?;
            let worker = entry.id;
            let created = outcome != kvix_engine::AnnounceOutcome::Unchanged;
            on.on(on.home_of(worker), Install { entry, outcome })
                .await?;
            // Installed everywhere: the ingest may subscribe to its source now.
            on.ingest()
                .announced(worker, &self.name, self.source, created);
            Ok(Announced { worker, created })
        })
    }
}
