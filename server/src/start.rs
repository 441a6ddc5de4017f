//! The process, from its flags to running executors and back: signals and limits, the
//! engine-event ingest, the restore (the snapshot: our own, or the one the replicas'
//! log stores; then the write-ahead log), the replicas' log, one executor per core
//! ([`crate::serve`]), and what is stopped once they all returned.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use anyhow::Context;
use glommio::{LocalExecutorBuilder, Placement};

use crate::config::{self, Config};
use crate::durable::{replica, snapshot, wal};
use crate::executor::{self, Executor};
use crate::metrics::ExecutorMetrics;
use crate::serve::{PeerFailed, Shared, StartGate};
use crate::{admit, ingest, listener, mesh, rlimit, serve};

/// Per-executor I/O memory: small enough for the default 8 MiB RLIMIT_MEMLOCK.
const IO_MEMORY: usize = 512 << 10;

/// Starts one executor per core and serves until SIGINT or SIGTERM.
pub fn run(config: Config) -> anyhow::Result<()> {
    run_with(config, Arc::new(crate::clock::SystemClock::new()))
}

/// [`run`] on `clock` (a test's [`crate::clock::ManualClock`]).
pub fn run_with(config: Config, clock: Arc<dyn crate::clock::Clock>) -> anyhow::Result<()> {
    let executors = config.executors();
    let tls = match (&config.tls.cert, &config.tls.key) {
        (Some(cert), Some(key)) => Some(futures_rustls::TlsAcceptor::from(
            crate::tls::server_config(cert, key, config.tls.client_ca.as_deref())?,
        )),
        _ => None,
    };
    let group = listener::tcp_group(config.listen.tcp, executors, config.executors.steering)?;
    if let Ok(metrics) = config.listen.metrics.parse() {
        listener::ensure_unserved(metrics)?;
    }
    if !config.listen.unix.is_empty() {
        listener::free_unix_path(&config.listen.unix)?;
    }
    let stop = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(sig, stop.clone()).context("installing signal handlers")?;
    }
    match rlimit::raise_open_files() {
        Ok((before, after)) => {
            let wanted = rlimit::wanted(
                executors,
                config.conn.max_connections,
                config.ingest.max_sources,
            );
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
    // A fleet file that does not read stops the start (at SIGHUP it only changes nothing).
    if let Some(path) = &config.ingest.engines {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("--engines {}", path.display()))?;
        ingest::fleet::parse(&path.display().to_string(), &text, config.index.block_size)?;
    }
    let ingest = Arc::new(
        ingest::Ingest::start(
            config.ingest.ingest_threads,
            executors,
            config.ingest.max_sources,
            config
                .ingest
                .source_networks()
                .map_err(anyhow::Error::msg)?,
            config.bind_spec().map_err(anyhow::Error::msg)?,
            config
                .ingest
                .engines
                .clone()
                .map(|p| (p, config.index.block_size)),
        )
        .context("starting the event ingest threads")?,
    );
    // A snapshot that cannot be read whole stops the start: never serve half an index.
    let mut restored = match &config.durability.snapshot {
        Some(path) => {
            snapshot::check_writable(path)?;
            snapshot::load(path, config.index.block_size)?
        }
        None => None,
    };
    let mut generation = String::new();
    if let Some(log) = &config.durability.log {
        let fleet = format!(
            "fleet {:?}, --block-size {}",
            config.durability.fleet, config.index.block_size
        );
        let start = replica::follower::fetch_start(&log.server, &log.key, &fleet)
            .with_context(|| format!("reading the stored snapshot from {}", log.server))?;
        generation = start.generation;
        // A snapshot of another log (flushed, restarted without persistence, recreated
        // since) names workers that log numbered: this one starts without it.
        if let Some(mine) = &restored {
            let mark = replica::LogMark::parse(&mine.log_position);
            if mark.generation.as_ref().is_some_and(|g| *g != generation) {
                tracing::warn!(
                    snapshot = %config.durability.snapshot.as_deref().map_or("".into(), |p| p.display().to_string()),
                    "the snapshot is of another write log (generation {}; the log at {} is \
                     now generation {generation}): not loaded",
                    mark.generation.as_deref().unwrap_or(""),
                    log.server
                );
                restored = None;
            }
        }
        // A replica without its own snapshot (new, or too far behind a trimmed stream)
        // starts from the one the fleet stored in Redis.
        if let Some(bytes) = start.snapshot {
            let theirs = snapshot::decode(
                &bytes,
                config.index.block_size,
                "the snapshot stored in Redis",
            )?;
            let position = |s: &str| replica::id_key(&replica::LogMark::parse(s).position);
            let newer = restored
                .as_ref()
                .is_none_or(|mine| position(&theirs.log_position) > position(&mine.log_position));
            if newer {
                restored = Some(theirs);
            }
        }
    }
    let (mut wal_cut_bytes, mut wal_damage) = (0, 0);
    let (wal, replay) = match (&config.durability.snapshot, config.durability.wal) {
        (Some(path), true) => {
            let from = restored.as_ref().map_or(0, |i| i.wal_from);
            let opened = wal::Wal::open(
                path,
                from,
                config.durability.wal_sync_ms,
                config.durability.wal_recover,
            )
            .context("opening the write-ahead log")?;
            (wal_cut_bytes, wal_damage) = (opened.cut_bytes, opened.damage_cut);
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
    let replica = match &config.durability.log {
        Some(log) => {
            let from = restored.as_ref().map_or("0-0".to_string(), |i| {
                replica::LogMark::parse(&i.log_position).position
            });
            let r = replica::Replica::new(log.clone(), generation, from, log_inboxes)?;
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
                    m.wal_damage.store(wal_damage, Ordering::Relaxed);
                }
                m
            })
            .collect(),
        stop: stop.clone(),
        // No executor serves before every executor is wired to the mesh and restored.
        ready: StartGate::new(executors),
        serving: std::sync::Barrier::new(executors),
        restored,
        snapshot_done: crate::latch::Latch::new(),
        services: executor::Services {
            ingest: ingest.clone(),
            wal,
            replica: replica.clone(),
            stopping: stop.clone(),
            clock,
            tls,
        },
        log_inboxes: std::sync::Mutex::new(log_receivers.into_iter().map(Some).collect()),
        replay: std::sync::Mutex::new(replay),
        restored_all: crate::latch::Latch::new(),
    });
    let config = shared.config.clone();
    let mesh = mesh::builder::<Executor>(executors);
    let cpus = executor_cpus(executors);
    // Printed on stdout (not the log) so scripts and tests can find a port-0 server.
    println!(
        "kvix-server listening on tcp://{} with {executors} executors, steering {:?}",
        group.addr, group.steering
    );
    let mut handles = Vec::with_capacity(executors);
    for (i, fd) in group.fds.into_iter().enumerate() {
        let placement = if config.executors.pin {
            Placement::Fixed(cpus[i])
        } else {
            Placement::Unbound
        };
        let mut builder = LocalExecutorBuilder::new(placement)
            .name(&format!("kvix-{i}"))
            .io_memory(IO_MEMORY);
        if let Some(spin) = config.executors.spin() {
            builder = builder.spin_before_park(spin);
        }
        let (shared, mesh) = (shared.clone(), mesh.clone());
        let handle = builder
            .spawn(move || async move { serve::serve(fd, shared, mesh).await })
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
    if !config.listen.unix.is_empty() {
        let _ = std::fs::remove_file(&config.listen.unix);
    }
    first_error.map_or(Ok(()), Err)
}

/// The CPU each executor is pinned to, among those this process may run on (a container's
/// cpuset, `taskset`): a CPU outside them is refused by a cgroup cpuset, and escapes the
/// operator's `taskset`.
fn executor_cpus(executors: usize) -> Vec<usize> {
    assign_cpus(&allowed_cpus(), executors)
}

/// The CPUs this process may run on, in order (every online CPU if that cannot be read).
fn allowed_cpus() -> Vec<usize> {
    // SAFETY: sched_getaffinity fills the zeroed set it is given, of the size given.
    let allowed = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        (libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) == 0).then(
            || {
                (0..libc::CPU_SETSIZE as usize)
                    .filter(|&c| libc::CPU_ISSET(c, &set))
                    .collect::<Vec<_>>()
            },
        )
    };
    allowed
        .filter(|a| !a.is_empty())
        .unwrap_or_else(|| (0..config::online_cpus()).collect())
}

/// Executor i gets an allowed CPU c with c % executors == i where there is one (the
/// connection steering sends a connection to executor `cpu % executors`, the CPU that
/// took its SYN), else the next allowed CPU no executor has; more executors than CPUs
/// share them in turn.
fn assign_cpus(allowed: &[usize], executors: usize) -> Vec<usize> {
    let mut taken = vec![false; allowed.len()];
    let mut out = vec![usize::MAX; executors];
    for (i, cpu) in out.iter_mut().enumerate() {
        if let Some(k) = (0..allowed.len()).find(|&k| !taken[k] && allowed[k] % executors == i) {
            taken[k] = true;
            *cpu = allowed[k];
        }
    }
    for (i, cpu) in out.iter_mut().enumerate() {
        if *cpu != usize::MAX {
            continue;
        }
        *cpu = match (0..allowed.len()).find(|&k| !taken[k]) {
            Some(k) => {
                taken[k] = true;
                allowed[k]
            }
            None => allowed[i % allowed.len()],
        };
    }
    out
}

#[cfg(test)]
mod tests {
    use super::assign_cpus;

    #[test]
    fn executors_get_allowed_cpus_matching_the_steering_where_they_can() {
        assert_eq!(assign_cpus(&[0, 1, 2, 3], 4), [0, 1, 2, 3]);
        // A container's cpuset: each executor i on a CPU with cpu % 4 == i.
        assert_eq!(assign_cpus(&[2, 3, 4, 5], 4), [4, 5, 2, 3]);
        assert_eq!(assign_cpus(&[8, 9], 2), [8, 9]);
        // No CPU of the right residue: the next free one.
        assert_eq!(assign_cpus(&[4, 8], 2), [4, 8]);
        assert_eq!(assign_cpus(&[1], 1), [1]);
        // More executors than CPUs: shared in turn, never outside the set.
        assert_eq!(assign_cpus(&[6, 7], 4), [6, 7, 6, 7]);
    }
}
