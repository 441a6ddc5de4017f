//! The log's blocking side, on threads of their own (off every write's path): what a
//! start fetches (the log's generation and fleet, the snapshot the fleet stored), and a
//! snapshot stored with the stream trimmed below it.

use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};

use redis::Commands;

use super::follower::{now_ms, STALE_MS};
use super::{fleet_key, generation_key, id_key, positions_key, snapshot_key, Replica};

/// Stores a snapshot in Redis for new replicas and records its position, after trimming
/// the stream below the oldest position still needed: this snapshot's and that of every
/// replica that reported in the last minute.
///
///
/// The trim comes first so that a log that filled Redis's memory (maxmemory: every
/// append refused) is freed by it: the store is then not refused for the memory it was
/// about to free, and the fleet heals by itself. Should the store still fail, the stored
/// snapshot is older than the trim point and a replica starting from it finds its
/// position trimmed and refuses (`kvix_log_stopped{reason="behind_trim"}`) until a later store succeeds.
///
/// Both happen only in the log of this replica's generation: a replica that has not yet
/// seen its log replaced must not trim the new one or store its old state in it.
pub fn publish_snapshot(r: &Replica, bytes: &[u8], position: &str) -> redis::RedisResult<()> {
    let mut c = r.connect()?;
    let key = &r.url.key;
    let replaced = || {
        redis::RedisError::from((
            redis::ErrorKind::Client,
            "the write log was replaced (another generation): snapshot not stored",
        ))
    };
    let generation = r.generation();
    let now: Option<String> = c.get(generation_key(key))?;
    if now.as_deref() != Some(generation.as_str()) {
        return Err(replaced());
    }
    trim(r, &mut c, position)?;
    let stored: u8 = redis::Script::new(STORE_SNAPSHOT)
        .key(generation_key(key))
        .key(snapshot_key(key))
        .key(positions_key(key))
        .arg(&generation)
        .arg(bytes)
        .arg(format!("{position} {}", u64::MAX))
        .arg(&r.id)
        .arg(format!("{position} {}", now_ms()))
        .invoke(&mut c)?;
    if stored == 0 {
        return Err(replaced());
    }
    Ok(())
}

/// Stores the snapshot and its position if the log is still of the generation ARGV[1].
const STORE_SNAPSHOT: &str = r"
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[2], ARGV[2])
redis.call('HSET', KEYS[3], 'snapshot', ARGV[3], ARGV[4], ARGV[5])
return 1";

/// Trims the stream below every position still needed once the snapshot at `snapshot`
/// is stored: it and every other replica that reported in the last minute (the snapshot
/// it replaces is not needed any more, and this replica has read at least as far as its
/// own snapshot: its last report may be older, or refused while Redis is out of memory).
pub fn trim(r: &Replica, c: &mut redis::Connection, snapshot: &str) -> redis::RedisResult<()> {
    let key = &r.url.key;
    let all: std::collections::HashMap<String, String> = c.hgetall(positions_key(key))?;
    let now = now_ms();
    let floor = all
        .iter()
        .filter(|(who, _)| who.as_str() != "snapshot" && **who != r.id)
        .filter_map(|(_, v)| v.split_once(' '))
        .filter(|(_, at)| {
            at.parse::<u64>()
                .is_ok_and(|at| at >= now.saturating_sub(STALE_MS))
        })
        .map(|(pos, _)| pos)
        .chain(std::iter::once(snapshot))
        .min_by_key(|p| id_key(p))
        .unwrap_or(snapshot)
        .to_string();
    let removed: u64 = redis::cmd("XTRIM")
        .arg(key)
        .arg("MINID")
        .arg(&floor)
        .query(c)?;
    r.metrics.trimmed.fetch_add(removed, Relaxed);
    // Replicas gone for good (each start reports under a new id): their positions are
    // not waited for any more, and would pile up.
    let gone: Vec<&String> = all
        .iter()
        .filter(|(who, _)| who.as_str() != "snapshot" && **who != r.id)
        .filter(|(_, v)| {
            v.split_once(' ')
                .and_then(|(_, at)| at.parse::<u64>().ok())
                .is_none_or(|at| at < now.saturating_sub(STALE_MS))
        })
        .map(|(who, _)| who)
        .collect();
    if !gone.is_empty() {
        let _: u64 = c.hdel(positions_key(key), gone)?;
    }
    Ok(())
}

/// How long a starting replica keeps trying a log it cannot reach (a Redis restarting,
/// a Sentinel between primaries) before it gives up: long enough for a failover, short
/// enough that a wrong address still fails the start while someone watches.
pub const START_WAIT: Duration = Duration::from_secs(30);

/// What a replica starts from: the log's generation and the snapshot stored in it.
pub struct LogStart {
    pub generation: String,
    /// The snapshot stored in Redis, if there is one.
    pub snapshot: Option<Vec<u8>>,
}

/// The log's generation (set now, to a new random id, where the key has none: a new
/// log, or one flushed or restarted without persistence) and its stored snapshot. Errors
/// that pass (the connection, a Sentinel that names no primary yet, Redis loading) are
/// retried for [`START_WAIT`], each logged with its cause; any other error, or the last,
/// is returned.
///
/// The log's fleet (`KEY:fleet`: the `--fleet` name and block size of the replica that
/// first started on it) must be this replica's, or the start is refused.
pub fn fetch_start(
    server: &super::LogServer,
    key: &str,
    fleet: &str,
) -> Result<LogStart, crate::error::StartError> {
    let failed = |source| crate::error::StartError::Log {
        server: server.to_string(),
        source,
    };
    let link = super::Link::open(server).map_err(failed)?;
    let fetch = || -> redis::RedisResult<LogStart> {
        let mut c = link.connect()?;
        let (_, theirs): (Option<String>, String) = redis::pipe()
            .cmd("SET")
            .arg(fleet_key(key))
            .arg(fleet)
            .arg("NX")
            .get(fleet_key(key))
            .query(&mut c)?;
        if theirs != fleet {
            return Err(redis::RedisError::from((
                redis::ErrorKind::Client,
                "another fleet's log",
                format!(
                    "the log at {server}/{key} belongs to another fleet ({theirs}); this \
                     replica is {fleet}: give each fleet its own key (or the same --fleet \
                     and --block-size if they are one)"
                ),
            )));
        }
        let (generation, snapshot): (Option<String>, Option<Vec<u8>>) = redis::pipe()
            .get(generation_key(key))
            .get(snapshot_key(key))
            .query(&mut c)?;
        if let Some(generation) = generation {
            return Ok(LogStart {
                generation,
                snapshot,
            });
        }
        // A new generation: its snapshot, if any, was stored by nobody (a snapshot left
        // without a generation is from before generations, and is taken as this log's).
        let new = format!("{:016x}", super::rand_id());
        let (_, generation, snapshot): (Option<String>, String, Option<Vec<u8>>) = redis::pipe()
            .cmd("SET")
            .arg(generation_key(key))
            .arg(&new)
            .arg("NX")
            .get(generation_key(key))
            .get(snapshot_key(key))
            .query(&mut c)?;
        if generation == new {
            tracing::info!(
                generation,
                "the write log had no generation: this one is new"
            );
        }
        Ok(LogStart {
            generation,
            snapshot,
        })
    };
    let deadline = Instant::now() + START_WAIT;
    let mut pause = Duration::from_millis(50);
    loop {
        match fetch() {
            Err(e) if passes(&e) && Instant::now() + pause < deadline => {
                tracing::warn!("the write log at {server} is not reachable yet, retrying: {e}");
                std::thread::sleep(pause);
                pause = (pause * 2).min(Duration::from_secs(2));
            }
            done => return done.map_err(failed),
        }
    }
}

/// Whether a Redis error is one that heals by itself: trying again later may succeed.
fn passes(e: &redis::RedisError) -> bool {
    use redis::{ErrorKind, ServerErrorKind};
    e.is_io_error()
        || e.is_timeout()
        || e.is_connection_refusal()
        || e.is_connection_dropped()
        || matches!(
            e.kind(),
            ErrorKind::MasterNameNotFoundBySentinel
                | ErrorKind::Server(
                    ServerErrorKind::BusyLoading
                        | ServerErrorKind::TryAgain
                        | ServerErrorKind::MasterDown
                )
        )
}
