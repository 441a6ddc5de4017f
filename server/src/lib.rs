//! kvix-server: the shared prefix-cache index as a thread-per-core service.
//!
//! Data path, top to bottom: [`listener`] (sockets, [`steering`]) → [`conn`] (frames)
//! → [`handler`] (messages) → [`shard`] (this core's index, [`mesh`] to the others)
//! → `kvix_engine` (the index itself) → the answer frame back through [`conn`].

pub mod config;
pub mod conn;
pub mod handler;
pub mod http;
pub mod ingest;
pub mod listener;
pub mod mesh;
pub mod metrics;
pub mod ops;
pub mod shard;
pub mod snapshot;
pub mod steering;

use std::os::fd::FromRawFd;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use glommio::{LocalExecutorBuilder, Placement};

pub use config::Config;
use metrics::ShardMetrics;
use ops::{ShardRep, ShardReq};
use shard::Shard;

/// Per-executor I/O memory: small enough for the default 8 MiB RLIMIT_MEMLOCK.
const IO_MEMORY: usize = 512 << 10;

/// Starts one executor per shard and serves until SIGINT or SIGTERM.
pub fn run(config: Config) -> anyhow::Result<()> {
    let executors = config.executors();
    let group = listener::tcp_group(config.listen, executors, config.steering)?;
    if !config.unix.is_empty() {
        listener::free_unix_path(&config.unix)?;
    }
    let stop = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(sig, stop.clone()).context("installing signal handlers")?;
    }
    ingest::init(ingest::Settings {
        addr: group.addr,
        auth: config.auth_token.clone(),
        block_size: config.block_size,
    })
    .context("starting the event ingest")?;
    // A snapshot that cannot be read whole stops the start: never serve half an index.
    let restored = match &config.snapshot {
        Some(path) => snapshot::load(path, config.block_size)?,
        None => None,
    };
    if let Some(image) = &restored {
        tracing::info!(
            workers = image.workers.len(),
            runs = image.runs.len(),
            "restoring snapshot"
        );
    }
    let shared = Arc::new(Shared {
        config: Arc::new(config),
        metrics: (0..executors).map(|_| ShardMetrics::default()).collect(),
        stop,
        // No executor serves before every shard is wired to the mesh and restored.
        ready: std::sync::Barrier::new(executors),
        restored,
        snapshot_done: AtomicBool::new(false),
    });
    let config = shared.config.clone();
    let mesh = mesh::builder::<ShardReq, ShardRep>(executors);
    let cpus = config::online_cpus();
    // Printed on stdout (not the log) so scripts and tests can find a port-0 server.
    println!(
        "kvix-server listening on tcp://{} with {executors} shards, steering {:?}",
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
            .spawn(move || async move { executor_main(i, fd, shared, mesh).await })
            .map_err(|e| anyhow::anyhow!("starting executor {i}: {e}"))?;
        handles.push(handle);
    }
    let mut first_error = None;
    for (i, h) in handles.into_iter().enumerate() {
        match h.join() {
            Ok(Ok(())) => {}
            Ok(Err(e)) => first_error = first_error.or(Some(e.context(format!("executor {i}")))),
            Err(e) => {
                first_error = first_error.or(Some(anyhow::anyhow!("executor {i} panicked: {e:?}")))
            }
        }
    }
    if !config.unix.is_empty() {
        let _ = std::fs::remove_file(&config.unix);
    }
    first_error.map_or(Ok(()), Err)
}

/// What every executor starts from.
struct Shared {
    config: Arc<Config>,
    metrics: Arc<[ShardMetrics]>,
    stop: Arc<AtomicBool>,
    ready: std::sync::Barrier,
    restored: Option<kvix_engine::EngineImage>,
    /// Set by shard 0 once the shutdown snapshot is written; peers serve it until then.
    snapshot_done: AtomicBool,
}

async fn executor_main(
    index: usize,
    fd: std::os::fd::RawFd,
    shared: Arc<Shared>,
    mesh: mesh::Builder<ShardReq, ShardRep>,
) -> anyhow::Result<()> {
    let (config, all_metrics) = (shared.config.clone(), shared.metrics.clone());
    // SAFETY: the fd is a listening TCP socket created for this executor alone.
    let tcp = unsafe { glommio::net::TcpListener::from_raw_fd(fd) };
    let shards = all_metrics.len();
    // Shard ids come from the mesh; the executor index only picks the socket.
    let cell: Rc<std::cell::OnceCell<Rc<Shard>>> = Rc::new(std::cell::OnceCell::new());
    let handler_cell = cell.clone();
    let joined = mesh::Mesh::join(mesh, move |req| {
        let shard = handler_cell
            .get()
            .expect("shard built before peers call")
            .clone();
        shard.execute(req)
    })
    .await?;
    let shard = Shard::new(config.clone(), all_metrics.clone(), joined.me(), shards);
    shard.set_mesh(joined);
    let _ = cell.set(shard.clone());
    if let Some(image) = &shared.restored {
        shard.restore(image).context("restoring the snapshot")?;
    }
    // Blocking here is fine: nothing on this executor may run before its peers are wired.
    shared.ready.wait();
    if index == 0 && !config.metrics.is_empty() {
        let addr = &shard.config().metrics;
        let l = glommio::net::TcpListener::bind(addr.as_str())
            .map_err(|e| anyhow::anyhow!("binding metrics on {addr}: {e}"))?;
        let bound = l
            .local_addr()
            .map_err(|e| anyhow::anyhow!("metrics address: {e}"))?;
        println!("kvix-server metrics on http://{bound}/metrics");
        glommio::spawn_local(http::serve(l, all_metrics.clone())).detach();
    }
    if index == 0 && !config.unix.is_empty() {
        let unix = glommio::net::UnixListener::bind(&config.unix)
            .map_err(|e| anyhow::anyhow!("binding Unix socket {}: {e}", config.unix))?;
        println!("kvix-server listening on unix://{}", config.unix);
        let shard = shard.clone();
        glommio::spawn_local(async move {
            loop {
                match unix.accept().await {
                    Ok(s) => spawn_conn(&shard, s),
                    Err(e) => tracing::warn!("unix accept: {e}"),
                }
            }
        })
        .detach();
    }
    let accept = {
        let shard = shard.clone();
        glommio::spawn_local(async move {
            loop {
                match tcp.accept().await {
                    Ok(s) => {
                        let _ = s.set_nodelay(true);
                        spawn_conn(&shard, s);
                    }
                    Err(e) => {
                        tracing::warn!("accept: {e}");
                        glommio::timer::sleep(Duration::from_millis(10)).await;
                    }
                }
            }
        })
    };
    let snapshot_ticks = config.snapshot_every.saturating_mul(20);
    let mut ticks = 0u64;
    while !shared.stop.load(Ordering::Relaxed) {
        glommio::timer::sleep(Duration::from_millis(50)).await;
        ticks += 1;
        if ticks.is_multiple_of(20) {
            let _ = shard.expire().await;
        }
        if shard.me() == 0 && snapshot_ticks > 0 && ticks.is_multiple_of(snapshot_ticks) {
            take_snapshot(&shard, false).await;
        }
    }
    drop(accept);
    if shard.me() == 0 {
        take_snapshot(&shard, true).await;
        shared.snapshot_done.store(true, Ordering::Release);
    } else {
        // Keep answering shard 0's export until the last snapshot is on disk.
        while !shared.snapshot_done.load(Ordering::Acquire) {
            glommio::timer::sleep(Duration::from_millis(5)).await;
        }
    }
    tracing::info!(shard = shard.me(), "executor stopping");
    Ok(())
}

/// Gathers and writes a snapshot when `--snapshot` is set. The file is written by a
/// helper thread so the executor keeps serving; at shutdown we wait for it.
async fn take_snapshot(shard: &Rc<Shard>, last: bool) {
    let Some(path) = shard.config().snapshot.clone() else {
        return;
    };
    let image = match shard.snapshot().await {
        Ok(image) => image,
        Err(e) => return tracing::error!("snapshot not taken: {}", e.message),
    };
    let bytes = snapshot::encode(&image, shard.config().block_size);
    let writer = std::thread::spawn(move || {
        let done = snapshot::write(&path, &bytes);
        match &done {
            Ok(()) => {
                tracing::info!(path = %path.display(), bytes = bytes.len(), "snapshot written")
            }
            Err(e) => tracing::error!(path = %path.display(), "snapshot not written: {e}"),
        }
    });
    if last {
        let _ = writer.join();
    }
}

/// Serves a new connection unless this executor is at its connection limit.
fn spawn_conn<S>(shard: &Rc<Shard>, stream: S)
where
    S: futures_lite::AsyncRead + futures_lite::AsyncWrite + Unpin + 'static,
{
    let m = shard.metrics();
    if m.connections_open.load(Ordering::Relaxed) as usize >= shard.config().max_connections {
        m.reject(metrics::Rejected::Overloaded);
        let shard = shard.clone();
        glommio::spawn_local(async move { conn::refuse_overloaded(stream, &shard).await }).detach();
        return;
    }
    ShardMetrics::add(&m.connections_total, 1);
    m.connections_open.fetch_add(1, Ordering::Relaxed);
    let shard = shard.clone();
    glommio::spawn_local(async move {
        conn::serve(stream, shard.clone()).await;
        shard
            .metrics()
            .connections_open
            .fetch_sub(1, Ordering::Relaxed);
    })
    .detach();
}
