//! A client for plain (non-async) threads.
//!
//! [`BlockingClient`] owns a small tokio runtime with one worker thread
//! (`kvix-client-io`) that runs the connections: reading replies, reconnecting,
//! re-announcing, sending placements. A call blocks the calling thread on that runtime
//! until its reply or deadline; with `spin_before_park` set the calling thread spins on
//! the reply first, so an answer that comes quickly costs no second thread wake-up.
//!
//! Do not call it from inside an async runtime (use [`crate::Client`] there).

use std::time::Duration;

use kvix_wire::{Announce, Feed, Keyspace, Lane, Stats, WorkerId};
use tokio::runtime::Runtime;

use crate::{
    Client, ClientConfig, ClientError, CountersSnapshot, Prompt, QueryOptions, QueryOutcome,
    WorkerRef,
};

/// A blocking [`Client`]: same behaviour, plain method calls.
pub struct BlockingClient {
    // Dropped first, then the runtime (see Drop).
    client: Option<Client>,
    rt: Option<Runtime>,
}

impl BlockingClient {
    /// Starts the I/O thread and connects; see [`Client::connect`].
    pub fn connect(config: ClientConfig) -> Result<Self, ClientError> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("kvix-client-io")
            .enable_all()
            .build()?;
        let client = rt.block_on(Client::connect(config))?;
        Ok(BlockingClient {
            client: Some(client),
            rt: Some(rt),
        })
    }

    fn on<T>(&self, f: impl std::future::Future<Output = T>) -> T {
        self.rt
            .as_ref()
            .expect("runtime lives until drop")
            .block_on(f)
    }

    /// The async client behind this one (for use from tasks on other runtimes too).
    pub fn client(&self) -> &Client {
        self.client.as_ref().expect("client lives until drop")
    }

    /// See [`Client::is_connected`].
    pub fn is_connected(&self) -> bool {
        self.client().is_connected()
    }

    /// See [`Client::wait_connected`].
    pub fn wait_connected(&self, timeout: Duration) -> bool {
        self.on(self.client().wait_connected(timeout))
    }

    /// See [`Client::query`].
    pub fn query(
        &self,
        keyspace: &Keyspace,
        prompt: Prompt<'_>,
        opts: &QueryOptions,
    ) -> QueryOutcome {
        self.on(self.client().query(keyspace, prompt, opts))
    }

    /// See [`Client::query_tokens`].
    pub fn query_tokens(
        &self,
        keyspace: &Keyspace,
        tokens: &[u32],
        opts: &QueryOptions,
    ) -> QueryOutcome {
        self.query(keyspace, Prompt::Tokens(tokens), opts)
    }

    /// See [`Client::query_bytes`].
    pub fn query_bytes(
        &self,
        keyspace: &Keyspace,
        prompt: impl AsRef<[u8]>,
        opts: &QueryOptions,
    ) -> QueryOutcome {
        self.query(keyspace, Prompt::Bytes(prompt.as_ref()), opts)
    }

    /// See [`Client::query_chain`].
    pub fn query_chain(
        &self,
        keyspace: &Keyspace,
        chain: &[u64],
        opts: &QueryOptions,
    ) -> QueryOutcome {
        self.query(keyspace, Prompt::Chain(chain), opts)
    }

    /// See [`Client::announce`].
    pub fn announce(
        &self,
        name: impl Into<String>,
        lanes: Vec<Lane>,
        feed: Feed,
    ) -> Result<WorkerId, ClientError> {
        self.on(self.client().announce(name, lanes, feed))
    }

    /// See [`Client::announce_worker`].
    pub fn announce_worker(&self, announce: Announce) -> Result<WorkerId, ClientError> {
        self.on(self.client().announce_worker(announce))
    }

    /// See [`Client::retire`].
    pub fn retire(&self, worker: impl Into<WorkerRef>) -> Result<(), ClientError> {
        self.on(self.client().retire(worker))
    }

    /// See [`Client::publish_placement`]; never blocks.
    pub fn publish_placement(
        &self,
        worker: impl Into<WorkerRef>,
        keyspace: &Keyspace,
        chain: Vec<u64>,
    ) -> bool {
        self.client().publish_placement(worker, keyspace, chain)
    }

    /// See [`Client::report_reuse`].
    pub fn report_reuse(&self, sample: crate::ReuseSample) -> bool {
        self.client().report_reuse(sample)
    }

    /// See [`Client::stats`].
    pub fn stats(&self) -> Result<Stats, ClientError> {
        self.on(self.client().stats())
    }

    /// See [`Client::echo`].
    pub fn echo(&self, payload: Vec<u8>, reply_len: u32) -> Result<Vec<u8>, ClientError> {
        self.on(self.client().echo(payload, reply_len))
    }

    /// See [`Client::counters`].
    pub fn counters(&self) -> CountersSnapshot {
        self.client().counters()
    }

    /// See [`Client::worker_id`].
    pub fn worker_id(&self, name: &str) -> Option<WorkerId> {
        self.client().worker_id(name)
    }

    /// See [`Client::token_chain`].
    pub fn token_chain(&self, keyspace: &Keyspace, tokens: &[u32]) -> Vec<u64> {
        self.client().token_chain(keyspace, tokens)
    }

    /// See [`Client::byte_chain`].
    pub fn byte_chain(&self, keyspace: &Keyspace, bytes: &[u8]) -> Vec<u64> {
        self.client().byte_chain(keyspace, bytes)
    }
}

impl Drop for BlockingClient {
    fn drop(&mut self) {
        drop(self.client.take());
        if let Some(rt) = self.rt.take() {
            rt.shutdown_background();
        }
    }
}
