//! What the ingest and the replicas' log follower hand an executor, routed: engine
//! deliveries (a refused one rewinds its stream), engine announces and retires, log
//! records in stream order.

use std::rc::Rc;

use kvix_wire::WorkerId;

use super::queue::export;
use super::record::{Outcome, Write};
use super::route::{route_write, Origin};
use crate::executor::Executor;
use crate::failure::Failure;

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

/// How a replica healing in place replaces an executor's state with a snapshot's.
pub type RestoreInPlace = Rc<
    dyn Fn(
        &Rc<Executor>,
        &crate::durable::snapshot::ServerImage,
    ) -> Result<(), crate::durable::replica::RestoreError>,
>;

/// Runs on every executor: applies what the replicas' log follower hands it, in stream
/// order; the replica's client waiting for a write hears its outcome, and the follower
/// is released from a barrier once the write is applied. A heal drains what was handed
/// over, then restores the snapshot with `restore`.
pub async fn serve_log(
    ex: Rc<Executor>,
    mut jobs: futures::channel::mpsc::Receiver<crate::durable::replica::LogJob>,
    restore: RestoreInPlace,
) {
    use crate::durable::replica::LogJob;
    use futures::StreamExt;
    // Records handed over and not yet applied on every executor.
    let in_flight = Rc::new(std::cell::Cell::new(0usize));
    while let Some(job) = jobs.next().await {
        match job {
            LogJob::Apply {
                write,
                waiter,
                barrier,
            } => {
                // Queued on its executor now, in stream order; answered when applied.
                let done = route_write(&ex, write, Origin::Logged);
                let (ex, in_flight) = (ex.clone(), in_flight.clone());
                in_flight.set(in_flight.get() + 1);
                glommio::spawn_local(async move {
                    let outcome = done.await;
                    in_flight.set(in_flight.get() - 1);
                    if let Some(r) = ex.log().shared() {
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
                let part = ex.queue(export);
                glommio::spawn_local(async move {
                    if let Ok(p) = part.await {
                        let _ = reply.send(p);
                    }
                })
                .detach();
            }
            LogJob::Drain { done } => {
                let in_flight = in_flight.clone();
                glommio::spawn_local(async move {
                    while in_flight.get() > 0 {
                        glommio::timer::sleep(std::time::Duration::from_millis(1)).await;
                    }
                    let _ = done.send(());
                })
                .detach();
            }
            LogJob::Restore { image, done } => {
                // In the write queue: after what it runs now, before what comes next.
                let restore = restore.clone();
                let restored = ex.queue(move |ex| async move {
                    super::job::Written::now(Ok(restore(&ex, &image)))
                });
                glommio::spawn_local(async move {
                    let outcome = restored.await.unwrap_or_else(|f| Err(f.into()));
                    let _ = done.send(outcome);
                })
                .detach();
            }
        }
    }
}
