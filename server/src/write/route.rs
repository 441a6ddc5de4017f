//! The one route every write takes, whoever sent it ([`route_write`]): to the
//! replicas' shared log when it is accepted with `--log`, else to the executor that
//! orders it: announces and retires to executor 0 ([`super::roster`]), every other
//! write to its worker's home write queue ([`super::queue`]).

use std::rc::Rc;

use super::record::{Outcome, Write};
use super::roster::{announce, check_source, retire};
use crate::durable::replica::appender::Appender;
use crate::executor::Executor;
use crate::failure::Failure;
use crate::mesh::LocalFuture;

/// Where a write comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Origin {
    /// Accepted now: a client's frame or an engine delivery. With replicas it goes to the
    /// shared log, and is applied here when the follower reads it back.
    Accepted,
    /// Read back from a log (the write-ahead log's replay, the replicas' shared log): its
    /// event source was checked where it was accepted and is not checked again (a check
    /// that came out otherwise here, a resolver failing or another `--source-allow`,
    /// would refuse what the log's other readers registered and put every later worker
    /// id out of step).
    Logged,
}

/// Sends `write` on its way: to the replicas' shared log, or to the executor that
/// orders it. The future answers once this server applied it everywhere.
pub fn route_write(
    ex: &Rc<Executor>,
    write: Write,
    origin: Origin,
) -> LocalFuture<Result<Outcome, Failure>> {
    match (origin, ex.log_appender()) {
        (Origin::Accepted, Some(log)) => to_log(ex, log.clone(), write),
        _ => to_executor(ex, write, origin == Origin::Logged),
    }
}

/// Replicas: the write is appended to the shared log now, in the order the connection
/// sent it; an announce's source is checked first, before the log takes it (every
/// replica then registers what the log holds, and a client waits for an announce's
/// reply before writing for its worker).
fn to_log(ex: &Rc<Executor>, log: Appender, write: Write) -> LocalFuture<Result<Outcome, Failure>> {
    let stopping = || Err(Failure::Stopping);
    if let Write::Announce {
        name,
        feed,
        source: Some(source),
        ..
    } = &write
    {
        // On executor 0, whose registry knows the name (a worker replacing its own
        // source is not one more).
        let (name, feed, source) = (name.clone(), *feed, source.clone());
        let check = ex.on(0, move |ex0| check_source(ex0, &name, feed, Some(&source)));
        return Box::pin(async move {
            check.await?;
            log.submit(&write).await.unwrap_or_else(|_| stopping())
        });
    }
    let applied = log.submit(&write);
    Box::pin(async move { applied.await.unwrap_or_else(|_| stopping()) })
}

/// The write, queued on the executor that orders it (announces and retires on executor 0,
/// the rest on the worker's home) before this returns.
fn to_executor(
    ex: &Rc<Executor>,
    mut write: Write,
    checked: bool,
) -> LocalFuture<Result<Outcome, Failure>> {
    match (write.home_worker(), &write) {
        (Ok(Some(worker)), _) => ex.on(ex.home_of(worker), move |home| home.queue_home(write)),
        (Ok(None), Write::Retire { worker }) => {
            let worker = *worker;
            ex.on(0, move |ex0| {
                let ex0 = ex0.clone();
                Box::pin(async move { retire(&ex0, worker).await.map(|()| Outcome::Done) })
            })
        }
        (Ok(None), _) => ex.on(0, move |ex0| {
            let ex0 = ex0.clone();
            Box::pin(async move {
                let announced = announce(&ex0, write, checked).await;
                announced.map(Outcome::Announced)
            })
        }),
        (Err(source), _) => {
            let f = Failure::Invalid {
                what: "a write that does not validate",
                source,
            };
            Box::pin(std::future::ready(Err(f)))
        }
    }
}
