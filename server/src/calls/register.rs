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
    /// Applied from a log (the write-ahead log's replay, the replicas' shared log): its
    /// source was checked where the announce was accepted and is not checked again.
    /// A check that came out otherwise here (a resolver failing, another
    /// `--source-allow`) would refuse what the log's other readers registered and put
    /// every later worker id out of step.
    pub logged: bool,
}

/// Checks an announce's source where the announce is accepted: its form and the sources
/// limit, then (off the executor: it may ask the resolver) that its hosts are allowed.
pub fn check_source(
    on: &Rc<Executor>,
    name: &str,
    feed: Feed,
    source: Option<&EventSource>,
) -> LocalFuture<Result<(), Failure>> {
    let Some(source) = source else {
        return Box::pin(std::future::ready(Ok(())));
    };
    let known = on.registry().id_of(name);
    if let Err(e) = on.ingest().check(source, feed, known) {
        let code = match e {
            SourceError::TooMany { .. } => ErrorCode::TooManySources,
            _ => ErrorCode::BadSource,
        };
        let f = Failure::new(code, format!("worker {name:?}: {e}"));
        return Box::pin(std::future::ready(Err(f)));
    }
    let (source, allow, name) = (source.clone(), on.ingest().allow.clone(), name.to_string());
    let hosts = glommio::executor()
        .spawn_blocking(move || crate::ingest::check_hosts(&source, allow.as_deref()));
    Box::pin(async move {
        hosts
            .await
            .map_err(|e| Failure::new(ErrorCode::BadSource, format!("worker {name:?}: {e}")))
    })
}

impl Call for Register {
    type Reply = Result<Announced, Failure>;

    fn run(self, on: &Rc<Executor>) -> LocalFuture<Self::Reply> {
        debug_assert_eq!(on.me(), 0, "executor 0 numbers workers");
        let checked: LocalFuture<Result<(), Failure>> = if self.logged {
            Box::pin(std::future::ready(Ok(())))
        } else {
            check_source(on, &self.name, self.feed, self.source.as_ref())
        };
        let on = on.clone();
        Box::pin(async move {
            checked.await?;
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
