//! Taking a snapshot: every executor's part (cut at one log position with replicas),
//! written to `--snapshot` by a helper thread, stored in Redis for new replicas, and the
//! write-ahead log below it dropped. At a clean stop every accepted write is drained
//! first, so the last snapshot covers them all.

use std::rc::Rc;
use std::sync::atomic::Ordering;

use kvix_engine::EngineImage;

use crate::durable::{replica, snapshot};
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
    if path.is_none() && ex.replica().is_none() {
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
    // Everything appended from here on may be missing from the parts: replay it. At the
    // last snapshot nothing before the rotation is.
    let wal_from = match ex.wal().map(|w| w.rotate()).transpose() {
        Ok(g) => g.map_or(0, |old| if last { old + 1 } else { old }),
        Err(e) => {
            ExecutorMetrics::add(&ex.metrics().snapshot_failures, 1);
            return Err(StartError::SnapshotTaken(failure::Failure::Wal(
                std::sync::Arc::new(e),
            )));
        }
    };
    // Replicas: every part cut at the same stream position, by the follower.
    let (parts, cut_at): (
        Vec<LocalFuture<Result<snapshot::Part, failure::Failure>>>,
        Option<replica::LogMark>,
    ) = match ex.replica() {
        Some(r) => {
            let mark = r.mark();
            let cut = glommio::timer::timeout(MARK_WAIT, async move {
                mark.await
                    .map_err(|_| glommio::GlommioError::IoError(std::io::Error::other("stopped")))
            });
            let Ok(mark) = cut.await else {
                ExecutorMetrics::add(&ex.metrics().snapshot_failures, 1);
                return Err(StartError::Uncut(MARK_WAIT));
            };
            let parts = mark
                .parts
                .into_iter()
                .map(|rx| -> LocalFuture<_> {
                    Box::pin(async move { rx.await.map_err(|_| failure::Failure::Stopping) })
                })
                .collect();
            let at = replica::LogMark {
                position: mark.position,
                generation: Some(r.generation.clone()),
            };
            (parts, Some(at))
        }
        None => (
            (0..ex.executors())
                .map(|e| ex.queue_on(e, write::queue::export))
                .collect(),
            None,
        ),
    };
    let mut image = snapshot::ServerImage {
        wal_from,
        log_position: cut_at.as_ref().map_or(String::new(), ToString::to_string),
        engine: EngineImage {
            workers: ex.registry().export(),
            ..Default::default()
        },
        sources: ex.ingest().sources(),
        ingest_states: Vec::new(),
    };
    for part in parts {
        match part.await {
            Ok(p) => {
                image.engine.runs.extend(p.runs);
                image.engine.feeds.extend(p.feeds);
                image.ingest_states.extend(p.ingest_states);
            }
            Err(f) => {
                ExecutorMetrics::add(&ex.metrics().snapshot_failures, 1);
                tracing::error!("snapshot not taken: {f}");
                return Err(StartError::SnapshotTaken(f));
            }
        }
    }
    image.engine.feeds.sort_unstable_by_key(|(w, _)| *w);
    image.ingest_states.sort_unstable_by_key(|(w, _)| *w);
    let bytes = snapshot::encode(&image, ex.settings().index.block_size);
    let (metrics, me) = (ex.all_metrics().clone(), ex.me());
    let wal = ex.wal().cloned();
    let replica = ex.replica().cloned();
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
            // The log below the snapshot's start is in the file now.
            if let Some(Err(e)) = wal.map(|w| w.drop_below(wal_from)) {
                tracing::warn!("write-ahead log: old generations not removed: {e}");
            }
        }
        if let (Some(r), Some(at)) = (replica, cut_at) {
            match replica::store::publish_snapshot(&r, &bytes, &at.position) {
                Ok(()) => {
                    r.metrics.stored.fetch_add(1, Ordering::Relaxed);
                }
                Err(e) => {
                    r.metrics.store_failures.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!("snapshot not stored in Redis (the log is not trimmed): {e}");
                }
            }
        }
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
