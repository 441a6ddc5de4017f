//! The follower, a task on executor 0: reads the stream in order from this replica's
//! position and hands every record to the executor that applies it (announces and
//! retires to executor 0, waiting for them; the rest to the worker's home, pipelined).
//! Between reads it serves snapshot marks, and it reports its position for trimming.
//! The trimming and the snapshot store ([`super::store::publish_snapshot`]) run on the
//! snapshot's own thread, on a connection of their own.

use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use futures::channel::{mpsc, oneshot};
use futures::SinkExt;
use redis::streams::{StreamRangeReply, StreamReadOptions, StreamReadReply};

use super::recover;
use super::resp::{self, Resp};
use super::{
    generation_key, id_key, positions_key, Follow, LogJob, MakeBase, Mark, Replica, Stopped,
};
use crate::write::record::Write;

/// Entries read per round trip, and how long one read waits for new ones.
const COUNT: usize = 256;
const BLOCK_MS: usize = 200;
/// A replica that has not reported its position for this long is not waited for when
/// the stream is trimmed.
pub(super) const STALE_MS: u64 = 60_000;

/// What one read of the stream found.
enum Read {
    Entries(Option<StreamReadReply>),
    /// Entries this replica has not read were trimmed away; the stream's first entry.
    Trimmed(String),
    /// The log is another one than this replica follows: its generation now, if any.
    Replaced(Option<String>),
    /// This replica's position is gone though the stream's first entry does not pass it
    /// (a failover to a Redis that had not received the tail, entries appended since;
    /// or the stream key deleted): the stream's last entry.
    TailLost(String),
}

/// Reads what follows `position`, unless entries this replica has not read were trimmed
/// away: its own position's entry is gone (trimming keeps every entry at or after the
/// oldest live replica's position, so a live replica's own entry stays), or, reading
/// from the start ("0-0"), the stream ever had more entries than it holds. A stream
/// lost altogether (flushed) is such a hole too: this replica's history went with it.
///
/// Every read also checks the log's generation: entries read from a log that was
/// replaced in between are not handed on.
async fn read_after(
    c: &mut Resp,
    key: &str,
    generation: &str,
    position: &str,
    opts: &StreamReadOptions,
) -> redis::RedisResult<Read> {
    let replaced = |now: &Option<String>| now.as_deref() != Some(generation);
    let generation_now = redis::Cmd::get(generation_key(key));
    let read = redis::Cmd::xread_options(&[key], &[position], opts);
    if position == "0-0" {
        let now: Option<String> = c.query(&generation_now).await?;
        if replaced(&now) {
            return Ok(Read::Replaced(now));
        }
        if trimmed_from_start(c, key).await? {
            return first(c, key).await.map(Read::Trimmed);
        }
        let reply = c.query(&read).await?;
        let now: Option<String> = c.query(&generation_now).await?;
        if replaced(&now) {
            return Ok(Read::Replaced(now));
        }
        return Ok(Read::Entries(reply));
    }
    let mut pipe = redis::pipe();
    pipe.add_command(generation_now.clone())
        .xrange(key, position, position)
        .add_command(read)
        .add_command(generation_now);
    let (now, mine, reply, after): (
        Option<String>,
        StreamRangeReply,
        Option<StreamReadReply>,
        Option<String>,
    ) = c.pipeline(&pipe).await?;
    if replaced(&now) || replaced(&after) {
        return Ok(Read::Replaced(if replaced(&now) { now } else { after }));
    }
    if mine.ids.is_empty() {
        // Trimming cuts a stream from its start: a hole that the stream's first entry does
        // not pass is a lost tail (a failover to a Redis that had not received it, with
        // entries appended since), which no stored snapshot of the fleet covers.
        let oldest = first(c, key).await?;
        return Ok(
            if oldest != "nothing" && id_key(&oldest) > id_key(position) {
                Read::Trimmed(oldest)
            } else {
                let last: StreamRangeReply = c
                    .query(&redis::Cmd::xrevrange_count(key, "+", "-", 1))
                    .await?;
                Read::TailLost(last.ids.first().map_or("nothing".into(), |e| e.id.clone()))
            },
        );
    }
    Ok(Read::Entries(reply))
}

/// The id of the stream's first entry, for the log line.
async fn first(c: &mut Resp, key: &str) -> redis::RedisResult<String> {
    let r: StreamRangeReply = c.query(&redis::Cmd::xrange_count(key, "-", "+", 1)).await?;
    Ok(r.ids.first().map_or("nothing".into(), |e| e.id.clone()))
}

/// Whether entries were ever removed from the stream (Redis 7's XINFO counts every
/// entry added: more than it holds).
async fn trimmed_from_start(c: &mut Resp, key: &str) -> redis::RedisResult<bool> {
    let info: redis::RedisResult<redis::Value> =
        c.query(redis::cmd("XINFO").arg("STREAM").arg(key)).await;
    let fields = match info {
        Ok(redis::Value::Array(f)) => f,
        Ok(redis::Value::Map(m)) => m.into_iter().flat_map(|(k, v)| [k, v]).collect(),
        Ok(_) => return Ok(false),
        Err(e) if e.to_string().contains("no such key") => return Ok(false),
        Err(e) => return Err(e),
    };
    let field = |name: &[u8]| {
        fields.chunks(2).find_map(|kv| match kv {
            [redis::Value::BulkString(k), redis::Value::Int(v)] if k.as_slice() == name => Some(*v),
            _ => None,
        })
    };
    Ok(matches!(
        (field(b"entries-added"), field(b"length")),
        (Some(added), Some(len)) if added > len
    ))
}

pub(super) fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// Follows the log until the process stops, or until this replica cannot follow it any
/// more ([`Stopped`]).
pub async fn run(r: Arc<Replica>, follow: Follow, base: MakeBase) {
    let Follow {
        mut position,
        mut inboxes,
    } = follow;
    follow_log(&r, &mut position, &mut inboxes, &base).await;
    // Stopped following: the executors' inboxes stay open (their ends would read the
    // log's end as a stop) while this replica refuses writes, until the process stops.
    // A cut of a replica that stopped following would hold what the log no longer
    // matches: a snapshot asked for now is refused at once (not after its wait).
    while !r.stopped() {
        drop(r.take_mark_request());
        glommio::timer::sleep(Duration::from_millis(100)).await;
    }
}

/// After a failed step: a snapshot waiting for its cut gets it (a cut needs no Redis),
/// the failure is counted and logged with its cause, the writes waiting to be read
/// back are answered `LogUnavailable` ([`Replica::fail_pending`]: a client is never
/// held while the log is away), and the next try waits `backoff`,
/// which doubles up to 2 s (a Redis that refuses every read, loading or denying this
/// user, is not asked again in a loop).
async fn pause(
    r: &Replica,
    inboxes: &mut [mpsc::Sender<LogJob>],
    position: &str,
    backoff: &mut Duration,
    why: std::fmt::Arguments<'_>,
) {
    if let Some(req) = r.take_mark_request() {
        mark(inboxes, position, req).await;
    }
    r.metrics.read_failures.fetch_add(1, Relaxed);
    r.link_failures.fetch_add(1, Relaxed);
    let why = why.to_string();
    tracing::warn!("{why}");
    r.fail_pending(&why);
    glommio::timer::sleep(*backoff).await;
    *backoff = (*backoff * 2).min(Duration::from_secs(2));
}

/// After a command failed with `e`: the connection stays when Redis refused the command,
/// and goes when it failed itself ([`resp::refused`]).
fn keep_if_refused(conn: &mut Option<Resp>, e: &redis::RedisError) {
    if !resp::refused(e) {
        *conn = None;
    }
}

async fn follow_log(
    r: &Replica,
    position: &mut String,
    inboxes: &mut [mpsc::Sender<LogJob>],
    base: &MakeBase,
) {
    r.at(position);
    let mut conn: Option<Resp> = None;
    let mut tail: Option<String> = None;
    let mut backoff = Duration::from_millis(50);
    let mut reported = Instant::now() - Duration::from_secs(60);
    while !r.stopped() {
        if conn.is_none() {
            match Resp::open(&r.link, &format!("kvix-follow-{}", r.id)).await {
                Ok(c) => conn = Some(c),
                Err(e) => {
                    let why = format_args!("the write log at {} is unreachable: {e}", r.url.server);
                    pause(r, inboxes, position, &mut backoff, why).await;
                    continue;
                }
            }
        }
        let c = conn.as_mut().expect("connected");
        if tail.is_none() {
            let last: redis::RedisResult<StreamRangeReply> = c
                .query(&redis::Cmd::xrevrange_count(&r.url.key, "+", "-", 1))
                .await;
            match last {
                Ok(reply) => tail = Some(reply.ids.first().map_or("0-0".into(), |e| e.id.clone())),
                Err(e) => {
                    keep_if_refused(&mut conn, &e);
                    let why = format_args!("reading the write log's end failed: {e}");
                    pause(r, inboxes, position, &mut backoff, why).await;
                    continue;
                }
            }
        }
        if let Some(req) = r.take_mark_request() {
            mark(inboxes, position, req).await;
        }
        if reported.elapsed() > Duration::from_secs(5) {
            reported = Instant::now();
            let report = redis::Cmd::hset(
                positions_key(&r.url.key),
                &r.id,
                format!("{position} {}", now_ms()),
            );
            if let Err(e) = c.query::<()>(&report).await {
                // Refused (Redis out of memory): tried again in 5 s, and the read goes on.
                // Lost: so is the connection, whose next reply would answer this.
                tracing::warn!("reporting this replica's log position failed: {e}");
                if !resp::refused(&e) {
                    r.metrics.read_failures.fetch_add(1, Relaxed);
                    conn = None;
                    continue;
                }
            }
            // Who else follows the log: a rebuild waits for them (a lost log takes
            // the positions with it).
            let reports: redis::RedisResult<std::collections::HashMap<String, String>> = c
                .query(&redis::Cmd::hgetall(positions_key(&r.url.key)))
                .await;
            if let Ok(reports) = reports {
                r.saw_peers(&reports, now_ms());
            }
        }
        // The read goes with a check that this replica's position is still in the
        // stream, in one round trip: a read from a trimmed position would return what
        // follows the hole as if nothing were missing.
        let opts = StreamReadOptions::default().count(COUNT).block(BLOCK_MS);
        let generation = r.generation();
        let read = read_after(c, &r.url.key, &generation, position, &opts).await;
        let reply = match read {
            Ok(Read::Entries(reply)) => reply,
            Ok(Read::Trimmed(first)) => {
                tracing::warn!(
                    "the write log was trimmed past this replica's position ({position} is \
                     gone; the stream now starts at {first}): healing in place from the \
                     snapshot the fleet stored, rather than skip what it missed"
                );
                if let Err(why) = recover::heal(r, c, position, inboxes).await {
                    if !r.stopped() {
                        r.stop_following(Stopped::BehindTrim, why.to_string());
                    }
                    return;
                }
                tail = None;
                continue;
            }
            Ok(lost @ (Read::Replaced(_) | Read::TailLost(_))) => {
                let what = match lost {
                    Read::Replaced(now) => format!(
                        "the write log was replaced (generation {} where this replica follows \
                         {generation}: flushed, restarted without persistence, or recreated)",
                        now.as_deref().unwrap_or("none")
                    ),
                    Read::TailLost(last) => format!(
                        "the write log lost its tail ({position} is gone, the stream is not \
                         trimmed past it and now ends at {last}: a failover to a Redis that \
                         had not received it, or the stream deleted)"
                    ),
                    Read::Entries(_) | Read::Trimmed(_) => unreachable!("matched"),
                };
                tracing::warn!("{what}: rebuilding it from the most advanced replica");
                if let Err(why) = recover::rebuild(r, c, position, inboxes, base, &generation).await
                {
                    if !r.stopped() {
                        let why = format!(
                            "{what}, and rebuilding it failed ({why}): it stopped following \
                             it, its worker ids would name other workers than the new log's; \
                             restart it to start from the log as it is now"
                        );
                        r.stop_following(Stopped::Replaced, why);
                    }
                    return;
                }
                tail = None;
                continue;
            }
            Err(e) => {
                keep_if_refused(&mut conn, &e);
                let why = format_args!("reading the write log failed: {e}");
                pause(r, inboxes, position, &mut backoff, why).await;
                continue;
            }
        };
        backoff = Duration::from_millis(50);
        let mut dispatched = false;
        for entry in reply.into_iter().flat_map(|k| k.keys).flat_map(|k| k.ids) {
            let bytes = match entry.map.get("r") {
                Some(redis::Value::BulkString(b)) => b.clone(),
                _ => Vec::new(),
            };
            let origin = match entry.map.get("o") {
                Some(redis::Value::BulkString(b)) => String::from_utf8_lossy(b).into_owned(),
                _ => String::new(),
            };
            // Up to a read's 256 records: queries on this executor are not held up
            // for all of them.
            glommio::yield_if_needed().await;
            if !dispatch(r, inboxes, &bytes, &origin).await {
                // Skipping it would leave this replica answering otherwise than those
                // that read it (another kvix version's record, or a foreign writer).
                let why = format!(
                    "the write log holds a record this server cannot read (entry {} of \
                     {} bytes, written by another kvix version or another program): it \
                     stopped following the log rather than skip it",
                    entry.id,
                    bytes.len()
                );
                r.stop_following(Stopped::Unreadable, why);
                return;
            }
            r.at(&entry.id);
            *position = entry.id;
            dispatched = true;
        }
        if dispatched {
            // The next read waits for the executor's next turn through its reactor: the
            // writes just handed over are applied and their clients answered first. Its
            // send (a syscall that wakes Redis: ~20 µs here) would otherwise come before
            // them, on every acknowledged write's path (docs/benchmarks.md §8).
            glommio::timer::sleep(Duration::from_micros(1)).await;
        }
        if !r.caught_up.load(Relaxed)
            && tail
                .as_deref()
                .is_some_and(|t| id_key(position) >= id_key(t))
        {
            tracing::info!(%position, "caught up with the write log");
            r.caught_up.store(true, Relaxed);
            r.first_caught_up.set();
        }
    }
}

/// Sends one record to the executor that applies it; false when it does not decode.
async fn dispatch(
    r: &Replica,
    inboxes: &mut [mpsc::Sender<LogJob>],
    bytes: &[u8],
    origin: &str,
) -> bool {
    let mut aligned = kvix_wire::AlignedVec::with_capacity(bytes.len());
    aligned.extend_from_slice(bytes);
    let Ok(mut record) = rkyv::from_bytes::<Write, rkyv::rancor::Error>(&aligned) else {
        return false;
    };
    let waiter = origin
        .split_once(':')
        .filter(|(id, _)| *id == r.id)
        .and_then(|(_, t)| t.parse().ok())
        .and_then(|t| r.waiter(t));
    let n = inboxes.len();
    let home = |w: u32| w as usize % n;
    // Announces and retires are barriers: the records after them may name the worker.
    let (to, barrier) = match record.home_worker() {
        Ok(Some(worker)) => (home(worker), false),
        Ok(None) => (0, true),
        Err(_) => return false,
    };
    let (done, wait) = if barrier {
        let (tx, rx) = oneshot::channel();
        (Some(tx), Some(rx))
    } else {
        (None, None)
    };
    let job = LogJob::Apply {
        write: record,
        waiter,
        barrier: done,
    };
    if inboxes[to].send(job).await.is_err() {
        return true; // stopping
    }
    if let Some(rx) = wait {
        let _ = rx.await;
    }
    true
}

/// Asks every executor for its part after everything dispatched so far.
async fn mark(inboxes: &mut [mpsc::Sender<LogJob>], position: &str, req: oneshot::Sender<Mark>) {
    let mut parts = Vec::with_capacity(inboxes.len());
    for inbox in inboxes.iter_mut() {
        let (tx, rx) = oneshot::channel();
        let _ = inbox.send(LogJob::Export { reply: tx }).await;
        parts.push(rx);
    }
    let _ = req.send(Mark {
        position: position.to_string(),
        parts,
    });
}
