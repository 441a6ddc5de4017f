//! Ingest of real engine KV events: the server subscribes to the ZMQ publishers of
//! vLLM / SGLang workers that announced an [`EventSource`].
//!
//! Layout: [`vllm`] decodes payloads, [`translate`] turns engine events into kvix
//! events (rehashing token ids into the keyspace chain), [`zmtp`] speaks just enough
//! ZMTP to read a PUB and its replay ROUTER, [`subscriber`] runs one publisher's stream.
//!
//! All of it runs outside the executors, on plain threads: a manager thread started at
//! [`init`] and one thread per subscribed worker. Each stream applies what it decodes
//! as a kvix protocol client of this very server over loopback (Hello, Announce for
//! its data-parallel ranks, EventBatch), so sharding, ordering and the feed state are
//! exactly those of any other producer, and an ingest fault can never take an
//! executor down.

pub mod subscriber;
pub mod translate;
pub mod vllm;
pub mod zmtp;

use std::collections::HashMap;
use std::fmt::Write;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{mpsc, Arc, OnceLock};

use kvix_wire::{EventSource, Feed, Lane, WorkerId};

/// How ingest streams reach their own server.
#[derive(Debug, Clone)]
pub struct Settings {
    /// The server's bound TCP address (an unspecified IP means loopback).
    pub addr: SocketAddr,
    pub auth: Option<String>,
    pub block_size: u32,
}

/// A successful announce, as shard 0 reports it.
#[derive(Debug, Clone)]
pub struct Announcement {
    pub worker: WorkerId,
    pub name: String,
    pub lanes: Vec<Lane>,
    pub feed: Feed,
    pub source: Option<EventSource>,
    /// The roster changed (the server dropped what the worker held).
    pub created: bool,
}

static JOBS: OnceLock<mpsc::Sender<Announcement>> = OnceLock::new();

/// Starts the ingest manager (idle until a worker announces a source). Once per process.
pub fn init(settings: Settings) -> std::io::Result<()> {
    let (tx, rx) = mpsc::channel();
    if JOBS.set(tx).is_err() {
        return Ok(());
    }
    std::thread::Builder::new()
        .name("kvix-ingest".into())
        .spawn(move || manage(Arc::new(settings), rx))?;
    Ok(())
}

/// Called by shard 0 after every successful announce; cheap and non-blocking. A no-op
/// when the ingest was never started (embedded shards in tests).
pub fn announced(a: Announcement) {
    if let Some(tx) = JOBS.get() {
        let _ = tx.send(a);
    }
}

struct Running {
    stop: Arc<AtomicBool>,
    source: EventSource,
    lanes: Vec<Lane>,
}

fn manage(settings: Arc<Settings>, rx: mpsc::Receiver<Announcement>) {
    let mut running: HashMap<WorkerId, Running> = HashMap::new();
    for a in rx {
        let keep = running.get(&a.worker).is_some_and(|r| {
            !a.created && Some(&r.source) == a.source.as_ref() && r.lanes == a.lanes
        });
        if keep {
            continue;
        }
        if let Some(old) = running.remove(&a.worker) {
            old.stop.store(true, Relaxed);
            tracing::info!(worker = a.worker, "ingest: stopping the old stream");
        }
        let Some(source) = a.source.clone() else {
            continue;
        };
        if a.feed != Feed::Events {
            tracing::warn!(
                worker = %a.name,
                "ingest: an event source needs the Events feed, not {:?}; not subscribing",
                a.feed
            );
            continue;
        }
        let stop = Arc::new(AtomicBool::new(false));
        let stream = subscriber::Stream::new(
            settings.clone(),
            a.worker,
            a.name.clone(),
            a.lanes.clone(),
            source.clone(),
            stop.clone(),
        );
        match std::thread::Builder::new()
            .name(format!("kvix-ingest-{}", a.worker))
            .spawn(move || stream.run())
        {
            Ok(_) => {
                METRICS.streams.fetch_add(1, Relaxed);
                running.insert(
                    a.worker,
                    Running {
                        stop,
                        source,
                        lanes: a.lanes,
                    },
                );
            }
            Err(e) => tracing::error!(worker = %a.name, "ingest: cannot start a thread: {e}"),
        }
    }
}

/// Process-wide ingest counters (the ingest runs outside the shards).
pub struct Metrics {
    pub messages: AtomicU64,
    pub malformed: AtomicU64,
    pub gaps: AtomicU64,
    pub replayed: AtomicU64,
    pub replay_failures: AtomicU64,
    pub restarts: AtomicU64,
    pub duplicates: AtomicU64,
    pub skipped: [AtomicU64; translate::SKIPS.len()],
    pub stored: [AtomicU64; 3],
    pub removed: [AtomicU64; 3],
    pub unknown_removals: AtomicU64,
    pub extra_keys: AtomicU64,
    pub refused: AtomicU64,
    pub connect_failures: AtomicU64,
    pub connected: AtomicU64,
    pub streams: AtomicU64,
}

#[allow(clippy::declare_interior_mutable_const)]
const ZERO: AtomicU64 = AtomicU64::new(0);

pub static METRICS: Metrics = Metrics {
    messages: ZERO,
    malformed: ZERO,
    gaps: ZERO,
    replayed: ZERO,
    replay_failures: ZERO,
    restarts: ZERO,
    duplicates: ZERO,
    skipped: [ZERO; translate::SKIPS.len()],
    stored: [ZERO; 3],
    removed: [ZERO; 3],
    unknown_removals: ZERO,
    extra_keys: ZERO,
    refused: ZERO,
    connect_failures: ZERO,
    connected: ZERO,
    streams: ZERO,
};

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
    }
}

/// Appends the ingest metrics in Prometheus text format.
pub fn render(out: &mut String) {
    let m = &METRICS;
    let plain: [(&str, &str, &str, &AtomicU64); 13] = [
        ("kvix_ingest_messages_total", "ZMQ event messages received from publishers.", "counter", &m.messages),
        ("kvix_ingest_malformed_total", "Event messages or payloads that could not be decoded (skipped whole).", "counter", &m.malformed),
        ("kvix_ingest_gaps_total", "Publisher sequence gaps seen.", "counter", &m.gaps),
        ("kvix_ingest_replayed_total", "Event batches recovered from a replay socket.", "counter", &m.replayed),
        ("kvix_ingest_replay_failures_total", "Replays that could not be done or did not finish.", "counter", &m.replay_failures),
        ("kvix_ingest_restarts_total", "Publisher restarts (sequence back to 0): the worker was cleared and rebuilt.", "counter", &m.restarts),
        ("kvix_ingest_duplicates_total", "Event messages at or below the last applied sequence.", "counter", &m.duplicates),
        ("kvix_ingest_unknown_removals_total", "Removed blocks the stream never saw stored.", "counter", &m.unknown_removals),
        ("kvix_ingest_extra_keys_total", "Stores whose engine hashes include extra keys (multimodal inputs) beyond the token ids.", "counter", &m.extra_keys),
        ("kvix_ingest_refused_total", "Translated batches the server refused.", "counter", &m.refused),
        ("kvix_ingest_connect_failures_total", "Failed connections to publishers (retried).", "counter", &m.connect_failures),
        ("kvix_ingest_publishers_connected", "Publishers currently connected.", "gauge", &m.connected),
        ("kvix_ingest_streams_total", "Subscriber streams started.", "counter", &m.streams),
    ];
    for (name, help, kind, v) in plain {
        let _ = writeln!(
            out,
            "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {}",
            v.load(Relaxed)
        );
    }
    let _ = writeln!(
        out,
        "# HELP kvix_ingest_skipped_events_total Engine events skipped, by reason.\n# TYPE kvix_ingest_skipped_events_total counter"
    );
    for (skip, label) in translate::SKIPS {
        let _ = writeln!(
            out,
            "kvix_ingest_skipped_events_total{{reason=\"{label}\"}} {}",
            m.skipped[skip as usize].load(Relaxed)
        );
    }
    for (name, help, arr) in [
        (
            "kvix_ingest_blocks_stored_total",
            "Engine blocks stored, by medium.",
            &m.stored,
        ),
        (
            "kvix_ingest_blocks_removed_total",
            "Engine blocks removed, by medium.",
            &m.removed,
        ),
    ] {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter");
        for (i, medium) in vllm::Medium::ALL.iter().enumerate() {
            let _ = writeln!(
                out,
                "{name}{{medium=\"{}\"}} {}",
                medium.label(),
                arr[i].load(Relaxed)
            );
        }
    }
}
