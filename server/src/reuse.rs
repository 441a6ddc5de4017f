//! The closed loop: what the engines say they reused (v5 `ReuseReport`: a gateway's
//! reports of `usage.prompt_tokens_details.cached_tokens` after routed requests) against
//! what kvix predicted, kept per (client, worker) so that a gateway-side cause is not
//! blamed on a worker, and turned into verdicts that name a cause.
//!
//! One report is exact within one block (the engine caps reuse below the prompt's
//! length and rounds to its block), an over-prediction, an under-prediction, or a miss
//! (kvix predicted nothing where the engine reused). Each (client, worker) pair keeps
//! its last [`WINDOW`] outcomes and turns *bad* at [`RAISE`] wrong ones, *good* again at
//! [`CLEAR`] or fewer: a verdict clears within `WINDOW - CLEAR` = 13 right reports after
//! its cause is fixed.
//!
//! - A client whose pairs are bad on at least two workers and on two thirds of those it
//!   reports on is suspect (`GatewayTokenization`: its token ids are not the engines');
//!   its reports then count for no worker.
//! - A worker is suspect when at least half of its judged pairs with the other clients
//!   are bad: `EventsMissing` (kvix predicts nothing), `Undercounted` (less than the
//!   engine reuses), `EventsLagging` (more). A worker whose history is lost is already
//!   flagged for under-counting and gets no verdict; placement-fed workers only for
//!   over-prediction (placements never learn the output an engine caches).
//!
//! Verdicts are this replica's own: every replica sees the reports its clients send
//! (a gateway reports to the replica that answered), and what they judge (the index
//! each replica holds) may differ for a moment; shipping them through the log would
//! make every report a write. The state is process-wide, behind one lock: reports are
//! batched by clients and rare next to queries, which read only [`SUSPECT`]'s atomics.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU8, Ordering::Relaxed};
use std::sync::{Arc, LazyLock, Mutex};
use std::time::Instant;

use kvix_wire::{SuspectCause, WorkerId};

use crate::exposition::{Buckets, Exposition};

/// Reports per (client, worker) judged.
pub const WINDOW: usize = 16;
/// Wrong reports of the last [`WINDOW`] that make a pair bad.
pub const RAISE: usize = 8;
/// Wrong reports of the last [`WINDOW`] at or under which a bad pair is good again.
pub const CLEAR: usize = 3;
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

/// One (client, worker) pair's last reports.
#[derive(Debug, Default)]
struct Pair {
    window: VecDeque<Outcome>,
    bad: bool,
}

impl Pair {
    fn push(&mut self, o: Outcome) {
        if self.window.len() == WINDOW {
            self.window.pop_front();
        }
        self.window.push_back(o);
        let wrong = self.wrong();
        if !self.bad && self.judged() && wrong >= RAISE {
            self.bad = true;
        } else if self.bad && wrong <= CLEAR {
            self.bad = false;
        }
    }

    fn judged(&self) -> bool {
        self.window.len() == WINDOW
    }

    fn wrong(&self) -> usize {
        self.window.iter().filter(|&&o| o != Outcome::Exact).count()
    }

    /// The most frequent wrong outcome.
    fn direction(&self) -> Outcome {
        let count = |x| self.window.iter().filter(|&&o| o == x).count();
        [Outcome::Missed, Outcome::Under, Outcome::Over]
            .into_iter()
            .max_by_key(|&o| count(o))
            .unwrap_or(Outcome::Exact)
    }
}

#[derive(Debug)]
struct Client {
    tokens: f64,
    refilled: Instant,
    suspect: bool,
    workers: Vec<WorkerId>,
}

#[derive(Debug, Default)]
struct State {
    clients: HashMap<Arc<str>, Client>,
    pairs: HashMap<(Arc<str>, WorkerId), Pair>,
    /// Clients that reported on each worker.
    reporters: HashMap<WorkerId, Vec<Arc<str>>>,
    workers: HashMap<WorkerId, SuspectCause>,
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
/// roster). `block`: the server's block, in tokens (the tolerance).
pub fn take(
    client: &str,
    reports: &[Report],
    block: u32,
    kind: &dyn Fn(WorkerId) -> Option<WorkerKind>,
) {
    METRICS.reports.fetch_add(reports.len() as u64, Relaxed);
    let mut st = lock();
    let key: Arc<str> = match st.clients.get_key_value(client) {
        Some((k, _)) => k.clone(),
        None if st.clients.len() >= MAX_CLIENTS => {
            return drop_all(Dropped::Clients, reports.len());
        }
        None => {
            let k: Arc<str> = client.into();
            st.clients.insert(
                k.clone(),
                Client {
                    tokens: REPORTS_PER_S,
                    refilled: Instant::now(),
                    suspect: false,
                    workers: Vec::new(),
                },
            );
            k
        }
    };
    let allowed = st
        .clients
        .get_mut(&key)
        .map_or(0, |c| c.allow(reports.len()));
    drop_all(Dropped::Rate, reports.len() - allowed);
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
        st.record(&key, r.worker, o);
        touched.push((r.worker, k));
    }
    touched.sort_unstable_by_key(|&(w, _)| w);
    touched.dedup_by_key(|&mut (w, _)| w);
    let was = st.clients.get(&key).is_some_and(|c| c.suspect);
    st.judge_client(&key);
    if st.clients.get(&key).is_some_and(|c| c.suspect) != was {
        // The client's reports now count, or no longer count, for every worker it
        // reported on.
        let all: Vec<WorkerId> = st
            .clients
            .get(&key)
            .map_or(Vec::new(), |c| c.workers.clone());
        for w in all {
            if let Some(k) = kind(w) {
                touched.push((w, k));
            }
        }
    }
    for (w, k) in touched {
        st.judge_worker(w, k);
    }
}

/// A retired worker's reports and verdict go (its id may name another worker next).
pub fn forget(worker: WorkerId) {
    let mut st = lock();
    if let Some(clients) = st.reporters.remove(&worker) {
        for c in clients {
            st.pairs.remove(&(c.clone(), worker));
            if let Some(client) = st.clients.get_mut(&c) {
                client.workers.retain(|&w| w != worker);
            }
        }
    }
    st.set_worker(worker, None);
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
    fn record(&mut self, client: &Arc<str>, worker: WorkerId, o: Outcome) {
        let pair = self
            .pairs
            .entry((client.clone(), worker))
            .or_insert_with(|| {
                self.reporters
                    .entry(worker)
                    .or_default()
                    .push(client.clone());
                if let Some(c) = self.clients.get_mut(client) {
                    c.workers.push(worker);
                }
                Pair::default()
            });
        pair.push(o);
    }

    fn judge_client(&mut self, client: &Arc<str>) {
        let Some(c) = self.clients.get(client) else {
            return;
        };
        let judged: Vec<&Pair> = c
            .workers
            .iter()
            .filter_map(|&w| self.pairs.get(&(client.clone(), w)))
            .filter(|p| p.judged())
            .collect();
        let bad = judged.iter().filter(|p| p.bad).count();
        let suspect = bad >= 2 && 3 * bad >= 2 * judged.len();
        let was = c.suspect;
        if suspect == was {
            return;
        }
        let gauge = &METRICS.suspect[cause_index(SuspectCause::GatewayTokenization)];
        let cause = SuspectCause::GatewayTokenization;
        if suspect {
            gauge.fetch_add(1, Relaxed);
            tracing::warn!(
                client = %client,
                cause = CAUSE_LABELS[cause_index(cause)],
                "reuse reports: client {client} is wrong on {bad} of the {} workers it reports \
                 on: {}",
                judged.len(),
                remedy(cause)
            );
        } else {
            gauge.fetch_sub(1, Relaxed);
            tracing::info!(client = %client, "reuse reports: client {client} agrees with the engines again");
        }
        if let Some(c) = self.clients.get_mut(client) {
            c.suspect = suspect;
        }
    }

    fn judge_worker(&mut self, worker: WorkerId, kind: WorkerKind) {
        let clients = self.reporters.get(&worker).map_or(&[][..], |v| &v[..]);
        let judged: Vec<&Pair> = clients
            .iter()
            .filter(|c| !self.clients.get(*c).is_some_and(|c| c.suspect))
            .filter_map(|c| self.pairs.get(&(c.clone(), worker)))
            .filter(|p| p.judged())
            .collect();
        let bad: Vec<&&Pair> = judged.iter().filter(|p| p.bad).collect();
        let cause = if kind.history_lost || bad.is_empty() || 2 * bad.len() < judged.len() {
            None
        } else {
            let count = |o| bad.iter().filter(|p| p.direction() == o).count();
            let direction = [Outcome::Missed, Outcome::Under, Outcome::Over]
                .into_iter()
                .max_by_key(|&o| count(o))
                .unwrap_or(Outcome::Exact);
            match (direction, kind.event_fed) {
                (Outcome::Over, _) => Some(SuspectCause::EventsLagging),
                (Outcome::Missed, true) => Some(SuspectCause::EventsMissing),
                (Outcome::Under, true) => Some(SuspectCause::Undercounted),
                _ => None,
            }
        };
        self.set_worker(worker, cause);
    }

    fn set_worker(&mut self, worker: WorkerId, cause: Option<SuspectCause>) {
        let was = self.workers.get(&worker).copied();
        if was == cause {
            return;
        }
        if let Some(c) = was {
            METRICS.suspect[cause_index(c)].fetch_sub(1, Relaxed);
        }
        match cause {
            Some(c) => {
                METRICS.suspect[cause_index(c)].fetch_add(1, Relaxed);
                self.workers.insert(worker, c);
                tracing::warn!(
                    worker,
                    cause = CAUSE_LABELS[cause_index(c)],
                    "reuse reports: worker {worker}'s engine disagrees with kvix's predictions: {}",
                    remedy(c)
                );
            }
            None => {
                self.workers.remove(&worker);
                if was.is_some() {
                    tracing::info!(
                        worker,
                        "reuse reports: worker {worker} agrees with kvix again"
                    );
                }
            }
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
/// worker and per client, each pair's last reports (`=` exact, `+` over, `-` under,
/// `0` missed).
pub fn view(name_of: &dyn Fn(WorkerId) -> Option<String>) -> serde_json::Value {
    use serde_json::json;
    let st = lock();
    let shown = |p: &Pair| -> String {
        p.window
            .iter()
            .map(|o| match o {
                Outcome::Exact => '=',
                Outcome::Over => '+',
                Outcome::Under => '-',
                Outcome::Missed => '0',
            })
            .collect()
    };
    let mut workers: Vec<_> = st
        .reporters
        .iter()
        .map(|(&w, clients)| {
            let pairs: Vec<_> = clients
                .iter()
                .filter_map(|c| {
                    let p = st.pairs.get(&(c.clone(), w))?;
                    Some(json!({"client": &**c, "bad": p.bad, "last": shown(p)}))
                })
                .collect();
            let cause = st.workers.get(&w).map(|&c| CAUSE_LABELS[cause_index(c)]);
            json!({"worker": w, "name": name_of(w), "suspect": cause, "pairs": pairs})
        })
        .collect();
    workers.sort_by_key(|v| v["worker"].as_u64());
    let mut clients: Vec<_> = st
        .clients
        .iter()
        .map(|(c, s)| {
            let cause = s.suspect.then_some(CAUSE_LABELS[0]);
            json!({"client": &**c, "suspect": cause, "workers": s.workers.len()})
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
    fn a_pair_turns_bad_at_half_wrong_and_good_again_within_thirteen_right_reports() {
        let mut p = Pair::default();
        for _ in 0..WINDOW - RAISE {
            p.push(Outcome::Exact);
        }
        for i in 0..RAISE {
            assert!(!p.bad, "{i}");
            p.push(Outcome::Missed);
        }
        assert!(p.bad);
        assert_eq!(p.direction(), Outcome::Missed);
        let mut right = 0;
        while p.bad {
            p.push(Outcome::Exact);
            right += 1;
        }
        assert!(right <= WINDOW - CLEAR, "{right}");
        // Hysteresis: a few wrong reports do not raise it again.
        for _ in 0..CLEAR + 1 {
            p.push(Outcome::Over);
        }
        assert!(!p.bad);
    }
}
