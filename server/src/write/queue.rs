//! The write queue of each executor: one task runs its write jobs one after another
//! ([`run`]): a write of a worker homed here (its feed step, [`super::feed`]), an update
//! another executor published ([`super::apply`]), or a job of its own (expire, flush,
//! export), each answered once every executor applied what it published.

use std::rc::Rc;

use glommio::channels::local_channel::LocalReceiver;
use kvix_engine::Update;
use kvix_wire::WorkerId;

use super::apply::{apply_here, publish, slice_done, SLICE_BLOCKS};
use super::feed::home_write;
use super::job::{answer, Queued, Written};
use crate::durable::snapshot::Part;
use crate::executor::Executor;
use crate::failure::Failure;

/// Runs `ex`'s queued writes in order until the queue closes. What a write leaves to
/// finish (waiting for the other executors) runs beside the queue, not in it.
pub async fn run(ex: Rc<Executor>, queue: LocalReceiver<Queued>) {
    while let Some(queued) = queue.recv().await {
        match queued {
            Queued::Home { write, reply } => answer(reply, home_write(ex.clone(), write).await),
            Queued::Apply { update, tally } => {
                apply_here(&ex, &update).await;
                tally.applied();
            }
            Queued::Other(work) => work.await,
        }
    }
}

/// Expires the placements of the workers homed here.
pub async fn expire(ex: Rc<Executor>) -> Written<Result<(), Failure>> {
    let mut u = Update::new();
    let now = ex.now_ms();
    ex.core().expire(now, &mut u);
    Written {
        result: Ok(()),
        acks: publish(&ex, u).await,
    }
}

/// Nothing: due once every write queued before it is done.
pub async fn flush(_: Rc<Executor>) -> Written<Result<(), Failure>> {
    Written::now(Ok(()))
}

/// This executor's snapshot part, taken in its queue (so no write of its workers is
/// half in it), its runs in slices.
pub async fn export(ex: Rc<Executor>) -> Written<Result<Part, Failure>> {
    let me = ex.me();
    let home = |w: WorkerId| ex.home_of(w) == me;
    let mut part = Part {
        feeds: ex.core().export_feeds(ex.now_ms()),
        runs: Vec::new(),
        ingest_states: ex.ingest_states().export(),
    };
    let mut cursor = 0;
    while !ex
        .core()
        .index()
        .export_some(&mut cursor, SLICE_BLOCKS * 8, home, &mut part.runs)
    {
        slice_done(&ex).await;
    }
    Written::now(Ok(part))
}
