//! The verdicts' state and rules: every client's and worker's window, and how a report
//! moves them (the rules themselves: the module above).

use std::collections::HashMap;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Instant;

use kvix_wire::{SuspectCause, WorkerId};

use super::window::Window;
use super::*;

#[derive(Debug)]
pub(super) struct Client {
    tokens: f64,
    refilled: Instant,
    pub(super) window: Window<WorkerId>,
}

#[derive(Debug)]
pub(super) struct Worker {
    /// Reports from clients under no verdict.
    pub(super) window: Window<Arc<str>>,
    pub(super) cause: Option<SuspectCause>,
    /// The worker's event feeds counted when its last report came ([`heard`]).
    pub(super) heard_then: u64,
    /// Its reports since an event of it was last fed: [`WINDOW`] or more is a quiet worker.
    pub(super) quiet: usize,
    /// Placement-fed: its last reports in a row where kvix predicted reuse and the engine
    /// reused nothing ([`CACHE_LOST`] of them: its engine lost its cache).
    pub(super) zeros: usize,
}

#[derive(Debug, Default)]
pub(super) struct State {
    pub(super) clients: HashMap<Arc<str>, Client>,
    pub(super) workers: HashMap<WorkerId, Worker>,
}

impl State {
    pub(super) fn take(
        &mut self,
        client: &str,
        reports: &[Report],
        block: u32,
        kind: &dyn Fn(WorkerId) -> Option<WorkerKind>,
    ) -> Learned {
        let Some(key) = self.client_key(client) else {
            drop_all(Dropped::Clients, reports.len());
            return Learned::default();
        };
        let mut learned = Learned::default();
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
                learned.caches_lost.push(r.worker);
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
            if self.judge_worker(w, k) == Some(SuspectCause::EventsMissing) {
                learned.fill_in.push(w);
            }
        }
        learned
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
    pub(super) fn client_key(&mut self, client: &str) -> Option<Arc<str>> {
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
    pub(super) fn judge_client(&mut self, client: &Arc<str>) -> bool {
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
    pub(super) fn others_wrong_share(&self, client: &Arc<str>) -> f64 {
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
    /// or more) are at least half wrong, cleared at [`CLEAR`] wrong or fewer. The cause
    /// it was named just now, if any.
    pub(super) fn judge_worker(
        &mut self,
        worker: WorkerId,
        kind: WorkerKind,
    ) -> Option<SuspectCause> {
        let w = self.workers.get_mut(&worker)?;
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
        self.set_worker(worker, cause).then_some(cause).flatten()
    }

    /// Whether the worker's verdict changed.
    pub(super) fn set_worker(&mut self, worker: WorkerId, cause: Option<SuspectCause>) -> bool {
        let was = self.workers.get(&worker).and_then(|w| w.cause);
        if was == cause {
            return false;
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
        true
    }
}
