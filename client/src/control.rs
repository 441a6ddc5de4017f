//! Requests that change or read the servers' state: announces (remembered and repeated
//! on every reconnect), retires, stats, echo.

use std::sync::Arc;
use std::time::Instant;

use kvix_wire::{
    Announce, Body, Echo, ErrorCode, ErrorReply, Feed, Kind, Lane, Retire, Stats, StatsRequest,
    WorkerId, FLAG_NO_REPLY,
};

use crate::conn::Reply;
use crate::roster::Want;
use crate::types::WorkerRef;
use crate::wait::{wait_reply, Until, Waited};
use crate::{Client, ClientError};

impl Client {
    /// Announces a worker with its lane roster to every server, and remembers it: it is
    /// re-announced on every reconnect, before anything else. Returns the primary
    /// server's id for it.
    ///
    /// With no server up it waits (up to `request_timeout`) for one; the worker stays
    /// remembered even if that times out.
    pub async fn announce(
        &self,
        name: impl Into<String>,
        lanes: Vec<Lane>,
        feed: Feed,
    ) -> Result<WorkerId, ClientError> {
        self.announce_worker(Announce {
            name: name.into(),
            lanes,
            feed,
            source: None,
        })
        .await
    }

    /// [`Client::announce`] with every field of the message (an event source, say).
    pub async fn announce_worker(&self, announce: Announce) -> Result<WorkerId, ClientError> {
        let sh = &self.shared;
        let until = Instant::now() + sh.cfg.request_timeout;
        let name: Arc<str> = announce.name.as_str().into();
        let conns = {
            let mut reg = sh.registry.lock().map_err(|_| ClientError::Disconnected)?;
            match reg.iter_mut().find(|a| a.name == announce.name) {
                Some(a) => *a = announce.clone(),
                None => reg.push(announce.clone()),
            }
            sh.write_conns()
        };
        let conns = if conns.is_empty() {
            // A connection that comes up now announces it during its own setup.
            if !sh.wait_until_connected(until).await {
                return Err(ClientError::NotConnected);
            }
            if let Some(id) = self.worker_id(&name) {
                return Ok(id);
            }
            sh.write_conns()
        } else {
            conns
        };
        // Pipelined: every frame out, then every reply.
        let mut waits = Vec::new();
        for (slot, conn) in conns {
            let id = conn.next_id();
            let r = sh.send_request(&conn, id, &announce, 0, Some(Kind::Announced));
            waits.push((slot, conn, id, r));
        }
        let mut results = Vec::new();
        for (slot, conn, id, rx) in waits {
            results.push(match rx {
                Ok(Some(mut rx)) => match wait_reply(&mut rx, until, Until::Kept, None).await {
                    Waited::Reply(Reply::Announced(a)) => {
                        sh.adopt(slot, &conn, name.clone(), a.worker);
                        Ok(a.worker)
                    }
                    Waited::Reply(Reply::Error(e)) => Err(ClientError::Rejected(e)),
                    Waited::Reply(_) | Waited::Closed => Err(ClientError::Disconnected),
                    Waited::TimedOut => {
                        conn.forget(id);
                        Err(ClientError::Timeout)
                    }
                },
                Ok(None) => Err(ClientError::Disconnected),
                Err(e) => Err(e),
            });
        }
        // The first server (in order) that took it; else the first server's error.
        let res = match results.iter().position(|r| r.is_ok()) {
            Some(i) => results.swap_remove(i),
            None if !results.is_empty() => results.swap_remove(0),
            None => Err(ClientError::NotConnected),
        };
        if let Err(ClientError::Rejected(e)) = &res {
            if !matches!(e.code, ErrorCode::Overloaded | ErrorCode::Internal) {
                // Refused for what it is: do not re-announce it forever.
                if let Ok(mut reg) = sh.registry.lock() {
                    reg.retain(|a| a.name != announce.name);
                }
            }
        }
        res
    }

    /// Retires a worker on every server and stops re-announcing it. Returns once the
    /// primary server acknowledged it.
    pub async fn retire(&self, worker: impl Into<WorkerRef>) -> Result<(), ClientError> {
        let sh = &self.shared;
        let worker = worker.into();
        let until = Instant::now() + sh.cfg.request_timeout;
        if let (WorkerRef::Name(n), Some((p, _))) = (&worker, sh.primary()) {
            if sh.id_on(p, &worker).is_none() {
                // Announced by another client (a controller retiring an engine).
                let names = [n.clone()];
                sh.learn(p, Want::Names(&names), Instant::now(), until)
                    .await;
            }
        }
        let name = sh.name_of(&worker);
        let conns = {
            let mut reg = sh.registry.lock().map_err(|_| ClientError::Disconnected)?;
            if let Some(n) = &name {
                reg.retain(|a| *a.name != **n);
            }
            sh.write_conns()
        };
        let Some(&(primary, _)) = conns.first() else {
            return Err(ClientError::NotConnected);
        };
        let mut wait = None;
        for (slot, conn) in conns {
            let Some(id) = sh.id_on(slot, &worker) else {
                continue;
            };
            if let Some(n) = &name {
                if let Ok(mut m) = sh.slots[slot].ids.lock() {
                    m.remove(n);
                }
            }
            let rid = conn.next_id();
            if slot == primary {
                let rx = sh.send_request(&conn, rid, &Retire { worker: id }, 0, Some(Kind::Ack))?;
                wait = rx.map(|rx| (conn, rid, rx));
            } else {
                let _ = sh.send_request(&conn, rid, &Retire { worker: id }, FLAG_NO_REPLY, None);
            }
        }
        let Some((conn, rid, mut rx)) = wait else {
            return Err(ClientError::Rejected(ErrorReply {
                code: ErrorCode::UnknownWorker,
                message: format!("worker {worker} is not announced on the server"),
            }));
        };
        match wait_reply(&mut rx, until, Until::Kept, None).await {
            Waited::Reply(Reply::Ack) => Ok(()),
            Waited::Reply(Reply::Error(e)) => Err(ClientError::Rejected(e)),
            Waited::Reply(_) | Waited::Closed => Err(ClientError::Disconnected),
            Waited::TimedOut => {
                conn.forget(rid);
                Err(ClientError::Timeout)
            }
        }
    }

    /// The primary server's counters.
    pub async fn stats(&self) -> Result<Stats, ClientError> {
        match self.control(&StatsRequest {}, Kind::Stats).await? {
            Reply::Stats(s) => Ok(s),
            _ => Err(ClientError::Disconnected),
        }
    }

    /// Sends `payload` and gets `reply_len` bytes back: the transport's latency floor.
    /// Waits like a query does (spin option included), up to `request_timeout`.
    pub async fn echo(&self, payload: Vec<u8>, reply_len: u32) -> Result<Vec<u8>, ClientError> {
        match self
            .control(&Echo { payload, reply_len }, Kind::Echo)
            .await?
        {
            Reply::Echo(p) => Ok(p),
            _ => Err(ClientError::Disconnected),
        }
    }

    async fn control<M: Body>(&self, msg: &M, want: Kind) -> Result<Reply, ClientError> {
        let sh = &self.shared;
        let until = Instant::now() + sh.cfg.request_timeout;
        let (_, conn) = sh.primary().ok_or(ClientError::NotConnected)?;
        match sh.call(&conn, msg, want, until).await? {
            Waited::Reply(Reply::Error(e)) => Err(ClientError::Rejected(e)),
            Waited::Reply(r) => Ok(r),
            Waited::Closed => Err(ClientError::Disconnected),
            Waited::TimedOut => Err(ClientError::Timeout),
        }
    }
}
