//! An executor's write queue: one task, in the throughput task queue, that runs write
//! jobs one after another. Queries never wait in it: they run in the latency task queue
//! and read the index between the slices a long job is cut into.
//!
//! A job of a worker homed here is turned into an update by the engine's feed step;
//! [`publish`] then hands the update to every other executor (their queues apply it in
//! the order this one sends), applies it here in slices of [`SLICE_BLOCKS`] blocks, and
//! answers once every executor has applied it, so a client that read the reply sees its
//! write in its next query, wherever that lands.

use std::rc::Rc;
use std::sync::Arc;
use std::time::Instant;

use futures::channel::oneshot;
use glommio::channels::local_channel::LocalReceiver;
use kvix_engine::{AnnounceOutcome, Cursor, FeedImage, Ks, RunImage, Update, WorkerEntry};
use kvix_wire::{AlignedVec, Applied, ApplyStatus, EventBatch, Placement, WorkerId};

use crate::calls;
use crate::executor::Executor;
use crate::failure::Failure;
use crate::ingest::holders::HolderImage;
use crate::metrics::ExecutorMetrics;
use crate::wal::Record;

/// Blocks applied between two yields to the query task queue (about 50 µs of work).
pub const SLICE_BLOCKS: u64 = 512;

/// What this executor's write queue runs.
pub enum Job {
    /// An `EventBatch` frame body of a worker homed here.
    Events {
        body: AlignedVec,
        reply: oneshot::Sender<Result<Applied, Failure>>,
    },
    /// A `Placement` frame body of a worker homed here.
    Place {
        body: AlignedVec,
        reply: oneshot::Sender<Result<(), Failure>>,
    },
    /// A worker homed here was (re-)registered.
    Register {
        entry: WorkerEntry,
        outcome: AnnounceOutcome,
        reply: oneshot::Sender<()>,
    },
    /// A worker homed here was retired.
    Retire {
        worker: WorkerId,
        reply: oneshot::Sender<Result<(), Failure>>,
    },
    /// Expire the placements of the workers homed here.
    Expire,
    /// An update another executor's queue published.
    Apply {
        update: Arc<Update>,
        ack: oneshot::Sender<()>,
    },
    /// This executor's part of a snapshot.
    Export { reply: oneshot::Sender<Part> },
    /// Answers once every job queued before it is done.
    Flush { reply: oneshot::Sender<()> },
    /// Engine events the ingest read for a worker homed here; `slot` is held until every
    /// executor applied them.
    Ingest {
        job: crate::ingest::IngestJob,
        done: Box<dyn FnOnce()>,
    },
}

/// One executor's part of a snapshot: the feeds of its workers, and their runs (taken
/// from its own copy, where their writes are applied in order with their feeds).
#[derive(Debug, Default)]
pub struct Part {
    pub feeds: Vec<(WorkerId, FeedImage)>,
    pub runs: Vec<RunImage>,
    pub holders: Vec<(WorkerId, HolderImage)>,
}

/// Runs `ex`'s write jobs in order until the queue closes.
pub async fn run(ex: Rc<Executor>, jobs: LocalReceiver<Job>) {
    while let Some(job) = jobs.recv().await {
        tracing::debug!(executor = ex.me(), job = job_name(&job), "write job");
        match job {
            Job::Events { body, reply } => {
                let started = Instant::now();
                let logged = ex
                    .log(&Record::Events {
                        body: body.to_vec(),
                    })
                    .await;
                if let Err(f) = logged {
                    let _ = reply.send(Err(f));
                    continue;
                }
                let mut u = Update::new();
                match events(&ex, &body, &mut u) {
                    Ok(applied) => {
                        publish(&ex, u, move || {
                            let _ = reply.send(Ok(applied));
                        })
                        .await
                    }
                    Err(f) => drop(reply.send(Err(f))),
                }
                ex.metrics().applied(started.elapsed());
            }
            Job::Place { body, reply } => {
                let started = Instant::now();
                let logged = ex
                    .log(&Record::Place {
                        body: body.to_vec(),
                    })
                    .await;
                if let Err(f) = logged {
                    let _ = reply.send(Err(f));
                    continue;
                }
                let mut u = Update::new();
                match place(&ex, &body, &mut u).await {
                    Ok(()) => {
                        publish(&ex, u, move || {
                            let _ = reply.send(Ok(()));
                        })
                        .await
                    }
                    Err(f) => drop(reply.send(Err(f))),
                }
                ex.metrics().applied(started.elapsed());
            }
            Job::Register {
                entry,
                outcome,
                reply,
            } => {
                let mut u = Update::new();
                let worker = entry.id;
                if outcome != AnnounceOutcome::Unchanged {
                    ex.holders().forget(worker);
                }
                ex.core().register(entry, outcome, &mut u);
                publish(&ex, u, move || {
                    let _ = reply.send(());
                })
                .await;
            }
            Job::Retire { worker, reply } => {
                let mut u = Update::new();
                ex.holders().forget(worker);
                let retired = ex.core().retire(worker, &mut u);
                match retired {
                    Ok(()) => {
                        publish(&ex, u, move || {
                            let _ = reply.send(Ok(()));
                        })
                        .await
                    }
                    Err(e) => drop(reply.send(Err(e.into()))),
                }
            }
            Job::Expire => {
                let mut u = Update::new();
                let now = ex.now_ms();
                ex.core().expire(now, &mut u);
                publish(&ex, u, || {}).await;
            }
            Job::Apply { update, ack } => {
                apply(&ex, &update).await;
                let _ = ack.send(());
            }
            Job::Export { reply } => {
                let _ = reply.send(export(&ex).await);
            }
            Job::Flush { reply } => drop(reply.send(())),
            Job::Ingest { job, done } => {
                let started = Instant::now();
                // The engine's buffer is the source of truth: a log that refuses is
                // counted and the delivery applied all the same.
                let _ = ex.log(&crate::ingest::holders::record(&job)).await;
                let mut u = Update::new();
                crate::ingest::holders::apply(&ex, job, &mut u);
                publish(&ex, u, done).await;
                ex.metrics().applied(started.elapsed());
            }
        }
    }
}

fn job_name(j: &Job) -> &'static str {
    match j {
        Job::Events { .. } => "events",
        Job::Place { .. } => "place",
        Job::Register { .. } => "register",
        Job::Retire { .. } => "retire",
        Job::Expire => "expire",
        Job::Apply { .. } => "apply",
        Job::Export { .. } => "export",
        Job::Flush { .. } => "flush",
        Job::Ingest { .. } => "ingest",
    }
}

/// The feed step of an event batch: checks it whole and turns it into `u`.
fn events(ex: &Executor, body: &AlignedVec, u: &mut Update) -> Result<Applied, Failure> {
    let b = kvix_wire::codec::access::<EventBatch>(body)
        .map_err(|e| Failure::new(kvix_wire::ErrorCode::BadFrame, e.to_string()))?;
    let m = ex.metrics();
    ExecutorMetrics::add(&m.batches, 1);
    let (worker, seq) = (b.worker.to_native(), b.seq.to_native());
    let (max, held) = (ex.config().max_blocks, ex.core().index().blocks());
    let stores = || {
        b.events
            .iter()
            .any(|e| matches!(e, kvix_wire::ArchivedEvent::Stored { .. }))
    };
    if max > 0 && held >= max && stores() {
        let refused = m
            .stores_refused
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        if (refused + 1).is_power_of_two() {
            tracing::warn!(
                held,
                max,
                "index full: {} event batches with stores refused so far",
                refused + 1
            );
        }
        return Err(Failure::new(
            kvix_wire::ErrorCode::Overloaded,
            format!("the index holds {held} blocks (--max-blocks {max}): batches that store blocks are refused until removals make room"),
        ));
    }
    let ks = Ks {
        seed: b.keyspace.seed(ex.config().block_size),
        kind: b.keyspace.kind(),
    };
    let report = ex.core().events(worker, seq, ks, &b.events, u)?;
    match report.status {
        ApplyStatus::Duplicate => ExecutorMetrics::add(&m.batch_duplicates, 1),
        ApplyStatus::Gap { .. } => ExecutorMetrics::add(&m.batch_gaps, 1),
        ApplyStatus::Applied => {}
    }
    ExecutorMetrics::add(&m.block_events, report.block_events);
    ExecutorMetrics::add(&m.unprobed_removals, report.unprobed);
    Ok(Applied {
        seq,
        status: report.status,
    })
}

/// The feed step of a placement, in slices (a chain may hold millions of blocks).
async fn place(ex: &Executor, body: &AlignedVec, u: &mut Update) -> Result<(), Failure> {
    let p = kvix_wire::codec::access::<Placement>(body)
        .map_err(|e| Failure::new(kvix_wire::ErrorCode::BadFrame, e.to_string()))?;
    ExecutorMetrics::add(&ex.metrics().placements, 1);
    let ks = Ks {
        seed: p.keyspace.seed(ex.config().block_size),
        kind: p.keyspace.kind(),
    };
    let (worker, chain) = (p.worker.to_native(), kvix_wire::u64s(&p.chain));
    let mut job = ex.core().start_placing(worker, ks, chain, ex.now_ms())?;
    while !ex
        .core()
        .place_some(worker, ks, chain, &mut job, SLICE_BLOCKS, u)?
    {
        slice_done(ex).await;
    }
    Ok(())
}

/// Ends one slice of a long write: counted, and queries get their turn.
async fn slice_done(ex: &Executor) {
    ExecutorMetrics::add(&ex.metrics().write_slices, 1);
    glommio::executor().yield_task_queue_now().await;
}

/// Hands `update` to every other executor, applies it here, and calls `done` once every
/// executor applied it (without holding up this queue meanwhile).
async fn publish(ex: &Rc<Executor>, update: Update, done: impl FnOnce() + 'static) {
    if update.is_empty() {
        return done();
    }
    let update = Arc::new(update);
    let acks: Vec<_> = (0..ex.executors())
        .filter(|&peer| peer != ex.me())
        .map(|peer| {
            ex.mesh()
                .invoke_on(peer, calls::apply::Apply(update.clone()))
        })
        .collect();
    apply(ex, &update).await;
    if acks.is_empty() {
        return done();
    }
    let me = ex.me();
    glommio::spawn_local(async move {
        for ack in acks {
            // A peer gone means the process is stopping: nothing left to wait for.
            let _ = ack.await;
        }
        tracing::debug!(executor = me, "published");
        done();
    })
    .detach();
}

/// Applies `update` to this executor's copy in slices, yielding to queries between them.
async fn apply(ex: &Executor, update: &Update) {
    let mut cursor = Cursor::default();
    loop {
        if let Err(e) = ex.core().apply_some(update, &mut cursor, SLICE_BLOCKS) {
            tracing::error!("the index refused a block operation (a bug): {e}");
        }
        if cursor.is_finished() {
            break;
        }
        slice_done(ex).await;
    }
    ex.refresh_gauges();
}

/// This executor's snapshot part, its runs taken in slices.
async fn export(ex: &Executor) -> Part {
    let me = ex.me();
    let home = |w: WorkerId| ex.home_of(w) == me;
    let mut part = Part {
        feeds: ex.core().export_feeds(ex.now_ms()),
        runs: Vec::new(),
        holders: ex.holders().export(),
    };
    let mut cursor = 0;
    while !ex
        .core()
        .index()
        .export_some(&mut cursor, SLICE_BLOCKS * 8, home, &mut part.runs)
    {
        slice_done(ex).await;
    }
    part
}
