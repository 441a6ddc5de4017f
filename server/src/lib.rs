//! kvix-server: the shared prefix-cache index as a thread-per-core service.
//!
//! Data path, top to bottom: [`listener`] (sockets, [`steering`]) → [`conn`] (frames)
//! → [`handler`] (messages) → [`executor`] (this core's copy of the engine) →
//! `kvix_engine` → the answer frame back through [`conn`]. A query never leaves the
//! executor that read it; every write ([`write::Write`], whoever sent it) takes
//! [`route::route_write`] to its worker's home [`writer`] queue, which publishes it to
//! every executor over the [`mesh`].

pub mod admit;
pub mod auth;
pub mod config;
pub mod conn;
pub mod executor;
pub mod failure;
pub mod handler;
pub mod http;
pub mod ingest;
pub mod listener;
pub mod mesh;
pub mod metrics;
pub mod replica;
pub mod rlimit;
pub mod route;
pub mod snapshot;
pub mod steering;
pub mod wal;
pub mod write;
pub mod writer;

use std::os::fd::FromRawFd;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use glommio::{Latency, LocalExecutorBuilder, Placement, Shares};
use kvix_engine::{Core, EngineImage, Registry};

pub use config::Config;
use executor::Executor;
use ingest::holders::Holders;
use mesh::LocalFuture;
use metrics::ExecutorMetrics;

/// Per-executor I/O memory: small enough for the default 8 MiB RLIMIT_MEMLOCK.
const IO_MEMORY: usize = 512 << 10;

/// Starts one executor per core and serves until SIGINT or SIGTERM.
pub fn run(config: Config) -> anyhow::Result<()> {
    let executors = config.executors();
    let group = listener::tcp_group(config.listen, executors, config.steering)?;
    if let Ok(metrics) = config.metrics.parse() {
        listener::ensure_unserved(metrics)?;
    }
    if !config.unix.is_empty() {
        listener::free_unix_path(&config.unix)?;
    }
    let stop = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(sig, stop.clone()).context("installing signal handlers")?;
    }
    match rlimit::raise_open_files() {
        Ok((before, after)) => {
            let wanted = rlimit::wanted(executors, config.max_connections, config.max_sources);
            if after < wanted {
                tracing::warn!(
                    "open files limited to {after} (ulimit -n); the configured connections and sources may need {wanted}"
                );
            } else if after > before {
                tracing::info!("open files: soft limit raised from {before} to {after}");
            }
        }
        Err(e) => tracing::warn!("open files limit not raised: {e}"),
    }
    admit::reserve::hold();
    let ingest = Arc::new(
        ingest::Ingest::start(
            config.ingest_threads,
            executors,
            config.max_sources,
            config.source_networks().map_err(anyhow::Error::msg)?,
        )
        .context("starting the event ingest threads")?,
    );
    // A snapshot that cannot be read whole stops the start: never serve half an index.
    let mut restored = match &config.snapshot {
        Some(path) => {
            snapshot::check_writable(path)?;
            snapshot::load(path, config.block_size)?
        }
        None => None,
    };
    if let Some(log) = &config.log {
        // A replica without its own snapshot (new, or too far behind a trimmed stream)
        // starts from the one the fleet stored in Redis.
        let stored = replica::follower::fetch_snapshot(&log.server, &log.key)
            .with_context(|| format!("reading the stored snapshot from {}", log.server))?;
        if let Some(bytes) = stored {
            let theirs =
                snapshot::decode(&bytes, config.block_size, "the snapshot stored in Redis")?;
            let newer = restored.as_ref().is_none_or(|mine| {
                replica::id_key(&theirs.log_position) > replica::id_key(&mine.log_position)
            });
            if newer {
                restored = Some(theirs);
            }
        }
    }
    let mut wal_cut_bytes = 0;
    let (wal, replay) = match (&config.snapshot, config.wal) {
        (Some(path), true) => {
            let from = restored.as_ref().map_or(0, |i| i.wal_from);
            let opened = wal::Wal::open(path, from, config.wal_sync_ms, config.wal_recover)
                .context("opening the write-ahead log")?;
            wal_cut_bytes = opened.cut_bytes;
            (Some(opened.wal), opened.records)
        }
        _ => (None, Vec::new()),
    };
    if let Some(image) = &restored {
        tracing::info!(
            workers = image.engine.workers.len(),
            runs = image.engine.runs.len(),
            sources = image.sources.len(),
            "restoring snapshot"
        );
    }
    let (log_inboxes, log_receivers): (Vec<_>, Vec<_>) = (0..executors)
        .map(|_| futures::channel::mpsc::channel(256))
        .unzip();
    let replica = match &config.log {
        Some(log) => {
            let from = restored
                .as_ref()
                .map_or("0-0".to_string(), |i| i.log_position.clone());
            let r = replica::Replica::start(log.clone(), from, log_inboxes)?;
            ingest.set_leased();
            let (r2, ing) = (r.clone(), ingest.clone());
            std::thread::Builder::new()
                .name("kvix-lease".into())
                .spawn(move || replica::lease::run(r2, ing))?;
            Some(r)
        }
        None => None,
    };
    let shared = Arc::new(Shared {
        config: Arc::new(config),
        metrics: (0..executors)
            .map(|e| {
                let m = ExecutorMetrics::default();
                if e == 0 {
                    m.wal_cut_bytes.store(wal_cut_bytes, Ordering::Relaxed);
                }
                m
            })
            .collect(),
        stop: stop.clone(),
        // No executor serves before every executor is wired to the mesh and restored.
        ready: StartGate::new(executors),
        serving: std::sync::Barrier::new(executors),
        restored,
        snapshot_done: AtomicBool::new(false),
        services: executor::Services {
            ingest: ingest.clone(),
            wal,
            replica: replica.clone(),
            stopping: stop.clone(),
        },
        log_inboxes: std::sync::Mutex::new(log_receivers.into_iter().map(Some).collect()),
        replay: std::sync::Mutex::new(replay),
        restored_all: AtomicBool::new(false),
    });
    let config = shared.config.clone();
    let mesh = mesh::builder::<Executor>(executors);
    let cpus = config::online_cpus();
    // Printed on stdout (not the log) so scripts and tests can find a port-0 server.
    println!(
        "kvix-server listening on tcp://{} with {executors} executors, steering {:?}",
        group.addr, group.steering
    );
    let mut handles = Vec::with_capacity(executors);
    for (i, fd) in group.fds.into_iter().enumerate() {
        let placement = if config.pin {
            Placement::Fixed(i % cpus)
        } else {
            Placement::Unbound
        };
        let mut builder = LocalExecutorBuilder::new(placement)
            .name(&format!("kvix-{i}"))
            .io_memory(IO_MEMORY);
        if let Some(spin) = config.spin() {
            builder = builder.spin_before_park(spin);
        }
        let (shared, mesh) = (shared.clone(), mesh.clone());
        let handle = builder
            .spawn(move || async move { executor_main(fd, shared, mesh).await })
            .map_err(|e| anyhow::anyhow!("starting executor {i}: {e}"))?;
        handles.push(handle);
    }
    let mut first_error: Option<anyhow::Error> = None;
    for (i, h) in handles.into_iter().enumerate() {
        match h.join() {
            Ok(Ok(())) => {}
            // The reason a peer gave beats "another executor failed".
            Ok(Err(e)) if e.is::<PeerFailed>() => {
                first_error = first_error.or(Some(e.context(format!("executor {i}"))))
            }
            Ok(Err(e)) => {
                let replace = first_error
                    .as_ref()
                    .is_none_or(|f| f.root_cause().is::<PeerFailed>());
                if replace {
                    first_error = Some(e.context(format!("executor {i}")));
                }
            }
            Err(e) => {
                first_error = first_error.or(Some(anyhow::anyhow!("executor {i} panicked: {e:?}")))
            }
        }
    }
    ingest.stop();
    if let Some(r) = &replica {
        r.stop();
    }
    if !config.unix.is_empty() {
        let _ = std::fs::remove_file(&config.unix);
    }
    first_error.map_or(Ok(()), Err)
}

/// What every executor starts from.
struct Shared {
    config: Arc<Config>,
    metrics: Arc<[ExecutorMetrics]>,
    stop: Arc<AtomicBool>,
    ready: StartGate,
    serving: std::sync::Barrier,
    restored: Option<snapshot::ServerImage>,
    services: executor::Services,
    /// Each executor's end of the replicated log's follower, taken once.
    log_inboxes: std::sync::Mutex<Vec<Option<futures::channel::mpsc::Receiver<replica::LogJob>>>>,
    /// The write-ahead log's records, replayed by executor 0 before anyone is served.
    replay: std::sync::Mutex<Vec<write::Write>>,
    /// Set by executor 0 once the snapshot and the log are in: then connections are taken.
    restored_all: AtomicBool,
    /// Set by executor 0 once the shutdown snapshot is written; peers serve it until then.
    snapshot_done: AtomicBool,
}

/// An executor stopped because a peer could not start (the peer says why).
#[derive(Debug, thiserror::Error)]
#[error("another executor failed to start")]
struct PeerFailed;

/// Where executors report whether they restored: a failed one makes every other one stop
/// instead of waiting for it (a barrier would hang the process).
struct StartGate {
    state: std::sync::Mutex<(usize, bool)>,
    all_in: std::sync::Condvar,
    executors: usize,
}

impl StartGate {
    fn new(executors: usize) -> Self {
        StartGate {
            state: std::sync::Mutex::new((0, false)),
            all_in: std::sync::Condvar::new(),
            executors,
        }
    }

    /// Reports this executor's start and waits for the others; true when all started.
    fn arrive(&self, ok: bool) -> bool {
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
) -> anyhow::Result<(Core, Registry, Holders)> {
    let (mut core, mut registry, mut holders) = (Core::new(), Registry::new(), Holders::default());
    if let Some(image) = &shared.restored {
        let block = shared.config.block_size;
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
        for (w, h) in image.holders.iter().filter(|(w, _)| home(*w)) {
            let lanes = entries.iter().find(|e| e.id == *w).map(|e| &e.lanes[..]);
            if !lanes.is_some_and(|l| holders.import(*w, h, l, block)) {
                anyhow::bail!("the snapshot's ingest state of worker {w} does not fit its roster");
            }
        }
    }
    Ok((core, registry, holders))
}

/// Writes replayed before the replay waits for them to be applied everywhere.
const REPLAY_WINDOW: usize = 4096;

/// Applies the log's records in their order. Each write is queued on its worker's home
/// before [`route::route_write`] returns, so writes of one worker keep their order without
/// waiting on each other: only announces and retires (which number workers and change
/// every executor's roster) wait for everything before them and are awaited themselves.
async fn replay(ex: &Rc<Executor>, records: Vec<write::Write>) {
    let mut pending = Vec::with_capacity(REPLAY_WINDOW);
    for r in records {
        let roster = r.changes_roster();
        if roster || pending.len() >= REPLAY_WINDOW {
            for p in pending.drain(..) {
                let _ = p.await;
            }
        }
        let done = route::route_write(ex, r, route::Origin::Logged);
        if roster {
            let _ = done.await;
        } else {
            pending.push(done);
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
            ex.ingest().restore(*w, source.clone());
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
    let parts: Vec<_> = (0..ex.executors())
        .map(|e| {
            ex.on(e, |on| {
                Box::pin(std::future::ready(Ok(on.holders().lasts())))
            })
        })
        .collect();
    let mut lasts = std::collections::HashMap::new();
    for p in parts {
        lasts.extend(p.await.unwrap_or_default());
    }
    ex.ingest().resume(
        |w| lasts.get(&w).copied().flatten(),
        |w| ex.registry().name_of(w).unwrap_or_default().to_string(),
    );
}

async fn executor_main(
    fd: std::os::fd::RawFd,
    shared: Arc<Shared>,
    mesh: mesh::Builder<Executor>,
) -> anyhow::Result<()> {
    let config = shared.config.clone();
    // SAFETY: the fd is a listening TCP socket created for this executor alone.
    let tcp = unsafe { glommio::net::TcpListener::from_raw_fd(fd) };
    let gx = glommio::executor();
    // Queries (every connection) before writes: connections run in a latency-sensitive
    // queue, the write queue in a throughput one, and long writes yield between slices.
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
    let (core, registry, holders) = restored?;
    let (jobs, queue) = glommio::channels::local_channel::new_unbounded();
    let ex = Executor::new(
        config.clone(),
        shared.metrics.clone(),
        mesh,
        core,
        registry,
        holders,
        shared.services.clone(),
        jobs,
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
    if let (Some(rx), Some(_)) = (log_inbox, ex.replica()) {
        glommio::spawn_local_into(route::serve_log(ex.clone(), rx), writes)
            .map_err(|e| anyhow::anyhow!("starting the log inbox: {e}"))?
            .detach();
    }
    if let Some(deliveries) = shared.services.ingest.take_inbox(me) {
        glommio::spawn_local_into(route::serve_deliveries(ex.clone(), deliveries), writes)
            .map_err(|e| anyhow::anyhow!("starting the ingest inbox: {e}"))?
            .detach();
    }
    // Blocking here is fine: nothing on this executor may run before its peers are wired.
    shared.serving.wait();
    if me == 0 {
        finish_restore(&ex, &shared).await;
        if let Some(r) = ex.replica() {
            // A replica serves once it has applied the log as far as it went at start.
            while !r.caught_up.load(Ordering::Relaxed) && !shared.stop.load(Ordering::Relaxed) {
                glommio::timer::sleep(Duration::from_millis(5)).await;
            }
        }
        shared.restored_all.store(true, Ordering::Release);
    }
    // Nobody is served before the log is replayed (a client's write would interleave).
    while !shared.restored_all.load(Ordering::Acquire) {
        glommio::timer::sleep(Duration::from_millis(1)).await;
    }
    if me == 0 && !config.metrics.is_empty() {
        let addr = &config.metrics;
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
    if me == 0 && !config.unix.is_empty() {
        let unix = glommio::net::UnixListener::bind(&config.unix)
            .map_err(|e| anyhow::anyhow!("binding Unix socket {}: {e}", config.unix))?;
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::Permissions::from_mode(config.unix_mode);
            std::fs::set_permissions(&config.unix, mode).map_err(|e| {
                anyhow::anyhow!("setting the mode of Unix socket {}: {e}", config.unix)
            })?;
        }
        println!("kvix-server listening on unix://{}", config.unix);
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
    let snapshot_ticks = config.snapshot_every.saturating_mul(20);
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
        shared.snapshot_done.store(true, Ordering::Release);
        last?;
    } else {
        // Keep answering executor 0's export until the last snapshot is on disk.
        while !shared.snapshot_done.load(Ordering::Acquire) {
            glommio::timer::sleep(Duration::from_millis(5)).await;
        }
    }
    tracing::info!(executor = me, "executor stopping");
    Ok(())
}

/// Gathers every executor's part and writes a snapshot when `--snapshot` is set. The file
/// is written by a helper thread so the executor keeps serving; at shutdown we wait for it
/// and say whether it was written.
async fn take_snapshot(ex: &Rc<Executor>, last: bool) -> anyhow::Result<()> {
    let Some(path) = ex.config().snapshot.clone() else {
        return Ok(());
    };
    if last {
        // Client writes are refused now: once every accepted one is applied everywhere,
        // the parts cover the whole log and a restart has nothing to replay (engine
        // deliveries arriving meanwhile go to the next generation).
        for _ in 0..2 {
            let drains: Vec<_> = (0..ex.executors()).map(|e| ex.on(e, drain)).collect();
            for d in drains {
                let _ = d.await;
            }
        }
    }
    // Everything appended from here on may be missing from the parts: replay it. At the
    // last snapshot nothing before the rotation is.
    let wal_from = match ex.wal().map(|w| w.rotate()).transpose() {
        Ok(g) => g.map_or(0, |old| if last { old + 1 } else { old }),
        Err(e) => {
            ExecutorMetrics::add(&ex.metrics().snapshot_failures, 1);
            anyhow::bail!("snapshot not taken: {e}");
        }
    };
    // Replicas: every part cut at the same stream position, by the follower.
    let (parts, log_position): (
        Vec<LocalFuture<Result<snapshot::Part, failure::Failure>>>,
        String,
    ) = match ex.replica() {
        Some(r) => {
            let Ok(mark) = r.mark().await else {
                anyhow::bail!("snapshot not taken: the log follower stopped");
            };
            let parts = mark
                .parts
                .into_iter()
                .map(|rx| -> LocalFuture<_> {
                    Box::pin(async move {
                        rx.await.map_err(|_| {
                            failure::Failure::new(kvix_wire::ErrorCode::Internal, "stopping")
                        })
                    })
                })
                .collect();
            (parts, mark.position)
        }
        None => (
            (0..ex.executors())
                .map(|e| ex.queue_on(e, writer::export))
                .collect(),
            String::new(),
        ),
    };
    let mut image = snapshot::ServerImage {
        wal_from,
        log_position: log_position.clone(),
        engine: EngineImage {
            workers: ex.registry().export(),
            ..Default::default()
        },
        sources: ex.ingest().sources(),
        holders: Vec::new(),
    };
    for part in parts {
        match part.await {
            Ok(p) => {
                image.engine.runs.extend(p.runs);
                image.engine.feeds.extend(p.feeds);
                image.holders.extend(p.holders);
            }
            Err(f) => {
                ExecutorMetrics::add(&ex.metrics().snapshot_failures, 1);
                tracing::error!("snapshot not taken: {}", f.message);
                anyhow::bail!("snapshot not taken: {}", f.message);
            }
        }
    }
    image.engine.feeds.sort_unstable_by_key(|(w, _)| *w);
    image.holders.sort_unstable_by_key(|(w, _)| *w);
    let bytes = snapshot::encode(&image, ex.config().block_size);
    let (written, failed) = (
        ex.metrics().snapshots.clone(),
        ex.metrics().snapshot_failures.clone(),
    );
    let wal = ex.wal().cloned();
    let replica = ex.replica().cloned();
    let writer = std::thread::spawn(move || match snapshot::write(&path, &bytes) {
        Ok(()) => {
            written.fetch_add(1, Ordering::Relaxed);
            if let Some(r) = replica {
                if let Err(e) = replica::follower::publish_snapshot(&r, &bytes, &log_position) {
                    tracing::warn!("snapshot not stored in Redis: {e}");
                }
            }
            tracing::info!(path = %path.display(), bytes = bytes.len(), "snapshot written");
            // The log below the snapshot's start is in the file now.
            if let Some(Err(e)) = wal.map(|w| w.drop_below(wal_from)) {
                tracing::warn!("write-ahead log: old generations not removed: {e}");
            }
            Ok(())
        }
        Err(e) => {
            failed.fetch_add(1, Ordering::Relaxed);
            tracing::error!(path = %path.display(), "snapshot not written: {e}");
            Err(anyhow::anyhow!(
                "snapshot {} not written: {e}",
                path.display()
            ))
        }
    });
    if last {
        return writer
            .join()
            .unwrap_or_else(|_| Err(anyhow::anyhow!("the snapshot writer panicked")));
    }
    Ok(())
}

/// Waits, on executor `on`, until the writes accepted so far are applied everywhere (a
/// clean stop's last snapshot then covers the whole log): it flushes every executor's
/// write queue through `on`'s own channels, so each flush arrives behind every write `on`
/// sent before. Run on every executor once, it sees each accepted write through its
/// home's queue (which then sent its update to the others); run on every executor a
/// second time, it sees those updates applied.
fn drain(on: &Rc<Executor>) -> mesh::LocalFuture<Result<(), failure::Failure>> {
    let flushes: Vec<_> = (0..on.executors())
        .map(|e| on.queue_on(e, writer::flush))
        .collect();
    Box::pin(async move {
        for f in flushes {
            let _ = f.await;
        }
        Ok(())
    })
}
