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
pub mod engines_file;

use kvix_events::stream;
pub mod metrics;
pub mod pool;
pub mod socket;
pub mod sources;
pub mod states;

pub use metrics::{render, METRICS};
use sources::check_endpoint;
pub use sources::{check_hosts, SourceError};

use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Mutex};

use futures::channel::mpsc;
use kvix_wire::{EventSource, Feed, WorkerId};

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
/// The process's ingest: its threads, the executors' inboxes, the sources subscribed.
pub struct Ingest {
    pool: Pool,
    inboxes: Mutex<Vec<Option<mpsc::Receiver<crate::write::record::Write>>>>,
    /// Every subscribed source by worker (executor 0 announces and retires; snapshots).
    sources: engines_file::Sources,
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
    engines_file: Mutex<Option<engines_file::Applier>>,
    engines_file_thread: Mutex<Option<std::thread::JoinHandle<()>>>,
    engines_file_stop: Arc<std::sync::atomic::AtomicBool>,
    /// Executor 0's inbox: where the replicas' lease thread sends the retire of a bound
    /// engine no replica has had a connection from for the grace period.
    to_home: Mutex<mpsc::Sender<crate::write::record::Write>>,
}

impl Ingest {
    /// Starts `threads` ingest threads for `executors` executors, binding `bind`'s
    /// sockets for engines that connect; `engines` is the --engines file and `--block-size`.
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
        let sources = engines_file::Sources::default();
        let engines_file_stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let applier = engines.map(|(path, block)| engines_file::Applier {
            path,
            block,
            inbox: senders[0].clone(),
            sources: sources.clone(),
            stop: engines_file_stop.clone(),
        });
        Ok(Ingest {
            to_home: Mutex::new(senders[0].clone()),
            engines_file: Mutex::new(applier),
            engines_file_thread: Mutex::new(None),
            engines_file_stop,
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
    pub fn admit_source(
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
        let sourced = |source| engines_file::Sourced {
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
        let sourced = engines_file::Sourced {
            name: name.to_string(),
            source,
        };
        let mut sources = self.sources.lock().expect("not poisoned");
        sources.insert(worker, sourced);
    }

    /// A replica healing in place: the sources are the snapshot's (by worker, with its
    /// name); no stream is led until this replica takes its lease again.
    pub fn replace_sources(&self, restored: Vec<(WorkerId, String, EventSource)>) {
        for worker in self.led() {
            self.follow(worker);
        }
        let mut sources = self.sources.lock().expect("not poisoned");
        for worker in sources.keys() {
            self.pool.unsubscribe(*worker);
        }
        sources.clear();
        for (worker, name, source) in restored {
            sources.insert(worker, engines_file::Sourced { name, source });
        }
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
        if let Some(applier) = self.engines_file.lock().expect("not poisoned").take() {
            match std::thread::Builder::new()
                .name("kvix-fleet".into())
                .spawn(move || applier.run())
            {
                Ok(t) => *self.engines_file_thread.lock().expect("not poisoned") = Some(t),
                Err(e) => tracing::error!(
                    "--engines: the thread that applies the file did not start: {e}"
                ),
            }
        }
    }

    /// For a bound source (`--events-bind`): whether its engine is connected to this
    /// server; None for a source this server subscribes to.
    pub fn bound_here(&self, source: &EventSource) -> Option<bool> {
        let (rank, topic) = bound::parse_source_endpoint(&source.endpoint)?;
        let presence = self.pool.presence.as_ref()?;
        Some(presence.connected(rank, topic))
    }

    /// How long a bound engine may have no connection before its worker is retired.
    pub fn bound_grace(&self) -> Option<std::time::Duration> {
        self.pool.presence.as_ref().map(|p| p.grace())
    }

    /// Replicas: retires a bound engine that no replica has had a connection from for
    /// the grace period (its worker's blocks would be false hits). False once stopping.
    pub fn retire_gone(&self, worker: WorkerId) -> bool {
        use futures::SinkExt;
        METRICS.engines_gone.fetch_add(1, Relaxed);
        let mut to = self.to_home.lock().expect("not poisoned");
        futures::executor::block_on(to.send(crate::write::record::Write::Retire { worker })).is_ok()
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
        self.engines_file_stop.store(true, Relaxed);
        if let Some(t) = self
            .engines_file_thread
            .lock()
            .expect("not poisoned")
            .take()
        {
            let _ = t.join();
        }
        self.pool.stop();
    }
}

/// The subscription of `worker`'s source, its stream resuming after `last`.
fn stream_spec(
    worker: WorkerId,
    s: &engines_file::Sourced,
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

#[cfg(test)]
mod tests;
