//! Every write: the one route it takes, whoever sent it, and the write queue of the
//! executor that orders it.
//!
//! **The route.** A client's frame (the protocol handler), the write-ahead log's replay,
//! the replicated log's follower and the engine-event ingest all hand a [`Write`] to
//! [`route_write`]. With replicas (`--log`), an accepted write goes to the shared log
//! first and takes this route again when the follower reads it back. Announces and
//! retires go to executor 0, which numbers workers ([`announce`], [`retire`]) and then
//! has the worker's home install or forget it; every other write goes to its worker's
//! home (`worker % executors`). The write is queued there, in the order this executor
//! sent it, before the returned future is first polled; the future answers once every
//! executor applied it.
//!
//! **The write queue.** One task per executor, in the write task queue, runs write jobs
//! one after another ([`run`]). Queries never wait in it: they run in the query task
//! queue (ten times its shares) and read the index between the slices a long job is
//! cut into. A write of
//! a worker homed here ([`home_write`], [`install`], [`forget`], [`expire`]) is turned
//! into an update by the engine's feed step; [`publish`] then hands the update to every
//! other executor (their queues apply it in the order this one sends), applies it here
//! in slices of [`SLICE_BLOCKS`] blocks, and the write's reply is due once every
//! executor has applied it, so a client that read the reply sees its write in its next
//! query, wherever that lands.

use std::cell::Cell;
use std::rc::Rc;
use std::sync::Arc;
use std::time::Instant;

use glommio::channels::local_channel::LocalReceiver;
use kvix_engine::{AnnounceOutcome, Cursor, EngineError, Ks, Update, WorkerEntry};
use kvix_events::payload::EngineEvent;
use kvix_wire::{
    Announced, Applied, ApplyStatus, Event, EventBatch, EventSource, Feed, Placement, WorkerId,
};

use crate::durable::replica::appender::Appender;
use crate::durable::snapshot::Part;
use crate::durable::write::{Body, Outcome, Write};
use crate::executor::{answer, Acks, Executor, Queued, Tally, Written};
use crate::failure::Failure;
use crate::ingest::states::Dropped;
use crate::mesh::LocalFuture;
use crate::metrics::ExecutorMetrics;

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
    match (origin, ex.log_appender()) {
        (Origin::Accepted, Some(log)) => to_log(ex, log.clone(), write),
        _ => to_executor(ex, write, origin == Origin::Logged),
    }
}

/// Replicas: the write is appended to the shared log now, in the order the connection
/// sent it; an announce's source is checked first, before the log takes it (every
/// replica then registers what the log holds, and a client waits for an announce's
/// reply before writing for its worker).
fn to_log(ex: &Rc<Executor>, log: Appender, write: Write) -> LocalFuture<Result<Outcome, Failure>> {
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
async fn retire(ex0: &Rc<Executor>, worker: WorkerId) -> Result<(), Failure> {
    debug_assert_eq!(ex0.me(), 0, "executor 0 numbers workers");
    if !ex0.registry().is_active(worker) {
        return Err(EngineError::UnknownWorker(worker).into());
    }
    ex0.log(&Write::Retire { worker }).await?;
    ex0.registry().retire(worker)?;
    ex0.ingest().retired(worker);
    ex0.queue_on(ex0.home_of(worker), move |home| forget(home, worker))
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

/// Blocks applied between two yields to the query task queue (about 50 µs of work).
pub const SLICE_BLOCKS: u64 = 512;

/// Runs `ex`'s queued writes in order until the queue closes. What a write leaves to
/// finish (waiting for the other executors) runs beside the queue, not in it.
pub async fn run(ex: Rc<Executor>, queue: LocalReceiver<Queued>) {
    while let Some(queued) = queue.recv().await {
        match queued {
            Queued::Home { write, reply } => answer(reply, home_write(ex.clone(), write).await),
            Queued::Apply { update, tally } => {
                apply_here(&ex, &update).await;
                tally.applied();
            }
            Queued::Other(work) => work.await,
        }
    }
}

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
    let logged = ex.log(&write).await;
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
        Write::Announce { .. } | Write::Retire { .. } => Err(Failure::Bug(
            "announces and retires are numbered by executor 0",
        )),
    }
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

/// Expires the placements of the workers homed here.
pub async fn expire(ex: Rc<Executor>) -> Written<Result<(), Failure>> {
    let mut u = Update::new();
    let now = ex.now_ms();
    ex.core().expire(now, &mut u);
    Written {
        result: Ok(()),
        acks: publish(&ex, u).await,
    }
}

/// Nothing: due once every write queued before it is done.
pub async fn flush(_: Rc<Executor>) -> Written<Result<(), Failure>> {
    Written::now(Ok(()))
}

/// This executor's snapshot part, taken in its queue (so no write of its workers is
/// half in it), its runs in slices.
pub async fn export(ex: Rc<Executor>) -> Written<Result<Part, Failure>> {
    let me = ex.me();
    let home = |w: WorkerId| ex.home_of(w) == me;
    let mut part = Part {
        feeds: ex.core().export_feeds(ex.now_ms()),
        runs: Vec::new(),
        ingest_states: ex.ingest_states().export(),
    };
    let mut cursor = 0;
    while !ex
        .core()
        .index()
        .export_some(&mut cursor, SLICE_BLOCKS * 8, home, &mut part.runs)
    {
        slice_done(&ex).await;
    }
    Written::now(Ok(part))
}

/// The feed step of an event batch: checks it whole and turns it into `u`, in slices.
async fn events(ex: &Executor, body: &Body, u: &mut Update) -> Result<Outcome, Failure> {
    let b = body
        .access::<EventBatch>()
        .map_err(|source| Failure::Invalid {
            what: "an event batch",
            source,
        })?;
    let m = ex.metrics();
    ExecutorMetrics::add(&m.batches, 1);
    let (worker, seq) = (b.worker.to_native(), b.seq.to_native());
    let (max, held) = (ex.settings().index.max_blocks, ex.core().index().blocks());
    let stores = || {
        b.events
            .iter()
            .any(|e| matches!(e, kvix_wire::ArchivedEvent::Stored { .. }))
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
async fn place(ex: &Executor, body: &Body, u: &mut Update) -> Result<(), Failure> {
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

thread_local! {
    /// This executor's slices since its last turn to the reactor, and when that was.
    static SINCE_TURN: Cell<(u32, Option<Instant>)> = const { Cell::new((0, None)) };
    /// Its write slices when it took its last two turns (the older first).
    static TURNS: Cell<(u64, u64)> = const { Cell::new((0, 0)) };
}

/// Ends one slice of a long write: counted, and queries get their turn. The write
/// queue yields to the query queue, so queries already read run now. A query's bytes
/// are read only when the executor turns to its reactor (polls for I/O), which glommio
/// does when no task is runnable or its preemption timer (100 ms) fires: so after
/// [`TURN_EVERY`] of write work, or [`SLICES_PER_TURN`] slices, the write waits on a
/// timer, which leaves nothing of it runnable until the reactor has been polled.
async fn slice_done(ex: &Executor) {
    let m = ex.metrics();
    ExecutorMetrics::add(&m.write_slices, 1);
    let (since, last) = SINCE_TURN.get();
    let now = Instant::now();
    let due = since + 1 >= SLICES_PER_TURN || last.is_none_or(|t| now - t >= TURN_EVERY);
    if !due {
        SINCE_TURN.set((since + 1, last));
        glommio::executor().yield_task_queue_now().await;
        return;
    }
    ExecutorMetrics::add(&m.write_turns, 1);
    let slices = m.write_slices.load(std::sync::atomic::Ordering::Relaxed);
    TURNS.set((TURNS.get().1, slices));
    glommio::timer::sleep(std::time::Duration::from_micros(1)).await;
    SINCE_TURN.set((0, Some(Instant::now())));
}

/// This executor's write slices at its turn to the reactor before the latest one: a
/// query read now arrived after that turn, so the slices run since bound what it
/// waited behind (conn.rs observes them in `kvix_query_write_slices`).
pub fn slices_at_turn_before_last() -> u64 {
    TURNS.get().0
}

/// Write work between two turns to the reactor. A turn costs a kernel timer (29 µs on
/// the 2-vCPU VM, more than a 512-block slice's work), so one after every slice more than
/// halved the write rate there; one a millisecond costs ~3 %. Shortening glommio's own
/// preemption period instead (500 µs) lost wakeups in glommio 0.9 here: servers hung at
/// start and under descriptor exhaustion (server/tests/attacks.rs).
pub const TURN_EVERY: std::time::Duration = std::time::Duration::from_millis(1);

/// Slices after which a long write turns to the reactor whatever the time (a count the
/// tests can bound: a query waits behind at most two turns' worth).
pub const SLICES_PER_TURN: u32 = 128;

/// Hands `update` to every other executor's write queue and applies it here; what it
/// returns resolves once every other executor applied it (None: nothing to wait for).
/// The peers count down one shared tally, the last one answers: one reply per update,
/// not one per peer (this is the hot path of every write).
async fn publish(ex: &Rc<Executor>, update: Update) -> Option<Acks> {
    if update.is_empty() {
        return None;
    }
    let update = Arc::new(update);
    let peers = ex.executors() - 1;
    let acked = (peers > 0).then(|| {
        let (tally, acks) = Tally::new(peers);
        for peer in (0..ex.executors()).filter(|&p| p != ex.me()) {
            let (update, tally) = (update.clone(), tally.clone());
            ex.mesh()
                .spawn_on(peer, move |on| on.enqueue(Queued::Apply { update, tally }));
        }
        acks
    });
    apply_here(ex, &update).await;
    // A peer gone drops the tally unanswered: the process is stopping, nothing to wait for.
    acked
}

/// Applies `update` to this executor's copy in slices, yielding to queries between them.
async fn apply_here(ex: &Executor, update: &Update) {
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
                let part = ex.queue(export);
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
