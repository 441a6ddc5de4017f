//! Reuse reports: after a routed request completes, what its engine says it reused
//! (`usage.prompt_tokens_details.cached_tokens`) against what the answer predicted. One
//! task sends them to the primary server in batches, fire-and-forget: never on a
//! query's path, no prompt text. The server turns them into verdicts (a worker whose
//! events are missing or late, a gateway whose token ids are not the engine's) that
//! answers then flag ([`crate::WorkerScore::suspect`]).

use std::sync::Arc;

use kvix_wire::{Reuse, ReuseReport, FLAG_NO_REPLY};
use tokio::sync::mpsc;

use crate::counters::Counters;
use crate::shared::Shared;
use crate::types::WorkerRef;
use crate::Client;

/// One routed request's reuse, as the gateway saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReuseSample {
    /// The worker the request went to.
    pub worker: WorkerRef,
    /// The keyspace's model.
    pub model: String,
    /// The reuse the answer predicted for that worker, in tokens (blocks × the token
    /// block); None when the worker was not in the answer (chosen for other reasons).
    pub predicted_tokens: Option<u32>,
    /// What the engine says it reused; None when the response carried no figure (the
    /// engine does not report it, or a stream without `include_usage`): no report, never
    /// taken as 0.
    pub cached_tokens: Option<u32>,
    /// The prompt's length in tokens.
    pub prompt_tokens: u32,
}

/// Most reports in one frame.
const BATCH: usize = 256;

impl Client {
    /// Queues a reuse report for the primary server. Never blocks. Returns `false`,
    /// counted, when nothing is queued: the engine gave no figure (`reuse_unreported`),
    /// or the queue is full (`reuse_drops`).
    pub fn report_reuse(&self, sample: ReuseSample) -> bool {
        let counters = &self.shared.counters.n;
        if sample.cached_tokens.is_none() {
            Counters::bump(&counters.reuse_unreported);
            return false;
        }
        match self.shared.reuse.try_send(sample) {
            Ok(()) => true,
            Err(_) => {
                Counters::bump(&counters.reuse_drops);
                false
            }
        }
    }
}

/// Sends queued reports to the primary server, up to [`BATCH`] a frame.
pub(crate) async fn pump_reuse(sh: Arc<Shared>, mut rx: mpsc::Receiver<ReuseSample>) {
    let mut shutdown = sh.shutdown.subscribe();
    let mut batch = Vec::with_capacity(BATCH);
    loop {
        let first = tokio::select! {
            r = rx.recv() => match r { Some(r) => r, None => return },
            _ = shutdown.wait_for(|s| *s) => return,
        };
        batch.clear();
        batch.push(first);
        while batch.len() < BATCH {
            match rx.try_recv() {
                Ok(s) => batch.push(s),
                Err(_) => break,
            }
        }
        send(&sh, &batch);
    }
}

fn send(sh: &Shared, batch: &[ReuseSample]) {
    let n = &sh.counters.n;
    let Some((slot, conn)) = sh.primary() else {
        Counters::add(&n.reuse_unsent, batch.len() as u64);
        return;
    };
    let reports: Vec<Reuse> = batch
        .iter()
        .filter_map(|s| {
            let Some(worker) = sh.id_on(slot, &s.worker) else {
                Counters::bump(&n.unknown_workers);
                return None;
            };
            Some(Reuse {
                worker,
                model: s.model.clone(),
                predicted_tokens: s.predicted_tokens,
                cached_tokens: s.cached_tokens?,
                prompt_tokens: s.prompt_tokens,
            })
        })
        .collect();
    if reports.is_empty() {
        return;
    }
    let count = reports.len() as u64;
    let id = sh.sent_placements.fresh_id();
    let msg = ReuseReport { reports };
    match sh.send_request(&conn, id, &msg, FLAG_NO_REPLY, None) {
        Ok(_) => Counters::add(&n.reuse_reports_sent, count),
        Err(_) => Counters::add(&n.reuse_unsent, count),
    }
}
