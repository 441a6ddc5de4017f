//! Placements: fire-and-forget through a bounded queue, sent by one task to the servers.

use std::sync::Arc;

use kvix_wire::{Keyspace, Placement, FLAG_NO_REPLY};
use tokio::sync::mpsc;

use crate::counters::Counters;
use crate::shared::Shared;
use crate::types::WorkerRef;
use crate::Client;

pub(crate) struct PlacementReq {
    pub(crate) worker: WorkerRef,
    pub(crate) keyspace: Keyspace,
    pub(crate) chain: Vec<u64>,
}

impl Client {
    /// Queues a placement (a request for `chain` was sent to `worker`) for every server
    /// that is up. Never blocks: when the queue is full the placement is dropped and
    /// counted, and `false` is returned.
    pub fn publish_placement(
        &self,
        worker: impl Into<WorkerRef>,
        keyspace: &Keyspace,
        chain: Vec<u64>,
    ) -> bool {
        let req = PlacementReq {
            worker: worker.into(),
            keyspace: keyspace.clone(),
            chain,
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
            let id = conn.next_id();
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
