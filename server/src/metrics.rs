//! Per-executor counters and histograms, rendered in Prometheus text format.
//!
//! Each executor writes only its own `ExecutorMetrics` (relaxed atomics, one writer), so
//! counting costs no cross-core traffic; the metrics endpoint sums them when scraped.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Mutex;
use std::time::Duration;

use hdrhistogram::Histogram;
use kvix_wire::FrameError;

use crate::exposition::Exposition;
use crate::exposition::Kind::{Counter, Gauge};

/// Why a frame or a connection was refused: the index of its `reason` label in
/// `kvix_rejected_frames_total`.
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

// One `reason` label per kind, in the enum's order (kvix_rejected_frames_total).
const _: () = assert!(Rejected::Stopping as usize + 1 == 12);

impl Rejected {
    pub fn of(e: &FrameError) -> Rejected {
        match e {
            FrameError::BadMagic(_) => Rejected::BadMagic,
            FrameError::UnsupportedVersion(_) | FrameError::KindTooNew { .. } => Rejected::Version,
            FrameError::UnknownKind(_) | FrameError::Unexpected { .. } => Rejected::Kind,
            FrameError::UnknownFlags(_) | FrameError::Reserved(_) => Rejected::Flags,
            FrameError::Oversize { .. } => Rejected::Oversize,
            FrameError::InvalidBody { .. } | FrameError::Misaligned => Rejected::InvalidBody,
        }
    }
}

/// How a query ended: the index of its `outcome` label in `kvix_queries_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QueryOutcome {
    /// Some worker scored above zero.
    Hit,
    /// Nobody holds any of the chain.
    Empty,
    /// Somebody holds part of the chain but no worker can reuse any of it jointly.
    Unscorable,
}

/// The HTTP API's routes (`kvix_http_requests_total{route}`), in `http_api::Route`
/// order, then requests for no known path.
pub const HTTP_ROUTES: [&str; 9] = [
    "register",
    "unregister",
    "workers",
    "query",
    "query_by_hash",
    "health",
    "echo",
    "unsupported",
    "unknown",
];

/// The status codes the HTTP API answers (`kvix_http_responses_total{code}`).
pub const HTTP_CODES: [u16; 17] = [
    200, 201, 400, 401, 403, 404, 405, 409, 411, 413, 415, 422, 429, 431, 500, 501, 503,
];
/// The labels of [`HTTP_CODES`], in its order.
pub const HTTP_CODE_LABELS: [&str; 17] = [
    "200", "201", "400", "401", "403", "404", "405", "409", "411", "413", "415", "422", "429",
    "431", "500", "501", "503",
];

crate::metric_set! {
    /// One executor's counters (relaxed atomics it alone writes), merged over executors
    /// at scrape. docs/operations.md says what each means and what to do about it.
    pub struct ExecutorMetrics {
        /// Queries answered, by outcome.
        queries: Counter Sum "kvix_queries_total" by "outcome" (&["hit", "empty", "unscorable"]),
        /// Requests on the HTTP API (`--http`), by route (`unknown`: no such path).
        http_requests: Counter Sum "kvix_http_requests_total" by "route" (&HTTP_ROUTES),
        /// Responses of the HTTP API, by status code.
        http_responses: Counter Sum "kvix_http_responses_total" by "code" (&HTTP_CODE_LABELS),
        /// HTTP request bodies being parsed on a thread aside (large ones) now.
        http_parsing_aside: Gauge Sum "kvix_http_bodies_parsing_aside",
        /// Frames or connections refused, by reason.
        rejected: Counter Sum "kvix_rejected_frames_total" by "reason" (&[
            "bad_magic", "version", "kind", "flags", "oversize", "invalid_body", "no_hello",
            "unauthorized", "block_size", "overloaded", "handshake_timeout", "stopping"
        ]),
        /// Event batches applied.
        batches: Counter Sum "kvix_event_batches_total",
        /// Event batches ignored as old or duplicate.
        batch_duplicates: Counter Sum "kvix_event_batch_duplicates_total",
        /// Event batches that revealed a sequence gap.
        batch_gaps: Counter Sum "kvix_event_batch_gaps_total",
        /// Block stores and removals applied.
        block_events: Counter Sum "kvix_block_events_total",
        /// Removal names not looked for in their lane's other keyspaces (lookups ran out).
        unprobed_removals: Counter Sum "kvix_removals_unprobed_total",
        /// Event batches with stores refused because the index held --max-blocks blocks.
        stores_refused: Counter Sum "kvix_event_batches_refused_full_total",
        /// Placements taken (placed, filling in for a lost history, or passed over).
        placements: Counter Sum "kvix_placements_total",
        /// Placements filling in for event-fed workers whose history is lost.
        placements_filled_in: Counter Sum "kvix_placements_filled_in_total",
        /// Placements on event-fed workers passed over (their events are exact).
        placements_passed_over: Counter Sum "kvix_placements_passed_over_total",
        /// Open client connections.
        connections_open: Gauge Sum "kvix_connections",
        /// Client connections accepted.
        connections_total: Counter Sum "kvix_connections_total",
        /// Connections accepted by a full executor and served by another with room.
        spilled: Counter Sum "kvix_connections_spilled_total",
        /// TCP connections closed because their TLS handshake failed or took too long.
        tls_failures: Counter Sum "kvix_tls_handshake_failures_total",
        /// Calls to other executors made while answering queries (zero by design).
        query_hops: Counter Sum "kvix_query_hops_total",
        /// Slices (512 blocks) long writes were cut into, queries let in between.
        write_slices: Counter Sum "kvix_write_slices_total",
        /// Write slices after which the executor turned to its reactor to read sockets.
        write_turns: Counter Sum "kvix_write_turns_total",
        /// Connections closed because the client took no reply bytes for --stall-timeout-ms.
        stalled: Counter Sum "kvix_connections_stalled_total",
        /// Connections closed after --idle-timeout-s without a request.
        idle_closed: Counter Sum "kvix_connections_idle_closed_total",
        /// Failed accepts (out of file descriptors, ...), each followed by a pause.
        accept_errors: Counter Sum "kvix_accept_errors_total",
        /// Connections accepted and closed at once while out of descriptors.
        shed: Counter Sum "kvix_connections_shed_total",
        /// Writes refused because the write-ahead log could not take them (disk full).
        wal_failures: Counter Sum "kvix_wal_failures_total",
        /// Bytes of the write-ahead log cut off at this start (torn tail or damage).
        wal_cut_bytes: Gauge Sum "kvix_wal_cut_bytes",
        /// Damage the write-ahead log was cut at (--wal-recover truncate).
        wal_damage: Counter Sum "kvix_wal_damage_total",
        /// Write-ahead log records replayed at this start.
        wal_replayed: Gauge Sum "kvix_wal_replayed_records",
        /// Snapshots written to --snapshot.
        snapshots: Counter Sum "kvix_snapshots_written_total",
        /// Snapshots that could not be written (the previous file stays).
        snapshot_failures: Counter Sum "kvix_snapshot_failures_total",
        /// Workers announced.
        workers: Gauge First "kvix_workers",
        /// Distinct blocks held.
        blocks: Gauge First "kvix_blocks",
        /// (block, holder) memberships held.
        memberships: Gauge First "kvix_memberships",
    }
    extra {
        /// Per query: write slices it waited behind (conn.rs).
        pub query_write_slices: crate::exposition::Buckets,
        query_us: Mutex<Option<Histogram<u64>>>,
        apply_us: Mutex<Option<Histogram<u64>>>,
    }
}

fn record(h: &Mutex<Option<Histogram<u64>>>, d: Duration) {
    let mut h = h.lock().unwrap_or_else(|p| p.into_inner());
    let h = h.get_or_insert_with(|| {
        Histogram::new_with_bounds(1, 60_000_000, 2).expect("static bounds")
    });
    h.saturating_record(d.as_nanos().div_ceil(1000).max(1) as u64);
}

impl ExecutorMetrics {
    pub fn query(&self, outcome: QueryOutcome, took: Duration) {
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

/// The Prometheus text exposition of every executor's metrics, the ingest's and the
/// replicas' log's.
pub fn render(
    shards: &[ExecutorMetrics],
    replica: Option<&crate::durable::replica::Replica>,
) -> String {
    let mut out = Exposition::new();
    out.families(ExecutorMetrics::FAMILIES, shards);
    // Where connections and queries land, executor by executor: a lopsided split shows
    // the steering concentrating clients (see admit.rs).
    out.by(
        "kvix_executor_queries_total",
        "Queries answered per executor.",
        Counter,
        "executor",
        (shards.iter().enumerate())
            .map(|(e, s)| (e, s.queries.iter().map(|q| q.load(Relaxed)).sum())),
    );
    out.by(
        "kvix_executor_connections",
        "Open client connections on each executor.",
        Gauge,
        "executor",
        (shards.iter().enumerate()).map(|(e, s)| (e, s.connections_open.load(Relaxed))),
    );
    out.histogram_by(
        "kvix_query_write_slices",
        "Write slices a query waited behind.",
        "executor",
        shards.iter().map(|s| &s.query_write_slices).enumerate(),
    );
    out.one(
        "kvix_resident_bytes",
        "Resident memory of the process.",
        Gauge,
        resident_bytes(),
    );
    out.one(
        "kvix_executors",
        "Executors, each holding a whole copy of the index.",
        Gauge,
        shards.len() as u64,
    );
    crate::ingest::render(&mut out);
    crate::reuse::render(&mut out);
    if let Some(r) = replica {
        crate::durable::replica::render(r, &mut out);
    }
    summary(
        &mut out,
        "kvix_query_latency_us",
        "Server-side query latency.",
        shards.iter().map(|s| &s.query_us),
    );
    summary(
        &mut out,
        "kvix_apply_latency_us",
        "Server-side event batch and placement apply latency.",
        shards.iter().map(|s| &s.apply_us),
    );
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
        shards[0].query(QueryOutcome::Hit, Duration::from_micros(10));
        shards[1].query(QueryOutcome::Hit, Duration::from_micros(30));
        shards[1].query(QueryOutcome::Unscorable, Duration::from_micros(5));
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
