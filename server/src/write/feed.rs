//! The feed steps of a worker's writes on its home: an event batch, a placement or an
//! engine delivery (translated, in steps) turned into block operations, in slices.

use std::rc::Rc;
use std::time::Instant;

use kvix_engine::{Ks, Update};
use kvix_events::payload::EngineEvent;
use kvix_wire::{Applied, ApplyStatus, Event, EventBatch, Placement, WorkerId};

use super::apply::{publish, slice_done, SLICE_BLOCKS};
use super::job::Written;
use super::record::{FrameBytes, Outcome, Write};
use crate::executor::Executor;
use crate::failure::Failure;
use crate::ingest::states::Dropped;
use crate::metrics::ExecutorMetrics;

/// An event batch, placement or engine delivery of a worker homed here: logged, turned
/// into an update by the feed step, published.
pub async fn home_write(ex: Rc<Executor>, write: Write) -> Written<Result<Outcome, Failure>> {
    let started = Instant::now();
    let mut u = Update::new();
    let result = feed_step(&ex, write, &mut u).await;
    let written = match result {
        Ok(outcome) => Written {
            result: Ok(outcome),
            acks: publish(&ex, u).await,
        },
        Err(f) => Written::now(Err(f)),
    };
    ex.metrics().applied(started.elapsed());
    written
}

/// Writes of workers homed here read back from the write-ahead log, in its order: each
/// one's feed step appends to one update, published once (a record at a time was an
/// update, a publish and an apply on every executor each). A write refused is left out
/// (as it was the first time), counted in the result.
pub async fn home_writes(ex: Rc<Executor>, writes: Vec<Write>) -> Written<Result<u64, Failure>> {
    let mut u = Update::new();
    let mut refused = 0;
    for mut write in writes {
        // A fill-in leaves to a worker's events what this copy's index shows them
        // holding: what came before it must be in the index, as when it was first taken.
        // The peers apply updates in the order sent, so the last update's acks cover it.
        if fills_in(&ex, &mut write) && !u.ops.is_empty() {
            let _ = publish(&ex, std::mem::take(&mut u)).await;
        }
        let mark = u.ops.mark();
        if feed_step(&ex, write, &mut u).await.is_err() {
            u.ops.truncate(mark);
            refused += 1;
        }
    }
    Written {
        result: Ok(refused),
        acks: publish(&ex, u).await,
    }
}

/// Whether `write` is a placement that fills in for a worker's lost history.
fn fills_in(ex: &Executor, write: &mut Write) -> bool {
    match write {
        Write::Place { .. } => write
            .home_worker()
            .is_ok_and(|w| w.is_some_and(|w| ex.core().fills_in(w))),
        _ => false,
    }
}

/// One write's feed step: logged, then turned into block operations appended to `u`.
async fn feed_step(ex: &Rc<Executor>, write: Write, u: &mut Update) -> Result<Outcome, Failure> {
    let logged = ex.keep(&write).await;
    match write {
        Write::Events { body } => match logged {
            Ok(()) => events(ex, &body, u).await,
            Err(f) => Err(f),
        },
        Write::Place { body } => match logged {
            Ok(()) => place(ex, &body, u).await.map(|()| Outcome::Done),
            Err(f) => Err(f),
        },
        // The engine's buffer is the source of truth: a log that refuses is counted and
        // the delivery applied all the same (a restart replays the engine's buffer after
        // the last batch the log holds).
        ingest @ Write::Ingest { worker, .. } => {
            crate::reuse::heard(worker);
            let block = ex.settings().index.block_size;
            let begun =
                ex.ingest_states()
                    .begin(&mut ex.core(), block, ingest, SLICE_BLOCKS as usize, u);
            match begun {
                Ok(begun) => {
                    ingest_steps(ex, worker, &begun.steps, u).await;
                    ex.ingest_states().finish(worker, begun.last);
                    Ok(Outcome::Done)
                }
                Err(Dropped::OutOfStep) => Err(Failure::OutOfStep { worker }),
                Err(Dropped::Orphaned | Dropped::Fenced) => Ok(Outcome::Done),
            }
        }
        Write::ForgetPlacements { worker } => {
            logged?;
            ex.core().forget_placements(worker, u)?;
            Ok(Outcome::Done)
        }
        Write::FillIn { worker } => {
            logged?;
            // False where the worker cannot take placements (not one full-attention
            // lane, or --fill-in-blocks 0): nothing to fill, as for a lost history.
            ex.core().fill_in(worker);
            Ok(Outcome::Done)
        }
        Write::Announce { .. } | Write::Retire { .. } => Err(Failure::Bug(
            "announces and retires are numbered by executor 0",
        )),
    }
}

/// The feed step of an event batch: checks it whole and turns it into `u`, in slices.
async fn events(ex: &Executor, body: &FrameBytes, u: &mut Update) -> Result<Outcome, Failure> {
    let b = body
        .access::<EventBatch>()
        .map_err(|source| Failure::Invalid {
            what: "an event batch",
            source,
        })?;
    let m = ex.metrics();
    ExecutorMetrics::add(&m.batches, 1);
    let (worker, seq) = (b.worker.to_native(), b.seq.to_native());
    crate::reuse::heard(worker);
    let (max, held) = (ex.settings().index.max_blocks, ex.core().index().blocks());
    let stores = || {
        b.events.iter().any(|e| {
            matches!(
                e,
                kvix_wire::ArchivedEvent::Stored { .. } | kvix_wire::ArchivedEvent::StoredIn { .. }
            )
        })
    };
    if max > 0 && held >= max && stores() {
        if let Some(refused) = crate::loud::count_loudly(&m.stores_refused) {
            tracing::warn!(
                held,
                max,
                "index full: {refused} event batches with stores refused so far"
            );
        }
        return Err(Failure::IndexFull { held, max });
    }
    let ks = Ks {
        seed: b.keyspace.seed(ex.settings().index.block_size),
        kind: b.keyspace.kind(),
    };
    // In slices: a 4 MiB batch is half a million blocks, tens of milliseconds of feed
    // step that queries would otherwise wait behind.
    let mut job = ex
        .core()
        .start_events(worker, seq, ks, &b.events, SLICE_BLOCKS)?;
    while !ex.core().events_some(worker, ks, &b.events, &mut job, u)? {
        slice_done(ex).await;
    }
    let report = job.report;
    match report.status {
        ApplyStatus::Duplicate => ExecutorMetrics::add(&m.batch_duplicates, 1),
        ApplyStatus::Gap { .. } => ExecutorMetrics::add(&m.batch_gaps, 1),
        ApplyStatus::Applied => {}
    }
    ExecutorMetrics::add(&m.block_events, report.block_events);
    ExecutorMetrics::add(&m.unprobed_removals, report.unprobed);
    Ok(Outcome::Applied(Applied {
        seq,
        status: report.status,
    }))
}

/// An engine delivery's steps, each translated then fed, with queries let in after
/// each translation and each slice of the feed: translating a step takes about as long
/// as a slice of the feed (a long prompt's prefill stores thousands of blocks at once,
/// an engine step many prompts).
async fn ingest_steps(ex: &Executor, worker: WorkerId, steps: &[Vec<EngineEvent>], u: &mut Update) {
    let max_blocks = ex.settings().index.max_blocks;
    for (i, events) in steps.iter().enumerate() {
        if i > 0 {
            slice_done(ex).await;
        }
        let groups = ex
            .ingest_states()
            .translate_step(&ex.core(), max_blocks, worker, events);
        slice_done(ex).await;
        feed_ingest(ex, worker, &groups, u).await;
    }
}

/// The feed step of an engine delivery's translated events, in slices. The feed
/// refusing them is a bug: counted and logged, the delivery's other groups still fed.
async fn feed_ingest(ex: &Executor, worker: WorkerId, groups: &[(Ks, Vec<Event>)], u: &mut Update) {
    use crate::ingest::METRICS;
    for (ks, events) in groups {
        let started = ex.core().start_ingest(worker, *ks, events, SLICE_BLOCKS);
        let fed = match started {
            Ok(mut job) => loop {
                let done = ex.core().events_some(worker, *ks, events, &mut job, u);
                match done {
                    Ok(true) => break Ok(job.report),
                    Ok(false) => slice_done(ex).await,
                    Err(e) => break Err(e),
                }
            },
            Err(e) => Err(e),
        };
        match fed {
            Ok(report) => {
                METRICS.block_events(report.block_events);
                ExecutorMetrics::add(&ex.metrics().unprobed_removals, report.unprobed);
            }
            Err(e) => {
                METRICS
                    .refused
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                tracing::warn!(worker, "ingest: the feed refused a translated batch: {e}");
            }
        }
    }
}

/// The feed step of a placement, in slices (a chain may hold millions of blocks).
async fn place(ex: &Executor, body: &FrameBytes, u: &mut Update) -> Result<(), Failure> {
    let p = body
        .access::<Placement>()
        .map_err(|source| Failure::Invalid {
            what: "a placement",
            source,
        })?;
    let m = ex.metrics();
    ExecutorMetrics::add(&m.placements, 1);
    let ks = Ks {
        seed: p.keyspace.seed(ex.settings().index.block_size),
        kind: p.keyspace.kind(),
    };
    let (worker, chain) = (p.worker.to_native(), kvix_wire::u64s(&p.chain));
    let Some(mut job) = ex.core().start_placing(worker, ks, chain, ex.now_ms())? else {
        ExecutorMetrics::add(&m.placements_passed_over, 1);
        return Ok(());
    };
    if ex.core().fills_in(worker) {
        ExecutorMetrics::add(&m.placements_filled_in, 1);
    }
    while !ex
        .core()
        .place_some(worker, ks, chain, &mut job, SLICE_BLOCKS, u)?
    {
        slice_done(ex).await;
    }
    Ok(())
}
