//! One ingest per engine across the replicas: a replica subscribes to an engine's event
//! stream only while it holds that worker's lease in Redis (`KEY:lease:WORKER`, a value
//! naming the replica with a TTL it renews). Each acquisition takes a new epoch
//! (`KEY:epoch:WORKER`, INCR) that its appended deliveries carry; appliers drop
//! deliveries of an older epoch than they have seen, so a holder that lost its lease
//! without knowing (a pause, a partition) cannot interleave with its successor.
//!
//! An engine that connects (`--events-bind`) is heard only by the replica it connected
//! to: a replica takes such a lease only while the engine is connected to it, and gives
//! it up as soon as it is not, so the replica the engine reconnects to takes it over
//! (asking the engine's replay from the last batch the log holds). A bound engine no
//! replica has held the lease of for `--events-grace` is gone: a replica retires it.

use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Duration;

use kvix_wire::WorkerId;

use super::Replica;
use crate::ingest::Ingest;

/// How long a lease lives without renewal, and how often it is renewed.
pub const TTL: Duration = Duration::from_secs(5);
const RENEW: Duration = Duration::from_secs(1);

/// Renews our lease (1), takes a free one (2), or says it is someone else's (0).
/// A lease outlives a failed round (it is ours until its TTL runs out), so 1 for a worker
/// this replica is not leading means leading it again.
const SCRIPT: &str = r"
local v = redis.call('GET', KEYS[1])
if v == ARGV[1] then redis.call('PEXPIRE', KEYS[1], ARGV[2]) return 1 end
if not v then redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2]) return 2 end
return 0";

/// Releases our lease if it is still ours.
const RELEASE: &str = r"
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0";

pub fn run(r: Arc<Replica>, ingest: Arc<Ingest>) {
    let script = redis::Script::new(SCRIPT);
    let release = redis::Script::new(RELEASE);
    let mut conn: Option<redis::Connection> = None;
    let mut away = Away::default();
    let mut generations = r.generations();
    while !r.stopped() {
        std::thread::sleep(RENEW);
        if r.generations() != generations {
            // The log was rebuilt: an epoch taken while it was lost came from a flushed
            // counter, below the rebuilt log's; every stream is taken up again anew.
            generations = r.generations();
            drop_all(&r, &ingest);
        }
        if !r.caught_up.load(Relaxed) {
            // Not following the log (yet, or any more): nothing it ingests could be
            // appended.
            drop_all(&r, &ingest);
            continue;
        }
        if conn.is_none() {
            conn = r.connect().ok();
        }
        let Some(c) = conn.as_mut() else {
            drop_all(&r, &ingest);
            continue;
        };
        let sources = ingest.sources();
        let mut failed = false;
        for (worker, source) in &sources {
            let key = format!("{}:lease:{worker}", r.url.key);
            match ingest.bound_here(source) {
                Some(false) => {
                    if ingest.leads(*worker) {
                        tracing::info!(
                            worker,
                            "ingest lease given up: the engine is not connected here any more"
                        );
                        ingest.follow(*worker);
                        let _: redis::RedisResult<u8> = release.key(&key).arg(&r.id).invoke(c);
                    }
                    let held: redis::RedisResult<bool> = redis::cmd("EXISTS").arg(&key).query(c);
                    match held {
                        Ok(held) => away.note(&ingest, *worker, held),
                        Err(_) => failed = true,
                    }
                    if failed {
                        break;
                    }
                    continue;
                }
                Some(true) => away.note(&ingest, *worker, true),
                None => {}
            }
            let got: redis::RedisResult<u8> = script
                .key(&key)
                .arg(&r.id)
                .arg(TTL.as_millis() as u64)
                .invoke(c);
            match got {
                Ok(1) if ingest.leads(*worker) => {}
                // Taken now; or still ours but not led: a failed round stopped every
                // stream while the lease lived on in Redis, so renewing it is taking it
                // up again (with a new epoch, as any acquisition).
                Ok(1 | 2) => {
                    let epoch: redis::RedisResult<u64> = redis::cmd("INCR")
                        .arg(super::epoch_key(&r.url.key, *worker))
                        .query(c);
                    match epoch {
                        Ok(epoch) => {
                            tracing::info!(worker, epoch, "ingest lease taken");
                            r.metrics.lease_changes.fetch_add(1, Relaxed);
                            ingest.lead(*worker, epoch);
                        }
                        Err(_) => failed = true,
                    }
                }
                Ok(_) => {
                    if ingest.leads(*worker) {
                        tracing::warn!(worker, "ingest lease lost");
                        ingest.follow(*worker);
                    }
                }
                Err(_) => failed = true,
            }
            if failed {
                break;
            }
        }
        // Leases of workers no longer subscribed (retired, announced without a source).
        let gone: Vec<WorkerId> = ingest
            .led()
            .into_iter()
            .filter(|w| !sources.iter().any(|(s, _)| s == w))
            .collect();
        for w in gone {
            ingest.follow(w);
            let _: redis::RedisResult<u8> = release
                .key(format!("{}:lease:{w}", r.url.key))
                .arg(&r.id)
                .invoke(c);
        }
        if failed {
            // Unable to renew: stop ingesting before the lease can run out on us.
            conn = None;
            drop_all(&r, &ingest);
        }
        r.metrics
            .leases_held
            .store(ingest.led().len() as u64, Relaxed);
    }
}

/// Since when each bound engine has had no lease holder, as this replica saw it, and
/// when its retire went out.
#[derive(Default)]
struct Away {
    since: std::collections::HashMap<WorkerId, std::time::Instant>,
    retired: std::collections::HashMap<WorkerId, std::time::Instant>,
}

impl Away {
    /// Notes whether anyone holds the worker's lease; retires it once nobody has for
    /// the grace period (again every 10 s while it stays).
    fn note(&mut self, ingest: &Ingest, worker: WorkerId, held: bool) {
        let now = std::time::Instant::now();
        if held {
            self.since.remove(&worker);
            self.retired.remove(&worker);
            return;
        }
        let since = *self.since.entry(worker).or_insert(now);
        let grace = ingest.bound_grace().unwrap_or(Duration::MAX);
        let sent = self
            .retired
            .get(&worker)
            .is_some_and(|t| now.duration_since(*t) < Duration::from_secs(10));
        if now.duration_since(since) >= grace && !sent {
            tracing::warn!(worker, "ingest: the engine has had no connection to any replica for {grace:?} (--events-grace); retiring its worker");
            self.retired.insert(worker, now);
            ingest.retire_gone(worker);
        }
    }
}

fn drop_all(r: &Replica, ingest: &Ingest) {
    for w in ingest.led() {
        ingest.follow(w);
    }
    r.metrics.leases_held.store(0, Relaxed);
}
