//! One executor, from start to stop, in the phases of [`super::phases`]: restore its copy,
//! wire it (mesh end, write queue, the log's and the ingest's inboxes), replay (executor
//! 0), serve (listeners; the placement expiry and snapshot timers), drain (the last
//! snapshot), stop.

use std::os::fd::{FromRawFd, RawFd};
use std::rc::Rc;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use glommio::{Latency, Shares, TaskQueueHandle};

use super::phases::Barrier;
use super::{restore, Shared};
use crate::admit::Protocol;
use crate::checkpoint::take_snapshot;
use crate::durable::replica;
use crate::error::StartError;
use crate::executor::Executor;
use crate::metrics::ExecutorMetrics;
use crate::{admit, http, listener, mesh, write};

/// The executor's two task queues: connections (queries) before writes, with ten
/// times the write queue's shares (long writes yield between slices). Neither is
/// `Latency::Matters`: with it, glommio lost wakeups here (docs/design.md).
struct Queues {
    queries: TaskQueueHandle,
    writes: TaskQueueHandle,
}

/// This executor's listening sockets: the kvix port's, and the HTTP API's if any.
pub struct Sockets {
    pub kvix: RawFd,
    pub http: Option<RawFd>,
}

/// Runs one executor on its listening sockets until the process stops.
pub async fn run(
    sockets: Sockets,
    shared: Arc<Shared>,
    mesh: mesh::Builder<Executor>,
) -> Result<(), StartError> {
    let fd = sockets.kvix;
    // SAFETY: the fd is a listening TCP socket created for this executor alone.
    let tcp = unsafe { glommio::net::TcpListener::from_raw_fd(fd) };
    let gx = glommio::executor();
    let queues = Queues {
        queries: gx.create_task_queue(Shares::Static(1000), Latency::NotImportant, "queries"),
        writes: gx.create_task_queue(Shares::Static(100), Latency::NotImportant, "writes"),
    };
    let ex = wire(&shared, mesh, &queues).await?;
    // Blocking here is fine: nothing on this executor may run before its peers are wired.
    let wired = shared.phases.arrive(Barrier::Wired, true);
    wired?;
    if ex.me() == 0 {
        restore::finish(&ex, &shared).await;
        caught_up(&ex, &shared).await;
        shared.phases.replayed();
    }
    // Nobody is served before the log is replayed (a client's write would interleave).
    shared.phases.until_replayed().await;
    let accepting = listen(&ex, &shared, &queues, tcp, fd)?;
    let http = sockets
        .http
        .map(|fd| listen_http(&ex, &queues, fd))
        .transpose()?;
    tick(&ex, &shared).await;
    drop(accepting);
    drop(http);
    let drained = drain(&ex, &shared).await;
    tracing::info!(executor = ex.me(), "executor stopping");
    drained
}

/// Restores this executor's copy and starts its write queue and inboxes.
async fn wire(
    shared: &Arc<Shared>,
    mesh: mesh::Builder<Executor>,
    q: &Queues,
) -> Result<Rc<Executor>, StartError> {
    let metrics = shared.metrics.clone();
    let hop = move |me: usize| -> Box<dyn Fn()> {
        Box::new(move || ExecutorMetrics::add(&metrics[me].query_hops, 1))
    };
    let (mesh, inbox) = mesh::Mesh::join(mesh, hop).await?;
    let me = mesh.me();
    let restored = restore::executor(shared, me, mesh.executors());
    // Every executor reports here, failed or not, so none waits for a peer that left.
    let all = shared.phases.arrive(Barrier::Restored, restored.is_ok());
    let (core, registry, states) = restored?;
    all?;
    let (jobs, queue) = glommio::channels::local_channel::new_unbounded();
    let appender = shared.services.log.shared().cloned();
    let log_appender = appender
        .map(|r| replica::appender::Appender::start(r, q.writes))
        .transpose()?;
    let settings = shared.config.executor_settings();
    let ex = Executor::new(
        settings,
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
    admit::set_conn_queue(q.queries);
    inbox.run_for(&ex);
    let spawn = |what: &'static str, task: futures::future::LocalBoxFuture<'static, ()>| {
        glommio::spawn_local_into(task, q.writes)
            .map(glommio::Task::detach)
            .map_err(StartError::spawn(what))
    };
    spawn(
        "the write queue",
        Box::pin(write::queue::run(ex.clone(), queue)),
    )?;
    let log_inbox = shared.log_inboxes.lock().unwrap_or_else(|p| p.into_inner())[me].take();
    if let (Some(rx), Some(r)) = (log_inbox, ex.log().shared()) {
        spawn(
            "the log inbox",
            Box::pin(write::inbox::serve_log(ex.clone(), rx, {
                let builder = restore::Builder::of(shared);
                Rc::new(
                    move |ex: &Rc<Executor>, image: &_| Ok(builder.restore_in_place(ex, image)?),
                )
            })),
        )?;
        // The follower runs on executor 0: its barriers (announces, retires) are applied
        // there, in place.
        if let Some(follow) = (me == 0).then(|| r.take_follow()).flatten() {
            let at = ex.clone();
            let base: replica::MakeBase =
                Box::new(move |parts, mark| crate::checkpoint::rebuilt_base(&at, parts, mark));
            let follower = replica::follower::run(r.clone(), follow, base);
            spawn("the log follower", Box::pin(follower))?;
        }
    }
    if let Some(deliveries) = shared.services.ingest.take_inbox(me) {
        let inbox = write::inbox::serve_deliveries(ex.clone(), deliveries);
        spawn("the ingest inbox", Box::pin(inbox))?;
    }
    Ok(ex)
}

/// A replica serves once it has applied the log as far as it went at start (or stops,
/// if told to before).
async fn caught_up(ex: &Rc<Executor>, shared: &Shared) {
    let Some(r) = ex.log().shared() else { return };
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

/// Starts taking connections: the TCP socket on every executor, the metrics endpoint
/// and the Unix socket on executor 0. Connections are taken until the task is dropped.
fn listen(
    ex: &Rc<Executor>,
    shared: &Shared,
    q: &Queues,
    tcp: glommio::net::TcpListener,
    fd: RawFd,
) -> Result<glommio::Task<()>, StartError> {
    let config = &shared.config;
    if ex.me() == 0 && !config.listen.metrics.is_empty() {
        let addr = &config.listen.metrics;
        let fd = listener::metrics_socket(addr)?;
        // SAFETY: a listening TCP socket made for this listener alone.
        let l = unsafe { glommio::net::TcpListener::from_raw_fd(fd) };
        let bound = l
            .local_addr()
            .map_err(|e| StartError::io("the metrics address")(e.into()))?;
        println!("kvix-server metrics on http://{bound}/metrics");
        let replica = ex.log().shared().cloned();
        let serve = http::serve_metrics(l, shared.metrics.clone(), replica, ex.clone());
        glommio::spawn_local(serve).detach();
    }
    if ex.me() == 0 && !config.listen.unix.is_empty() {
        let path = &config.listen.unix;
        let unix = glommio::net::UnixListener::bind(path)
            .map_err(|e| StartError::io(format!("binding Unix socket {path}"))(e.into()))?;
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::Permissions::from_mode(config.listen.unix_mode);
        std::fs::set_permissions(path, mode).map_err(StartError::io(format!(
            "setting the mode of Unix socket {path}"
        )))?;
        println!("kvix-server listening on unix://{path}");
        let (ex, queries) = (ex.clone(), q.queries);
        let accept = async move {
            loop {
                match unix.shared_accept().await {
                    Ok(s) => admit::admit(&ex, s, queries, Protocol::Kvix),
                    Err(e) => admit::accept_failed(&ex, "unix", e, None).await,
                }
            }
        };
        glommio::spawn_local_into(accept, q.queries)
            .map_err(StartError::spawn("the Unix listener"))?
            .detach();
    }
    accept_tcp(ex, q, tcp, fd, Protocol::Kvix)
}

/// Takes `protocol`'s connections on this executor's TCP socket `fd` (`listener`), until
/// the task is dropped.
fn accept_tcp(
    ex: &Rc<Executor>,
    q: &Queues,
    listener: glommio::net::TcpListener,
    fd: RawFd,
    protocol: Protocol,
) -> Result<glommio::Task<()>, StartError> {
    let (ex, queries) = (ex.clone(), q.queries);
    let what = match protocol {
        Protocol::Kvix => "tcp",
        Protocol::Http => "http",
    };
    let accept = async move {
        loop {
            match listener.shared_accept().await {
                Ok(s) => admit::admit(&ex, s, queries, protocol),
                Err(e) => admit::accept_failed(&ex, what, e, Some(fd)).await,
            }
        }
    };
    glommio::spawn_local_into(accept, q.queries).map_err(StartError::spawn("a TCP listener"))
}

/// Starts taking HTTP API connections on this executor's socket of `--http`.
fn listen_http(ex: &Rc<Executor>, q: &Queues, fd: RawFd) -> Result<glommio::Task<()>, StartError> {
    // SAFETY: a listening TCP socket made for this executor alone.
    let http = unsafe { glommio::net::TcpListener::from_raw_fd(fd) };
    accept_tcp(ex, q, http, fd, Protocol::Http)
}

/// The executor's timers until the process is told to stop: placements expire every
/// second; executor 0 takes a snapshot every `--snapshot-every`.
async fn tick(ex: &Rc<Executor>, shared: &Shared) {
    let snapshot_ticks = shared.config.durability.snapshot_every.saturating_mul(20);
    let mut ticks = 0u64;
    while !shared.stop.load(Ordering::Relaxed) {
        glommio::timer::sleep(Duration::from_millis(50)).await;
        ticks += 1;
        if ticks.is_multiple_of(20) {
            drop(ex.queue(write::queue::expire));
        }
        if ex.me() == 0 {
            if let Some(why) = ex.log().shared().and_then(|r| r.broken()) {
                // What a restart may cure (a start reads the log afresh), a restart
                // does: the process exits non-zero for its supervisor to start again.
                tracing::error!("exiting: {why}");
                shared.stop.store(true, Ordering::Relaxed);
                break;
            }
        }
        if ex.me() == 0 && snapshot_ticks > 0 && ticks.is_multiple_of(snapshot_ticks) {
            // A failure is counted and logged; the next period tries again.
            let _ = take_snapshot(ex, false).await;
        }
    }
}

/// Executor 0 writes the last snapshot; the others answer its export until it is done.
async fn drain(ex: &Rc<Executor>, shared: &Shared) -> Result<(), StartError> {
    if ex.me() == 0 {
        let last = take_snapshot(ex, true).await;
        shared.phases.drained();
        last
    } else {
        shared.phases.until_drained().await;
        Ok(())
    }
}
