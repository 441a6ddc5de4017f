//! Ingest of real engine KV events: the server subscribes to the ZMQ publishers of the
//! vLLM / SGLang workers that announced an [`EventSource`].
//!
//! The path of one batch: [`pool`] (a bounded set of plain threads, each polling many
//! [`socket`] subscriptions) → [`stream`] (sequence, replay, restart detection; the
//! payload decoded by [`payload`]) → the worker's home executor over a bounded channel
//! (`write::inbox::serve_deliveries`, then `write::route_write`) → its write queue, where
//! [`states`] translates the engine events ([`translate`]) and the engine's feed turns them into block operations for every
//! executor, like any other write. Nothing goes through the network to the server
//! itself, and an ingest fault never takes an executor down.

pub mod bound;
mod context;
pub mod fleet;

use kvix_events::{payload, stream, translate};
pub mod pool;
pub mod socket;
pub mod states;

use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Mutex};

use futures::channel::mpsc;
use kvix_wire::{EventSource, Feed, WorkerId};

use crate::exposition::Exposition;
use pool::{Pool, StreamSpec};

/// Deliveries queued per executor before the ingest threads wait.
const INBOX: usize = 64;
/// Deliveries one executor applies at a time (each waits for every executor's ack).
pub const IN_FLIGHT: u64 = 16;

/// Where a source's events come from and which keyspace they are rehashed into.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SourceSpec {
    pub endpoint: String,
    pub replay: String,
    pub model: String,
    pub salt: String,
}

impl From<&EventSource> for SourceSpec {
    fn from(s: &EventSource) -> Self {
        SourceSpec {
            endpoint: s.endpoint.clone(),
            replay: s.replay.clone(),
            model: s.model.clone(),
            salt: s.salt.clone(),
        }
    }
}

/// Why an event source is refused at announce.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SourceError {
    #[error(
        "event source endpoint {0:?}: expected tcp://HOST:PORT or ipc://PATH (at most 107 bytes)"
    )]
    Endpoint(String),
    #[error("event source endpoint {0:?}: connect to the engine's address, not a wildcard (the engine binds tcp://*:PORT; name its host here)")]
    Wildcard(String),
    #[error("an event source needs the Events feed")]
    Feed,
    #[error("{max} event sources are subscribed already (--max-sources)")]
    TooMany { max: usize },
    #[error("event source endpoint {endpoint:?}: {addr} is outside --source-allow")]
    NotAllowed { endpoint: String, addr: String },
    #[error("event source endpoint {endpoint:?}: {why}")]
    Unresolved { endpoint: String, why: String },
    #[error("event source endpoint {0:?}: this server binds no --events-bind socket for that rank (bound://RANK/TOPIC)")]
    NotBound(String),
    #[error("a bound source may not take over {0:?}: that worker has another source, or none (retire it first)")]
    NameTaken(String),
}

/// Checks an endpoint the way libzmq will use it to connect, or a `bound://` one against
/// the ranks this server binds.
fn check_endpoint(ep: &str, bound_ranks: usize) -> Result<(), SourceError> {
    if ep.starts_with(bound::SCHEME) {
        return match bound::parse_source_endpoint(ep) {
            Some((rank, topic)) if rank < bound_ranks && !topic.is_empty() => Ok(()),
            _ => Err(SourceError::NotBound(ep.to_string())),
        };
    }
    let bad = || SourceError::Endpoint(ep.to_string());
    if let Some(path) = ep.strip_prefix("ipc://") {
        // A Unix socket path holds at most 107 bytes (sun_path).
        return if path.is_empty() || path.len() > 107 {
            Err(bad())
        } else {
            Ok(())
        };
    }
    let rest = ep.strip_prefix("tcp://").ok_or_else(bad)?;
    let (host, port) = rest.rsplit_once(':').ok_or_else(bad)?;
    if host == "*" || host == "0.0.0.0" || host == "[::]" {
        return Err(SourceError::Wildcard(ep.to_string()));
    }
    match port.parse::<u16>() {
        Ok(p) if p > 0 && !host.is_empty() => Ok(()),
        _ => Err(bad()),
    }
}

/// Checks that every address a tcp endpoint names (or resolves to) is in `allow` (None:
/// any). Blocking: it may ask the resolver.
pub fn check_hosts(
    source: &EventSource,
    allow: Option<&[ipnet::IpNet]>,
) -> Result<(), SourceError> {
    use std::net::ToSocketAddrs;
    let Some(allow) = allow else { return Ok(()) };
    for ep in [&source.endpoint, &source.replay] {
        let Some(rest) = ep.strip_prefix("tcp://") else {
            continue;
        };
        let (host, port) = rest.rsplit_once(':').unwrap_or((rest, "0"));
        let host = host.trim_start_matches('[').trim_end_matches(']');
        let port: u16 = port.parse().unwrap_or(0);
        let addrs: Vec<std::net::IpAddr> = match host.parse() {
            Ok(ip) => vec![ip],
            Err(_) => (host, port)
                .to_socket_addrs()
                .map_err(|e| SourceError::Unresolved {
                    endpoint: ep.clone(),
                    why: e.to_string(),
                })?
                .map(|a| a.ip())
                .collect(),
        };
        if let Some(bad) = addrs
            .iter()
            .find(|ip| !allow.iter().any(|n| n.contains(*ip)))
        {
            return Err(SourceError::NotAllowed {
                endpoint: ep.clone(),
                addr: bad.to_string(),
            });
        }
    }
    Ok(())
}

/// The process's ingest: its threads, the executors' inboxes, the sources subscribed.
pub struct Ingest {
    pool: Pool,
    inboxes: Mutex<Vec<Option<mpsc::Receiver<crate::write::record::Write>>>>,
    /// Every subscribed source by worker (executor 0 announces and retires; snapshots).
    sources: fleet::Sources,
    max_sources: usize,
    /// Ranks bound for engines to connect to (--events-bind; 0 without).
    bound_ranks: usize,
    /// --source-allow (None: any address).
    pub allow: Option<Arc<[ipnet::IpNet]>>,
    /// While the server restores (snapshot, write-ahead log), sources are recorded but
    /// not subscribed: [`Ingest::resume`] subscribes them where their streams left off.
    paused: std::sync::atomic::AtomicBool,
    /// Replicas: streams are subscribed only under a lease ([`Ingest::lead`]).
    leased: std::sync::atomic::AtomicBool,
    /// The last batch applied from each stream (the homes write it).
    lasts: Arc<states::Lasts>,
    /// Replicas: the streams this replica leads (holds the ingest lease of), with their
    /// lease's epoch. The lease thread decides ([`Ingest::lead`], [`Ingest::follow`]).
    leading: Mutex<std::collections::HashMap<WorkerId, u64>>,
    /// Streams with a rewind scheduled ([`Ingest::rewind_due`]).
    rewinding: Mutex<std::collections::HashSet<WorkerId>>,
    /// `--engines`: started once the server has restored ([`Ingest::resume`]).
    fleet: Mutex<Option<fleet::Applier>>,
    fleet_thread: Mutex<Option<std::thread::JoinHandle<()>>>,
    fleet_stop: Arc<std::sync::atomic::AtomicBool>,
}

impl Ingest {
    /// Starts `threads` ingest threads for `executors` executors, binding `bind`'s
    /// sockets for engines that connect; `engines` is the fleet file and `--block-size`.
    pub fn start(
        threads: usize,
        executors: usize,
        max_sources: usize,
        allow: Option<Vec<ipnet::IpNet>>,
        bind: Option<bound::BindSpec>,
        engines: Option<(std::path::PathBuf, u32)>,
    ) -> std::io::Result<Ingest> {
        let (senders, receivers): (Vec<_>, Vec<_>) =
            (0..executors).map(|_| mpsc::channel(INBOX)).unzip();
        METRICS.threads.store(threads.max(1) as u64, Relaxed);
        let sources = fleet::Sources::default();
        let fleet_stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let fleet = engines.map(|(path, block)| fleet::Applier {
            path,
            block,
            inbox: senders[0].clone(),
            sources: sources.clone(),
            stop: fleet_stop.clone(),
        });
        Ok(Ingest {
            fleet: Mutex::new(fleet),
            fleet_thread: Mutex::new(None),
            fleet_stop,
            bound_ranks: bind.as_ref().map_or(0, |b| b.endpoints.len()),
            pool: Pool::start(threads, max_sources, senders, bind)?,
            inboxes: Mutex::new(receivers.into_iter().map(Some).collect()),
            sources,
            max_sources,
            allow: allow.map(Into::into),
            paused: std::sync::atomic::AtomicBool::new(true),
            leased: std::sync::atomic::AtomicBool::new(false),
            leading: Mutex::default(),
            rewinding: Mutex::default(),
            lasts: Arc::default(),
        })
    }

    /// The record of each stream's last batch, for the executors' ingest states.
    pub fn lasts(&self) -> Arc<states::Lasts> {
        self.lasts.clone()
    }

    /// Executor `me`'s end of its inbox (once).
    pub fn take_inbox(&self, me: usize) -> Option<mpsc::Receiver<crate::write::record::Write>> {
        self.inboxes.lock().ok()?.get_mut(me)?.take()
    }

    /// Checks an announce's source before anything is registered: `known` is the id the
    /// name already has, if any (a worker replacing its own source is not one more).
    pub fn check(
        &self,
        source: &EventSource,
        feed: Feed,
        known: Option<WorkerId>,
    ) -> Result<(), SourceError> {
        check_endpoint(&source.endpoint, self.bound_ranks)?;
        if !source.replay.is_empty() {
            check_endpoint(&source.replay, 0)?;
        }
        if feed != Feed::Events {
            return Err(SourceError::Feed);
        }
        let sources = self.sources.lock().expect("not poisoned");
        // An engine that names itself on a bound socket never takes a name over.
        let bound = source.endpoint.starts_with(bound::SCHEME);
        if bound && known.is_some_and(|w| sources.get(&w).map(|s| &s.source) != Some(source)) {
            return Err(SourceError::NameTaken(source.endpoint.clone()));
        }
        let replacing = known.is_some_and(|w| sources.contains_key(&w));
        if !replacing && sources.len() >= self.max_sources {
            return Err(SourceError::TooMany {
                max: self.max_sources,
            });
        }
        Ok(())
    }

    /// After an announce is installed everywhere: subscribes, resubscribes or stops the
    /// worker's stream. `fresh`: the server dropped what the worker held.
    pub fn announced(
        &self,
        worker: WorkerId,
        name: &str,
        source: Option<EventSource>,
        fresh: bool,
    ) {
        let mut sources = self.sources.lock().expect("not poisoned");
        let sourced = |source| fleet::Sourced {
            name: name.to_string(),
            source,
        };
        // Restoring, or a replica (the lease decides who subscribes): record only.
        if self.paused.load(Relaxed) || self.leased.load(Relaxed) {
            match source {
                Some(s) => sources.insert(worker, sourced(s)),
                None => sources.remove(&worker),
            };
            return;
        }
        match source {
            None => {
                if sources.remove(&worker).is_some() {
                    self.pool.unsubscribe(worker);
                }
            }
            Some(s) => {
                if !fresh && sources.get(&worker).is_some_and(|was| was.source == s) {
                    return;
                }
                // A new source for blocks the worker still holds: the stream keeps its
                // last batch, so that a new process behind it (counting from 0 again,
                // or unknown to the replay) is told apart and the old blocks cleared.
                let last = if fresh { None } else { self.lasts.get(worker) };
                let s = sourced(s);
                self.pool.subscribe(stream_spec(worker, &s, last, 0));
                sources.insert(worker, s);
            }
        }
    }

    /// Records the source of worker `name` restored from a snapshot (subscribed by
    /// [`Ingest::resume`]).
    pub fn restore(&self, worker: WorkerId, name: &str, source: EventSource) {
        let sourced = fleet::Sourced {
            name: name.to_string(),
            source,
        };
        let mut sources = self.sources.lock().expect("not poisoned");
        sources.insert(worker, sourced);
    }

    /// Ends the restore: subscribes every source, each stream resuming after the last
    /// batch its worker's home applied.
    pub fn resume(&self) {
        let sources = self.sources.lock().expect("not poisoned");
        if !self.leased.load(Relaxed) {
            for (&worker, s) in sources.iter() {
                let last = self.lasts.get(worker);
                self.pool.subscribe(stream_spec(worker, s, last, 0));
            }
        }
        drop(sources);
        self.paused.store(false, Relaxed);
        self.pool.discover();
        if let Some(applier) = self.fleet.lock().expect("not poisoned").take() {
            match std::thread::Builder::new()
                .name("kvix-fleet".into())
                .spawn(move || applier.run())
            {
                Ok(t) => *self.fleet_thread.lock().expect("not poisoned") = Some(t),
                Err(e) => tracing::error!(
                    "--engines: the thread that applies the file did not start: {e}"
                ),
            }
        }
    }

    /// Replicas: streams start only under a lease.
    pub fn set_leased(&self) {
        self.leased.store(true, Relaxed);
    }

    /// This replica took the worker's lease at `epoch`: subscribe where its stream is.
    pub fn lead(&self, worker: WorkerId, epoch: u64) {
        self.leading
            .lock()
            .expect("not poisoned")
            .insert(worker, epoch);
        self.subscribe_after_last(worker, epoch);
    }

    /// A delivery of the worker's stream was refused on its way or out of step: true
    /// when a rewind is to be scheduled (none is pending yet).
    pub fn rewind_due(&self, worker: WorkerId) -> bool {
        self.rewinding.lock().expect("not poisoned").insert(worker)
    }

    /// Starts the worker's stream again from the last batch applied from it, where this
    /// server ingests it: the engine's replay re-sends what was refused, and deliveries
    /// the log took meanwhile are not applied twice (each continues one batch only).
    pub fn rewind(&self, worker: WorkerId) {
        self.rewinding.lock().expect("not poisoned").remove(&worker);
        if self.paused.load(Relaxed) {
            return;
        }
        let epoch = if self.leased.load(Relaxed) {
            match self.leading.lock().expect("not poisoned").get(&worker) {
                Some(&epoch) => epoch,
                None => return,
            }
        } else {
            0
        };
        METRICS.rewinds.fetch_add(1, Relaxed);
        self.subscribe_after_last(worker, epoch);
    }

    /// Subscribes the worker's source, its stream resuming after the last batch applied.
    fn subscribe_after_last(&self, worker: WorkerId, epoch: u64) {
        let Some(s) = self
            .sources
            .lock()
            .expect("not poisoned")
            .get(&worker)
            .cloned()
        else {
            return;
        };
        let last = self.lasts.get(worker);
        self.pool.subscribe(stream_spec(worker, &s, last, epoch));
    }

    /// Whether this replica leads the worker's stream.
    pub fn leads(&self, worker: WorkerId) -> bool {
        self.leading
            .lock()
            .expect("not poisoned")
            .contains_key(&worker)
    }

    /// The workers whose streams this replica leads.
    pub fn led(&self) -> Vec<WorkerId> {
        let leading = self.leading.lock().expect("not poisoned");
        leading.keys().copied().collect()
    }

    /// This replica no longer holds the worker's lease.
    pub fn follow(&self, worker: WorkerId) {
        self.leading.lock().expect("not poisoned").remove(&worker);
        self.pool.unsubscribe(worker);
    }

    /// The worker was retired.
    pub fn retired(&self, worker: WorkerId) {
        if self
            .sources
            .lock()
            .expect("not poisoned")
            .remove(&worker)
            .is_some()
        {
            self.pool.unsubscribe(worker);
        }
    }

    /// Every subscribed source, by worker.
    pub fn sources(&self) -> Vec<(WorkerId, EventSource)> {
        let sources = self.sources.lock().expect("not poisoned");
        sources
            .iter()
            .map(|(w, s)| (*w, s.source.clone()))
            .collect()
    }

    /// Stops the ingest threads.
    pub fn stop(&self) {
        self.fleet_stop.store(true, Relaxed);
        if let Some(t) = self.fleet_thread.lock().expect("not poisoned").take() {
            let _ = t.join();
        }
        self.pool.stop();
    }
}

crate::metric_set! {
    /// Process-wide ingest counters (the ingest threads and the executors add to them).
    /// docs/operations.md ("Is the stream healthy?") says what each means.
    pub struct Metrics {
        /// Live messages received from publishers.
        messages: Counter Sum "kvix_ingest_messages_total",
        /// Event batches delivered to their worker's home (live or replayed).
        applied: Counter Sum "kvix_ingest_batches_applied_total",
        /// Messages or payloads that could not be decoded (skipped whole).
        malformed: Counter Sum "kvix_ingest_malformed_total",
        /// Publisher sequence gaps seen (filled by a replay where the publisher has one).
        gaps: Counter Sum "kvix_ingest_gaps_total",
        /// Event batches recovered from a replay socket.
        replayed: Counter Sum "kvix_ingest_replayed_total",
        /// Replays that got no answer or did not finish (retried later).
        replay_failures: Counter Sum "kvix_ingest_replay_failures_total",
        /// Replays that came back with replies missing (asked again from the hole).
        replay_holes: Counter Sum "kvix_ingest_replay_holes_total",
        /// New publisher processes detected: the worker cleared and rebuilt from replay.
        restarts: Counter Sum "kvix_ingest_restarts_total",
        /// Batches already applied (seen again live after a replay).
        duplicates: Counter Sum "kvix_ingest_duplicates_total",
        /// Engine events skipped, by reason.
        skipped: Counter Sum "kvix_ingest_skipped_events_total" by "reason" (&translate::SKIP_LABELS),
        /// Engine blocks stored, by medium.
        stored: Counter Sum "kvix_ingest_blocks_stored_total" by "medium" (&payload::Medium::LABELS),
        /// Engine blocks removed, by medium.
        removed: Counter Sum "kvix_ingest_blocks_removed_total" by "medium" (&payload::Medium::LABELS),
        /// Keyspace blocks stored or removed by ingested batches.
        block_events: Counter Sum "kvix_ingest_block_events_total",
        /// Removed blocks the stream never saw stored.
        unknown_removals: Counter Sum "kvix_ingest_unknown_removals_total",
        /// Stores whose blocks carry extra keys (multimodal items, prompt embeddings).
        extra_keys: Counter Sum "kvix_ingest_extra_keys_total",
        /// Stores starting a prompt with a cache salt (filed under the salt's keyspace).
        salted: Counter Sum "kvix_ingest_salted_total",
        /// Translated batches the worker's feed refused (a bug if it shows up).
        refused: Counter Sum "kvix_ingest_refused_total",
        /// Translated stores not indexed because the index held --max-blocks blocks.
        dropped_full: Counter Sum "kvix_ingest_stores_dropped_full_total",
        /// Messages on --events-bind whose topic has not the --events-topic form.
        unknown_topics: Counter Sum "kvix_ingest_unknown_topics_total",
        /// Messages on --events-bind dropped past what their stream may hold unread.
        inbox_dropped: Counter Sum "kvix_ingest_inbox_dropped_total",
        /// Engine-fed workers whose history is lost (batches went by unapplied).
        history_lost: Gauge Sum "kvix_ingest_workers_history_lost",
        /// Times the --engines file was applied (at start and at each SIGHUP).
        fleet_applies: Counter Sum "kvix_fleet_file_applies_total",
        /// Times the --engines file did not read (nothing changed).
        fleet_errors: Counter Sum "kvix_fleet_file_errors_total",
        /// Workers the --engines file declares, as last applied.
        fleet_workers: Gauge Sum "kvix_fleet_file_workers",
        /// Announces sent for engines first heard of on --events-bind.
        engines_announced: Counter Sum "kvix_ingest_engines_announced_total",
        /// Bound workers retired because their engine had no connection for --events-grace.
        engines_gone: Counter Sum "kvix_ingest_engines_gone_total",
        /// Announces of engines first heard of on --events-bind that were refused.
        discovery_refused: Counter Sum "kvix_ingest_engines_refused_total",
        /// Deliveries for workers retired or re-announced while on their way.
        orphaned: Counter Sum "kvix_ingest_orphaned_total",
        /// Deliveries read under an ingest lease another replica has taken since.
        fenced: Counter Sum "kvix_ingest_fenced_total",
        /// Deliveries that do not continue the last batch applied from their stream.
        out_of_step: Counter Sum "kvix_ingest_out_of_step_total",
        /// Streams started again from the last batch applied.
        rewinds: Counter Sum "kvix_ingest_rewinds_total",
        /// Subscriptions that could not be opened.
        connect_failures: Counter Sum "kvix_ingest_connect_failures_total",
        /// Publishers currently connected.
        connected: Gauge Sum "kvix_ingest_publishers_connected",
        /// Event sources subscribed.
        sources: Gauge Sum "kvix_ingest_sources",
        /// Ingest threads (--ingest-threads).
        threads: Gauge Sum "kvix_ingest_threads",
        /// Replays asked for and not yet ended.
        replays_in_flight: Gauge Sum "kvix_ingest_replays_in_flight",
        /// Replays waiting for one in flight on their thread to end.
        replays_queued: Gauge Sum "kvix_ingest_replays_queued",
    }
}

pub static METRICS: Metrics = Metrics::new();

impl Metrics {
    pub fn record(&self, c: &translate::Counts) {
        for (a, n) in self.skipped.iter().zip(c.skipped) {
            a.fetch_add(n, Relaxed);
        }
        for (a, n) in self.stored.iter().zip(c.stored) {
            a.fetch_add(n, Relaxed);
        }
        for (a, n) in self.removed.iter().zip(c.removed) {
            a.fetch_add(n, Relaxed);
        }
        self.unknown_removals.fetch_add(c.unknown_removals, Relaxed);
        self.extra_keys.fetch_add(c.extra_keys, Relaxed);
        self.salted.fetch_add(c.salted, Relaxed);
    }

    pub fn tally(&self, t: &stream::Tally) {
        self.applied.fetch_add(t.applied, Relaxed);
        self.duplicates.fetch_add(t.duplicates, Relaxed);
        self.gaps.fetch_add(t.gaps, Relaxed);
        self.replayed.fetch_add(t.replayed, Relaxed);
        self.replay_failures.fetch_add(t.replay_failures, Relaxed);
        self.replay_holes.fetch_add(t.holes, Relaxed);
        self.restarts.fetch_add(t.restarts, Relaxed);
        self.malformed.fetch_add(t.malformed, Relaxed);
    }

    pub fn block_events(&self, n: u64) {
        self.block_events.fetch_add(n, Relaxed);
    }
}

/// The subscription of `worker`'s source, its stream resuming after `last`.
fn stream_spec(
    worker: WorkerId,
    s: &fleet::Sourced,
    last: Option<stream::LastBatch>,
    epoch: u64,
) -> StreamSpec {
    StreamSpec {
        worker,
        name: s.name.clone(),
        source: Arc::new(SourceSpec::from(&s.source)),
        last,
        epoch,
    }
}

/// Appends the ingest metrics in Prometheus text format.
pub fn render(out: &mut Exposition) {
    out.families(Metrics::FAMILIES, std::slice::from_ref(&METRICS));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hosts_outside_the_allowed_networks_are_refused() {
        let allow: Vec<ipnet::IpNet> = vec![
            "127.0.0.0/8".parse().unwrap(),
            "10.0.0.0/8".parse().unwrap(),
        ];
        let src = |ep: &str, replay: &str| EventSource {
            endpoint: ep.into(),
            replay: replay.into(),
            model: String::new(),
            salt: String::new(),
        };
        let ok = |ep, replay| check_hosts(&src(ep, replay), Some(&allow[..]));
        assert_eq!(ok("tcp://127.0.0.1:5", "tcp://10.1.2.3:6"), Ok(()));
        assert_eq!(ok("ipc:///tmp/x", ""), Ok(()));
        assert_eq!(ok("tcp://localhost:5", ""), Ok(()));
        assert!(matches!(
            ok("tcp://8.8.8.8:5", ""),
            Err(SourceError::NotAllowed { .. })
        ));
        assert!(matches!(
            ok("tcp://127.0.0.1:5", "tcp://[2001:db8::1]:6"),
            Err(SourceError::NotAllowed { .. })
        ));
        assert_eq!(check_hosts(&src("tcp://8.8.8.8:5", ""), None), Ok(()));
    }

    #[test]
    fn endpoints_are_checked_as_libzmq_connects_to_them() {
        for ok in [
            "tcp://127.0.0.1:5557",
            "tcp://[::1]:5557",
            "tcp://engine-0:1",
            "ipc:///tmp/kv.sock",
        ] {
            assert_eq!(check_endpoint(ok, 0), Ok(()), "{ok}");
        }
        for bad in [
            "",
            "tcp://127.0.0.1",
            "tcp://:5557",
            "tcp://h:0",
            "tcp://h:x",
            "udp://h:1",
            "ipc://",
            "inproc://kv",
            &format!("ipc:///{}", "x".repeat(120)),
        ] {
            assert!(
                matches!(check_endpoint(bad, 0), Err(SourceError::Endpoint(_))),
                "{bad}"
            );
        }
        assert!(matches!(
            check_endpoint("tcp://*:5557", 0),
            Err(SourceError::Wildcard(_))
        ));
        assert_eq!(check_endpoint("bound://1/kv@h@m", 2), Ok(()));
        for bad in ["bound://2/kv@h@m", "bound://0/", "bound://x/t", "bound://0"] {
            assert!(
                matches!(check_endpoint(bad, 2), Err(SourceError::NotBound(_))),
                "{bad}"
            );
        }
        assert!(matches!(
            check_endpoint("bound://0/kv@h@m", 0),
            Err(SourceError::NotBound(_))
        ));
    }
}
