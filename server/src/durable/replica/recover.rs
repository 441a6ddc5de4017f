//! How a replica recovers in place, in the follower's task: it heals past a trim from
//! the snapshot the fleet stored, and rebuilds a lost log from the most advanced replica.
//! Both replace every executor's state in the same process, connections kept.

use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::channel::{mpsc, oneshot};
use futures::SinkExt;
use redis::streams::StreamRangeReply;

use super::resp::Resp;
use super::{
    chosen_key, id_key, rebuild_key, snapshot_key, store, LogJob, LogMark, MakeBase, Replica,
};

/// Why a heal or a rebuild did not finish: the replica then stops following its log.
#[derive(Debug, thiserror::Error)]
pub enum RecoverError {
    #[error("stopping")]
    Stopping,
    #[error("Redis: {0}")]
    Redis(#[from] redis::RedisError),
    #[error("another generation was started on the key meanwhile")]
    Overtaken,
    #[error("no rebuilt log appeared within {waited_s} s")]
    NoBase { waited_s: u64 },
    #[error("the stored snapshot does not load: {0}")]
    Snapshot(#[from] crate::durable::snapshot::SnapshotError),
    #[error("restoring the snapshot failed: {0}")]
    Restore(#[from] super::RestoreError),
    #[error("the decoding thread stopped")]
    Decoder,
}

/// How long the replicas that found their log lost wait for the others following it
/// lately to post their positions before the most advanced of those posted is chosen
/// to rebuild it (one paused or gone is not waited for longer), and how long the
/// others wait for its new log.
const ELECTION: Duration = Duration::from_secs(15);
const REBUILD_WAIT: Duration = Duration::from_secs(60);

/// Rebuilds a lost log (flushed, a Redis restarted without persistence, a failover that
/// lost the stream's tail) from the most advanced replica instead of abandoning what
/// the fleet held: each replica that finds the log lost posts its position (under the
/// old generation); once every replica that reported following the log in the last
/// 10 s posted (at most [`ELECTION`]), the most advanced is chosen, once for all
/// (SET NX). It stores its state as the base snapshot of a new generation (with the
/// ingest epochs, so that engines' deliveries are not fenced) and follows the new
/// stream from its start; the others load that snapshot in place ([`restore_all`]).
/// Writes are refused meanwhile (`LogUnavailable`), and the replica is not caught up
/// (answers `stale`, /readyz fails). An error leaves the replica stopped, as before.
pub(super) async fn rebuild(
    r: &Replica,
    c: &mut Resp,
    position: &mut String,
    inboxes: &mut [mpsc::Sender<LogJob>],
    base: &MakeBase,
    old: &str,
) -> Result<(), RecoverError> {
    r.caught_up.store(false, Relaxed);
    r.rebuilding.store(true, Relaxed);
    r.fail_pending("the write log was lost; the replicas are rebuilding it");
    let rebuilt = elect_and_rebuild(r, c, position, inboxes, base, old).await;
    r.rebuilding.store(false, Relaxed);
    if rebuilt.is_ok() {
        r.metrics.rebuilds.fetch_add(1, Relaxed);
        r.at(position);
    }
    rebuilt
}

async fn elect_and_rebuild(
    r: &Replica,
    c: &mut Resp,
    position: &mut String,
    inboxes: &mut [mpsc::Sender<LogJob>],
    base: &MakeBase,
    old: &str,
) -> Result<(), RecoverError> {
    let key = &r.url.key;
    let (candidates, chosen_key) = (rebuild_key(key, old), chosen_key(key, old));
    c.pipeline::<()>(&store::post_position(key, old, &r.id, position))
        .await?;
    tracing::warn!(%position, "rebuilding the lost log: this replica's position posted");
    let peers = r.peers();
    let deadline = Instant::now() + ELECTION;
    let posted = loop {
        let posted: std::collections::HashMap<String, String> =
            c.query(&redis::Cmd::hgetall(&candidates)).await?;
        let decided: Option<String> = c.query(&redis::Cmd::get(&chosen_key)).await?;
        let all = peers.iter().all(|p| posted.contains_key(p));
        if all || decided.is_some() || Instant::now() >= deadline || r.stopped() {
            break posted;
        }
        glommio::timer::sleep(Duration::from_millis(100)).await;
    };
    let best = store::most_advanced(&posted).unwrap_or_else(|| r.id.clone());
    let (_, chosen): (Option<String>, String) = c.pipeline(&store::choose(key, old, &best)).await?;
    if chosen == r.id {
        lead_rebuild(r, c, position, inboxes, base, old).await
    } else {
        tracing::warn!(
            chosen,
            "rebuilding the lost log: another replica is more advanced, loading its base"
        );
        follow_rebuild(r, c, position, inboxes, old).await
    }
}

/// The chosen replica: its state becomes the new generation's base.
async fn lead_rebuild(
    r: &Replica,
    c: &mut Resp,
    position: &mut String,
    inboxes: &mut [mpsc::Sender<LogJob>],
    base: &MakeBase,
    old: &str,
) -> Result<(), RecoverError> {
    let key = &r.url.key;
    let new = format!("{:016x}", super::rand_id());
    let parts = every(inboxes, |reply| LogJob::Export { reply }).await?;
    let mark = LogMark::start_of(&new);
    let made = base(parts, &mark);
    let publish = store::publish_base(key, old, &new, &made, &r.fleet);
    let published: u8 = c.query(&publish).await?;
    if published == 0 {
        return Err(RecoverError::Overtaken);
    }
    r.set_generation(&new);
    *position = mark.position;
    tracing::warn!(
        generation = new,
        "rebuilt the lost log from this replica's state: the new generation's base is stored"
    );
    Ok(())
}

/// A replica not chosen: waits for the new generation and its base, and loads it.
async fn follow_rebuild(
    r: &Replica,
    c: &mut Resp,
    position: &mut String,
    inboxes: &mut [mpsc::Sender<LogJob>],
    old: &str,
) -> Result<(), RecoverError> {
    let key = &r.url.key;
    let deadline = Instant::now() + REBUILD_WAIT;
    while Instant::now() < deadline && !r.stopped() {
        drop(r.take_mark_request());
        let seen: redis::RedisResult<(Option<String>, Option<Vec<u8>>)> =
            c.pipeline(&store::generation_and_snapshot(key)).await;
        if let Ok((Some(generation), Some(bytes))) = seen {
            if generation != old {
                let image = decode_aside(bytes, r.block_size).await?;
                let mark = LogMark::parse(&image.log_position);
                if mark.generation.as_deref() == Some(generation.as_str()) {
                    restore_all(inboxes, image).await?;
                    r.set_generation(&generation);
                    *position = mark.position;
                    tracing::warn!(
                        generation,
                        "loaded the rebuilt log's base in place: following the new generation"
                    );
                    return Ok(());
                }
            }
        }
        glommio::timer::sleep(Duration::from_millis(200)).await;
    }
    Err(RecoverError::NoBase {
        waited_s: REBUILD_WAIT.as_secs(),
    })
}

/// How long a heal waits between looks for a stored snapshot it can load.
const HEAL_RETRY: Duration = Duration::from_secs(1);

/// Heals a replica whose next entries were trimmed away, in the same process: once every
/// record handed over before is applied, the newest snapshot the fleet stored in Redis
/// replaces every executor's state, and the follower goes on from the snapshot's
/// position. Until then the replica is not caught up (its answers say `stale`, /readyz
/// fails, and no snapshot is cut); its writes still waiting to be read back are answered
/// `LogUnavailable`. A stored snapshot not yet past the hole is waited for: the others
/// store one every `--snapshot-every`. An error leaves the replica stopped.
pub(super) async fn heal(
    r: &Replica,
    c: &mut Resp,
    position: &mut String,
    inboxes: &mut [mpsc::Sender<LogJob>],
) -> Result<(), RecoverError> {
    r.caught_up.store(false, Relaxed);
    r.healing.store(true, Relaxed);
    r.fail_pending("this replica is healing in place (the log was trimmed past it)");
    let image = loop {
        drop(r.take_mark_request());
        if r.stopped() {
            return Err(RecoverError::Stopping);
        }
        match loadable_snapshot(r, c, position).await {
            Ok(Some(image)) => break image,
            Ok(None) => {}
            Err(e) => tracing::warn!("healing: reading the stored snapshot failed: {e}"),
        }
        glommio::timer::sleep(HEAL_RETRY).await;
    };
    let mark = LogMark::parse(&image.log_position);
    restore_all(inboxes, image).await?;
    *position = mark.position;
    r.at(position);
    r.metrics.heals.fetch_add(1, Relaxed);
    r.healing.store(false, Relaxed);
    tracing::warn!(%position, "healed in place: the stored snapshot is loaded, following the log from it");
    Ok(())
}

/// Every executor's state replaced by `image`'s, once every record handed over before is
/// applied on every executor.
async fn restore_all(
    inboxes: &mut [mpsc::Sender<LogJob>],
    image: crate::durable::snapshot::ServerImage,
) -> Result<(), RecoverError> {
    let image = Arc::new(image);
    every(inboxes, |done| LogJob::Drain { done }).await?;
    let restored = every(inboxes, |done| LogJob::Restore {
        image: image.clone(),
        done,
    });
    for outcome in restored.await? {
        outcome?;
    }
    Ok(())
}

/// Decodes a stored snapshot beside the executor (a large one takes a while).
async fn decode_aside(
    bytes: Vec<u8>,
    block: u32,
) -> Result<crate::durable::snapshot::ServerImage, RecoverError> {
    let (tx, rx) = oneshot::channel();
    std::thread::spawn(move || {
        let decoded =
            crate::durable::snapshot::decode(&bytes, block, "the snapshot stored in Redis");
        let _ = tx.send(decoded);
    });
    Ok(rx.await.map_err(|_| RecoverError::Decoder)??)
}

/// The snapshot stored in Redis, when this replica can go on from it: of this log's
/// generation, past `position`, and its own position still in the stream.
async fn loadable_snapshot(
    r: &Replica,
    c: &mut Resp,
    position: &str,
) -> redis::RedisResult<Option<crate::durable::snapshot::ServerImage>> {
    let bytes: Option<Vec<u8>> = c.query(&redis::Cmd::get(snapshot_key(&r.url.key))).await?;
    let Some(bytes) = bytes else {
        tracing::warn!("healing: no snapshot is stored yet; waiting for one");
        return Ok(None);
    };
    let image = match decode_aside(bytes, r.block_size).await {
        Ok(image) => image,
        Err(e) => {
            tracing::warn!("healing: the stored snapshot does not load: {e}; waiting for another");
            return Ok(None);
        }
    };
    let mark = LogMark::parse(&image.log_position);
    if mark
        .generation
        .as_ref()
        .is_some_and(|g| *g != r.generation())
    {
        return Err(redis::RedisError::from((
            redis::ErrorKind::Client,
            "the stored snapshot is of another log",
            format!("generation {:?}", mark.generation),
        )));
    }
    if id_key(&mark.position) <= id_key(position) {
        tracing::warn!(
            snapshot = %mark.position,
            "healing: the stored snapshot is not past the hole yet; waiting for a newer one"
        );
        return Ok(None);
    }
    let there: StreamRangeReply = c
        .query(&redis::Cmd::xrange(
            &r.url.key,
            &mark.position,
            &mark.position,
        ))
        .await?;
    Ok((!there.ids.is_empty()).then_some(image))
}

/// Sends every executor the job `make` builds around its answer's sender, and waits for
/// all the answers; `Stopping` when an executor is gone (the process is stopping).
async fn every<T>(
    inboxes: &mut [mpsc::Sender<LogJob>],
    make: impl Fn(oneshot::Sender<T>) -> LogJob,
) -> Result<Vec<T>, RecoverError> {
    let mut answers = Vec::with_capacity(inboxes.len());
    for inbox in inboxes.iter_mut() {
        let (tx, rx) = oneshot::channel();
        inbox
            .send(make(tx))
            .await
            .map_err(|_| RecoverError::Stopping)?;
        answers.push(rx);
    }
    let mut out = Vec::with_capacity(answers.len());
    for rx in answers {
        out.push(rx.await.map_err(|_| RecoverError::Stopping)?);
    }
    Ok(out)
}
