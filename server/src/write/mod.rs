//! Every write: the one route it takes, whoever sent it, and the write queue of the
//! executor that orders it.
//!
//! A client's frame (the protocol handler), the write-ahead log's replay, the replicated
//! log's follower and the engine-event ingest all hand a [`Write`] ([`record`]) to
//! [`route_write`] ([`route`]). With replicas (`--log`), an accepted write goes to the
//! shared log first and takes the route again when the follower reads it back
//! ([`inbox`]). Announces and retires go to executor 0, which numbers workers
//! ([`roster`]) and has the worker's home install or forget it; every other write goes
//! to its worker's home (`worker % executors`), queued there in the order this executor
//! sent it ([`queue`]), where its feed step ([`feed`]) turns it into an update the queue
//! publishes to every executor and applies in slices. The write is answered once every
//! executor applied it.

pub mod apply;
pub mod feed;
pub mod inbox;
pub mod job;
pub mod queue;
pub mod record;
pub mod roster;
pub mod route;

pub use record::{FrameBytes, Outcome, Write};
pub use route::{route_write, Origin};
