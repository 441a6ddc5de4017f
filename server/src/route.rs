//! The one route every write takes, whoever sent it: a client's frame (the protocol
//! handler), the write-ahead log's replay, the replicated log's follower and the
//! engine-event ingest all hand a [`Write`] to [`route_write`]. With replicas
//! (`--log`), an accepted write goes to the shared log first and takes this route again
//! when the follower reads it back.
//!
//! Announces and retires go to executor 0, which numbers workers ([`announce`],
//! [`retire`]) and then has the worker's home install or forget it; every other write
//! goes to its worker's home (`worker % executors`), whose write queue orders it
//! ([`writer::home_write`]). The write is queued there, in the order this executor sent
//! it, before the returned future is first polled; the future answers once every
//! executor applied it.

use std::rc::Rc;
use std::sync::Arc;

use kvix_engine::EngineError;
use kvix_wire::{Announced, EventSource, Feed, WorkerId};

use crate::durable::replica::Replica;
use crate::durable::write::{Outcome, Write};
use crate::executor::Executor;
use crate::failure::Failure;
use crate::mesh::LocalFuture;
use crate::writer;

/// Where a write comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Origin {
    /// Accepted now: a client's frame or an engine delivery. With replicas it goes to the
    /// shared log, and is applied here when the follower reads it back.
    Accepted,
    /// Read back from a log (the write-ahead log's replay, the replicas' shared log): its
    /// event source was checked where it was accepted and is not checked again (a check
    /// that came out otherwise here, a resolver failing or another `--source-allow`,
    /// would refuse what the log's other readers registered and put every later worker
    /// id out of step).
    Logged,
}

/// Sends `write` on its way: to the replicas' shared log, or to the executor that
/// orders it. The future answers once this server applied it everywhere.
pub fn route_write(
    ex: &Rc<Executor>,
    write: Write,
    origin: Origin,
) -> LocalFuture<Result<Outcome, Failure>> {
    match (origin, ex.replica()) {
        (Origin::Accepted, Some(log)) => to_log(ex, log.clone(), write),
        _ => to_executor(ex, write, origin == Origin::Logged),
    }
}

/// Replicas: the write is appended to the shared log now, in the order the connection
/// sent it; an announce's source is checked first, before the log takes it (every
/// replica then registers what the log holds, and a client waits for an announce's
/// reply before writing for its worker).
fn to_log(
    ex: &Rc<Executor>,
    log: Arc<Replica>,
    write: Write,
) -> LocalFuture<Result<Outcome, Failure>> {
    let stopping = || Err(Failure::Stopping);
    if let Write::Announce {
        name,
        feed,
        source: Some(source),
        ..
    } = &write
    {
        // On executor 0, whose registry knows the name (a worker replacing its own
        // source is not one more).
        let (name, feed, source) = (name.clone(), *feed, source.clone());
        let check = ex.on(0, move |ex0| check_source(ex0, &name, feed, Some(&source)));
        return Box::pin(async move {
            check.await?;
            log.submit(&write).await.unwrap_or_else(|_| stopping())
        });
    }
    let applied = log.submit(&write);
    Box::pin(async move { applied.await.unwrap_or_else(|_| stopping()) })
}

/// The write, queued on the executor that orders it (announces and retires on executor 0,
/// the rest on the worker's home) before this returns.
fn to_executor(
    ex: &Rc<Executor>,
    mut write: Write,
    checked: bool,
) -> LocalFuture<Result<Outcome, Failure>> {
    match (write.home_worker(), &write) {
        (Ok(Some(worker)), _) => ex.on(ex.home_of(worker), move |home| home.queue_home(write)),
        (Ok(None), Write::Retire { worker }) => {
            let worker = *worker;
            ex.on(0, move |ex0| {
                let ex0 = ex0.clone();
                Box::pin(async move { retire(&ex0, worker).await.map(|()| Outcome::Done) })
            })
        }
        (Ok(None), _) => ex.on(0, move |ex0| {
            let ex0 = ex0.clone();
            Box::pin(async move {
                let announced = announce(&ex0, write, checked).await;
                announced.map(Outcome::Announced)
            })
        }),
        (Err(source), _) => {
            let f = Failure::Invalid {
                what: "a write that does not validate",
                source,
            };
            Box::pin(std::future::ready(Err(f)))
        }
    }
}

/// An announce, on executor 0: its source checked (unless `checked`), logged, the name
/// numbered by the registry, then the worker installed by its home everywhere.
async fn announce(ex0: &Rc<Executor>, write: Write, checked: bool) -> Result<Announced, Failure> {
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
    ex0.log(&write).await?;
    let block = ex0.settings().index.block_size;
    let registered = ex0.registry().register(name, lanes, *feed, block);
    let (entry, outcome) = registered.map_err(Failure::Roster)?;
    let worker = entry.id;
    let created = outcome != kvix_engine::AnnounceOutcome::Unchanged;
    ex0.queue_on(ex0.home_of(worker), move |home| {
        writer::install(home, entry, outcome)
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
async fn retire(ex0: &Rc<Executor>, worker: WorkerId) -> Result<(), Failure> {
    debug_assert_eq!(ex0.me(), 0, "executor 0 numbers workers");
    if !ex0.registry().is_active(worker) {
        return Err(EngineError::UnknownWorker(worker).into());
    }
    ex0.log(&Write::Retire { worker }).await?;
    ex0.registry().retire(worker)?;
    ex0.ingest().retired(worker);
    ex0.queue_on(ex0.home_of(worker), move |home| {
        writer::forget(home, worker)
    })
    .await
}

/// Checks an announce's event source, on executor 0: its form and the sources limit,
/// then (off the executor: it may ask the resolver) that its hosts are allowed.
fn check_source(
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
    if let Err(source) = ex.ingest().check(source, feed, known) {
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

/// How long a stream whose delivery was refused waits before it is started again from
/// the last batch applied: refusals come in runs (Redis full, away or failing over), and
/// each rewind asks the engine for a replay.
const REWIND_AFTER: std::time::Duration = std::time::Duration::from_secs(1);

/// Runs on every executor: routes the ingest's deliveries for workers homed here, at
/// most [`crate::ingest::IN_FLIGHT`] at a time (the ingest threads wait behind them).
/// A delivery refused on its way (the log unavailable) or out of step has its stream
/// rewound: the stream has moved past it, and only the engine's replay still has it.
pub async fn serve_deliveries(
    ex: Rc<Executor>,
    mut inbox: futures::channel::mpsc::Receiver<Write>,
) {
    use futures::StreamExt;
    let slots = Rc::new(glommio::sync::Semaphore::new(crate::ingest::IN_FLIGHT));
    while let Some(delivery) = inbox.next().await {
        let Ok(slot) = slots.acquire_static_permit(1).await else {
            return;
        };
        let worker = match &delivery {
            Write::Ingest { worker, .. } => *worker,
            Write::Announce { .. } | Write::Retire { .. } => {
                let change = EngineChange::of(&delivery);
                let applied = route_write(&ex, delivery, Origin::Accepted);
                glommio::spawn_local(async move {
                    let outcome = applied.await;
                    drop(slot);
                    change.report(outcome);
                })
                .detach();
                continue;
            }
            _ => continue,
        };
        let applied = route_write(&ex, delivery, Origin::Accepted);
        let ingest = ex.ingest().clone();
        glommio::spawn_local(async move {
            let refused = applied.await.err();
            drop(slot);
            if let Some(f) = refused {
                if ingest.rewind_due(worker) {
                    tracing::warn!(
                        worker,
                        "ingest: a delivery was not applied ({f}); the stream starts again \
                         from the last batch applied in {} s",
                        REWIND_AFTER.as_secs()
                    );
                    glommio::timer::sleep(REWIND_AFTER).await;
                    ingest.rewind(worker);
                }
            }
        })
        .detach();
    }
}

/// An announce or retire the ingest sends: an engine on --events-bind that connected
/// for the first time, or one gone past its grace period.
enum EngineChange {
    Announce { name: String, endpoint: String },
    Retire(WorkerId),
}

impl EngineChange {
    fn of(w: &Write) -> EngineChange {
        match w {
            Write::Retire { worker } => EngineChange::Retire(*worker),
            Write::Announce { name, source, .. } => EngineChange::Announce {
                name: name.clone(),
                endpoint: source
                    .as_ref()
                    .map(|s| s.endpoint.clone())
                    .unwrap_or_default(),
            },
            _ => unreachable!("the ingest sends announces, retires and deliveries"),
        }
    }

    /// Logs what became of it; a refused announce is counted.
    fn report(self, outcome: Result<Outcome, Failure>) {
        match (self, outcome) {
            (EngineChange::Announce { name, endpoint }, Ok(_)) => {
                tracing::info!(worker = %name, %endpoint, "ingest: engine announced");
            }
            (EngineChange::Announce { name, endpoint }, Err(f)) => {
                crate::ingest::METRICS
                    .discovery_refused
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                tracing::warn!(worker = %name, %endpoint, "ingest: announcing an engine that connected was refused: {f}");
            }
            (EngineChange::Retire(worker), Ok(_)) => {
                tracing::info!(worker, "ingest: gone engine retired");
            }
            (EngineChange::Retire(worker), Err(f)) => {
                tracing::warn!(worker, "ingest: retiring a gone engine was refused: {f}");
            }
        }
    }
}

/// Runs on every executor: applies what the replicas' log follower hands it, in stream
/// order; the replica's client waiting for a write hears its outcome, and the follower
/// is released from a barrier once the write is applied.
pub async fn serve_log(
    ex: Rc<Executor>,
    mut jobs: futures::channel::mpsc::Receiver<crate::durable::replica::LogJob>,
) {
    use crate::durable::replica::LogJob;
    use futures::StreamExt;
    while let Some(job) = jobs.next().await {
        match job {
            LogJob::Apply {
                write,
                waiter,
                barrier,
            } => {
                // Queued on its executor now, in stream order; answered when applied.
                let done = route_write(&ex, write, Origin::Logged);
                let ex = ex.clone();
                glommio::spawn_local(async move {
                    let outcome = done.await;
                    if let Some(r) = ex.replica() {
                        r.metrics
                            .applied
                            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    }
                    if let Some(w) = waiter {
                        let _ = w.send(outcome);
                    }
                    if let Some(b) = barrier {
                        let _ = b.send(());
                    }
                })
                .detach();
            }
            LogJob::Export { reply } => {
                let part = ex.queue(writer::export);
                glommio::spawn_local(async move {
                    if let Ok(p) = part.await {
                        let _ = reply.send(p);
                    }
                })
                .detach();
            }
        }
    }
}
