//! kvix-client: what an LLM gateway links to ask a kvix-server which worker already
//! holds the longest reusable prefix of a prompt, inside a deadline.
//!
//! - [`Client`] (async, tokio): one multiplexed, pipelined connection per configured
//!   server, kept up in the background with exponential backoff. Queries go to the
//!   first server that is up; announces and placements go to every server that is up.
//! - Queries never fail and never wait past the deadline: they answer a
//!   [`QueryOutcome`], where everything but `Scores` means "route without the index"
//!   (fail open). No connection up → `Disconnected` at once. A query whose connection
//!   is lost before the answer goes to the next server up while time is left.
//! - Workers the client announced are re-announced on every (re)connect before anything
//!   else is sent on that connection, and the id ↔ name map is refreshed from the
//!   replies (a restarted server may number workers differently).
//! - Placements are fire-and-forget through a bounded queue: full → dropped and counted.
//! - [`Client::counters`]: outcomes, a latency histogram, drops, reconnects, malformed
//!   replies.
//! - [`pick`]: the load-aware choice among workers from an answer (reuse against
//!   load, like Dynamo's and SGLang's routers), returning the expected hit.
//! - [`blocking::BlockingClient`]: the same for plain threads; it owns a one-thread
//!   tokio runtime that does the I/O.
//!
//! Worker ids are per server: [`Client::announce`] returns the primary server's id and
//! answers name the answering server's ids, each with the worker's name, whichever
//! client announced it: the client learns every server's roster (at connect, every
//! second, and at once when an answer or the caller names a worker it has not seen).
//! So a gateway need not announce the workers it routes to; a controller or the
//! engines' agents do. Name workers by name ([`WorkerRef::Name`]) in candidates and
//! placements; the client translates. A placement for a name no server announced is
//! refused at once (`publish_placement` returns false, counted as `unknown_workers`).
//!
//! Everything about the protocol (frames, messages, chain hashing, keyspaces, lanes)
//! comes from [`kvix_wire`], re-exported here as [`wire`].
//!
//! ```no_run
//! # async fn demo() -> Result<(), kvix_client::ClientError> {
//! use kvix_client::{Client, ClientConfig, QueryOptions, QueryOutcome};
//! use kvix_client::wire::{Feed, Keyspace, Lane};
//!
//! let client = Client::connect(ClientConfig::default()).await?;
//! client.announce("worker-0", vec![Lane::full(16)], Feed::Events).await?;
//! let ks = Keyspace::tokens("llama-3-8b");
//! let tokens: Vec<u32> = (0..64).collect();
//! match client.query_tokens(&ks, &tokens, &QueryOptions::default()).await {
//!     QueryOutcome::Scores(s) => println!("best: {:?}", s[0]),
//!     other => println!("route without the index: {}", other.kind()),
//! }
//! # Ok(()) }
//! ```

#![deny(missing_docs)]

mod client;
mod config;
mod conn;
mod control;
mod counters;
mod error;
mod placements;
mod reuse;
pub use reuse::ReuseSample;
mod query;
mod roster;
mod shared;
mod supervisor;
mod tls;
mod types;
mod wait;

pub mod blocking;
pub mod pick;

pub use client::Client;
pub use config::{Addr, ClientConfig};
pub use counters::CountersSnapshot;
pub use error::ClientError;
pub use pick::{pick, Picked, DEFAULT_ALPHA};
pub use tls::ClientTls;
pub use types::{Prompt, QueryOptions, QueryOutcome, WorkerRef, WorkerScore};

/// The histogram type of [`CountersSnapshot::latency_ns`].
pub use hdrhistogram;
/// The protocol crate, for message, keyspace and lane types.
pub use kvix_wire as wire;
/// Worker ids as the server assigns them.
pub use kvix_wire::{Depths, SuspectCause, TierWeights, WorkerId};
