//! Taking a snapshot: every executor's part (cut at one log position with replicas),
//! written to `--snapshot` by a helper thread, stored in Redis for new replicas, and the
//! write-ahead log below it dropped. At a clean stop every accepted write is drained
//! first, so the last snapshot covers them all.

use std::rc::Rc;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use kvix_engine::EngineImage;

use crate::durable::wal::Wal;
use crate::durable::{replica, snapshot, Log};
use crate::error::StartError;
use crate::executor::Executor;
use crate::mesh::LocalFuture;
use crate::metrics::ExecutorMetrics;
use crate::{failure, mesh, write};

/// How long a snapshot waits for the log follower to cut the log: between two reads it
/// does at once, and while Redis is away too; a follower that does not is stuck, and a
/// stop must not wait for it.
const MARK_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

/// Gathers every executor's part and writes a snapshot: to `--snapshot`, and, for a
/// replica, into the log's Redis (which trims the stream below it: a fleet without
/// snapshot files is trimmed all the same). Written by a helper thread so the executor
/// keeps serving; at shutdown we wait for it and say whether it was written.
pub(crate) async fn take_snapshot(ex: &Rc<Executor>, last: bool) -> Result<(), StartError> {
    let path = ex.settings().snapshot.clone();
    if path.is_none() && ex.log().shared().is_none() {
        return Ok(());
    }
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
    let (cut, parts) = match cut(ex, last).await {
        Ok(cut) => cut,
        Err(e) => {
            ExecutorMetrics::add(&ex.metrics().snapshot_failures, 1);
            return Err(e);
        }
    };
    // The roster as the cut left it: the follower may dispatch announces meanwhile.
    let mut image = skeleton(ex, cut.wal_from(), cut.position());
    let mut gathered = Vec::with_capacity(parts.len());
    for part in parts {
        match part.await {
            Ok(p) => gathered.push(p),
            Err(f) => {
                ExecutorMetrics::add(&ex.metrics().snapshot_failures, 1);
                tracing::error!("snapshot not taken: {f}");
                return Err(StartError::SnapshotTaken(f));
            }
        }
    }
    fill(&mut image, gathered);
    let bytes = snapshot::encode(&image, ex.settings().index.block_size);
    let (metrics, me) = (ex.all_metrics().clone(), ex.me());
    let writer = std::thread::spawn(move || {
        if let Some(path) = &path {
            if let Err(source) = snapshot::write(path, &bytes) {
                ExecutorMetrics::add(&metrics[me].snapshot_failures, 1);
                tracing::error!(path = %path.display(), "snapshot not written: {source}");
                return Err(StartError::SnapshotWrite {
                    path: path.clone(),
                    source,
                });
            }
            ExecutorMetrics::add(&metrics[me].snapshots, 1);
            tracing::info!(path = %path.display(), bytes = bytes.len(), "snapshot written");
        }
        cut.settle(&bytes, path.is_some());
        Ok(())
    });
    if last {
        return writer.join().unwrap_or_else(|_| {
            Err(StartError::Panicked {
                executor: 0,
                why: "the snapshot writer panicked".into(),
            })
        });
    }
    Ok(())
}

/// A snapshot without its parts: the roster (executor 0's) and the ingest's sources.
fn skeleton(ex: &Rc<Executor>, wal_from: u64, log_position: String) -> snapshot::ServerImage {
    snapshot::ServerImage {
        wal_from,
        log_position,
        engine: EngineImage {
            workers: ex.registry().export(),
            ..Default::default()
        },
        sources: ex.ingest().sources(),
        ingest_states: Vec::new(),
    }
}

/// Every executor's part into the snapshot.
fn fill(image: &mut snapshot::ServerImage, parts: Vec<snapshot::Part>) {
    for p in parts {
        image.engine.runs.extend(p.runs);
        image.engine.feeds.extend(p.feeds);
        image.ingest_states.extend(p.ingest_states);
    }
    image.engine.feeds.sort_unstable_by_key(|(w, _)| *w);
    image.ingest_states.sort_unstable_by_key(|(w, _)| *w);
}

/// A lost log's new base, on executor 0 of the replica chosen to rebuild it: its state
/// (every executor's part, cut by the follower) as the snapshot at `at` (the new
/// generation's start), encoded, and each ingest stream's epoch, from which the new
/// log's leases count on.
pub(crate) fn rebuilt_base(
    ex: &Rc<Executor>,
    parts: Vec<snapshot::Part>,
    at: &replica::LogMark,
) -> replica::Base {
    let mut image = skeleton(ex, 0, at.to_string());
    fill(&mut image, parts);
    replica::Base::of(image, at, ex.settings().index.block_size)
}

/// Where a snapshot's parts are cut, per log, and what the log does once it is written.
enum Cut {
    /// No log: each part as its executor's queue has it.
    Plain,
    /// The write-ahead log rotated: the generations from `from` on are replayed over it.
    Wal { wal: Arc<Wal>, from: u64 },
    /// Every part cut at one stream position by the follower.
    Shared {
        replica: Arc<replica::Replica>,
        at: replica::LogMark,
    },
}

type Parts = Vec<LocalFuture<Result<snapshot::Part, failure::Failure>>>;

/// Cuts the log where the snapshot starts, and asks every executor for its part.
async fn cut(ex: &Rc<Executor>, last: bool) -> Result<(Cut, Parts), StartError> {
    let export = || -> Parts {
        (0..ex.executors())
            .map(|e| ex.queue_on(e, write::queue::export))
            .collect()
    };
    match ex.log() {
        Log::None => Ok((Cut::Plain, export())),
        // Everything appended from here on may be missing from the parts: replay it. At
        // the last snapshot nothing before the rotation is.
        Log::Wal(wal) => {
            let old = wal
                .rotate()
                .map_err(|e| StartError::SnapshotTaken(failure::Failure::Wal(Arc::new(e))))?;
            let from = if last { old + 1 } else { old };
            Ok((
                Cut::Wal {
                    wal: wal.clone(),
                    from,
                },
                export(),
            ))
        }
        Log::Shared(r) => {
            let mark = r.mark();
            let cut = glommio::timer::timeout(MARK_WAIT, async move {
                mark.await
                    .map_err(|_| glommio::GlommioError::IoError(std::io::Error::other("stopped")))
            });
            let mark = cut.await.map_err(|_| StartError::Uncut(MARK_WAIT))?;
            let parts = mark
                .parts
                .into_iter()
                .map(|rx| -> LocalFuture<_> {
                    Box::pin(async move { rx.await.map_err(|_| failure::Failure::Stopping) })
                })
                .collect();
            let at = replica::LogMark {
                position: mark.position,
                generation: Some(r.generation()),
            };
            Ok((
                Cut::Shared {
                    replica: r.clone(),
                    at,
                },
                parts,
            ))
        }
    }
}

impl Cut {
    fn wal_from(&self) -> u64 {
        match self {
            Cut::Wal { from, .. } => *from,
            _ => 0,
        }
    }

    fn position(&self) -> String {
        match self {
            Cut::Shared { at, .. } => at.to_string(),
            _ => String::new(),
        }
    }

    /// Once the snapshot is written (`in_file`: to `--snapshot`): the write-ahead log
    /// drops what the file covers; a replica stores it in Redis, which trims the stream.
    fn settle(self, bytes: &[u8], in_file: bool) {
        match self {
            Cut::Plain => {}
            Cut::Wal { wal, from } => {
                if let (true, Err(e)) = (in_file, wal.drop_below(from)) {
                    tracing::warn!("write-ahead log: old generations not removed: {e}");
                }
            }
            Cut::Shared { replica: r, at } => {
                match replica::store::publish_snapshot(&r, bytes, &at.position) {
                    Ok(()) => {
                        r.metrics.stored.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(e) => {
                        r.metrics.store_failures.fetch_add(1, Ordering::Relaxed);
                        tracing::warn!(
                            "snapshot not stored in Redis (the log is not trimmed): {e}"
                        );
                    }
                }
            }
        }
    }
}

/// Waits, on executor `on`, until the writes accepted so far are applied everywhere (a
/// clean stop's last snapshot then covers the whole log): it flushes every executor's
/// write queue through `on`'s own channels, so each flush arrives behind every write `on`
/// sent before. Run on every executor once, it sees each accepted write through its
/// home's queue (which then sent its update to the others); run on every executor a
/// second time, it sees those updates applied.
fn drain(on: &Rc<Executor>) -> mesh::LocalFuture<Result<(), failure::Failure>> {
    let flushes: Vec<_> = (0..on.executors())
        .map(|e| on.queue_on(e, write::queue::flush))
        .collect();
    Box::pin(async move {
        for f in flushes {
            let _ = f.await;
        }
        Ok(())
    })
}
