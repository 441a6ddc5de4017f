//! Keeping each server connected: connect, handshake, re-announce, publish the
//! connection, wait for its loss, back off, again.

use std::collections::HashSet;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use kvix_wire::{
    encode, Announce, ErrorCode, ErrorReply, Hello, Kind, Retire, BYTE_CHUNK, FLAG_NO_REPLY,
};

use crate::conn::{dial, Conn, FrameReader, Reply};
use crate::counters::Counters;
use crate::roster::Want;
use crate::shared::{IdMap, Shared};
use crate::{Addr, ClientError};

/// Keeps server `idx` connected: connect, handshake, re-announce, publish, wait for the
/// loss, back off exponentially, again; until the client is dropped.
pub(crate) async fn supervise(sh: Arc<Shared>, idx: usize) {
    let mut shutdown = sh.shutdown.subscribe();
    let mut backoff = sh.cfg.reconnect_min;
    let mut had_conn = false;
    let slot = &sh.slots[idx];
    loop {
        if *shutdown.borrow() {
            return;
        }
        let attempt = tokio::select! {
            r = tokio::time::timeout(sh.cfg.connect_timeout, establish(&sh, idx)) => r,
            _ = shutdown.wait_for(|s| *s) => return,
        };
        match attempt {
            Ok(Ok(conn)) => {
                Counters::bump(&sh.counters.n.connects);
                if had_conn {
                    Counters::bump(&sh.counters.n.reconnects);
                }
                had_conn = true;
                backoff = sh.cfg.reconnect_min;
                if let Ok(mut r) = slot.refusal.lock() {
                    *r = None;
                }
                slot.tried.store(true, Ordering::Release);
                sh.bump_changed();
                tracing::info!(server = %slot.addr, "connected");
                // Connected: learn the roster's news until the connection goes.
                loop {
                    tokio::select! {
                        _ = conn.closed() => break,
                        _ = shutdown.wait_for(|s| *s) => { conn.close(); return; }
                        _ = tokio::time::sleep(crate::roster::POLL) => {}
                        _ = sh.names_wanted.notified() => {}
                    }
                    // Names a placement missed are asked for by name: one retired and
                    // announced again has an id below where the listing goes on.
                    let names = sh.unresolved.lock().map(|u| u.clone()).unwrap_or_default();
                    let until = Instant::now() + sh.cfg.request_timeout;
                    let want = if names.is_empty() {
                        Want::New
                    } else {
                        Want::Names(&names)
                    };
                    sh.learn(idx, want, Instant::now(), until).await;
                    sh.resolved(idx);
                }
                if let Ok(mut c) = slot.conn.lock() {
                    if c.as_ref().is_some_and(|c| Arc::ptr_eq(c, &conn)) {
                        *c = None;
                    }
                }
                Counters::bump(&sh.counters.n.connection_losses);
                tracing::warn!(server = %slot.addr, "connection lost; reconnecting");
            }
            Ok(Err(refused @ (ClientError::Refused { .. } | ClientError::Tls { .. }))) => {
                Counters::bump(&sh.counters.n.handshake_refusals);
                tracing::warn!(server = %slot.addr, "{refused}");
                if let Ok(mut r) = slot.refusal.lock() {
                    *r = Some(refused);
                }
            }
            Ok(Err(e)) => {
                Counters::bump(&sh.counters.n.connect_failures);
                tracing::debug!(server = %slot.addr, "connect failed: {e}");
            }
            Err(_) => {
                Counters::bump(&sh.counters.n.connect_failures);
                tracing::debug!(server = %slot.addr, "connect timed out");
            }
        }
        slot.tried.store(true, Ordering::Release);
        sh.bump_changed();
        tokio::select! {
            _ = tokio::time::sleep(backoff) => {}
            _ = shutdown.wait_for(|s| *s) => return,
        }
        backoff = (backoff * 2).min(sh.cfg.reconnect_max);
    }
}

/// Closes a connection that did not make it through setup.
pub(crate) struct CloseUnlessKept(Option<Arc<Conn>>);

impl Drop for CloseUnlessKept {
    fn drop(&mut self) {
        if let Some(c) = self.0.take() {
            c.close();
        }
    }
}

/// Connect, Hello → Welcome, re-announce every registered worker (pipelined, before any
/// other frame), then publish the connection with the fresh id map.
pub(crate) async fn establish(sh: &Arc<Shared>, idx: usize) -> Result<Arc<Conn>, ClientError> {
    let slot = &sh.slots[idx];
    let (rd, wr) = dial(&slot.addr, sh.tls.as_ref())
        .await
        .map_err(|e| crate::tls::setup_error(&slot.addr, e))?;
    let conn = Conn::new(slot.addr.clone(), wr);
    let mut guard = CloseUnlessKept(Some(conn.clone()));
    tokio::spawn(conn.clone().write_loop());
    let hello = Hello {
        client: sh.cfg.name.clone(),
        token_block: sh.cfg.token_block,
        auth: sh.cfg.auth.clone(),
    };
    let frame = encode(&hello, 0, 0).map_err(|e| ClientError::Encode(e.to_string()))?;
    conn.send(&frame)?;
    let mut reader = FrameReader::new(rd, sh.cfg.max_frame);
    let welcome = handshake(&mut reader, sh, &slot.addr).await?;
    if welcome.token_block != sh.cfg.token_block {
        return Err(ClientError::Refused {
            addr: slot.addr.clone(),
            reply: ErrorReply {
                code: ErrorCode::BlockSizeMismatch,
                message: format!(
                    "server hashes {}-token blocks, this client {}",
                    welcome.token_block, sh.cfg.token_block
                ),
            },
        });
    }
    if welcome.byte_chunk != BYTE_CHUNK {
        return Err(ClientError::Protocol(format!(
            "server cuts {}-byte chunks, this client {BYTE_CHUNK}",
            welcome.byte_chunk
        )));
    }
    conn.set_max_frame(welcome.max_frame);
    let weak = Arc::downgrade(sh);
    let refused = Arc::new(move |id: u64, code: ErrorCode| {
        if let Some(sh) = weak.upgrade() {
            crate::placements::refused(&sh, id, code);
        }
    });
    tokio::spawn(conn.clone().read_loop(reader, sh.counters.clone(), refused));

    // Every worker any client announced, so that answers and the caller's names
    // resolve from the first query.
    let mut ids = IdMap::default();
    let until = Instant::now() + sh.cfg.connect_timeout;
    let next = crate::roster::fetch(sh, &conn, 0, &[], until, &mut ids).await?;
    sh.start_roster(idx, next).await;
    let mut done: HashSet<String> = HashSet::new();
    loop {
        let todo: Vec<Announce> = {
            let reg = sh.registry.lock().map_err(|_| ClientError::Disconnected)?;
            let todo: Vec<Announce> = reg
                .iter()
                .filter(|a| !done.contains(&a.name))
                .cloned()
                .collect();
            if todo.is_empty() {
                // Publish under the registry lock: an announce that registers after
                // this sees the connection and sends on it itself.
                let live: HashSet<&str> = reg.iter().map(|a| a.name.as_str()).collect();
                for gone in done.iter().filter(|n| !live.contains(n.as_str())) {
                    if let Some(&worker) = ids.by_name.get(gone.as_str()) {
                        let id = conn.next_id();
                        let _ = sh.send_request(&conn, id, &Retire { worker }, FLAG_NO_REPLY, None);
                    }
                    ids.remove(gone);
                }
                if let Ok(mut m) = slot.ids.lock() {
                    *m = ids;
                }
                if let Ok(mut c) = slot.conn.lock() {
                    *c = Some(conn.clone());
                }
                guard.0 = None;
                return Ok(conn);
            }
            todo
        };
        let mut waits = Vec::with_capacity(todo.len());
        for a in &todo {
            let id = conn.next_id();
            let rx = sh.send_request(&conn, id, a, 0, Some(Kind::Announced))?;
            waits.push((a.name.clone(), rx));
        }
        for (name, rx) in waits {
            let Some(rx) = rx else { continue };
            match rx.await {
                Ok(Reply::Announced(a)) => ids.insert(name.as_str().into(), a.worker),
                Ok(Reply::Error(e)) => {
                    tracing::warn!(server = %slot.addr, worker = %name, code = ?e.code,
                        "re-announce refused: {}", e.message);
                }
                Ok(_) | Err(_) => return Err(ClientError::Disconnected),
            }
            done.insert(name);
        }
    }
}

pub(crate) async fn handshake(
    reader: &mut FrameReader,
    sh: &Shared,
    addr: &Addr,
) -> Result<kvix_wire::Welcome, ClientError> {
    use crate::conn::ReadError;
    let malformed = |m: String| {
        Counters::bump(&sh.counters.n.malformed_replies);
        ClientError::Protocol(m)
    };
    match reader.ready().await {
        Ok(()) => {}
        Err(ReadError::Eof) => return Err(ClientError::Disconnected),
        Err(ReadError::Io(e)) => return Err(crate::tls::setup_error(addr, e)),
        Err(ReadError::Malformed(m)) => return Err(malformed(m)),
    }
    let frame = reader.frame().ok_or_else(|| malformed("no frame".into()))?;
    let len = frame.len;
    let msg = frame.message().map_err(|e| malformed(e.to_string()))?;
    let out = match msg {
        kvix_wire::MessageRef::Welcome(w) => Ok(kvix_wire::to_native::<kvix_wire::Welcome>(w)),
        kvix_wire::MessageRef::ErrorReply(e) => Err(ClientError::Refused {
            addr: addr.clone(),
            reply: kvix_wire::to_native::<ErrorReply>(e),
        }),
        other => Err(malformed(format!(
            "{} frame in answer to Hello",
            other.kind().name()
        ))),
    };
    reader.consume(len);
    out
}
