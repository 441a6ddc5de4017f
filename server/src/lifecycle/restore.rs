//! What a start restores, in order: the snapshot (our own file, or the newer one the
//! replicas' log stores), then the write-ahead log over it (the process, before any
//! executor starts); each executor's copy of that snapshot; executor 0 then replays the
//! log's records through the write route and has the ingest subscribe every source where
//! its stream left off.

use std::rc::Rc;
use std::sync::atomic::Ordering;

use kvix_engine::{Core, Registry};

use super::Shared;
use crate::config::Config;
use crate::durable::{replica, snapshot, wal};
use crate::error::StartError;
use crate::executor::Executor;
use crate::ingest::states::IngestStates;
use crate::write;
use crate::write::Write;

/// What the process read before its executors start.
pub struct Loaded {
    /// The snapshot to restore, if any.
    pub image: Option<snapshot::ServerImage>,
    /// The replicas' log generation (empty without `--log`).
    pub generation: String,
    /// What the log's `KEY:fleet` says (empty without `--log`).
    pub fleet: String,
    pub wal: Option<std::sync::Arc<wal::Wal>>,
    /// The write-ahead log's records to replay over the snapshot.
    pub records: Vec<Write>,
    pub wal_cut_bytes: u64,
    pub wal_damage: u64,
}

/// Reads the snapshot and the write-ahead log. A snapshot that cannot be read whole
/// stops the start: never serve half an index.
pub fn load(config: &Config) -> Result<Loaded, StartError> {
    let block = config.index.block_size;
    let mut image = match &config.durability.snapshot {
        Some(path) => {
            snapshot::check_writable(path)?;
            snapshot::load(path, block)?
        }
        None => None,
    };
    let mut generation = String::new();
    let fleet = config.fleet();
    if let Some(log) = &config.durability.log {
        let found =
            replica::start::fetch_start(&log.server, &log.key, &fleet, config.durability.log_new)?;
        let start = match found {
            Some(start) => start,
            None => empty_log(config, log, &mut image)?,
        };
        generation = start.generation;
        image = image.filter(|mine| of_this_log(config, mine, &generation));
        // A replica without its own snapshot (new, or too far behind a trimmed stream)
        // starts from the one the fleet stored in Redis.
        if let Some(bytes) = start.snapshot {
            let theirs = snapshot::decode(&bytes, block, "the snapshot stored in Redis")?;
            let position = |s: &str| replica::id_key(&replica::LogMark::parse(s).position);
            let newer = image
                .as_ref()
                .is_none_or(|mine| position(&theirs.log_position) > position(&mine.log_position));
            if newer {
                image = Some(theirs);
            }
        }
    }
    let mut loaded = Loaded {
        image,
        generation,
        fleet,
        wal: None,
        records: Vec::new(),
        wal_cut_bytes: 0,
        wal_damage: 0,
    };
    if let (Some(path), true) = (&config.durability.snapshot, config.durability.wal) {
        let from = loaded.image.as_ref().map_or(0, |i| i.wal_from);
        let d = &config.durability;
        let opened = wal::Wal::open(path, from, d.wal_sync_ms, d.wal_recover)?;
        (loaded.wal_cut_bytes, loaded.wal_damage) = (opened.cut_bytes, opened.damage_cut);
        (loaded.wal, loaded.records) = (Some(opened.wal), opened.records);
    }
    if let Some(image) = &loaded.image {
        tracing::info!(
            workers = image.engine.workers.len(),
            runs = image.engine.runs.len(),
            sources = image.sources.len(),
            "restoring snapshot"
        );
    }
    Ok(loaded)
}

/// A log found empty: waits for it to be rebuilt, offering our snapshot file (if it is
/// of the lost log) as the base. If it is chosen, `image` is re-marked as the new
/// generation's start.
fn empty_log(
    config: &Config,
    log: &replica::LogUrl,
    image: &mut Option<snapshot::ServerImage>,
) -> Result<replica::start::LogStart, StartError> {
    let block = config.index.block_size;
    let base = |mine: &snapshot::ServerImage, at: &replica::LogMark| {
        replica::Base::of(mine.clone(), at, block)
    };
    let wait = std::time::Duration::from_secs(config.durability.log_empty_wait);
    let fleet = config.fleet();
    let awaited = {
        let mine = image.as_ref();
        let base = mine.map(|mine| move |at: &replica::LogMark| base(mine, at));
        let candidate = mine.zip(base.as_ref()).and_then(|(mine, base)| {
            let mark = replica::LogMark::parse(&mine.log_position);
            Some(replica::start::Candidate {
                lost: mark.generation?,
                position: mark.position,
                base,
            })
        });
        replica::start::await_log(&log.server, &log.key, &fleet, candidate, wait)?
    };
    Ok(match awaited {
        replica::start::Awaited::Found(start) => start,
        replica::start::Awaited::Led(generation) => {
            if let Some(mine) = image.as_mut() {
                mine.log_position = replica::LogMark::start_of(&generation).to_string();
            }
            replica::start::LogStart {
                generation,
                snapshot: None,
            }
        }
    })
}

/// Whether our snapshot is of the log as it is now: one of another log (flushed,
/// restarted without persistence, recreated since) names workers that log numbered.
fn of_this_log(config: &Config, mine: &snapshot::ServerImage, generation: &str) -> bool {
    let mark = replica::LogMark::parse(&mine.log_position);
    let other = mark.generation.as_ref().is_some_and(|g| g != generation);
    if other {
        tracing::warn!(
            snapshot = %config.durability.snapshot.as_deref().map_or("".into(), |p| p.display().to_string()),
            "the snapshot is of another write log (generation {}; the log is now generation \
             {generation}): not loaded",
            mark.generation.as_deref().unwrap_or(""),
        );
    }
    !other
}

/// Executor `me`'s engine, registry and ingest state, restored from the snapshot if
/// there is one.
pub fn executor(
    shared: &Shared,
    me: usize,
    executors: usize,
) -> Result<(Core, Registry, IngestStates), StartError> {
    Builder::of(shared).state(shared.restored.as_ref(), me, executors)
}

/// What an executor's state is built from, at start and when a replica heals in place.
#[derive(Clone)]
pub struct Builder {
    index: crate::config::Index,
    lasts: std::sync::Arc<crate::ingest::states::Lasts>,
}

impl Builder {
    pub fn of(shared: &Shared) -> Builder {
        Builder {
            index: shared.config.index.clone(),
            lasts: shared.services.ingest.lasts(),
        }
    }

    /// Executor `me`'s engine, registry and ingest state: empty, or `image`'s.
    pub fn state(
        &self,
        image: Option<&snapshot::ServerImage>,
        me: usize,
        executors: usize,
    ) -> Result<(Core, Registry, IngestStates), StartError> {
        let index = &self.index;
        let (mut core, mut registry, mut states) = (
            Core::new().with_fill_in(kvix_engine::FillIn {
                capacity_blocks: index.fill_in_blocks,
                ttl_ms: index.fill_in_ttl.saturating_mul(1000),
            }),
            Registry::with_limit(index.max_workers),
            IngestStates::new(self.lasts.clone()),
        );
        let Some(image) = image else {
            return Ok((core, registry, states));
        };
        let block = index.block_size;
        let entries = registry
            .import(&image.engine.workers, block)
            .map_err(StartError::RestoreWorkers)?;
        let home = |w: u32| w as usize % executors == me;
        let dropped = core
            .import(&entries, &image.engine.runs, &image.engine.feeds, home, 0)
            .map_err(StartError::RestoreIndex)?;
        if dropped > 0 && me == 0 {
            tracing::warn!(
                dropped,
                "snapshot: holders naming a worker or lane its roster lacks were dropped (a roster changed while it was taken)"
            );
        }
        for (w, h) in image.ingest_states.iter().filter(|(w, _)| home(*w)) {
            let lanes = entries.iter().find(|e| e.id == *w).map(|e| &e.lanes[..]);
            if !lanes.is_some_and(|l| states.import(*w, h, l, block)) {
                return Err(StartError::IngestState(*w));
            }
        }
        Ok((core, registry, states))
    }

    /// A replica healing in place: executor `ex`'s state replaced by `image`'s (what
    /// its ingest states recorded forgotten first); executor 0 also hands the ingest
    /// the snapshot's sources.
    pub fn restore_in_place(
        &self,
        ex: &Rc<Executor>,
        image: &snapshot::ServerImage,
    ) -> Result<(), StartError> {
        ex.ingest_states().clear();
        let (core, registry, states) = self.state(Some(image), ex.me(), ex.executors())?;
        ex.install(core, registry, states);
        if ex.me() == 0 {
            let registry = ex.registry();
            let sources = image.sources.iter().map(|(w, source)| {
                let name = registry.name_of(*w).unwrap_or_default().to_string();
                (*w, name, source.clone())
            });
            ex.ingest().replace_sources(sources.collect());
        }
        ex.refresh_gauges();
        Ok(())
    }
}

/// Executor 0, once every executor is wired: the snapshot's sources handed to the
/// ingest, the write-ahead log replayed over the snapshot, then the ingest subscribes
/// every source where its stream left off.
pub async fn finish(ex: &Rc<Executor>, shared: &Shared) {
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
        if let Some(wal) = ex.log().wal() {
            wal.replaying(true);
        }
        replay(ex, records).await;
        ex.metrics()
            .wal_replayed
            .store(count as u64, Ordering::Relaxed);
        if let Some(wal) = ex.log().wal() {
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

/// Writes replayed before the replay waits for them to be applied everywhere.
const REPLAY_WINDOW: usize = 4096;
/// Writes of one home's that go to it as one job, their feed steps in one update.
const REPLAY_BATCH: usize = 256;

/// Applies the log's records in their order. Records of workers homed on one executor
/// go to it in batches ([`write::feed::home_writes`]: one update, one publish per batch), in
/// their order, so writes of one worker keep their order without waiting on each other;
/// only announces and retires (which number workers and change every executor's
/// roster) wait for everything before them and are awaited themselves.
async fn replay(ex: &Rc<Executor>, records: Vec<Write>) {
    let mut batches: Vec<Vec<Write>> = (0..ex.executors()).map(|_| Vec::new()).collect();
    let mut pending = Vec::new();
    let mut queued = 0;
    let send = |home: usize, batch: Vec<Write>, pending: &mut Vec<_>| {
        pending.push(ex.queue_on(home, move |on| write::feed::home_writes(on, batch)));
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
            let _ = write::route_write(ex, r, write::Origin::Logged).await;
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
