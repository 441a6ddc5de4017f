//! A write record (what the write-ahead log and the replicated log hold) applied on this
//! server through the same calls a client's write takes. The write is queued on its
//! executor before this returns; the future answers once it is applied everywhere.

use std::rc::Rc;

use kvix_wire::{codec, AlignedVec, Announced, Applied, ErrorCode, EventBatch, Placement};

use crate::calls;
use crate::executor::Executor;
use crate::failure::Failure;
use crate::mesh::LocalFuture;
use crate::wal::Record;

/// What a write gives back to the client that sent it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    Announced(Announced),
    Applied(Applied),
    Done,
}

fn aligned(body: Vec<u8>) -> AlignedVec {
    let mut v = AlignedVec::with_capacity(body.len());
    v.extend_from_slice(&body);
    v
}

fn bad(what: &str) -> LocalFuture<Result<Outcome, Failure>> {
    let f = Failure::new(
        ErrorCode::BadFrame,
        format!("a logged {what} that does not validate"),
    );
    Box::pin(std::future::ready(Err(f)))
}

/// Applies `record` on this server.
pub fn record(ex: &Rc<Executor>, record: Record) -> LocalFuture<Result<Outcome, Failure>> {
    match record {
        Record::Announce {
            name,
            lanes,
            feed,
            source,
        } => {
            let done = ex.on(
                0,
                calls::register::Register {
                    name,
                    lanes,
                    feed,
                    source,
                    logged: true,
                },
            );
            Box::pin(async move { Ok(Outcome::Announced(done.await??)) })
        }
        Record::Retire { worker } => {
            let done = ex.on(0, calls::retire::Retire { worker });
            Box::pin(async move {
                done.await??;
                Ok(Outcome::Done)
            })
        }
        Record::Events { body } => {
            let body = aligned(body);
            let Ok(b) = codec::access::<EventBatch>(&body) else {
                return bad("event batch");
            };
            let home = ex.home_of(b.worker.to_native());
            let done = ex.on(home, calls::events::Events { body });
            Box::pin(async move { Ok(Outcome::Applied(done.await??)) })
        }
        Record::Place { body } => {
            let body = aligned(body);
            let Ok(p) = codec::access::<Placement>(&body) else {
                return bad("placement");
            };
            let home = ex.home_of(p.worker.to_native());
            let done = ex.on(home, calls::place::Place { body });
            Box::pin(async move {
                done.await??;
                Ok(Outcome::Done)
            })
        }
        r @ Record::Ingest { .. } => {
            let Some(job) = crate::ingest::holders::from_record(r) else {
                return bad("ingest delivery");
            };
            let home = ex.home_of(job.worker);
            let done = ex.on(home, calls::redeliver::Redeliver { job });
            Box::pin(async move {
                done.await?;
                Ok(Outcome::Done)
            })
        }
    }
}

/// The outcome of one applied write as the reply frame its client waits for.
pub fn reply_frame(id: u64, outcome: Result<Outcome, Failure>) -> AlignedVec {
    use crate::handler::{failure_frame, frame};
    match outcome {
        Ok(Outcome::Announced(a)) => frame(id, &a),
        Ok(Outcome::Applied(a)) => frame(id, &a),
        Ok(Outcome::Done) => frame(id, &kvix_wire::Ack {}),
        Err(f) => failure_frame(id, f),
    }
}
