//! One engine delivery on its worker's home: checked against the stream's state and
//! begun (the worker cleared where it asks), translated a step at a time, finished.

use kvix_engine::{Core, Ks, Update};
use kvix_wire::{ChunkKind, Event, Lane, WorkerId};

use super::{IngestState, IngestStates, LOST};
use crate::ingest::METRICS;
use crate::write::record::Write;
use kvix_events::payload::EngineEvent;
use kvix_events::stream::LastBatch;
use kvix_events::translate::{Counts, Group, Translator};

/// A delivery checked and begun ([`IngestStates::begin`]): its engine events, cut into
/// steps the caller translates one at a time ([`IngestStates::translate_step`]) and
/// feeds between yields, and where its stream stands once they are all applied
/// ([`IngestStates::finish`]).
#[derive(Debug, Default)]
pub struct Begun {
    pub steps: Vec<Vec<EngineEvent>>,
    /// The stream's last batch once they are applied (where a new lease holder resumes).
    pub last: Option<LastBatch>,
}

/// Why a delivery was not applied.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dropped {
    /// The worker was retired, or announced again without events, while it was on its way.
    Orphaned,
    /// Read under an ingest lease another replica has taken since.
    Fenced,
    /// It does not continue the last batch applied from the stream: one before it was
    /// refused on its way (the stream is rewound and re-sends it), or it was applied
    /// already (a replay re-sending what the log holds).
    OutOfStep,
}

impl IngestStates {
    /// Takes one delivery (a [`Write::Ingest`]) of a worker homed here: checked against
    /// the stream's state, the worker cleared in `core` (appending to `u`) where it
    /// asks, and its engine events cut into steps of about `step_blocks` blocks. Every
    /// copy decides alike from the delivery and the state alone, so replicas and a
    /// replayed log agree.
    pub fn begin(
        &mut self,
        core: &mut Core,
        block: u32,
        delivery: Write,
        step_blocks: usize,
        u: &mut Update,
    ) -> Result<Begun, Dropped> {
        let Write::Ingest {
            worker,
            epoch,
            model,
            salt,
            reset,
            last,
            after,
            payload,
            batch,
        } = delivery
        else {
            unreachable!("IngestStates::begin is given ingest deliveries");
        };
        // Read back from a log, the batch is decoded again from the engine's message.
        let batch = batch.or_else(|| {
            payload
                .as_deref()
                .and_then(|p| kvix_events::payload::decode(p).ok())
        });
        let Some(lanes) = lanes_of(core, worker) else {
            // Retired (or re-announced without events) while the delivery was on its way.
            METRICS
                .orphaned
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            return Err(Dropped::Orphaned);
        };
        let stream_last = self.lasts.get(worker);
        let h = state_of(self, worker, &model, &salt, &lanes, block);
        if epoch < h.epoch {
            // Read under a lease that has passed to another replica since.
            METRICS
                .fenced
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            return Err(Dropped::Fenced);
        }
        if !kvix_events::stream::continues(after, stream_last) {
            METRICS
                .out_of_step
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            return Err(Dropped::OutOfStep);
        }
        h.epoch = epoch;
        note_history(h, worker, reset, after, last, batch.as_ref());
        if reset {
            h.translator.reset();
            let ks = Ks {
                seed: source_seed(&model, &salt, block),
                kind: ChunkKind::Tokens,
            };
            if let Err(e) = core.ingest(worker, ks, &[Event::Cleared], u) {
                tracing::error!(worker, "ingest: clearing the worker failed: {e}");
            }
        }
        // After the clear, which ends a fill-in: while the history is lost, gateways'
        // placements fill in for what the events no longer report.
        if h.lost {
            core.fill_in(worker);
        }
        let steps = batch.map_or_else(Vec::new, |b| {
            kvix_events::translate::steps(b.events, step_blocks)
        });
        Ok(Begun { steps, last })
    }

    /// Translates one step of a begun delivery of `worker` into the kvix events the
    /// caller feeds to `core`, each run under its keyspace, in order; while the index
    /// holds `max_blocks` (0: no bound) its stores are dropped. The groups of the step
    /// before must have been fed.
    pub fn translate_step(
        &mut self,
        core: &Core,
        max_blocks: u64,
        worker: WorkerId,
        events: &[EngineEvent],
    ) -> Vec<(Ks, Vec<Event>)> {
        let Some(h) = self.by_worker.get_mut(&worker) else {
            return Vec::new();
        };
        let (mut groups, mut counts) = (Vec::<Group>::new(), Counts::default());
        h.translator.apply_events(events, &mut groups, &mut counts);
        // The engine holds what it stored whatever the index's bound: past it, the stores
        // are dropped here (queries miss them, never a false hit) and the translator still
        // tracks them, so what continues them resolves once there is room again.
        let held = core.index().blocks();
        if max_blocks > 0 && held >= max_blocks {
            drop_stores(&mut groups, worker, held, max_blocks);
        }
        METRICS.record(&counts);
        groups
            .into_iter()
            .filter(|g| !g.events.is_empty())
            .map(|g| {
                let ks = Ks {
                    seed: h.translator.seed(g.ks),
                    kind: ChunkKind::Tokens,
                };
                (ks, g.events)
            })
            .collect()
    }

    /// A begun delivery's steps are all fed: its stream's last batch is `last`. Called
    /// in the same write-queue job as [`IngestStates::begin`]: no other write of this
    /// worker, and no snapshot, comes between.
    pub fn finish(&mut self, worker: WorkerId, last: Option<LastBatch>) {
        if self.by_worker.contains_key(&worker) {
            self.lasts.set(worker, last);
        }
    }
}

/// Takes the stores out of `groups`, counted and logged at 1, 2, 4, ... drops.
fn drop_stores(groups: &mut [Group], worker: WorkerId, held: u64, max: u64) {
    let mut dropped = 0;
    for g in groups {
        let before = g.events.len();
        g.events
            .retain(|e| !matches!(e, Event::Stored { .. } | Event::StoredIn { .. }));
        dropped += (before - g.events.len()) as u64;
    }
    if dropped == 0 {
        return;
    }
    let total = METRICS
        .dropped_full
        .fetch_add(dropped, std::sync::atomic::Ordering::Relaxed)
        + dropped;
    if (total - dropped).checked_ilog2() != total.checked_ilog2() {
        tracing::warn!(
            worker,
            held,
            max,
            "index full (--max-blocks): {total} engine stores dropped so far; queries miss them"
        );
    }
}

/// Whether the worker still holds all its engine published: a delivery that does not
/// follow its stream's last batch (or, one that clears, that does not start the process's
/// stream) loses the history, a clear in the batch makes it whole again.
fn note_history(
    h: &mut IngestState,
    worker: WorkerId,
    reset: bool,
    after: Option<LastBatch>,
    last: Option<LastBatch>,
    batch: Option<&kvix_events::payload::Batch>,
) {
    let follows = match (after, last) {
        // A clear alone: what the engine holds now is unknown.
        (_, None) => false,
        (_, Some(l)) if reset => l.seq == 0,
        (Some(a), Some(l)) => l.seq == a.seq + 1,
        (None, Some(l)) => l.seq == 0,
    };
    let cleared = batch.is_some_and(|b| b.events.iter().any(|e| matches!(e, EngineEvent::Cleared)));
    let lost = if cleared {
        false
    } else {
        (h.lost && !reset) || !follows || batch.is_none()
    };
    if lost == h.lost {
        return;
    }
    h.lost = lost;
    LOST.set(worker, lost);
    if lost {
        tracing::warn!(
            worker,
            seq = last.map(|l| l.seq),
            after = after.map(|a| a.seq),
            "ingest: the worker's history is lost (batches of its engine went by unapplied): \
             the engine may hold blocks this index does not report until it clears, \
             restarts or stores them again; size the engine's replay buffer for the outages \
             to ride out"
        );
    } else {
        tracing::info!(worker, "ingest: the worker's history is whole again");
    }
}

fn lanes_of(core: &Core, worker: WorkerId) -> Option<Vec<Lane>> {
    let entry = core.roster().get(worker)?;
    (entry.feed == kvix_wire::Feed::Events).then(|| entry.lanes.clone())
}

/// The worker's state, made new when it has none or its source's keyspace changed (the
/// stream goes on: its last batch is kept).
fn state_of<'a>(
    states: &'a mut IngestStates,
    worker: WorkerId,
    model: &str,
    salt: &str,
    lanes: &[Lane],
    block: u32,
) -> &'a mut IngestState {
    let fresh = || IngestState {
        epoch: 0,
        model: model.to_string(),
        salt: salt.to_string(),
        translator: Translator::new(block, model, salt, lanes),
        lost: false,
    };
    let h = states.by_worker.entry(worker).or_insert_with(fresh);
    if h.model != model || h.salt != salt {
        let (epoch, lost) = (h.epoch, h.lost);
        *h = IngestState {
            epoch,
            lost,
            ..fresh()
        };
    }
    h
}

fn source_seed(model: &str, salt: &str, block: u32) -> u64 {
    kvix_wire::Keyspace {
        model: model.to_string(),
        lora: String::new(),
        salt: salt.to_string(),
        kind: ChunkKind::Tokens,
    }
    .seed(block)
}
