//! The calls one executor makes on another, one file each, each with its own request
//! and reply types (see [`crate::mesh::Call`]).
//!
//! Writes go to the worker's home: [`events`], [`place`]; names and ids to executor 0:
//! [`register`] (which then [`install`]s the worker on its home) and [`retire`] (which
//! then has the home [`forget`] it). A home's update reaches the others as [`apply`].
//! [`stats`] and [`export`] gather every executor's part; [`lasts`] and [`redeliver`]
//! serve the restore (where streams left off, ingest deliveries read back from the
//! write-ahead log); [`drain`] waits for every accepted write to be applied everywhere
//! (a clean stop).

pub mod apply;
pub mod drain;
pub mod events;
pub mod export;
pub mod forget;
pub mod install;
pub mod lasts;
pub mod place;
pub mod redeliver;
pub mod register;
pub mod retire;
pub mod stats;

use futures::channel::oneshot;

use crate::failure::Failure;
use crate::mesh::LocalFuture;

/// Waits for a reply a write job sends; a dropped sender (the queue closed while the
/// process stops) is an Internal failure.
fn reply<T: 'static>(rx: oneshot::Receiver<Result<T, Failure>>) -> LocalFuture<Result<T, Failure>> {
    Box::pin(async move {
        rx.await.unwrap_or_else(|_| {
            Err(Failure::new(
                kvix_wire::ErrorCode::Internal,
                "the server is stopping",
            ))
        })
    })
}
