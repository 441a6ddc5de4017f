//! Placements: fire-and-forget through a bounded queue, sent by one task to the servers.
//! A server answers one only to refuse it: one refused for a moment (the replicas' log
//! away or full, the server overloaded) is sent again a few times, later; the rest are
//! counted ([`crate::CountersSnapshot::writes_refused`]).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvix_wire::{ErrorCode, Keyspace, Placement, FLAG_NO_REPLY};
use tokio::sync::mpsc;

use crate::counters::Counters;
use crate::shared::Shared;
use crate::types::WorkerRef;
use crate::Client;

#[derive(Clone)]
pub(crate) struct PlacementReq {
    pub(crate) worker: WorkerRef,
    pub(crate) keyspace: Keyspace,
    pub(crate) chain: Vec<u64>,
    /// Sends before this one that a server refused.
    pub(crate) retries: u32,
}

/// How many times a refused placement is sent again, and the first wait (doubling).
const RETRIES: u32 = 4;
const FIRST_RETRY: Duration = Duration::from_millis(250);
/// Placements kept for a retry: a refusal comes back within a round trip and a Redis
/// timeout (2 s), far fewer than this many placements later at any rate a gateway sends.
const KEPT: usize = 4096;

/// Placements sent lately (request id, what was sent), oldest first, and the ids they
/// are sent under: unique across the client's connections, and apart from the ids each
/// connection numbers its other requests with (a refused fire-and-forget retire must not
/// be taken for a placement).
pub(crate) struct Sent {
    recent: Mutex<VecDeque<(u64, PlacementReq)>>,
    next_id: AtomicU64,
}

/// Where placement ids start: connections number their requests from 1 and never reach it.
const FIRST_PLACEMENT_ID: u64 = 1 << 62;

impl Default for Sent {
    fn default() -> Self {
        Sent {
            recent: Mutex::default(),
            next_id: AtomicU64::new(FIRST_PLACEMENT_ID),
        }
    }
}

impl Sent {
    /// The id `msg` is sent under, kept for a retry while it may have one.
    fn keep(&self, worker: &WorkerRef, msg: &Placement, retries: u32) -> u64 {
        let id = self.next_id.fetch_add(1, Relaxed);
        if retries < RETRIES {
            let req = PlacementReq {
                worker: worker.clone(),
                keyspace: msg.keyspace.clone(),
                chain: msg.chain.clone(),
                retries,
            };
            let mut recent = self.recent.lock().unwrap_or_else(|p| p.into_inner());
            if recent.len() == KEPT {
                recent.pop_front();
            }
            recent.push_back((id, req));
        }
        id
    }

    /// An id in the same space for another fire-and-forget request (a reuse report)
    /// that is not kept for a retry.
    pub(crate) fn fresh_id(&self) -> u64 {
        self.next_id.fetch_add(1, Relaxed)
    }

    fn take(&self, id: u64) -> Option<PlacementReq> {
        let mut recent = self.recent.lock().unwrap_or_else(|p| p.into_inner());
        let at = recent.iter().position(|(i, _)| *i == id)?;
        recent.remove(at).map(|(_, req)| req)
    }
}

/// A server refused the fire-and-forget request `id`: a placement refused for a moment
/// is queued again after a wait.
pub(crate) fn refused(sh: &Arc<Shared>, id: u64, code: ErrorCode) {
    if !matches!(code, ErrorCode::LogUnavailable | ErrorCode::Overloaded) {
        return;
    }
    let Some(mut req) = sh.sent_placements.take(id) else {
        return;
    };
    let wait = FIRST_RETRY * 2u32.pow(req.retries);
    req.retries += 1;
    Counters::bump(&sh.counters.n.placements_retried);
    let placements = sh.placements.clone();
    tokio::spawn(async move {
        tokio::time::sleep(wait).await;
        let _ = placements.try_send(req);
    });
}

impl Client {
    /// Queues a placement (a request for `chain` was sent to `worker`) for every server
    /// that is up. Never blocks. Returns `false`, counted, when the placement is
    /// dropped: the queue is full (`placement_drops`), or `worker` is a name the
    /// primary server's roster, as this client last learnt it, does not hold
    /// (`unknown_workers`; the roster is asked for that name at once, so a worker
    /// announced a moment ago by another client is placed on the next try).
    pub fn publish_placement(
        &self,
        worker: impl Into<WorkerRef>,
        keyspace: &Keyspace,
        chain: Vec<u64>,
    ) -> bool {
        let worker = worker.into();
        if let (WorkerRef::Name(name), Some((slot, _))) = (&worker, self.shared.primary()) {
            if self.shared.id_on(slot, &worker).is_none() {
                Counters::bump(&self.shared.counters.n.unknown_workers);
                self.shared.want_name(name);
                return false;
            }
        }
        let req = PlacementReq {
            worker,
            keyspace: keyspace.clone(),
            chain,
            retries: 0,
        };
        match self.shared.placements.try_send(req) {
            Ok(()) => true,
            Err(_) => {
                Counters::bump(&self.shared.counters.n.placement_drops);
                false
            }
        }
    }
}

/// Sends queued placements to every server that is up, fire-and-forget.
pub(crate) async fn pump_placements(sh: Arc<Shared>, mut rx: mpsc::Receiver<PlacementReq>) {
    let mut shutdown = sh.shutdown.subscribe();
    loop {
        let req = tokio::select! {
            r = rx.recv() => match r { Some(r) => r, None => return },
            _ = shutdown.wait_for(|s| *s) => return,
        };
        let mut msg = Placement {
            worker: 0,
            keyspace: req.keyspace,
            chain: req.chain,
        };
        let mut sent = false;
        for (slot, conn) in sh.write_conns() {
            let Some(worker) = sh.id_on(slot, &req.worker) else {
                continue;
            };
            msg.worker = worker;
            let id = sh.sent_placements.keep(&req.worker, &msg, req.retries);
            if sh
                .send_request(&conn, id, &msg, FLAG_NO_REPLY, None)
                .is_ok()
            {
                Counters::bump(&sh.counters.n.placements_sent);
                sent = true;
            }
        }
        if !sent {
            Counters::bump(&sh.counters.n.placements_unsent);
        }
    }
}
