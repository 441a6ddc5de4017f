//! What every handle and background task of one client shares: a slot per server (its
//! connection and the ids it gave), the workers announced, the counters.

use std::collections::HashMap;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvix_wire::{encode, Announce, Body, Kind, WorkerId, FLAG_NO_REPLY};
use tokio::sync::{mpsc, oneshot, watch, Notify};

use crate::conn::{Conn, Reply};
use crate::counters::Counters;
use crate::placements::PlacementReq;
use crate::roster::RosterSync;
use crate::types::WorkerRef;
use crate::wait::{wait_reply, Until, Waited};
use crate::{Addr, ClientConfig, ClientError};

#[derive(Default, Clone)]
pub(crate) struct IdMap {
    pub(crate) by_name: HashMap<Arc<str>, WorkerId>,
    pub(crate) by_id: HashMap<WorkerId, Arc<str>>,
    /// The server's count of ids given again (`Roster::reissued`) these names were
    /// learnt under: under another count an id may name another worker.
    pub(crate) reissued: u32,
}

impl IdMap {
    /// Records `name → id`, forgetting the id `name` held before and the name `id`
    /// stood for before (an id given again).
    pub(crate) fn insert(&mut self, name: Arc<str>, id: WorkerId) {
        if let Some(old) = self.by_name.insert(name.clone(), id) {
            self.by_id.remove(&old);
        }
        if let Some(prev) = self.by_id.insert(id, name.clone()) {
            if prev != name {
                self.by_name.remove(&prev);
            }
        }
    }

    pub(crate) fn remove(&mut self, name: &str) {
        if let Some(id) = self.by_name.remove(name) {
            self.by_id.remove(&id);
        }
    }
}

pub(crate) struct Slot {
    pub(crate) addr: Addr,
    pub(crate) conn: Mutex<Option<Arc<Conn>>>,
    pub(crate) ids: Mutex<IdMap>,
    pub(crate) tried: AtomicBool,
    /// Why the last attempt was refused, when it needs an operator (handshake, TLS).
    pub(crate) refusal: Mutex<Option<ClientError>>,
    /// How far this server's roster was learnt ([`crate::roster`]).
    pub(crate) roster: tokio::sync::Mutex<RosterSync>,
}

impl Slot {
    pub(crate) fn live(&self) -> Option<Arc<Conn>> {
        let c = self.conn.lock().ok()?.clone()?;
        (!c.is_closed()).then_some(c)
    }
}

pub(crate) struct Shared {
    pub(crate) cfg: ClientConfig,
    /// `cfg.tls` made ready.
    pub(crate) tls: Option<crate::tls::Tls>,
    pub(crate) slots: Vec<Slot>,
    /// Every worker this client announced and has not retired, in announce order.
    pub(crate) registry: Mutex<Vec<Announce>>,
    pub(crate) counters: Arc<Counters>,
    pub(crate) placements: mpsc::Sender<PlacementReq>,
    pub(crate) reuse: mpsc::Sender<crate::reuse::ReuseSample>,
    /// Placements sent lately, by request id, for a retry should a server refuse one.
    pub(crate) sent_placements: crate::placements::Sent,
    /// Names a placement was refused for (not in the roster learnt): the servers'
    /// supervisors ask for them at once (`names_wanted`), and then drop them.
    pub(crate) unresolved: Mutex<Vec<Arc<str>>>,
    pub(crate) names_wanted: Notify,
    /// Bumped whenever a connection comes up or goes, or a first attempt ends.
    pub(crate) changed: watch::Sender<u64>,
    pub(crate) shutdown: watch::Sender<bool>,
}

/// Signals shutdown when the last [`Client`] handle goes.
pub(crate) struct Guard(pub(crate) Arc<Shared>);

impl Drop for Guard {
    fn drop(&mut self) {
        self.0.shutdown.send_replace(true);
        for s in &self.0.slots {
            if let Some(c) = s.live() {
                c.close();
            }
        }
    }
}

impl Shared {
    /// The first server, in configured order, that is up.
    pub(crate) fn primary(&self) -> Option<(usize, Arc<Conn>)> {
        self.slots
            .iter()
            .enumerate()
            .find_map(|(i, s)| s.live().map(|c| (i, c)))
    }

    /// The servers a write goes to: the primary alone where the servers are replicas of
    /// one log, else every server up.
    pub(crate) fn write_conns(&self) -> Vec<(usize, Arc<Conn>)> {
        if self.cfg.replicas {
            self.primary().into_iter().collect()
        } else {
            self.live_conns()
        }
    }

    pub(crate) fn live_conns(&self) -> Vec<(usize, Arc<Conn>)> {
        self.slots
            .iter()
            .enumerate()
            .filter_map(|(i, s)| s.live().map(|c| (i, c)))
            .collect()
    }

    pub(crate) async fn wait_connected(&self, timeout: Duration) -> bool {
        self.wait_until_connected(Instant::now() + timeout).await
    }

    pub(crate) async fn wait_until_connected(&self, until: Instant) -> bool {
        let mut rx = self.changed.subscribe();
        let ok = tokio::time::timeout_at(
            until.into(),
            rx.wait_for(|_| self.slots.iter().any(|s| s.live().is_some())),
        )
        .await;
        matches!(ok, Ok(Ok(_)))
    }

    pub(crate) fn name_of(&self, w: &WorkerRef) -> Option<Arc<str>> {
        match w {
            WorkerRef::Name(n) => Some(n.clone()),
            WorkerRef::Id(id) => {
                let (p, _) = self.primary()?;
                self.slots[p].ids.lock().ok()?.by_id.get(id).cloned()
            }
        }
    }

    /// The ids `workers` have on server `slot` (those it does not know left out): a
    /// query's candidates as that server numbers them.
    pub(crate) fn ids_on(&self, slot: usize, workers: &[WorkerRef]) -> Vec<WorkerId> {
        workers.iter().filter_map(|w| self.id_on(slot, w)).collect()
    }

    /// The id `w` has on server `slot`: names are looked up there; ids are the primary's,
    /// translated through the worker's name for the other servers.
    pub(crate) fn id_on(&self, slot: usize, w: &WorkerRef) -> Option<WorkerId> {
        match w {
            WorkerRef::Name(n) => self.slots[slot].ids.lock().ok()?.by_name.get(n).copied(),
            WorkerRef::Id(id) => {
                // Replicas of one log number workers alike.
                if self.cfg.replicas || self.primary().map(|(p, _)| p) == Some(slot) {
                    return Some(*id);
                }
                let name = self.name_of(w)?;
                self.slots[slot]
                    .ids
                    .lock()
                    .ok()?
                    .by_name
                    .get(&name)
                    .copied()
            }
        }
    }

    /// The names among `workers` that server `slot` has no id for in this client.
    pub(crate) fn unresolved(&self, slot: usize, workers: &[WorkerRef]) -> Vec<Arc<str>> {
        let Ok(ids) = self.slots[slot].ids.lock() else {
            return Vec::new();
        };
        workers
            .iter()
            .filter_map(|w| match w {
                WorkerRef::Name(n) if !ids.by_name.contains_key(n) => Some(n.clone()),
                _ => None,
            })
            .collect()
    }

    /// Records `name → id` for server `slot`, if `conn` is still its connection.
    pub(crate) fn adopt(&self, slot: usize, conn: &Arc<Conn>, name: Arc<str>, id: WorkerId) {
        let mut one = IdMap {
            reissued: self.slots[slot].ids.lock().map_or(0, |m| m.reissued),
            ..IdMap::default()
        };
        one.insert(name, id);
        self.adopt_all(slot, conn, one);
    }

    /// Records every `name → id` of `learnt` for server `slot`, if `conn` is still its
    /// connection (ids learnt on a lost connection may not be the next one's). A map
    /// learnt under another `reissued` count is the whole roster: it replaces the old.
    pub(crate) fn adopt_all(&self, slot: usize, conn: &Arc<Conn>, learnt: IdMap) {
        let s = &self.slots[slot];
        let current = s.conn.lock().ok().and_then(|c| c.clone());
        if current.is_some_and(|c| Arc::ptr_eq(&c, conn)) {
            if let Ok(mut m) = s.ids.lock() {
                if learnt.reissued != m.reissued {
                    *m = learnt;
                    return;
                }
                for (name, id) in learnt.by_name {
                    m.insert(name, id);
                }
            }
        }
    }

    /// Encodes and writes one request; registers a waiter when `want` is given.
    pub(crate) fn send_request<M: Body>(
        &self,
        conn: &Conn,
        id: u64,
        msg: &M,
        flags: u8,
        want: Option<Kind>,
    ) -> Result<Option<oneshot::Receiver<Reply>>, ClientError> {
        // The server answers a fire-and-forget write only to refuse it: the id's top bit
        // tells that refusal from a reply that came after its request timed out.
        let id = if flags & FLAG_NO_REPLY != 0 {
            id | crate::conn::QUIET_ID
        } else {
            id
        };
        let frame = encode(msg, id, flags).map_err(|e| ClientError::Encode(e.to_string()))?;
        if frame.len() > conn.max_frame() as usize {
            return Err(ClientError::Encode(format!(
                "{} frame of {} bytes exceeds the server's limit of {}",
                M::KIND.name(),
                frame.len(),
                conn.max_frame()
            )));
        }
        let rx = want.map(|k| conn.register(id, k)).transpose()?;
        if let Err(e) = conn.send(&frame) {
            conn.forget(id);
            return Err(e);
        }
        Ok(rx)
    }

    /// One request, waited for until `until` with the configured spin.
    pub(crate) async fn call<M: Body>(
        &self,
        conn: &Conn,
        msg: &M,
        want: Kind,
        until: Instant,
    ) -> Result<Waited, ClientError> {
        let id = conn.next_id();
        let Some(mut rx) = self.send_request(conn, id, msg, 0, Some(want))? else {
            return Err(ClientError::Disconnected);
        };
        let w = wait_reply(&mut rx, until, Until::Kept, self.cfg.spin_before_park).await;
        if matches!(w, Waited::TimedOut) {
            conn.forget(id);
        }
        Ok(w)
    }

    pub(crate) fn bump_changed(&self) {
        self.changed.send_modify(|v| *v += 1);
    }
}
