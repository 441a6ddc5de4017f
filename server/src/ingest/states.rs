//! The ingest state a worker's home executor keeps: the translator of each event-source
//! worker homed there, and the last batch applied from its stream (in [`Lasts`], which
//! the ingest's side reads too). It lives next to the worker's feed and changes in the
//! same write-queue job, so a snapshot taken through that queue has the two in step.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use kvix_wire::{Lane, WorkerId};
use rkyv::{Archive, Deserialize, Serialize};

use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering::Relaxed;

use super::METRICS;
use kvix_events::stream::LastBatch;
use kvix_events::translate::{Translator, TranslatorImage};

/// One worker's ingest state, as plain data.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct IngestStateImage {
    /// The newest ingest-lease epoch applied (replicas).
    pub epoch: u64,
    pub model: String,
    pub salt: String,
    pub last: Option<LastBatch>,
    pub translator: TranslatorImage,
    /// See [`IngestState::lost`].
    pub lost: bool,
}

pub(super) struct IngestState {
    pub(super) epoch: u64,
    pub(super) model: String,
    pub(super) salt: String,
    pub(super) translator: Translator,
    /// The worker's history is lost: batches of its engine's current process went by
    /// unapplied (a gap past the replay buffer, a late join onto a buffer that no longer
    /// reaches its first batch, a gap without replay, a batch that did not decode), so
    /// the engine may hold blocks this index will not report until it evicts and
    /// stores them again. A clear, or a process replayed from its first batch, ends it.
    pub(super) lost: bool,
}

/// Which workers' history is lost, for every executor's answers to read (a query on any
/// executor flags them; the decision is the home's [`IngestState::lost`], and only the
/// home of a worker changes its bit). Also keeps `kvix_ingest_workers_history_lost`.
pub struct LostWorkers {
    bits: [AtomicU64; kvix_engine::MAX_WORKERS as usize / 64],
}

/// The process's lost workers (its executors share one roster of ids).
pub static LOST: LostWorkers = LostWorkers {
    bits: [const { AtomicU64::new(0) }; kvix_engine::MAX_WORKERS as usize / 64],
};

impl LostWorkers {
    /// Marks `worker` lost or whole; the gauge counts the change, if any.
    pub(super) fn set(&self, worker: WorkerId, lost: bool) {
        let Some(word) = self.bits.get(worker as usize / 64) else {
            return;
        };
        let bit = 1u64 << (worker % 64);
        let before = match lost {
            true => word.fetch_or(bit, Relaxed),
            false => word.fetch_and(!bit, Relaxed),
        };
        match (before & bit != 0, lost) {
            (false, true) => METRICS.history_lost.fetch_add(1, Relaxed),
            (true, false) => METRICS.history_lost.fetch_sub(1, Relaxed),
            _ => 0,
        };
    }

    /// Whether some worker's history is lost (a query then looks its scores up).
    pub fn any(&self) -> bool {
        METRICS.history_lost.load(Relaxed) > 0
    }

    pub fn contains(&self, worker: WorkerId) -> bool {
        self.bits
            .get(worker as usize / 64)
            .is_some_and(|w| w.load(Relaxed) >> (worker % 64) & 1 == 1)
    }
}

/// The last batch applied from each worker's stream: where the stream resumes after a
/// restart, under a new lease holder, after a rewind, or from a new source for blocks
/// the worker still holds. One record per stream: only the worker's home writes it (in
/// the write-queue job that applies the delivery); the ingest's side reads it.
#[derive(Debug, Default)]
pub struct Lasts {
    by_worker: Mutex<HashMap<WorkerId, LastBatch>>,
}

impl Lasts {
    pub fn get(&self, worker: WorkerId) -> Option<LastBatch> {
        self.by_worker
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&worker)
            .copied()
    }

    /// Home: the stream's last batch is now `last` (None: it starts afresh).
    pub(super) fn set(&self, worker: WorkerId, last: Option<LastBatch>) {
        let mut by_worker = self.by_worker.lock().unwrap_or_else(|p| p.into_inner());
        match last {
            Some(l) => by_worker.insert(worker, l),
            None => by_worker.remove(&worker),
        };
    }
}

/// The ingest state of the workers homed on one executor.
pub struct IngestStates {
    pub(super) by_worker: HashMap<WorkerId, IngestState>,
    pub(super) lasts: Arc<Lasts>,
}

impl IngestStates {
    /// States that keep each stream's last batch in `lasts` (the process's one record).
    pub fn new(lasts: Arc<Lasts>) -> Self {
        IngestStates {
            by_worker: HashMap::new(),
            lasts,
        }
    }

    /// Forgets a worker (retired, or announced again with another roster or source).
    pub fn forget(&mut self, worker: WorkerId) {
        self.by_worker.remove(&worker);
        self.lasts.set(worker, None);
        LOST.set(worker, false);
    }

    /// Forgets every worker (the executor's state is being replaced).
    pub fn clear(&mut self) {
        let workers: Vec<WorkerId> = self.by_worker.keys().copied().collect();
        for w in workers {
            self.forget(w);
        }
    }

    pub fn export(&self) -> Vec<(WorkerId, IngestStateImage)> {
        let mut out: Vec<_> = self
            .by_worker
            .iter()
            .map(|(w, h)| {
                (
                    *w,
                    IngestStateImage {
                        epoch: h.epoch,
                        model: h.model.clone(),
                        salt: h.salt.clone(),
                        last: self.lasts.get(*w),
                        translator: h.translator.export(),
                        lost: h.lost,
                    },
                )
            })
            .collect();
        out.sort_unstable_by_key(|(w, _)| *w);
        out
    }

    /// Restores a worker's state; false when it does not fit the worker's lanes.
    pub fn import(
        &mut self,
        worker: WorkerId,
        image: &IngestStateImage,
        lanes: &[Lane],
        block: u32,
    ) -> bool {
        let mut translator = Translator::new(block, &image.model, &image.salt, lanes);
        if !translator.import(&image.translator) {
            return false;
        }
        self.by_worker.insert(
            worker,
            IngestState {
                epoch: image.epoch,
                model: image.model.clone(),
                salt: image.salt.clone(),
                translator,
                lost: image.lost,
            },
        );
        self.lasts.set(worker, image.last);
        LOST.set(worker, image.lost);
        true
    }
}

mod delivery;

pub use delivery::{Begun, Dropped};
