//! One executor, from start to stop: its copy restored (and, on executor 0, the
//! write-ahead log replayed and the ingest resumed), its write queue, mesh inbox, log
//! and ingest inboxes, its listeners, its timers (placement expiry, snapshots), and its
//! part of a clean stop.

use std::os::fd::FromRawFd;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use glommio::{Latency, Shares};
use kvix_engine::{Core, Registry};

use crate::checkpoint::take_snapshot;
use crate::config::Config;
use crate::durable::{replica, snapshot, write};
use crate::executor::Executor;
use crate::ingest::states::IngestStates;
use crate::metrics::ExecutorMetrics;
use crate::{admit, executor, http, listener, mesh, writer};

/// What every executor starts from.
pub(crate) struct Shared {
    pub(crate) config: Arc<Config>,
    pub(crate) metrics: Arc<[ExecutorMetrics]>,
    pub(crate) stop: Arc<AtomicBool>,
    pub(crate) ready: StartGate,
    pub(crate) serving: std::sync::Barrier,
    pub(crate) restored: Option<snapshot::ServerImage>,
    pub(crate) services: executor::Services,
    /// Each executor's end of the replicated log's follower, taken once.
    pub(crate) log_inboxes:
        std::sync::Mutex<Vec<Option<futures::channel::mpsc::Receiver<replica::LogJob>>>>,
    /// The write-ahead log's records, replayed by executor 0 before anyone is served.
    pub(crate) replay: std::sync::Mutex<Vec<write::Write>>,
    /// Set by executor 0 once the snapshot and the log are in: then connections are taken.
    pub(crate) restored_all: crate::latch::Latch,
    /// Set by executor 0 once the shutdown snapshot is written; peers serve it until then.
    pub(crate) snapshot_done: crate::latch::Latch,
}

/// An executor stopped because a peer could not start (the peer says why).
#[derive(Debug, thiserror::Error)]
#[error("another executor failed to start")]
pub(crate) struct PeerFailed;

/// Where executors report whether they restored: a failed one makes every other one stop
/// instead of waiting for it (a barrier would hang the process).
pub(crate) struct StartGate {
    state: std::sync::Mutex<(usize, bool)>,
    all_in: std::sync::Condvar,
    executors: usize,
}

impl StartGate {
    pub(crate) fn new(executors: usize) -> Self {
        StartGate {
            state: std::sync::Mutex::new((0, false)),
            all_in: std::sync::Condvar::new(),
            executors,
        }
    }

    /// Reports this executor's start and waits for the others; true when all started.
    pub(crate) fn arrive(&self, ok: bool) -> bool {
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        st.0 += 1;
        st.1 |= !ok;
        self.all_in.notify_all();
        while st.0 < self.executors && !st.1 {
            st = self.all_in.wait(st).unwrap_or_else(|p| p.into_inner());
        }
        !st.1
    }
}

/// This executor's engine, registry and ingest state, restored from the snapshot if
/// there is one.
fn restore(
    shared: &Shared,
    me: usize,
    executors: usize,
) -> anyhow::Result<(Core, Registry, IngestStates)> {
    let (mut core, mut registry, mut states) = (
        Core::new().with_fill_in(kvix_engine::FillIn {
            capacity_blocks: shared.config.index.fill_in_blocks,
            ttl_ms: shared.config.index.fill_in_ttl.saturating_mul(1000),
        }),
        Registry::with_limit(shared.config.index.max_workers),
        IngestStates::new(shared.services.ingest.lasts()),
    );
    if let Some(image) = &shared.restored {
        let block = shared.config.index.block_size;
        let entries = registry
            .import(&image.engine.workers, block)
            .context("restoring the snapshot's workers")?;
        let home = |w: u32| w as usize % executors == me;
        let dropped = core
            .import(&entries, &image.engine.runs, &image.engine.feeds, home, 0)
            .context("restoring the snapshot's index")?;
        if dropped > 0 && me == 0 {
            tracing::warn!(
                dropped,
                "snapshot: holders naming a worker or lane its roster lacks were dropped (a roster changed while it was taken)"
            );
        }
        for (w, h) in image.ingest_states.iter().filter(|(w, _)| home(*w)) {
            let lanes = entries.iter().find(|e| e.id == *w).map(|e| &e.lanes[..]);
            if !lanes.is_some_and(|l| states.import(*w, h, l, block)) {
                anyhow::bail!("the snapshot's ingest state of worker {w} does not fit its roster");
            }
        }
    }
    Ok((core, registry, states))
}

/// Writes replayed before the replay waits for them to be applied everywhere.
const REPLAY_WINDOW: usize = 4096;
/// Writes of one home's that go to it as one job, their feed steps in one update.
const REPLAY_BATCH: usize = 256;

/// Applies the log's records in their order. Records of workers homed on one executor
/// go to it in batches ([`writer::home_writes`]: one update, one publish per batch), in
/// their order, so writes of one worker keep their order without waiting on each other;
/// only announces and retires (which number workers and change every executor's
/// roster) wait for everything before them and are awaited themselves.
async fn replay(ex: &Rc<Executor>, records: Vec<write::Write>) {
    let mut batches: Vec<Vec<write::Write>> = (0..ex.executors()).map(|_| Vec::new()).collect();
    let mut pending = Vec::new();
    let mut queued = 0;
    let send = |home: usize, batch: Vec<write::Write>, pending: &mut Vec<_>| {
        pending.push(ex.queue_on(home, move |on| writer::home_writes(on, batch)));
    };
    for mut r in records {
        if r.changes_roster() || queued >= REPLAY_WINDOW {
            for (home, batch) in batches.iter_mut().enumerate() {
                if !batch.is_empty() {
                    send(home, std::mem::take(batch), &mut pending);
                }
            }
            for p in pending.drain(..) {
                let _ = p.await;
            }
            queued = 0;
        }
        if r.changes_roster() {
            let _ = writer::route_write(ex, r, writer::Origin::Logged).await;
            continue;
        }
        // A record that does not read was refused when it was first taken too.
        let Ok(Some(worker)) = r.home_worker() else {
            continue;
        };
        let home = ex.home_of(worker);
        batches[home].push(r);
        queued += 1;
        if batches[home].len() >= REPLAY_BATCH {
            send(home, std::mem::take(&mut batches[home]), &mut pending);
        }
    }
    for (home, batch) in batches.into_iter().enumerate() {
        if !batch.is_empty() {
            send(home, batch, &mut pending);
        }
    }
    for p in pending {
        let _ = p.await;
    }
}

/// Executor 0, once every executor is ready: replays the write-ahead log over the
/// snapshot, then has the ingest subscribe every source where its stream left off.
async fn finish_restore(ex: &Rc<Executor>, shared: &Shared) {
    if let Some(image) = &shared.restored {
        for (w, source) in &image.sources {
            let name = ex.registry().name_of(*w).unwrap_or_default().to_string();
            ex.ingest().restore(*w, &name, source.clone());
        }
    }
    let records = std::mem::take(&mut *shared.replay.lock().unwrap_or_else(|p| p.into_inner()));
    if !records.is_empty() {
        let (count, started) = (records.len(), std::time::Instant::now());
        tracing::info!(records = count, "replaying the write-ahead log");
        if let Some(wal) = ex.wal() {
            wal.replaying(true);
        }
        replay(ex, records).await;
        ex.metrics()
            .wal_replayed
            .store(count as u64, Ordering::Relaxed);
        if let Some(wal) = ex.wal() {
            wal.replaying(false);
        }
        let took = started.elapsed().as_secs_f64();
        tracing::info!(
            records = count,
            seconds = took,
            per_second = (count as f64 / took.max(1e-9)) as u64,
            "write-ahead log replayed"
        );
    }
    ex.ingest().resume();
}

pub(crate) async fn serve(
    fd: std::os::fd::RawFd,
    shared: Arc<Shared>,
    mesh: mesh::Builder<Executor>,
) -> anyhow::Result<()> {
    let config = shared.config.clone();
    // SAFETY: the fd is a listening TCP socket created for this executor alone.
    let tcp = unsafe { glommio::net::TcpListener::from_raw_fd(fd) };
    let gx = glommio::executor();
    // Queries (every connection) before writes: connections run in a queue with ten
    // times the write queue's shares, and long writes yield between slices. Neither is
    // `Latency::Matters`: with it, glommio lost wakeups here (docs/design.md).
    let queries = gx.create_task_queue(Shares::Static(1000), Latency::NotImportant, "queries");
    let writes = gx.create_task_queue(Shares::Static(100), Latency::NotImportant, "writes");
    let hops = |me: usize| shared.metrics[me].query_hops.clone();
    let (mesh, inbox) = mesh::Mesh::join(mesh, hops).await?;
    let me = mesh.me();
    let restored = restore(&shared, me, mesh.executors());
    // Every executor reports here, failed or not, so none waits for a peer that left.
    if !shared.ready.arrive(restored.is_ok()) {
        restored?;
        return Err(PeerFailed.into());
    }
    let (core, registry, states) = restored?;
    let (jobs, queue) = glommio::channels::local_channel::new_unbounded();
    let log_appender = shared
        .services
        .replica
        .clone()
        .map(|r| replica::appender::Appender::start(r, writes))
        .transpose()?;
    let ex = Executor::new(
        config.executor_settings(),
        shared.metrics.clone(),
        mesh,
        core,
        registry,
        states,
        shared.services.clone(),
        jobs,
        log_appender,
    );
    ex.refresh_gauges();
    admit::set_conn_queue(queries);
    inbox.serve(&ex);
    glommio::spawn_local_into(writer::run(ex.clone(), queue), writes)
        .map_err(|e| anyhow::anyhow!("starting the write queue: {e}"))?
        .detach();
    let log_inbox = shared
        .log_inboxes
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .get_mut(me)
        .and_then(Option::take);
    if let (Some(rx), Some(r)) = (log_inbox, ex.replica()) {
        glommio::spawn_local_into(writer::serve_log(ex.clone(), rx), writes)
            .map_err(|e| anyhow::anyhow!("starting the log inbox: {e}"))?
            .detach();
        // The follower runs on executor 0: its barriers (announces, retires) are applied
        // there, in place.
        let follow = if me == 0 { r.take_follow() } else { None };
        if let Some(follow) = follow {
            glommio::spawn_local_into(replica::follower::run(r.clone(), follow), writes)
                .map_err(|e| anyhow::anyhow!("starting the log follower: {e}"))?
                .detach();
        }
    }
    if let Some(deliveries) = shared.services.ingest.take_inbox(me) {
        glommio::spawn_local_into(writer::serve_deliveries(ex.clone(), deliveries), writes)
            .map_err(|e| anyhow::anyhow!("starting the ingest inbox: {e}"))?
            .detach();
    }
    // Blocking here is fine: nothing on this executor may run before its peers are wired.
    shared.serving.wait();
    if me == 0 {
        finish_restore(&ex, &shared).await;
        if let Some(r) = ex.replica() {
            // A replica serves once it has applied the log as far as it went at start
            // (or stops, if told to before).
            let mut caught_up = std::pin::pin!(r.first_caught_up.wait());
            while !shared.stop.load(Ordering::Relaxed) {
                let tick = std::pin::pin!(glommio::timer::sleep(Duration::from_millis(50)));
                if let futures::future::Either::Left(_) =
                    futures::future::select(caught_up.as_mut(), tick).await
                {
                    break;
                }
            }
        }
        shared.restored_all.set();
    }
    // Nobody is served before the log is replayed (a client's write would interleave).
    shared.restored_all.wait().await;
    if me == 0 && !config.listen.metrics.is_empty() {
        let addr = &config.listen.metrics;
        let fd = listener::metrics_socket(addr)?;
        // SAFETY: a listening TCP socket made for this listener alone.
        let l = unsafe { glommio::net::TcpListener::from_raw_fd(fd) };
        let bound = l
            .local_addr()
            .map_err(|e| anyhow::anyhow!("metrics address: {e}"))?;
        println!("kvix-server metrics on http://{bound}/metrics");
        glommio::spawn_local(http::serve(
            l,
            shared.metrics.clone(),
            ex.replica().cloned(),
        ))
        .detach();
    }
    if me == 0 && !config.listen.unix.is_empty() {
        let unix = glommio::net::UnixListener::bind(&config.listen.unix)
            .map_err(|e| anyhow::anyhow!("binding Unix socket {}: {e}", config.listen.unix))?;
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::Permissions::from_mode(config.listen.unix_mode);
            std::fs::set_permissions(&config.listen.unix, mode).map_err(|e| {
                anyhow::anyhow!(
                    "setting the mode of Unix socket {}: {e}",
                    config.listen.unix
                )
            })?;
        }
        println!("kvix-server listening on unix://{}", config.listen.unix);
        let ex = ex.clone();
        glommio::spawn_local_into(
            async move {
                loop {
                    match unix.shared_accept().await {
                        Ok(s) => admit::admit(&ex, s, queries),
                        Err(e) => admit::accept_failed(&ex, "unix", e, None).await,
                    }
                }
            },
            queries,
        )
        .map_err(|e| anyhow::anyhow!("starting the Unix listener: {e}"))?
        .detach();
    }
    let accept = {
        let ex = ex.clone();
        glommio::spawn_local_into(
            async move {
                loop {
                    match tcp.shared_accept().await {
                        Ok(s) => admit::admit(&ex, s, queries),
                        Err(e) => admit::accept_failed(&ex, "tcp", e, Some(fd)).await,
                    }
                }
            },
            queries,
        )
        .map_err(|e| anyhow::anyhow!("starting the listener: {e}"))?
    };
    let snapshot_ticks = config.durability.snapshot_every.saturating_mul(20);
    let mut ticks = 0u64;
    while !shared.stop.load(Ordering::Relaxed) {
        glommio::timer::sleep(Duration::from_millis(50)).await;
        ticks += 1;
        if ticks.is_multiple_of(20) {
            drop(ex.queue(writer::expire));
        }
        if me == 0 && snapshot_ticks > 0 && ticks.is_multiple_of(snapshot_ticks) {
            // A failure is counted and logged; the next period tries again.
            let _ = take_snapshot(&ex, false).await;
        }
    }
    drop(accept);
    if me == 0 {
        let last = take_snapshot(&ex, true).await;
        shared.snapshot_done.set();
        last?;
    } else {
        // Keep answering executor 0's export until the last snapshot is on disk.
        shared.snapshot_done.wait().await;
    }
    tracing::info!(executor = me, "executor stopping");
    Ok(())
}
