//! The process, from its flags to running executors and back, in one order:
//!
//! 1. **open**: the listening sockets (refused when another process serves a port), the
//!    signal handlers, the open-files limit, the TLS configuration;
//! 2. **load**: the fleet file checked, the ingest threads started, the snapshot and the
//!    write-ahead log read ([`restore::load`]), the replicas' log joined;
//! 3. **run**: one executor per core ([`executor::run`]), through the phases of
//!    [`phases`]: restored, wired, replayed, serving until SIGINT or SIGTERM, drained;
//! 4. **stop**: the ingest and the log stopped, the Unix socket removed, the first
//!    executor's error (the one that caused the others' to stop) returned.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use glommio::{LocalExecutorBuilder, Placement};

use crate::config::Config;
use crate::durable::{replica, snapshot, Log};
use crate::error::StartError;
use crate::executor::{Executor, Services};
use crate::ingest::Ingest;
use crate::listener::TcpGroup;
use crate::metrics::ExecutorMetrics;
use crate::write;
use crate::{admit, ingest, listener, mesh, rlimit};

mod cpus;
pub mod executor;
pub mod phases;
pub mod restore;

/// Per-executor I/O memory: small enough for the default 8 MiB RLIMIT_MEMLOCK.
const IO_MEMORY: usize = 512 << 10;

/// What every executor starts from.
pub struct Shared {
    pub config: Arc<Config>,
    pub metrics: Arc<[ExecutorMetrics]>,
    /// Set by a signal: the executors stop serving and drain.
    pub stop: Arc<AtomicBool>,
    pub phases: phases::Phases,
    pub restored: Option<snapshot::ServerImage>,
    pub services: Services,
    /// Each executor's end of the replicated log's follower, taken once.
    pub log_inboxes:
        std::sync::Mutex<Vec<Option<futures::channel::mpsc::Receiver<replica::LogJob>>>>,
    /// The write-ahead log's records, replayed by executor 0 before anyone is served.
    pub replay: std::sync::Mutex<Vec<write::Write>>,
}

/// Starts one executor per core and serves until SIGINT or SIGTERM.
pub fn run(config: Config) -> Result<(), StartError> {
    run_with(config, Arc::new(crate::clock::SystemClock::new()))
}

/// [`run`] on `clock` (a test's [`crate::clock::ManualClock`]).
pub fn run_with(config: Config, clock: Arc<dyn crate::clock::Clock>) -> Result<(), StartError> {
    let executors = config.executors();
    let (group, http, tls) = open(&config)?;
    let stop = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(sig, stop.clone())
            .map_err(StartError::io("installing signal handlers"))?;
    }
    raise_open_files(&config);
    admit::reserve::hold();
    let ingest = start_ingest(&config)?;
    let loaded = restore::load(&config)?;
    let (log_inboxes, log_receivers): (Vec<_>, Vec<_>) = (0..executors)
        .map(|_| futures::channel::mpsc::channel(256))
        .unzip();
    let replica = match &config.durability.log {
        Some(log) => {
            let from = loaded.image.as_ref().map_or("0-0".to_string(), |i| {
                replica::LogMark::parse(&i.log_position).position
            });
            let r = replica::Replica::new(
                log.clone(),
                loaded.generation,
                (loaded.fleet, config.index.block_size),
                from,
                log_inboxes,
            )?;
            ingest.set_leased();
            let (r2, ing) = (r.clone(), ingest.clone());
            std::thread::Builder::new()
                .name("kvix-lease".into())
                .spawn(move || replica::lease::run(r2, ing))
                .map_err(StartError::io("starting the ingest lease thread"))?;
            Some(r)
        }
        None => None,
    };
    let metrics: Arc<[ExecutorMetrics]> =
        (0..executors).map(|_| ExecutorMetrics::default()).collect();
    metrics[0]
        .wal_cut_bytes
        .store(loaded.wal_cut_bytes, Ordering::Relaxed);
    metrics[0]
        .wal_damage
        .store(loaded.wal_damage, Ordering::Relaxed);
    let shared = Arc::new(Shared {
        config: Arc::new(config),
        metrics,
        stop: stop.clone(),
        phases: phases::Phases::new(executors),
        restored: loaded.image,
        services: Services {
            ingest: ingest.clone(),
            log: match (loaded.wal, replica.clone()) {
                (Some(wal), _) => Log::Wal(wal),
                (None, Some(r)) => Log::Shared(r),
                (None, None) => Log::None,
            },
            stopping: stop,
            clock,
            tls,
        },
        log_inboxes: std::sync::Mutex::new(log_receivers.into_iter().map(Some).collect()),
        replay: std::sync::Mutex::new(loaded.records),
    });
    // Printed on stdout (not the log) so scripts and tests can find a port-0 server.
    println!(
        "kvix-server listening on tcp://{} with {executors} executors, steering {:?}",
        group.addr, group.steering
    );
    if let Some(h) = &http {
        println!("kvix-server HTTP API on http://{}", h.addr);
    }
    let ran = run_executors(&shared, group, http);
    ingest.stop();
    let broken = replica.as_ref().and_then(|r| r.broken());
    if let Some(r) = &replica {
        r.stop();
    }
    if !shared.config.listen.unix.is_empty() {
        let _ = std::fs::remove_file(&shared.config.listen.unix);
    }
    match broken {
        Some(why) => Err(StartError::LogStopped(why)),
        None => ran,
    }
}

/// The listening sockets (the kvix port's, the HTTP API's) and TLS: refused before
/// anything else starts when a port is served by another process or a file does not
/// read.
#[allow(clippy::type_complexity)]
fn open(
    config: &Config,
) -> Result<
    (
        TcpGroup,
        Option<TcpGroup>,
        Option<futures_rustls::TlsAcceptor>,
    ),
    StartError,
> {
    let tls = match (&config.tls.cert, &config.tls.key) {
        (Some(cert), Some(key)) => {
            let c = crate::tls::server_config(cert, key, config.tls.client_ca.as_deref())?;
            Some(futures_rustls::TlsAcceptor::from(c))
        }
        _ => None,
    };
    let executors = config.executors();
    let group = listener::tcp_group(config.listen.tcp, executors, config.executors.steering)?;
    // The HTTP API's connections go where the kernel's reuseport hash puts them.
    let http = config
        .listen
        .http
        .map(|addr| listener::tcp_group(addr, executors, crate::config::Steering::None))
        .transpose()?;
    if let Ok(metrics) = config.listen.metrics.parse() {
        listener::ensure_unserved(metrics)?;
    }
    if !config.listen.unix.is_empty() {
        listener::free_unix_path(&config.listen.unix)?;
    }
    Ok((group, http, tls))
}

fn raise_open_files(config: &Config) {
    let executors = config.executors();
    match rlimit::raise_open_files() {
        Ok((before, after)) => {
            let (conns, sources) = (config.conn.max_connections, config.ingest.max_sources);
            let wanted = rlimit::wanted(executors, conns, sources);
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
}

/// The ingest threads. A fleet file that does not read stops the start (at SIGHUP it
/// only changes nothing).
fn start_ingest(config: &Config) -> Result<Arc<Ingest>, StartError> {
    let block = config.index.block_size;
    if let Some(path) = &config.ingest.engines {
        let text = std::fs::read_to_string(path).map_err(|source| StartError::FleetFile {
            path: path.clone(),
            source,
        })?;
        ingest::engines_file::parse(&path.display().to_string(), &text, block)?;
    }
    let i = &config.ingest;
    let started = Ingest::start(
        i.ingest_threads,
        config.executors(),
        i.max_sources,
        i.source_networks()?,
        config.bind_spec()?,
        i.engines.clone().map(|p| (p, block)),
    )
    .map_err(StartError::io("starting the event ingest threads"))?;
    Ok(Arc::new(started))
}

/// One executor per listening socket, each on its own thread (pinned with `--pin`);
/// returns once all stopped, with the error that stopped the first to fail.
fn run_executors(
    shared: &Arc<Shared>,
    group: TcpGroup,
    http: Option<TcpGroup>,
) -> Result<(), StartError> {
    let executors = group.fds.len();
    let mut http_fds = http.map(|h| h.fds.into_iter());
    let mesh = mesh::builder::<Executor>(executors);
    let cpus = cpus::executor_cpus(executors);
    let mut handles = Vec::with_capacity(executors);
    for (i, fd) in group.fds.into_iter().enumerate() {
        let placement = match shared.config.executors.pin {
            true => Placement::Fixed(cpus[i]),
            false => Placement::Unbound,
        };
        let mut builder = LocalExecutorBuilder::new(placement)
            .name(&format!("kvix-{i}"))
            .io_memory(IO_MEMORY);
        if let Some(spin) = shared.config.executors.spin() {
            builder = builder.spin_before_park(spin);
        }
        let (shared, mesh) = (shared.clone(), mesh.clone());
        let sockets = executor::Sockets {
            kvix: fd,
            http: http_fds.as_mut().and_then(Iterator::next),
        };
        let handle = builder
            .spawn(move || async move { executor::run(sockets, shared, mesh).await })
            .map_err(StartError::spawn("an executor"))?;
        handles.push(handle);
    }
    let mut first: Option<StartError> = None;
    for (executor, h) in handles.into_iter().enumerate() {
        let failed = match h.join() {
            Ok(Ok(())) => continue,
            Ok(Err(e)) => StartError::Executor {
                executor,
                source: Box::new(e),
            },
            Err(e) => StartError::Panicked {
                executor,
                why: format!("{e:?}"),
            },
        };
        // The reason a peer gave beats "another executor failed".
        if first.as_ref().is_none_or(StartError::is_peer_failed) {
            first = Some(failed);
        }
    }
    first.map_or(Ok(()), Err)
}
