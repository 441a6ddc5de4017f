//! The log's blocking side, on threads of their own (off every write's path): a
//! snapshot stored with the stream trimmed below it, and a lost log's new base.

use std::collections::HashMap;
use std::sync::atomic::Ordering::Relaxed;

use redis::Commands;

use super::follower::{now_ms, STALE_MS};
use super::{
    chosen_key, epoch_key, fleet_key, generation_key, id_key, positions_key, rebuild_key,
    snapshot_key, Replica,
};

/// Stores a snapshot in Redis for new replicas and records its position, after trimming
/// the stream below the oldest position still needed: this snapshot's and that of every
/// replica that reported in the last minute.
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

/// Sets `key` to `value` unless it has one (expiring after `ttl_s`, if given), and reads
/// back what it holds: (the SET's reply, the value that won) in one round trip.
pub fn set_once(key: &str, value: &str, ttl_s: Option<u64>) -> redis::Pipeline {
    let mut set = redis::cmd("SET");
    set.arg(key).arg(value).arg("NX");
    if let Some(ttl) = ttl_s {
        set.arg("EX").arg(ttl);
    }
    let mut p = redis::pipe();
    p.add_command(set).get(key);
    p
}

/// The log's generation and its stored snapshot, in one round trip.
pub fn generation_and_snapshot(key: &str) -> redis::Pipeline {
    let mut p = redis::pipe();
    p.get(generation_key(key)).get(snapshot_key(key));
    p
}

/// How long a lost generation's election keys are kept.
const ELECTION_TTL_S: u64 = 3600;

/// Posts replica `id`'s position in the election that rebuilds the lost generation
/// `lost`.
pub fn post_position(key: &str, lost: &str, id: &str, position: &str) -> redis::Pipeline {
    let candidates = rebuild_key(key, lost);
    let mut p = redis::pipe();
    p.hset(&candidates, id, position)
        .ignore()
        .expire(&candidates, ELECTION_TTL_S as i64)
        .ignore();
    p
}

/// Chooses `best` to rebuild the lost generation `lost`, once for all; the reply's
/// second value is the replica chosen.
pub fn choose(key: &str, lost: &str, best: &str) -> redis::Pipeline {
    set_once(&chosen_key(key, lost), best, Some(ELECTION_TTL_S))
}

/// The replica that posted the most advanced position (ties to the greatest id).
pub fn most_advanced(posted: &HashMap<String, String>) -> Option<String> {
    posted
        .iter()
        .max_by_key(|(id, at)| (id_key(at), id.as_str()))
        .map(|(id, _)| id.clone())
}

/// Publishes a rebuilt log's base if the key still has the lost generation `old` or
/// none: the stream and positions dropped, the snapshot stored, the fleet restored,
/// each ingest epoch at least the base's, then the new generation. The reply is 1 if
/// it was published.
pub fn publish_base(
    key: &str,
    old: &str,
    new: &str,
    base: &super::Base,
    fleet: &str,
) -> redis::Cmd {
    let mut keys = vec![
        generation_key(key),
        key.to_string(),
        positions_key(key),
        snapshot_key(key),
        fleet_key(key),
    ];
    keys.extend(base.epochs.iter().map(|(w, _)| epoch_key(key, *w)));
    let mut publish = redis::cmd("EVAL");
    publish.arg(PUBLISH_BASE).arg(keys.len()).arg(&keys);
    publish.arg(old).arg(new).arg(&base.snapshot).arg(fleet);
    for (_, epoch) in &base.epochs {
        publish.arg(*epoch);
    }
    publish
}

/// See [`publish_base`]: KEYS[1..5] the generation, stream, positions, snapshot and
/// fleet; KEYS[6..] the epochs, whose values are ARGV[5..]; ARGV[1..4] the lost and new
/// generations, the snapshot and the fleet.
const PUBLISH_BASE: &str = r"
local now = redis.call('GET', KEYS[1])
if now and now ~= ARGV[1] then return 0 end
redis.call('DEL', KEYS[2], KEYS[3])
redis.call('SET', KEYS[4], ARGV[3])
redis.call('SET', KEYS[5], ARGV[4], 'NX')
for i = 6, #KEYS do
  local had = tonumber(redis.call('GET', KEYS[i]) or '0')
  if had < tonumber(ARGV[i - 1]) then redis.call('SET', KEYS[i], ARGV[i - 1]) end
end
redis.call('SET', KEYS[1], ARGV[2])
return 1";
