//! `sim`: a routing simulation that measures what a shared index buys over per-gateway
//! guesses.
//!
//! Mock workers keep LRU prefix caches ([`crate::lru::LruCache`], capacity in blocks).
//! Sessions arrive as a Poisson stream; turn `t + 1` of a session extends turn `t`'s
//! prompt with its output and a new user message, and each turn is sprayed at a
//! uniformly random gateway (no sticky load balancer). Every gateway makes the same
//! cache-aware pick ([`kvix_client::pick::Picker`]); only where its prefix knowledge comes from
//! differs:
//!
//! - `shared`: one [`Engine`] fed by every worker's own cache events (stored / removed as
//!   the mock LRU caches admit and evict), queried by every gateway;
//! - `local`: each gateway keeps its own [`Engine`] fed only by its own placements
//!   (`Feed::Placements`, capacity = the worker's cache capacity).
//!
//! The hit ratio is measured on the mock workers, not predicted: the blocks of the prompt
//! the chosen worker actually still holds, over the prompt's blocks, summed over every
//! follow-up (turn ≥ 2) request. The workload (session contents, gateway choices, think
//! times) is drawn from per-session streams of the seed, so every leg of one run sees
//! the same requests; only routing (and hence timing) differs.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::time::Instant;

use indicatif::ProgressBar;
use kvix_engine::{Engine, Ks};
use kvix_wire::chain::token_chain;
use kvix_wire::{Feed, Keyspace, Lane, LaneKind, WorkerId};
use serde::{Deserialize, Serialize};

use crate::lru::LruCache;
use crate::rng::Rng;
use crate::stats::cov;
use crate::workload::Workload;
use kvix_client::pick::Picker;

/// Where a gateway's prefix knowledge comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Regime {
    /// One index fed by every worker's cache events.
    Shared,
    /// One index per gateway, fed only by that gateway's own placements.
    Local,
}

/// Which queue lengths the load penalty reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum LoadView {
    /// Each gateway counts only its own in-flight requests per worker (what a gateway
    /// knows without asking anyone).
    Gateway,
    /// Every gateway sees the fleet's true in-flight counts.
    Global,
}

/// One simulation leg's parameters.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SimConfig {
    pub workers: u32,
    pub gateways: u32,
    pub sessions: u32,
    /// Session arrivals per simulated second (Poisson).
    pub session_rate: f64,
    pub load_view: LoadView,
    pub regime: Regime,
    #[serde(flatten)]
    pub workload: Workload,
}

impl Default for SimConfig {
    fn default() -> Self {
        SimConfig {
            workers: 240,
            gateways: 8,
            sessions: 20_000,
            session_rate: 600.0,
            load_view: LoadView::Gateway,
            regime: Regime::Shared,
            workload: Workload::default(),
        }
    }
}

/// What one leg measured.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct LegResult {
    pub regime: Regime,
    pub gateways: u32,
    pub requests: u64,
    pub followups: u64,
    /// Σ reused blocks / Σ prompt blocks over turn ≥ 2 requests (measured on the workers).
    pub followup_hit: f64,
    /// The same over turn-1 requests (mostly the shared system prefix).
    pub first_turn_hit: f64,
    /// Share of follow-ups sent to the worker that served the session's previous turn.
    pub same_worker: f64,
    /// CoV of requests served per worker.
    pub load_cov: f64,
    /// CoV of the time-averaged in-flight count per worker.
    pub inflight_cov: f64,
    /// Keyspace block events the mock workers produced (stored + removed).
    pub block_events: u64,
    /// Distinct blocks in the (first) index at the end.
    pub index_blocks: u64,
    pub wall_s: f64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Ev {
    Arrive { session: u32, turn: u32 },
    Done { session: u32 },
}

#[derive(Debug, Default)]
struct Session {
    /// The prompt of the current turn (then prompt + output once it completes).
    tokens: Vec<u32>,
    worker: u32,
    gateway: u32,
    turn: u32,
    prev_worker: Option<u32>,
}

/// Appends `n` random token ids.
pub(crate) fn tokens(rng: &mut Rng, n: u32, out: &mut Vec<u32>) {
    out.extend((0..n).map(|_| (rng.next_u64() >> 40) as u32 | 1 << 24));
}

/// Runs one leg.
pub fn run(cfg: &SimConfig, progress: &ProgressBar) -> anyhow::Result<LegResult> {
    anyhow::ensure!(
        cfg.workers > 0 && cfg.gateways > 0,
        "need workers and gateways"
    );
    anyhow::ensure!(
        cfg.workload.block_tokens > 0,
        "block_tokens must be positive"
    );
    anyhow::ensure!(
        cfg.workload.turns > 0 && cfg.session_rate > 0.0,
        "need turns and a rate"
    );
    let started = Instant::now();
    let w_n = cfg.workers as usize;
    let g_n = cfg.gateways as usize;
    let keyspace = Keyspace::tokens("kvix-sim");
    let ks = Ks::of(&keyspace, cfg.workload.block_tokens);
    let lanes = [Lane {
        kind: LaneKind::FullAttention,
        block_tokens: cfg.workload.block_tokens,
    }];
    let feed = match cfg.regime {
        Regime::Shared => Feed::Events,
        Regime::Local => Feed::Placements {
            capacity_blocks: cfg.workload.capacity_blocks as u64,
            ttl_ms: 0,
        },
    };
    let n_engines = match cfg.regime {
        Regime::Shared => 1,
        Regime::Local => g_n,
    };
    let mut engines = Vec::with_capacity(n_engines);
    let mut ids: Vec<WorkerId> = Vec::with_capacity(w_n);
    let mut index_of = Vec::new();
    for e in 0..n_engines {
        let mut engine = Engine::new(cfg.workload.block_tokens);
        for w in 0..w_n {
            let (id, _) = engine
                .announce(&format!("worker-{w}"), &lanes, feed)
                .map_err(|e| anyhow::anyhow!("announce: {e}"))?;
            if e == 0 {
                ids.push(id);
                if index_of.len() <= id as usize {
                    index_of.resize(id as usize + 1, usize::MAX);
                }
                index_of[id as usize] = w;
            } else {
                anyhow::ensure!(ids[w] == id, "engines numbered workers differently");
            }
        }
        engines.push(engine);
    }

    let mut caches: Vec<LruCache> = (0..w_n)
        .map(|_| LruCache::new(cfg.workload.capacity_blocks as usize))
        .collect();
    let mut seqs = vec![0u64; w_n];
    let mut inflight = vec![0u32; w_n];
    let mut gw_inflight = vec![vec![0u32; w_n]; g_n];
    let mut served = vec![0u64; w_n];
    // Time-integral of in-flight per worker (µs · requests), for the in-flight CoV.
    let mut area = vec![0f64; w_n];
    let mut last_change = vec![0u64; w_n];
    let mut picker = Picker::new(w_n);
    let mut sessions: Vec<Session> = (0..cfg.sessions).map(|_| Session::default()).collect();

    let mut system = Vec::new();
    tokens(
        &mut Rng::derive(cfg.workload.seed, u64::MAX, 0),
        cfg.workload.system_tokens,
        &mut system,
    );

    let apply = |engine: &mut Engine, seq: &mut u64, w: usize, ev: &[kvix_wire::Event]| {
        if ev.is_empty() {
            return Ok(());
        }
        *seq += 1;
        engine
            .apply(ids[w], *seq, ks, ev)
            .map(|_| ())
            .map_err(|e| anyhow::anyhow!("apply: {e}"))
    };

    // Steady state of a running fleet: every worker already holds the shared system
    // prefix, and every index knows it (events for the shared index, a past placement on
    // every worker for each local one). Without this the first holders of the prefix
    // attract all turn-1 traffic and the rest of the fleet stays cold.
    let system_chain = token_chain(ks.seed, cfg.workload.block_tokens, &system);
    for w in 0..w_n {
        let admitted = caches[w].admit(&system_chain);
        match cfg.regime {
            Regime::Shared => apply(
                &mut engines[0],
                &mut seqs[w],
                w,
                &admitted.events(&system_chain),
            )?,
            Regime::Local => {
                for e in engines.iter_mut() {
                    e.place(ids[w], ks, &system_chain, 0)
                        .map_err(|e| anyhow::anyhow!("place: {e}"))?;
                }
            }
        }
    }

    let mut heap = BinaryHeap::new();
    let mut seq_no = 0u64;
    let mut arrivals = Rng::derive(cfg.workload.seed, u64::MAX, 1);
    let mut t = 0f64;
    for s in 0..cfg.sessions {
        t += arrivals.exp(1e6 / cfg.session_rate);
        heap.push(Reverse((
            t as u64,
            seq_no,
            Ev::Arrive {
                session: s,
                turn: 1,
            },
        )));
        seq_no += 1;
    }

    let (mut fu_hit, mut fu_blocks, mut fu_n, mut same) = (0u64, 0u64, 0u64, 0u64);
    let (mut t1_hit, mut t1_blocks) = (0u64, 0u64);
    let (mut requests, mut block_events) = (0u64, 0u64);
    let mut now = 0u64;
    let total = cfg.sessions as u64 * cfg.workload.turns as u64;
    progress.set_length(total);

    while let Some(Reverse((at, _, ev))) = heap.pop() {
        now = at;
        match ev {
            Ev::Arrive { session, turn } => {
                let s = session as usize;
                let mut rng = Rng::derive(cfg.workload.seed, session as u64, turn as u64);
                let sess = &mut sessions[s];
                if turn == 1 {
                    sess.tokens.extend_from_slice(&system);
                    let n = rng.around(cfg.workload.user_tokens);
                    tokens(&mut rng, n, &mut sess.tokens);
                } else {
                    let n = rng.around(cfg.workload.followup_tokens);
                    tokens(&mut rng, n, &mut sess.tokens);
                }
                let g = rng.below(cfg.gateways as u64) as usize;
                let chain = token_chain(ks.seed, cfg.workload.block_tokens, &sess.tokens);
                let engine = match cfg.regime {
                    Regime::Shared => &mut engines[0],
                    Regime::Local => &mut engines[g],
                };
                let answer = engine.query(ks, &chain, None, 0, false);
                let load = match cfg.load_view {
                    LoadView::Global => &inflight,
                    LoadView::Gateway => &gw_inflight[g],
                };
                let scores = answer
                    .scores
                    .iter()
                    .filter_map(|&(id, b)| index_of.get(id as usize).map(|&w| (w as u32, b)));
                let tie = rng.next_u64();
                let w = picker.pick(scores, load, cfg.workload.alpha, tie).index;
                let reused = caches[w].reusable(&chain) as u64;
                if turn >= 2 {
                    fu_hit += reused;
                    fu_blocks += chain.len() as u64;
                    fu_n += 1;
                    if sess.prev_worker == Some(w as u32) {
                        same += 1;
                    }
                } else {
                    t1_hit += reused;
                    t1_blocks += chain.len() as u64;
                }
                // The worker prefills: it stores the prompt's blocks.
                let admitted = caches[w].admit(&chain);
                block_events += admitted.block_events();
                match cfg.regime {
                    Regime::Shared => {
                        apply(&mut engines[0], &mut seqs[w], w, &admitted.events(&chain))?
                    }
                    Regime::Local => {
                        let placed = engines[g].place(ids[w], ks, &chain, now / 1000);
                        anyhow::ensure!(placed.map_err(|e| anyhow::anyhow!("place: {e}"))?);
                    }
                }
                area[w] += inflight[w] as f64 * (now - last_change[w]) as f64;
                last_change[w] = now;
                inflight[w] += 1;
                gw_inflight[g][w] += 1;
                served[w] += 1;
                requests += 1;
                sess.worker = w as u32;
                sess.gateway = g as u32;
                sess.turn = turn;
                sess.prev_worker = Some(w as u32);
                let prompt_tokens = sess.tokens.len() as u64;
                let uncached =
                    prompt_tokens.saturating_sub(reused * cfg.workload.block_tokens as u64);
                let out = Rng::derive(cfg.workload.seed, session as u64, 1_000_000 + turn as u64)
                    .around(cfg.workload.output_tokens);
                let service_us = uncached as f64 * cfg.workload.prefill_us_per_token
                    + out as f64 * cfg.workload.decode_ms_per_token * 1000.0;
                heap.push(Reverse((
                    now + service_us as u64 + 1,
                    seq_no,
                    Ev::Done { session },
                )));
                seq_no += 1;
                progress.inc(1);
            }
            Ev::Done { session } => {
                let s = session as usize;
                let turn = sessions[s].turn;
                let w = sessions[s].worker as usize;
                let g = sessions[s].gateway as usize;
                let mut rng =
                    Rng::derive(cfg.workload.seed, session as u64, 1_000_000 + turn as u64);
                let n = rng.around(cfg.workload.output_tokens);
                tokens(&mut rng, n, &mut sessions[s].tokens);
                // The worker decoded: it stores the output's whole blocks too.
                let chain = token_chain(ks.seed, cfg.workload.block_tokens, &sessions[s].tokens);
                let admitted = caches[w].admit(&chain);
                block_events += admitted.block_events();
                if cfg.regime == Regime::Shared {
                    apply(&mut engines[0], &mut seqs[w], w, &admitted.events(&chain))?;
                }
                area[w] += inflight[w] as f64 * (now - last_change[w]) as f64;
                last_change[w] = now;
                inflight[w] -= 1;
                gw_inflight[g][w] -= 1;
                if turn < cfg.workload.turns {
                    let think = rng.exp(cfg.workload.think_ms * 1000.0) as u64;
                    heap.push(Reverse((
                        now + think + 1,
                        seq_no,
                        Ev::Arrive {
                            session,
                            turn: turn + 1,
                        },
                    )));
                    seq_no += 1;
                } else {
                    sessions[s].tokens = Vec::new();
                }
            }
        }
    }
    progress.finish_and_clear();
    for w in 0..w_n {
        area[w] += inflight[w] as f64 * (now - last_change[w]) as f64;
    }
    let ratio = |a: u64, b: u64| if b == 0 { 0.0 } else { a as f64 / b as f64 };
    Ok(LegResult {
        regime: cfg.regime,
        gateways: cfg.gateways,
        requests,
        followups: fu_n,
        followup_hit: ratio(fu_hit, fu_blocks),
        first_turn_hit: ratio(t1_hit, t1_blocks),
        same_worker: ratio(same, fu_n),
        load_cov: cov(&served.iter().map(|&x| x as f64).collect::<Vec<_>>()),
        inflight_cov: cov(&area),
        block_events,
        index_blocks: engines[0].stats().blocks,
        wall_s: started.elapsed().as_secs_f64(),
    })
}
