//! The async client: its handle, connecting, and what it can tell about itself. Queries
//! are in `query.rs`, announces and the other requests in `control.rs`, placements in
//! `placements.rs`, keeping connections up in `supervisor.rs`.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvix_wire::chain::{byte_chain, token_chain};
use kvix_wire::{Announce, ChunkKind, Keyspace, WorkerId, BYTE_CHUNK};
use tokio::sync::{mpsc, watch};

use crate::counters::{Counters, CountersSnapshot};
use crate::placements::pump_placements;
use crate::shared::{Guard, IdMap, Shared, Slot};
use crate::supervisor::supervise;
use crate::{Addr, ClientConfig, ClientError, Prompt};

/// A kvix client: one multiplexed connection per configured server, kept up in the
/// background. Cheap to clone; the connections close when the last clone is dropped.
///
/// Made with [`Client::connect`] inside a tokio runtime (its tasks run there); for
/// plain threads use [`crate::blocking::BlockingClient`].
#[derive(Clone)]
pub struct Client {
    pub(crate) shared: Arc<Shared>,
    _guard: Arc<Guard>,
}

impl Client {
    /// Starts the client and waits (up to `connect_timeout`) for the first connection
    /// attempt to every server, or for the first server to come up.
    ///
    /// Returns `Ok` when a server is up, and also when none could be reached: the client
    /// then fails queries open (`Disconnected`) and keeps reconnecting with backoff.
    /// Errs on a bad configuration, or when no server is up and one refused the
    /// handshake (wrong block size, bad auth) or failed TLS: that needs an operator, not
    /// a retry.
    pub async fn connect(config: ClientConfig) -> Result<Client, ClientError> {
        config.validate()?;
        let (ptx, prx) = mpsc::channel(config.placement_queue);
        let (rtx, rrx) = mpsc::channel(config.placement_queue);
        let slots = config
            .servers
            .iter()
            .map(|a| Slot {
                addr: a.clone(),
                conn: Mutex::new(None),
                ids: Mutex::new(IdMap::default()),
                tried: AtomicBool::new(false),
                refusal: Mutex::new(None),
                roster: Default::default(),
            })
            .collect();
        let tls = config.tls.as_ref().map(crate::tls::Tls::new).transpose()?;
        let shared = Arc::new(Shared {
            tls,
            cfg: config,
            slots,
            registry: Mutex::new(Vec::new()),
            counters: Arc::new(Counters::new()),
            placements: ptx,
            reuse: rtx,
            sent_placements: Default::default(),
            unresolved: Mutex::default(),
            names_wanted: Default::default(),
            changed: watch::channel(0).0,
            shutdown: watch::channel(false).0,
        });
        for i in 0..shared.slots.len() {
            tokio::spawn(supervise(shared.clone(), i));
        }
        tokio::spawn(pump_placements(shared.clone(), prx));
        tokio::spawn(crate::reuse::pump_reuse(shared.clone(), rrx));
        let client = Client {
            _guard: Arc::new(Guard(shared.clone())),
            shared,
        };
        let wait = client.shared.cfg.connect_timeout + Duration::from_millis(100);
        let mut rx = client.shared.changed.subscribe();
        let sh = &client.shared;
        let _ = tokio::time::timeout(
            wait,
            rx.wait_for(|_| {
                sh.slots[0].live().is_some()
                    || sh.slots.iter().all(|s| s.tried.load(Ordering::Acquire))
            }),
        )
        .await;
        if client.is_connected() {
            return Ok(client);
        }
        for s in &sh.slots {
            if let Some(refused) = s.refusal.lock().ok().and_then(|r| r.clone()) {
                return Err(refused);
            }
        }
        Ok(client)
    }

    /// The configuration the client runs with.
    pub fn config(&self) -> &ClientConfig {
        &self.shared.cfg
    }

    /// Whether some server connection is up now.
    pub fn is_connected(&self) -> bool {
        self.shared.slots.iter().any(|s| s.live().is_some())
    }

    /// The address of the server queries go to now (the first one up).
    pub fn primary(&self) -> Option<Addr> {
        self.shared
            .primary()
            .map(|(i, _)| self.shared.slots[i].addr.clone())
    }

    /// Waits until some server is up (workers re-announced), at most `timeout`.
    /// Returns whether one is.
    pub async fn wait_connected(&self, timeout: Duration) -> bool {
        self.shared.wait_connected(timeout).await
    }

    /// Waits until the server at `addr` is up, at most `timeout`; false when it is not
    /// one of the configured servers or did not come up in time.
    pub async fn wait_server(&self, addr: &Addr, timeout: Duration) -> bool {
        let Some(slot) = self.shared.slots.iter().find(|s| &s.addr == addr) else {
            return false;
        };
        let mut rx = self.shared.changed.subscribe();
        let r = tokio::time::timeout(timeout, rx.wait_for(|_| slot.live().is_some())).await;
        matches!(r, Ok(Ok(_)))
    }

    /// The id the primary server gave the worker `name`.
    pub fn worker_id(&self, name: &str) -> Option<WorkerId> {
        let (i, _) = self.shared.primary()?;
        self.shared.slots[i]
            .ids
            .lock()
            .ok()?
            .by_name
            .get(name)
            .copied()
    }

    /// The name of the primary server's worker `id`, if this client announced it or
    /// learnt it from the server's roster (fetched at connect, every second, and when
    /// an answer names an id this client cannot name).
    pub fn worker_name(&self, id: WorkerId) -> Option<Arc<str>> {
        let (i, _) = self.shared.primary()?;
        self.shared.slots[i]
            .ids
            .lock()
            .ok()?
            .by_id
            .get(&id)
            .cloned()
    }

    /// The workers this client announced and will re-announce on every reconnect.
    pub fn announced(&self) -> Vec<Announce> {
        self.shared
            .registry
            .lock()
            .map(|r| r.clone())
            .unwrap_or_default()
    }

    /// A snapshot of the counters.
    pub fn counters(&self) -> CountersSnapshot {
        self.shared.counters.snapshot()
    }

    /// Clears the latency histogram (the other counters are monotonic).
    pub fn reset_latency(&self) {
        self.shared.counters.reset_latency();
    }

    /// The keyspace a prompt is hashed in and its chain, as queries and placements use
    /// them: the keyspace's kind is the prompt's (tokens or bytes); a chain the caller
    /// hashed keeps the keyspace as given.
    pub fn prompt_chain(&self, keyspace: &Keyspace, prompt: Prompt<'_>) -> (Keyspace, Vec<u64>) {
        let block = self.shared.cfg.token_block;
        let mut ks = keyspace.clone();
        let chain = match prompt {
            Prompt::Tokens(t) => {
                ks.kind = ChunkKind::Tokens;
                token_chain(ks.seed(block), block, t)
            }
            Prompt::Bytes(b) => {
                ks.kind = ChunkKind::Bytes;
                byte_chain(ks.seed(block), BYTE_CHUNK, b)
            }
            Prompt::Chain(c) => c.to_vec(),
        };
        (ks, chain)
    }

    /// The chain of a token prompt in `keyspace` (its kind taken as tokens), as queries
    /// and placements use it.
    pub fn token_chain(&self, keyspace: &Keyspace, tokens: &[u32]) -> Vec<u64> {
        self.prompt_chain(keyspace, Prompt::Tokens(tokens)).1
    }

    /// The chain of a string prompt in `keyspace` (its kind taken as bytes).
    pub fn byte_chain(&self, keyspace: &Keyspace, bytes: &[u8]) -> Vec<u64> {
        self.prompt_chain(keyspace, Prompt::Bytes(bytes)).1
    }
}
