//! kvix-bench: the benchmark CLI of kvix, as a library so its parts are tested.
//!
//! - [`sim`]: routing simulation, shared index vs per-gateway guesses,
//! - [`fleet`]: the same claim end to end: mock engines and gateways on the wire around a
//!   real kvix-server,
//! - [`trace`] + [`replay`]: the Mooncake trace, its chain mapping, replay,
//! - [`lru`]: the mock worker's LRU prefix cache, the cache-aware pick (`kvix_client::pick`),
//! - [`latency`], [`load`], [`redis`], [`soak`], [`huge`]: against a running kvix-server
//!   (and Redis, or [`echo_server`], the floor in a process of its own),
//!   over [`net`] (worker-side wire connection, preloaded dataset) and [`resp`],
//! - [`workload`]: the sessions and engines of `sim` and `fleet`,
//! - [`stats`], [`table`], [`rng`]: reporting and determinism helpers.

pub mod echo_server;
pub mod fleet;
pub mod http_latency;
pub mod huge;
pub mod latency;
pub mod load;
pub mod lru;
pub mod metrics;
pub mod net;
pub mod redis;
pub mod replay;
pub mod resp;
pub mod rng;
pub mod sim;
pub mod soak;
pub mod stats;
pub mod table;
pub mod trace;
pub mod workload;
pub mod writes;
