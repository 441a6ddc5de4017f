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
//!   in a row lost its cache (a restart): its placements are dropped instead.
//!
//! Verdicts are this replica's own: every replica sees the reports its clients send
//! (a gateway reports to the replica that answered), and what they judge (the index
//! each replica holds) may differ for a moment; shipping them through the log would
//! make every report a write. The state is process-wide, behind one lock: reports are
//! batched by clients and rare next to queries, which read only [`SUSPECT`]'s atomics.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering::Relaxed};
use std::sync::{Arc, LazyLock, Mutex};
use std::time::Instant;

use kvix_wire::{SuspectCause, WorkerId};

use crate::exposition::{Buckets, Exposition};

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

/// The last outcomes, each with whom it is about (a worker in a client's window, a
/// client in a worker's), and whether they add up to a verdict (kept between reports:
/// raising and clearing have different thresholds).
#[derive(Debug)]
struct Window<K> {
    last: VecDeque<(K, Outcome)>,
    cap: usize,
    bad: bool,
}

impl<K: PartialEq + Clone> Window<K> {
    fn new(cap: usize) -> Self {
        Window {
            last: VecDeque::with_capacity(cap),
            cap,
            bad: false,
        }
    }

    fn push(&mut self, about: K, o: Outcome) {
        if self.last.len() == self.cap {
            self.last.pop_front();
        }
        self.last.push_back((about, o));
    }

    fn full(&self) -> bool {
        self.last.len() == self.cap
    }

    fn wrong(&self) -> usize {
        self.last
            .iter()
            .filter(|(_, o)| *o != Outcome::Exact)
            .count()
    }

    /// The most frequent wrong outcome.
    fn direction(&self) -> Outcome {
        let count = |x| self.last.iter().filter(|(_, o)| *o == x).count();
        [Outcome::Missed, Outcome::Under, Outcome::Over]
            .into_iter()
            .max_by_key(|&o| count(o))
            .unwrap_or(Outcome::Exact)
    }

    /// Whom the outcomes are about, each with (outcomes, wrong ones).
    fn by_whom(&self) -> Vec<(K, usize, usize)> {
        let mut out: Vec<(K, usize, usize)> = Vec::new();
        for (k, o) in &self.last {
            let wrong = usize::from(*o != Outcome::Exact);
            match out.iter_mut().find(|(x, _, _)| x == k) {
                Some(e) => {
                    e.1 += 1;
                    e.2 += wrong;
                }
                None => out.push((k.clone(), 1, wrong)),
            }
        }
        out
    }

    fn shown(&self) -> String {
        self.last
            .iter()
            .map(|(_, o)| match o {
                Outcome::Exact => '=',
                Outcome::Over => '+',
                Outcome::Under => '-',
                Outcome::Missed => '0',
            })
            .collect()
    }
}

/// A client's last reports judged together (across the workers it reports on).
pub const CLIENT_WINDOW: usize = 32;

#[derive(Debug)]
struct Client {
    tokens: f64,
    refilled: Instant,
    window: Window<WorkerId>,
}

#[derive(Debug)]
struct Worker {
    /// Reports from clients under no verdict.
    window: Window<Arc<str>>,
    cause: Option<SuspectCause>,
    /// The worker's event feeds counted when its last report came ([`heard`]).
    heard_then: u64,
    /// Its reports since an event of it was last fed: [`WINDOW`] or more is a quiet worker.
    quiet: usize,
    /// Placement-fed: its last reports in a row where kvix predicted reuse and the engine
    /// reused nothing ([`CACHE_LOST`] of them: its engine lost its cache).
    zeros: usize,
}

#[derive(Debug, Default)]
struct State {
    clients: HashMap<Arc<str>, Client>,
    workers: HashMap<WorkerId, Worker>,
}

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

/// Takes `reports` from `client`; `kind` says what each worker is (None: not on the
/// roster). `block`: the server's block, in tokens (the tolerance). Returns the
/// placement-fed workers whose engine lost its cache ([`CACHE_LOST`]): their placements
/// are to be dropped, through the write route so that every replica drops them.
pub fn take(
    client: &str,
    reports: &[Report],
    block: u32,
    kind: &dyn Fn(WorkerId) -> Option<WorkerKind>,
) -> Vec<WorkerId> {
    METRICS.reports.fetch_add(reports.len() as u64, Relaxed);
    lock().take(client, reports, block, kind)
}

impl State {
    fn take(
        &mut self,
        client: &str,
        reports: &[Report],
        block: u32,
        kind: &dyn Fn(WorkerId) -> Option<WorkerKind>,
    ) -> Vec<WorkerId> {
        let Some(key) = self.client_key(client) else {
            drop_all(Dropped::Clients, reports.len());
            return Vec::new();
        };
        let mut lost = Vec::new();
        let allowed = self
            .clients
            .get_mut(&key)
            .map_or(0, |c| c.allow(reports.len()));
        drop_all(Dropped::Rate, reports.len() - allowed);
        let suspect = self.clients.get(&key).is_some_and(|c| c.window.bad);
        let mut touched = Vec::new();
        for r in &reports[..allowed] {
            let Some(k) = kind(r.worker) else {
                METRICS.dropped[Dropped::UnknownWorker as usize].fetch_add(1, Relaxed);
                continue;
            };
            let o = classify(r.predicted, r.cached, r.prompt, block);
            METRICS.outcomes[o as usize].fetch_add(1, Relaxed);
            let off = u64::from(r.predicted.unwrap_or(0).abs_diff(r.cached) / block.max(1));
            match o {
                Outcome::Over => ERROR_OVER.observe(off),
                Outcome::Under | Outcome::Missed => ERROR_UNDER.observe(off),
                Outcome::Exact => {}
            }
            if let Some(c) = self.clients.get_mut(&key) {
                c.window.push(r.worker, o);
            }
            let heard = heard_of(r.worker);
            let w = self.workers.entry(r.worker).or_insert_with(|| Worker {
                window: Window::new(WINDOW),
                cause: None,
                heard_then: heard,
                quiet: 0,
                zeros: 0,
            });
            if w.heard_then != heard {
                (w.heard_then, w.quiet) = (heard, 0);
            }
            w.quiet += 1;
            if !suspect {
                w.window.push(key.clone(), o);
            }
            if cache_lost(w, r, block, k) {
                lost.push(r.worker);
            }
            touched.push((r.worker, k));
        }
        if self.judge_client(&key) {
            // Named: its reports count for no worker; every worker it spoke of is judged
            // again without them.
            let about: Vec<WorkerId> = self.clients.get(&key).map_or(Vec::new(), |c| {
                c.window.last.iter().map(|(w, _)| *w).collect()
            });
            for w in self.workers.values_mut() {
                w.window.last.retain(|(c, _)| *c != key);
            }
            touched.extend(about.into_iter().filter_map(|w| Some((w, kind(w)?))));
        }
        touched.sort_unstable_by_key(|&(w, _)| w);
        touched.dedup_by_key(|&mut (w, _)| w);
        for (w, k) in touched {
            self.judge_worker(w, k);
        }
        lost
    }
}

/// Counts a placement-fed worker's reports where kvix predicted two blocks or more and
/// its engine reused none; true at [`CACHE_LOST`] in a row, when its window starts again
/// (what it held before is not what its engine holds now).
fn cache_lost(w: &mut Worker, r: &Report, block: u32, k: WorkerKind) -> bool {
    if k.event_fed {
        return false;
    }
    let zero = r.predicted.unwrap_or(0) >= 2 * block && r.cached < block;
    w.zeros = if zero { w.zeros + 1 } else { 0 };
    if w.zeros < CACHE_LOST {
        return false;
    }
    w.zeros = 0;
    w.window.last.clear();
    METRICS.caches_lost.fetch_add(1, Relaxed);
    true
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

impl Client {
    /// How many of `n` reports the client's rate allows now.
    fn allow(&mut self, n: usize) -> usize {
        let now = Instant::now();
        let earned = now.duration_since(self.refilled).as_secs_f64() * REPORTS_PER_S;
        self.tokens = (self.tokens + earned).min(REPORTS_PER_S);
        self.refilled = now;
        let allowed = (self.tokens.floor() as usize).min(n);
        self.tokens -= allowed as f64;
        allowed
    }
}

impl State {
    /// The key `client` is tracked under, tracking it now if there is room.
    fn client_key(&mut self, client: &str) -> Option<Arc<str>> {
        if let Some((k, _)) = self.clients.get_key_value(client) {
            return Some(k.clone());
        }
        if self.clients.len() >= MAX_CLIENTS {
            return None;
        }
        let k: Arc<str> = client.into();
        let c = Client {
            tokens: REPORTS_PER_S,
            refilled: Instant::now(),
            window: Window::new(CLIENT_WINDOW),
        };
        self.clients.insert(k.clone(), c);
        Some(k)
    }

    /// Judges `client` on its last [`CLIENT_WINDOW`] reports: named when half of them
    /// or more are wrong, about two workers or more, and at least twice the share of
    /// the other clients' last reports (a feed that under-predicts for everyone, as
    /// placements do, names no one); cleared at a fifth wrong or fewer, or under 1.25
    /// times the others' share. True when it was named just now.
    fn judge_client(&mut self, client: &Arc<str>) -> bool {
        let others = self.others_wrong_share(client);
        let Some(c) = self.clients.get_mut(client) else {
            return false;
        };
        let wrong = c.window.wrong();
        let about = c.window.by_whom().iter().filter(|(_, _, w)| *w > 0).count();
        let was = c.window.bad;
        let share = wrong as f64 / CLIENT_WINDOW as f64;
        if !was && c.window.full() && share >= 0.5 && about >= 2 && share >= 2.0 * others {
            c.window.bad = true;
        } else if was && (share <= 0.2 || share < 1.25 * others) {
            c.window.bad = false;
        }
        let now = c.window.bad;
        if now == was {
            return false;
        }
        let cause = SuspectCause::GatewayTokenization;
        let gauge = &METRICS.suspect[cause_index(cause)];
        if now {
            gauge.fetch_add(1, Relaxed);
            tracing::warn!(
                client = %client,
                cause = CAUSE_LABELS[cause_index(cause)],
                "reuse reports: client {client} is wrong on {wrong} of its last {CLIENT_WINDOW} \
                 reports, about {about} workers, where the other clients are right: {}",
                remedy(cause)
            );
        } else {
            gauge.fetch_sub(1, Relaxed);
            tracing::info!(client = %client, "reuse reports: client {client} agrees with the engines again");
        }
        now
    }

    /// The share of wrong reports in the last reports of the clients other than
    /// `client` and under no verdict (0 when there are none).
    fn others_wrong_share(&self, client: &Arc<str>) -> f64 {
        let (mut n, mut wrong) = (0usize, 0usize);
        for (c, s) in &self.clients {
            if c != client && !s.window.bad {
                n += s.window.last.len();
                wrong += s.window.wrong();
            }
        }
        if n == 0 {
            0.0
        } else {
            wrong as f64 / n as f64
        }
    }

    /// Judges `worker` on its last [`WINDOW`] reports from clients under no verdict:
    /// named at [`RAISE`] wrong when most of the clients in them (those with two reports
    /// or more) are at least half wrong, cleared at [`CLEAR`] wrong or fewer.
    fn judge_worker(&mut self, worker: WorkerId, kind: WorkerKind) {
        let Some(w) = self.workers.get_mut(&worker) else {
            return;
        };
        let wrong = w.window.wrong();
        let clients: Vec<_> = w
            .window
            .by_whom()
            .into_iter()
            .filter(|(_, n, _)| *n >= 2)
            .collect();
        let wrong_clients = clients.iter().filter(|(_, n, bad)| 2 * bad >= *n).count();
        if !w.window.bad && w.window.full() && wrong >= RAISE && 2 * wrong_clients > clients.len() {
            w.window.bad = true;
        } else if w.window.bad && wrong <= CLEAR {
            w.window.bad = false;
        }
        let quiet = w.quiet >= WINDOW;
        let cause = match (w.window.bad && !kind.history_lost, w.window.direction()) {
            (false, _) => None,
            (true, Outcome::Over) => Some(SuspectCause::EventsLagging),
            (true, Outcome::Missed) if kind.event_fed => Some(SuspectCause::EventsMissing),
            (true, Outcome::Under) if kind.event_fed && quiet => Some(SuspectCause::EventsMissing),
            (true, Outcome::Under) if kind.event_fed => Some(SuspectCause::Undercounted),
            (true, _) => None,
        };
        self.set_worker(worker, cause);
    }

    fn set_worker(&mut self, worker: WorkerId, cause: Option<SuspectCause>) {
        let was = self.workers.get(&worker).and_then(|w| w.cause);
        if was == cause {
            return;
        }
        if let Some(c) = was {
            METRICS.suspect[cause_index(c)].fetch_sub(1, Relaxed);
        }
        if let Some(w) = self.workers.get_mut(&worker) {
            w.cause = cause;
        }
        match cause {
            Some(c) => {
                METRICS.suspect[cause_index(c)].fetch_add(1, Relaxed);
                tracing::warn!(
                    worker,
                    cause = CAUSE_LABELS[cause_index(c)],
                    "reuse reports: worker {worker}'s engine disagrees with kvix's predictions: {}",
                    remedy(c)
                );
            }
            None => tracing::info!(
                worker,
                "reuse reports: worker {worker} agrees with kvix again"
            ),
        }
        SUSPECT.set(worker, cause);
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_report_is_exact_within_one_block_and_below_the_prompt() {
        let cases = [
            // predicted, cached, prompt, outcome
            (Some(160), 160, 200, Outcome::Exact),
            (Some(160), 144, 200, Outcome::Exact),
            (Some(160), 176, 200, Outcome::Exact),
            (Some(160), 100, 200, Outcome::Over),
            (Some(64), 160, 200, Outcome::Under),
            (Some(0), 160, 200, Outcome::Missed),
            (None, 160, 200, Outcome::Missed),
            (None, 0, 200, Outcome::Exact),
            // The whole prompt predicted: the engine recomputes its last block.
            (Some(320), 304, 320, Outcome::Exact),
            (Some(320), 288, 320, Outcome::Exact),
        ];
        for (predicted, cached, prompt, want) in cases {
            assert_eq!(
                classify(predicted, cached, prompt, 16),
                want,
                "{predicted:?} {cached} {prompt}"
            );
        }
    }

    #[test]
    fn a_worker_is_named_at_half_wrong_and_cleared_within_thirteen_right_reports() {
        let kind = WorkerKind {
            event_fed: true,
            history_lost: false,
        };
        let mut st = State::default();
        let key: Arc<str> = "g".into();
        let report = |st: &mut State, o| {
            let w = st.workers.entry(7).or_insert_with(|| Worker {
                window: Window::new(WINDOW),
                cause: None,
                heard_then: 0,
                quiet: 0,
                zeros: 0,
            });
            w.window.push(key.clone(), o);
            st.judge_worker(7, kind);
            st.workers[&7].cause
        };
        for _ in 0..WINDOW - RAISE {
            report(&mut st, Outcome::Exact);
        }
        for i in 0..RAISE - 1 {
            assert_eq!(report(&mut st, Outcome::Missed), None, "{i}");
        }
        assert_eq!(
            report(&mut st, Outcome::Missed),
            Some(SuspectCause::EventsMissing)
        );
        let mut right = 0;
        while report(&mut st, Outcome::Exact).is_some() {
            right += 1;
        }
        assert!(right < WINDOW - CLEAR, "{right}");
        // Hysteresis: a few wrong reports do not raise it again.
        for _ in 0..CLEAR + 1 {
            assert_eq!(report(&mut st, Outcome::Over), None);
        }
        st.set_worker(7, None);
    }

    /// A feed that under-predicts every gateway's follow-ups alike (placements never
    /// learn outputs) names no gateway, even while the workers' windows still hold the
    /// exact first turns; one gateway wrong on everything among them is named.
    #[test]
    fn a_gateway_is_named_only_for_being_wrong_where_the_others_are_right() {
        let kind = |_| {
            Some(WorkerKind {
                event_fed: false,
                history_lost: false,
            })
        };
        let mut st = State::default();
        let report = |worker, cached| Report {
            worker,
            predicted: Some(160),
            cached,
            prompt: 400,
        };
        for g in ["a", "b", "c"] {
            let first: Vec<_> = (0..40).map(|w| report(w, 160)).collect();
            st.take(g, &first, 16, &kind);
        }
        for round in 0..32 {
            for g in ["a", "b", "c"] {
                let cached = if round % 2 == 0 { 160 } else { 320 };
                st.take(g, &[report(round % 40, cached)], 16, &kind);
            }
        }
        assert!(
            st.clients.values().all(|c| !c.window.bad),
            "{:?}",
            st.clients
        );
        for round in 0..32 {
            st.take("d", &[report(round % 40, 0)], 16, &kind);
        }
        let named: Vec<&str> = (st.clients.iter())
            .filter(|(_, c)| c.window.bad)
            .map(|(k, _)| &**k)
            .collect();
        assert_eq!(named, ["d"]);
        let gauge = &METRICS.suspect[cause_index(SuspectCause::GatewayTokenization)];
        gauge.fetch_sub(1, Relaxed);
    }
}
