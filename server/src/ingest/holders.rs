//! The ingest state a worker's home executor keeps: the translator of each event-source
//! worker homed there, and the last batch applied from its stream. It lives next to the
//! worker's feed and changes in the same write-queue job, so a snapshot taken through
//! that queue has the two in step.

use std::collections::HashMap;
use std::sync::Arc;

use kvix_engine::{Ks, Update};
use kvix_wire::{ChunkKind, Event, Lane, WorkerId};
use rkyv::{Archive, Deserialize, Serialize};

use super::stream::Record;
use super::translate::{Counts, Group, Translator, TranslatorImage};
use super::{IngestJob, SourceSpec, METRICS};
use crate::executor::Executor;

/// One worker's ingest state, as plain data.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct HolderImage {
    /// The newest ingest-lease epoch applied (replicas).
    pub epoch: u64,
    pub model: String,
    pub salt: String,
    pub last: Option<Record>,
    pub translator: TranslatorImage,
}

struct Holder {
    epoch: u64,
    model: String,
    salt: String,
    last: Option<Record>,
    translator: Translator,
}

/// The ingest state of the workers homed on one executor.
#[derive(Default)]
pub struct Holders {
    by_worker: HashMap<WorkerId, Holder>,
}

impl Holders {
    /// The last batch applied from each worker's stream.
    pub fn lasts(&self) -> Vec<(WorkerId, Option<Record>)> {
        self.by_worker.iter().map(|(w, h)| (*w, h.last)).collect()
    }

    /// Forgets a worker (retired, or announced again with another roster or source).
    pub fn forget(&mut self, worker: WorkerId) {
        self.by_worker.remove(&worker);
    }

    pub fn export(&self) -> Vec<(WorkerId, HolderImage)> {
        let mut out: Vec<_> = self
            .by_worker
            .iter()
            .map(|(w, h)| {
                (
                    *w,
                    HolderImage {
                        epoch: h.epoch,
                        model: h.model.clone(),
                        salt: h.salt.clone(),
                        last: h.last,
                        translator: h.translator.export(),
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
        image: &HolderImage,
        lanes: &[Lane],
        block: u32,
    ) -> bool {
        let mut translator = Translator::new(block, &image.model, &image.salt, lanes);
        if !translator.import(&image.translator) {
            return false;
        }
        self.by_worker.insert(
            worker,
            Holder {
                epoch: image.epoch,
                model: image.model.clone(),
                salt: image.salt.clone(),
                last: image.last,
                translator,
            },
        );
        true
    }
}

/// The write-ahead log's record of a delivery.
pub fn record(job: &IngestJob) -> crate::wal::Record {
    crate::wal::Record::Ingest {
        worker: job.worker,
        epoch: job.epoch,
        model: job.source.model.clone(),
        salt: job.source.salt.clone(),
        reset: job.delivery.reset,
        last: job.delivery.record,
        payload: job.delivery.payload.clone(),
    }
}

/// The delivery a write-ahead log record holds (its batch decoded again).
pub fn from_record(r: crate::wal::Record) -> Option<IngestJob> {
    let crate::wal::Record::Ingest {
        worker,
        epoch,
        model,
        salt,
        reset,
        last,
        payload,
    } = r
    else {
        return None;
    };
    Some(IngestJob {
        worker,
        epoch,
        source: Arc::new(SourceSpec {
            endpoint: String::new(),
            replay: String::new(),
            model,
            salt,
        }),
        delivery: super::stream::Delivery {
            reset,
            record: last,
            batch: payload
                .as_deref()
                .and_then(|p| super::payload::decode(p).ok()),
            payload,
        },
    })
}

/// Applies one delivery on the worker's home, appending the block operations to `u`.
pub fn apply(ex: &Executor, job: IngestJob, u: &mut Update) {
    let IngestJob {
        worker,
        epoch,
        source,
        delivery,
    } = job;
    let block = ex.config().block_size;
    let Some(lanes) = lanes_of(ex, worker) else {
        // Retired (or re-announced without events) while the delivery was on its way.
        METRICS
            .orphaned
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        return;
    };
    let mut holders = ex.holders();
    let h = holder(&mut holders, worker, &source, &lanes, block);
    if epoch < h.epoch {
        // Read under a lease that has passed to another replica since.
        METRICS
            .fenced
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        return;
    }
    h.epoch = epoch;
    let mut core = ex.core();
    if delivery.reset {
        h.translator.reset();
        let ks = Ks {
            seed: source_seed(&source, block),
            kind: ChunkKind::Tokens,
        };
        if let Err(e) = core.ingest(worker, ks, &[Event::Cleared], u) {
            tracing::error!(worker, "ingest: clearing the worker failed: {e}");
        }
    }
    if let Some(batch) = &delivery.batch {
        let (mut groups, mut counts) = (Vec::<Group>::new(), Counts::default());
        h.translator.apply(batch, &mut groups, &mut counts);
        for g in &groups {
            let ks = Ks {
                seed: h.translator.seed(g.ks),
                kind: ChunkKind::Tokens,
            };
            match core.ingest(worker, ks, &g.events, u) {
                Ok(report) => {
                    METRICS.block_events(report.block_events);
                    let unprobed = &ex.metrics().unprobed_removals;
                    crate::metrics::ExecutorMetrics::add(unprobed, report.unprobed);
                }
                Err(e) => {
                    METRICS
                        .refused
                        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    tracing::warn!(worker, "ingest: the feed refused a translated batch: {e}");
                }
            }
        }
        METRICS.record(&counts);
    }
    h.last = delivery.record;
    ex.ingest().note_last(worker, h.last);
}

fn lanes_of(ex: &Executor, worker: WorkerId) -> Option<Vec<Lane>> {
    let core = ex.core();
    let entry = core.roster().get(worker)?;
    (entry.feed == kvix_wire::Feed::Events).then(|| entry.lanes.clone())
}

/// The worker's state, made new when it has none or its source's keyspace changed.
fn holder<'a>(
    holders: &'a mut Holders,
    worker: WorkerId,
    source: &Arc<SourceSpec>,
    lanes: &[Lane],
    block: u32,
) -> &'a mut Holder {
    let fresh = || Holder {
        epoch: 0,
        model: source.model.clone(),
        salt: source.salt.clone(),
        last: None,
        translator: Translator::new(block, &source.model, &source.salt, lanes),
    };
    let h = holders.by_worker.entry(worker).or_insert_with(fresh);
    if h.model != source.model || h.salt != source.salt {
        *h = fresh();
    }
    h
}

fn source_seed(source: &SourceSpec, block: u32) -> u64 {
    kvix_wire::Keyspace {
        model: source.model.clone(),
        lora: String::new(),
        salt: source.salt.clone(),
        kind: ChunkKind::Tokens,
    }
    .seed(block)
}
