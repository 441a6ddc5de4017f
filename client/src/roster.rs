//! Learning the names of workers other clients announced. Answers name workers by id
//! and a gateway usually announces nothing (a controller or the engines do), so each
//! server's roster is fetched at connect, again every [`POLL`] while connected (from
//! where the last fetch ended), and at once when a query meets an id or a name this
//! client cannot resolve. An id keeps its name until the server gives it to another
//! (only once all its ids were given): every answer and roster page carries the
//! server's count of such reissues, and a client that learnt its names under another
//! count lists the roster again from 0 before it names an id. A server restarted
//! without its state may number anew: the next connection learns from 0.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvix_wire::{Kind, RosterEntry, RosterRequest, WorkerId};

use crate::conn::{Conn, Reply};
use crate::shared::{IdMap, Shared};
use crate::wait::Waited;
use crate::ClientError;

/// How often a connected client asks for workers announced since its last fetch.
pub(crate) const POLL: Duration = Duration::from_secs(1);
/// A name nobody announced may be asked for on every query: once the server said it
/// does not know a name, that name is asked for again at most this often.
const NAME_GAP: Duration = Duration::from_millis(50);
/// Names remembered as unknown, at most (past it the memory starts over).
const MAX_MISSED: usize = 4096;
/// Names asked for in one request, at most.
const MAX_NAMES: usize = 256;

/// Per server: where the id-ordered listing continues, and when the last fetch began.
#[derive(Default)]
pub(crate) struct RosterSync {
    next: WorkerId,
    began: Option<Instant>,
    /// Names the server did not know when last asked, and when.
    missed: HashMap<Arc<str>, Instant>,
}

/// What a fetch is for.
pub(crate) enum Want<'a> {
    /// Workers announced since the last fetch.
    New,
    /// An answer scored ids this client cannot name, the lowest of them given (it may
    /// be an id given before the last fetch, retired then and announced again).
    Ids(WorkerId),
    /// Names this client cannot resolve.
    Names(&'a [Arc<str>]),
    /// An answer came under this `reissued` count, not the one the names were learnt
    /// under: the whole roster, listed again.
    Reissued(u32),
}

/// Fetches `names` and what follows from `from` on `conn`, page by page, into `ids`.
/// Where the server's `reissued` count is not `ids.reissued` (an id was given to
/// another name since those names were learnt) and the listing did not start at 0,
/// it starts again from 0 into an emptied `ids`, which then holds the whole roster
/// under the new count. Returns where the id-ordered listing ended.
pub(crate) async fn fetch(
    sh: &Shared,
    conn: &Conn,
    mut from: WorkerId,
    names: &[Arc<str>],
    until: Instant,
    ids: &mut IdMap,
) -> Result<WorkerId, ClientError> {
    let mut names: Vec<String> = names
        .iter()
        .take(MAX_NAMES)
        .map(|n| n.to_string())
        .collect();
    let asked = names.clone();
    loop {
        let req = RosterRequest {
            from,
            names: std::mem::take(&mut names),
        };
        let roster = match sh.call(conn, &req, Kind::Roster, until).await? {
            Waited::Reply(Reply::Roster(r)) => r,
            Waited::Reply(Reply::Error(e)) => return Err(ClientError::Rejected(e)),
            Waited::Reply(_) | Waited::Closed => return Err(ClientError::Disconnected),
            Waited::TimedOut => return Err(ClientError::Timeout),
        };
        if roster.reissued != ids.reissued {
            // What was learnt (here or before) may name an id's old worker.
            *ids = IdMap {
                reissued: roster.reissued,
                ..IdMap::default()
            };
            if req.from != 0 {
                (from, names) = (0, asked.clone());
                continue;
            }
        }
        for RosterEntry { worker, name } in roster.workers {
            ids.insert(name.into(), worker);
        }
        if !roster.more || roster.next <= from {
            return Ok(roster.next);
        }
        from = roster.next;
    }
}

impl Shared {
    /// Fetches what `want` needs from server `slot` by `until`: not new workers or ids
    /// when a listing began since `noticed` (what it learnt is already there), not a
    /// name the server said it did not know less than [`NAME_GAP`] ago. Returns whether
    /// the map may have changed; false when nothing was asked or the fetch failed.
    pub(crate) async fn learn(
        &self,
        slot: usize,
        want: Want<'_>,
        noticed: Instant,
        until: Instant,
    ) -> bool {
        let s = &self.slots[slot];
        let Some(conn) = s.live() else { return false };
        let Ok(mut sync) = tokio::time::timeout_at(until.into(), s.roster.lock()).await else {
            return false;
        };
        // A listing that began since the caller looked covers new workers and ids (not
        // names: it may not have asked for them).
        let listed = sync.began.is_some_and(|b| b >= noticed);
        let now = Instant::now();
        let known = s.ids.lock().map_or(0, |m| m.reissued);
        let (from, names) = match want {
            Want::Reissued(n) if n == known => return true,
            Want::Reissued(_) => (0, Vec::new()),
            Want::New | Want::Ids(_) if listed => return true,
            Want::New => (sync.next, Vec::new()),
            Want::Ids(id) => (sync.next.min(id), Vec::new()),
            Want::Names(n) => {
                let fresh: Vec<Arc<str>> = n
                    .iter()
                    .filter(|n| sync.missed.get(*n).is_none_or(|at| now >= *at + NAME_GAP))
                    .cloned()
                    .collect();
                if fresh.is_empty() {
                    return false;
                }
                (sync.next, fresh)
            }
        };
        sync.began = Some(now);
        let mut learnt = IdMap {
            reissued: known,
            ..IdMap::default()
        };
        match fetch(self, &conn, from, &names, until, &mut learnt).await {
            Ok(next) => {
                sync.next = sync.next.max(next);
                if sync.missed.len() + names.len() > MAX_MISSED {
                    sync.missed.clear();
                }
                for n in names {
                    if learnt.by_name.contains_key(&n) {
                        sync.missed.remove(&n);
                    } else {
                        sync.missed.insert(n, now);
                    }
                }
                if learnt.by_id.is_empty() && learnt.reissued == known {
                    return false;
                }
                self.adopt_all(slot, &conn, learnt);
                true
            }
            Err(e) => {
                tracing::debug!(server = %s.addr, "roster fetch failed: {e}");
                false
            }
        }
    }

    /// Forgets the wanted names server `slot` now resolves.
    pub(crate) fn resolved(&self, slot: usize) {
        let Ok(ids) = self.slots[slot].ids.lock() else {
            return;
        };
        if let Ok(mut u) = self.unresolved.lock() {
            u.retain(|n| !ids.by_name.contains_key(n));
        }
    }

    /// Asks the supervisors to look `name` up at once.
    pub(crate) fn want_name(&self, name: &Arc<str>) {
        if let Ok(mut u) = self.unresolved.lock() {
            if u.len() < MAX_NAMES && !u.contains(name) {
                u.push(name.clone());
            }
        }
        self.names_wanted.notify_waiters();
    }

    /// A fresh connection's roster, fetched whole: where its listing continues.
    pub(crate) async fn start_roster(&self, slot: usize, next: WorkerId) {
        let mut sync = self.slots[slot].roster.lock().await;
        *sync = RosterSync {
            next,
            began: Some(Instant::now()),
            missed: HashMap::new(),
        };
    }
}
