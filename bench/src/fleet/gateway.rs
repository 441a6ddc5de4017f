//! A gateway of the mock fleet: where its prefix knowledge comes from is the leg; the
//! choice itself is the same everywhere (`kvix_client::pick::Picker`: reuse against the
//! gateway's own count of its requests in flight per engine).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvix_client::pick::Picker;
use kvix_client::{Client, QueryOptions, QueryOutcome};
use kvix_engine::{Engine as Index, Ks};
use kvix_wire::{Depths, Feed, Keyspace, Lane, TierWeights, WorkerId};

use super::engine::Engine;
use super::{Fleet, Leg};

/// A gateway's own index (the `local` leg): fed only by its own placements.
struct LocalIndex {
    index: Index,
    ks: Ks,
    /// Engine index → its id in `index`, and back.
    ids: Vec<WorkerId>,
    engine_of: HashMap<WorkerId, usize>,
}

/// Where the gateway's knowledge comes from.
enum Knowledge {
    /// kvix (shared), by its own connection; with placements published when the leg is
    /// `placements`.
    Kvix {
        client: Client,
        placements: bool,
        /// What a block from CPU is worth against one on GPU, for this leg's pick.
        weights: TierWeights,
    },
    Local(Box<Mutex<LocalIndex>>),
    /// Every engine's cache, read directly, with no lag, weighed by the time model.
    Oracle(TierWeights),
    RoundRobin(AtomicUsize),
}

/// What routing one request came to.
#[derive(Debug, Clone, Copy)]
pub struct Routed {
    pub engine: usize,
    /// Reusable blocks (any tier) the gateway expected on that engine (None: round robin
    /// has no expectation).
    pub predicted: Option<u32>,
    pub lookup: Duration,
    /// Whether the answer scored the engine chosen (its reuse was predicted).
    pub in_answer: bool,
    /// Why the index did not help (`QueryOutcome::kind`: timeout, disconnected,
    /// rejected): routed by load alone.
    pub degraded: Option<&'static str>,
}

pub struct Gateway {
    knowledge: Knowledge,
    keyspace: Keyspace,
    /// The keyspace its queries and placements hash in: another than the engines' for
    /// a gateway whose token ids are not theirs (`Misconfig::GatewayTokenization`).
    asks_in: Keyspace,
    block_tokens: u32,
    engines: Arc<Vec<Engine>>,
    engine_of_name: Arc<HashMap<Arc<str>, usize>>,
    inflight: Vec<AtomicU32>,
    picker: Mutex<Picker>,
    alpha: f64,
}

impl Gateway {
    /// Gateway `g` of `fleet`; `client` is its own connection to kvix for the legs that
    /// ask kvix. Its own index (`local`) starts knowing the system prefix on every
    /// engine, as from its past placements.
    pub(super) fn new(g: usize, fleet: &Fleet, client: Option<Client>) -> anyhow::Result<Gateway> {
        let mistokenizes =
            g == 0 && fleet.cfg.misconfig == Some(super::Misconfig::GatewayTokenization);
        let (leg, keyspace, engines) = (fleet.leg, fleet.keyspace.clone(), fleet.engines.clone());
        let block_tokens = fleet.cfg.workload.block_tokens;
        let capacity_blocks = u64::from(fleet.cfg.workload.capacity_blocks);
        let n = engines.len();
        let knowledge = match leg {
            Leg::Events | Leg::EventsJoint | Leg::Placements => Knowledge::Kvix {
                client: client.ok_or_else(|| anyhow::anyhow!("the {leg:?} leg asks kvix"))?,
                // Placements fill in for an engine whose events go elsewhere.
                placements: leg == Leg::Placements
                    || fleet.cfg.misconfig == Some(super::Misconfig::EngineEventsElsewhere),
                weights: match leg {
                    Leg::EventsJoint => TierWeights::JOINT,
                    _ => fleet.tier_weights(),
                },
            },
            Leg::Local => {
                let mut index = Index::new(block_tokens);
                let feed = Feed::Placements {
                    capacity_blocks,
                    ttl_ms: 0,
                };
                let mut ids = Vec::with_capacity(n);
                for e in engines.iter() {
                    let (id, _) = index
                        .announce(&e.name, &[Lane::full(block_tokens)], feed)
                        .map_err(|e| anyhow::anyhow!("announce: {e}"))?;
                    ids.push(id);
                    index
                        .place(id, Ks::of(&keyspace, block_tokens), &fleet.system.chain, 0)
                        .map_err(|e| anyhow::anyhow!("place: {e}"))?;
                }
                let engine_of = ids.iter().enumerate().map(|(i, &id)| (id, i)).collect();
                Knowledge::Local(Box::new(Mutex::new(LocalIndex {
                    ks: Ks::of(&keyspace, block_tokens),
                    index,
                    ids,
                    engine_of,
                })))
            }
            Leg::Oracle => Knowledge::Oracle(fleet.tier_weights()),
            Leg::RoundRobin => Knowledge::RoundRobin(AtomicUsize::new(g)),
        };
        let asks_in = match mistokenizes {
            // Another chat template: other token ids, so chains no engine's events make.
            true => Keyspace {
                salt: "another-chat-template".into(),
                ..keyspace.clone()
            },
            false => keyspace.clone(),
        };
        Ok(Gateway {
            knowledge,
            keyspace,
            asks_in,
            block_tokens,
            inflight: (0..n).map(|_| AtomicU32::new(0)).collect(),
            picker: Mutex::new(Picker::new(n)),
            engines,
            engine_of_name: fleet.engine_of_name.clone(),
            alpha: fleet.cfg.workload.alpha,
        })
    }

    /// Chooses the engine for a prompt of `chain` and records the choice where this
    /// leg's knowledge comes from (a placement); `tie` orders equal engines.
    pub async fn route(&self, chain: &[u64], tie: u64) -> Routed {
        let started = Instant::now();
        // (engine, reuse weighed by tier, joint depth) for the engines that hold some.
        let (scores, degraded): (Vec<(WorkerId, f64, u32)>, Option<&'static str>) =
            match &self.knowledge {
                Knowledge::Kvix {
                    client, weights, ..
                } => {
                    let opts = QueryOptions {
                        weights: Some(*weights),
                        ..QueryOptions::default()
                    };
                    let outcome = client.query_chain(&self.asks_in, chain, &opts).await;
                    let degraded = match outcome {
                        QueryOutcome::Scores(_) | QueryOutcome::Empty => None,
                        ref other => Some(other.kind()),
                    };
                    let scores = match outcome {
                        QueryOutcome::Scores(s) => s
                            .iter()
                            .filter_map(|s| {
                                let i = self.engine_of_name.get(s.name.as_deref()?)?;
                                Some((*i as WorkerId, s.reuse, s.blocks))
                            })
                            .collect(),
                        _ => Vec::new(),
                    };
                    (scores, degraded)
                }
                Knowledge::Local(local) => {
                    let mut l = local.lock().unwrap_or_else(|e| e.into_inner());
                    let ks = l.ks;
                    let answer = l.index.query(ks, chain, None, 0, false);
                    let scores = answer
                        .scores
                        .iter()
                        .filter_map(|&(id, b)| {
                            Some((*l.engine_of.get(&id)? as WorkerId, f64::from(b), b))
                        })
                        .collect();
                    (scores, None)
                }
                Knowledge::Oracle(weights) => {
                    let scores = self
                        .engines
                        .iter()
                        .enumerate()
                        .map(|(i, e)| {
                            let held = e.held(chain);
                            let depths = Depths {
                                gpu: held.gpu,
                                cpu: held.cpu,
                                storage: held.cpu,
                            };
                            (i as WorkerId, depths.weighed(weights), held.cpu)
                        })
                        .filter(|&(_, _, b)| b > 0)
                        .collect();
                    (scores, None)
                }
                Knowledge::RoundRobin(next) => {
                    let engine = next.fetch_add(1, Ordering::Relaxed) % self.engines.len();
                    return Routed {
                        engine,
                        predicted: None,
                        lookup: started.elapsed(),
                        in_answer: false,
                        degraded: None,
                    };
                }
            };
        let lookup = started.elapsed();
        let load: Vec<u32> = self
            .inflight
            .iter()
            .map(|l| l.load(Ordering::Relaxed))
            .collect();
        let picked = self.picker.lock().unwrap_or_else(|e| e.into_inner()).pick(
            scores.iter().map(|&(w, r, _)| (w, r)),
            &load,
            self.alpha,
            tie,
        );
        let chosen = scores.iter().find(|&&(w, _, _)| w as usize == picked.index);
        let joint = chosen.map_or(0, |&(_, _, b)| b);
        match &self.knowledge {
            Knowledge::Kvix {
                client,
                placements: true,
                ..
            } => {
                let name = self.engines[picked.index].name.as_str();
                client.publish_placement(name, &self.asks_in, chain.to_vec());
            }
            Knowledge::Local(local) => {
                let mut l = local.lock().unwrap_or_else(|e| e.into_inner());
                let (id, ks) = (l.ids[picked.index], l.ks);
                let now_ms = 0; // no TTL: the capacity bound is what evicts
                let _ = l.index.place(id, ks, chain, now_ms);
            }
            _ => {}
        }
        Routed {
            engine: picked.index,
            predicted: Some(joint),
            lookup,
            in_answer: chosen.is_some(),
            degraded,
        }
    }

    /// A routed request completed: what its engine reused (`reused_blocks` of a prompt
    /// of `prompt_tokens`), reported to kvix against what the answer predicted, as a
    /// gateway reports an engine's `cached_tokens`. kvix legs only.
    pub fn report(&self, routed: &Routed, reused_blocks: u32, prompt_tokens: u32) {
        let Knowledge::Kvix { client, .. } = &self.knowledge else {
            return;
        };
        let bt = self.block_tokens;
        client.report_reuse(kvix_client::ReuseSample {
            worker: kvix_client::WorkerRef::Name(self.engines[routed.engine].name.as_str().into()),
            model: self.keyspace.model.clone(),
            predicted_tokens: routed.in_answer.then(|| routed.predicted.unwrap_or(0) * bt),
            cached_tokens: Some(reused_blocks * bt),
            prompt_tokens,
        });
    }

    /// Reuse reports this gateway sent.
    pub fn reports_sent(&self) -> u64 {
        match &self.knowledge {
            Knowledge::Kvix { client, .. } => client.counters().reuse_reports_sent,
            _ => 0,
        }
    }

    /// A request of this gateway's went to / came back from `engine`.
    pub fn started(&self, engine: usize) {
        self.inflight[engine].fetch_add(1, Ordering::Relaxed);
    }

    pub fn finished(&self, engine: usize) {
        self.inflight[engine].fetch_sub(1, Ordering::Relaxed);
    }
}
