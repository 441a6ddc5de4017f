//! Announces and retires, on executor 0 (its registry numbers every worker), then the
//! worker's home installing or forgetting it on every executor's roster and index.

use std::rc::Rc;

use kvix_engine::{AnnounceOutcome, EngineError, Update, WorkerEntry};
use kvix_wire::{Announced, EventSource, Feed, WorkerId};

use super::apply::publish;
use super::job::Written;
use super::record::Write;
use crate::executor::Executor;
use crate::failure::Failure;
use crate::mesh::LocalFuture;

/// An announce, on executor 0: its source checked (unless `checked`), logged, the name
/// numbered by the registry, then the worker installed by its home everywhere.
pub(super) async fn announce(
    ex0: &Rc<Executor>,
    write: Write,
    checked: bool,
) -> Result<Announced, Failure> {
    debug_assert_eq!(ex0.me(), 0, "executor 0 numbers workers");
    let Write::Announce {
        name,
        lanes,
        feed,
        source,
    } = &write
    else {
        unreachable!("announce() is given announces");
    };
    if !checked {
        check_source(ex0, name, *feed, source.as_ref()).await?;
    }
    ex0.keep(&write).await?;
    let block = ex0.settings().index.block_size;
    let registered = ex0.registry().register(name, lanes, *feed, block);
    let (entry, outcome) = registered.map_err(Failure::Roster)?;
    let worker = entry.id;
    let created = outcome != kvix_engine::AnnounceOutcome::Unchanged;
    ex0.queue_on(ex0.home_of(worker), move |home| {
        install(home, entry, outcome)
    })
    .await?;
    // Installed everywhere: the ingest may subscribe to its source now.
    let Write::Announce { name, source, .. } = write else {
        unreachable!("announce() is given announces");
    };
    ex0.ingest().announced(worker, &name, source, created);
    Ok(Announced { worker, created })
}

/// A retire, on executor 0: the registry forgets the worker, then its home drops
/// everything it held, everywhere.
pub(super) async fn retire(ex0: &Rc<Executor>, worker: WorkerId) -> Result<(), Failure> {
    debug_assert_eq!(ex0.me(), 0, "executor 0 numbers workers");
    if !ex0.registry().is_active(worker) {
        return Err(EngineError::UnknownWorker(worker).into());
    }
    ex0.keep(&Write::Retire { worker }).await?;
    ex0.registry().retire(worker)?;
    ex0.ingest().retired(worker);
    crate::reuse::forget(worker);
    ex0.queue_on(ex0.home_of(worker), move |home| forget(home, worker))
        .await
}

/// A (re-)registered worker homed here: its feed starts afresh (what it held is dropped
/// when its roster or feed changed) and every executor's roster learns it.
pub async fn install(
    ex: Rc<Executor>,
    entry: WorkerEntry,
    outcome: AnnounceOutcome,
) -> Written<Result<(), Failure>> {
    let mut u = Update::new();
    if outcome != AnnounceOutcome::Unchanged {
        ex.ingest_states().forget(entry.id);
    }
    ex.core().register(entry, outcome, &mut u);
    Written {
        result: Ok(()),
        acks: publish(&ex, u).await,
    }
}

/// A retired worker homed here: everything it held goes, on every executor.
pub async fn forget(ex: Rc<Executor>, worker: WorkerId) -> Written<Result<(), Failure>> {
    let mut u = Update::new();
    ex.ingest_states().forget(worker);
    let retired = ex.core().retire(worker, &mut u);
    match retired {
        Ok(()) => Written {
            result: Ok(()),
            acks: publish(&ex, u).await,
        },
        Err(e) => Written::now(Err(e.into())),
    }
}

/// Checks an announce's event source, on executor 0: its form and the sources limit,
/// then (off the executor: it may ask the resolver) that its hosts are allowed.
pub(super) fn check_source(
    ex: &Rc<Executor>,
    name: &str,
    feed: Feed,
    source: Option<&EventSource>,
) -> LocalFuture<Result<(), Failure>> {
    let Some(source) = source else {
        return Box::pin(std::future::ready(Ok(())));
    };
    let known = {
        let registry = ex.registry();
        registry.id_of(name).filter(|&w| registry.is_active(w))
    };
    if let Err(source) = ex.ingest().admit_source(source, feed, known) {
        let worker = name.to_string();
        return Box::pin(std::future::ready(Err(Failure::Source { worker, source })));
    }
    let (source, allow, worker) = (source.clone(), ex.ingest().allow.clone(), name.to_string());
    let hosts = glommio::executor()
        .spawn_blocking(move || crate::ingest::check_hosts(&source, allow.as_deref()));
    Box::pin(async move {
        hosts
            .await
            .map_err(|source| Failure::Source { worker, source })
    })
}
