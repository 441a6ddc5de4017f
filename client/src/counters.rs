//! Counters a gateway can export: outcomes, latency, drops, connection churn.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Mutex;
use std::time::Duration;

use hdrhistogram::Histogram;

use kvix_wire::ErrorCode;

use crate::QueryOutcome;

/// Highest latency the histogram tracks (larger values are clamped to it): 60 s.
const MAX_LATENCY_NS: u64 = 60_000_000_000;

#[derive(Default)]
pub(crate) struct Atomics {
    pub scores: AtomicU64,
    pub empty: AtomicU64,
    pub timeouts: AtomicU64,
    pub disconnected: AtomicU64,
    pub rejected: AtomicU64,
    pub unscorable: AtomicU64,
    pub placements_sent: AtomicU64,
    pub placement_drops: AtomicU64,
    pub placements_unsent: AtomicU64,
    pub placements_retried: AtomicU64,
    pub unknown_workers: AtomicU64,
    pub connects: AtomicU64,
    pub reconnects: AtomicU64,
    pub connection_losses: AtomicU64,
    pub connect_failures: AtomicU64,
    pub handshake_refusals: AtomicU64,
    pub malformed_replies: AtomicU64,
    pub late_replies: AtomicU64,
    pub hedges: AtomicU64,
    pub hedges_won: AtomicU64,
    pub failovers: AtomicU64,
    pub stale_answers: AtomicU64,
    pub reuse_reports_sent: AtomicU64,
    pub reuse_unreported: AtomicU64,
    pub reuse_drops: AtomicU64,
    pub reuse_unsent: AtomicU64,
}

pub(crate) struct Counters {
    pub n: Atomics,
    latency: Mutex<Histogram<u64>>,
    /// Fire-and-forget writes the servers refused, by error code.
    refused: Mutex<Vec<(ErrorCode, u64)>>,
}

impl Counters {
    pub fn new() -> Self {
        Counters {
            n: Atomics::default(),
            latency: Mutex::new(new_histogram()),
            refused: Mutex::new(Vec::new()),
        }
    }

    /// Counts a fire-and-forget write refused with `code`; the count for that code now.
    pub fn write_refused(&self, code: ErrorCode) -> u64 {
        let mut refused = self.refused.lock().unwrap_or_else(|p| p.into_inner());
        match refused.iter_mut().find(|(c, _)| *c == code) {
            Some((_, n)) => {
                *n += 1;
                *n
            }
            None => {
                refused.push((code, 1));
                1
            }
        }
    }

    pub fn add(c: &AtomicU64, n: u64) {
        c.fetch_add(n, Relaxed);
    }

    pub fn bump(c: &AtomicU64) {
        c.fetch_add(1, Relaxed);
    }

    pub fn record_query(&self, outcome: &QueryOutcome, took: Duration) {
        let c = match outcome {
            QueryOutcome::Scores(_) => &self.n.scores,
            QueryOutcome::Empty => &self.n.empty,
            QueryOutcome::Timeout => &self.n.timeouts,
            QueryOutcome::Disconnected => &self.n.disconnected,
            QueryOutcome::Rejected(_) => &self.n.rejected,
        };
        Self::bump(c);
        let ns = u64::try_from(took.as_nanos()).unwrap_or(u64::MAX);
        if let Ok(mut h) = self.latency.lock() {
            h.saturating_record(ns.clamp(1, MAX_LATENCY_NS));
        }
    }

    pub fn snapshot(&self) -> CountersSnapshot {
        let g = |c: &AtomicU64| c.load(Relaxed);
        let n = &self.n;
        CountersSnapshot {
            scores: g(&n.scores),
            empty: g(&n.empty),
            timeouts: g(&n.timeouts),
            disconnected: g(&n.disconnected),
            rejected: g(&n.rejected),
            unscorable: g(&n.unscorable),
            placements_sent: g(&n.placements_sent),
            placement_drops: g(&n.placement_drops),
            placements_unsent: g(&n.placements_unsent),
            unknown_workers: g(&n.unknown_workers),
            placements_retried: g(&n.placements_retried),
            writes_refused: self
                .refused
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .clone(),
            connects: g(&n.connects),
            reconnects: g(&n.reconnects),
            connection_losses: g(&n.connection_losses),
            connect_failures: g(&n.connect_failures),
            handshake_refusals: g(&n.handshake_refusals),
            malformed_replies: g(&n.malformed_replies),
            late_replies: g(&n.late_replies),
            hedges: g(&n.hedges),
            hedges_won: g(&n.hedges_won),
            reuse_reports_sent: g(&n.reuse_reports_sent),
            reuse_unreported: g(&n.reuse_unreported),
            reuse_drops: g(&n.reuse_drops),
            reuse_unsent: g(&n.reuse_unsent),
            failovers: g(&n.failovers),
            stale_answers: g(&n.stale_answers),
            latency_ns: self
                .latency
                .lock()
                .map(|h| h.clone())
                .unwrap_or_else(|_| new_histogram()),
        }
    }

    /// The `q` quantile of recent query latencies, once there are enough of them.
    pub fn latency_quantile(&self, q: f64) -> Option<Duration> {
        let h = self.latency.lock().ok()?;
        (h.len() >= 100).then(|| Duration::from_nanos(h.value_at_quantile(q)))
    }

    pub fn reset_latency(&self) {
        if let Ok(mut h) = self.latency.lock() {
            h.reset();
        }
    }
}

fn new_histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, MAX_LATENCY_NS, 3).expect("valid histogram bounds")
}

/// A point-in-time copy of the client's counters (all monotonic since the client was
/// made, except the histogram, which [`crate::Client::reset_latency`] clears).
///
/// Its `Debug` form summarises the histogram (count, p50, p99, max).
#[derive(Clone)]
pub struct CountersSnapshot {
    /// Queries answered with scores.
    pub scores: u64,
    /// Queries answered with no worker scoring.
    pub empty: u64,
    /// Queries that ran past their deadline (failed open).
    pub timeouts: u64,
    /// Queries that found no connection or lost it (failed open).
    pub disconnected: u64,
    /// Queries the server answered with an error.
    pub rejected: u64,
    /// Sum over answers of workers that held part of the chain but could reuse none of
    /// it jointly: a fleet where this grows is not healthy.
    pub unscorable: u64,
    /// Placement frames written (one per server they went to).
    pub placements_sent: u64,
    /// Placements dropped because the queue was full.
    pub placement_drops: u64,
    /// Placements dequeued but not sent: no server up, or the worker is unknown.
    pub placements_unsent: u64,
    /// Workers named by a placement or as a query candidate that no server up knows
    /// (not in its roster, fetched again before this is counted): the placement was
    /// refused at once (`publish_placement` returned false), the candidate left out.
    pub unknown_workers: u64,
    /// Placements sent again after a server refused them for a moment (`LogUnavailable`,
    /// `Overloaded`): up to 4 times each, 0.25 s later at first, doubling.
    pub placements_retried: u64,
    /// Fire-and-forget writes (placements, retires) a server refused, by error code
    /// (`LogUnavailable`: the replicas' log was away; `UnknownWorker`: the server did not
    /// know the worker): sent, but not taken.
    pub writes_refused: Vec<(ErrorCode, u64)>,
    /// Successful handshakes, first connections included.
    pub connects: u64,
    /// Successful handshakes after an earlier connection to the same server was lost.
    pub reconnects: u64,
    /// Established connections that were lost or closed.
    pub connection_losses: u64,
    /// Connection attempts that failed before the handshake completed.
    pub connect_failures: u64,
    /// Handshakes the server refused with an error reply.
    pub handshake_refusals: u64,
    /// Reply frames that could not be read (bad header, invalid body, wrong kind);
    /// each closed its connection.
    pub malformed_replies: u64,
    /// Replies that came after their request had timed out.
    pub late_replies: u64,
    /// Queries sent to a second server because the first had not answered in time.
    pub hedges: u64,
    /// Hedged queries the second server answered first.
    pub hedges_won: u64,
    /// Queries sent again to the next server because the connection they were waiting
    /// on was lost before the answer.
    pub failovers: u64,
    /// Answers of a replica that said it is behind its log (healing in place, or
    /// stopped following it); the query went on to the next server.
    pub stale_answers: u64,
    /// Reuse reports sent to a server ([`crate::Client::report_reuse`]).
    pub reuse_reports_sent: u64,
    /// Reuse samples without the engine's figure: not reports.
    pub reuse_unreported: u64,
    /// Reuse reports dropped because the queue was full.
    pub reuse_drops: u64,
    /// Reuse reports dequeued but not sent: no server up, or a send failed.
    pub reuse_unsent: u64,
    /// Query latency in nanoseconds, every outcome included.
    pub latency_ns: Histogram<u64>,
}

impl fmt::Debug for CountersSnapshot {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CountersSnapshot")
            .field("scores", &self.scores)
            .field("empty", &self.empty)
            .field("timeouts", &self.timeouts)
            .field("disconnected", &self.disconnected)
            .field("rejected", &self.rejected)
            .field("unscorable", &self.unscorable)
            .field("placements_sent", &self.placements_sent)
            .field("placement_drops", &self.placement_drops)
            .field("placements_unsent", &self.placements_unsent)
            .field("unknown_workers", &self.unknown_workers)
            .field("placements_retried", &self.placements_retried)
            .field("writes_refused", &self.writes_refused)
            .field("connects", &self.connects)
            .field("reconnects", &self.reconnects)
            .field("connection_losses", &self.connection_losses)
            .field("connect_failures", &self.connect_failures)
            .field("handshake_refusals", &self.handshake_refusals)
            .field("malformed_replies", &self.malformed_replies)
            .field("late_replies", &self.late_replies)
            .field("reuse_reports_sent", &self.reuse_reports_sent)
            .field("reuse_drops", &self.reuse_drops)
            .field("hedges", &self.hedges)
            .field("hedges_won", &self.hedges_won)
            .field("failovers", &self.failovers)
            .field("stale_answers", &self.stale_answers)
            .field("latency_count", &self.latency_ns.len())
            .field("latency_p50", &self.latency_quantile(0.5))
            .field("latency_p99", &self.latency_quantile(0.99))
            .field("latency_max", &self.latency_quantile(1.0))
            .finish()
    }
}

impl CountersSnapshot {
    /// Queries asked, all outcomes.
    pub fn queries(&self) -> u64 {
        self.scores + self.empty + self.timeouts + self.disconnected + self.rejected
    }

    /// Fire-and-forget writes refused, all codes.
    pub fn writes_refused_total(&self) -> u64 {
        self.writes_refused.iter().map(|(_, n)| n).sum()
    }

    /// Queries that failed open (timeout or disconnected).
    pub fn failed_open(&self) -> u64 {
        self.timeouts + self.disconnected
    }

    /// The latency at quantile `q` (0..=1), or zero when nothing was recorded.
    pub fn latency_quantile(&self, q: f64) -> Duration {
        if self.latency_ns.is_empty() {
            return Duration::ZERO;
        }
        Duration::from_nanos(self.latency_ns.value_at_quantile(q))
    }
}
