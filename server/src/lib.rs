//! kvix-server: the shared prefix-cache index as a thread-per-core service.
//!
//! Data path, top to bottom: [`listener`] (sockets, [`steering`]) → [`conn`] (frames)
//! → [`handler`] (messages) → [`executor`] (this core's copy of the engine) →
//! `kvix_engine` → the answer frame back through [`conn`]. A query never leaves the
//! executor that read it; every write ([`write::Write`], whoever sent it) takes
//! [`write::route_write`] to its worker's home write queue ([`write`]), which publishes it to
//! every executor over the [`mesh`].

pub mod admit;
pub mod auth;
pub mod check;
pub mod checkpoint;
pub mod clock;
pub mod config;
pub mod conn;
pub mod durable;
pub mod error;
pub mod executor;
pub mod exposition;
pub mod failure;
pub mod handler;
pub mod http;
pub mod http_api;
pub mod ingest;
pub mod latch;
pub mod lifecycle;
pub mod listener;
pub mod loud;
pub mod mesh;
pub mod metrics;
pub mod query;
pub mod reuse;
pub mod rlimit;
pub mod steering;
pub mod tls;
pub mod write;

pub use config::Config;
pub use lifecycle::{run, run_with};
