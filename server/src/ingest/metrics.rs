//! The ingest's counters, process-wide (the ingest threads and the executors add to
//! them).

use std::sync::atomic::Ordering::Relaxed;

use kvix_events::{payload, stream, translate};

use crate::exposition::Exposition;

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
        /// Connections (at their handshake) and messages on --events-bind from outside --source-allow, refused.
        peers_refused: Counter Sum "kvix_ingest_peers_refused_total",
        /// Messages on --events-bind under a topic another address speaks for, or while its address has more connections than engines.
        impostors: Counter Sum "kvix_ingest_impostor_messages_total",
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

/// Appends the ingest metrics in Prometheus text format.
pub fn render(out: &mut Exposition) {
    out.families(Metrics::FAMILIES, std::slice::from_ref(&METRICS));
}
