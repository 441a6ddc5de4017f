//! Per-executor counters and histograms, rendered in Prometheus text format.
//!
//! Each executor writes only its own `ExecutorMetrics` (relaxed atomics, one writer), so
//! counting costs no cross-core traffic; the metrics endpoint sums them when scraped.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use hdrhistogram::Histogram;
use kvix_wire::FrameError;

use crate::exposition::Exposition;
use crate::exposition::Kind::{self, Counter, Gauge};

/// Why a frame or a connection was refused (the `reason` label).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(usize)]
pub enum Rejected {
    BadMagic,
    Version,
    Kind,
    Flags,
    Oversize,
    InvalidBody,
    NoHello,
    Unauthorized,
    BlockSize,
    Overloaded,
    Handshake,
    Stopping,
}

const REJECTED: [(Rejected, &str); 12] = [
    (Rejected::BadMagic, "bad_magic"),
    (Rejected::Version, "version"),
    (Rejected::Kind, "kind"),
    (Rejected::Flags, "flags"),
    (Rejected::Oversize, "oversize"),
    (Rejected::InvalidBody, "invalid_body"),
    (Rejected::NoHello, "no_hello"),
    (Rejected::Unauthorized, "unauthorized"),
    (Rejected::BlockSize, "block_size"),
    (Rejected::Overloaded, "overloaded"),
    (Rejected::Handshake, "handshake_timeout"),
    (Rejected::Stopping, "stopping"),
];

impl Rejected {
    pub fn of(e: &FrameError) -> Rejected {
        match e {
            FrameError::BadMagic(_) => Rejected::BadMagic,
            FrameError::UnsupportedVersion(_) => Rejected::Version,
            FrameError::UnknownKind(_) | FrameError::Unexpected { .. } => Rejected::Kind,
            FrameError::UnknownFlags(_) | FrameError::Reserved(_) => Rejected::Flags,
            FrameError::Oversize { .. } => Rejected::Oversize,
            FrameError::InvalidBody { .. } | FrameError::Misaligned => Rejected::InvalidBody,
        }
    }
}

/// How a query ended, as the `outcome` label counts it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Some worker scored above zero.
    Hit,
    /// Nobody holds any of the chain.
    Empty,
    /// Somebody holds part of the chain but no worker can reuse any of it jointly.
    Unscorable,
}

#[derive(Default)]
pub struct ExecutorMetrics {
    pub queries: [AtomicU64; 3],
    pub batches: AtomicU64,
    pub batch_duplicates: AtomicU64,
    pub batch_gaps: AtomicU64,
    pub block_events: AtomicU64,
    /// Removal names not looked for in the lane's other keyspaces (the batch's lookups
    /// there ran out): taken as chain hashes of the batch's keyspace.
    pub unprobed_removals: AtomicU64,
    pub placements: AtomicU64,
    /// Placements on event-fed workers: filling in for a lost history, or passed over
    /// (the worker's events are exact, or it cannot take them).
    pub placements_filled_in: AtomicU64,
    pub placements_passed_over: AtomicU64,
    pub connections_open: AtomicU64,
    pub connections_total: AtomicU64,
    /// Connections this executor accepted while full and handed to a peer with room.
    pub spilled: AtomicU64,
    /// TCP connections closed because their TLS handshake failed or timed out.
    pub tls_failures: AtomicU64,
    pub rejected: [AtomicU64; REJECTED.len()],
    /// Gauges the executor refreshes after each change of its index copy.
    pub blocks: AtomicU64,
    pub memberships: AtomicU64,
    pub workers: AtomicU64,
    /// Calls to other executors made while answering a query: zero by design.
    pub query_hops: Arc<AtomicU64>,
    /// Bounded slices long writes were applied in (queries run between slices).
    pub write_slices: AtomicU64,
    /// Slices after which the executor turned to its reactor (polled for I/O).
    pub write_turns: AtomicU64,
    /// Per query: write slices this executor ran from its turn to the reactor before the
    /// one that read the query until its reply left: a bound on the write work the query
    /// waited behind, counted.
    pub query_write_slices: crate::exposition::Buckets,
    /// Connections closed for taking no replies for --stall-timeout-ms, or idle.
    pub stalled: AtomicU64,
    pub idle_closed: AtomicU64,
    /// Accepts that failed (out of file descriptors, ...), each followed by a pause.
    pub accept_errors: AtomicU64,
    /// Queued connections accepted and closed at once while out of descriptors.
    pub shed: AtomicU64,
    /// Writes the write-ahead log refused (the client got an error).
    pub wal_failures: AtomicU64,
    /// Bytes of the write-ahead log cut off at start (executor 0's): a torn tail, or the
    /// log after damage `--wal-recover truncate` accepted.
    pub wal_cut_bytes: AtomicU64,
    /// Damage in the write-ahead log that `--wal-recover truncate` cut the log at, at this
    /// start (executor 0's).
    pub wal_damage: AtomicU64,
    /// Write-ahead log records replayed at this start (executor 0's).
    pub wal_replayed: AtomicU64,
    /// Event batches with stores refused because the index held --max-blocks.
    pub stores_refused: AtomicU64,
    /// Snapshots written to disk, and those that failed (executor 0's).
    pub snapshots: Arc<AtomicU64>,
    pub snapshot_failures: Arc<AtomicU64>,
    query_us: Mutex<Option<Histogram<u64>>>,
    apply_us: Mutex<Option<Histogram<u64>>>,
}

fn record(h: &Mutex<Option<Histogram<u64>>>, d: Duration) {
    let mut h = h.lock().unwrap_or_else(|p| p.into_inner());
    let h = h.get_or_insert_with(|| {
        Histogram::new_with_bounds(1, 60_000_000, 2).expect("static bounds")
    });
    h.saturating_record(d.as_nanos().div_ceil(1000).max(1) as u64);
}

impl ExecutorMetrics {
    pub fn query(&self, outcome: Outcome, took: Duration) {
        self.queries[outcome as usize].fetch_add(1, Relaxed);
        record(&self.query_us, took);
    }

    pub fn applied(&self, took: Duration) {
        record(&self.apply_us, took);
    }

    pub fn reject(&self, why: Rejected) {
        self.rejected[why as usize].fetch_add(1, Relaxed);
    }

    pub fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Relaxed);
    }
}

/// Picks one counter out of a shard's metrics.
type Field = fn(&ExecutorMetrics) -> &AtomicU64;

/// Reads one value out of a shard's metrics.
type Reading = fn(&ExecutorMetrics) -> u64;

fn sum(shards: &[ExecutorMetrics], f: impl Fn(&ExecutorMetrics) -> &AtomicU64) -> u64 {
    shards.iter().map(|s| f(s).load(Relaxed)).sum()
}

/// The Prometheus text exposition of every executor's metrics.
pub fn render(
    shards: &[ExecutorMetrics],
    replica: Option<&crate::durable::replica::Replica>,
) -> String {
    let mut out = Exposition::new();
    let outcomes = ["hit", "empty", "unscorable"];
    out.by(
        "kvix_queries_total",
        "Queries answered, by outcome.",
        Counter,
        "outcome",
        (outcomes.iter().enumerate()).map(|(i, o)| (o, sum(shards, |s| &s.queries[i]))),
    );
    let plain: [(&str, &str, Kind, Field); 26] = [
        (
            "kvix_event_batches_total",
            "Event batches applied.",
            Counter,
            |s| &s.batches,
        ),
        (
            "kvix_event_batch_duplicates_total",
            "Event batches ignored as old or duplicate.",
            Counter,
            |s| &s.batch_duplicates,
        ),
        (
            "kvix_event_batch_gaps_total",
            "Event batches that revealed a sequence gap.",
            Counter,
            |s| &s.batch_gaps,
        ),
        (
            "kvix_block_events_total",
            "Block stores and removals applied.",
            Counter,
            |s| &s.block_events,
        ),
        (
            "kvix_removals_unprobed_total",
            "Removal names not looked for in their lane's other keyspaces: the batch had used its 2^20 lookups there (send removals under the keyspace that stored them).",
            Counter,
            |s| &s.unprobed_removals,
        ),
        (
            "kvix_event_batches_refused_full_total",
            "Event batches with stores refused because the index held --max-blocks blocks.",
            Counter,
            |s| &s.stores_refused,
        ),
        (
            "kvix_placements_total",
            "Placements taken (placed, filling in for a lost history, or passed over).",
            Counter,
            |s| &s.placements,
        ),
        (
            "kvix_placements_filled_in_total",
            "Placements on event-fed workers whose history is lost, filling in for what their events no longer report.",
            Counter,
            |s| &s.placements_filled_in,
        ),
        (
            "kvix_placements_passed_over_total",
            "Placements on event-fed workers passed over: their events are exact (or, for a hybrid roster or with --fill-in-blocks 0, they cannot fill in).",
            Counter,
            |s| &s.placements_passed_over,
        ),
        (
            "kvix_connections",
            "Open client connections.",
            Gauge,
            |s| &s.connections_open,
        ),
        (
            "kvix_connections_total",
            "Client connections accepted.",
            Counter,
            |s| &s.connections_total,
        ),
        (
            "kvix_connections_spilled_total",
            "Connections accepted by a full executor and served by the least loaded one with room.",
            Counter,
            |s| &s.spilled,
        ),
        (
            "kvix_tls_handshake_failures_total",
            "TCP connections closed because their TLS handshake failed or did not finish in time (a client without TLS, an unknown CA, a missing or refused client certificate; the log names the cause at 1, 2, 4, ... failures).",
            Counter,
            |s| &s.tls_failures,
        ),
        (
            "kvix_query_hops_total",
            "Calls to other executors made while answering queries (zero by design: every executor answers from its own copy).",
            Counter,
            |s| &s.query_hops,
        ),
        (
            "kvix_write_slices_total",
            "Bounded slices that long writes were applied in, letting queries run between them.",
            Counter,
            |s| &s.write_slices,
        ),
        (
            "kvix_connections_stalled_total",
            "Connections closed because the client took no reply bytes for --stall-timeout-ms.",
            Counter,
            |s| &s.stalled,
        ),
        (
            "kvix_connections_idle_closed_total",
            "Connections closed after --idle-timeout-s without a request.",
            Counter,
            |s| &s.idle_closed,
        ),
        (
            "kvix_accept_errors_total",
            "Failed accepts (e.g. out of file descriptors); each backs off before the next.",
            Counter,
            |s| &s.accept_errors,
        ),
        (
            "kvix_connections_shed_total",
            "Connections accepted and closed at once because the process was out of descriptors.",
            Counter,
            |s| &s.shed,
        ),
        (
            "kvix_write_turns_total",
            "Write slices after which the executor turned to its reactor to read sockets.",
            Counter,
            |s| &s.write_turns,
        ),
        (
            "kvix_wal_failures_total",
            "Writes refused because the write-ahead log could not take them (disk full, ...).",
            Counter,
            |s| &s.wal_failures,
        ),
        (
            "kvix_wal_cut_bytes",
            "Bytes of the write-ahead log cut off at this start: a torn last record, or the log after damage --wal-recover truncate accepted.",
            Gauge,
            |s| &s.wal_cut_bytes,
        ),
        (
            "kvix_wal_damage_total",
            "Damage in the write-ahead log that --wal-recover truncate cut the log at (acknowledged writes dropped).",
            Counter,
            |s| &s.wal_damage,
        ),
        (
            "kvix_wal_replayed_records",
            "Write-ahead log records replayed at this start (0 after a clean stop).",
            Gauge,
            |s| &s.wal_replayed,
        ),
        (
            "kvix_snapshots_written_total",
            "Snapshots written to --snapshot (fsynced and renamed into place).",
            Counter,
            |s| &s.snapshots,
        ),
        (
            "kvix_snapshot_failures_total",
            "Snapshots that could not be written (the previous file stays).",
            Counter,
            |s| &s.snapshot_failures,
        ),
    ];
    for (name, help, kind, f) in plain {
        out.one(name, help, kind, sum(shards, f));
    }
    // Where connections and queries land, executor by executor: a lopsided split shows
    // the steering concentrating clients (see admit.rs).
    let per_executor: [(&str, &str, Kind, Reading); 2] = [
        (
            "kvix_executor_queries_total",
            "Queries answered per executor (how connections spread over the cores).",
            Counter,
            |s| s.queries.iter().map(|q| q.load(Relaxed)).sum(),
        ),
        (
            "kvix_executor_connections",
            "Open client connections on each executor.",
            Gauge,
            |s| s.connections_open.load(Relaxed),
        ),
    ];
    for (name, help, kind, f) in per_executor {
        out.by(
            name,
            help,
            kind,
            "executor",
            shards.iter().map(f).enumerate(),
        );
    }
    out.histogram_by(
        "kvix_query_write_slices",
        "Write slices a query waited behind: from the executor's turn to its reactor before the one that read it, to its reply.",
        "executor",
        shards.iter().map(|s| &s.query_write_slices).enumerate(),
    );
    // Every executor keeps a whole copy of the index and roster: one copy, not the sum.
    let copy: [(&str, &str, Field); 3] = [
        ("kvix_workers", "Workers announced.", |s| &s.workers),
        ("kvix_blocks", "Distinct blocks held.", |s| &s.blocks),
        (
            "kvix_memberships",
            "(block, holder) memberships held.",
            |s| &s.memberships,
        ),
    ];
    for (name, help, f) in copy {
        let v = shards.first().map_or(0, |s| f(s).load(Relaxed));
        out.one(name, help, Gauge, v);
    }
    out.one(
        "kvix_resident_bytes",
        "Resident memory of the process (every executor's copy of the index included).",
        Gauge,
        resident_bytes(),
    );
    out.one(
        "kvix_executors",
        "Executors, each holding a whole copy of the index.",
        Gauge,
        shards.len() as u64,
    );
    out.by(
        "kvix_rejected_frames_total",
        "Frames or connections refused, by reason.",
        Counter,
        "reason",
        (REJECTED.iter()).map(|(r, n)| (n, sum(shards, |s| &s.rejected[*r as usize]))),
    );
    crate::ingest::render(&mut out);
    if let Some(r) = replica {
        crate::durable::replica::render(r, &mut out);
    }
    for (name, help, f) in [
        (
            "kvix_query_latency_us",
            "Server-side query latency.",
            (|s: &ExecutorMetrics| &s.query_us)
                as fn(&ExecutorMetrics) -> &Mutex<Option<Histogram<u64>>>,
        ),
        (
            "kvix_apply_latency_us",
            "Server-side event batch / placement apply latency.",
            |s: &ExecutorMetrics| &s.apply_us,
        ),
    ] {
        summary(&mut out, name, help, shards.iter().map(f));
    }
    out.into_text()
}

/// The process's resident set, from /proc/self/statm (0 where there is none).
fn resident_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: u64 = statm
        .split_whitespace()
        .nth(1)
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(0) as u64;
    pages * page
}

/// Writes the executors' histograms merged, as a summary.
fn summary<'a>(
    out: &mut Exposition,
    name: &str,
    help: &str,
    parts: impl Iterator<Item = &'a Mutex<Option<Histogram<u64>>>>,
) {
    let mut all = Histogram::<u64>::new_with_bounds(1, 60_000_000, 2).expect("static bounds");
    for p in parts {
        if let Some(h) = p.lock().unwrap_or_else(|e| e.into_inner()).as_ref() {
            let _ = all.add(h);
        }
    }
    out.summary(name, help, &all);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn render_sums_executors_and_labels_outcomes() {
        let shards: Vec<ExecutorMetrics> = (0..2).map(|_| ExecutorMetrics::default()).collect();
        shards[0].query(Outcome::Hit, Duration::from_micros(10));
        shards[1].query(Outcome::Hit, Duration::from_micros(30));
        shards[1].query(Outcome::Unscorable, Duration::from_micros(5));
        shards[0].reject(Rejected::Oversize);
        shards[1].blocks.store(7, Relaxed);
        shards[0].blocks.store(7, Relaxed);
        let text = render(&shards, None);
        assert!(
            text.contains("kvix_queries_total{outcome=\"hit\"} 2\n"),
            "{text}"
        );
        assert!(text.contains("kvix_queries_total{outcome=\"unscorable\"} 1\n"));
        assert!(text.contains("kvix_queries_total{outcome=\"empty\"} 0\n"));
        assert!(text.contains("kvix_rejected_frames_total{reason=\"oversize\"} 1\n"));
        assert!(text.contains("kvix_blocks 7\n"), "one copy, not the sum");
        assert!(text.contains("kvix_executor_queries_total{executor=\"1\"} 2\n"));
        assert!(text.contains("kvix_query_hops_total 0\n"));
        assert!(text.contains("kvix_executors 2\n"));
        let rss = text
            .lines()
            .find_map(|l| l.strip_prefix("kvix_resident_bytes "))
            .and_then(|v| v.parse::<u64>().ok());
        assert!(rss.is_some_and(|b| b > 1 << 20), "{rss:?}");
        assert!(text.contains("kvix_query_latency_us_count 3\n"));
    }
}
