//! What a replica's start asks of the log, before any executor runs (blocking, on the
//! starting thread): the log's generation and fleet and the snapshot the fleet stored;
//! on a key found empty, the wait for a replica holding the fleet's state to rebuild it
//! (this one, if its snapshot file is the most advanced); and `kvix-server log reset`.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use redis::Commands;

use super::{fleet_key, generation_key, rebuild_key};
use crate::error::StartError;

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

/// The log's generation and its stored snapshot; `None` where the key has no generation
/// (a new key, or a log flushed or restarted without persistence) and `new` is false.
/// With `new` (`--log-new`, a fleet's first start) such a key gets a new generation at
/// once. Errors that pass (the connection, a Sentinel that names no primary yet, Redis
/// loading) are retried for [`START_WAIT`], each logged with its cause; any other error,
/// or the last, is returned.
///
/// The log's fleet (`KEY:fleet`: the `--fleet` name and block size of the replica that
/// first started on it) must be this replica's, or the start is refused.
pub fn fetch_start(
    server: &super::LogServer,
    key: &str,
    fleet: &str,
    new: bool,
) -> Result<Option<LogStart>, StartError> {
    let link = super::Link::open(server).map_err(failed(server))?;
    patiently(server, || {
        let mut c = link.connect()?;
        let (generation, snapshot): (Option<String>, Option<Vec<u8>>) =
            super::store::generation_and_snapshot(key).query(&mut c)?;
        let generation = match generation {
            Some(generation) => generation,
            None if !new => return Ok(None),
            None => begin(&mut c, key)?,
        };
        of_fleet(&mut c, server, key, fleet)?;
        Ok(Some(LogStart {
            generation,
            snapshot,
        }))
    })
}

/// A new, empty generation on a key that has none (the one already there where another
/// replica was quicker). A snapshot left without a generation is from before
/// generations, and stays this log's.
fn begin(c: &mut redis::Connection, key: &str) -> redis::RedisResult<String> {
    let new = format!("{:016x}", super::rand_id());
    let (_, generation): (Option<String>, String) =
        super::store::set_once(&generation_key(key), &new, None).query(c)?;
    if generation == new {
        tracing::info!(
            generation,
            "the write log had no generation: this one is new"
        );
    }
    Ok(generation)
}

/// Records this replica's fleet on a key that has none, and refuses another fleet's.
fn of_fleet(
    c: &mut redis::Connection,
    server: &super::LogServer,
    key: &str,
    fleet: &str,
) -> redis::RedisResult<()> {
    let (_, theirs): (Option<String>, String) =
        super::store::set_once(&fleet_key(key), fleet, None).query(c)?;
    if theirs == fleet {
        return Ok(());
    }
    Err(redis::RedisError::from((
        redis::ErrorKind::Client,
        "another fleet's log",
        format!(
            "the log at {server}/{key} belongs to another fleet ({theirs}); this replica is \
             {fleet}: give each fleet its own key (or the same --fleet and --block-size if \
             they are one)"
        ),
    )))
}

/// What `kvix-server log reset` found.
pub enum Reset {
    /// The key had no generation: it now has this new, empty one.
    Started(String),
    /// The key has a generation: the log is live, and nothing was changed.
    Live(String),
}

/// Starts an empty fleet on a key that has no generation (`kvix-server log reset`): the
/// operator's word that no replica holds the fleet's state. A live log is left alone.
pub fn reset(server: &super::LogServer, key: &str, fleet: &str) -> Result<Reset, StartError> {
    let link = super::Link::open(server).map_err(failed(server))?;
    patiently(server, || {
        let mut c = link.connect()?;
        let had: Option<String> = c.get(generation_key(key))?;
        if let Some(generation) = had {
            return Ok(Reset::Live(generation));
        }
        let generation = begin(&mut c, key)?;
        of_fleet(&mut c, server, key, fleet)?;
        Ok(Reset::Started(generation))
    })
}

/// A replica that finds the log's key empty and holds a snapshot file of the lost
/// generation: a candidate to rebuild it, as a running replica that saw it lost is.
pub struct Candidate<'a> {
    /// The generation the snapshot is of.
    pub lost: String,
    /// The stream position the snapshot covers.
    pub position: String,
    /// The snapshot as the base of a new generation starting at the mark.
    pub base: &'a dyn Fn(&super::LogMark) -> super::Base,
}

/// How an empty key's wait ended.
pub enum Awaited {
    /// A replica rebuilt the log (or an operator reset it): start from it.
    Found(LogStart),
    /// This replica was the most advanced candidate: its snapshot is the base of this new
    /// generation.
    Led(String),
}

/// How long candidates at start post their positions before the most advanced is chosen
/// (as long as running replicas wait for their peers, within half the whole wait).
const START_ELECTION: Duration = Duration::from_secs(15);

/// Waits, up to `wait`, for a log on a key found empty, so that a replica holding the
/// fleet's state rebuilds it before anyone starts an empty one: a running replica (it
/// elects and publishes a base within seconds), or this one, if it is a candidate and
/// the most advanced that posted. Then the start is refused, naming the way to start an
/// empty fleet: an empty log is never begun without the operator's word.
pub fn await_log(
    server: &super::LogServer,
    key: &str,
    fleet: &str,
    mut candidate: Option<Candidate<'_>>,
    wait: Duration,
) -> Result<Awaited, StartError> {
    tracing::warn!(
        "the write log at {server}/{key} is empty (no generation): a new key, or a log lost \
         (flushed, or a Redis restarted without persistence). Waiting up to {} s for a \
         replica holding the fleet's state to rebuild it; a new fleet starts with --log-new \
         or `kvix-server log reset`",
        wait.as_secs()
    );
    let link = super::Link::open(server).map_err(failed(server))?;
    let me = format!("{:016x}", super::rand_id());
    let start = Instant::now();
    let election = start + START_ELECTION.min(wait / 2);
    let mut posted = false;
    loop {
        let mut look = || -> redis::RedisResult<Option<Awaited>> {
            let mut c = link.connect()?;
            let (generation, snapshot): (Option<String>, Option<Vec<u8>>) =
                super::store::generation_and_snapshot(key).query(&mut c)?;
            if let Some(generation) = generation {
                of_fleet(&mut c, server, key, fleet)?;
                return Ok(Some(Awaited::Found(LogStart {
                    generation,
                    snapshot,
                })));
            }
            let Some(me_too) = &candidate else {
                return Ok(None);
            };
            if !posted {
                post(&mut c, key, me_too, &me)?;
                posted = true;
            }
            if Instant::now() < election {
                return Ok(None);
            }
            let lead = elect(&mut c, key, &me_too.lost, &me)?
                .then(|| lead(&mut c, key, me_too, fleet))
                .transpose()?
                .flatten();
            candidate = None;
            Ok(lead.map(Awaited::Led))
        };
        match look() {
            Ok(Some(awaited)) => return Ok(awaited),
            Ok(None) => {}
            Err(e) if passes(&e) => {
                tracing::warn!("waiting for the write log at {server}: {e}");
            }
            Err(e) => return Err(failed(server)(e)),
        }
        if start.elapsed() >= wait {
            return Err(StartError::LogEmpty {
                server: server.to_string(),
                key: key.to_string(),
                waited_s: wait.as_secs(),
            });
        }
        std::thread::sleep(Duration::from_millis(250));
    }
}

/// Posts a candidate's position in the lost generation's election.
fn post(
    c: &mut redis::Connection,
    key: &str,
    candidate: &Candidate<'_>,
    me: &str,
) -> redis::RedisResult<()> {
    super::store::post_position(key, &candidate.lost, me, &candidate.position).query::<()>(c)?;
    tracing::warn!(
        position = candidate.position,
        lost = candidate.lost,
        "this replica's snapshot file is of the lost log: its position is posted to rebuild it"
    );
    Ok(())
}

/// Chooses, once for all, the most advanced replica that posted; whether it is `me`.
fn elect(c: &mut redis::Connection, key: &str, lost: &str, me: &str) -> redis::RedisResult<bool> {
    let posted: HashMap<String, String> = c.hgetall(rebuild_key(key, lost))?;
    let best = super::store::most_advanced(&posted).unwrap_or_else(|| me.to_string());
    let (_, chosen): (Option<String>, String) = super::store::choose(key, lost, &best).query(c)?;
    if chosen != me {
        tracing::warn!(
            chosen,
            "another replica is more advanced: waiting for its rebuilt log"
        );
    }
    Ok(chosen == me)
}

/// The chosen candidate publishes its snapshot as the new generation's base; `None` if
/// another generation was started meanwhile.
fn lead(
    c: &mut redis::Connection,
    key: &str,
    candidate: &Candidate<'_>,
    fleet: &str,
) -> redis::RedisResult<Option<String>> {
    let new = format!("{:016x}", super::rand_id());
    let base = (candidate.base)(&super::LogMark::start_of(&new));
    let published: u8 =
        super::store::publish_base(key, &candidate.lost, &new, &base, fleet).query(c)?;
    if published == 0 {
        return Ok(None);
    }
    tracing::warn!(
        generation = new,
        "rebuilt the lost log from this replica's snapshot file: the new generation's base \
         is stored"
    );
    Ok(Some(new))
}

fn failed(server: &super::LogServer) -> impl Fn(redis::RedisError) -> StartError + '_ {
    move |source| StartError::Log {
        server: server.to_string(),
        source,
    }
}

/// Runs `f` until it succeeds or fails for good: errors that pass are retried for
/// [`START_WAIT`], each logged with its cause.
fn patiently<T>(
    server: &super::LogServer,
    mut f: impl FnMut() -> redis::RedisResult<T>,
) -> Result<T, StartError> {
    let deadline = Instant::now() + START_WAIT;
    let mut pause = Duration::from_millis(50);
    loop {
        match f() {
            Err(e) if passes(&e) && Instant::now() + pause < deadline => {
                tracing::warn!("the write log at {server} is not reachable yet, retrying: {e}");
                std::thread::sleep(pause);
                pause = (pause * 2).min(Duration::from_secs(2));
            }
            done => return done.map_err(failed(server)),
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
