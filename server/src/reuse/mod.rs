//! The closed loop: what the engines say they reused (v5 `ReuseReport`: a gateway's
//! reports of `usage.prompt_tokens_details.cached_tokens` after routed requests) against
//! what kvix predicted, judged per client and per worker so that a gateway-side cause
//! is not blamed on a worker, and turned into verdicts that name a cause.
//!
//! One report is exact within one block (the engine caps reuse below the prompt's
//! length and rounds to its block), an over-prediction, an under-prediction, or a miss
//! (kvix predicted nothing where the engine reused).
//!
//! - A client's last [`CLIENT_WINDOW`] reports name it (`GatewayTokenization`: its token
//!   ids are not the engines') when half or more are wrong, about two workers or more,
//!   and at least twice the share of the other clients'; a fifth wrong or fewer clears
//!   it. Its reports then count for no worker.
//! - A worker's last [`WINDOW`] reports (from clients under no verdict) name it at
//!   [`RAISE`] wrong when most of the clients in them are mostly wrong, and clear it at
//!   [`CLEAR`] or fewer: within `WINDOW - CLEAR` = 13 right reports after its cause is
//!   fixed. `EventsMissing` (kvix predicts nothing, or less than the engine reuses
//!   while none of the worker's events came in across a window of its reports: an
//!   engine serving requests stores blocks, so its events stopped), `Undercounted`
//!   (less than the engine reuses, its events coming in), `EventsLagging` (more). A worker whose history is lost is already
//!   flagged for under-counting and gets no verdict; placement-fed workers only for
//!   over-prediction (placements never learn the output an engine caches). A
//!   placement-fed worker whose engine reused nothing on [`CACHE_LOST`] predicted prompts
//!   in a row lost its cache (a restart): its placements are dropped instead. A worker
//!   named `EventsMissing` is filled in by gateways' placements from then on ([`Learned`]).
//!
//! Verdicts are this replica's own: every replica sees the reports its clients send
//! (a gateway reports to the replica that answered), and what they judge (the index
//! each replica holds) may differ for a moment; shipping them through the log would
//! make every report a write. The state is process-wide, behind one lock: reports are
//! batched by clients and rare next to queries, which read only [`SUSPECT`]'s atomics.

use std::sync::atomic::{AtomicU64, AtomicU8, Ordering::Relaxed};
use std::sync::{LazyLock, Mutex};

use kvix_wire::{SuspectCause, WorkerId};

use crate::exposition::{Buckets, Exposition};

mod judge;
#[cfg(test)]
mod tests;
mod window;

use judge::State;

/// A worker's last reports judged together.
pub const WINDOW: usize = 16;
/// Wrong reports of the last [`WINDOW`] that name a worker.
pub const RAISE: usize = 8;
/// Wrong reports of the last [`WINDOW`] at or under which a worker's verdict clears.
pub const CLEAR: usize = 3;
/// Reports in a row of a placement-fed worker where kvix predicted two blocks or more and
/// the engine reused none: its engine lost its cache (a restart), and its placements are
/// dropped rather than predicted until they age out. Four: a cache that merely evicts
/// keeps the shared prefixes most prompts start with, so a run of zeros is rare.
pub const CACHE_LOST: usize = 4;
/// Clients tracked at once; reports of more are dropped (counted).
pub const MAX_CLIENTS: usize = 1024;
/// Reports a client may send per second (and at once); past it they are dropped.
pub const REPORTS_PER_S: f64 = 10_000.0;

/// What one report says of kvix's prediction.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Exact,
    /// kvix predicted more than the engine reused.
    Over,
    /// kvix predicted less than the engine reused, but some.
    Under,
    /// kvix predicted nothing (or the worker was not in its answer) where the engine
    /// reused.
    Missed,
}

impl Outcome {
    pub const LABELS: [&'static str; 4] = ["exact", "over", "under", "missed"];
}

/// Why a report was not counted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dropped {
    /// The client sent past [`REPORTS_PER_S`].
    Rate,
    /// [`MAX_CLIENTS`] other clients are tracked.
    Clients,
    /// The worker is not on this server's roster (retired, or never announced).
    UnknownWorker,
}

impl Dropped {
    pub const LABELS: [&'static str; 3] = ["rate", "clients", "unknown_worker"];
}

/// The causes a verdict names, in [`cause_index`] order.
pub const CAUSES: [SuspectCause; 4] = [
    SuspectCause::GatewayTokenization,
    SuspectCause::EventsMissing,
    SuspectCause::EventsLagging,
    SuspectCause::Undercounted,
];

pub const CAUSE_LABELS: [&str; 4] = [
    "gateway_tokenization",
    "events_missing",
    "events_lagging",
    "undercounted",
];

fn cause_index(c: SuspectCause) -> usize {
    CAUSES.iter().position(|&x| x == c).unwrap_or(0)
}

/// What to do about a cause, as the log and docs/operations.md say it.
pub fn remedy(c: SuspectCause) -> &'static str {
    match c {
        SuspectCause::GatewayTokenization => {
            "the gateway's token ids are not the engines' (chat template, tokenizer, special \
             tokens): tokenize as the engine does"
        }
        SuspectCause::EventsMissing => {
            "the engine reuses what kvix never heard of: its KV events do not arrive (publisher \
             off, wrong endpoint or topic, another kvix); check --kv-events-config and \
             kvix_ingest_messages_total"
        }
        SuspectCause::EventsLagging => {
            "kvix predicts blocks the engine no longer has: its removals arrive late or not at \
             all (or a placement-fed capacity is set above the engine's)"
        }
        SuspectCause::Undercounted => {
            "the engine reuses more than kvix knows: a tier or a store not reported, or hashes \
             that differ (the engine's hash seed, offload events)"
        }
    }
}

/// What one report comes to: `predicted` and `cached` in tokens, the engine's reuse
/// capped below `prompt` tokens, all within one `block`.
pub fn classify(predicted: Option<u32>, cached: u32, prompt: u32, block: u32) -> Outcome {
    let block = block.max(1);
    let cap = prompt.saturating_sub(1) / block * block;
    let predicted = predicted.unwrap_or(0).min(cap.max(cached));
    if cached > predicted.saturating_add(block) {
        if predicted < block {
            Outcome::Missed
        } else {
            Outcome::Under
        }
    } else if predicted > cached.saturating_add(block) {
        Outcome::Over
    } else {
        Outcome::Exact
    }
}

/// What a worker is, for judging its reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkerKind {
    pub event_fed: bool,
    pub history_lost: bool,
}

/// A client's last reports judged together (across the workers it reports on).
pub const CLIENT_WINDOW: usize = 32;

/// Event feeds counted by worker id (ids are given from 0 up; past the table, two ids
/// share a slot, which can only hide a quiet worker, never invent one). Atomics, not
/// [`STATE`]'s lock: every event batch counts here, on every executor's write path.
static HEARD: [AtomicU64; 1 << 16] = [const { AtomicU64::new(0) }; 1 << 16];

/// Counts an event feed of `worker` (an event batch or an engine delivery): reports
/// that keep coming while none does say its events stopped.
pub fn heard(worker: WorkerId) {
    HEARD[worker as usize % HEARD.len()].fetch_add(1, Relaxed);
}

fn heard_of(worker: WorkerId) -> u64 {
    HEARD[worker as usize % HEARD.len()].load(Relaxed)
}

crate::metric_set! {
    /// The closed loop's counters, process-wide.
    pub struct Metrics {
        /// Reuse reports received (v5 `ReuseReport`: what engines said they reused).
        reports: Counter Sum "kvix_reuse_reports_total",
        /// Reports counted, by what they said of kvix's prediction.
        outcomes: Counter Sum "kvix_reuse_predictions_total" by "outcome" (&Outcome::LABELS),
        /// Reports not counted, by why.
        dropped: Counter Sum "kvix_reuse_reports_dropped_total" by "reason" (&Dropped::LABELS),
        /// Workers (and, for gateway_tokenization, clients) under a verdict, by cause.
        suspect: Gauge Sum "kvix_workers_suspect" by "cause" (&CAUSE_LABELS),
        /// Placement-fed workers whose placements were dropped: their engine lost its cache.
        caches_lost: Counter Sum "kvix_reuse_caches_lost_total",
    }
}

pub static METRICS: Metrics = Metrics::new();

/// How far off kvix was, in blocks, when it predicted more and when less.
static ERROR_OVER: LazyLock<Buckets> = LazyLock::new(Buckets::default);
static ERROR_UNDER: LazyLock<Buckets> = LazyLock::new(Buckets::default);

static STATE: LazyLock<Mutex<State>> = LazyLock::new(Mutex::default);

/// The workers under a verdict, for every executor's answers to read: the cause's
/// index in [`CAUSES`] plus one, 0 for none.
pub static SUSPECT: SuspectWorkers = SuspectWorkers {
    causes: [const { AtomicU8::new(0) }; kvix_engine::MAX_WORKERS as usize],
};

pub struct SuspectWorkers {
    causes: [AtomicU8; kvix_engine::MAX_WORKERS as usize],
}

impl SuspectWorkers {
    pub fn any(&self) -> bool {
        CAUSES[1..]
            .iter()
            .any(|&c| METRICS.suspect[cause_index(c)].load(Relaxed) > 0)
    }

    pub fn of(&self, worker: WorkerId) -> Option<SuspectCause> {
        let c = self.causes.get(worker as usize)?.load(Relaxed);
        (c > 0).then(|| CAUSES[usize::from(c) - 1])
    }

    fn set(&self, worker: WorkerId, cause: Option<SuspectCause>) {
        if let Some(slot) = self.causes.get(worker as usize) {
            let v = cause.map_or(0, |c| cause_index(c) as u8 + 1);
            slot.store(v, Relaxed);
        }
    }
}

fn lock() -> std::sync::MutexGuard<'static, State> {
    STATE.lock().unwrap_or_else(|p| p.into_inner())
}

/// One report as the server reads it.
#[derive(Debug, Clone, Copy)]
pub struct Report {
    pub worker: WorkerId,
    pub predicted: Option<u32>,
    pub cached: u32,
    pub prompt: u32,
}

/// What the index is to learn from a round of reports, through the write route so
/// that every replica learns it alike (verdicts are each replica's own; the index is
/// not).
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Learned {
    /// Placement-fed workers whose engine lost its cache ([`CACHE_LOST`]): their
    /// placements are dropped.
    pub caches_lost: Vec<WorkerId>,
    /// Event-fed workers just named `events_missing`: gateways' placements fill in for
    /// them, as for a worker whose history is lost.
    pub fill_in: Vec<WorkerId>,
}

/// Takes `reports` from `client`; `kind` says what each worker is (None: not on the
/// roster). `block`: the server's block, in tokens (the tolerance).
pub fn take(
    client: &str,
    reports: &[Report],
    block: u32,
    kind: &dyn Fn(WorkerId) -> Option<WorkerKind>,
) -> Learned {
    METRICS.reports.fetch_add(reports.len() as u64, Relaxed);
    lock().take(client, reports, block, kind)
}

/// A retired worker's reports and verdict go (its id may name another worker next).
pub fn forget(worker: WorkerId) {
    let mut st = lock();
    st.set_worker(worker, None);
    st.workers.remove(&worker);
    for c in st.clients.values_mut() {
        c.window.last.retain(|(w, _)| *w != worker);
    }
}

fn drop_all(why: Dropped, n: usize) {
    if n > 0 {
        METRICS.dropped[why as usize].fetch_add(n as u64, Relaxed);
    }
}

/// Appends the closed loop's metrics in Prometheus text format.
pub fn render(out: &mut Exposition) {
    out.families(Metrics::FAMILIES, std::slice::from_ref(&METRICS));
    out.histogram_by(
        "kvix_reuse_error_blocks",
        "How far off kvix's prediction was, in blocks, by direction (exact reports left out).",
        "direction",
        [("over", &*ERROR_OVER), ("under", &*ERROR_UNDER)],
    );
}

/// The verdicts and what they stand on, as JSON (`GET /reuse` on the metrics port): per
/// worker and per client, the last reports (`=` exact, `+` over, `-` under, `0` missed)
/// and whom they came from or were about.
pub fn view(name_of: &dyn Fn(WorkerId) -> Option<String>) -> serde_json::Value {
    use serde_json::json;
    let st = lock();
    let mut workers: Vec<_> = st
        .workers
        .iter()
        .map(|(&id, w)| {
            let from: Vec<_> = w
                .window
                .by_whom()
                .into_iter()
                .map(|(c, n, wrong)| json!({"client": &*c, "reports": n, "wrong": wrong}))
                .collect();
            let cause = w.cause.map(|c| CAUSE_LABELS[cause_index(c)]);
            json!({"worker": id, "name": name_of(id), "suspect": cause,
                   "last": w.window.shown(), "from": from})
        })
        .collect();
    workers.sort_by_key(|v| v["worker"].as_u64());
    let mut clients: Vec<_> = st
        .clients
        .iter()
        .map(|(c, s)| {
            let cause = s.window.bad.then_some(CAUSE_LABELS[0]);
            json!({"client": &**c, "suspect": cause, "last": s.window.shown()})
        })
        .collect();
    clients.sort_by(|a, b| a["client"].as_str().cmp(&b["client"].as_str()));
    json!({"workers": workers, "clients": clients})
}
